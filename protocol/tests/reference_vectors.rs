//! The reference implementation's canonical vectors (`VSET-CANONICAL-001`,
//! transcribed in `../shared/vectors/`, copied to `fixtures/`): every valid
//! vector reproduces byte for byte, and every invalid one is rejected.
//!
//! The fingerprint vectors give a batch or mutation in the reference's own
//! input form (`table_id`, `pk: {field_id, value}`, `operation`, `columns` as
//! an array). They are rewritten member by member into the wire form, kept as
//! text so that a duplicate stays a duplicate, and go through the real push
//! intake before the fingerprint is computed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use protocol::digest::{Digest, RowIdentity, row_digest, scope_digest};
use protocol::fingerprint::{batch_fingerprint, mutation_fingerprint};
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::{self, Object, Value};
use protocol::manifest::Manifest;
use protocol::value::{self, DecimalBounds, FieldType, PortableType};
use protocol::wire::push::PushRequest;

const VECTORS: &str = include_str!("fixtures/reference-canonical-v1.json");

struct Vector {
    id: String,
    kind: String,
    valid: bool,
    input: Object,
    /// `canonical_bytes_hex`, when the vector defines bytes.
    bytes: Option<Vec<u8>>,
    /// `expected_sha256`, for the digest and fingerprint kinds.
    sha256: Option<String>,
}

fn vectors() -> Vec<Vector> {
    let file = json::parse(VECTORS.as_bytes()).unwrap();
    let Value::Array(all) = file.as_object().unwrap()["vectors"].clone() else {
        panic!("vectors is an array");
    };
    all.into_iter()
        .map(|v| {
            let o = v.as_object().unwrap();
            let expected = o["expected"].as_object().unwrap();
            Vector {
                id: o["vector_id"].as_str().unwrap().to_owned(),
                kind: o["kind"].as_str().unwrap().to_owned(),
                valid: o["valid"] == Value::Bool(true),
                input: o["input"].as_object().unwrap().clone(),
                bytes: expected["canonical_bytes_hex"].as_str().map(unhex),
                sha256: expected["expected_sha256"].as_str().map(str::to_owned),
            }
        })
        .collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn text<'a>(o: &'a Object, member: &str) -> &'a str {
    o[member].as_str().unwrap()
}

/// What an accepted vector produced: bytes, a digest, or both.
#[derive(Debug, Default, PartialEq)]
struct Produced {
    bytes: Option<Vec<u8>>,
    sha256: Option<String>,
}

impl Produced {
    fn bytes(b: Vec<u8>) -> Produced {
        Produced {
            bytes: Some(b),
            sha256: None,
        }
    }
    fn digest(d: Digest) -> Produced {
        Produced {
            bytes: None,
            sha256: Some(d.to_hex()),
        }
    }
}

/// Runs one vector through our code; `Err` says where it was rejected.
fn run(v: &Vector) -> Result<Produced, String> {
    match v.kind.as_str() {
        "typed_value" => typed_value(&v.input),
        "row_identity" => row_identity(&v.input).map(|id| Produced::bytes(id.as_bytes().to_vec())),
        "row_digest" => row_digest_of(&v.input).map(Produced::digest),
        "scope_digest" => scope_digest_of(&v.input).map(Produced::digest),
        "schema_manifest" => manifest(text(&v.input, "manifest_json")).map(|m| Produced {
            bytes: None,
            sha256: Some(m.hash().to_hex()),
        }),
        "mutation_fingerprint" => mutation_fingerprint_of(&v.input).map(Produced::digest),
        "batch_fingerprint" => batch_fingerprint_of(&v.input).map(Produced::digest),
        other => panic!("unknown vector kind {other}"),
    }
}

fn typed_value(input: &Object) -> Result<Produced, String> {
    let spec = input["field_spec"].as_object().unwrap();
    let ty = PortableType::from_name(text(spec, "type")).unwrap();
    let bound = |v: &Value| match v {
        Value::Number(n) => u32::try_from(n.as_exact_i64().unwrap()).unwrap(),
        _ => panic!("a decimal bound is a number"),
    };
    let decimal = spec.get("precision").map(|p| DecimalBounds {
        precision: bound(p),
        scale: bound(&spec["scale"]),
    });
    let field = FieldType {
        ty,
        nullable: spec["nullable"] == Value::Bool(true),
        decimal,
    };
    let raw = json::parse(text(input, "raw_json").as_bytes()).map_err(|e| format!("json: {e}"))?;
    let decoded = value::decode(&field, &raw).map_err(|e| format!("value: {e}"))?;
    let mut out = Vec::new();
    value::encode_field(ty, decoded.as_ref(), &mut out);
    Ok(Produced::bytes(out))
}

