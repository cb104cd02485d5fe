//! The reserved key space: keys that start with [`PREFIX`] belong to Tessera
//! itself (sorted-set entries, a new head's barrier), never to clients. The
//! node refuses them in commands and hides them from SCAN, KEYS and DBSIZE;
//! every internal key is made here, so that none escapes that rule.
//!
//! Two kinds of internal key live under the prefix: entries that follow it
//! with a 4-byte big-endian length and the client key they belong to (the
//! node's sorted sets), and named keys ([`named`]), whose name starts with a
//! byte no such length can start with (lengths stay far below 2^31).

use bytes::Bytes;

use crate::KeyRange;

pub const PREFIX: &[u8] = b"\xff\xff#";

/// Named internal keys begin with this byte after the prefix.
const NAMED: u8 = 0xfe;

/// Written (deleted) by a shard's new head to commit everything its
/// predecessor left in flight before it serves strong reads.
pub const BARRIER: &[u8] = b"\xff\xff#\xfebarrier";

pub fn is_reserved(key: &[u8]) -> bool {
    key.starts_with(PREFIX)
}

/// An internal key that belongs to client key `owner`: the prefix, the
/// owner's length and the owner, then `suffix`.
pub fn owned(owner: &[u8], suffix: &[u8]) -> Vec<u8> {
    let length = u32::try_from(owner.len()).expect("keys are far smaller than 4 GiB");
    let mut key = Vec::with_capacity(PREFIX.len() + 4 + owner.len() + suffix.len());
    key.extend_from_slice(PREFIX);
    key.extend_from_slice(&length.to_be_bytes());
    key.extend_from_slice(owner);
    key.extend_from_slice(suffix);
    key
}

/// The client key an [`owned`] internal key belongs to, and what follows it.
pub fn owner(key: &[u8]) -> Option<(&[u8], &[u8])> {
    let rest = key.strip_prefix(PREFIX)?;
    let length = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let rest = &rest[4..];
    (rest.len() >= length).then(|| rest.split_at(length))
}

/// A named internal key (`\xff\xff#\xfe` + name).
pub fn named(name: &str) -> Bytes {
    let mut key = PREFIX.to_vec();
    key.push(NAMED);
    key.extend_from_slice(name.as_bytes());
    Bytes::from(key)
}

/// Every reserved key.
pub fn range() -> KeyRange {
    let mut end = PREFIX.to_vec();
    *end.last_mut().expect("non-empty") += 1;
    KeyRange { start: Some(Bytes::from_static(PREFIX)), end: Some(end.into()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_keys_name_their_owner_and_named_keys_are_apart() {
        let key = owned(b"scores", b"\x00\x00\x00\x00\x00\x00\x00\x07d");
        assert!(is_reserved(&key) && range().contains(&key));
        assert_eq!(owner(&key), Some((&b"scores"[..], &b"\x00\x00\x00\x00\x00\x00\x00\x07d"[..])));
        assert_eq!(named("barrier").as_ref(), BARRIER);
        assert!(is_reserved(BARRIER) && range().contains(BARRIER));
        assert_eq!(owner(BARRIER), None, "no owned key's length starts with 0xfe");
        assert!(!is_reserved(b"\xff\xff"));
    }
}
