//! Fingerprints, row identities and digests, checked against preimages
//! built independently from INTEGRITY.md.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use protocol::digest::{
    Digest, RowDigester, RowIdentity, ScopeDigest, ScopeDigestError, scope_digest,
};
use protocol::fingerprint::{batch_fingerprint, mutation_fingerprint};
use protocol::ids::ServerVersion;
use protocol::json::{self, Value};
use protocol::manifest::{
    Composition, FieldManifest, Lifecycle, Manifest, TableManifest, TransitionClass,
};
use protocol::value::{DecimalBounds, FieldType, PortableType, TypedValue};
use protocol::wire::push::PushRequest;
use sha2::{Digest as _, Sha256};

const H: &str = "21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea";

fn sha(domain: &str, bytes: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update([0]);
    h.update(bytes);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn request(mutations: &str, atomic: bool) -> PushRequest {
    let atomic = if atomic { r#","atomic":true"# } else { "" };
    let text = format!(
        r#"{{"client_id":"c1","client_generation":4,"batch_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674001",
        "schema":{{"version":8,"hash":"{H}"}},"mutations":[{mutations}]{atomic}}}"#
    );
    PushRequest::parse(text.as_bytes()).unwrap()
}

const INSERT: &str = r#"{"mutation_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674011","table":"t","pk":{"id":"k1"},
  "authored_schema":{"version":8,"hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea"},
  "op":"insert","client_version":"2026-07-18T13:59:01.000000Z","columns":{"z":1.5,"a":null,"j":"{\"x\":1}"}}"#;
const EMPTY_INSERT: &str = r#"{"mutation_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674012","table":"t","pk":{"id":7},
  "authored_schema":{"version":8,"hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea"},
  "op":"insert","client_version":"2026-07-18T13:59:01.000000Z","columns":{}}"#;
const UPDATE: &str = r#"{"mutation_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674013","table":"t","pk":{"id":"k3"},
  "authored_schema":{"version":7,"hash":"fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"},
  "op":"update","base_version":"v-3","client_version":"2026-07-18T13:59:02.000000Z","columns":{"title":"x"}}"#;
const DELETE: &str = r#"{"mutation_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674014","table":"t","pk":{"id":"k4"},
  "authored_schema":{"version":8,"hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea"},
  "op":"delete","base_version":"v-4","client_version":"2026-07-18T13:59:03.000000Z"}"#;

