//! The answer of one endpoint call: a leaf that the engine and every actor
//! share, so that no actor depends on the engine.

use protocol::error::{ErrorCode, ProtocolError};

/// A complete HTTP answer: status, canonical JSON body, optional `Retry-After`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    pub retry_after: Option<u32>,
    /// The error code of a non-200 answer, for counting (`/metrics`).
    pub code: Option<ErrorCode>,
}

impl Reply {
    /// A 200 reply with a canonical body.
    pub fn ok(body: Vec<u8>) -> Reply {
        Reply {
            status: 200,
            body,
            retry_after: None,
            code: None,
        }
    }

    /// The error envelope of `e`.
    pub fn error(e: &ProtocolError) -> Reply {
        Reply {
            status: e.status(),
            body: e.to_body(),
            retry_after: e.retry_after(),
            code: Some(e.code()),
        }
    }
}

impl From<Result<Vec<u8>, ProtocolError>> for Reply {
    fn from(r: Result<Vec<u8>, ProtocolError>) -> Reply {
        match r {
            Ok(body) => Reply::ok(body),
            Err(e) => Reply::error(&e),
        }
    }
}
