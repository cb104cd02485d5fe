//! Per-record protocol metadata, kept inside the engine's opaque value by one
//! codec shared by every protocol:
//!
//! ```text
//! format (1 byte = 1) | version (u64 LE) | origin replica (u32 LE) | flags (1 byte) | [intent] | [markers] | [vector] | [dependencies] | value
//! flags: 1 = tombstone, 2 = an intent follows, 4 = commit markers follow, 8 = a dependency vector follows,
//!        16 = dependencies follow
//! intent:  batch version u64 | batch origin u32 | primary (len u32, bytes) | 0 (a delete) or 1 (len u32, value)
//! markers: count u32 | (batch version u64, batch origin u32) × count
//! vector:  count u8 | version u64 × count
//! dependencies: count u16 | (key (len u32, bytes), version u64, origin u32) × count
//! ```
//!
//! Intents and markers are AA+SC's, for batches (docs/PROTOCOLS.md, "Batches
//! on AA+SC"); the vector is CausalSpartan's, one entry per datacenter; the
//! dependencies are COPS's, so that a partition that starts over its data
//! ships its own writes again with them. A record without them is the
//! header and the value.

use bytes::{BufMut, Bytes, BytesMut};

use crate::{NodeId, Time};

const FORMAT: u8 = 1;
const HEADER_BYTES: usize = 1 + 8 + 4 + 1;
const TOMBSTONE: u8 = 1;
const HAS_INTENT: u8 = 2;
const HAS_MARKERS: u8 = 4;
const HAS_VECTOR: u8 = 8;
const HAS_DEPENDENCIES: u8 = 16;
/// The most entries a dependency vector has (one per datacenter).
pub const VECTOR_MAX: usize = u8::MAX as usize;
/// The most dependencies a record keeps.
pub const DEPENDENCIES_MAX: usize = u16::MAX as usize;
/// More markers than a record ever needs (one per batch whose roll-forward
/// is under way or was cut short): a record claiming more is corrupt.
const MARKERS_MAX: usize = 1 << 16;

/// A hybrid logical clock value: 48 bits of physical milliseconds, then a 16-bit
/// logical counter. Ordered like the pair (milliseconds, counter). Protocols that
/// order writes themselves (chain replication) use plain sequence numbers here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub u64);

impl Version {
    pub fn new(physical_ms: u64, logical: u16) -> Self {
        Self((physical_ms << 16) | logical as u64)
    }

    pub fn physical_ms(self) -> u64 {
        self.0 >> 16
    }

    pub fn logical(self) -> u16 {
        self.0 as u16
    }
}

/// How far ahead of the local clock a peer's version may be. Clocks drift
/// by far less; a version beyond this comes from a broken clock, and taking
/// it would put its key out of reach of every later write, so it is refused.
pub const VERSION_AHEAD_MAX_MS: u64 = 10_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a peer's version is {ahead_ms} ms ahead of this clock, more than the {VERSION_AHEAD_MAX_MS} ms clocks may drift")]
pub struct VersionAhead {
    pub ahead_ms: u64,
}

/// Issues hybrid logical clock versions: never backwards, always above any
/// version seen, and close to physical time.
#[derive(Clone, Debug, Default)]
pub struct Hlc {
    last: Version,
}

impl Hlc {
    /// A version for a local event at physical time `now`.
    pub fn tick(&mut self, now: Time) -> Version {
        self.last = Self::after(self.last, now);
        self.last
    }

    /// Moves the clock past a version this replica stored earlier.
    pub fn observe(&mut self, stored: Version, now: Time) -> Version {
        self.last = Self::after(self.last.max(stored), now);
        self.last
    }

    /// Moves the clock past a version received from a peer, unless it is
    /// further ahead of `now` than clocks drift.
    pub fn observe_remote(&mut self, remote: Version, now: Time) -> Result<(), VersionAhead> {
        let ahead_ms = remote.physical_ms().saturating_sub(now);
        if ahead_ms > VERSION_AHEAD_MAX_MS {
            return Err(VersionAhead { ahead_ms });
        }
        self.observe(remote, now);
        Ok(())
    }

