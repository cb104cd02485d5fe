//! A record's layout in the hybrid log. Every record starts on an 8-byte
//! boundary with a header of three words, then the key, then the value with
//! whatever room the alignment leaves:
//!
//! - word 0: the previous address in the record's hash chain (48 bits) and
//!   flags (16 bits);
//! - word 1: the key's length (low 32 bits) and the value's capacity (high);
//! - word 2: the value's length (low 32 bits) and, in memory, a sequence count
//!   that is odd while the value is being changed in place (high); on disk the
//!   same bits hold the record's CRC32, which recovery checks.

/// Bytes of the header.
pub(crate) const HEADER_BYTES: u64 = 24;

/// The value is absent: the key was deleted.
pub(crate) const TOMBSTONE: u64 = 1 << 48;
/// Allocated, but its key and value are not written yet. Scans skip it.
pub(crate) const INCOMPLETE: u64 = 1 << 49;

const ADDRESS_MASK: u64 = (1 << 48) - 1;

/// Logical addresses are 48 bits. Address 0 is "none"; the log starts after it.
pub(crate) const FIRST_ADDRESS: u64 = 8;
pub(crate) const ADDRESS_LIMIT: u64 = 1 << 48;

pub(crate) fn align8(bytes: u64) -> u64 {
    (bytes + 7) & !7
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) word0: u64,
    pub(crate) key_len: u32,
    pub(crate) capacity: u32,
    pub(crate) value_len: u32,
    /// The sequence count (in memory) or the CRC (on disk).
    pub(crate) check: u32,
}

impl Header {
    /// A new record's header, marked incomplete: `previous` is the chain's head
    /// it goes in front of; the value's capacity is what the alignment leaves.
    pub(crate) fn new(previous: u64, key_len: usize, value_len: Option<usize>) -> Self {
        let value_bytes = value_len.unwrap_or(0) as u64;
        let capacity = align8(key_len as u64 + value_bytes) - key_len as u64;
        let tombstone = if value_len.is_none() { TOMBSTONE } else { 0 };
        Self {
            word0: previous | tombstone | INCOMPLETE,
            key_len: key_len as u32,
            capacity: capacity as u32,
            value_len: value_bytes as u32,
            check: 0,
        }
    }

    pub(crate) fn decode(words: [u64; 3]) -> Self {
        Self {
            word0: words[0],
            key_len: words[1] as u32,
            capacity: (words[1] >> 32) as u32,
            value_len: words[2] as u32,
            check: (words[2] >> 32) as u32,
        }
    }

    pub(crate) fn encode(&self) -> [u64; 3] {
        [self.word0, self.word1(), self.word2()]
    }

    pub(crate) fn word1(&self) -> u64 {
        u64::from(self.key_len) | u64::from(self.capacity) << 32
    }

    pub(crate) fn word2(&self) -> u64 {
        u64::from(self.value_len) | u64::from(self.check) << 32
    }

    pub(crate) fn previous(&self) -> u64 {
        self.word0 & ADDRESS_MASK
    }

    pub(crate) fn is_tombstone(&self) -> bool {
        self.word0 & TOMBSTONE != 0
    }

    pub(crate) fn is_incomplete(&self) -> bool {
        self.word0 & INCOMPLETE != 0
    }

    /// The whole record's size in the log.
    pub(crate) fn record_bytes(&self) -> u64 {
        HEADER_BYTES + align8(u64::from(self.key_len) + u64::from(self.capacity))
    }

    /// Whether the lengths can be those of a record that fits in `limit`
    /// bytes: what recovery and scans check before trusting a header.
    pub(crate) fn is_plausible(&self, limit: u64) -> bool {
        self.value_len <= self.capacity
            && self.record_bytes() <= limit
            && self.word0 >> 48 & !((TOMBSTONE | INCOMPLETE) >> 48) == 0
    }

    pub(crate) fn value_offset(&self) -> u64 {
        HEADER_BYTES + u64::from(self.key_len)
    }
}

/// The CRC a record carries on disk: over its bytes with the check bits zero.
pub(crate) fn checksum(record: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&record[..20]);
    hasher.update(&[0; 4]);
    hasher.update(&record[HEADER_BYTES as usize..]);
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_round_trips_and_its_size_is_aligned() {
        let header = Header::new(4096, 5, Some(10));
        assert_eq!(Header::decode(header.encode()), header);
        assert_eq!(header.previous(), 4096);
        assert!(header.is_incomplete() && !header.is_tombstone());
        assert_eq!(header.capacity, 11, "the key and value fill their words");
        assert_eq!(header.record_bytes(), 24 + 16);
        assert!(header.is_plausible(1 << 20));
        let tombstone = Header::new(0, 3, None);
        assert!(tombstone.is_tombstone());
        assert_eq!(tombstone.value_len, 0);
    }
}
