//! Peer messages as bytes. The framework names no protocol: each protocol's
//! file encodes and decodes its own messages ([`Message`]), and a
//! [`PeerMessage`] carries them opaquely, tagged with the protocol's
//! [`Family`]. The simulator and the links between nodes carry the same
//! bytes, so the simulator runs every codec the nodes run.
//!
//! On the wire a message is its family byte, then the body: fixed-width
//! little-endian integers and length-prefixed byte strings. Decoding checks
//! every length against what is left, so bytes from a confused or hostile
//! peer are an error, never a panic or a huge allocation.

use bytes::{BufMut, Bytes};

use crate::{Chunk, NodeId, Write};

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed peer message: {0}")]
pub struct CodecError(pub &'static str);

/// Which protocol's messages a [`PeerMessage`] carries: one byte, unique per
/// protocol (the registry checks it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Family(pub u8);

/// A protocol's messages, encoded and decoded by the protocol itself.
pub trait Message: Sized {
    const FAMILY: Family;

    /// Appends the message's body to `out`.
    fn encode(&self, out: &mut Vec<u8>);

    /// Reads a body that `encode` wrote; the caller checks that nothing is
    /// left over.
    fn decode(reader: &mut Reader) -> Result<Self, CodecError>;
}

/// A message between replicas of a shard, opaque to all but the protocol that
/// sent it.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerMessage {
    family: Family,
    body: Bytes,
}

impl std::fmt::Debug for PeerMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerMessage(family {}, {} bytes)", self.family.0, self.body.len())
    }
}

impl PeerMessage {
    pub fn new<M: Message>(message: &M) -> Self {
        let mut body = Vec::with_capacity(64);
        message.encode(&mut body);
        Self { family: M::FAMILY, body: Bytes::from(body) }
    }

    /// A message from its family and its encoded body, as [`PeerMessage::body`]
    /// gave them.
    pub fn from_parts(family: Family, body: Bytes) -> Self {
        Self { family, body }
    }

    pub fn family(&self) -> Family {
        self.family
    }

    /// The encoded body, without the family byte.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The message as `M`: `None` when it belongs to another protocol's
    /// family (a late message of a protocol this shard switched away from),
    /// an error when its body is malformed.
    pub fn open<M: Message>(&self) -> Option<Result<M, CodecError>> {
        if self.family != M::FAMILY {
            return None;
        }
        let mut reader = Reader::new(self.body.clone());
        Some(M::decode(&mut reader).and_then(|message| reader.finish().map(|()| message)))
    }

    /// Appends the family byte and the body: what the links send.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u8(self.family.0);
        out.put_slice(&self.body);
    }

    /// Splits what [`PeerMessage::encode`] wrote (sharing its buffer); the
    /// body is checked only by the protocol that opens it.
    pub fn decode(bytes: Bytes) -> Result<Self, CodecError> {
        let family = *bytes.first().ok_or(CodecError("empty message"))?;
        Ok(Self { family: Family(family), body: bytes.slice(1..) })
    }
}

pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let length = u32::try_from(bytes.len()).expect("a peer message field fits in 4 GiB");
    out.put_u32_le(length);
    out.put_slice(bytes);
}

pub fn put_optional(out: &mut Vec<u8>, bytes: &Option<Bytes>) {
    match bytes {
        None => out.put_u8(0),
        Some(bytes) => {
            out.put_u8(1);
            put_bytes(out, bytes);
        }
    }
}

pub fn put_write(out: &mut Vec<u8>, write: &Write) {
    match write {
        Write::Put(value) => {
            out.put_u8(1);
            put_bytes(out, value);
        }
        Write::Delete => out.put_u8(0),
    }
}

/// An entry's writes: a count, then each key and write.
pub fn put_writes(out: &mut Vec<u8>, writes: &[(Bytes, Write)]) {
    out.put_u32_le(writes.len() as u32);
    for (key, write) in writes {
        put_bytes(out, key);
        put_write(out, write);
    }
}

pub fn put_chunk(out: &mut Vec<u8>, chunk: Chunk) {
    out.put_u64_le(chunk.stream);
    out.put_u32_le(chunk.index);
    out.put_u8(u8::from(chunk.last));
}

pub fn put_entries(out: &mut Vec<u8>, entries: &[(Bytes, Bytes)]) {
    out.put_u32_le(entries.len() as u32);
    for (key, value) in entries {
        put_bytes(out, key);
        put_bytes(out, value);
    }
}

pub fn put_u64s(out: &mut Vec<u8>, values: &[u64]) {
    out.put_u32_le(values.len() as u32);
    for value in values {
        out.put_u64_le(*value);
    }
}

/// Reads a message body, refusing any length larger than what is left.
pub struct Reader {
    bytes: Bytes,
    at: usize,
}

impl Reader {
    pub fn new(bytes: Bytes) -> Self {
        Self { bytes, at: 0 }
    }

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