    /// The smallest version above `floor` at physical time `now`.
    fn after(floor: Version, now: Time) -> Version {
        if now > floor.physical_ms() {
            Version::new(now, 0)
        } else if floor.logical() == u16::MAX {
            Version::new(floor.physical_ms() + 1, 0)
        } else {
            Version::new(floor.physical_ms(), floor.logical() + 1)
        }
    }
}

/// A batch, named by its proposer's ballot when it began.
pub type BatchId = (Version, NodeId);

/// A batch's write waiting on a key, over the key's committed value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent {
    pub batch: BatchId,
    /// The batch's first key, whose record decides whether it committed.
    pub primary: Bytes,
    /// The key's value in the batch; `None` deletes it.
    pub value: Option<Bytes>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub version: Version,
    pub origin: NodeId,
    pub tombstone: bool,
    pub value: Bytes,
    pub intent: Option<Box<Intent>>,
    /// Batches committed with this key as their primary whose other keys
    /// may still hold their intents.
    pub markers: Vec<BatchId>,
    /// The causal protocols' metadata, if any: out of line, since the
    /// other protocols' records never carry it.
    pub causal: Option<Box<CausalMetadata>>,
}

/// What a causal protocol keeps with a version.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CausalMetadata {
    /// CausalSpartan: the write's dependency vector, by datacenter (at most
    /// [`VECTOR_MAX`] entries).
    pub vector: Vec<Version>,
    /// COPS: the write's nearest dependencies (at most [`DEPENDENCIES_MAX`]).
    pub dependencies: Vec<Dependency>,
}

/// A version of a key a COPS session or write depends on, and the node
/// that took it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Dependency {
    pub key: Bytes,
    pub version: Version,
    pub origin: NodeId,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("stored record is not in Tessera's record format")]
pub struct RecordError;

impl Record {
    pub fn value(version: Version, origin: NodeId, value: Bytes) -> Self {
        Self { version, origin, tombstone: false, value, intent: None, markers: Vec::new(), causal: None }
    }

    pub fn tombstone(version: Version, origin: NodeId) -> Self {
        Self {
            version,
            origin,
            tombstone: true,
            value: Bytes::new(),
            intent: None,
            markers: Vec::new(),
            causal: None,
        }
    }

    /// A record of `value` (`None`: a tombstone).
    pub fn new(version: Version, origin: NodeId, value: Option<Bytes>) -> Self {
        match value {
            Some(value) => Self::value(version, origin, value),
            None => Self::tombstone(version, origin),
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_BYTES + self.value.len());
        out.put_u8(FORMAT);
        out.put_u64_le(self.version.0);
        out.put_u32_le(self.origin.0);
        let mut flags = if self.tombstone { TOMBSTONE } else { 0 };
        if self.intent.is_some() {
            flags |= HAS_INTENT;
        }
        if !self.markers.is_empty() {
            flags |= HAS_MARKERS;
        }
        let (vector, dependencies) = match self.causal.as_deref() {
            Some(causal) => (&causal.vector[..], &causal.dependencies[..]),
            None => (&[][..], &[][..]),
        };
        if !vector.is_empty() {
            flags |= HAS_VECTOR;
        }
        if !dependencies.is_empty() {
            flags |= HAS_DEPENDENCIES;
        }
        out.put_u8(flags);
        if let Some(intent) = &self.intent {
            put_batch(&mut out, intent.batch);
            out.put_u32_le(intent.primary.len() as u32);
            out.put_slice(&intent.primary);
            match &intent.value {
                None => out.put_u8(0),
                Some(value) => {
                    out.put_u8(1);
                    out.put_u32_le(value.len() as u32);
                    out.put_slice(value);
                }
            }
        }
        if !self.markers.is_empty() {
            out.put_u32_le(self.markers.len() as u32);
            for batch in &self.markers {
                put_batch(&mut out, *batch);
            }
        }
        if !vector.is_empty() {
            assert!(vector.len() <= VECTOR_MAX, "a vector entry per datacenter");
            out.put_u8(vector.len() as u8);
            for entry in vector {
                out.put_u64_le(entry.0);
            }
        }
        if !dependencies.is_empty() {
            assert!(dependencies.len() <= DEPENDENCIES_MAX, "a write's context is bounded");
            out.put_u16_le(dependencies.len() as u16);
            for dependency in dependencies {
                out.put_u32_le(dependency.key.len() as u32);
                out.put_slice(&dependency.key);
                out.put_u64_le(dependency.version.0);
                out.put_u32_le(dependency.origin.0);
            }
        }
        out.put_slice(&self.value);
        out.freeze()
    }

