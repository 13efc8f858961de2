//! Row-digest and scope-digest throughput against plain SHA-256 over the
//! same preimage bytes (the target: within 1.5x of plain SHA-256).
//! Run: `cargo bench -p protocol --bench digest`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use protocol::digest::{Digest, RowDigester, RowIdentity, ScopeDigest};
use protocol::ids::ServerVersion;
use protocol::json;
use protocol::manifest::{
    Composition, FieldManifest, Lifecycle, Manifest, TableManifest, TransitionClass,
};
use protocol::value::{FieldType, PortableType, encode_field};
use sha2::{Digest as _, Sha256};
use std::hint::black_box;

/// A table with `n` string fields besides the key.
fn table(n: usize) -> Manifest {
    let mut fields = vec![
        FieldManifest::new(
            "id",
            "id",
            FieldType::new(PortableType::String, false),
            false,
        )
        .unwrap(),
    ];
    for i in 0..n {
        fields.push(
            FieldManifest::new(
                format!("fld_{i:02}"),
                "f",
                FieldType::new(PortableType::String, true),
                true,
            )
            .unwrap(),
        );
    }
    let t = TableManifest::new(
        "tbl",
        "rel",
        "t",
        Composition::MultiScope,
        "id",
        Lifecycle::default(),
        fields,
    )
    .unwrap();
    Manifest::new(1, None, TransitionClass::Initial, 1, vec![t]).unwrap()
}

fn row_json(n: usize, value_len: usize, key: usize) -> json::Value {
    let mut o = json::Object::new();
    o.insert("id".into(), json::Value::string(format!("row-{key:08}")));
    for i in 0..n {
        o.insert(
            format!("fld_{i:02}"),
            json::Value::string("x".repeat(value_len)),
        );
    }
    json::Value::Object(o)
}

/// The exact bytes the row digest hashes, built once, for the plain-SHA baseline.
fn preimage(
    m: &Manifest,
    identity: &RowIdentity,
    row: &protocol::manifest::Row,
    version: &ServerVersion,
) -> Vec<u8> {
    let t = &m.tables()[0];
    let mut body = (t.fields().len() as u32).to_be_bytes().to_vec();
    for (f, v) in t.fields().iter().zip(row.values()) {
        body.extend_from_slice(&(f.field_id().len() as u64).to_be_bytes());
        body.extend_from_slice(f.field_id().as_bytes());
        encode_field(f.field_type().ty, v.as_ref(), &mut body);
    }
    let mut p = b"synchro:v3:row-digest:v1\0".to_vec();
    p.extend_from_slice(&m.hash().0);
    p.extend_from_slice(&(identity.as_bytes().len() as u64).to_be_bytes());
    p.extend_from_slice(identity.as_bytes());
    p.extend_from_slice(&(body.len() as u64).to_be_bytes());
    p.extend_from_slice(&body);
    p.extend_from_slice(&(version.as_str().len() as u64).to_be_bytes());
    p.extend_from_slice(version.as_str().as_bytes());
    p
}

fn rows(c: &mut Criterion) {
    let mut g = c.benchmark_group("row_digest");
    // (fields, bytes per value): a small row like the spec's, a typical one, a wide one.
    for (n, len) in [(3, 12), (12, 40), (40, 200)] {
        let m = table(n);
        let t = &m.tables()[0];
        let row = t
            .decode_row(row_json(n, len, 1).as_object().unwrap())
            .unwrap();
        let identity = RowIdentity::of(t, t.row_key(&row).unwrap());
        let version = ServerVersion::parse("0123456789abcdef0123456789abcdef").unwrap();
        let pre = preimage(&m, &identity, &row, &version);
        let mut d = RowDigester::default();
        assert_eq!(
            d.digest(&m.hash(), t, &identity, &row, &version).0,
            <[u8; 32]>::from(Sha256::digest(&pre)),
            "the baseline hashes exactly the digest's bytes"
        );
        g.throughput(Throughput::Bytes(pre.len() as u64));
        let label = format!("{n}x{len}B ({} B preimage)", pre.len());
        g.bench_with_input(BenchmarkId::new("synchro", &label), &(), |b, _| {
            b.iter(|| black_box(d.digest(&m.hash(), t, &identity, &row, &version)))
        });
        g.bench_with_input(BenchmarkId::new("plain_sha256", &label), &(), |b, _| {
            b.iter(|| black_box(Sha256::digest(black_box(&pre))))
        });
    }
    g.finish();
}

fn scopes(c: &mut Criterion) {
    let mut g = c.benchmark_group("scope_digest");
    let m = table(3);
    let t = &m.tables()[0];
    let n = 10_000u64;
    let mut entries: Vec<(RowIdentity, Digest)> = (0..n as usize)
        .map(|k| {
            let row = t
                .decode_row(row_json(3, 12, k).as_object().unwrap())
                .unwrap();
            (
                RowIdentity::of(t, t.row_key(&row).unwrap()),
                Digest([k as u8; 32]),
            )
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut pre = b"synchro:v3:scope-digest:v1\0".to_vec();
    pre.extend_from_slice(&m.hash().0);
    pre.extend_from_slice(&5u64.to_be_bytes());
    pre.extend_from_slice(b"scope");
    pre.extend_from_slice(&n.to_be_bytes());
    for (id, d) in &entries {
        pre.extend_from_slice(&(id.as_bytes().len() as u64).to_be_bytes());
        pre.extend_from_slice(id.as_bytes());
        pre.extend_from_slice(&d.0);
    }
    let streamed = {
        let mut s = ScopeDigest::new(&m.hash(), "scope", n);
        entries.iter().for_each(|(id, d)| s.push(id, d));
        s.finish().unwrap()
    };
    assert_eq!(
        streamed.0,
        <[u8; 32]>::from(Sha256::digest(&pre)),
        "the baseline hashes exactly the digest's bytes"
    );
    g.throughput(Throughput::Bytes(pre.len() as u64));
    g.bench_function("synchro/10000 rows", |b| {
        b.iter(|| {
            let mut s = ScopeDigest::new(&m.hash(), "scope", n);
            for (id, d) in &entries {
                s.push(id, d);
            }
            black_box(s.finish())
        })
    });
    g.bench_function("plain_sha256/10000 rows", |b| {
        b.iter(|| black_box(Sha256::digest(black_box(&pre))))
    });
    g.finish();
}

criterion_group!(benches, rows, scopes);
criterion_main!(benches);
