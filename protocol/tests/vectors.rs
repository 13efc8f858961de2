//! The wire spec's own example digests and schema hash, recomputed
//! (INTEGRITY.md "Vectors to test against").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use protocol::digest::{Digest, RowIdentity, ScopeDigest, row_digest};
use protocol::ids::ServerVersion;
use protocol::json;
use protocol::manifest::Manifest;

const SCHEMA_HASH: &str = "21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea";

fn manifest() -> Manifest {
    let text = include_str!("fixtures/connect_schema_definition.json");
    Manifest::from_json(json::parse(text.as_bytes()).unwrap()).unwrap()
}

/// Row digest of a `tbl_documents` row given as wire JSON.
fn documents_row_digest(row: &str, version: &str) -> (RowIdentity, Digest) {
    let m = manifest();
    let table = m.table("tbl_documents").unwrap();
    let row = table
        .decode_row(json::parse(row.as_bytes()).unwrap().as_object().unwrap())
        .unwrap();
    let identity = RowIdentity::of(table, table.row_key(&row).unwrap());
    let d = row_digest(
        &m.hash(),
        table,
        &identity,
        &row,
        &ServerVersion::parse(version).unwrap(),
    );
    (identity, d)
}

#[test]
fn connect_example_schema_hash() {
    let m = manifest();
    assert_eq!(m.hash().to_hex(), SCHEMA_HASH);
    // The serialized definition reads back to the same manifest.
    let again = Manifest::from_json(m.to_json()).unwrap();
    assert_eq!(again, m);
}

#[test]
fn a_wrong_stated_schema_hash_is_rejected() {
    let text = include_str!("fixtures/connect_schema_definition.json")
        .replace(SCHEMA_HASH, &"0".repeat(64));
    assert!(Manifest::from_json(json::parse(text.as_bytes()).unwrap()).is_err());
}

#[test]
fn push_example_row_digests() {
    let cases = [
        (
            r#"{"fld_documents_deleted_at":null,"fld_documents_id":"doc-100","fld_documents_title":"Lower Body","fld_documents_updated_at":"2026-07-18T14:00:01.000000Z"}"#,
            "opaque-new-version-100",
            "63c3b7ae6054827a3e0d2ca334f8147ae3da135a4b91338daf5d99e704cd3976",
        ),
        (
            r#"{"fld_documents_deleted_at":null,"fld_documents_id":"doc-101","fld_documents_title":"Upper Body","fld_documents_updated_at":"2026-07-18T14:00:01.000000Z"}"#,
            "opaque-new-version-101",
            "5c67d69839a65937e02ae3d898cd34a5a5cb3793706e248ddb604942edb676b4",
        ),
        (
            r#"{"fld_documents_deleted_at":"2026-07-18T14:00:01.000000Z","fld_documents_id":"doc-102","fld_documents_title":"Archived Plan","fld_documents_updated_at":"2026-07-18T14:00:01.000000Z"}"#,
            "opaque-new-version-102",
            "a7653f643b34a717990175b8e3017488640f833dc4c281079fa34d82e0f11ac5",
        ),
        (
            r#"{"fld_documents_deleted_at":null,"fld_documents_id":"doc-103","fld_documents_title":"Current Plan","fld_documents_updated_at":"2026-07-18T13:58:00.000000Z"}"#,
            "opaque-current-version-103",
            "184ee9357371ae6a66f89c5e51152350d0a2a0a1b4c20e0a7756f89cb2331dd6",
        ),
    ];
    for (row, version, expected) in cases {
        assert_eq!(
            documents_row_digest(row, version).1.to_hex(),
            expected,
            "{version}"
        );
    }
}

#[test]
fn pull_example_row_digest() {
    let row = r#"{"fld_documents_deleted_at":null,"fld_documents_id":"doc-200","fld_documents_title":"Tempo Run","fld_documents_updated_at":"2026-07-18T14:01:00.000000Z"}"#;
    assert_eq!(
        documents_row_digest(row, "opaque-pull-version-200")
            .1
            .to_hex(),
        "6f5d85950d90b017b28373562c0f0a2c538abd1d455aaef86289095cc138fcbb"
    );
}

#[test]
fn rebuild_example_row_and_scope_digest() {
    let row = r#"{"fld_documents_deleted_at":null,"fld_documents_id":"doc-300","fld_documents_title":"Shared Plan","fld_documents_updated_at":"2026-07-18T14:02:00.000000Z"}"#;
    let (identity, d) = documents_row_digest(row, "opaque-rebuild-version-300");
    assert_eq!(
        d.to_hex(),
        "81d1d576ff6bf0614a821e1c423f672f35a05aa1d4b391e8adaa447473949d2a"
    );
    let mut scope = ScopeDigest::new(&manifest().hash(), "documents_shared", 1);
    scope.push(&identity, &d);
    assert_eq!(
        scope.finish().unwrap().to_hex(),
        "25ac19f2bf10bb573ba407d20c254cc2a1a65e5eaaa98f62489b1b4717ebd463"
    );
}
