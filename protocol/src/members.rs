//! Exact-object intake: take each declared member once, then reject whatever
//! is left. Errors name only the protocol's own member names, never input.

use std::borrow::Cow;
use std::fmt;

use crate::json::{Object, Value};
use crate::limits::MAX_SAFE_INTEGER;

/// A structural defect of a request object, with a bounded description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError(pub Cow<'static, str>);

impl ShapeError {
    pub(crate) fn member(member: &str, problem: &str) -> ShapeError {
        ShapeError(Cow::Owned(format!("member `{member}` {problem}")))
    }
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// The members of one JSON object, taken one by one.
pub(crate) struct Members {
    map: Object,
    what: &'static str,
}

impl Members {
    /// Starts reading `v`, which must be an object; `what` names it in errors.
    pub(crate) fn new(v: Value, what: &'static str) -> Result<Members, ShapeError> {
        match v {
            Value::Object(map) => Ok(Members { map, what }),
            _ => Err(ShapeError(Cow::Owned(format!(
                "{what} must be a JSON object"
            )))),
        }
    }

    /// Takes a required member (JSON null counts as present).
    pub(crate) fn take(&mut self, name: &'static str) -> Result<Value, ShapeError> {
        self.map
            .remove(name)
            .ok_or_else(|| ShapeError::member(name, "is required"))
    }

    /// Takes an optional member.
    pub(crate) fn take_opt(&mut self, name: &'static str) -> Option<Value> {
        self.map.remove(name)
    }

    /// Fails if any member was not taken.
    pub(crate) fn finish(self) -> Result<(), ShapeError> {
        if self.map.is_empty() {
            Ok(())
        } else {
            Err(ShapeError(Cow::Owned(format!(
                "{} has an unknown member",
                self.what
            ))))
        }
    }
}

/// A string member whose octet length is within `min..=max`.
pub(crate) fn string(
    v: Value,
    member: &'static str,
    min: usize,
    max: usize,
) -> Result<String, ShapeError> {
    match v {
        Value::String(s) if (min..=max).contains(&s.len()) => Ok(s),
        Value::String(_) => Err(ShapeError::member(member, "has an invalid length")),
        _ => Err(ShapeError::member(member, "must be a string")),
    }
}

/// An integer member within `min..=MAX_SAFE_INTEGER`, written without fraction or exponent.
pub(crate) fn integer(v: &Value, member: &'static str, min: u64) -> Result<u64, ShapeError> {
    let Value::Number(n) = v else {
        return Err(ShapeError::member(member, "must be an integer"));
    };
    match n.as_exact_i64() {
        Some(i) if i >= 0 && (i as u64) >= min && (i as u64) <= MAX_SAFE_INTEGER => Ok(i as u64),
        Some(_) => Err(ShapeError::member(member, "is out of range")),
        None => Err(ShapeError::member(member, "must be an integer")),
    }
}

/// A boolean member.
pub(crate) fn boolean(v: &Value, member: &'static str) -> Result<bool, ShapeError> {
    match v {
        Value::Bool(b) => Ok(*b),
        _ => Err(ShapeError::member(member, "must be a boolean")),
    }
}

/// An object member.
pub(crate) fn object(v: Value, member: &'static str) -> Result<Object, ShapeError> {
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ShapeError::member(member, "must be an object")),
    }
}
