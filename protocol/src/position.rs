//! Stream positions (ADR 003 "Stream position and common terms").
//!
//! Within one stream generation: `generation_start` precedes everything;
//! effects order by (commit_lsn, event_ordinal, effect_ordinal); the
//! `transaction_end` of an LSN follows every effect at that LSN and precedes
//! every later LSN. Positions of different generations are not comparable,
//! so the generation is not part of this type.

use std::cmp::Ordering;

/// A point in one stream generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamPosition {
    GenerationStart,
    Effect {
        commit_lsn: u64,
        event_ordinal: u64,
        effect_ordinal: u64,
    },
    TransactionEnd {
        commit_lsn: u64,
    },
}

impl StreamPosition {
    /// A total-order key: (started?, lsn, end-of-transaction?, event, effect).
    fn key(&self) -> (u8, u64, u8, u64, u64) {
        match *self {
            StreamPosition::GenerationStart => (0, 0, 0, 0, 0),
            StreamPosition::Effect {
                commit_lsn,
                event_ordinal,
                effect_ordinal,
            } => (1, commit_lsn, 0, event_ordinal, effect_ordinal),
            StreamPosition::TransactionEnd { commit_lsn } => (1, commit_lsn, 1, 0, 0),
        }
    }

    /// The boundary kind, if this is a boundary (not an effect).
    pub fn as_boundary(&self) -> Option<Boundary> {
        match *self {
            StreamPosition::GenerationStart => Some(Boundary::GenerationStart),
            StreamPosition::TransactionEnd { commit_lsn } => {
                Some(Boundary::TransactionEnd { commit_lsn })
            }
            StreamPosition::Effect { .. } => None,
        }
    }
}

impl Ord for StreamPosition {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

impl PartialOrd for StreamPosition {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A materialization boundary: where a pull page or rebuild snapshot is fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Boundary {
    GenerationStart,
    TransactionEnd { commit_lsn: u64 },
}

impl From<Boundary> for StreamPosition {
    fn from(b: Boundary) -> StreamPosition {
        match b {
            Boundary::GenerationStart => StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn } => {
                StreamPosition::TransactionEnd { commit_lsn }
            }
        }
    }
}

impl PartialOrd for Boundary {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Boundary {
    fn cmp(&self, other: &Self) -> Ordering {
        StreamPosition::from(*self).cmp(&StreamPosition::from(*other))
    }
}

#[cfg(test)]
mod tests {
    use super::StreamPosition::*;
    use super::*;

    #[test]
    fn the_order_of_positions() {
        let ordered = [
            GenerationStart,
            TransactionEnd { commit_lsn: 0 },
            Effect {
                commit_lsn: 5,
                event_ordinal: 0,
                effect_ordinal: 0,
            },
            Effect {
                commit_lsn: 5,
                event_ordinal: 0,
                effect_ordinal: 1,
            },
            Effect {
                commit_lsn: 5,
                event_ordinal: 1,
                effect_ordinal: 0,
            },
            Effect {
                commit_lsn: 5,
                event_ordinal: u64::MAX,
                effect_ordinal: u64::MAX,
            },
            TransactionEnd { commit_lsn: 5 },
            Effect {
                commit_lsn: 6,
                event_ordinal: 0,
                effect_ordinal: 0,
            },
            TransactionEnd { commit_lsn: 6 },
            TransactionEnd {
                commit_lsn: u64::MAX,
            },
        ];
        for (i, a) in ordered.iter().enumerate() {
            for (j, b) in ordered.iter().enumerate() {
                assert_eq!(a.cmp(b), i.cmp(&j), "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn boundaries_are_positions() {
        assert!(Boundary::GenerationStart < Boundary::TransactionEnd { commit_lsn: 0 });
        let b = Boundary::TransactionEnd { commit_lsn: 9 };
        assert_eq!(StreamPosition::from(b).as_boundary(), Some(b));
        assert_eq!(
            Effect {
                commit_lsn: 1,
                event_ordinal: 0,
                effect_ordinal: 0
            }
            .as_boundary(),
            None
        );
    }
}
