//! One pull page, as ADR 003 constructs it, over candidates already read
//! at a fixed boundary B. Pure: the pull actor reads, this decides.
//!
//! 1. Per scope, the effects after its cursor and through B are
//!    deduplicated by (table, typed key), keeping the greatest position;
//!    every earlier effect of that key is covered by the retained one. The
//!    store does this (`StoreTx::scope_candidates`), and hands over at most
//!    one more candidate than the limit: no page can take more.
//! 2. Only then does the global limit apply, through a k-way merge of the
//!    per-scope candidate streams by (position, scope, table, key): each
//!    page takes the least remaining candidates, so no scope starves another.
//! 3. A scope whose candidates were all taken is accounted through B. A
//!    scope the limit cut gets a cursor at the last candidate the page took
//!    (none when it took none): everything up to there was delivered or is
//!    covered by a candidate still ahead, and no candidate is passed.
//!
//! The page depends only on the candidates, never on the superseded effects
//! behind them, so removing a superseded effect changes no page: the
//! materializer deletes them as it supersedes them (docs/adr/0024).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use protocol::ids::ScopeId;
use protocol::position::{Boundary, StreamPosition};

use crate::capture::Effect;

/// One incrementally valid scope's retained candidates after `after` and
/// through the page's boundary, in strictly increasing position order.
#[derive(Clone, Copy, Debug)]
pub struct ScopeEffects<'a> {
    pub scope: &'a ScopeId,
    /// The position of the cursor the client presented.
    pub after: StreamPosition,
    /// All of the scope's candidates when `complete`; otherwise the first
    /// ones, more than the page's limit.
    pub candidates: &'a [Effect],
    pub complete: bool,
}

impl<'a> ScopeEffects<'a> {
    /// How many candidates to read for a page of `limit`: one more than any
    /// page can take from one scope, so a shorter list is all of them.
    pub fn to_read(limit: usize) -> usize {
        limit + 1
    }

    /// A scope's candidates as read with [`ScopeEffects::to_read`].
    pub fn read(
        scope: &'a ScopeId,
        after: StreamPosition,
        candidates: &'a [Effect],
        limit: usize,
    ) -> ScopeEffects<'a> {
        ScopeEffects {
            scope,
            after,
            candidates,
            complete: candidates.len() < ScopeEffects::to_read(limit),
        }
    }
}

/// The decisions of one page.
#[derive(Debug, PartialEq)]
pub struct Page<'a> {
    /// The selected candidates in merge order: the page's changes.
    pub changes: Vec<&'a Effect>,
    /// The new cursor of each scope that progressed: at the boundary when
    /// all its candidates were taken, else at the last one taken.
    pub cursors: BTreeMap<ScopeId, StreamPosition>,
    /// Some scope still has a candidate that was not taken.
    pub has_more: bool,
}

/// The order of the merge (ADR 003 "Deterministic, starvation-free merge").
/// `operation_rank` would break a tie only between two effects of one scope
/// at one position, which the stores' keys forbid.
type MergeKey<'a> = (StreamPosition, &'a [u8], &'a [u8], &'a [u8]);

fn merge_key<'a>(scope: &'a ScopeId, e: &'a Effect) -> MergeKey<'a> {
    (
        e.position(),
        scope.as_str().as_bytes(),
        e.table_id.as_bytes(),
        e.identity.as_bytes(),
    )
}