    /// Checks that the whole body was read.
    pub fn finish(&self) -> Result<(), CodecError> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(CodecError("trailing bytes"))
        }
    }

    pub fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.take(4)?.as_ref().try_into().expect("4 bytes")))
    }

    pub fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.take(8)?.as_ref().try_into().expect("8 bytes")))
    }

    pub fn node(&mut self) -> Result<NodeId, CodecError> {
        Ok(NodeId(self.u32()?))
    }

    /// A length-prefixed field. One that is less than half its message is
    /// copied out: a replica keeps a record for as long as the key lives, and
    /// a slice would pin the whole batch it came in (a batch of 256 records
    /// whose other keys were deleted). Most of a message (a large value) keeps
    /// sharing its buffer, which wastes less than it would cost to copy.
    pub fn bytes(&mut self) -> Result<Bytes, CodecError> {
        let length = self.u32()? as usize;
        let field = self.take(length)?;
        Ok(if field.len() * 2 < self.bytes.len() { Bytes::copy_from_slice(&field) } else { field })
    }

    pub fn write(&mut self) -> Result<Write, CodecError> {
        match self.u8()? {
            0 => Ok(Write::Delete),
            1 => Ok(Write::Put(self.bytes()?)),
            _ => Err(CodecError("unknown write kind")),
        }
    }

    /// An entry's writes, at least one (a key's length and a write's kind
    /// take five bytes at least).
    pub fn writes(&mut self) -> Result<crate::Writes, CodecError> {
        let count = self.count(5)?;
        if count == 0 {
            return Err(CodecError("an entry without writes"));
        }
        (0..count).map(|_| Ok((self.bytes()?, self.write()?))).collect()
    }

    /// A count of items each at least `item_bytes` long: checked against what
    /// is left before anything is allocated.
    pub fn count(&mut self, item_bytes: usize) -> Result<usize, CodecError> {
        let count = self.u32()? as usize;
        if count.saturating_mul(item_bytes) > self.bytes.len() - self.at {
            return Err(CodecError("count larger than the message"));
        }
        Ok(count)
    }

    pub fn flag(&mut self) -> Result<bool, CodecError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(CodecError("a flag is 0 or 1")),
        }
    }

    pub fn optional(&mut self) -> Result<Option<Bytes>, CodecError> {
        Ok(if self.flag()? { Some(self.bytes()?) } else { None })
    }

    pub fn chunk(&mut self) -> Result<Chunk, CodecError> {
        Ok(Chunk { stream: self.u64()?, index: self.u32()?, last: self.flag()? })
    }

    pub fn entries(&mut self) -> Result<Vec<(Bytes, Bytes)>, CodecError> {
        let count = self.count(8)?;
        (0..count).map(|_| Ok((self.bytes()?, self.bytes()?))).collect()
    }

    pub fn u64s(&mut self) -> Result<Vec<u64>, CodecError> {
        let count = self.count(8)?;
        (0..count).map(|_| self.u64()).collect()
    }
}

/// Checks shared by every protocol's codec tests: a message survives the
/// trip through [`PeerMessage`] bytes, and any cut or extension of it is an
/// error rather than a panic.
#[cfg(test)]
pub(crate) fn check_codec<M: Message + PartialEq + std::fmt::Debug>(message: &M, cut: usize) {
    let mut wire = Vec::new();
    PeerMessage::new(message).encode(&mut wire);
    let decoded = PeerMessage::decode(Bytes::from(wire.clone())).unwrap();
    assert_eq!(&decoded.open::<M>().expect("its own family").unwrap(), message);
    let cut = cut % wire.len();
    if let Ok(truncated) = PeerMessage::decode(Bytes::copy_from_slice(&wire[..cut])) {
        assert!(!matches!(truncated.open::<M>(), Some(Ok(_))), "a truncated message decoded");
    }
    wire.push(0);
    let extended = PeerMessage::decode(Bytes::from(wire)).unwrap();
    assert!(extended.open::<M>().unwrap().is_err(), "a message with trailing bytes decoded");
}

#[cfg(test)]
pub(crate) mod strategies {
    use bytes::Bytes;
    use proptest::prelude::*;

    use crate::{Chunk, Write};

    pub fn bytes() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
    }

    pub fn write() -> impl Strategy<Value = Write> {
        prop_oneof![Just(Write::Delete), bytes().prop_map(Write::Put)]
    }

    pub fn writes() -> impl Strategy<Value = crate::Writes> {
        proptest::collection::vec((bytes(), write()), 1..4)
    }

    pub fn entries() -> impl Strategy<Value = Vec<(Bytes, Bytes)>> {
        proptest::collection::vec((bytes(), bytes()), 0..5)
    }

    pub fn chunk() -> impl Strategy<Value = Chunk> {
        (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(stream, index, last)| Chunk {
            stream,
            index,
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::ChainMessage;

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        proptest::proptest!(|(garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64))| {
            if let Ok(message) = PeerMessage::decode(Bytes::from(garbage)) {
                let _ = message.open::<ChainMessage>();
                let _ = message.open::<crate::transition::TransitionMessage>();
            }
        });
        assert_eq!(PeerMessage::decode(Bytes::new()), Err(CodecError("empty message")));
    }

    #[test]
    fn a_huge_count_allocates_nothing() {
        let mut body = Vec::new();
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut reader = Reader::new(Bytes::from(body));
        assert_eq!(reader.entries(), Err(CodecError("count larger than the message")));
    }

    #[test]
    fn a_small_field_is_copied_out_of_its_message_and_most_of_one_is_not() {
        let mut body = Vec::new();
        put_bytes(&mut body, b"key");
        put_bytes(&mut body, &[7; 4096]);
        let message = Bytes::from(body);
        let within = |field: &Bytes| message.as_ptr_range().contains(&field.as_ptr());
        let mut reader = Reader::new(message.clone());
        let (key, value) = (reader.bytes().unwrap(), reader.bytes().unwrap());
        assert_eq!(key, Bytes::from_static(b"key"));
        assert!(!within(&key), "a stored key must not keep the whole message alive");
        assert!(within(&value), "a field that is most of the message is not copied");
    }

    #[test]
    fn another_familys_message_is_not_opened() {
        let ack = PeerMessage::new(&ChainMessage::Ack { view: 1, seq: 2 });
        assert!(ack.open::<crate::transition::TransitionMessage>().is_none());
        assert_eq!(ack.open::<ChainMessage>(), Some(Ok(ChainMessage::Ack { view: 1, seq: 2 })));
    }
}
