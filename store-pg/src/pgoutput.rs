//! Decoding of PostgreSQL's `pgoutput` logical replication messages,
//! protocol version 1 (PostgreSQL docs, "Logical Replication Message
//! Formats"). Both ways of reading a slot deliver these bytes: the streaming
//! replication protocol (inside XLogData) and the SQL functions
//! `pg_logical_slot_{peek,get}_binary_changes` (one message per row).
//!
//! Pure and total: any byte string decodes to a message or an error, never
//! a panic. What the messages mean (transactions, fences, projections) is
//! the materializer's business, not this module's.

use std::fmt;

/// A WAL position.
pub type Lsn = u64;

/// One column of a `Relation` message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelationColumn {
    /// Whether the column is part of the replica identity key.
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// One column value of a tuple.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TupleValue {
    Null,
    /// An unchanged TOASTed value: not sent.
    UnchangedToast,
    /// The value in PostgreSQL's text output format.
    Text(Vec<u8>),
    /// The value in binary format (only with the `binary` option).
    Binary(Vec<u8>),
}

/// A row image.
pub type Tuple = Vec<TupleValue>;

/// One pgoutput message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: Lsn,
        commit_time: i64,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time: i64,
    },
    Origin {
        commit_lsn: Lsn,
        name: String,
    },
    Relation {
        oid: u32,
        namespace: String,
        name: String,
        replica_identity: u8,
        columns: Vec<RelationColumn>,
    },
    Type {
        oid: u32,
        namespace: String,
        name: String,
    },
    Insert {
        oid: u32,
        new: Tuple,
    },
    /// `old` is the replica identity key (`K`) or the full old row (`O`) when sent.
    Update {
        oid: u32,
        old: Option<Tuple>,
        new: Tuple,
    },
    Delete {
        oid: u32,
        old: Tuple,
    },
    Truncate {
        options: u8,
        oids: Vec<u32>,
    },
    /// A `pg_logical_emit_message` record.
    LogicalMessage {
        transactional: bool,
        lsn: Lsn,
        prefix: String,
        content: Vec<u8>,
    },
}

/// Why bytes are not a pgoutput message. Carries no row data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    Truncated,
    UnknownMessage(u8),
    UnknownTupleKind(u8),
    InvalidString,
    TrailingBytes,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated => write!(f, "pgoutput message is truncated"),
            DecodeError::UnknownMessage(b) => write!(f, "unknown pgoutput message type 0x{b:02x}"),
            DecodeError::UnknownTupleKind(b) => write!(f, "unknown tuple data kind 0x{b:02x}"),
            DecodeError::InvalidString => {
                write!(f, "a pgoutput string is not terminated or not UTF-8")
            }
            DecodeError::TrailingBytes => write!(f, "bytes follow the pgoutput message"),
        }
    }
}

impl std::error::Error for DecodeError {}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn i16(&mut self) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn i32(&mut self) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array()?))
    }

    /// A NUL-terminated UTF-8 string.
    fn string(&mut self) -> Result<String, DecodeError> {
        let end = self
            .b
            .iter()
            .position(|&c| c == 0)
            .ok_or(DecodeError::InvalidString)?;
        let s = std::str::from_utf8(&self.b[..end])
            .map_err(|_| DecodeError::InvalidString)?
            .to_owned();
        self.b = &self.b[end + 1..];
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Tuple, DecodeError> {
        let n = self.i16()?;
        let n = usize::try_from(n).map_err(|_| DecodeError::Truncated)?;
        // Each column needs at least one byte: a bound before allocating.
        if n > self.b.len() {
            return Err(DecodeError::Truncated);
        }
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            values.push(match self.u8()? {
                b'n' => TupleValue::Null,
                b'u' => TupleValue::UnchangedToast,
                kind @ (b't' | b'b') => {
                    let len = usize::try_from(self.i32()?).map_err(|_| DecodeError::Truncated)?;
                    let data = self.take(len)?.to_vec();
                    if kind == b't' {
                        TupleValue::Text(data)
                    } else {
                        TupleValue::Binary(data)
                    }
                }
                other => return Err(DecodeError::UnknownTupleKind(other)),
            });
        }
        Ok(values)
    }
}

