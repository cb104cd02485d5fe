//! Sorted sets over any engine, atomic per key (changed under the key's lock).
//!
//! A sorted set is spread over several engine entries so that a change costs a
//! few small reads and writes rather than a rewrite of the whole set (the YCSB
//! Redis binding keeps every record's key in one sorted set):
//!
//! ```text
//! key                                'z' value: set id u64 | members u64 | next page id u64
//! R | key_len u32 | key | id | 'd'   directory: (lower bound, page id) per page, in order
//! R | key_len u32 | key | id | 'p' | page id    up to PAGE_MAX (score, member), sorted
//! R | key_len u32 | key | id | 'm' | member     the member's score
//! ```
//!
//! The entries live in the engine of the table that owns `key`, named and
//! collected as every collection's are ([`crate::collection`]).
//!
//! On an engine that keeps native values ([`Engine::keeps_native`]) a sorted
//! set is held in the engine's memory instead ([`NativeSortedSet`]), from its
//! first member, attached to a value whose payload is the one byte
//! [`NATIVE`] (a paged set's is 24).

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};

use bytes::{BufMut, Bytes, BytesMut};
use tessera_engine::Engine;

use crate::collection::{corrupt, entry_key, put_bytes, stored_bytes, Changes, Reader};
use crate::native::{edit_native, Held};
use crate::native_zset::NativeSortedSet;
use crate::typed::{self, read_kind, Edit, Kind, ReservedEntries};
use crate::{DataError, DataResult};

/// Entries per page; a page that grows past it splits in two.
const PAGE_MAX: usize = 128;

/// The payload of a native set's stub.
const NATIVE: &[u8] = &[2];

const DIRECTORY: u8 = b'd';
const PAGE: u8 = b'p';
const MEMBER: u8 = b'm';

/// What a range with LIMIT keeps of the entries it walks: the first
/// `offset` skipped, then at most `limit`.
struct Window {
    offset: usize,
    limit: usize,
    skipped: usize,
    out: Vec<(f64, Bytes)>,
}

impl Window {
    fn new(offset: usize, limit: usize) -> Self {
        Self { offset, limit, skipped: 0, out: Vec::new() }
    }

    /// Takes an entry in range; whether the walk should go on.
    fn take(&mut self, score: f64, member: &[u8]) -> bool {
        if self.skipped < self.offset {
            self.skipped += 1;
        } else {
            self.out.push((score, Bytes::copy_from_slice(member)));
        }
        self.out.len() < self.limit
    }
}

/// Orders (score, member) pairs as Redis does: by score, then by member bytes.
fn compare(a: (f64, &[u8]), b: (f64, &[u8])) -> Ordering {
    a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1))
}

/// A bound of a lexicographic range, as ZRANGEBYLEX takes it: `-`, `+`,
/// `[member` (inclusive) or `(member` (exclusive).
#[derive(Clone, Debug, PartialEq)]
pub enum LexBound {
    Lowest,
    Highest,
    Inclusive(Bytes),
    Exclusive(Bytes),
}

impl LexBound {
    pub fn parse(text: &[u8]) -> DataResult<Self> {
        match text {
            b"-" => Ok(LexBound::Lowest),
            b"+" => Ok(LexBound::Highest),
            [b'[', rest @ ..] => Ok(LexBound::Inclusive(Bytes::copy_from_slice(rest))),
            [b'(', rest @ ..] => Ok(LexBound::Exclusive(Bytes::copy_from_slice(rest))),
            _ => Err(DataError::Invalid("min or max not valid string range item".into())),
        }
    }

    /// Whether no member can lie between `min` and `max`.
    fn empty_between(min: &LexBound, max: &LexBound) -> bool {
        let rank = |bound: &LexBound| match bound {
            LexBound::Lowest => 0,
            LexBound::Inclusive(_) | LexBound::Exclusive(_) => 1,
            LexBound::Highest => 2,
        };
        let exclusive = |bound: &LexBound| matches!(bound, LexBound::Exclusive(_));
        let order = match (min, max) {
            (
                LexBound::Inclusive(a) | LexBound::Exclusive(a),
                LexBound::Inclusive(b) | LexBound::Exclusive(b),
            ) => a.cmp(b),
            _ => rank(min).cmp(&rank(max)),
        };
        order.is_gt() || (order.is_eq() && (exclusive(min) || exclusive(max)))
    }

    /// Whether `member` is at or past this bound taken as a minimum.
    fn admits_from_below(&self, member: &[u8]) -> bool {
        match self {
            LexBound::Lowest => true,
            LexBound::Highest => false,
            LexBound::Inclusive(bound) => member >= &bound[..],
            LexBound::Exclusive(bound) => member > &bound[..],
        }
    }

    /// Whether `member` is at or before this bound taken as a maximum.
    fn admits_from_above(&self, member: &[u8]) -> bool {
        match self {
            LexBound::Lowest => false,
            LexBound::Highest => true,
            LexBound::Inclusive(bound) => member <= &bound[..],
            LexBound::Exclusive(bound) => member < &bound[..],
        }
    }
}

/// A score bound of a range query, as in `ZRANGEBYSCORE key (1 +inf`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreBound {
    pub score: f64,
    pub exclusive: bool,
}

impl ScoreBound {
    pub fn parse(text: &[u8]) -> DataResult<Self> {
        let (exclusive, number) = match text.strip_prefix(b"(") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let score =
            parse_score(number).map_err(|_| DataError::Invalid("min or max is not a float".into()))?;
        Ok(Self { score, exclusive })
    }

    fn admits_from_below(&self, score: f64) -> bool {
        if self.exclusive {
            score > self.score
        } else {
            score >= self.score
        }
    }

    fn admits_from_above(&self, score: f64) -> bool {
        if self.exclusive {
            score < self.score
        } else {
            score <= self.score
        }
    }
}

/// Parses a score: a decimal or `inf` / `+inf` / `-inf`; never NaN.
pub fn parse_score(text: &[u8]) -> DataResult<f64> {
    let invalid = || DataError::Invalid("value is not a valid float".into());
    let text = std::str::from_utf8(text).map_err(|_| invalid())?;
    if text.is_empty() || text.starts_with(char::is_whitespace) || text.ends_with(char::is_whitespace) {
        return Err(invalid());
    }
    let score: f64 = text.parse().map_err(|_| invalid())?;
    if score.is_nan() {
        return Err(invalid());
    }
    // One zero: -0 and 0 are the same score.
    Ok(if score == 0.0 { 0.0 } else { score })
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    id: u64,
    len: u64,
    next_page: u64,
    expires_at_ms: Option<u64>,
}

