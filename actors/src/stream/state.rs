//! The stream's durable lineage as a store holds it: a leaf, which the
//! store's contract names without importing the logic that reads it.

use protocol::position::StreamPosition;

/// The durable lineage of the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamState {
    /// Created with the stream; only a stream reset changes it.
    pub generation: u64,
    /// Changes when the retained history is cut other than by ordinary
    /// floor movement.
    pub retention_generation: u64,
    /// Effects before the floor may be compacted away: a cursor below it is stale.
    pub floor: StreamPosition,
}

impl Default for StreamState {
    fn default() -> StreamState {
        StreamState {
            generation: 1,
            retention_generation: 1,
            floor: StreamPosition::GenerationStart,
        }
    }
}

/// A client's acknowledged position in one scope: advanced only by a pull
/// that presents a valid cursor, and never backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub stream_generation: u64,
    pub position: StreamPosition,
}

/// One table's scope rules from `generation` on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipRules {
    pub table_id: String,
    pub generation: u64,
    /// Canonical JSON of the table's rules, to tell a change.
    pub fingerprint: String,
    /// The scope templates the rules render (the scopes they can place rows in).
    pub templates: Vec<String>,
}