/// Decodes exactly one message.
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    let mut r = Reader { b: bytes };
    let message = match r.u8()? {
        b'B' => Message::Begin {
            final_lsn: r.u64()?,
            commit_time: r.i64()?,
            xid: r.u32()?,
        },
        b'C' => Message::Commit {
            flags: r.u8()?,
            commit_lsn: r.u64()?,
            end_lsn: r.u64()?,
            commit_time: r.i64()?,
        },
        b'O' => Message::Origin {
            commit_lsn: r.u64()?,
            name: r.string()?,
        },
        b'R' => {
            let (oid, namespace, name, replica_identity) =
                (r.u32()?, r.string()?, r.string()?, r.u8()?);
            let n = usize::try_from(r.i16()?).map_err(|_| DecodeError::Truncated)?;
            if n > r.b.len() {
                return Err(DecodeError::Truncated);
            }
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                let flags = r.u8()?;
                columns.push(RelationColumn {
                    key: flags & 1 == 1,
                    name: r.string()?,
                    type_oid: r.u32()?,
                    type_modifier: r.i32()?,
                });
            }
            Message::Relation {
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            }
        }
        b'Y' => Message::Type {
            oid: r.u32()?,
            namespace: r.string()?,
            name: r.string()?,
        },
        b'I' => {
            let oid = r.u32()?;
            match r.u8()? {
                b'N' => Message::Insert {
                    oid,
                    new: r.tuple()?,
                },
                other => return Err(DecodeError::UnknownTupleKind(other)),
            }
        }
        b'U' => {
            let oid = r.u32()?;
            let (old, new) = match r.u8()? {
                b'K' | b'O' => {
                    let old = r.tuple()?;
                    match r.u8()? {
                        b'N' => (Some(old), r.tuple()?),
                        other => return Err(DecodeError::UnknownTupleKind(other)),
                    }
                }
                b'N' => (None, r.tuple()?),
                other => return Err(DecodeError::UnknownTupleKind(other)),
            };
            Message::Update { oid, old, new }
        }
        b'D' => {
            let oid = r.u32()?;
            match r.u8()? {
                b'K' | b'O' => Message::Delete {
                    oid,
                    old: r.tuple()?,
                },
                other => return Err(DecodeError::UnknownTupleKind(other)),
            }
        }
        b'T' => {
            let n = usize::try_from(r.u32()?).map_err(|_| DecodeError::Truncated)?;
            let options = r.u8()?;
            if n.saturating_mul(4) > r.b.len() {
                return Err(DecodeError::Truncated);
            }
            let oids = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
            Message::Truncate { options, oids }
        }
        b'M' => {
            let transactional = r.u8()? & 1 == 1;
            let lsn = r.u64()?;
            let prefix = r.string()?;
            let len = r.u32()? as usize;
            Message::LogicalMessage {
                transactional,
                lsn,
                prefix,
                content: r.take(len)?.to_vec(),
            }
        }
        other => return Err(DecodeError::UnknownMessage(other)),
    };
    if !r.b.is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(kind in proptest::sample::select(b"BCORYIUDTMZ".to_vec()),
                                       rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let mut bytes = vec![kind];
            bytes.extend(rest);
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn hand_built_messages() {
        let mut begin = vec![b'B'];
        begin.extend(0x0100_u64.to_be_bytes());
        begin.extend(7_i64.to_be_bytes());
        begin.extend(42_u32.to_be_bytes());
        assert_eq!(
            decode(&begin),
            Ok(Message::Begin {
                final_lsn: 0x100,
                commit_time: 7,
                xid: 42
            })
        );
        assert_eq!(
            decode(&begin[..begin.len() - 1]),
            Err(DecodeError::Truncated)
        );
        let mut extra = begin.clone();
        extra.push(0);
        assert_eq!(decode(&extra), Err(DecodeError::TrailingBytes));

        let mut insert = vec![b'I'];
        insert.extend(16384_u32.to_be_bytes());
        insert.push(b'N');
        insert.extend(3_i16.to_be_bytes());
        insert.push(b't');
        insert.extend(2_i32.to_be_bytes());
        insert.extend(b"hi");
        insert.push(b'n');
        insert.push(b'u');
        assert_eq!(
            decode(&insert),
            Ok(Message::Insert {
                oid: 16384,
                new: vec![
                    TupleValue::Text(b"hi".to_vec()),
                    TupleValue::Null,
                    TupleValue::UnchangedToast
                ]
            })
        );
        assert_eq!(decode(b"Z"), Err(DecodeError::UnknownMessage(b'Z')));
        assert_eq!(decode(b""), Err(DecodeError::Truncated));
    }

    #[test]
    fn hostile_lengths_do_not_allocate_or_panic() {
        // A tuple claiming 32767 columns in a 10-byte message.
        let mut m = vec![b'I'];
        m.extend(1_u32.to_be_bytes());
        m.push(b'N');
        m.extend(i16::MAX.to_be_bytes());
        assert_eq!(decode(&m), Err(DecodeError::Truncated));
        // A negative text length.
        let mut m = vec![b'I'];
        m.extend(1_u32.to_be_bytes());
        m.push(b'N');
        m.extend(1_i16.to_be_bytes());
        m.push(b't');
        m.extend((-5_i32).to_be_bytes());
        assert_eq!(decode(&m), Err(DecodeError::Truncated));
        // A truncate of u32::MAX relations.
        let mut m = vec![b'T'];
        m.extend(u32::MAX.to_be_bytes());
        m.push(0);
        assert_eq!(decode(&m), Err(DecodeError::Truncated));
        // Every prefix of every byte string decodes or fails cleanly.
        for len in 0..64 {
            for seed in 0..64u8 {
                let bytes: Vec<u8> = (0..len)
                    .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                    .collect();
                let _ = decode(&bytes);
            }
        }
    }
}
