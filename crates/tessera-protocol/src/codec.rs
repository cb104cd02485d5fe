//! Peer messages as bytes, for the links between nodes. A frame's body is
//! one message: a tag byte, then fixed-width little-endian integers and
//! length-prefixed byte strings. Decoding checks every length against what is
//! left, so bytes from a confused or hostile peer are an error, never a panic
//! or a huge allocation.

use bytes::{BufMut, Bytes};

use crate::chain::ChainMessage;
use crate::multi_master::MultiMessage;
use crate::primary_backup::{BackupMessage, LogEntry};
use crate::quorum::QuorumMessage;
use crate::record::Version;
use crate::transition::TransitionMessage;
use crate::{Chunk, NodeId, PeerMessage, RequestId, Write};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed peer message: {0}")]
pub struct CodecError(&'static str);

const FORWARD: u8 = 1;
const ACK: u8 = 2;
const READ_FORWARD: u8 = 3;
const READ_REPLY: u8 = 4;
const CHAIN_SNAPSHOT: u8 = 5;
const UPDATES: u8 = 16;
const BACKUP_SNAPSHOT: u8 = 17;
const POSITION: u8 = 18;
const RECORDS: u8 = 32;
const ACKED: u8 = 33;
const ROOTS: u8 = 34;
const LEAVES: u8 = 35;
const REPAIR: u8 = 36;
const PEEK: u8 = 48;
const PEEKED: u8 = 49;
const PREPARE: u8 = 50;
const PROMISE: u8 = 51;
const ACCEPT: u8 = 52;
const ACCEPTED: u8 = 53;
const SNAPSHOT_REQUEST: u8 = 54;
const QUORUM_SNAPSHOT: u8 = 55;
const QUIET: u8 = 64;
const RECORDS_REQUEST: u8 = 65;
const IN_SYNC: u8 = 66;
const TRANSITION_RECORDS: u8 = 67;

fn put_optional(out: &mut Vec<u8>, bytes: &Option<Bytes>) {
    match bytes {
        None => out.put_u8(0),
        Some(bytes) => {
            out.put_u8(1);
            put_bytes(out, bytes);
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.put_u32_le(bytes.len() as u32);
    out.put_slice(bytes);
}

fn put_write(out: &mut Vec<u8>, write: &Write) {
    match write {
        Write::Put(value) => {
            out.put_u8(1);
            put_bytes(out, value);
        }
        Write::Delete => out.put_u8(0),
    }
}

fn put_chunk(out: &mut Vec<u8>, chunk: Chunk) {
    out.put_u32_le(chunk.index);
    out.put_u8(u8::from(chunk.last));
}

fn put_entries(out: &mut Vec<u8>, entries: &[(Bytes, Bytes)]) {
    out.put_u32_le(entries.len() as u32);
    for (key, value) in entries {
        put_bytes(out, key);
        put_bytes(out, value);
    }
}

/// Appends `message` to `out`.
pub fn encode(message: &PeerMessage, out: &mut Vec<u8>) {
    match message {
        PeerMessage::Chain(message) => match message {
            ChainMessage::Forward { view, seq, origin, key, write } => {
                out.put_u8(FORWARD);
                out.put_u64_le(*view);
                out.put_u64_le(*seq);
                out.put_u32_le(origin.0);
                put_bytes(out, key);
                put_write(out, write);
            }
            ChainMessage::Ack { view, seq } => {
                out.put_u8(ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*seq);
            }
            ChainMessage::ReadForward { view, request, key } => {
                out.put_u8(READ_FORWARD);
                out.put_u64_le(*view);
                out.put_u64_le(request.0);
                put_bytes(out, key);
            }
            ChainMessage::ReadReply { view, request, value } => {
                out.put_u8(READ_REPLY);
                out.put_u64_le(*view);
                out.put_u64_le(request.0);
                match value {
                    None => out.put_u8(0),
                    Some(None) => out.put_u8(1),
                    Some(Some(value)) => {
                        out.put_u8(2);
                        put_bytes(out, value);
                    }
                }
            }
            ChainMessage::Snapshot { view, applied, chunk, entries } => {
                out.put_u8(CHAIN_SNAPSHOT);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
        },
        PeerMessage::Backup(message) => match message {
            BackupMessage::Updates { view, entries } => {
                out.put_u8(UPDATES);
                out.put_u64_le(*view);
                out.put_u32_le(entries.len() as u32);
                for entry in entries {
                    out.put_u64_le(entry.seq);
                    out.put_u64_le(entry.epoch);
                    out.put_u32_le(entry.origin.0);
                    put_bytes(out, &entry.key);
                    put_write(out, &entry.write);
                }
            }
            BackupMessage::Snapshot { view, applied, epoch, chunk, entries } => {
                out.put_u8(BACKUP_SNAPSHOT);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                out.put_u64_le(*epoch);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            BackupMessage::Position { view, applied, epoch } => {
                out.put_u8(POSITION);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                out.put_u64_le(*epoch);
            }
        },
        PeerMessage::Multi(message) => match message {
            MultiMessage::Records { view, batch, records } => {
                out.put_u8(RECORDS);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
                put_entries(out, records);
            }
            MultiMessage::Acked { view, batch } => {
                out.put_u8(ACKED);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
            }
            MultiMessage::Roots { view, roots } => {
                out.put_u8(ROOTS);
                out.put_u64_le(*view);
                out.put_u32_le(roots.len() as u32);
                for root in roots {
                    out.put_u64_le(*root);
                }
            }
            MultiMessage::Leaves { view, leaves } => {
                out.put_u8(LEAVES);
                out.put_u64_le(*view);
                out.put_u32_le(leaves.len() as u32);
                for (leaf, digest) in leaves {
                    out.put_u32_le(*leaf);
                    out.put_u64_le(*digest);
                }
            }
            MultiMessage::Repair { view, records, want } => {
                out.put_u8(REPAIR);
                out.put_u64_le(*view);
                put_entries(out, records);
                out.put_u32_le(want.len() as u32);
                for leaf in want {
                    out.put_u32_le(*leaf);
                }
            }
        },
        PeerMessage::Quorum(message) => match message {
            QuorumMessage::Peek { view, op, key } => {
                out.put_u8(PEEK);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
            }
            QuorumMessage::Peeked { view, op, record } => {
                out.put_u8(PEEKED);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_optional(out, record);
            }
            QuorumMessage::Prepare { view, op, key, ballot } => {
                out.put_u8(PREPARE);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
                out.put_u64_le(ballot.0 .0);
                out.put_u32_le(ballot.1 .0);
            }
            QuorumMessage::Promise { view, op, ok, record, highest } => {
                out.put_u8(PROMISE);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                out.put_u8(u8::from(*ok));
                put_optional(out, record);
                out.put_u64_le(highest.0);
            }
            QuorumMessage::Accept { view, op, key, record } => {
                out.put_u8(ACCEPT);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
                put_bytes(out, record);
            }
            QuorumMessage::Accepted { view, op, ok, highest } => {
                out.put_u8(ACCEPTED);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                out.put_u8(u8::from(*ok));
                out.put_u64_le(highest.0);
            }
            QuorumMessage::SnapshotRequest { view } => {
                out.put_u8(SNAPSHOT_REQUEST);
                out.put_u64_le(*view);
            }
            QuorumMessage::Snapshot { view, chunk, entries } => {
                out.put_u8(QUORUM_SNAPSHOT);
                out.put_u64_le(*view);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
        },
        PeerMessage::Transition(message) => match message {
            TransitionMessage::Quiet { view } => {
                out.put_u8(QUIET);
                out.put_u64_le(*view);
            }
            TransitionMessage::RecordsRequest { view, digests } => {
                out.put_u8(RECORDS_REQUEST);
                out.put_u64_le(*view);
                out.put_u32_le(digests.len() as u32);
                for digest in digests {
                    out.put_u64_le(*digest);
                }
            }
            TransitionMessage::InSync { view } => {
                out.put_u8(IN_SYNC);
                out.put_u64_le(*view);
            }
            TransitionMessage::Records { view, chunk, entries } => {
                out.put_u8(TRANSITION_RECORDS);
                out.put_u64_le(*view);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
        },
    }
}

struct Reader {
    bytes: Bytes,
    at: usize,
}

impl Reader {
    fn take(&mut self, count: usize) -> Result<Bytes, CodecError> {
        let end = self
            .at
            .checked_add(count)
            .filter(|end| *end <= self.bytes.len())
            .ok_or(CodecError("truncated"))?;
        let slice = self.bytes.slice(self.at..end);
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.take(4)?.as_ref().try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.take(8)?.as_ref().try_into().expect("8 bytes")))
    }

    fn bytes(&mut self) -> Result<Bytes, CodecError> {
        let length = self.u32()? as usize;
        self.take(length)
    }

    fn write(&mut self) -> Result<Write, CodecError> {
        match self.u8()? {
            0 => Ok(Write::Delete),
            1 => Ok(Write::Put(self.bytes()?)),
            _ => Err(CodecError("unknown write kind")),
        }
    }

    /// A count of items each at least `item_bytes` long: checked against what
    /// is left before anything is allocated.
    fn count(&mut self, item_bytes: usize) -> Result<usize, CodecError> {
        let count = self.u32()? as usize;
        if count.saturating_mul(item_bytes) > self.bytes.len() - self.at {
            return Err(CodecError("count larger than the message"));
        }
        Ok(count)
    }

    fn flag(&mut self) -> Result<bool, CodecError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(CodecError("a flag is 0 or 1")),
        }
    }

    fn optional(&mut self) -> Result<Option<Bytes>, CodecError> {
        Ok(if self.flag()? { Some(self.bytes()?) } else { None })
    }

    fn chunk(&mut self) -> Result<Chunk, CodecError> {
        let index = self.u32()?;
        let last = match self.u8()? {
            0 => false,
            1 => true,
            _ => return Err(CodecError("a chunk's last flag is neither 0 nor 1")),
        };
        Ok(Chunk { index, last })
    }

    fn entries(&mut self) -> Result<Vec<(Bytes, Bytes)>, CodecError> {
        let count = self.count(8)?;
        (0..count).map(|_| Ok((self.bytes()?, self.bytes()?))).collect()
    }
}

/// Decodes one message that fills `bytes` exactly (sharing its buffer).
pub fn decode(bytes: Bytes) -> Result<PeerMessage, CodecError> {
    let mut reader = Reader { bytes, at: 0 };
    let message = match reader.u8()? {
        FORWARD => PeerMessage::Chain(ChainMessage::Forward {
            view: reader.u64()?,
            seq: reader.u64()?,
            origin: NodeId(reader.u32()?),
            key: reader.bytes()?,
            write: reader.write()?,
        }),
        ACK => PeerMessage::Chain(ChainMessage::Ack { view: reader.u64()?, seq: reader.u64()? }),
        READ_FORWARD => PeerMessage::Chain(ChainMessage::ReadForward {
            view: reader.u64()?,
            request: RequestId(reader.u64()?),
            key: reader.bytes()?,
        }),
        READ_REPLY => {
            let (view, request) = (reader.u64()?, RequestId(reader.u64()?));
            let value = match reader.u8()? {
                0 => None,
                1 => Some(None),
                2 => Some(Some(reader.bytes()?)),
                _ => return Err(CodecError("unknown read reply kind")),
            };
            PeerMessage::Chain(ChainMessage::ReadReply { view, request, value })
        }
        CHAIN_SNAPSHOT => PeerMessage::Chain(ChainMessage::Snapshot {
            view: reader.u64()?,
            applied: reader.u64()?,
            chunk: reader.chunk()?,
            entries: reader.entries()?,
        }),
        UPDATES => {
            let view = reader.u64()?;
            let count = reader.count(25)?;
            let entries = (0..count)
                .map(|_| {
                    Ok(LogEntry {
                        seq: reader.u64()?,
                        epoch: reader.u64()?,
                        origin: NodeId(reader.u32()?),
                        key: reader.bytes()?,
                        write: reader.write()?,
                    })
                })
                .collect::<Result<_, CodecError>>()?;
            PeerMessage::Backup(BackupMessage::Updates { view, entries })
        }
        BACKUP_SNAPSHOT => PeerMessage::Backup(BackupMessage::Snapshot {
            view: reader.u64()?,
            applied: reader.u64()?,
            epoch: reader.u64()?,
            chunk: reader.chunk()?,
            entries: reader.entries()?,
        }),
        POSITION => PeerMessage::Backup(BackupMessage::Position {
            view: reader.u64()?,
            applied: reader.u64()?,
            epoch: reader.u64()?,
        }),
        RECORDS => PeerMessage::Multi(MultiMessage::Records {
            view: reader.u64()?,
            batch: reader.u64()?,
            records: reader.entries()?,
        }),
        ACKED => PeerMessage::Multi(MultiMessage::Acked { view: reader.u64()?, batch: reader.u64()? }),
        ROOTS => {
            let view = reader.u64()?;
            let count = reader.count(8)?;
            let roots = (0..count).map(|_| reader.u64()).collect::<Result<_, _>>()?;
            PeerMessage::Multi(MultiMessage::Roots { view, roots })
        }
        LEAVES => {
            let view = reader.u64()?;
            let count = reader.count(12)?;
            let leaves =
                (0..count).map(|_| Ok((reader.u32()?, reader.u64()?))).collect::<Result<_, CodecError>>()?;
            PeerMessage::Multi(MultiMessage::Leaves { view, leaves })
        }
        REPAIR => {
            let (view, records) = (reader.u64()?, reader.entries()?);
            let count = reader.count(4)?;
            let want = (0..count).map(|_| reader.u32()).collect::<Result<_, _>>()?;
            PeerMessage::Multi(MultiMessage::Repair { view, records, want })
        }
        PEEK => PeerMessage::Quorum(QuorumMessage::Peek {
            view: reader.u64()?,
            op: reader.u64()?,
            key: reader.bytes()?,
        }),
        PEEKED => PeerMessage::Quorum(QuorumMessage::Peeked {
            view: reader.u64()?,
            op: reader.u64()?,
            record: reader.optional()?,
        }),
        PREPARE => PeerMessage::Quorum(QuorumMessage::Prepare {
            view: reader.u64()?,
            op: reader.u64()?,
            key: reader.bytes()?,
            ballot: (Version(reader.u64()?), NodeId(reader.u32()?)),
        }),
        PROMISE => PeerMessage::Quorum(QuorumMessage::Promise {
            view: reader.u64()?,
            op: reader.u64()?,
            ok: reader.flag()?,
            record: reader.optional()?,
            highest: Version(reader.u64()?),
        }),
        ACCEPT => PeerMessage::Quorum(QuorumMessage::Accept {
            view: reader.u64()?,
            op: reader.u64()?,
            key: reader.bytes()?,
            record: reader.bytes()?,
        }),
        ACCEPTED => PeerMessage::Quorum(QuorumMessage::Accepted {
            view: reader.u64()?,
            op: reader.u64()?,
            ok: reader.flag()?,
            highest: Version(reader.u64()?),
        }),
        SNAPSHOT_REQUEST => PeerMessage::Quorum(QuorumMessage::SnapshotRequest { view: reader.u64()? }),
        QUORUM_SNAPSHOT => PeerMessage::Quorum(QuorumMessage::Snapshot {
            view: reader.u64()?,
            chunk: reader.chunk()?,
            entries: reader.entries()?,
        }),
        QUIET => PeerMessage::Transition(TransitionMessage::Quiet { view: reader.u64()? }),
        RECORDS_REQUEST => {
            let view = reader.u64()?;
            let count = reader.count(8)?;
            let digests = (0..count).map(|_| reader.u64()).collect::<Result<_, _>>()?;
            PeerMessage::Transition(TransitionMessage::RecordsRequest { view, digests })
        }
        IN_SYNC => PeerMessage::Transition(TransitionMessage::InSync { view: reader.u64()? }),
        TRANSITION_RECORDS => PeerMessage::Transition(TransitionMessage::Records {
            view: reader.u64()?,
            chunk: reader.chunk()?,
            entries: reader.entries()?,
        }),
        _ => return Err(CodecError("unknown message tag")),
    };
    if reader.at != reader.bytes.len() {
        return Err(CodecError("trailing bytes"));
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
    }

    fn write() -> impl Strategy<Value = Write> {
        prop_oneof![Just(Write::Delete), bytes().prop_map(Write::Put)]
    }

    fn entries() -> impl Strategy<Value = Vec<(Bytes, Bytes)>> {
        proptest::collection::vec((bytes(), bytes()), 0..5)
    }

    fn chunk() -> impl Strategy<Value = Chunk> {
        (any::<u32>(), any::<bool>()).prop_map(|(index, last)| Chunk { index, last })
    }

    fn message() -> impl Strategy<Value = PeerMessage> {
        let chain = prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u32>(), bytes(), write()).prop_map(
                |(view, seq, origin, key, write)| {
                    ChainMessage::Forward { view, seq, origin: NodeId(origin), key, write }
                }
            ),
            (any::<u64>(), any::<u64>()).prop_map(|(view, seq)| ChainMessage::Ack { view, seq }),
            (any::<u64>(), any::<u64>(), bytes()).prop_map(|(view, request, key)| {
                ChainMessage::ReadForward { view, request: RequestId(request), key }
            }),
            (any::<u64>(), any::<u64>(), proptest::option::of(proptest::option::of(bytes()))).prop_map(
                |(view, request, value)| ChainMessage::ReadReply { view, request: RequestId(request), value }
            ),
            (any::<u64>(), any::<u64>(), chunk(), entries()).prop_map(|(view, applied, chunk, entries)| {
                ChainMessage::Snapshot { view, applied, chunk, entries }
            }),
        ]
        .prop_map(PeerMessage::Chain);
        let entry = (any::<u64>(), any::<u64>(), any::<u32>(), bytes(), write()).prop_map(
            |(seq, epoch, origin, key, write)| LogEntry { seq, epoch, origin: NodeId(origin), key, write },
        );
        let backup = prop_oneof![
            (any::<u64>(), proptest::collection::vec(entry, 0..4))
                .prop_map(|(view, entries)| BackupMessage::Updates { view, entries }),
            (any::<u64>(), any::<u64>(), any::<u64>(), chunk(), entries()).prop_map(
                |(view, applied, epoch, chunk, entries)| {
                    BackupMessage::Snapshot { view, applied, epoch, chunk, entries }
                }
            ),
            (any::<u64>(), any::<u64>(), any::<u64>())
                .prop_map(|(view, applied, epoch)| BackupMessage::Position { view, applied, epoch }),
        ]
        .prop_map(PeerMessage::Backup);
        let multi = prop_oneof![
            (any::<u64>(), any::<u64>(), entries())
                .prop_map(|(view, batch, records)| MultiMessage::Records { view, batch, records }),
            (any::<u64>(), any::<u64>()).prop_map(|(view, batch)| MultiMessage::Acked { view, batch }),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..5))
                .prop_map(|(view, roots)| MultiMessage::Roots { view, roots }),
            (any::<u64>(), proptest::collection::vec((any::<u32>(), any::<u64>()), 0..5))
                .prop_map(|(view, leaves)| MultiMessage::Leaves { view, leaves }),
            (any::<u64>(), entries(), proptest::collection::vec(any::<u32>(), 0..5))
                .prop_map(|(view, records, want)| MultiMessage::Repair { view, records, want }),
        ]
        .prop_map(PeerMessage::Multi);
        let ballot =
            (any::<u64>(), any::<u32>()).prop_map(|(version, node)| (Version(version), NodeId(node)));
        let quorum = prop_oneof![
            (any::<u64>(), any::<u64>(), bytes()).prop_map(|(view, op, key)| QuorumMessage::Peek {
                view,
                op,
                key
            }),
            (any::<u64>(), any::<u64>(), proptest::option::of(bytes()))
                .prop_map(|(view, op, record)| QuorumMessage::Peeked { view, op, record }),
            (any::<u64>(), any::<u64>(), bytes(), ballot)
                .prop_map(|(view, op, key, ballot)| QuorumMessage::Prepare { view, op, key, ballot }),
            (any::<u64>(), any::<u64>(), any::<bool>(), proptest::option::of(bytes()), any::<u64>())
                .prop_map(|(view, op, ok, record, highest)| QuorumMessage::Promise {
                    view,
                    op,
                    ok,
                    record,
                    highest: Version(highest)
                }),
            (any::<u64>(), any::<u64>(), bytes(), bytes())
                .prop_map(|(view, op, key, record)| QuorumMessage::Accept { view, op, key, record }),
            (any::<u64>(), any::<u64>(), any::<bool>(), any::<u64>()).prop_map(|(view, op, ok, highest)| {
                QuorumMessage::Accepted { view, op, ok, highest: Version(highest) }
            }),
            any::<u64>().prop_map(|view| QuorumMessage::SnapshotRequest { view }),
            (any::<u64>(), chunk(), entries()).prop_map(|(view, chunk, entries)| QuorumMessage::Snapshot {
                view,
                chunk,
                entries
            }),
        ]
        .prop_map(PeerMessage::Quorum);
        let transition = prop_oneof![
            any::<u64>().prop_map(|view| TransitionMessage::Quiet { view }),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..70))
                .prop_map(|(view, digests)| TransitionMessage::RecordsRequest { view, digests }),
            any::<u64>().prop_map(|view| TransitionMessage::InSync { view }),
            (any::<u64>(), chunk(), entries())
                .prop_map(|(view, chunk, entries)| TransitionMessage::Records { view, chunk, entries }),
        ]
        .prop_map(PeerMessage::Transition);
        prop_oneof![chain, backup, multi, quorum, transition]
    }

    proptest! {
        #[test]
        fn messages_round_trip(message in message()) {
            let mut out = Vec::new();
            encode(&message, &mut out);
            prop_assert_eq!(decode(Bytes::from(out)).unwrap(), message);
        }

        #[test]
        fn truncated_or_extended_messages_are_errors(message in message(), cut in any::<prop::sample::Index>()) {
            let mut out = Vec::new();
            encode(&message, &mut out);
            let cut = cut.index(out.len());
            prop_assert!(decode(Bytes::copy_from_slice(&out[..cut])).is_err());
            out.push(0);
            prop_assert!(decode(Bytes::from(out)).is_err());
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(garbage in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(Bytes::from(garbage));
        }
    }

    #[test]
    fn a_huge_count_allocates_nothing() {
        let mut out = vec![CHAIN_SNAPSHOT];
        out.extend_from_slice(&[0; 16]); // view, applied
        out.extend_from_slice(&[0, 0, 0, 0, 1]); // chunk 0, the last
        out.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(Bytes::from(out)), Err(CodecError("count larger than the message")));
    }
}