fn manifest(manifest_json: &str) -> Result<Manifest, String> {
    let v = json::parse(manifest_json.as_bytes()).map_err(|e| format!("json: {e}"))?;
    Manifest::from_json(v).map_err(|e| format!("manifest: {e}"))
}

fn row_identity(input: &Object) -> Result<RowIdentity, String> {
    let m = manifest(text(input, "manifest_json"))?;
    let table = m.table(text(input, "table_id")).ok_or("no such table")?;
    let pk = json::parse(text(input, "pk_json").as_bytes()).map_err(|e| format!("json: {e}"))?;
    let key = value::decode_key(table.primary_key().field_type().ty, &pk)
        .map_err(|e| format!("key: {e}"))?;
    Ok(RowIdentity::of(table, &key))
}

fn row_digest_of(input: &Object) -> Result<Digest, String> {
    let m = manifest(text(input, "manifest_json"))?;
    let table = m.table(text(input, "table_id")).ok_or("no such table")?;
    let identity = row_identity(input)?;
    let row = json::parse(text(input, "row_json").as_bytes()).map_err(|e| format!("json: {e}"))?;
    let row = table
        .decode_row(row.as_object().ok_or("row is not an object")?)
        .map_err(|e| format!("row: {e:?}"))?;
    let key = table.row_key(&row).ok_or("row has no key")?;
    if RowIdentity::of(table, key) != identity {
        return Err("the row's key differs from pk".into());
    }
    let version = ServerVersion::parse(text(input, "server_version")).ok_or("server_version")?;
    Ok(row_digest(&m.hash(), table, &identity, &row, &version))
}

fn scope_digest_of(input: &Object) -> Result<Digest, String> {
    let schema = Digest::from_hex(text(input, "schema_hash")).ok_or("schema_hash")?;
    let scope = ScopeId::parse(text(input, "scope_id")).ok_or("scope_id")?;
    let Value::Array(entries) = &input["entries"] else {
        return Err("entries".into());
    };
    let mut rows = Vec::new();
    for e in entries {
        let e = e.as_object().unwrap();
        let identity = hex_bytes(text(e, "row_identity_hex"))
            .and_then(RowIdentity::parse)
            .ok_or("row identity")?;
        let digest = Digest::from_hex(text(e, "row_digest_hex")).ok_or("row digest")?;
        rows.push((identity, digest));
    }
    scope_digest(&schema, scope.as_str(), &mut rows).map_err(|e| format!("scope: {e:?}"))
}

/// Lowercase hex only, as the vectors' own producer writes it.
fn hex_bytes(s: &str) -> Option<Vec<u8>> {
    let ok = s.len().is_multiple_of(2) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    ok.then(|| unhex(s))
}

/// Writes `name` and the canonical text of `v` as one object member.
fn member(out: &mut Vec<String>, name: &str, v: &str) {
    out.push(format!(
        "{}:{v}",
        json::to_canonical_string(&Value::string(name))
    ));
}

/// A reference-form mutation rewritten as wire text; members the wire does
/// not have are dropped, so their absence is what the intake judges.
fn wire_mutation(m: &Value) -> Result<String, String> {
    let o = m.as_object().ok_or("mutation is not an object")?;
    let canonical = json::to_canonical_string;
    let mut out = Vec::new();
    for (name, v) in o {
        match name.as_str() {
            "table_id" => member(&mut out, "table", &canonical(v)),
            "operation" => member(&mut out, "op", &canonical(v)),
            "pk" => {
                let pk = v.as_object().ok_or("pk")?;
                let inner = format!(
                    "{{{}:{}}}",
                    canonical(&pk["field_id"]),
                    canonical(&pk["value"])
                );
                member(&mut out, "pk", &inner);
            }
            "columns" => match v {
                Value::Array(columns) => {
                    let mut fields = Vec::new();
                    for c in columns {
                        let c = c.as_object().ok_or("column")?;
                        let field_id = c["field_id"].as_str().ok_or("field_id")?;
                        member(&mut fields, field_id, &canonical(&c["value"]));
                    }
                    member(&mut out, "columns", &format!("{{{}}}", fields.join(",")));
                }
                other => member(&mut out, "columns", &canonical(other)),
            },
            _ => member(&mut out, name, &canonical(v)),
        }
    }
    Ok(format!("{{{}}}", out.join(",")))
}

