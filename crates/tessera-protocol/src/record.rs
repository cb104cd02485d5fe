//! Per-record protocol metadata, kept inside the engine's opaque value by one
//! codec shared by every protocol:
//!
//! ```text
//! format (1 byte = 1) | version (u64 LE) | origin replica (u32 LE) | flags (1 byte: 1 = tombstone) | value
//! ```

use bytes::{BufMut, Bytes, BytesMut};

use crate::{NodeId, Time};

const FORMAT: u8 = 1;
const HEADER_BYTES: usize = 1 + 8 + 4 + 1;
const TOMBSTONE: u8 = 1;

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub version: Version,
    pub origin: NodeId,
    pub tombstone: bool,
    pub value: Bytes,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("stored record is not in Tessera's record format")]
pub struct RecordError;

impl Record {
    pub fn value(version: Version, origin: NodeId, value: Bytes) -> Self {
        Self { version, origin, tombstone: false, value }
    }

    pub fn tombstone(version: Version, origin: NodeId) -> Self {
        Self { version, origin, tombstone: true, value: Bytes::new() }
    }

    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_BYTES + self.value.len());
        out.put_u8(FORMAT);
        out.put_u64_le(self.version.0);
        out.put_u32_le(self.origin.0);
        out.put_u8(if self.tombstone { TOMBSTONE } else { 0 });
        out.put_slice(&self.value);
        out.freeze()
    }

    pub fn decode(raw: Bytes) -> Result<Self, RecordError> {
        if raw.len() < HEADER_BYTES || raw[0] != FORMAT {
            return Err(RecordError);
        }
        let version = Version(u64::from_le_bytes(raw[1..9].try_into().expect("8 bytes")));
        let origin = NodeId(u32::from_le_bytes(raw[9..13].try_into().expect("4 bytes")));
        let tombstone = match raw[13] {
            0 => false,
            TOMBSTONE => true,
            _ => return Err(RecordError),
        };
        Ok(Self { version, origin, tombstone, value: raw.slice(HEADER_BYTES..) })
    }

    /// The value a reader sees: none for a tombstone.
    pub fn visible(&self) -> Option<&Bytes> {
        (!self.tombstone).then_some(&self.value)
    }
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
