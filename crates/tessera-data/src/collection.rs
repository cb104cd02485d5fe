//! What the collections spread over several engine entries share: sorted
//! sets ([`crate::zset`]), large lists ([`crate::list`]), and large sets and
//! hashes ([`crate::hashed`]).
//!
//! A collection's value at its key holds a random id; its other entries live
//! under the reserved key space ([`tessera_engine::reserved`]), named by the
//! key, the id and a tag:
//!
//! ```text
//! R | key_len u32 | key | id u64 BE | tag | suffix
//! ```
//!
//! Keys under `R` are Tessera's own: refused from clients and hidden from
//! SCAN, KEYS and DBSIZE. A key that is deleted, overwritten or expires as a
//! whole needs no clean-up on the spot: its entries stop matching the id at
//! the key and the expiry sweep removes them ([`is_orphan`]). On a persistent
//! engine a change of more than one entry is first written as one intent
//! entry, and replayed when the table opens if the process died half-way
//! ([`recover`]).

use bytes::{BufMut, Bytes, BytesMut};
use tessera_engine::{reserved, Engine, ScanCursor};

use crate::typed::{read_live, Kind, ReservedEntries};
use crate::{DataError, DataResult};

/// The tag of a change's intent entry, whatever the collection.
const INTENT: u8 = b'w';

pub fn corrupt() -> DataError {
    DataError::Invalid("stored collection is corrupt".into())
}

/// The name of one of the entries of the collection `id` at `key`.
pub fn entry_key(key: &[u8], id: u64, tag: u8, suffix: &[u8]) -> Bytes {
    let mut after = Vec::with_capacity(9 + suffix.len());
    after.extend_from_slice(&id.to_be_bytes());
    after.push(tag);
    after.extend_from_slice(suffix);
    Bytes::from(reserved::owned(key, &after))
}

/// Splits an entry's name into (key, id, tag).
pub fn parse_entry_key(raw: &[u8]) -> Option<(&[u8], u64, u8)> {
    let (key, rest) = reserved::owner(raw)?;
    let id = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    let tag = *rest.get(8)?;
    Some((key, id, tag))
}

/// The key a reserved entry belongs to, for locking before [`is_orphan`].
pub fn owner_key(entry: &[u8]) -> Option<&[u8]> {
    parse_entry_key(entry).map(|(key, _, _)| key)
}

/// The id of the collection a stored value heads, if it has entries apart:
/// each type knows where its own keeps it.
pub type IdOf = fn(Kind, &Bytes) -> DataResult<Option<u64>>;

/// Whether a reserved entry belongs to no live collection (its key was
/// deleted, overwritten or expired), `id_of` reading the ids the values
/// carry. Call with the owner key's lock held.
pub fn is_orphan(engine: &dyn Engine, entry: &[u8], now_ms: u64, id_of: IdOf) -> DataResult<bool> {
    let Some((key, id, tag)) = parse_entry_key(entry) else { return Ok(true) };
    if tag == INTENT {
        // Only a crash leaves one behind, and opening the table replays it.
        return Ok(false);
    }
    Ok(match read_live(engine, key, now_ms)? {
        Some(stored) => id_of(stored.kind, &stored.payload)? != Some(id),
        None => true,
    })
}

/// Reads length-prefixed byte strings and fixed words from an entry's value.
pub struct Reader<'a> {
    bytes: &'a Bytes,
    pub at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a Bytes) -> Self {
        Self { bytes, at: 0 }
    }

    pub fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    pub fn u8(&mut self) -> DataResult<u8> {
        let byte = *self.bytes.get(self.at).ok_or_else(corrupt)?;
        self.at += 1;
        Ok(byte)
    }

    pub fn u64(&mut self) -> DataResult<u64> {
        let word = self.bytes.get(self.at..self.at + 8).ok_or_else(corrupt)?;
        self.at += 8;
        Ok(u64::from_le_bytes(word.try_into().expect("8 bytes")))
    }

    pub fn f64(&mut self) -> DataResult<f64> {
        Ok(f64::from_bits(self.u64()?))
    }

    pub fn bytes(&mut self) -> DataResult<Bytes> {
        let range = stored_bytes(self.bytes, self.at)?;
        self.at = range.end;
        Ok(self.bytes.slice(range))
    }
}

/// Where the bytes of the `len u32 | bytes` stored at `at` in `raw` are.
pub fn stored_bytes(raw: &[u8], at: usize) -> DataResult<std::ops::Range<usize>> {
    let length = raw.get(at..at + 4).ok_or_else(corrupt)?;
    let length = u32::from_le_bytes(length.try_into().expect("4 bytes")) as usize;
    let end = (at + 4).checked_add(length).filter(|end| *end <= raw.len()).ok_or_else(corrupt)?;
    Ok(at + 4..end)
}

pub fn put_bytes(out: &mut impl BufMut, bytes: &[u8]) {
    out.put_u32_le(bytes.len() as u32);
    out.put_slice(bytes);
}

/// One entry to write (`Some`) or delete (`None`).
type EntryWrite = (Bytes, Option<Bytes>);

/// The entries one change of a collection writes, and how many entries it
/// adds less those it removes.
#[derive(Default)]
pub struct Changes {
    writes: Vec<EntryWrite>,
    added: i64,
}