fn mutation_fingerprint_of(input: &Object) -> Result<Digest, String> {
    let source =
        json::parse(text(input, "mutation_json").as_bytes()).map_err(|e| format!("json: {e}"))?;
    let client_id = text(input, "client_id");
    // The batch around it carries nothing the mutation fingerprint covers.
    let schema = r#"{"hash":"a97280b716fe0f8a9553ba7c3b31b00dd03f7c7aacf0ff01a703d73182f3df31","version":1}"#;
    let body = format!(
        r#"{{"batch_id":"00000000-0000-4000-8000-0000000000ff","client_generation":1,"client_id":{},"mutations":[{}],"schema":{schema}}}"#,
        json::to_canonical_string(&Value::string(client_id)),
        wire_mutation(&source)?
    );
    let req = PushRequest::parse(body.as_bytes()).map_err(|e| format!("intake: {e:?}"))?;
    Ok(mutation_fingerprint(
        text(input, "authenticated_user_id"),
        client_id,
        &req.mutations[0],
    ))
}

fn batch_fingerprint_of(input: &Object) -> Result<Digest, String> {
    let source =
        json::parse(text(input, "batch_json").as_bytes()).map_err(|e| format!("json: {e}"))?;
    let o = source.as_object().ok_or("batch is not an object")?;
    let mut out = Vec::new();
    for (name, v) in o {
        match name.as_str() {
            "request_schema" => member(&mut out, "schema", &json::to_canonical_string(v)),
            "mutations" => {
                let Value::Array(ms) = v else {
                    return Err("mutations".into());
                };
                let ms = ms
                    .iter()
                    .map(wire_mutation)
                    .collect::<Result<Vec<_>, _>>()?;
                member(&mut out, "mutations", &format!("[{}]", ms.join(",")));
            }
            _ => member(&mut out, name, &json::to_canonical_string(v)),
        }
    }
    let body = format!("{{{}}}", out.join(","));
    let req = PushRequest::parse(body.as_bytes()).map_err(|e| format!("intake: {e:?}"))?;
    Ok(batch_fingerprint(
        text(input, "authenticated_user_id"),
        &req.client_id,
        &req,
    ))
}

#[test]
fn every_reference_vector_reproduces_or_is_rejected() {
    let all = vectors();
    assert_eq!(all.len(), 120, "the transcription holds 120 vectors");
    let mut failures = Vec::new();
    for v in &all {
        match (v.valid, run(v)) {
            (true, Ok(p)) => {
                if v.bytes.is_some() && p.bytes.is_some() && p.bytes != v.bytes {
                    failures.push(format!("{}: bytes differ", v.id));
                }
                if v.sha256.is_some() && p.sha256.is_some() && p.sha256 != v.sha256 {
                    failures.push(format!("{}: digest differs", v.id));
                }
                if p.bytes.is_some() != v.bytes.is_some() && p.sha256.is_none() {
                    failures.push(format!("{}: nothing comparable was produced", v.id));
                }
            }
            (true, Err(why)) => failures.push(format!("{}: valid but rejected ({why})", v.id)),
            (false, Ok(_)) => failures.push(format!("{}: invalid but accepted", v.id)),
            (false, Err(_)) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_kind_is_covered() {
    let all = vectors();
    for kind in [
        "typed_value",
        "row_identity",
        "row_digest",
        "scope_digest",
        "schema_manifest",
        "mutation_fingerprint",
        "batch_fingerprint",
    ] {
        let of_kind = all.iter().filter(|v| v.kind == kind);
        assert!(
            of_kind.clone().any(|v| v.valid),
            "{kind} has a valid vector"
        );
        assert!(
            of_kind.clone().any(|v| !v.valid),
            "{kind} has an invalid vector"
        );
    }
}

/// The test would pass vacuously if `run` rejected everything: a valid
/// vector with one byte changed must stop reproducing.
#[test]
fn a_changed_expectation_is_caught() {
    let v = vectors()
        .into_iter()
        .find(|v| v.id == "VEC-BATCH-ORDERED-001")
        .unwrap();
    let p = run(&v).unwrap();
    assert_eq!(p.sha256, v.sha256);
    let mut wrong = v.sha256.clone().unwrap();
    wrong.replace_range(0..1, if wrong.starts_with('0') { "1" } else { "0" });
    assert_ne!(p.sha256, Some(wrong));
}
