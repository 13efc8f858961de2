//! The one place where a PostgreSQL error becomes a kind of failure, by
//! SQLSTATE class. A retry must be able to cure what is called operational;
//! an error caused by a request's data is terminal; anything else means
//! the database is not what the server expects.

use actors::ledger::contract::Refusal;
use actors::store::StoreError;

/// What a SQLSTATE says about a failed statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Connection lost (08), transaction rollback such as a serialization
    /// failure or deadlock (40), resources exhausted (53), operator
    /// intervention such as shutdown (57), system error (58), a lock not
    /// available (55P03), a read-only standby (25006).
    Operational,
    /// The value is not valid for its column (22: invalid text, out of
    /// range, too long; 54000: too large to index).
    Data,
    /// A constraint of the application failed (23).
    Constraint,
    /// Row security or a privilege (42501), or an exception raised by a
    /// trigger of the application (P0001).
    Policy,
    /// Anything else: a missing relation or column, a syntax error, an
    /// internal error. Retrying cannot help.
    Unexpected,
}

/// The class of a five-character SQLSTATE.
pub(crate) fn classify(code: &str) -> Class {
    match code {
        "42501" | "P0001" => Class::Policy,
        "55P03" | "25006" => Class::Operational,
        "54000" => Class::Data,
        _ => match code.get(..2) {
            Some("08" | "40" | "53" | "57" | "58") => Class::Operational,
            Some("22") => Class::Data,
            Some("23") => Class::Constraint,
            _ => Class::Unexpected,
        },
    }
}

/// How the source refused a write, for the statements of a push write;
/// `None` when the failure is not the source's answer to this write.
pub(crate) fn refusal(e: &sqlx::Error, pk_constraint: &str) -> Option<Refusal> {
    let sqlx::Error::Database(d) = e else {
        return None;
    };
    let code = d.code()?;
    match classify(&code) {
        Class::Policy => Some(Refusal::Policy),
        Class::Constraint if code == "23505" && d.constraint() == Some(pk_constraint) => {
            Some(Refusal::DuplicateKey)
        }
        Class::Data | Class::Constraint => Some(Refusal::Constraint),
        Class::Operational | Class::Unexpected => None,
    }
}

/// A driver error as a store failure. Messages hold codes, never values.
pub(crate) fn store_error(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(d) => {
            let code = d.code().unwrap_or_default().into_owned();
            match classify(&code) {
                Class::Operational => {
                    StoreError::Unavailable(format!("operational database error {code}"))
                }
                Class::Data | Class::Constraint => {
                    StoreError::Data(format!("the database refused a value ({code})"))
                }
                Class::Policy | Class::Unexpected => {
                    StoreError::Integrity(format!("unexpected database error {code}"))
                }
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => {
            StoreError::Unavailable("database connection failed".into())
        }
        _ => StoreError::Integrity(format!("unexpected database result: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::{Class, classify};

    #[test]
    fn classes() {
        for (code, class) in [
            ("08006", Class::Operational),
            ("40001", Class::Operational),
            ("40P01", Class::Operational),
            ("53300", Class::Operational),
            ("57P01", Class::Operational),
            ("55P03", Class::Operational),
            ("22021", Class::Data),
            ("22003", Class::Data),
            ("22001", Class::Data),
            ("22P02", Class::Data),
            ("54000", Class::Data),
            ("23505", Class::Constraint),
            ("23514", Class::Constraint),
            ("42501", Class::Policy),
            ("P0001", Class::Policy),
            ("42P01", Class::Unexpected),
            ("42703", Class::Unexpected),
            ("XX000", Class::Unexpected),
        ] {
            assert_eq!(classify(code), class, "{code}");
        }
    }
}
