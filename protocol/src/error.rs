//! The complete status and code table of the wire spec ("Error and HTTP
//! dispatch"), as one type whose variants carry exactly the extra members
//! each code requires.

use std::borrow::Cow;
use std::fmt;

use crate::json::{self, Value, object};
use crate::limits::{MAX_ERROR_MESSAGE_OCTETS, RETRY_AFTER_SECONDS};
use crate::manifest::SchemaRef;

/// Every error code of protocol version 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidRequest,
    InvalidSchemaReference,
    AuthRequired,
    IdempotencyConflict,
    ClientRetired,
    ClientGenerationExpired,
    RebuildRestartRequired,
    SchemaMismatch,
    UpgradeRequired,
    RetryLater,
    SyncIntegrityFailure,
    CapturePending,
    TemporaryUnavailable,
}

impl ErrorCode {
    /// All codes, in the order of the spec's table.
    pub const ALL: [ErrorCode; 13] = [
        ErrorCode::InvalidRequest,
        ErrorCode::InvalidSchemaReference,
        ErrorCode::AuthRequired,
        ErrorCode::IdempotencyConflict,
        ErrorCode::ClientRetired,
        ErrorCode::ClientGenerationExpired,
        ErrorCode::RebuildRestartRequired,
        ErrorCode::SchemaMismatch,
        ErrorCode::UpgradeRequired,
        ErrorCode::RetryLater,
        ErrorCode::SyncIntegrityFailure,
        ErrorCode::CapturePending,
        ErrorCode::TemporaryUnavailable,
    ];

    /// The wire code.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::InvalidSchemaReference => "invalid_schema_reference",
            ErrorCode::AuthRequired => "auth_required",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::ClientRetired => "client_retired",
            ErrorCode::ClientGenerationExpired => "client_generation_expired",
            ErrorCode::RebuildRestartRequired => "rebuild_restart_required",
            ErrorCode::SchemaMismatch => "schema_mismatch",
            ErrorCode::UpgradeRequired => "upgrade_required",
            ErrorCode::RetryLater => "retry_later",
            ErrorCode::SyncIntegrityFailure => "sync_integrity_failure",
            ErrorCode::CapturePending => "capture_pending",
            ErrorCode::TemporaryUnavailable => "temporary_unavailable",
        }
    }

    /// The HTTP status of the code.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidSchemaReference => 400,
            ErrorCode::AuthRequired => 401,
            ErrorCode::IdempotencyConflict
            | ErrorCode::ClientRetired
            | ErrorCode::ClientGenerationExpired
            | ErrorCode::RebuildRestartRequired => 409,
            ErrorCode::SchemaMismatch => 422,
            ErrorCode::UpgradeRequired => 426,
            ErrorCode::RetryLater => 429,
            ErrorCode::SyncIntegrityFailure => 500,
            ErrorCode::CapturePending | ErrorCode::TemporaryUnavailable => 503,
        }
    }

    /// Whether a client may retry the same request.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::RetryLater | ErrorCode::CapturePending | ErrorCode::TemporaryUnavailable
        )
    }

    fn default_message(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "the request is not a valid protocol request",
            ErrorCode::InvalidSchemaReference => {
                "the schema reference is neither a normal reference nor the fresh sentinel"
            }
            ErrorCode::AuthRequired => "authentication is required",
            ErrorCode::IdempotencyConflict => {
                "the identity was already used for different request content"
            }
            ErrorCode::ClientRetired => "the client identity was retired",
            ErrorCode::ClientGenerationExpired => "the client generation is not current",
            ErrorCode::RebuildRestartRequired => "the rebuild must restart with a new attempt",
            ErrorCode::SchemaMismatch => "the schema reference is not the current schema",
            ErrorCode::UpgradeRequired => "the client must be upgraded",
            ErrorCode::RetryLater => "the server is busy; retry later",
            ErrorCode::SyncIntegrityFailure => "durable state violates the integrity contract",
            ErrorCode::CapturePending => "accepted writes are awaiting capture",
            ErrorCode::TemporaryUnavailable => "the operation is temporarily unavailable",
        }
    }
}