impl Meta {
    /// Where `len` lies in the payload.
    const LEN_AT: usize = 8;

    fn encode(&self) -> Bytes {
        let mut payload = [0u8; 24];
        payload[..8].copy_from_slice(&self.id.to_le_bytes());
        payload[8..16].copy_from_slice(&self.len.to_le_bytes());
        payload[16..].copy_from_slice(&self.next_page.to_le_bytes());
        typed::encode(Kind::SortedSet, self.expires_at_ms, &payload)
    }

    fn decode(payload: &[u8], expires_at_ms: Option<u64>) -> DataResult<Self> {
        let word = |at: usize| -> DataResult<u64> {
            Ok(u64::from_le_bytes(payload.get(at..at + 8).ok_or_else(corrupt)?.try_into().expect("8 bytes")))
        };
        Ok(Self { id: word(0)?, len: word(8)?, next_page: word(16)?, expires_at_ms })
    }
}

/// A page's lower bound: every entry of page i is in [bound i, bound i+1).
#[derive(Clone, Debug)]
struct PageBound {
    score: f64,
    member: Bytes,
    page: u64,
}

/// The page directory. As stored it is searched in place (an offset table
/// makes each bound one lookup), so a change that splits no page decodes
/// only the few bounds a binary search touches; it is decoded whole only to
/// change it.
///
/// ```text
/// count u32 | offset u32 × count | (score u64, member_len u32, member, page u64) × count
/// ```
enum Directory {
    Stored(Bytes),
    Changed(Vec<PageBound>),
}

impl Directory {
    fn from_stored(raw: Bytes) -> DataResult<Self> {
        let count =
            u32::from_le_bytes(raw.get(..4).ok_or_else(corrupt)?.try_into().expect("4 bytes")) as usize;
        if count == 0 || raw.len() < 4 + 4 * count {
            return Err(corrupt());
        }
        Ok(Self::Stored(raw))
    }

    fn len(&self) -> usize {
        match self {
            Self::Stored(raw) => u32::from_le_bytes(raw[..4].try_into().expect("4 bytes")) as usize,
            Self::Changed(bounds) => bounds.len(),
        }
    }

    fn bound(&self, index: usize) -> DataResult<PageBound> {
        match self {
            Self::Stored(raw) => {
                let at = 4 + 4 * index;
                let offset = raw.get(at..at + 4).ok_or_else(corrupt)?;
                let mut reader = Reader::new(raw);
                reader.at = u32::from_le_bytes(offset.try_into().expect("4 bytes")) as usize;
                Ok(PageBound { score: reader.f64()?, member: reader.bytes()?, page: reader.u64()? })
            }
            Self::Changed(bounds) => bounds.get(index).cloned().ok_or_else(corrupt),
        }
    }

    /// Bound `index`'s (score, member), borrowed: a search decodes and
    /// copies nothing.
    fn bound_key(&self, index: usize) -> DataResult<(f64, &[u8])> {
        match self {
            Self::Stored(raw) => {
                let at = 4 + 4 * index;
                let offset = raw.get(at..at + 4).ok_or_else(corrupt)?;
                let offset = u32::from_le_bytes(offset.try_into().expect("4 bytes")) as usize;
                let score = raw.get(offset..offset + 8).ok_or_else(corrupt)?;
                let score = f64::from_bits(u64::from_le_bytes(score.try_into().expect("8 bytes")));
                Ok((score, &raw[stored_bytes(raw, offset + 8)?]))
            }
            Self::Changed(bounds) => {
                bounds.get(index).map(|bound| (bound.score, &bound.member[..])).ok_or_else(corrupt)
            }
        }
    }

