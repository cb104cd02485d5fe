//! Keys as the hash-based engines store them: up to 23 bytes inline in the map
//! entry, longer ones on the heap. Most keys are short, and an inline key saves
//! a cache miss on every lookup (the comparison reads the entry, not a separate
//! allocation).

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};

const INLINE_BYTES: usize = 23;

#[derive(Clone)]
pub(crate) enum StoredKey {
    Inline { length: u8, bytes: [u8; INLINE_BYTES] },
    Heap(Box<[u8]>),
}

impl StoredKey {
    pub(crate) fn new(key: &[u8]) -> Self {
        if key.len() <= INLINE_BYTES {
            let mut bytes = [0u8; INLINE_BYTES];
            bytes[..key.len()].copy_from_slice(key);
            StoredKey::Inline { length: key.len() as u8, bytes }
        } else {
            StoredKey::Heap(key.into())
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            StoredKey::Inline { length, bytes } => &bytes[..*length as usize],
            StoredKey::Heap(bytes) => bytes,
        }
    }
}

impl Borrow<[u8]> for StoredKey {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

// Hash and equality must match `[u8]`'s, since lookups borrow keys as slices.
impl Hash for StoredKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl PartialEq for StoredKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for StoredKey {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn short_and_long_keys_hash_and_compare_like_slices() {
        let state = hashbrown::DefaultHashBuilder::default();
        for key in [&b""[..], b"k", &[7u8; 23], &[9u8; 24], &[1u8; 1000]] {
            let stored = StoredKey::new(key);
            assert_eq!(stored.as_slice(), key);
            assert_eq!(state.hash_one(&stored), state.hash_one(key));
        }
        assert!(matches!(StoredKey::new(&[0; 23]), StoredKey::Inline { .. }));
        assert!(matches!(StoredKey::new(&[0; 24]), StoredKey::Heap(_)));
    }
}