/// Which compatibility gate sent `426 upgrade_required`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpgradeRequired {
    /// The request's protocol version is not 3.
    Protocol { required: i64, received: i64 },
    /// The client runtime (`app_version`) is below the configured minimum.
    Runtime {
        minimum: semver::Version,
        received: semver::Version,
    },
}

/// The bounded reason carried by `503 temporary_unavailable`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnavailableReason {
    /// WAL capture is blocked (quarantine, TRUNCATE, relation drift).
    CaptureBlocked,
}

/// A protocol error: its code, the code's required members, and a bounded message.
#[derive(Clone, Debug, PartialEq)]
pub struct ProtocolError {
    kind: ErrorKind,
    message: Cow<'static, str>,
}

/// The error code together with the extra members the code requires.
#[derive(Clone, Debug, PartialEq)]
pub enum ErrorKind {
    InvalidRequest,
    /// Carries the reference as received (null when absent or too large to echo).
    InvalidSchemaReference {
        received_schema: Value,
    },
    AuthRequired,
    IdempotencyConflict,
    ClientRetired,
    ClientGenerationExpired {
        current_client_generation: u64,
    },
    RebuildRestartRequired {
        scope_id: String,
    },
    SchemaMismatch {
        current_schema: SchemaRef,
        received_schema: SchemaRef,
    },
    UpgradeRequired(UpgradeRequired),
    RetryLater,
    SyncIntegrityFailure,
    CapturePending,
    TemporaryUnavailable {
        reason: Option<UnavailableReason>,
    },
}

/// The largest received schema value echoed back, in canonical octets.
const MAX_ECHOED_SCHEMA_OCTETS: usize = 256;

impl ProtocolError {
    /// An error of `kind` with the code's default message.
    pub fn new(kind: ErrorKind) -> ProtocolError {
        let message = Cow::Borrowed(kind.code().default_message());
        ProtocolError { kind, message }
    }

    /// Replaces the message, cut to the bound at a character boundary.
    /// Callers pass only text that names no row, identity, credential or token.
    pub fn with_message(mut self, message: impl Into<Cow<'static, str>>) -> ProtocolError {
        let mut message = message.into();
        if message.len() > MAX_ERROR_MESSAGE_OCTETS {
            let mut cut = MAX_ERROR_MESSAGE_OCTETS;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.to_mut().truncate(cut);
        }
        self.message = message;
        self
    }

    /// `400 invalid_request` with a bounded description.
    pub fn invalid_request(message: impl Into<Cow<'static, str>>) -> ProtocolError {
        ProtocolError::new(ErrorKind::InvalidRequest).with_message(message)
    }

    /// `400 invalid_schema_reference`, echoing a small received reference.
    pub fn invalid_schema_reference(received: Option<&Value>) -> ProtocolError {
        let received_schema = match received {
            Some(v) if json::to_canonical(v).len() <= MAX_ECHOED_SCHEMA_OCTETS => v.clone(),
            _ => Value::Null,
        };
        ProtocolError::new(ErrorKind::InvalidSchemaReference { received_schema })
    }

    /// The error's code and required members.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        self.kind.code()
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        self.code().status()
    }

    /// The bounded message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The `Retry-After` header value: delay-seconds for 429 and 503.
    pub fn retry_after(&self) -> Option<u32> {
        matches!(self.status(), 429 | 503).then_some(RETRY_AFTER_SECONDS)
    }

    /// The error envelope `{"error":{code, message, retryable, ...}}`.
    pub fn to_json(&self) -> Value {
        let code = self.code();
        let mut error = json::Object::new();
        error.insert("code".into(), Value::string(code.as_str()));
        error.insert("message".into(), Value::string(self.message.as_ref()));
        error.insert("retryable".into(), Value::Bool(code.retryable()));
        match &self.kind {
            ErrorKind::InvalidSchemaReference { received_schema } => {
                error.insert("received_schema".into(), received_schema.clone());
            }
            ErrorKind::ClientGenerationExpired {
                current_client_generation,
            } => {
                let g = *current_client_generation as i64;
                error.insert("current_client_generation".into(), Value::int(g));
            }
            ErrorKind::RebuildRestartRequired { scope_id } => {
                error.insert("scope_id".into(), Value::string(scope_id.clone()));
            }
            ErrorKind::SchemaMismatch {
                current_schema,
                received_schema,
            } => {
                error.insert("current_schema".into(), current_schema.to_json());
                error.insert("received_schema".into(), received_schema.to_json());
            }
            ErrorKind::UpgradeRequired(UpgradeRequired::Protocol { required, received }) => {
                error.insert("required_protocol_version".into(), Value::int(*required));
                error.insert("received_protocol_version".into(), Value::int(*received));
            }
            ErrorKind::UpgradeRequired(UpgradeRequired::Runtime { minimum, received }) => {
                error.insert(
                    "minimum_client_version".into(),
                    Value::string(minimum.to_string()),
                );
                error.insert(
                    "received_client_version".into(),
                    Value::string(received.to_string()),
                );
            }
            ErrorKind::TemporaryUnavailable {
                reason: Some(UnavailableReason::CaptureBlocked),
            } => {
                error.insert("reason".into(), Value::string("capture_blocked"));
            }
            _ => {}
        }
        object([("error", Value::Object(error))])
    }

    /// The canonical response body.
    pub fn to_body(&self) -> Vec<u8> {
        json::to_canonical(&self.to_json())
    }
}

