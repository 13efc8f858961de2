//! Push fingerprints (INTEGRITY.md "Push fingerprints"): what makes two
//! batches, or two mutations, the same request for exact replay.

use crate::digest::Digest;
use crate::json::{self, Value};
use crate::manifest::SchemaRef;
use crate::wire::push::{Mutation, PushRequest};

fn s(text: impl Into<String>) -> Value {
    Value::String(text.into())
}

/// `[decimal(version), hash]`.
fn schema_ref(r: &SchemaRef) -> Value {
    Value::Array(vec![s(r.version.to_string()), s(r.hash.to_hex())])
}

/// The `mutation` preimage array.
fn mutation(m: &Mutation) -> Value {
    let base = match m.op.base_version() {
        None => Value::Array(vec![Value::int(0)]),
        Some(b) => Value::Array(vec![Value::int(1), s(b.as_str())]),
    };
    // A BTreeMap iterates in field-ID byte order, the order the preimage requires.
    let columns = match m.op.columns() {
        None => Value::Array(vec![Value::int(0)]),
        Some(c) => {
            let pairs = c
                .iter()
                .map(|(k, v)| Value::Array(vec![s(k.clone()), v.clone()]));
            Value::Array(vec![Value::int(1), Value::Array(pairs.collect())])
        }
    };
    Value::Array(vec![
        s("mutation-v1"),
        s(m.mutation_id.to_string()),
        s(m.table.clone()),
        Value::Array(vec![s(m.pk.field_id.clone()), m.pk.value.clone()]),
        schema_ref(&m.authored_schema),
        s(m.op.name()),
        base,
        s(m.client_version.clone()),
        columns,
    ])
}

/// The batch fingerprint of `request` sent by `client_id` of `user_id`.
pub fn batch_fingerprint(user_id: &str, client_id: &str, request: &PushRequest) -> Digest {
    let tag = if request.atomic {
        "atomic-batch-v1"
    } else {
        "batch-v1"
    };
    let batch = Value::Array(vec![
        s(tag),
        s(user_id),
        s(client_id),
        s(request.client_generation.to_string()),
        s(request.batch_id.to_string()),
        schema_ref(&request.schema),
        Value::Array(request.mutations.iter().map(mutation).collect()),
    ]);
    Digest::of(
        "synchro:v3:push-batch-fingerprint:v1",
        &json::to_canonical(&batch),
    )
}

/// The mutation fingerprint: independent of the enclosing batch, generation and request schema.
pub fn mutation_fingerprint(user_id: &str, client_id: &str, m: &Mutation) -> Digest {
    let scoped = Value::Array(vec![
        s("mutation-scope-v1"),
        s(user_id),
        s(client_id),
        mutation(m),
    ]);
    Digest::of(
        "synchro:v3:push-mutation-fingerprint:v1",
        &json::to_canonical(&scoped),
    )
}
