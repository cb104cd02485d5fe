//! Typed values inside the engines' opaque bytes.
//!
//! ```text
//! kind (1 byte: 's' string, 'h' hash, 'z' sorted set, 'l' list, 'S' set; bit 0x80 set = has expiry) | [expiry unix ms, u64 LE] | payload
//! ```
//!
//! A string's payload is its bytes. A hash's payload is its fields in
//! insertion order, each `field_len u32 LE | field | value_len u32 LE | value`,
//! or, once large, points to buckets ([`crate::hashed`]).
//! A sorted set's payload points to entries of its own ([`crate::zset`]); a
//! list's or a set's holds its elements or, once large, points to pages
//! ([`crate::list`], [`crate::hashed`]).

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::RwLock;
use tessera_engine::Engine;

use crate::{DataError, DataResult};

const EXPIRES_FLAG: u8 = 0x80;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    String,
    Hash,
    SortedSet,
    List,
    Set,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::String, Kind::Hash, Kind::SortedSet, Kind::List, Kind::Set];

    fn tag(self) -> u8 {
        match self {
            Kind::String => b's',
            Kind::Hash => b'h',
            Kind::SortedSet => b'z',
            Kind::List => b'l',
            Kind::Set => b'S',
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::String => "string",
            Kind::Hash => "hash",
            Kind::SortedSet => "zset",
            Kind::List => "list",
            Kind::Set => "set",
        }
    }
}

/// A decoded stored value; `payload` shares the engine's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub kind: Kind,
    pub expires_at_ms: Option<u64>,
    pub payload: Bytes,
}

/// A stored value's header: its kind, its deadline, and where the payload starts.
/// Bytes that are not a Tessera value (a remote Redis shared with other
/// writers, say) are an error, not a panic.
pub fn decode_header(raw: &[u8]) -> DataResult<(Kind, Option<u64>, usize)> {
    let corrupt = || DataError::Invalid("stored value is not in Tessera's format".into());
    let &first = raw.first().ok_or_else(corrupt)?;
    let kind = match first & !EXPIRES_FLAG {
        b's' => Kind::String,
        b'h' => Kind::Hash,
        b'z' => Kind::SortedSet,
        b'l' => Kind::List,
        b'S' => Kind::Set,
        _ => return Err(corrupt()),
    };
    if first & EXPIRES_FLAG != 0 {
        let deadline: [u8; 8] = raw.get(1..9).ok_or_else(corrupt)?.try_into().expect("8 bytes");
        Ok((kind, Some(u64::from_le_bytes(deadline)), 9))
    } else {
        Ok((kind, None, 1))
    }
}

impl Stored {
    /// Decodes what an engine returned, sharing its buffer.
    pub fn decode(raw: Bytes) -> DataResult<Self> {
        let (kind, expires_at_ms, payload_start) = decode_header(&raw)?;
        Ok(Self { kind, expires_at_ms, payload: raw.slice(payload_start..) })
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|deadline| deadline <= now_ms)
    }

    pub fn expect(self, kind: Kind) -> DataResult<Self> {
        if self.kind == kind {
            Ok(self)
        } else {
            Err(DataError::WrongType)
        }
    }
}

/// Encodes a value for the engine: one allocation, one copy of the payload.
pub fn encode(kind: Kind, expires_at_ms: Option<u64>, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(payload.len() + 9);
    put_header(&mut out, kind, expires_at_ms);
    out.put_slice(payload);
    out.freeze()
}

fn put_header(out: &mut impl BufMut, kind: Kind, expires_at_ms: Option<u64>) {
    match expires_at_ms {
        Some(deadline) => {
            out.put_u8(kind.tag() | EXPIRES_FLAG);
            out.put_u64_le(deadline);
        }
        None => out.put_u8(kind.tag()),
    }
}