impl ErrorKind {
    /// The wire code of this kind.
    pub fn code(&self) -> ErrorCode {
        match self {
            ErrorKind::InvalidRequest => ErrorCode::InvalidRequest,
            ErrorKind::InvalidSchemaReference { .. } => ErrorCode::InvalidSchemaReference,
            ErrorKind::AuthRequired => ErrorCode::AuthRequired,
            ErrorKind::IdempotencyConflict => ErrorCode::IdempotencyConflict,
            ErrorKind::ClientRetired => ErrorCode::ClientRetired,
            ErrorKind::ClientGenerationExpired { .. } => ErrorCode::ClientGenerationExpired,
            ErrorKind::RebuildRestartRequired { .. } => ErrorCode::RebuildRestartRequired,
            ErrorKind::SchemaMismatch { .. } => ErrorCode::SchemaMismatch,
            ErrorKind::UpgradeRequired(_) => ErrorCode::UpgradeRequired,
            ErrorKind::RetryLater => ErrorCode::RetryLater,
            ErrorKind::SyncIntegrityFailure => ErrorCode::SyncIntegrityFailure,
            ErrorKind::CapturePending => ErrorCode::CapturePending,
            ErrorKind::TemporaryUnavailable { .. } => ErrorCode::TemporaryUnavailable,
        }
    }
}

impl From<ErrorKind> for ProtocolError {
    fn from(kind: ErrorKind) -> ProtocolError {
        ProtocolError::new(kind)
    }
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status(),
            self.code().as_str(),
            self.message
        )
    }
}

