//! Admission and rebuild-staging invariants (issue 24), judged from the
//! answers each user saw and the sessions the store holds:
//!
//! - no answer is a `500`;
//! - admission is fair: a user that stays within its own share is never
//!   answered `429`, whatever another user does (`check_fair`);
//! - at most one rebuild session lives per client and scope, and a user's
//!   live sessions stage at most its budget of rows, unless it has only
//!   one (`check_sessions`);
//! - a user binds at most its cap of new client IDs (`check_registrations`).

use std::collections::{BTreeMap, BTreeSet};

/// One answer as its user saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub user: String,
    /// `connect`, `pull`, `push` or `rebuild`.
    pub endpoint: &'static str,
    pub status: u16,
    /// When the answer arrived (microseconds): the request was admitted
    /// before, by at most the time an answer takes.
    pub at_micros: i64,
}

/// A rebuild session live in the store at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveSession {
    pub client_id: String,
    pub user_id: String,
    pub scope: String,
    pub rows: u64,
}

/// No 500 for anyone, and no 429 for a user in `within_share`.
pub fn check_fair(answers: &[Answer], within_share: &BTreeSet<String>) -> Result<(), Vec<String>> {
    let violations: Vec<String> = answers
        .iter()
        .filter(|a| a.status == 500 || (a.status == 429 && within_share.contains(&a.user)))
        .map(|a| format!("{} answered {} on {}", a.user, a.status, a.endpoint))
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// Page requests (pull and rebuild) answered 200 for `user` stay within its
/// rate: in any span of answers, at most `burst` plus `per_second` for
/// each second of it, the span widened by `slack` for the time an answer
/// takes after its admission.
pub fn check_rate(
    answers: &[Answer],
    user: &str,
    per_second: u64,
    burst: u64,
    slack_micros: i64,
) -> Result<(), Vec<String>> {
    let mut served: Vec<i64> = answers
        .iter()
        .filter(|a| a.user == user && a.status == 200 && matches!(a.endpoint, "pull" | "rebuild"))
        .map(|a| a.at_micros)
        .collect();
    served.sort_unstable();
    for (i, first) in served.iter().enumerate() {
        for (n, last) in served[i..].iter().enumerate() {
            let span = (last - first + slack_micros).max(0) as u128;
            let allowed = u128::from(burst) + span * u128::from(per_second) / 1_000_000;
            let count = (n + 1) as u128;
            if count > allowed {
                return Err(vec![format!(
                    "{user} was served {count} pages in {span} µs, past {per_second}/s with a burst of {burst}"
                )]);
            }
        }
    }
    Ok(())
}

/// At most one live session per client and scope; each user's live
/// sessions within `rows_per_user` rows unless the user has just one.
pub fn check_sessions(live: &[LiveSession], rows_per_user: u64) -> Result<(), Vec<String>> {
    let mut violations = Vec::new();
    let mut per_client_scope: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut per_user: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for s in live {
        *per_client_scope
            .entry((&s.client_id, &s.scope))
            .or_default() += 1;
        let u = per_user.entry(&s.user_id).or_default();
        u.0 += 1;
        u.1 += s.rows;
    }
    for ((client, scope), n) in per_client_scope {
        if n > 1 {
            violations.push(format!("{client} holds {n} live sessions of {scope}"));
        }
    }
    for (user, (sessions, rows)) in per_user {
        if sessions > 1 && rows > rows_per_user {
            violations.push(format!(
                "{user}'s {sessions} live sessions stage {rows} rows, past its {rows_per_user}"
            ));
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// Each user bound at most `cap` client IDs (a run shorter than the
/// cap's hour). `bound` is every bound client's user.
pub fn check_registrations(bound: &[String], cap: u64) -> Result<(), Vec<String>> {
    let mut per_user: BTreeMap<&str, u64> = BTreeMap::new();
    for u in bound {
        *per_user.entry(u).or_default() += 1;
    }
    let violations: Vec<String> = per_user
        .into_iter()
        .filter(|(_, n)| *n > cap)
        .map(|(u, n)| format!("{u} bound {n} client IDs, past its {cap}"))
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(client: &str, user: &str, scope: &str, rows: u64) -> LiveSession {
        LiveSession {
            client_id: client.into(),
            user_id: user.into(),
            scope: scope.into(),
            rows,
        }
    }

    #[test]
    fn each_check_catches_its_violation() {
        let calm: BTreeSet<String> = ["calm".to_owned()].into();
        let a = |user: &str, status| Answer {
            user: user.into(),
            endpoint: "pull",
            status,
            at_micros: 0,
        };
        assert!(check_fair(&[a("calm", 200), a("flood", 429)], &calm).is_ok());
        assert!(check_fair(&[a("calm", 429)], &calm).is_err());
        assert!(check_fair(&[a("flood", 500)], &calm).is_err());
        let one = [session("c", "u", "s", 50)];
        assert!(
            check_sessions(&one, 10).is_ok(),
            "a lone stage may be of any size"
        );
        let two = [session("c", "u", "s", 5), session("c", "u", "s", 1)];
        assert!(
            check_sessions(&two, 10).is_err(),
            "two of one client and scope"
        );
        let over = [session("c", "u", "s", 6), session("d", "u", "s", 6)];
        assert!(check_sessions(&over, 10).is_err(), "past the budget");
        let at = |at_micros| Answer {
            user: "u".into(),
            endpoint: "pull",
            status: 200,
            at_micros,
        };
        let paced: Vec<Answer> = (0..10).map(|i| at(i * 500_000)).collect();
        assert!(check_rate(&paced, "u", 2, 1, 0).is_ok(), "2 a second");
        assert!(check_rate(&paced, "u", 1, 1, 0).is_err(), "past 1 a second");
        assert!(check_registrations(&["u".into(), "u".into()], 2).is_ok());
        assert!(check_registrations(&["u".into(), "u".into(), "u".into()], 2).is_err());
    }
}