/// Parses a Redis integer argument: optional '-', no spaces or '+', no leading
/// zeros, within i64.
pub fn parse_i64(text: &[u8]) -> DataResult<i64> {
    let digits = text.strip_prefix(b"-").unwrap_or(text);
    let valid = !digits.is_empty()
        && digits.len() <= 19
        && digits.iter().all(u8::is_ascii_digit)
        && (digits == b"0" || digits[0] != b'0')
        && text != b"-0";
    if !valid {
        return Err(DataError::NotInteger);
    }
    std::str::from_utf8(text).ok().and_then(|text| text.parse().ok()).ok_or(DataError::NotInteger)
}

/// Reads a live (unexpired) value.
pub fn read_live(engine: &dyn Engine, key: &[u8], now: u64) -> DataResult<Option<Stored>> {
    match engine.get(key)? {
        Some(raw) => {
            let stored = Stored::decode(raw)?;
            Ok((!stored.is_expired(now)).then_some(stored))
        }
        None => Ok(None),
    }
}

/// Reads a live value of the given kind: `WRONGTYPE` for another kind.
pub fn read_kind(engine: &dyn Engine, key: &[u8], kind: Kind, now: u64) -> DataResult<Option<Stored>> {
    read_live(engine, key, now)?.map(|stored| stored.expect(kind)).transpose()
}

/// Whether the collections change several of `engine`'s entries where they
/// lie ([`Engine::update`]) for the commands that touch one end or one
/// bucket (a push, a pop, an addition to a paged collection). A persistent
/// engine takes the general path instead, whose change of several entries
/// goes through an intent ([`crate::collection::Changes`]) so that a crash
/// half-way is finished on recovery. A collection held inline is one entry,
/// changed where it lies on every engine: one entry's update is as atomic
/// as a put.
pub fn edits_in_place(engine: &dyn Engine) -> bool {
    !engine.capabilities().persistent
}

/// What an edit in place did with the value it was handed.
pub enum Edit<T> {
    /// Nothing: the change needs the general path.
    Declined,
    /// Nothing, and this is the answer (a member added that was there).
    Unchanged(T),
    Changed(T),
}

impl<T> Edit<T> {
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Edit<U> {
        match self {
            Edit::Declined => Edit::Declined,
            Edit::Unchanged(answer) => Edit::Unchanged(f(answer)),
            Edit::Changed(answer) => Edit::Changed(f(answer)),
        }
    }
}

/// An edit that changes the value whenever it does not decline.
impl<T> From<Option<T>> for Edit<T> {
    fn from(answer: Option<T>) -> Self {
        answer.map_or(Edit::Declined, Edit::Changed)
    }
}

/// Runs `edit` on the value at `key` where it lies ([`Engine::update`]):
/// the answer, or `None` when `edit` declined (having changed nothing).
pub fn edit_value<T>(
    engine: &dyn Engine,
    key: &[u8],
    mut edit: impl FnMut(&mut Option<Vec<u8>>) -> DataResult<Edit<T>>,
) -> DataResult<Option<T>> {
    let mut outcome = Ok(Edit::Declined);
    engine.update(key, &mut |value| {
        outcome = edit(value);
        matches!(outcome, Ok(Edit::Changed(_)))
    })?;
    match outcome? {
        Edit::Declined => Ok(None),
        Edit::Unchanged(answer) | Edit::Changed(answer) => Ok(Some(answer)),
    }
}

/// Edits the live value of `kind` at `key` where it lies: `edit` gets the
/// stored value and where its payload starts. Declined when there is no
/// live value; `WRONGTYPE` for another kind.
pub fn edit_live<T>(
    engine: &dyn Engine,
    key: &[u8],
    kind: Kind,
    now_ms: u64,
    mut edit: impl FnMut(&mut Vec<u8>, usize) -> DataResult<Edit<T>>,
) -> DataResult<Option<T>> {
    edit_value(engine, key, |value| {
        let Some(raw) = value else { return Ok(Edit::Declined) };
        let (stored_kind, expires_at_ms, payload_start) = decode_header(raw)?;
        if expires_at_ms.is_some_and(|deadline| deadline <= now_ms) {
            Ok(Edit::Declined)
        } else if stored_kind != kind {
            Err(DataError::WrongType)
        } else {
            edit(raw, payload_start)
        }
    })
}