impl Changes {
    /// Writes (`Some`) or deletes (`None`) `entry`, which the engine holds
    /// now if `was_there`.
    pub fn note(&mut self, entry: Bytes, value: Option<Bytes>, was_there: bool) {
        self.added += i64::from(value.is_some()) - i64::from(was_there);
        self.writes.push((entry, value));
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// Writes the entries, then `main` at `key` (or deletes `key`): through
    /// an intent entry on a persistent engine, so that a crash half-way is
    /// finished on recovery. `reserved` counts the entries.
    pub fn commit(
        self,
        engine: &dyn Engine,
        key: &[u8],
        id: u64,
        main: Option<Bytes>,
        reserved: &ReservedEntries,
    ) -> DataResult<()> {
        reserved.change(|| {
            let intent = engine.capabilities().persistent && !self.writes.is_empty();
            let intent_key = entry_key(key, id, INTENT, &[]);
            if intent {
                engine.put(&intent_key, encode_intent(&self.writes, main.as_ref()))?;
            }
            apply(engine, key, &self.writes, main)?;
            if intent {
                engine.delete(&intent_key)?;
            }
            Ok(((), self.added))
        })
    }
}

fn apply(engine: &dyn Engine, key: &[u8], writes: &[EntryWrite], main: Option<Bytes>) -> DataResult<()> {
    for (entry, value) in writes {
        match value {
            Some(value) => engine.put(entry, value.clone())?,
            None => {
                engine.delete(entry)?;
            }
        }
    }
    match main {
        Some(value) => engine.put(key, value)?,
        None => {
            engine.delete(key)?;
        }
    }
    Ok(())
}

fn encode_intent(writes: &[EntryWrite], main: Option<&Bytes>) -> Bytes {
    let mut out = BytesMut::new();
    let put_optional = |out: &mut BytesMut, value: Option<&Bytes>| match value {
        Some(value) => {
            out.put_u8(1);
            put_bytes(out, value);
        }
        None => out.put_u8(0),
    };
    put_optional(&mut out, main);
    for (key, value) in writes {
        put_bytes(&mut out, key);
        put_optional(&mut out, value.as_ref());
    }
    out.freeze()
}

fn decode_intent(raw: &Bytes) -> DataResult<(Option<Bytes>, Vec<EntryWrite>)> {
    let mut reader = Reader::new(raw);
    let optional = |reader: &mut Reader| -> DataResult<Option<Bytes>> {
        match reader.u8()? {
            0 => Ok(None),
            1 => Ok(Some(reader.bytes()?)),
            _ => Err(corrupt()),
        }
    };
    let main = optional(&mut reader)?;
    let mut writes = Vec::new();
    while !reader.done() {
        let key = reader.bytes()?;
        writes.push((key, optional(&mut reader)?));
    }
    Ok((main, writes))
}

/// Finishes changes a crash interrupted and counts the reserved entries; run
/// when a table opens, before it serves.
pub fn recover(engine: &dyn Engine) -> DataResult<u64> {
    let mut intents = Vec::new();
    for_each_reserved(engine, |key, value| {
        if parse_entry_key(key).is_some_and(|(_, _, tag)| tag == INTENT) {
            intents.push((Bytes::copy_from_slice(key), value.clone()));
        }
    })?;
    for (intent_key, raw) in intents {
        let (key, _, _) = parse_entry_key(&intent_key).expect("parsed above");
        let (main, writes) = decode_intent(&raw)?;
        apply(engine, key, &writes, main)?;
        engine.delete(&intent_key)?;
        tracing::info!(key = %String::from_utf8_lossy(key), "finished an interrupted change of a collection");
    }
    let mut count = 0;
    for_each_reserved(engine, |_, _| count += 1)?;
    Ok(count)
}

/// Calls `visit` with every reserved entry of `engine`.
pub fn for_each_reserved(engine: &dyn Engine, mut visit: impl FnMut(&[u8], &Bytes)) -> DataResult<()> {
    let range = reserved::range();
    let mut cursor = ScanCursor::start();
    loop {
        let page = engine.scan(&range, &cursor, 1024)?;
        for (key, value) in &page.entries {
            if range.contains(key) {
                visit(key, value);
            }
        }
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_engine::MemoryEngine;

    #[test]
    fn entry_names_parse_back() {
        let key = entry_key(b"index", 42, b'p', &7u64.to_be_bytes());
        assert!(reserved::is_reserved(&key) && reserved::range().contains(&key));
        assert_eq!(parse_entry_key(&key), Some((&b"index"[..], 42, b'p')));
        assert_eq!(parse_entry_key(b"\xff\xff#\x00\x00"), None);
    }

    #[test]
    fn an_interrupted_change_is_finished_on_recovery() {
        let engine = MemoryEngine::new();
        let writes = vec![(entry_key(b"k", 9, b'x', b"a"), Some(Bytes::from_static(b"entry")))];
        let main = Bytes::from_static(b"main");
        engine.put(&entry_key(b"k", 9, INTENT, &[]), encode_intent(&writes, Some(&main))).unwrap();
        assert_eq!(recover(&engine).unwrap(), 1);
        assert_eq!(engine.get(b"k").unwrap(), Some(main));
        assert!(engine.get(&entry_key(b"k", 9, INTENT, &[])).unwrap().is_none());
    }
}