/// Builds the page of at most `limit` changes over `scopes` at `boundary`.
pub fn build<'a>(scopes: &[ScopeEffects<'a>], boundary: Boundary, limit: usize) -> Page<'a> {
    let end = StreamPosition::from(boundary);
    for s in scopes {
        assert!(s.after <= end, "a cursor never passes the boundary");
        assert!(
            s.candidates
                .windows(2)
                .all(|w| w[0].position() < w[1].position()),
            "candidates arrive in strictly increasing position order"
        );
        assert!(
            s.candidates
                .iter()
                .all(|e| e.position() > s.after && e.position() <= end && e.scope == *s.scope),
            "only the scope's effects in (cursor, boundary] are eligible"
        );
        assert!(
            s.complete || s.candidates.len() > limit,
            "an incomplete candidate list is longer than any page"
        );
    }
    // The k-way merge: a heap of each stream's next candidate.
    let mut taken = vec![0usize; scopes.len()];
    let mut heads: BinaryHeap<Reverse<(MergeKey<'a>, usize)>> = BinaryHeap::new();
    for (i, s) in scopes.iter().enumerate() {
        if let Some(e) = s.candidates.first() {
            heads.push(Reverse((merge_key(s.scope, e), i)));
        }
    }
    let mut changes = Vec::with_capacity(limit.min(heads.len() * 4));
    while changes.len() < limit {
        let Some(Reverse((_, i))) = heads.pop() else {
            break;
        };
        let s = &scopes[i];
        changes.push(&s.candidates[taken[i]]);
        taken[i] += 1;
        if let Some(e) = s.candidates.get(taken[i]) {
            heads.push(Reverse((merge_key(s.scope, e), i)));
        }
    }
    let has_more = !heads.is_empty();
    let mut cursors = BTreeMap::new();
    let mut cut = 0;
    for (i, s) in scopes.iter().enumerate() {
        let cursor = match s.candidates.get(taken[i]) {
            // Fully accounted through the boundary.
            None => {
                assert!(
                    s.complete,
                    "a scope is accounted only when all of it was read"
                );
                Some(end)
            }
            // Cut by the limit: through its last taken candidate, if any.
            Some(next) => {
                cut += 1;
                let last = taken[i].checked_sub(1).map(|t| s.candidates[t].position());
                assert!(
                    last.is_none_or(|p| p < next.position()),
                    "a cursor never passes a candidate"
                );
                last
            }
        };
        if let Some(p) = cursor {
            assert!(p > s.after || p == end, "progress only moves forward");
            cursors.insert(s.scope.clone(), p);
        }
    }
    assert!(changes.len() <= limit, "a page never exceeds its limit");
    assert_eq!(
        has_more,
        cut > 0,
        "more remains exactly where a scope was cut"
    );
    Page {
        changes,
        cursors,
        has_more,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;
    use protocol::json::Value;
    use protocol::value::TypedValue;

    use super::*;
    use crate::capture::EffectOp;
    use protocol::digest::RowIdentity;

    /// A scope's raw effects in (cursor, boundary], as the store holds them.
    #[derive(Clone, Copy)]
    struct Raw<'a> {
        scope: &'a ScopeId,
        after: StreamPosition,
        effects: &'a [Effect],
    }

    /// A page with every cursor resolved, its changes pointing into the raw effects.
    struct RawPage<'a> {
        changes: Vec<&'a Effect>,
        cursors: BTreeMap<ScopeId, StreamPosition>,
        has_more: bool,
    }

    /// What the store's `scope_candidates` returns: each row's last effect.
    fn retained(effects: &[Effect]) -> Vec<Effect> {
        let mut last: BTreeMap<(&str, &RowIdentity), StreamPosition> = BTreeMap::new();
        for e in effects {
            last.insert((e.table_id.as_str(), &e.identity), e.position());
        }
        effects
            .iter()
            .filter(|e| last[&(e.table_id.as_str(), &e.identity)] == e.position())
            .cloned()
            .collect()
    }

    /// `build` as the pull actor drives it: at most `limit + 1` candidates
    /// per scope.
    fn build_raw<'a>(raw: &[Raw<'a>], boundary: Boundary, limit: usize) -> RawPage<'a> {
        let lists: Vec<Vec<Effect>> = raw
            .iter()
            .map(|r| {
                let all = retained(r.effects);
                all.into_iter().take(ScopeEffects::to_read(limit)).collect()
            })
            .collect();
        let scopes: Vec<ScopeEffects<'_>> = raw
            .iter()
            .zip(&lists)
            .map(|(r, l)| ScopeEffects::read(r.scope, r.after, l, limit))
            .collect();
        let page = build(&scopes, boundary, limit);
        let cursors = page.cursors.clone();
        let changes = page
            .changes
            .iter()
            .map(|e| {
                raw.iter()
                    .flat_map(|r| r.effects)
                    .find(|x| x.scope == e.scope && x.position() == e.position())
                    .unwrap()
            })
            .collect();
        RawPage {
            changes,
            cursors,
            has_more: page.has_more,
        }
    }

    fn scope(s: &str) -> ScopeId {
        ScopeId::parse(s).unwrap()
    }

    /// An effect of `key` in `scope` at (lsn, event, effect); the op's
    /// content does not matter to the page.
    fn effect(s: &str, key: i32, lsn: u64, event: u64, ord: u64) -> Effect {
        Effect {
            scope: scope(s),
            commit_lsn: lsn,
            event_ordinal: event,
            effect_ordinal: ord,
            table_id: "t".into(),
            identity: RowIdentity::new("t", "id", &TypedValue::Int(key)),
            key: Value::int(i64::from(key)),
            op: EffectOp::Remove(protocol::ids::ServerVersion::parse("v").unwrap()),
        }
    }

    fn at(lsn: u64, event: u64, ord: u64) -> StreamPosition {
        StreamPosition::Effect {
            commit_lsn: lsn,
            event_ordinal: event,
            effect_ordinal: ord,
        }
    }

    #[test]
    fn dedup_keeps_the_greatest_and_the_cursor_stops_before_what_is_left() {
        let a = scope("a");
        let effects = [
            effect("a", 1, 10, 0, 0),
            effect("a", 2, 10, 1, 0),
            effect("a", 1, 20, 0, 0), // retains key 1
            effect("a", 3, 30, 0, 0),
        ];
        let s = [Raw {
            scope: &a,
            after: StreamPosition::GenerationStart,
            effects: &effects,
        }];
        let b = Boundary::TransactionEnd { commit_lsn: 30 };
        let page = build_raw(&s, b, 1);
        // Candidates by position: key 2 @10.1, key 1 @20, key 3 @30.
        assert_eq!(page.changes, [&effects[1]]);
        assert!(page.has_more);
        // Through the last candidate taken: 10.1. The suppressed 10.0 is
        // behind the cursor, covered by 20 still ahead.
        assert_eq!(page.cursors[&a], at(10, 1, 0));
        let page = build_raw(&s, b, 2);
        assert_eq!(page.changes, [&effects[1], &effects[2]]);
        assert_eq!(page.cursors[&a], at(20, 0, 0));
        let page = build_raw(&s, b, 3);
        assert!(!page.has_more);
        assert_eq!(page.cursors[&a], StreamPosition::from(b));
    }

    #[test]
    fn a_busy_scope_does_not_hide_an_older_change() {
        let (a, z) = (scope("a"), scope("z"));
        let busy: Vec<Effect> = (0..50)
            .map(|i| effect("a", i, 100 + i as u64, 0, 0))
            .collect();
        let old = [effect("z", 7, 5, 0, 0)];
        let s = [
            Raw {
                scope: &a,
                after: StreamPosition::GenerationStart,
                effects: &busy,
            },
            Raw {
                scope: &z,
                after: StreamPosition::GenerationStart,
                effects: &old,
            },
        ];
        let page = build_raw(&s, Boundary::TransactionEnd { commit_lsn: 200 }, 1);
        assert_eq!(page.changes, [&old[0]], "the least position first");
        assert_eq!(
            page.cursors[&z],
            StreamPosition::TransactionEnd { commit_lsn: 200 }
        );
        assert!(
            !page.cursors.contains_key(&a),
            "a gets nothing it could not take"
        );
    }

    #[test]
    fn a_terminal_page_accounts_every_scope_through_the_boundary() {
        let (a, b) = (scope("a"), scope("b"));
        let b_start = at(3, 0, 0);
        let s = [
            Raw {
                scope: &a,
                after: StreamPosition::GenerationStart,
                effects: &[],
            },
            Raw {
                scope: &b,
                after: b_start,
                effects: &[],
            },
        ];
        let end = Boundary::TransactionEnd { commit_lsn: 9 };
        let page = build_raw(&s, end, 10);
        assert!(!page.has_more && page.changes.is_empty());
        assert_eq!(page.cursors.len(), 2);
        assert!(
            page.cursors
                .values()
                .all(|c| *c == StreamPosition::from(end))
        );
    }

    /// A client's view of one scope: the position of the last effect it
    /// applied per key.
    type Held = BTreeMap<(ScopeId, Vec<u8>), StreamPosition>;

    /// Checks one page against the model, independently of `build`:
    /// the limit, starvation-freedom, and that no cursor passes an effect
    /// that was neither delivered nor covered by a candidate still ahead.
    fn check(scopes: &[Raw<'_>], page: &RawPage<'_>, limit: usize) -> Result<(), String> {
        if page.changes.len() > limit {
            return Err("over the limit".into());
        }
        let delivered: BTreeSet<(&str, StreamPosition)> = page
            .changes
            .iter()
            .map(|e| (e.scope.as_str(), e.position()))
            .collect();
        for s in scopes {
            let Some(cursor) = page.cursors.get(s.scope) else {
                continue;
            };
            for (i, e) in s.effects.iter().enumerate() {
                if e.position() > *cursor {
                    continue;
                }
                let later = s.effects[i + 1..]
                    .iter()
                    .filter(|l| l.table_id == e.table_id && l.identity == e.identity)
                    .map(Effect::position)
                    .max();
                let covered_ahead = later.is_some_and(|l| l > *cursor);
                let covered_delivered =
                    later.is_some_and(|l| delivered.contains(&(s.scope.as_str(), l)));
                if !(delivered.contains(&(s.scope.as_str(), e.position()))
                    || covered_ahead
                    || covered_delivered)
                {
                    return Err(format!("{} passed an undelivered effect", s.scope));
                }
            }
        }
        Ok(())
    }

    proptest! {
        /// Random effects in three scopes, pulled to the end with a random
        /// limit while more commit between pulls: every page passes the
        /// check, equals the page built once superseded effects are
        /// deleted, and the client ends holding each key's last effect.
        #[test]
        fn pulling_to_the_end_delivers_every_last_effect(
            commits in proptest::collection::vec(
                proptest::collection::vec((0..3usize, 0..6i32), 1..6), 1..12),
            limit in 1..5usize,
            pulls_between in 1..3usize,
        ) {
            let names = [scope("s0"), scope("s1"), scope("s2")];
            let mut all: Vec<Vec<Effect>> = vec![Vec::new(); 3];
            let mut cursor = [StreamPosition::GenerationStart; 3];
            let mut held: Held = BTreeMap::new();
            let mut boundary = Boundary::GenerationStart;
            for (c, events) in commits.iter().enumerate() {
                let lsn = (c as u64 + 1) * 10;
                let mut ordinal = [0u64; 3];
                for (event, (s, key)) in events.iter().enumerate() {
                    all[*s].push(effect(names[*s].as_str(), *key, lsn, event as u64, ordinal[*s]));
                    ordinal[*s] += 1;
                }
                boundary = Boundary::TransactionEnd { commit_lsn: lsn };
                for _ in 0..pulls_between {
                    pull_once(&names, &all, &mut cursor, &mut held, boundary, limit)?;
                }
            }
            // Then pull until a terminal page (bounded: each page takes one or more).
            let total: usize = all.iter().map(Vec::len).sum();
            let mut terminal = false;
            for _ in 0..=total {
                if !pull_once(&names, &all, &mut cursor, &mut held, boundary, limit)? {
                    terminal = true;
                    break;
                }
            }
            prop_assert!(terminal, "no terminal page");
            let mut want: Held = BTreeMap::new();
            for (s, effects) in all.iter().enumerate() {
                for e in effects {
                    want.insert((names[s].clone(), e.identity.as_bytes().to_vec()), e.position());
                }
            }
            prop_assert_eq!(held, want);
            for c in cursor {
                prop_assert_eq!(c, StreamPosition::from(boundary));
            }
        }
    }

    /// One pull at `boundary`; applies it; `Ok(has_more)`.
    fn pull_once(
        names: &[ScopeId; 3],
        all: &[Vec<Effect>],
        cursor: &mut [StreamPosition; 3],
        held: &mut Held,
        boundary: Boundary,
        limit: usize,
    ) -> Result<bool, TestCaseError> {
        let end = StreamPosition::from(boundary);
        let eligible: Vec<Vec<Effect>> = (0..3)
            .map(|s| {
                all[s]
                    .iter()
                    .filter(|e| e.position() > cursor[s] && e.position() <= end)
                    .cloned()
                    .collect()
            })
            .collect();
        let scopes: Vec<Raw<'_>> = (0..3)
            .map(|s| Raw {
                scope: &names[s],
                after: cursor[s],
                effects: &eligible[s],
            })
            .collect();
        let page = build_raw(&scopes, boundary, limit);
        check(&scopes, &page, limit).map_err(TestCaseError::fail)?;
        // What the store holds once every superseded effect is deleted:
        // the same page, cursor for cursor.
        let compacted: Vec<Vec<Effect>> = (0..3)
            .map(|s| {
                let through: Vec<Effect> = all[s]
                    .iter()
                    .filter(|e| e.position() <= end)
                    .cloned()
                    .collect();
                retained(&through)
                    .into_iter()
                    .filter(|e| e.position() > cursor[s])
                    .collect()
            })
            .collect();
        let lean: Vec<Raw<'_>> = (0..3)
            .map(|s| Raw {
                scope: &names[s],
                after: cursor[s],
                effects: &compacted[s],
            })
            .collect();
        let after_compaction = build_raw(&lean, boundary, limit);
        let at = |p: &RawPage<'_>| -> Vec<(ScopeId, StreamPosition)> {
            p.changes
                .iter()
                .map(|e| (e.scope.clone(), e.position()))
                .collect()
        };
        prop_assert_eq!(
            at(&after_compaction),
            at(&page),
            "compaction changed the changes"
        );
        prop_assert_eq!(
            &after_compaction.cursors,
            &page.cursors,
            "compaction moved a cursor"
        );
        prop_assert_eq!(after_compaction.has_more, page.has_more);
        for e in &page.changes {
            held.insert(
                (e.scope.clone(), e.identity.as_bytes().to_vec()),
                e.position(),
            );
        }
        for (s, name) in names.iter().enumerate() {
            if let Some(c) = page.cursors.get(name) {
                prop_assert!(*c >= cursor[s], "a cursor moved back");
                cursor[s] = *c;
            }
        }
        Ok(page.has_more)
    }

    /// The check is not vacuous: a cursor one position too far, past a
    /// candidate that was not delivered, is caught.
    #[test]
    fn the_check_catches_a_cursor_one_position_too_far() {
        let a = scope("a");
        let effects = [effect("a", 1, 10, 0, 0), effect("a", 2, 20, 0, 0)];
        let s = [Raw {
            scope: &a,
            after: StreamPosition::GenerationStart,
            effects: &effects,
        }];
        let mut page = build_raw(&s, Boundary::TransactionEnd { commit_lsn: 20 }, 1);
        assert_eq!(check(&s, &page, 1), Ok(()));
        page.cursors.insert(a.clone(), at(20, 0, 0));
        assert!(check(&s, &page, 1).is_err());
        // And a dropped change.
        let mut page = build_raw(&s, Boundary::TransactionEnd { commit_lsn: 20 }, 2);
        page.changes.pop();
        assert!(check(&s, &page, 2).is_err());
    }
}
