//! SHA-256 values and the domain-separated hasher every integrity value
//! starts from (INTEGRITY.md "Notation"). A leaf: the manifest hash, row
//! and scope digests, fingerprints and token MACs all build on it.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::json::{Object, Value};

/// A 32-byte SHA-256 value (row digest, scope digest, schema hash, fingerprint).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// SHA-256 of `D(domain) || bytes`.
    pub fn of(domain: &str, bytes: &[u8]) -> Digest {
        let mut h = domain_hasher(domain);
        h.update(bytes);
        Digest(h.finalize().into())
    }

    /// 64 lowercase hexadecimal characters.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        self.write_hex(&mut s);
        s
    }

    fn write_hex(&self, out: &mut String) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for b in self.0 {
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0x0f) as usize] as char);
        }
    }

    /// Parses exactly 64 lowercase hexadecimal characters.
    pub fn from_hex(s: &str) -> Option<Digest> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Digest(out))
    }

    /// The checksum object `{"algorithm":"sha256","version":1,"encoding":"hex","digest":…}`.
    pub fn checksum_json(&self) -> Value {
        crate::json::object([
            ("algorithm", Value::string("sha256")),
            ("version", Value::int(1)),
            ("encoding", Value::string("hex")),
            ("digest", Value::string(self.to_hex())),
        ])
    }

    /// Appends [`Digest::checksum_json`]'s canonical text to `out`.
    pub fn write_checksum(&self, out: &mut String) {
        let mut o = crate::json::ObjectWriter::new(out);
        o.member("algorithm").push_str("\"sha256\"");
        let hex = o.member("digest");
        hex.push('"');
        self.write_hex(hex);
        hex.push('"');
        o.member("encoding").push_str("\"hex\"");
        o.member("version").push('1');
        o.finish();
    }

    /// Reads a checksum object; `None` for any other shape, member set or alphabet.
    pub fn from_checksum_json(v: &Value) -> Option<Digest> {
        let o: &Object = v.as_object()?;
        let exact = o.len() == 4
            && o.get("algorithm")?.as_str()? == "sha256"
            && o.get("encoding")?.as_str()? == "hex"
            && matches!(o.get("version")?, Value::Number(n) if n.as_exact_i64() == Some(1));
        if !exact {
            return None;
        }
        Digest::from_hex(o.get("digest")?.as_str()?)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A hasher that has absorbed `D(domain) = ASCII(domain) || 0x00`.
pub(crate) fn domain_hasher(domain: &str) -> Sha256 {
    let mut h = Sha256::new();
    h.update(domain.as_bytes());
    h.update([0u8]);
    h
}