    /// The number of leading bounds for which `before` holds (it must hold for
    /// a prefix of the directory, as for `slice::partition_point`).
    fn partition_point(&self, before: impl Fn(f64, &[u8]) -> bool) -> DataResult<usize> {
        let (mut low, mut high) = (0, self.len());
        while low < high {
            let middle = low + (high - low) / 2;
            let (score, member) = self.bound_key(middle)?;
            if before(score, member) {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        Ok(low)
    }

    /// The index of the page that holds (or would hold) an entry: the last
    /// whose bound is at or below it.
    fn index_for(&self, score: f64, member: &[u8]) -> DataResult<usize> {
        let after = self.partition_point(|bound_score, bound_member| {
            compare((bound_score, bound_member), (score, member)).is_le()
        })?;
        Ok(after.saturating_sub(1))
    }

    fn changed(&mut self) -> DataResult<&mut Vec<PageBound>> {
        if let Self::Stored(_) = self {
            let bounds = (0..self.len()).map(|index| self.bound(index)).collect::<DataResult<_>>()?;
            *self = Self::Changed(bounds);
        }
        match self {
            Self::Changed(bounds) => Ok(bounds),
            Self::Stored(_) => unreachable!("decoded above"),
        }
    }

    fn encode(&self) -> DataResult<Bytes> {
        let bounds = match self {
            Self::Stored(raw) => return Ok(raw.clone()),
            Self::Changed(bounds) => bounds,
        };
        let header = 4 + 4 * bounds.len();
        let mut entries = BytesMut::new();
        let mut out = BytesMut::with_capacity(header);
        out.put_u32_le(bounds.len() as u32);
        for bound in bounds {
            out.put_u32_le((header + entries.len()) as u32);
            entries.put_u64_le(bound.score.to_bits());
            put_bytes(&mut entries, &bound.member);
            entries.put_u64_le(bound.page);
        }
        out.extend_from_slice(&entries);
        Ok(out.freeze())
    }
}

fn encode_page(entries: &[(f64, Bytes)]) -> Bytes {
    let mut out = BytesMut::with_capacity(entries.iter().map(|(_, member)| 12 + member.len()).sum());
    for (score, member) in entries {
        out.put_u64_le(score.to_bits());
        put_bytes(&mut out, member);
    }
    out.freeze()
}

fn decode_page(raw: &Bytes) -> DataResult<Vec<(f64, Bytes)>> {
    let mut reader = Reader::new(raw);
    let mut entries = Vec::new();
    while !reader.done() {
        entries.push((reader.f64()?, reader.bytes()?));
    }
    Ok(entries)
}

/// The lowest possible bound, which the first page always has.
fn lowest_bound(page: u64) -> PageBound {
    PageBound { score: f64::NEG_INFINITY, member: Bytes::new(), page }
}

struct CachedPage {
    entries: Vec<(f64, Bytes)>,
    in_engine: bool,
    dirty: bool,
    deleted: bool,
}

/// A member's score as read from the engine and as changed since.
struct MemberState {
    stored: Option<f64>,
    current: Option<f64>,
}

/// One sorted set, read lazily and changed in memory until [`SortedSet::commit`].
/// The caller holds the key's lock for as long as it lives.
pub struct SortedSet<'a> {
    engine: &'a dyn Engine,
    key: &'a [u8],
    meta: Meta,
    /// Whether the set's value is in the engine (false for a new set).
    in_engine: bool,
    directory: Option<Directory>,
    directory_dirty: bool,
    pages: HashMap<u64, CachedPage>,
    members: HashMap<Bytes, MemberState>,
    native: Option<Held<NativeSortedSet>>,
}

impl<'a> SortedSet<'a> {
    /// The set at `key`, if there is one; `WRONGTYPE` for another kind of value.
    pub fn open(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> DataResult<Option<Self>> {
        let Some(stored) = read_kind(engine, key, Kind::SortedSet, now_ms)? else { return Ok(None) };
        if stored.payload == NATIVE {
            if !engine.keeps_native() {
                return Err(corrupt());
            }
            let mut set = Self::native(engine, key, Held::Attached);
            set.meta.expires_at_ms = stored.expires_at_ms;
            set.meta.len = set.read_native(NativeSortedSet::len)?.expect("native") as u64;
            return Ok(Some(set));
        }
        let meta = Meta::decode(&stored.payload, stored.expires_at_ms)?;
        Ok(Some(Self::with_meta(engine, key, meta, true)))
    }

    /// The set at `key`, or a new empty one (stored by `commit` only if it gains members).
    pub fn open_or_new(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> DataResult<Self> {
        Ok(match Self::open(engine, key, now_ms)? {
            Some(set) => set,
            None if engine.keeps_native() => Self::native(engine, key, Held::Built(Box::default())),
            None => {
                let meta = Meta { id: rand::random(), len: 0, next_page: 1, expires_at_ms: None };
                let mut set = Self::with_meta(engine, key, meta, false);
                set.directory = Some(Directory::Changed(vec![lowest_bound(0)]));
                set.pages.insert(
                    0,
                    CachedPage { entries: Vec::new(), in_engine: false, dirty: false, deleted: false },
                );
                set
            }
        })
    }

    fn with_meta(engine: &'a dyn Engine, key: &'a [u8], meta: Meta, in_engine: bool) -> Self {
        Self {
            engine,
            key,
            meta,
            in_engine,
            directory: None,
            directory_dirty: false,
            pages: HashMap::new(),
            members: HashMap::new(),
            native: None,
        }
    }

    fn native(engine: &'a dyn Engine, key: &'a [u8], held: Held<NativeSortedSet>) -> Self {
        let meta = Meta { id: 0, len: 0, next_page: 0, expires_at_ms: None };
        let in_engine = matches!(held, Held::Attached);
        Self { native: Some(held), ..Self::with_meta(engine, key, meta, in_engine) }
    }

    /// Runs `read` on the native set, if the set is one.
    fn read_native<T>(&self, read: impl FnOnce(&NativeSortedSet) -> T) -> DataResult<Option<T>> {
        self.native.as_ref().map(|held| held.read(self.engine, self.key, read)).transpose()
    }

    /// Runs `write` on the native set, if the set is one; `write` answers,
    /// and says whether it changed the set.
    fn write_native<T>(
        &mut self,
        write: impl FnOnce(&mut NativeSortedSet) -> (T, bool),
    ) -> DataResult<Option<T>> {
        let (engine, key) = (self.engine, self.key);
        let Some(held) = self.native.as_mut() else { return Ok(None) };
        let (answer, len) = held.write(engine, key, |set| {
            let (answer, changed) = write(set);
            ((answer, set.len()), changed)
        })?;
        self.meta.len = len as u64;
        Ok(Some(answer))
    }

    pub fn len(&self) -> u64 {
        self.meta.len
    }

    pub fn is_empty(&self) -> bool {
        self.meta.len == 0
    }

    fn entry_key(&self, tag: u8, suffix: &[u8]) -> Bytes {
        entry_key(self.key, self.meta.id, tag, suffix)
    }

    fn directory(&mut self) -> DataResult<&mut Directory> {
        if self.directory.is_none() {
            let raw = self.engine.get(&self.entry_key(DIRECTORY, &[]))?.ok_or_else(corrupt)?;
            self.directory = Some(Directory::from_stored(raw)?);
        }
        Ok(self.directory.as_mut().expect("loaded"))
    }

    fn page_id(&mut self, index: usize) -> DataResult<u64> {
        Ok(self.directory()?.bound(index)?.page)
    }

    fn page(&mut self, page: u64) -> DataResult<&mut CachedPage> {
        if !self.pages.contains_key(&page) {
            let raw = self.engine.get(&self.entry_key(PAGE, &page.to_be_bytes()))?.ok_or_else(corrupt)?;
            let entries = decode_page(&raw)?;
            self.pages.insert(page, CachedPage { entries, in_engine: true, dirty: false, deleted: false });
        }
        Ok(self.pages.get_mut(&page).expect("loaded"))
    }

    /// The index in the directory of the page that holds (or would hold) an entry.
    fn page_index_for(&mut self, score: f64, member: &[u8]) -> DataResult<usize> {
        self.directory()?.index_for(score, member)
    }

    pub fn score(&mut self, member: &[u8]) -> DataResult<Option<f64>> {
        if let Some(score) = self.read_native(|set| set.score(member))? {
            return Ok(score);
        }
        if let Some(state) = self.members.get(member) {
            return Ok(state.current);
        }
        let stored = if self.in_engine {
            match self.engine.get(&self.entry_key(MEMBER, member))? {
                Some(raw) => Some(Reader::new(&raw).f64()?),
                None => None,
            }
        } else {
            None
        };
        self.members.insert(Bytes::copy_from_slice(member), MemberState { stored, current: stored });
        Ok(stored)
    }

    /// Sets a member's score; returns its previous score.
    pub fn insert(&mut self, member: &[u8], score: f64) -> DataResult<Option<f64>> {
        if let Some(previous) = self.write_native(|set| {
            let previous = set.insert(member, score);
            (previous, previous != Some(score))
        })? {
            return Ok(previous);
        }
        let previous = self.score(member)?;
        if previous == Some(score) {
            return Ok(previous);
        }
        if let Some(old) = previous {
            self.remove_from_page(member, old)?;
        } else {
            self.meta.len += 1;
        }
        let index = self.page_index_for(score, member)?;
        let page_id = self.page_id(index)?;
        let page = self.page(page_id)?;
        let at = page.entries.partition_point(|(s, m)| compare((*s, m), (score, member)).is_lt());
        page.entries.insert(at, (score, Bytes::copy_from_slice(member)));
        page.dirty = true;
        let overfull = page.entries.len() > PAGE_MAX;
        if overfull {
            let page = self.page(page_id)?;
            let upper = page.entries.split_off(page.entries.len() / 2);
            let new_page = self.meta.next_page;
            self.meta.next_page += 1;
            let bound = PageBound { score: upper[0].0, member: upper[0].1.clone(), page: new_page };
            self.pages.insert(
                new_page,
                CachedPage { entries: upper, in_engine: false, dirty: true, deleted: false },
            );
            self.directory()?.changed()?.insert(index + 1, bound);
            self.directory_dirty = true;
        }
        self.members.get_mut(member).expect("looked up").current = Some(score);
        Ok(previous)
    }

    /// Removes a member; returns its score if it was there.
    pub fn remove(&mut self, member: &[u8]) -> DataResult<Option<f64>> {
        if let Some(previous) = self.write_native(|set| {
            let previous = set.remove(member);
            (previous, previous.is_some())
        })? {
            return Ok(previous);
        }
        let previous = self.score(member)?;
        if let Some(old) = previous {
            self.remove_from_page(member, old)?;
            self.meta.len -= 1;
            self.members.get_mut(member).expect("looked up").current = None;
        }
        Ok(previous)
    }

    fn remove_from_page(&mut self, member: &[u8], score: f64) -> DataResult<()> {
        let index = self.page_index_for(score, member)?;
        let page_id = self.page_id(index)?;
        let page = self.page(page_id)?;
        let at = page
            .entries
            .binary_search_by(|(s, m)| compare((*s, m), (score, member)))
            .map_err(|_| corrupt())?;
        page.entries.remove(at);
        page.dirty = true;
        if page.entries.is_empty() {
            let directory = self.directory()?.changed()?;
            if directory.len() > 1 {
                directory.remove(index);
                if index == 0 {
                    directory[0] = lowest_bound(directory[0].page);
                }
                self.directory_dirty = true;
                self.pages.get_mut(&page_id).expect("loaded").deleted = true;
            }
        }
        Ok(())
    }

    /// Entries in score order from the first one at or after `from`, calling
    /// `visit` until it returns false.
    fn walk_forward(
        &mut self,
        from: Option<(f64, &[u8])>,
        mut visit: impl FnMut(f64, &[u8]) -> bool,
    ) -> DataResult<()> {
        if self.read_native(|set| set.walk_forward(from, &mut visit))?.is_some() {
            return Ok(());
        }
        let start = match from {
            Some((score, member)) => self.page_index_for(score, member)?,
            None => 0,
        };
        let page_count = self.directory()?.len();
        for index in start..page_count {
            let page_id = self.page_id(index)?;
            for (score, member) in &self.page(page_id)?.entries {
                if from.is_some_and(|from| compare((*score, member), from).is_lt()) {
                    continue;
                }
                if !visit(*score, member) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Entries in descending order from the last one whose score is at most `to`
    /// (below it if `exclusive`).
    fn walk_backward(
        &mut self,
        to: Option<ScoreBound>,
        mut visit: impl FnMut(f64, &[u8]) -> bool,
    ) -> DataResult<()> {
        let admits = |score: f64| to.is_none_or(|bound| bound.admits_from_above(score));
        if self.read_native(|set| set.walk_backward(admits, &mut visit))?.is_some() {
            return Ok(());
        }
        let directory = self.directory()?;
        let end = match to {
            Some(bound) => directory
                .partition_point(|page_score, _| {
                    page_score < bound.score || (!bound.exclusive && page_score == bound.score)
                })?
                .max(1),
            None => directory.len(),
        };
        for index in (0..end).rev() {
            let page_id = self.page_id(index)?;
            for (score, member) in self.page(page_id)?.entries.iter().rev() {
                if to.is_some_and(|bound| !bound.admits_from_above(*score)) {
                    continue;
                }
                if !visit(*score, member) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Members with scores between `min` and `max`, skipping `offset` and
    /// returning at most `limit`; descending when `reverse` (then `min` is the
    /// upper bound, as in ZREVRANGEBYSCORE).
    pub fn range_by_score(
        &mut self,
        min: ScoreBound,
        max: ScoreBound,
        reverse: bool,
        offset: usize,
        limit: usize,
    ) -> DataResult<Vec<(f64, Bytes)>> {
        let mut window = Window::new(offset, limit);
        if limit == 0 {
            return Ok(window.out);
        }
        if reverse {
            let (upper, lower) = (min, max);
            self.walk_backward(Some(upper), |score, member| {
                lower.admits_from_below(score) && window.take(score, member)
            })?;
        } else {
            self.walk_forward(Some((min.score, b"")), |score, member| {
                if !min.admits_from_below(score) {
                    return true;
                }
                max.admits_from_above(score) && window.take(score, member)
            })?;
        }
        Ok(window.out)
    }

    /// Members between `min` and `max` by member bytes, skipping `offset` and
    /// returning at most `limit`; descending when `reverse`. As Redis reads
    /// a set whose members share one score (the case the lexicographic
    /// commands are for, and the only one whose answer Redis defines): from
    /// the first member within the near bound, on while within the far one.
    pub fn range_by_lex(
        &mut self,
        min: &LexBound,
        max: &LexBound,
        reverse: bool,
        offset: usize,
        limit: usize,
    ) -> DataResult<Vec<(f64, Bytes)>> {
        let mut window = Window::new(offset, limit);
        if limit == 0 || self.is_empty() || LexBound::empty_between(min, max) {
            return Ok(window.out);
        }
        // Redis answers nothing unless the last member is within `min` and
        // the first within `max`, whatever lies between.
        let last = self.range_by_rank(0, 0, true)?;
        let first = self.range_by_rank(0, 0, false)?;
        if !min.admits_from_below(&last[0].1) || !max.admits_from_above(&first[0].1) {
            return Ok(window.out);
        }
        // The bound the walk meets first, and the one that ends it.
        let near = |member: &[u8]| {
            if reverse {
                max.admits_from_above(member)
            } else {
                min.admits_from_below(member)
            }
        };
        let far_admits = |member: &[u8]| {
            if reverse {
                min.admits_from_below(member)
            } else {
                max.admits_from_above(member)
            }
        };
        let mut started = false;
        let mut visit = |score: f64, member: &[u8]| -> bool {
            if !started {
                if !near(member) {
                    return true;
                }
                started = true;
            }
            far_admits(member) && window.take(score, member)
        };
        if reverse {
            self.walk_backward(None, visit)?;
        } else {
            // Members before `min` at the first score come first: start there.
            let from = match min {
                LexBound::Inclusive(bound) | LexBound::Exclusive(bound) => Some((first[0].0, bound.clone())),
                _ => None,
            };
            self.walk_forward(from.as_ref().map(|(score, bound)| (*score, &bound[..])), &mut visit)?;
        }
        Ok(window.out)
    }

    /// Up to `count` members after `after` (a score and member) in set
    /// order, from the first when None.
    pub fn entries_after(
        &mut self,
        after: Option<(f64, &[u8])>,
        count: usize,
    ) -> DataResult<Vec<(f64, Bytes)>> {
        let mut out = Vec::new();
        if count == 0 {
            return Ok(out);
        }
        self.walk_forward(after, |score, member| {
            if after.is_some_and(|after| compare((score, member), after).is_le()) {
                return true;
            }
            out.push((score, Bytes::copy_from_slice(member)));
            out.len() < count
        })?;
        Ok(out)
    }

    /// Members ranked `start..=stop` (0-based, in score order or descending).
    pub fn range_by_rank(&mut self, start: u64, stop: u64, reverse: bool) -> DataResult<Vec<(f64, Bytes)>> {
        let mut out = Vec::new();
        let mut rank = 0u64;
        let mut take = |score: f64, member: &[u8]| {
            if rank >= start {
                out.push((score, Bytes::copy_from_slice(member)));
            }
            rank += 1;
            rank <= stop
        };
        if start <= stop {
            if reverse {
                self.walk_backward(None, &mut take)?;
            } else {
                self.walk_forward(None, &mut take)?;
            }
        }
        Ok(out)
    }

    /// A member's 0-based rank, ascending or descending.
    pub fn rank(&mut self, member: &[u8], reverse: bool) -> DataResult<Option<(u64, f64)>> {
        let Some(score) = self.score(member)? else { return Ok(None) };
        let mut below = 0u64;
        self.walk_forward(None, |entry_score, entry_member| {
            let before = compare((entry_score, entry_member), (score, member)).is_lt();
            if before {
                below += 1;
            }
            before
        })?;
        let rank = if reverse { self.meta.len - 1 - below } else { below };
        Ok(Some((rank, score)))
    }

    /// How many members have scores between `min` and `max`.
    pub fn count(&mut self, min: ScoreBound, max: ScoreBound) -> DataResult<u64> {
        let mut count = 0;
        self.walk_forward(Some((min.score, b"")), |score, _| {
            if min.admits_from_below(score) {
                if !max.admits_from_above(score) {
                    return false;
                }
                count += 1;
            }
            true
        })?;
        Ok(count)
    }

    /// Writes the changes; an emptied set is deleted, as in Redis. `reserved`
    /// counts the table's reserved entries (DBSIZE leaves them out).
    pub fn commit(mut self, reserved: &ReservedEntries) -> DataResult<()> {
        if let Some(held) = self.native.take() {
            let stub = || typed::encode(Kind::SortedSet, self.meta.expires_at_ms, NATIVE);
            return held.commit(self.engine, self.key, self.meta.len, stub);
        }
        let mut changes = Changes::default();
        let emptied = self.meta.len == 0;
        for (member, state) in std::mem::take(&mut self.members) {
            if state.current != state.stored {
                let value = state.current.map(|score| Bytes::copy_from_slice(&score.to_bits().to_le_bytes()));
                changes.note(self.entry_key(MEMBER, &member), value, state.stored.is_some());
            }
        }
        let pages: BTreeMap<u64, CachedPage> = std::mem::take(&mut self.pages).into_iter().collect();
        for (page_id, page) in pages {
            let removed = page.deleted || emptied;
            if page.dirty || removed {
                let value = (!removed).then(|| encode_page(&page.entries));
                if value.is_some() || page.in_engine {
                    changes.note(self.entry_key(PAGE, &page_id.to_be_bytes()), value, page.in_engine);
                }
            }
        }
        if emptied {
            if self.in_engine {
                changes.note(self.entry_key(DIRECTORY, &[]), None, true);
            }
        } else if self.directory_dirty || !self.in_engine {
            let directory = self.directory.as_ref().expect("a changed set has its directory").encode()?;
            changes.note(self.entry_key(DIRECTORY, &[]), Some(directory), self.in_engine);
        }
        if changes.is_empty() {
            // Nothing changed (a set's size and pages change only with its entries).
            return Ok(());
        }
        let main = (!emptied).then(|| self.meta.encode());
        changes.commit(self.engine, self.key, self.meta.id, main, reserved)
    }
}

/// The entry stored at `at` in a page: its score, where its member lies,
/// and where it ends.
fn page_entry_at(raw: &[u8], at: usize) -> DataResult<(f64, std::ops::Range<usize>, usize)> {
    let score = raw.get(at..at + 8).ok_or_else(corrupt)?;
    let score = f64::from_bits(u64::from_le_bytes(score.try_into().expect("8 bytes")));
    let member = stored_bytes(raw, at + 8)?;
    let end = member.end;
    Ok((score, member, end))
}

/// How many entries a stored page holds.
fn page_len(raw: &[u8]) -> DataResult<usize> {
    let (mut at, mut held) = (0, 0);
    while at < raw.len() {
        at = page_entry_at(raw, at)?.2;
        held += 1;
    }
    Ok(held)
}

/// Where (score, member) belongs in a stored page: the offset of the first
/// entry after it, and whether the entry itself is there (its range). The
/// walk stops there unless `count_all`, which also counts the entries.
fn page_slot(
    raw: &[u8],
    score: f64,
    member: &[u8],
    count_all: bool,
) -> DataResult<(usize, Option<std::ops::Range<usize>>, usize)> {
    let (mut at, mut held, mut slot, mut found) = (0, 0, None, None);
    while at < raw.len() {
        let (stored_score, stored_member, end) = page_entry_at(raw, at)?;
        match compare((stored_score, &raw[stored_member]), (score, member)) {
            Ordering::Less => {}
            Ordering::Equal => found = Some(at..end),
            Ordering::Greater if !count_all => return Ok((at, found, held)),
            Ordering::Greater => {
                slot.get_or_insert(at);
            }
        }
        held += 1;
        at = end;
    }
    Ok((slot.unwrap_or(raw.len()), found, held))
}

/// The set's header, when there is a live paged set at `key`.
fn read_meta(engine: &dyn Engine, key: &[u8], now_ms: u64) -> DataResult<Option<Meta>> {
    read_kind(engine, key, Kind::SortedSet, now_ms)?
        .filter(|stored| stored.payload != NATIVE)
        .map(|stored| Meta::decode(&stored.payload, stored.expires_at_ms))
        .transpose()
}

/// The page a (score, member) entry belongs in.
fn page_for(directory: &Directory, score: f64, member: &[u8]) -> DataResult<u64> {
    directory.bound(directory.index_for(score, member)?).map(|bound| bound.page)
}

/// ZADD of one member where the set lies ([`typed::edits_in_place`]): the
/// member's page (and the page it leaves), its score entry and the header's
/// count, changed in place; `allows` says whether the member may take
/// `score` given its present one. The member's previous score, or `None`
/// when the change needs the general path ([`SortedSet`]): no set yet, or a
/// page that would split or empty (which changes the directory).
pub fn insert_in_place(
    engine: &dyn Engine,
    key: &[u8],
    member: &[u8],
    score: f64,
    allows: impl Fn(Option<f64>) -> bool,
    now_ms: u64,
    reserved: &ReservedEntries,
) -> DataResult<Option<Option<f64>>> {
    let native = edit_native(engine, key, Kind::SortedSet, now_ms, |set: &mut NativeSortedSet| {
        let previous = set.score(member);
        if !allows(previous) || previous == Some(score) {
            return Edit::Unchanged(previous);
        }
        set.insert(member, score);
        Edit::Changed(previous)
    })?;
    if native.is_some() {
        return Ok(native);
    }
    if !typed::edits_in_place(engine) {
        return Ok(None);
    }
    let Some(meta) = read_meta(engine, key, now_ms)? else { return Ok(None) };
    let name = |tag: u8, suffix: &[u8]| entry_key(key, meta.id, tag, suffix);
    let member_key = name(MEMBER, member);
    let previous = match engine.get(&member_key)? {
        Some(raw) => Some(Reader::new(&raw).f64()?),
        None => None,
    };
    if !allows(previous) || previous == Some(score) {
        return Ok(Some(previous));
    }
    let directory = Directory::from_stored(engine.get(&name(DIRECTORY, &[]))?.ok_or_else(corrupt)?)?;
    let target = page_for(&directory, score, member)?;
    let source = previous.map(|old| page_for(&directory, old, member)).transpose()?;
    let moving_pages = source.is_some_and(|source| source != target);
    if moving_pages {
        // A page the member leaves empty changes the directory.
        let mut held = Ok(0);
        engine.get_with(&name(PAGE, &source.expect("moving").to_be_bytes()), &mut |raw| {
            held = raw.ok_or_else(corrupt).and_then(page_len);
        })?;
        if held? < 2 {
            return Ok(None);
        }
    }
    let inserted = typed::edit_value(engine, &name(PAGE, &target.to_be_bytes()), |stored| {
        let raw = stored.as_mut().ok_or_else(corrupt)?;
        if let (Some(old), false) = (previous, moving_pages) {
            let (_, found, _) = page_slot(raw, old, member, false)?;
            raw.drain(found.ok_or_else(corrupt)?);
        }
        // Only an entry moving in can fill the page: one that loses an entry first never does.
        let moving_in = previous.is_none() || moving_pages;
        let (at, _, held) = page_slot(raw, score, member, moving_in)?;
        if moving_in && held >= PAGE_MAX {
            return Ok(Edit::Declined);
        }
        let length = (member.len() as u32).to_le_bytes();
        let entry = score.to_bits().to_le_bytes().into_iter().chain(length).chain(member.iter().copied());
        raw.splice(at..at, entry);
        Ok(Edit::Changed(()))
    })?;
    if inserted.is_none() {
        return Ok(None);
    }
    if let (Some(old), Some(source), true) = (previous, source, moving_pages) {
        typed::edit_value(engine, &name(PAGE, &source.to_be_bytes()), |stored| {
            let raw = stored.as_mut().ok_or_else(corrupt)?;
            let (_, found, _) = page_slot(raw, old, member, false)?;
            raw.drain(found.ok_or_else(corrupt)?);
            Ok(Edit::Changed(()))
        })?;
    }
    reserved.change(|| {
        engine.put(&member_key, Bytes::copy_from_slice(&score.to_bits().to_le_bytes()))?;
        Ok(((), i64::from(previous.is_none())))
    })?;
    if previous.is_none() {
        typed::add_to_count(engine, key, Kind::SortedSet, now_ms, Meta::LEN_AT, 1)?;
    }
    Ok(Some(previous))
}

/// ZPOPMIN and ZPOPMAX of one member where the set lies, as
/// [`insert_in_place`] adds: the (score, member) taken, or `None` when the
/// pop needs the general path (no set, or one that would empty a page).
pub fn pop_in_place(
    engine: &dyn Engine,
    key: &[u8],
    max: bool,
    now_ms: u64,
    reserved: &ReservedEntries,
) -> DataResult<Option<(f64, Bytes)>> {
    let native =
        edit_native(engine, key, Kind::SortedSet, now_ms, |set: &mut NativeSortedSet| match set.len() {
            // The last member: the general path deletes the set.
            0 | 1 => Edit::Declined,
            _ => set
                .pop(max)
                .map_or(Edit::Declined, |(score, member)| Edit::Changed((score, Bytes::from(member)))),
        })?;
    if native.is_some() {
        return Ok(native);
    }
    if !typed::edits_in_place(engine) {
        return Ok(None);
    }
    let Some(meta) = read_meta(engine, key, now_ms)? else { return Ok(None) };
    if meta.len < 2 {
        return Ok(None);
    }
    let name = |tag: u8, suffix: &[u8]| entry_key(key, meta.id, tag, suffix);
    let directory = Directory::from_stored(engine.get(&name(DIRECTORY, &[]))?.ok_or_else(corrupt)?)?;
    let page = directory.bound(if max { directory.len() - 1 } else { 0 })?.page;
    let popped = typed::edit_value(engine, &name(PAGE, &page.to_be_bytes()), |stored| {
        let raw = stored.as_mut().ok_or_else(corrupt)?;
        // The first entry, or walked to the last.
        let mut taken = 0..page_entry_at(raw, 0)?.2;
        while max && taken.end < raw.len() {
            taken = taken.end..page_entry_at(raw, taken.end)?.2;
        }
        // A page left empty changes the directory: the general path.
        if taken.start == 0 && taken.end == raw.len() {
            return Ok(Edit::Declined);
        }
        let (score, member, _) = page_entry_at(raw, taken.start)?;
        let member = Bytes::copy_from_slice(&raw[member]);
        raw.drain(taken);
        Ok(Edit::Changed((score, member)))
    })?;
    let Some((score, member)) = popped else { return Ok(None) };
    reserved.change(|| {
        let removed = engine.delete(&name(MEMBER, &member))?;
        Ok(((), -i64::from(removed)))
    })?;
    typed::add_to_count(engine, key, Kind::SortedSet, now_ms, Meta::LEN_AT, -1)?;
    Ok(Some((score, member)))
}

/// The id of the paged set whose stored value (payload) this is; a native
/// set has none.
pub fn id_of(payload: &[u8]) -> DataResult<Option<u64>> {
    if payload == NATIVE {
        return Ok(None);
    }
    Ok(Some(Meta::decode(payload, None)?.id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collection::{for_each_reserved, is_orphan, parse_entry_key, IdOf};

    const ID_OF: IdOf = |kind, payload| if kind == Kind::SortedSet { id_of(payload) } else { Ok(None) };
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;
    use tessera_engine::{MemoryEngine, OrderedEngine};

    fn model_entries(model: &BTreeMap<Vec<u8>, f64>) -> Vec<(f64, Bytes)> {
        let mut entries: Vec<(f64, Bytes)> =
            model.iter().map(|(member, score)| (*score, Bytes::from(member.clone()))).collect();
        entries.sort_by(|a, b| compare((a.0, &a.1), (b.0, &b.1)));
        entries
    }

    /// ZADDs and pops where the set lies, falling back to the general path
    /// as the commands do, mixed with general removals: held to a model
    /// through page splits and pages emptied, with every member's score
    /// entry and the count of reserved entries kept exact.
    #[test]
    fn changes_in_place_match_a_model() {
        let engines: [&dyn Engine; 2] = [&MemoryEngine::new(), &OrderedEngine::new()];
        for engine in engines {
            changes_in_place_match_a_model_on(engine);
        }
    }

    fn changes_in_place_match_a_model_on(engine: &dyn Engine) {
        let reserved = ReservedEntries::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut model: BTreeMap<Vec<u8>, f64> = BTreeMap::new();
        let (mut in_place, mut general) = (0, 0);
        for round in 0..12_000 {
            let growing = (round / 3000) % 2 == 0;
            match rng.gen_range(0..10) {
                0..=5 if growing || rng.gen_bool(0.3) => {
                    let member = format!("m{}", rng.gen_range(0..2000)).into_bytes();
                    let score = rng.gen_range(0..300) as f64;
                    let only_greater = rng.gen_bool(0.2);
                    let allows = |old: Option<f64>| !only_greater || old.is_none_or(|old| score > old);
                    let old = model.get(&member).copied();
                    if allows(old) {
                        model.insert(member.clone(), score);
                    }
                    match insert_in_place(engine, b"z", &member, score, allows, 0, &reserved).unwrap() {
                        Some(previous) => {
                            in_place += 1;
                            assert_eq!(previous, old, "round {round}");
                        }
                        None => {
                            general += 1;
                            let mut set = SortedSet::open_or_new(engine, b"z", 0).unwrap();
                            if allows(set.score(&member).unwrap()) {
                                set.insert(&member, score).unwrap();
                            }
                            set.commit(&reserved).unwrap();
                        }
                    }
                }
                0..=8 => {
                    let max = rng.gen_bool(0.5);
                    let expected = model_entries(&model);
                    let expected = if max { expected.last() } else { expected.first() }.cloned();
                    let popped = match pop_in_place(engine, b"z", max, 0, &reserved).unwrap() {
                        Some(popped) => Some(popped),
                        None => SortedSet::open(engine, b"z", 0).unwrap().and_then(|mut set| {
                            let taken = set.range_by_rank(0, 0, max).unwrap().pop()?;
                            set.remove(&taken.1).unwrap();
                            set.commit(&reserved).unwrap();
                            Some(taken)
                        }),
                    };
                    assert_eq!(popped, expected, "round {round}");
                    if let Some((_, member)) = popped {
                        model.remove(&member[..]);
                    }
                }
                _ => {
                    let member = format!("m{}", rng.gen_range(0..2000)).into_bytes();
                    if let Some(mut set) = SortedSet::open(engine, b"z", 0).unwrap() {
                        assert_eq!(set.remove(&member).unwrap(), model.remove(&member));
                        set.commit(&reserved).unwrap();
                    }
                }
            }
            if round % 89 == 0 || round == 11_999 {
                let mut set = SortedSet::open_or_new(engine, b"z", 0).unwrap();
                assert_eq!(set.len(), model.len() as u64, "round {round}");
                let entries = if model.is_empty() {
                    Vec::new()
                } else {
                    set.range_by_rank(0, set.len() - 1, false).unwrap()
                };
                assert_eq!(entries, model_entries(&model), "round {round}");
                for (member, score) in &model {
                    assert_eq!(set.score(member).unwrap(), Some(*score), "round {round}");
                }
                let mut stored = 0;
                for_each_reserved(engine, |_, _| stored += 1).unwrap();
                assert_eq!(reserved.count(), stored, "round {round}: reserved entries counted");
            }
        }
        // A native set takes the general path only to be made and emptied.
        let general_least = if engine.keeps_native() { 1 } else { 40 };
        assert!(in_place > 4000 && general > general_least, "{in_place} in place, {general} general");
    }

    /// A member that would leave its page empty takes the general path,
    /// which drops the page from the directory: no empty page is left for
    /// a later pop to meet.
    #[test]
    fn a_move_that_would_empty_a_page_takes_the_general_path() {
        let engine = OrderedEngine::new();
        let reserved = ReservedEntries::default();
        let mut set = SortedSet::open_or_new(&engine, b"z", 0).unwrap();
        for n in 0..=PAGE_MAX {
            set.insert(format!("m{n:03}").as_bytes(), n as f64).unwrap();
        }
        set.commit(&reserved).unwrap();
        // Leave the lowest page with one member, m000.
        let mut set = SortedSet::open(&engine, b"z", 0).unwrap().unwrap();
        let lowest_page = set.page_id(0).unwrap();
        let lowest_page_len = set.page(lowest_page).unwrap().entries.len();
        assert!(lowest_page_len > 1 && set.directory().unwrap().len() == 2, "the set split once");
        for n in 1..lowest_page_len {
            set.remove(format!("m{n:03}").as_bytes()).unwrap();
        }
        set.commit(&reserved).unwrap();
        let allows = |_: Option<f64>| true;
        assert_eq!(insert_in_place(&engine, b"z", b"m000", 1000.0, allows, 0, &reserved).unwrap(), None);
        let mut set = SortedSet::open(&engine, b"z", 0).unwrap().unwrap();
        set.insert(b"m000", 1000.0).unwrap();
        set.commit(&reserved).unwrap();
        let lowest = format!("m{lowest_page_len:03}");
        let popped = pop_in_place(&engine, b"z", false, 0, &reserved).unwrap();
        assert_eq!(popped, Some((lowest_page_len as f64, Bytes::from(lowest))));
    }

    #[test]
    fn scores_parse_like_redis() {
        assert_eq!(parse_score(b"1.5").unwrap(), 1.5);
        assert_eq!(parse_score(b"-inf").unwrap(), f64::NEG_INFINITY);
        assert_eq!(parse_score(b"+inf").unwrap(), f64::INFINITY);
        assert_eq!(parse_score(b"-0").unwrap().to_bits(), 0.0f64.to_bits());
        for bad in [&b""[..], b"nan", b"abc", b" 1", b"1 ", b"1x"] {
            assert!(parse_score(bad).is_err(), "{bad:?}");
        }
        let bound = ScoreBound::parse(b"(3").unwrap();
        assert!(bound.exclusive && bound.score == 3.0);
        assert!(ScoreBound::parse(b"(").is_err());
    }

    /// Random changes across many page splits and merges, held to a model after
    /// every commit, on a volatile and a persistent engine.
    #[test]
    fn changes_match_a_model() {
        let dir = tempfile::tempdir().unwrap();
        let log = tessera_engine::LogEngine::open(dir.path(), Default::default()).unwrap();
        let engines: [&dyn Engine; 3] = [&MemoryEngine::new(), &OrderedEngine::new(), &log];
        for engine in engines {
            let reserved = ReservedEntries::default();
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut model: BTreeMap<Vec<u8>, f64> = BTreeMap::new();
            for round in 0..300 {
                let mut set = SortedSet::open_or_new(engine, b"z", 0).unwrap();
                for _ in 0..rng.gen_range(1..40) {
                    let member = format!("m{}", rng.gen_range(0..2000)).into_bytes();
                    if rng.gen_bool(if round < 150 { 0.8 } else { 0.3 }) {
                        let score = f64::from(rng.gen_range(-50..50));
                        assert_eq!(set.insert(&member, score).unwrap(), model.insert(member, score));
                    } else {
                        assert_eq!(set.remove(&member).unwrap(), model.remove(&member));
                    }
                }
                set.commit(&reserved).unwrap();
                let expected = model_entries(&model);
                let Some(mut set) = SortedSet::open(engine, b"z", 0).unwrap() else {
                    assert!(model.is_empty());
                    continue;
                };
                assert_eq!(set.len(), model.len() as u64);
                assert_eq!(set.range_by_rank(0, u64::MAX, false).unwrap(), expected);
                let mut reversed = expected.clone();
                reversed.reverse();
                assert_eq!(set.range_by_rank(0, u64::MAX, true).unwrap(), reversed);
                let (low, high) = (f64::from(rng.gen_range(-60..60)), f64::from(rng.gen_range(-60..60)));
                for (min_open, max_open) in [(false, false), (true, false), (false, true), (true, true)] {
                    let min = ScoreBound { score: low, exclusive: min_open };
                    let max = ScoreBound { score: high, exclusive: max_open };
                    let inside: Vec<_> = expected
                        .iter()
                        .filter(|(score, _)| min.admits_from_below(*score) && max.admits_from_above(*score))
                        .cloned()
                        .collect();
                    assert_eq!(set.range_by_score(min, max, false, 0, usize::MAX).unwrap(), inside);
                    assert_eq!(set.count(min, max).unwrap(), inside.len() as u64);
                    let mut inside_reversed = inside.clone();
                    inside_reversed.reverse();
                    assert_eq!(set.range_by_score(max, min, true, 0, usize::MAX).unwrap(), inside_reversed);
                    let window: Vec<_> = inside.iter().skip(3).take(5).cloned().collect();
                    assert_eq!(set.range_by_score(min, max, false, 3, 5).unwrap(), window);
                }
                if let Some((member, score)) = model.iter().nth(model.len() / 2) {
                    let rank = expected.iter().position(|(_, m)| m.as_ref() == member.as_slice()).unwrap();
                    assert_eq!(set.rank(member, false).unwrap(), Some((rank as u64, *score)));
                    assert_eq!(
                        set.rank(member, true).unwrap(),
                        Some(((model.len() - 1 - rank) as u64, *score))
                    );
                }
            }
            // Every reserved entry is counted and belongs to the live set.
            let mut live = BTreeSet::new();
            for_each_reserved(engine, |key, _| {
                assert!(!is_orphan(engine, key, 0, ID_OF).unwrap());
                live.insert(key.to_vec());
            })
            .unwrap();
            assert_eq!(reserved.count(), live.len() as u64);
            let pages = live.iter().filter(|key| parse_entry_key(key).is_some_and(|(_, _, tag)| tag == PAGE));
            if engine.keeps_native() {
                assert_eq!(pages.count(), 0, "a native set has no entries of its own");
            } else {
                assert!(pages.count() >= 3, "the set spans several pages");
            }
        }
    }

    #[test]
    fn replaced_sets_leave_orphans_for_the_sweep() {
        let engine = OrderedEngine::new();
        let reserved = ReservedEntries::default();
        let mut set = SortedSet::open_or_new(&engine, b"z", 0).unwrap();
        set.insert(b"a", 1.0).unwrap();
        set.commit(&reserved).unwrap();
        engine.put(b"z", typed::encode(Kind::String, None, b"plain")).unwrap();
        for_each_reserved(&engine, |key, _| assert!(is_orphan(&engine, key, 0, ID_OF).unwrap())).unwrap();
    }
}