/// Changes the live string at `key` in one read-modify-write of the engine
/// ([`Engine::update`]: in place where the engine can). `change` is handed
/// the payload (`None` when the key is absent or expired) and a buffer for
/// the new payload, and answers. The value keeps its deadline (a new one has
/// none). `WRONGTYPE` for another kind; nothing is written when `change`
/// fails or the new payload is over `bytes_max`.
pub fn change_string<T>(
    engine: &dyn Engine,
    key: &[u8],
    now_ms: u64,
    bytes_max: usize,
    mut change: impl FnMut(Option<&[u8]>, &mut Vec<u8>) -> DataResult<T>,
) -> DataResult<T> {
    let answer = edit_value(engine, key, |value| {
        let (payload_start, deadline) = match value.as_deref() {
            Some(raw) => match decode_header(raw)? {
                (_, Some(deadline), _) if deadline <= now_ms => (None, None),
                (Kind::String, deadline, start) => (Some(start), deadline),
                _ => return Err(DataError::WrongType),
            },
            None => (None, None),
        };
        let mut payload = Vec::new();
        let answer =
            change(payload_start.and_then(|start| value.as_deref().map(|raw| &raw[start..])), &mut payload)?;
        if payload.len() > bytes_max {
            return Err(DataError::TooLarge);
        }
        let raw = value.get_or_insert_with(Vec::new);
        raw.clear();
        put_header(raw, Kind::String, deadline);
        raw.extend_from_slice(&payload);
        Ok(Edit::Changed(answer))
    })?;
    Ok(answer.expect("a change of a string is never declined"))
}

/// Gives the value at `key` the deadline `expires_at_ms` (none: it lives
/// until deleted), where it lies, so that a value the engine keeps native
/// keeps its table. The caller has read the value live.
pub fn set_deadline(engine: &dyn Engine, key: &[u8], expires_at_ms: Option<u64>) -> DataResult<()> {
    edit_value(engine, key, |value| {
        let Some(raw) = value else { return Ok(Edit::Declined) };
        let (kind, _, payload_start) = decode_header(raw)?;
        let mut header = Vec::with_capacity(9);
        put_header(&mut header, kind, expires_at_ms);
        raw.splice(..payload_start, header);
        Ok(Edit::Changed(()))
    })?
    .ok_or_else(crate::collection::corrupt)
}

/// Adds `delta` to the count a collection's header keeps as a u64 at `at`
/// in the payload of the live value of `kind` at `key`, where it lies.
pub fn add_to_count(
    engine: &dyn Engine,
    key: &[u8],
    kind: Kind,
    now_ms: u64,
    at: usize,
    delta: i64,
) -> DataResult<()> {
    use crate::collection::corrupt;
    edit_live(engine, key, kind, now_ms, |value, start| {
        let stored = value.get_mut(start + at..start + at + 8).ok_or_else(corrupt)?;
        let count = u64::from_le_bytes((&*stored).try_into().expect("8 bytes"));
        stored.copy_from_slice(&count.wrapping_add_signed(delta).to_le_bytes());
        Ok(Edit::Changed(()))
    })?
    .ok_or_else(corrupt)
}