#[test]
fn mutation_fingerprint_preimages_for_every_op_and_presence_form() {
    let r = request(&[INSERT, EMPTY_INSERT, UPDATE, DELETE].join(","), false);
    let expected_mutations = [
        // Columns sorted by field-ID bytes; the float keeps its JCS form; a json value stays its string.
        format!(r#"["mutation-v1","018f2b5e-7c42-7a1d-9d31-8a95bd674011","t",["id","k1"],["8","{H}"],"insert",[0],"2026-07-18T13:59:01.000000Z",[1,[["a",null],["j","{{\"x\":1}}"],["z",1.5]]]]"#),
        // Empty insert columns are present-and-empty, not absent.
        format!(r#"["mutation-v1","018f2b5e-7c42-7a1d-9d31-8a95bd674012","t",["id",7],["8","{H}"],"insert",[0],"2026-07-18T13:59:01.000000Z",[1,[]]]"#),
        r#"["mutation-v1","018f2b5e-7c42-7a1d-9d31-8a95bd674013","t",["id","k3"],["7","fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"],"update",[1,"v-3"],"2026-07-18T13:59:02.000000Z",[1,[["title","x"]]]]"#.to_owned(),
        format!(r#"["mutation-v1","018f2b5e-7c42-7a1d-9d31-8a95bd674014","t",["id","k4"],["8","{H}"],"delete",[1,"v-4"],"2026-07-18T13:59:03.000000Z",[0]]"#),
    ];
    for (m, expected) in r.mutations.iter().zip(&expected_mutations) {
        let scoped = format!(r#"["mutation-scope-v1","user-1","c1",{expected}]"#);
        assert_eq!(
            mutation_fingerprint("user-1", "c1", m).to_hex(),
            sha("synchro:v3:push-mutation-fingerprint:v1", scoped.as_bytes()),
            "{}",
            m.op.name()
        );
    }
    let batch = format!(
        r#"["batch-v1","user-1","c1","4","018f2b5e-7c42-7a1d-9d31-8a95bd674001",["8","{H}"],[{}]]"#,
        expected_mutations.join(",")
    );
    assert_eq!(
        batch_fingerprint("user-1", "c1", &r).to_hex(),
        sha("synchro:v3:push-batch-fingerprint:v1", batch.as_bytes())
    );
}

#[test]
fn atomic_changes_only_the_batch_tag() {
    let plain = request(INSERT, false);
    let atomic = request(INSERT, true);
    let expected = format!(
        r#"["atomic-batch-v1","u","c1","4","018f2b5e-7c42-7a1d-9d31-8a95bd674001",["8","{H}"],[["mutation-v1","018f2b5e-7c42-7a1d-9d31-8a95bd674011","t",["id","k1"],["8","{H}"],"insert",[0],"2026-07-18T13:59:01.000000Z",[1,[["a",null],["j","{{\"x\":1}}"],["z",1.5]]]]]]"#
    );
    assert_eq!(
        batch_fingerprint("u", "c1", &atomic).to_hex(),
        sha("synchro:v3:push-batch-fingerprint:v1", expected.as_bytes())
    );
    assert_ne!(
        batch_fingerprint("u", "c1", &plain),
        batch_fingerprint("u", "c1", &atomic)
    );
    assert_eq!(
        mutation_fingerprint("u", "c1", &plain.mutations[0]),
        mutation_fingerprint("u", "c1", &atomic.mutations[0])
    );
}

#[test]
fn fingerprints_bind_user_client_and_content() {
    let r = request(INSERT, false);
    let m = &r.mutations[0];
    let base = mutation_fingerprint("u", "c1", m);
    assert_ne!(base, mutation_fingerprint("u2", "c1", m));
    assert_ne!(base, mutation_fingerprint("u", "c2", m));
    // Boundaries between fields are unambiguous.
    assert_ne!(
        mutation_fingerprint("ab", "c", m),
        mutation_fingerprint("a", "bc", m)
    );
    // A mutation keeps its fingerprint in a successor batch with another generation.
    let moved = request(INSERT, false);
    let mut moved_generation = moved.clone();
    moved_generation.client_generation = 5;
    assert_eq!(
        base,
        mutation_fingerprint("u", "c1", &moved_generation.mutations[0])
    );
    assert_ne!(
        batch_fingerprint("u", "c1", &moved),
        batch_fingerprint("u", "c1", &moved_generation)
    );
    // A string key and an int key with the same digits differ.
    let int_key = request(&INSERT.replace(r#"{"id":"k1"}"#, r#"{"id":1}"#), false);
    let str_key = request(&INSERT.replace(r#"{"id":"k1"}"#, r#"{"id":"1"}"#), false);
    assert_ne!(
        mutation_fingerprint("u", "c1", &int_key.mutations[0]),
        mutation_fingerprint("u", "c1", &str_key.mutations[0])
    );
    // An absent column and a null column differ.
    let with_null = request(
        &INSERT.replace(r#""a":null,"#, r#""a":null,"b":null,"#),
        false,
    );
    assert_ne!(
        base,
        mutation_fingerprint("u", "c1", &with_null.mutations[0])
    );
}

fn key(ty: PortableType, v: &str) -> TypedValue {
    protocol::value::decode_key(ty, &json::parse(v.as_bytes()).unwrap()).unwrap()
}

#[test]
fn row_identity_bytes_and_order() {
    let id = RowIdentity::new("t", "id", &TypedValue::Int(1));
    let mut expected = b"synchro:v3:row-identity:v1\0".to_vec();
    expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, b't']);
    expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 2, b'i', b'd']);
    expected.extend_from_slice(&[0x02, 0x01, 0, 0, 0, 1]);
    assert_eq!(id.as_bytes(), expected);
    // Two's complement big-endian: negative ints sort after positive ones.
    let ids: Vec<_> = ["0", "1", "2147483647", "-2147483648", "-1"]
        .iter()
        .map(|v| RowIdentity::new("t", "id", &key(PortableType::Int, v)))
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    let ids: Vec<_> = [
        r#""0""#,
        r#""9223372036854775807""#,
        r#""-9223372036854775808""#,
        r#""-1""#,
    ]
    .iter()
    .map(|v| RowIdentity::new("t", "id", &key(PortableType::Int64, v)))
    .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    // Length prefixes: a short table ID sorts before a longer one, whatever its letters.
    let short = RowIdentity::new("z", "id", &TypedValue::String("a".into()));
    let long = RowIdentity::new("aa", "id", &TypedValue::String("a".into()));
    assert!(short < long);
    // Type tags keep "1" and 1 apart.
    assert_ne!(
        RowIdentity::new("t", "id", &TypedValue::String("1".into())),
        RowIdentity::new("t", "id", &TypedValue::Int(1))
    );
}

/// A table with one field of every type, all nullable but the key.
fn every_type_manifest() -> Manifest {
    let mut fields = vec![
        FieldManifest::new(
            "id",
            "id",
            FieldType::new(PortableType::Int64, false),
            false,
        )
        .unwrap(),
    ];
    for ty in PortableType::ALL {
        let decimal = (ty == PortableType::Decimal).then_some(DecimalBounds {
            precision: 10,
            scale: 3,
        });
        let ft = FieldType {
            ty,
            nullable: true,
            decimal,
        };
        fields.push(FieldManifest::new(format!("f_{}", ty.name()), ty.name(), ft, true).unwrap());
    }
    let table = TableManifest::new(
        "t_all",
        "r_all",
        "all",
        Composition::SingleScope,
        "id",
        Lifecycle::default(),
        fields,
    )
    .unwrap();
    Manifest::new(1, None, TransitionClass::Initial, 1, vec![table]).unwrap()
}

#[test]
fn row_digest_preimage_for_every_type_and_null() {
    let m = every_type_manifest();
    let t = m.table("t_all").unwrap();
    let full = r#"{"id":"-5","f_string":"s","f_int":-2,"f_int64":"9","f_decimal":"1.5","f_float":0.5,"f_boolean":false,
      "f_datetime":"2026-07-18T14:00:00.000000Z","f_date":"2026-07-18","f_time":"14:00:00.000000","f_json":"[1]","f_bytes":"AQ"}"#;
    let nulls = r#"{"id":"-5","f_string":null,"f_int":null,"f_int64":null,"f_decimal":null,"f_float":null,"f_boolean":null,
      "f_datetime":null,"f_date":null,"f_time":null,"f_json":null,"f_bytes":null}"#;
    let version = ServerVersion::parse("v1").unwrap();
    let mut digests = Vec::new();
    for text in [full, nulls] {
        let row = t
            .decode_row(json::parse(text.as_bytes()).unwrap().as_object().unwrap())
            .unwrap();
        let identity = RowIdentity::of(t, t.row_key(&row).unwrap());
        // Build the preimage by hand from INTEGRITY.md.
        let mut body = (t.fields().len() as u32).to_be_bytes().to_vec();
        for (f, v) in t.fields().iter().zip(row.values()) {
            body.extend_from_slice(&(f.field_id().len() as u64).to_be_bytes());
            body.extend_from_slice(f.field_id().as_bytes());
            protocol::value::encode_field(f.field_type().ty, v.as_ref(), &mut body);
        }
        let mut pre = m.hash().0.to_vec();
        pre.extend_from_slice(&(identity.as_bytes().len() as u64).to_be_bytes());
        pre.extend_from_slice(identity.as_bytes());
        pre.extend_from_slice(&(body.len() as u64).to_be_bytes());
        pre.extend_from_slice(&body);
        pre.extend_from_slice(&2u64.to_be_bytes());
        pre.extend_from_slice(b"v1");
        let d = RowDigester::default().digest(&m.hash(), t, &identity, &row, &version);
        assert_eq!(d.to_hex(), sha("synchro:v3:row-digest:v1", &pre));
        // The row's wire form decodes back to the same row.
        assert_eq!(
            t.decode_row(t.row_to_json(&row).as_object().unwrap())
                .unwrap(),
            row
        );
        digests.push(d);
    }
    assert_ne!(digests[0], digests[1]);
    // The server version is covered.
    let row = t
        .decode_row(json::parse(nulls.as_bytes()).unwrap().as_object().unwrap())
        .unwrap();
    let identity = RowIdentity::of(t, t.row_key(&row).unwrap());
    let other = RowDigester::default().digest(
        &m.hash(),
        t,
        &identity,
        &row,
        &ServerVersion::parse("v2").unwrap(),
    );
    assert_ne!(other, digests[1]);
}

#[test]
fn rows_must_be_complete_and_exact() {
    let m = every_type_manifest();
    let t = m.table("t_all").unwrap();
    let parse = |s: &str| json::parse(s.as_bytes()).unwrap();
    assert!(
        t.decode_row(parse(r#"{"id":"1"}"#).as_object().unwrap())
            .is_err()
    );
    let mut o = t.row_to_json(&t.decode_row(parse(r#"{"id":"1","f_string":null,"f_int":null,"f_int64":null,"f_decimal":null,"f_float":null,"f_boolean":null,"f_datetime":null,"f_date":null,"f_time":null,"f_json":null,"f_bytes":null}"#).as_object().unwrap()).unwrap());
    if let Value::Object(map) = &mut o {
        map.insert("extra".into(), Value::Null);
    }
    assert!(t.decode_row(o.as_object().unwrap()).is_err());
}

#[test]
fn scope_digest_streaming_rules() {
    let hash = Digest([1; 32]);
    let a = RowIdentity::new("t", "id", &TypedValue::Int(1));
    let b = RowIdentity::new("t", "id", &TypedValue::Int(2));
    let (da, db) = (Digest([2; 32]), Digest([3; 32]));
    let mut s = ScopeDigest::new(&hash, "s", 2);
    s.push(&a, &da);
    s.push(&b, &db);
    let streamed = s.finish().unwrap();
    // Preimage by hand.
    let mut pre = hash.0.to_vec();
    pre.extend_from_slice(&1u64.to_be_bytes());
    pre.push(b's');
    pre.extend_from_slice(&2u64.to_be_bytes());
    for (id, d) in [(&a, &da), (&b, &db)] {
        pre.extend_from_slice(&(id.as_bytes().len() as u64).to_be_bytes());
        pre.extend_from_slice(id.as_bytes());
        pre.extend_from_slice(&d.0);
    }
    assert_eq!(streamed.to_hex(), sha("synchro:v3:scope-digest:v1", &pre));
    // Order-independent entry point agrees.
    assert_eq!(
        scope_digest(&hash, "s", &mut [(b.clone(), db), (a.clone(), da)]),
        Ok(streamed)
    );
    // Out of order, duplicates and wrong cardinality are errors.
    let mut s = ScopeDigest::new(&hash, "s", 2);
    s.push(&b, &db);
    s.push(&a, &da);
    assert_eq!(s.finish(), Err(ScopeDigestError::OutOfOrder));
    assert_eq!(
        scope_digest(&hash, "s", &mut [(a.clone(), da), (a.clone(), da)]),
        Err(ScopeDigestError::OutOfOrder)
    );
    let mut s = ScopeDigest::new(&hash, "s", 3);
    s.push(&a, &da);
    assert_eq!(
        s.finish(),
        Err(ScopeDigestError::CardinalityMismatch {
            declared: 3,
            seen: 1
        })
    );
    // The empty scope has a digest too.
    assert!(ScopeDigest::new(&hash, "s", 0).finish().is_ok());
}

#[test]
fn checksum_object_shape_is_exact() {
    let d = Digest([0xab; 32]);
    let v = d.checksum_json();
    assert_eq!(
        json::to_canonical_string(&v),
        format!(
            r#"{{"algorithm":"sha256","digest":"{}","encoding":"hex","version":1}}"#,
            "ab".repeat(32)
        )
    );
    assert_eq!(Digest::from_checksum_json(&v), Some(d));
    let hex = "ab".repeat(32);
    for bad in [
        format!(r#"{{"algorithm":"sha-256","version":1,"encoding":"hex","digest":"{hex}"}}"#),
        format!(r#"{{"algorithm":"sha256","version":2,"encoding":"hex","digest":"{hex}"}}"#),
        format!(r#"{{"algorithm":"sha256","version":1.0,"encoding":"hex","digest":"{hex}"}}"#),
        format!(r#"{{"algorithm":"sha256","version":1,"encoding":"base64","digest":"{hex}"}}"#),
        format!(
            r#"{{"algorithm":"sha256","version":1,"encoding":"hex","digest":"{}"}}"#,
            "AB".repeat(32)
        ),
        format!(
            r#"{{"algorithm":"sha256","version":1,"encoding":"hex","digest":"{}"}}"#,
            "ab".repeat(31)
        ),
        format!(r#"{{"algorithm":"sha256","version":1,"encoding":"hex","digest":"{hex}","x":1}}"#),
        r#"{"algorithm":"sha256","version":1,"encoding":"hex"}"#.to_owned(),
        r#""abab""#.to_owned(),
    ] {
        assert_eq!(
            Digest::from_checksum_json(&json::parse(bad.as_bytes()).unwrap()),
            None,
            "{bad}"
        );
    }
}

#[test]
fn manifest_rules() {
    let key =
        |nullable, ty| FieldManifest::new("id", "id", FieldType::new(ty, nullable), false).unwrap();
    let table = |f: FieldManifest| {
        TableManifest::new(
            "t",
            "r",
            "t",
            Composition::SingleScope,
            "id",
            Lifecycle::default(),
            vec![f],
        )
    };
    assert!(table(key(true, PortableType::String)).is_err());
    assert!(table(key(false, PortableType::Float)).is_err());
    assert!(table(key(false, PortableType::Int)).is_ok());
    assert!(
        TableManifest::new(
            "t",
            "r",
            "t",
            Composition::SingleScope,
            "missing",
            Lifecycle::default(),
            vec![key(false, PortableType::Int)]
        )
        .is_err()
    );
    let lifecycle = Lifecycle {
        deleted_at_field_id: Some("gone".into()),
        ..Lifecycle::default()
    };
    assert!(
        TableManifest::new(
            "t",
            "r",
            "t",
            Composition::SingleScope,
            "id",
            lifecycle,
            vec![key(false, PortableType::Int)]
        )
        .is_err()
    );
    assert!(
        FieldManifest::new("d", "d", FieldType::new(PortableType::Decimal, true), true).is_err()
    );
    let t = table(key(false, PortableType::Int)).unwrap();
    assert!(Manifest::new(1, None, TransitionClass::Class2, 1, vec![t.clone()]).is_err());
    assert!(Manifest::new(2, None, TransitionClass::Initial, 3, vec![t.clone()]).is_err());
    assert!(
        Manifest::new(
            1,
            None,
            TransitionClass::Initial,
            1,
            vec![t.clone(), t.clone()]
        )
        .is_err()
    );
    // Table and field order do not change the hash; any content change does.
    let a = Manifest::new(1, None, TransitionClass::Initial, 1, vec![t.clone()]).unwrap();
    let renamed = TableManifest::new(
        "t",
        "r",
        "t2",
        Composition::SingleScope,
        "id",
        Lifecycle::default(),
        vec![key(false, PortableType::Int)],
    )
    .unwrap();
    assert_ne!(
        a.hash(),
        Manifest::new(1, None, TransitionClass::Initial, 1, vec![renamed])
            .unwrap()
            .hash()
    );
    let child = Manifest::new(2, Some(a.reference()), TransitionClass::Class2, 1, vec![t]).unwrap();
    assert_eq!(child.parent_schema(), Some(a.reference()));
    assert_eq!(Manifest::from_json(child.to_json()).unwrap(), child);
}

#[test]
fn an_identity_gives_back_its_key() {
    for key in [
        TypedValue::String("n-1".into()),
        TypedValue::String(String::new()),
        TypedValue::Int(-7),
        TypedValue::Int64(i64::MAX),
    ] {
        let identity = RowIdentity::new("tbl", "fld_id", &key);
        assert_eq!(identity.key(), Some(("fld_id", key)));
    }
    let mut bytes = RowIdentity::new("tbl", "fld_id", &TypedValue::Int(1))
        .as_bytes()
        .to_vec();
    bytes.push(0);
    assert_eq!(RowIdentity::from_bytes(bytes).key(), None, "trailing bytes");
    assert_eq!(RowIdentity::from_bytes(b"x".to_vec()).key(), None);
}