impl std::error::Error for ProtocolError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::Digest;

    fn schema(version: u64, byte: u8) -> SchemaRef {
        SchemaRef {
            version,
            hash: Digest([byte; 32]),
        }
    }

    fn body(e: &ProtocolError) -> String {
        json::to_canonical_string(&e.to_json())
    }

    #[test]
    fn the_status_and_code_table() {
        let table: [(ErrorCode, u16, bool); 13] = [
            (ErrorCode::InvalidRequest, 400, false),
            (ErrorCode::InvalidSchemaReference, 400, false),
            (ErrorCode::AuthRequired, 401, false),
            (ErrorCode::IdempotencyConflict, 409, false),
            (ErrorCode::ClientRetired, 409, false),
            (ErrorCode::ClientGenerationExpired, 409, false),
            (ErrorCode::RebuildRestartRequired, 409, false),
            (ErrorCode::SchemaMismatch, 422, false),
            (ErrorCode::UpgradeRequired, 426, false),
            (ErrorCode::RetryLater, 429, true),
            (ErrorCode::SyncIntegrityFailure, 500, false),
            (ErrorCode::CapturePending, 503, true),
            (ErrorCode::TemporaryUnavailable, 503, true),
        ];
        for (code, status, retryable) in table {
            assert_eq!(code.status(), status, "{}", code.as_str());
            assert_eq!(code.retryable(), retryable, "{}", code.as_str());
        }
        assert_eq!(ErrorCode::ALL.len(), table.len());
    }

    #[test]
    fn plain_codes_have_exactly_three_members() {
        for kind in [
            ErrorKind::InvalidRequest,
            ErrorKind::AuthRequired,
            ErrorKind::IdempotencyConflict,
            ErrorKind::ClientRetired,
            ErrorKind::RetryLater,
            ErrorKind::SyncIntegrityFailure,
            ErrorKind::CapturePending,
            ErrorKind::TemporaryUnavailable { reason: None },
        ] {
            let e = ProtocolError::new(kind);
            let v = e.to_json();
            let inner = v.as_object().unwrap()["error"].as_object().unwrap();
            let names: Vec<_> = inner.keys().map(String::as_str).collect();
            assert_eq!(
                names,
                ["code", "message", "retryable"],
                "{}",
                e.code().as_str()
            );
            assert_eq!(inner["retryable"], Value::Bool(e.code().retryable()));
        }
    }

    #[test]
    fn extra_members_per_code() {
        let e = ProtocolError::new(ErrorKind::CapturePending);
        assert_eq!(
            body(&e),
            r#"{"error":{"code":"capture_pending","message":"accepted writes are awaiting capture","retryable":true}}"#
        );
        assert_eq!(e.retry_after(), Some(5));

        let e = ProtocolError::new(ErrorKind::ClientGenerationExpired {
            current_client_generation: 5,
        });
        assert!(body(&e).contains(r#""current_client_generation":5"#));
        assert_eq!((e.status(), e.retry_after()), (409, None));

        let e = ProtocolError::new(ErrorKind::RebuildRestartRequired {
            scope_id: "s:1".into(),
        });
        assert!(body(&e).contains(r#""scope_id":"s:1""#));

        let e = ProtocolError::new(ErrorKind::SchemaMismatch {
            current_schema: schema(8, 0xab),
            received_schema: schema(7, 0xcd),
        });
        let b = body(&e);
        assert!(b.contains(&format!(
            r#""current_schema":{{"hash":"{}","version":8}}"#,
            "ab".repeat(32)
        )));
        assert!(b.contains(&format!(
            r#""received_schema":{{"hash":"{}","version":7}}"#,
            "cd".repeat(32)
        )));
        assert_eq!(e.status(), 422);

        let e = ProtocolError::new(ErrorKind::UpgradeRequired(UpgradeRequired::Protocol {
            required: 3,
            received: 2,
        }));
        assert!(
            body(&e).contains(r#""received_protocol_version":2,"required_protocol_version":3"#)
        );
        assert_eq!(e.status(), 426);

        let e = ProtocolError::new(ErrorKind::UpgradeRequired(UpgradeRequired::Runtime {
            minimum: semver::Version::new(3, 0, 0),
            received: semver::Version::new(2, 9, 1),
        }));
        assert!(
            body(&e)
                .contains(r#""minimum_client_version":"3.0.0","received_client_version":"2.9.1""#)
        );

        let e = ProtocolError::new(ErrorKind::TemporaryUnavailable {
            reason: Some(UnavailableReason::CaptureBlocked),
        });
        assert!(body(&e).contains(r#""reason":"capture_blocked""#));
        assert_eq!(e.retry_after(), Some(5));
        assert_eq!(
            ProtocolError::new(ErrorKind::RetryLater).retry_after(),
            Some(5)
        );
        assert_eq!(
            ProtocolError::new(ErrorKind::SyncIntegrityFailure).retry_after(),
            None
        );
    }

    #[test]
    fn invalid_schema_reference_echo_is_bounded() {
        let small = json::parse(br#"{"version":0,"hash":"x"}"#).unwrap();
        let e = ProtocolError::invalid_schema_reference(Some(&small));
        assert!(body(&e).contains(r#""received_schema":{"hash":"x","version":0}"#));
        let huge = Value::string("h".repeat(1000));
        let e = ProtocolError::invalid_schema_reference(Some(&huge));
        assert!(body(&e).contains(r#""received_schema":null"#));
        assert!(
            body(&ProtocolError::invalid_schema_reference(None))
                .contains(r#""received_schema":null"#)
        );
    }

    #[test]
    fn messages_are_bounded() {
        let e = ProtocolError::invalid_request("é".repeat(300));
        assert!(e.message().len() <= MAX_ERROR_MESSAGE_OCTETS);
        assert!(e.message().starts_with('é'));
    }
}
