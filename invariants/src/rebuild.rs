//! Rebuild, judged from the client's side (wire spec "Rebuild", ADR 003).
//!
//! The invariants over a run:
//! - [`PageLog`]: a session's pages never change: every 200 answer to one
//!   exact rebuild request is the same bytes;
//! - every row of the staged scope is delivered exactly once per session,
//!   and the final checksum is that of exactly the rows delivered: checked
//!   by `pull::Replica::apply_rebuild` (records in strictly increasing
//!   row-identity order across the attempt's pages, each verified, and the
//!   recomputed scope checksum before the final cursor is installed);
//! - the handoff loses nothing: after rebuild and pull, every copy equals
//!   the server's (`pull::check_converged`).

use std::collections::BTreeMap;

/// Every 200 rebuild page a client received, by the exact request.
#[derive(Clone, Debug, Default)]
pub struct PageLog {
    pages: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl PageLog {
    /// Records `page` as the answer to `request`: an error when an earlier
    /// answer to the same request differs.
    pub fn record(&mut self, request: &[u8], page: &[u8]) -> Result<(), String> {
        match self.pages.get(request) {
            Some(earlier) if earlier.as_slice() != page => {
                Err("a rebuild page changed on replay".into())
            }
            Some(_) => Ok(()),
            None => {
                self.pages.insert(request.to_vec(), page.to_vec());
                Ok(())
            }
        }
    }

    /// How many distinct requests were answered.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page was recorded.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_that_changes_on_replay_is_caught() {
        let mut log = PageLog::default();
        assert!(log.record(b"first", b"page").is_ok());
        assert!(log.record(b"first", b"page").is_ok());
        assert!(log.record(b"second", b"other").is_ok());
        assert!(log.record(b"first", b"changed").is_err());
        assert_eq!(log.len(), 2);
    }
}