    pub fn decode(raw: Bytes) -> Result<Self, RecordError> {
        if raw.len() < HEADER_BYTES || raw[0] != FORMAT {
            return Err(RecordError);
        }
        let version = Version(u64::from_le_bytes(raw[1..9].try_into().expect("8 bytes")));
        let origin = NodeId(u32::from_le_bytes(raw[9..13].try_into().expect("4 bytes")));
        let flags = raw[13];
        if flags & !(TOMBSTONE | HAS_INTENT | HAS_MARKERS | HAS_VECTOR | HAS_DEPENDENCIES) != 0 {
            return Err(RecordError);
        }
        let mut at = HEADER_BYTES;
        let intent = if flags & HAS_INTENT != 0 {
            let batch = take_batch(&raw, &mut at)?;
            let primary = take_bytes(&raw, &mut at)?;
            let value = match take(&raw, &mut at, 1)?[0] {
                0 => None,
                1 => Some(take_bytes(&raw, &mut at)?),
                _ => return Err(RecordError),
            };
            Some(Box::new(Intent { batch, primary, value }))
        } else {
            None
        };
        let mut markers = Vec::new();
        if flags & HAS_MARKERS != 0 {
            let count = u32::from_le_bytes(take(&raw, &mut at, 4)?.try_into().expect("4 bytes")) as usize;
            if count == 0 || count > MARKERS_MAX {
                return Err(RecordError);
            }
            for _ in 0..count {
                markers.push(take_batch(&raw, &mut at)?);
            }
        }
        let mut vector = Vec::new();
        if flags & HAS_VECTOR != 0 {
            let count = take(&raw, &mut at, 1)?[0] as usize;
            if count == 0 {
                return Err(RecordError);
            }
            for _ in 0..count {
                vector
                    .push(Version(u64::from_le_bytes(take(&raw, &mut at, 8)?.try_into().expect("8 bytes"))));
            }
        }
        let mut dependencies = Vec::new();
        if flags & HAS_DEPENDENCIES != 0 {
            let count = u16::from_le_bytes(take(&raw, &mut at, 2)?.try_into().expect("2 bytes")) as usize;
            if count == 0 {
                return Err(RecordError);
            }
            for _ in 0..count {
                let key = take_bytes(&raw, &mut at)?;
                let (version, origin) = take_batch(&raw, &mut at)?;
                dependencies.push(Dependency { key, version, origin });
            }
        }
        Ok(Self {
            version,
            origin,
            tombstone: flags & TOMBSTONE != 0,
            value: raw.slice(at..),
            intent,
            markers,
            causal: CausalMetadata::of(vector, dependencies),
        })
    }

    /// The value a reader sees: none for a tombstone. An intent's value is
    /// not visible until its batch commits and the key is rolled forward.
    pub fn visible(&self) -> Option<&Bytes> {
        (!self.tombstone).then_some(&self.value)
    }

    /// Its version and origin: under a quorum protocol, the ballot it was
    /// accepted at, which tells one record of a key from another.
    pub fn ballot(&self) -> (Version, NodeId) {
        (self.version, self.origin)
    }

    /// Where last writer wins puts it among a key's records: by version,
    /// then origin, and at one version and origin a tombstone above the
    /// value, for a delete that retires exactly that record (multi-master's
    /// conditional delete) and so loses to any later write of the key.
    pub fn rank(&self) -> (Version, NodeId, bool) {
        (self.version, self.origin, self.tombstone)
    }
}

