//! A record's layout in the hybrid log. Every record starts on an 8-byte
//! boundary with a header of two words, then the key, then the value, padded
//! to the next word:
//!
//! - word 0: the previous address in the record's hash chain (48 bits), the
//!   tombstone and incomplete flags, and the key's length (14 bits). A key of
//!   16383 bytes or more has the length field at its maximum and its real
//!   length in one more word before the key.
//! - word 1: the value's length (low 32 bits) and, in memory, a sequence count
//!   that is odd while the value is being changed in place (high); on disk the
//!   same bits hold the record's CRC32, which recovery checks.
//!
//! A record's size follows from its lengths, so a value changes in place only
//! when the new one pads to the same size.

/// Bytes of the header (without a long key's length word).
pub(crate) const HEADER_BYTES: u64 = 16;
/// Where the sequence count (or the CRC) is: the high half of word 1.
pub(crate) const SEQUENCE_WORD: u64 = 8;
pub(crate) const CHECK_BYTES: std::ops::Range<usize> = 12..16;

/// The value is absent: the key was deleted.
pub(crate) const TOMBSTONE: u64 = 1 << 48;
/// Allocated, but its key and value are not written yet. Scans skip it.
pub(crate) const INCOMPLETE: u64 = 1 << 49;

/// Logical addresses are 48 bits, in every word that holds one.
pub(crate) const ADDRESS_MASK: u64 = (1 << 48) - 1;
const KEY_LEN_SHIFT: u32 = 50;
/// The key length field's value for a key whose length has its own word.
const LONG_KEY: u64 = (1 << 14) - 1;

/// The largest record a log may hold, whatever budget wrote it: what a
/// header read back from disk is checked against. (A budget limits the
/// records it writes to half its memory; reopening with a smaller budget
/// must still read the larger records written before.)
pub(crate) const RECORD_BYTES_LIMIT: u64 = 1 << 30;

/// Logical addresses are 48 bits. Address 0 is "none"; the log starts after it.
pub(crate) const FIRST_ADDRESS: u64 = 8;

pub(crate) fn align8(bytes: u64) -> u64 {
    (bytes + 7) & !7
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// The previous address and the flags (the key length field aside).
    pub(crate) word0: u64,
    pub(crate) key_len: u32,
    pub(crate) value_len: u32,
    /// The sequence count (in memory) or the CRC (on disk).
    pub(crate) check: u32,
}

impl Header {
    /// A new record's header, marked incomplete: `previous` is the chain's head
    /// it goes in front of.
    pub(crate) fn new(previous: u64, key_len: usize, value_len: Option<usize>) -> Self {
        debug_assert!(previous <= ADDRESS_MASK);
        let tombstone = if value_len.is_none() { TOMBSTONE } else { 0 };
        Self {
            word0: previous | tombstone | INCOMPLETE,
            key_len: key_len as u32,
            value_len: value_len.unwrap_or(0) as u32,
            check: 0,
        }
    }

    fn is_long_key(&self) -> bool {
        u64::from(self.key_len) >= LONG_KEY
    }

    /// The header's words as they are stored: two, or three for a long key.
    pub(crate) fn words(&self) -> ([u64; 3], usize) {
        let key_len_field = u64::from(self.key_len).min(LONG_KEY);
        let word0 = self.word0 & !(LONG_KEY << KEY_LEN_SHIFT) | key_len_field << KEY_LEN_SHIFT;
        let word1 = u64::from(self.value_len) | u64::from(self.check) << 32;
        ([word0, word1, u64::from(self.key_len)], if self.is_long_key() { 3 } else { 2 })
    }

    /// Decodes a header from its first two words; `long_key_len` is asked for
    /// the third when the key's length has its own word.
    pub(crate) fn decode(word0: u64, word1: u64, long_key_len: impl FnOnce() -> Option<u64>) -> Option<Self> {
        let field = word0 >> KEY_LEN_SHIFT;
        let key_len = if field == LONG_KEY { u32::try_from(long_key_len()?).ok()? } else { field as u32 };
        Some(Self {
            word0: word0 & !(LONG_KEY << KEY_LEN_SHIFT),
            key_len,
            value_len: word1 as u32,
            check: (word1 >> 32) as u32,
        })
    }

    /// Decodes a header from the bytes at a record's start: `None` when they
    /// are too few.
    pub(crate) fn parse(bytes: &[u8]) -> Option<Self> {
        let word =
            |i: usize| bytes.get(i * 8..i * 8 + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8")));
        Self::decode(word(0)?, word(1)?, || word(2))
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

    pub(crate) fn key_offset(&self) -> u64 {
        HEADER_BYTES + if self.is_long_key() { 8 } else { 0 }
    }

    pub(crate) fn value_offset(&self) -> u64 {
        self.key_offset() + u64::from(self.key_len)
    }

    /// The whole record's size in the log.
    pub(crate) fn record_bytes(&self) -> u64 {
        align8(self.value_offset() + u64::from(self.value_len))
    }

    /// Whether a value of `len` bytes takes the place of this record's value
    /// without changing the record's size.
    pub(crate) fn fits_in_place(&self, len: usize) -> bool {
        align8(self.value_offset() + len as u64) == self.record_bytes()
    }

    /// Whether the lengths can be those of a record that fits in `limit`
    /// bytes: what recovery and scans check before trusting a header.
    pub(crate) fn is_plausible(&self, limit: u64) -> bool {
        self.record_bytes() <= limit
    }
}

/// The CRC a record carries on disk: over its bytes with the check bits zero.
pub(crate) fn checksum(record: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&record[..CHECK_BYTES.start]);
    hasher.update(&[0; 4]);
    hasher.update(&record[CHECK_BYTES.end..]);
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(header: &Header) -> Header {
        let (words, count) = header.words();
        let bytes: Vec<u8> = words[..count].iter().flat_map(|word| word.to_le_bytes()).collect();
        Header::parse(&bytes).expect("whole")
    }

    #[test]
    fn a_header_round_trips_and_its_size_is_aligned() {
        let header = Header::new(4096, 5, Some(10));
        assert_eq!(round_trip(&header), header);
        assert_eq!(header.previous(), 4096);
        assert!(header.is_incomplete() && !header.is_tombstone());
        assert_eq!(header.record_bytes(), 16 + 16);
        assert!(header.fits_in_place(11) && header.fits_in_place(8) && !header.fits_in_place(12));
        let tombstone = Header::new(0, 3, None);
        assert!(tombstone.is_tombstone());
        assert_eq!(tombstone.value_len, 0);
        assert_eq!(tombstone.record_bytes(), 24);
    }

    #[test]
    fn a_long_key_has_its_length_in_a_word_of_its_own() {
        let header = Header::new(64, 20_000, Some(3));
        assert_eq!(header.words().1, 3);
        assert_eq!(round_trip(&header), header);
        assert_eq!(header.key_offset(), 24);
        assert_eq!(header.record_bytes(), align8(24 + 20_003));
        let (words, _) = header.words();
        let two: Vec<u8> = words[..2].iter().flat_map(|word| word.to_le_bytes()).collect();
        assert_eq!(Header::parse(&two), None, "the length word is needed");
    }
}