/// Writes a value, checking the size limit.
pub fn write(
    engine: &dyn Engine,
    key: &[u8],
    kind: Kind,
    expires_at_ms: Option<u64>,
    payload: &[u8],
    bytes_max: usize,
) -> DataResult<()> {
    if payload.len() > bytes_max {
        return Err(DataError::TooLarge);
    }
    engine.put(key, encode(kind, expires_at_ms, payload))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DBSIZE's reading never sees a change's entries without its count: a
    /// sweeper removing a replaced set's entries while DBSIZE ran made it
    /// count them as keys.
    #[test]
    fn the_count_of_keys_ignores_reserved_entries_changing_at_the_same_time() {
        use tessera_engine::{reserved, MemoryEngine};
        let engine = MemoryEngine::new();
        let reserved_entries = ReservedEntries::default();
        for key in 0..100u32 {
            engine.put(&key.to_be_bytes(), Bytes::from_static(b"v")).unwrap();
        }
        let entries: Vec<Vec<u8>> = (0..8u8).map(|n| reserved::owned(b"set", &[n])).collect();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for _ in 0..2000 {
                    reserved_entries
                        .change(|| {
                            for entry in &entries {
                                engine.put(entry, Bytes::from_static(b"e"))?;
                            }
                            Ok(((), entries.len() as i64))
                        })
                        .unwrap();
                    reserved_entries
                        .change(|| {
                            let removed =
                                entries.iter().filter(|entry| engine.delete(entry).unwrap()).count();
                            Ok(((), -(removed as i64)))
                        })
                        .unwrap();
                }
                done.store(true, Ordering::Relaxed);
            });
            while !done.load(Ordering::Relaxed) {
                assert_eq!(reserved_entries.keys_in(&engine).unwrap(), 100);
            }
        });
    }

    #[test]
    fn integers_parse_like_redis() {
        assert_eq!(parse_i64(b"0").unwrap(), 0);
        assert_eq!(parse_i64(b"-17").unwrap(), -17);
        assert_eq!(parse_i64(b"9223372036854775807").unwrap(), i64::MAX);
        assert_eq!(parse_i64(b"-9223372036854775808").unwrap(), i64::MIN);
        for bad in [&b""[..], b"-", b"+1", b" 1", b"01", b"1.5", b"9223372036854775808", b"-0", b"abc"] {
            assert!(parse_i64(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn values_round_trip_with_and_without_expiry() {
        for expires in [None, Some(1_700_000_000_000)] {
            let stored = Stored::decode(encode(Kind::String, expires, b"payload")).unwrap();
            assert_eq!(
                stored,
                Stored { kind: Kind::String, expires_at_ms: expires, payload: "payload".into() }
            );
        }
        assert!(Stored::decode(Bytes::from_static(b"")).is_err());
        assert!(Stored::decode(Bytes::from_static(b"\x8f12")).is_err());
    }
}

/// How many of an engine's entries lie under the reserved key space
/// ([`tessera_engine::reserved`]), so that DBSIZE can leave them out in O(1).
///
/// Changes to reserved entries run under the shared side of `changing` and
/// adjust the count before releasing it; DBSIZE reads the engine's length and
/// the count under the exclusive side. Without that, a sweep deleting a
/// replaced set's entries between DBSIZE's two reads made it count them as keys.
#[derive(Default)]
pub struct ReservedEntries {
    count: AtomicU64,
    changing: RwLock<()>,
}

impl ReservedEntries {
    pub fn new(count: u64) -> Self {
        Self { count: AtomicU64::new(count), changing: RwLock::new(()) }
    }

    /// Runs `change`, which writes reserved entries and returns its answer
    /// with the number of entries it added less those it removed.
    pub fn change<T>(&self, change: impl FnOnce() -> DataResult<(T, i64)>) -> DataResult<T> {
        let _changing = self.changing.read();
        let (answer, added) = change()?;
        if added >= 0 {
            self.count.fetch_add(added as u64, Ordering::Relaxed);
        } else {
            let removed = added.unsigned_abs();
            let before = self.count.fetch_sub(removed, Ordering::Relaxed);
            debug_assert!(before >= removed, "more reserved entries removed than counted");
        }
        Ok(answer)
    }

    /// The entries of `engine` outside the reserved key space.
    pub fn keys_in(&self, engine: &dyn Engine) -> DataResult<u64> {
        let _quiet = self.changing.write();
        Ok(engine.len()?.saturating_sub(self.count.load(Ordering::Relaxed)))
    }

    /// Empties `engine`, reserved entries and all.
    pub fn clear(&self, engine: &dyn Engine) -> DataResult<()> {
        let _quiet = self.changing.write();
        engine.clear()?;
        self.count.store(0, Ordering::Relaxed);
        Ok(())
    }

    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}