impl CausalMetadata {
    /// The metadata of `vector` and `dependencies`, if either is there.
    pub fn of(vector: Vec<Version>, dependencies: Vec<Dependency>) -> Option<Box<Self>> {
        (!vector.is_empty() || !dependencies.is_empty()).then(|| Box::new(Self { vector, dependencies }))
    }
}

fn put_batch(out: &mut BytesMut, batch: BatchId) {
    out.put_u64_le(batch.0 .0);
    out.put_u32_le(batch.1 .0);
}

fn take<'a>(raw: &'a Bytes, at: &mut usize, count: usize) -> Result<&'a [u8], RecordError> {
    let end = at.checked_add(count).filter(|end| *end <= raw.len()).ok_or(RecordError)?;
    let taken = &raw[*at..end];
    *at = end;
    Ok(taken)
}

fn take_bytes(raw: &Bytes, at: &mut usize) -> Result<Bytes, RecordError> {
    let length = u32::from_le_bytes(take(raw, at, 4)?.try_into().expect("4 bytes")) as usize;
    let start = *at;
    take(raw, at, length)?;
    Ok(raw.slice(start..*at))
}

/// A version and the node that stamped it: a batch's id, or a dependency's
/// version and origin.
fn take_batch(raw: &Bytes, at: &mut usize) -> Result<BatchId, RecordError> {
    let version = Version(u64::from_le_bytes(take(raw, at, 8)?.try_into().expect("8 bytes")));
    let origin = NodeId(u32::from_le_bytes(take(raw, at, 4)?.try_into().expect("4 bytes")));
    Ok((version, origin))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_an_error() {
        let record = Record::value(Version::new(1_700_000_000_000, 3), NodeId(7), Bytes::from_static(b"v"));
        assert_eq!(Record::decode(record.encode()).unwrap(), record);
        let tombstone = Record::tombstone(Version(9), NodeId(1));
        assert_eq!(Record::decode(tombstone.encode()).unwrap().visible(), None);
        assert!(Record::decode(Bytes::from_static(b"short")).is_err());
        assert!(Record::decode(Bytes::from(vec![2u8; 20])).is_err());
    }

    #[test]
    fn intents_markers_vectors_and_dependencies_round_trip_and_cut_records_are_errors() {
        let batch = (Version::new(5, 1), NodeId(2));
        let mut record = Record::value(Version::new(9, 0), NodeId(3), Bytes::from_static(b"committed"));
        record.intent = Some(Box::new(Intent {
            batch,
            primary: Bytes::from_static(b"p"),
            value: Some(Bytes::from_static(b"new")),
        }));
        record.markers = vec![batch, (Version(1), NodeId(1))];
        record.causal = CausalMetadata::of(
            vec![Version(11), Version(0), Version(13)],
            vec![
                Dependency { key: Bytes::from_static(b"post"), version: Version(8), origin: NodeId(4) },
                Dependency { key: Bytes::new(), version: Version(2), origin: NodeId(0) },
            ],
        );
        let raw = record.encode();
        assert_eq!(Record::decode(raw.clone()).unwrap(), record);
        assert_eq!(Record::decode(raw.clone()).unwrap().visible(), Some(&Bytes::from_static(b"committed")));
        let mut deleting = Record::tombstone(Version(4), NodeId(1));
        deleting.intent = Some(Box::new(Intent { batch, primary: Bytes::new(), value: None }));
        assert_eq!(Record::decode(deleting.encode()).unwrap(), deleting);
        // Every cut inside the intent, the markers, the vector or the
        // dependencies is caught (a cut in the value is only a shorter value).
        let value_starts = raw.len() - b"committed".len();
        for cut in HEADER_BYTES..value_starts {
            assert!(Record::decode(raw.slice(..cut)).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn hlc_never_goes_back_and_passes_what_it_sees() {
        let mut clock = Hlc::default();
        let first = clock.tick(100);
        let second = clock.tick(100);
        assert!(second > first);
        let third = clock.tick(50); // the wall clock stepped back
        assert!(third > second);
        let remote = Version::new(1_000, 5);
        let observed = clock.observe(remote, 60);
        assert!(observed > remote && observed > third);
        assert_eq!(clock.tick(2_000), Version::new(2_000, 0));
    }
}
