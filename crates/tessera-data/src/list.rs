//! Lists over any engine, atomic per key (changed under the key's lock):
//! Redis's quicklist over engine entries. A small list is one value; past
//! [`INLINE_ELEMENTS_MAX`] elements or [`INLINE_BYTES_MAX`] bytes it becomes a
//! header and a doubly linked chain of pages, so that a push or a pop reads
//! and writes the header and one end page whatever the list's length:
//!
//! ```text
//! key   'l' value, inline: 0 | (len u32, element) × n
//!       'l' value, paged:  1 | id u64 | length u64 | head page u64 | tail page u64 | next page id u64
//!       'l' value, native: 2
//! R | key_len u32 | key | id | 'p' | page id u64 BE    prev u64 | next u64 | (len u32, element) × n
//! ```
//!
//! Page ids start at 1; 0 links to nothing. The pages are named and collected
//! as every collection's entries are ([`crate::collection`]). An inline list
//! is handled as a chain of one page (id 0) kept inside the value.
//!
//! On an engine that keeps native values ([`Engine::keeps_native`]) a list
//! that outgrows its inline form becomes a deque in the engine's memory
//! instead ([`NativeList`]), attached to a value that only marks it.

use std::collections::{HashMap, VecDeque};

use bytes::{BufMut, Bytes, BytesMut};
use tessera_engine::Engine;

use crate::collection::{corrupt, entry_key, put_bytes, stored_bytes, Changes, Reader};
use crate::native::{edit_native, Held};
use crate::native_list::NativeList;
use crate::typed::{self, read_kind, Edit, Kind, ReservedEntries};
use crate::DataResult;

/// The most elements and bytes a list keeps in its value (near Redis's own
/// listpack limits).
pub const INLINE_ELEMENTS_MAX: usize = 128;
pub const INLINE_BYTES_MAX: usize = 8 << 10;
/// A page takes elements until it holds this many, or this many bytes.
const PAGE_ELEMENTS_MAX: usize = 128;
const PAGE_BYTES_MAX: usize = 32 << 10;

const INLINE: u8 = 0;
const PAGED: u8 = 1;
const NATIVE: u8 = 2;
const PAGE: u8 = b'p';
/// The page id of an inline list's elements, and the end of a chain.
const NONE: u64 = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Front,
    Back,
}

impl End {
    pub fn other(self) -> Self {
        match self {
            End::Front => End::Back,
            End::Back => End::Front,
        }
    }
}

struct Page {
    prev: u64,
    next: u64,
    elements: Elements,
    in_engine: bool,
    dirty: bool,
    deleted: bool,
}

impl Page {
    fn new(prev: u64, next: u64) -> Self {
        Self { prev, next, elements: Elements::default(), in_engine: false, dirty: true, deleted: false }
    }

    fn bytes(&self) -> usize {
        self.elements.bytes()
    }

    fn full(&self) -> bool {
        self.elements.len() >= PAGE_ELEMENTS_MAX || self.bytes() >= PAGE_BYTES_MAX
    }

    fn overfull(&self) -> bool {
        self.elements.len() > 1 && (self.elements.len() > PAGE_ELEMENTS_MAX || self.bytes() > PAGE_BYTES_MAX)
    }

    fn link(&self, toward: End) -> u64 {
        match toward {
            End::Front => self.prev,
            End::Back => self.next,
        }
    }

    fn set_link(&mut self, toward: End, page: u64) {
        match toward {
            End::Front => self.prev = page,
            End::Back => self.next = page,
        }
        self.dirty = true;
    }

    fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(16 + self.bytes());
        out.put_u64_le(self.prev);
        out.put_u64_le(self.next);
        self.elements.write_to(&mut out);
        out.freeze()
    }

    /// The elements, to be changed (the page is marked so): a page already
    /// changed in this call is decoded, so that a command pushing many
    /// elements copies the stored form once, not once per element.
    fn changing(&mut self) -> DataResult<&mut Elements> {
        if self.dirty {
            self.elements.decoded()?;
        }
        self.dirty = true;
        Ok(&mut self.elements)
    }

    fn decode(raw: &Bytes) -> DataResult<Self> {
        let mut reader = Reader::new(raw);
        let (prev, next) = (reader.u64()?, reader.u64()?);
        let elements = Elements::encoded(raw.slice(16..))?;
        Ok(Self { prev, next, elements, in_engine: true, dirty: false, deleted: false })
    }
}

/// A page's elements, `(len u32, element) × n`. They stay as stored until an
/// operation needs them one by one: a push or a pop at either end works on
/// the stored form (one copy of the page for a push, none for a pop), so a
/// queue's LPUSH and RPOP do no work per element of the page.
enum Elements {
    Encoded { raw: Bytes, count: usize },
    Decoded(VecDeque<Bytes>),
}

impl Default for Elements {
    fn default() -> Self {
        Elements::Encoded { raw: Bytes::new(), count: 0 }
    }
}

/// How many elements `(len u32, element) × n` holds, their lengths checked.
fn count_stored(raw: &[u8]) -> DataResult<usize> {
    let mut count = 0;
    let mut at = 0;
    while at < raw.len() {
        at = stored_bytes(raw, at)?.end;
        count += 1;
    }
    Ok(count)
}

impl Elements {
    /// Stored elements, their lengths checked.
    fn encoded(raw: Bytes) -> DataResult<Self> {
        Ok(Elements::Encoded { count: count_stored(&raw)?, raw })
    }

    fn len(&self) -> usize {
        match self {
            Elements::Encoded { count, .. } => *count,
            Elements::Decoded(elements) => elements.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes as stored.
    fn bytes(&self) -> usize {
        match self {
            Elements::Encoded { raw, .. } => raw.len(),
            Elements::Decoded(elements) => elements.iter().map(|element| element.len() + 4).sum(),
        }
    }

    /// The elements one by one, decoded now if they were not.
    fn decoded(&mut self) -> DataResult<&mut VecDeque<Bytes>> {
        if let Elements::Encoded { raw, count } = self {
            let mut elements = VecDeque::with_capacity(*count);
            let mut reader = Reader::new(raw);
            while !reader.done() {
                elements.push_back(reader.bytes()?);
            }
            *self = Elements::Decoded(elements);
        }
        match self {
            Elements::Decoded(elements) => Ok(elements),
            Elements::Encoded { .. } => unreachable!("decoded above"),
        }
    }

    fn push(&mut self, end: End, element: Bytes) {
        match self {
            Elements::Encoded { raw, count } => {
                let mut grown = BytesMut::with_capacity(raw.len() + 4 + element.len());
                if end == End::Back {
                    grown.extend_from_slice(raw);
                }
                put_bytes(&mut grown, &element);
                if end == End::Front {
                    grown.extend_from_slice(raw);
                }
                *raw = grown.freeze();
                *count += 1;
            }
            Elements::Decoded(elements) if end == End::Front => elements.push_front(element),
            Elements::Decoded(elements) => elements.push_back(element),
        }
    }

    fn pop(&mut self, end: End) -> DataResult<Option<Bytes>> {
        match self {
            Elements::Encoded { count: 0, .. } => Ok(None),
            Elements::Encoded { raw, count } => {
                // Where the element's length is stored, and its bytes.
                let (start, element) = match end {
                    End::Front => (0, stored_bytes(raw, 0)?),
                    End::Back => {
                        let (mut start, mut element) = (0, stored_bytes(raw, 0)?);
                        while element.end < raw.len() {
                            start = element.end;
                            element = stored_bytes(raw, start)?;
                        }
                        (start, element)
                    }
                };
                let element_end = element.end;
                let element = raw.slice(element);
                *raw = match end {
                    End::Front => raw.slice(element_end..),
                    End::Back => raw.slice(..start),
                };
                *count -= 1;
                Ok(Some(element))
            }
            Elements::Decoded(elements) if end == End::Front => Ok(elements.pop_front()),
            Elements::Decoded(elements) => Ok(elements.pop_back()),
        }
    }

    fn write_to(&self, out: &mut BytesMut) {
        match self {
            Elements::Encoded { raw, .. } => out.extend_from_slice(raw),
            Elements::Decoded(elements) => {
                for element in elements {
                    put_bytes(out, element);
                }
            }
        }
    }
}

/// Pushes `elements` one by one to `end` of the stored elements that begin at
/// `base` in `value` (a list's value or a page), where they lie.
fn insert_stored(value: &mut Vec<u8>, base: usize, end: End, elements: &[&[u8]]) {
    let added: usize = elements.iter().map(|element| 4 + element.len()).sum();
    let at = match end {
        End::Front => base,
        End::Back => value.len(),
    };
    let old_len = value.len();
    value.resize(old_len + added, 0);
    value.copy_within(at..old_len, at + added);
    let mut written = at;
    let mut write = |element: &&[u8]| {
        value[written..written + 4].copy_from_slice(&(element.len() as u32).to_le_bytes());
        value[written + 4..written + 4 + element.len()].copy_from_slice(element);
        written += 4 + element.len();
    };
    // The last element pushed to the front ends up first.
    match end {
        End::Front => elements.iter().rev().for_each(&mut write),
        End::Back => elements.iter().for_each(&mut write),
    }
}

/// Pops `count` of the `held` stored elements that begin at `base` in
/// `value` from `end`, where they lie: the popped elements, in the order
/// popped. `count` is below `held`.
fn take_stored(
    value: &mut Vec<u8>,
    base: usize,
    end: End,
    count: usize,
    held: usize,
) -> DataResult<Vec<Bytes>> {
    debug_assert!(count < held);
    let kept_before = match end {
        End::Front => count,
        End::Back => held - count,
    };
    let mut boundary = base;
    for _ in 0..kept_before {
        boundary = stored_bytes(value, boundary)?.end;
    }
    let (from, to) = match end {
        End::Front => (base, boundary),
        End::Back => (boundary, value.len()),
    };
    let mut popped = Vec::with_capacity(count);
    let mut at = from;
    while at < to {
        let element = stored_bytes(value, at)?;
        at = element.end;
        popped.push(Bytes::copy_from_slice(&value[element]));
    }
    if end == End::Back {
        popped.reverse();
    }
    value.drain(from..to);
    Ok(popped)
}

/// A paged list's header: `PAGED | id | length | head | tail | next page id`.
struct PagedHeader {
    id: u64,
    len: u64,
    head: u64,
    tail: u64,
    next_page: u64,
}

impl PagedHeader {
    /// Where the length lies in the payload.
    const LEN_AT: usize = 9;

    /// The header of a paged list's payload (its first byte `PAGED`).
    fn read(payload: &[u8]) -> DataResult<Self> {
        let word = |at: usize| -> DataResult<u64> {
            let bytes = payload.get(at..at + 8).ok_or_else(corrupt)?;
            Ok(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
        };
        Ok(Self {
            id: word(1)?,
            len: word(Self::LEN_AT)?,
            head: word(17)?,
            tail: word(25)?,
            next_page: word(33)?,
        })
    }

    fn outer(&self, end: End) -> u64 {
        match end {
            End::Front => self.head,
            End::Back => self.tail,
        }
    }
}

/// How much an inline list or a page may hold.
struct Room {
    elements: usize,
    bytes: usize,
}

const INLINE_ROOM: Room = Room { elements: INLINE_ELEMENTS_MAX, bytes: INLINE_BYTES_MAX };
const PAGE_ROOM: Room = Room { elements: PAGE_ELEMENTS_MAX, bytes: PAGE_BYTES_MAX };

/// What the in-place paths found at a list's key.
enum Form<T> {
    /// An inline list, already changed: its new length, and the edit's answer.
    Inline(u64, T),
    /// A paged list, its length already changed.
    Paged(PagedHeader),
}

/// Changes a list's length by `delta` at `end`, where it lies: `edit` gets
/// the inline list's value, or the paged list's end page (its stored
/// length changed first, and changed back if the page's edit declines or
/// fails), with where the stored elements begin, how many it holds and how
/// many it may. The new length and the edit's answer; `None` when it
/// declined, or the list would empty.
fn edit_end<T>(
    engine: &dyn Engine,
    key: &[u8],
    end: End,
    delta: i64,
    now_ms: u64,
    mut edit: impl FnMut(&mut Vec<u8>, usize, usize, &Room) -> DataResult<Option<T>>,
) -> DataResult<Option<(u64, T)>> {
    let form = typed::edit_live(engine, key, Kind::List, now_ms, |value, start| {
        match *value.get(start).ok_or_else(corrupt)? {
            INLINE => {
                let held = count_stored(&value[start + 1..])?;
                let len = (held as u64).wrapping_add_signed(delta);
                Ok(edit(value, start + 1, held, &INLINE_ROOM)?.map(|answer| Form::Inline(len, answer)).into())
            }
            // The header and an end page: two entries.
            PAGED if !typed::edits_in_place(engine) => Ok(Edit::Declined),
            PAGED => {
                let mut header = PagedHeader::read(&value[start..])?;
                let len = header.len.checked_add_signed(delta).filter(|len| *len > 0);
                let Some(len) = len else { return Ok(Edit::Declined) };
                header.len = len;
                value[start + PagedHeader::LEN_AT..start + PagedHeader::LEN_AT + 8]
                    .copy_from_slice(&len.to_le_bytes());
                Ok(Edit::Changed(Form::Paged(header)))
            }
            // A native list's edit in place declined: the general path takes it.
            NATIVE => Ok(Edit::Declined),
            _ => Err(corrupt()),
        }
    })?;
    let header = match form {
        None => return Ok(None),
        Some(Form::Inline(len, answer)) => return Ok(Some((len, answer))),
        Some(Form::Paged(header)) => header,
    };
    let name = entry_key(key, header.id, PAGE, &header.outer(end).to_be_bytes());
    let edited = typed::edit_value(engine, &name, |value| {
        let value = value.as_mut().ok_or_else(corrupt)?;
        let held = count_stored(value.get(16..).ok_or_else(corrupt)?)?;
        Ok(edit(value, 16, held, &PAGE_ROOM)?.into())
    });
    if !matches!(edited, Ok(Some(_))) {
        typed::add_to_count(engine, key, Kind::List, now_ms, PagedHeader::LEN_AT, -delta)?;
    }
    Ok(edited?.map(|answer| (header.len, answer)))
}

/// LPUSH and RPUSH where the list lies: the inline list's value (on every
/// engine), or the header's length and the end page (where
/// [`typed::edits_in_place`]), changed in place. The new length, or `None`
/// when the push needs the general path ([`List`]): no list yet, an inline
/// list outgrowing its form, or an end page without room.
pub fn push_in_place(
    engine: &dyn Engine,
    key: &[u8],
    end: End,
    elements: &[&[u8]],
    now_ms: u64,
) -> DataResult<Option<u64>> {
    let native = edit_native(engine, key, Kind::List, now_ms, |list: &mut NativeList| {
        for element in elements {
            list.push(end, element);
        }
        Edit::Changed(list.len() as u64)
    })?;
    if native.is_some() {
        return Ok(native);
    }
    let bytes: usize = elements.iter().map(|element| 4 + element.len()).sum();
    let pushed = edit_end(engine, key, end, elements.len() as i64, now_ms, |value, base, held, room| {
        let fits = held + elements.len() <= room.elements && value.len() - base + bytes <= room.bytes;
        if fits {
            insert_stored(value, base, end, elements);
        }
        Ok(fits.then_some(()))
    })?;
    Ok(pushed.map(|(len, ())| len))
}

/// LPOP and RPOP of `count` elements where the list lies, as
/// [`push_in_place`] pushes: the popped elements, or `None` when the pop
/// needs the general path (no list, or the list or its end page emptied).
pub fn pop_in_place(
    engine: &dyn Engine,
    key: &[u8],
    end: End,
    count: u64,
    now_ms: u64,
) -> DataResult<Option<Vec<Bytes>>> {
    if count == 0 {
        return Ok(None);
    }
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    let native =
        edit_native(engine, key, Kind::List, now_ms, |list: &mut NativeList| match count < list.len() {
            true => Edit::Changed((0..count).filter_map(|_| list.pop(end)).collect()),
            false => Edit::Declined, // it would empty: the general path deletes it
        })?;
    if native.is_some() {
        return Ok(native);
    }
    let delta = -(count.min(i64::MAX as usize) as i64);
    let popped = edit_end(engine, key, end, delta, now_ms, |value, base, held, _| match count < held {
        true => take_stored(value, base, end, count, held).map(Some),
        false => Ok(None),
    })?;
    Ok(popped.map(|(_, popped)| popped))
}

/// The id of a paged list's entries, from its stored value (payload); an
/// inline list has none.
pub fn id_of(payload: &[u8]) -> DataResult<Option<u64>> {
    match payload.first() {
        Some(&PAGED) => {
            let id = payload.get(1..9).ok_or_else(corrupt)?;
            Ok(Some(u64::from_le_bytes(id.try_into().expect("8 bytes"))))
        }
        Some(&INLINE | &NATIVE) => Ok(None),
        _ => Err(corrupt()),
    }
}

/// Whether a stored list (payload) is small enough to be one value.
pub fn is_inline(payload: &[u8]) -> DataResult<bool> {
    match payload.first() {
        Some(&INLINE) => Ok(true),
        Some(&PAGED | &NATIVE) => Ok(false),
        _ => Err(corrupt()),
    }
}

/// One list, read lazily and changed in memory until [`List::commit`]. The
/// caller holds the key's lock for as long as it lives.
pub struct List<'a> {
    engine: &'a dyn Engine,
    key: &'a [u8],
    expires_at_ms: Option<u64>,
    /// The id of its pages once it is paged.
    paged_id: Option<u64>,
    len: u64,
    head: u64,
    tail: u64,
    next_page: u64,
    pages: HashMap<u64, Page>,
    native: Option<Held<NativeList>>,
    changed: bool,
}

impl<'a> List<'a> {
    /// The list at `key`, if there is one; `WRONGTYPE` for another kind of value.
    pub fn open(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> DataResult<Option<Self>> {
        let Some(stored) = read_kind(engine, key, Kind::List, now_ms)? else { return Ok(None) };
        let mut list = Self::empty(engine, key);
        list.expires_at_ms = stored.expires_at_ms;
        match *stored.payload.first().ok_or_else(corrupt)? {
            INLINE => {
                let mut page = Page::new(NONE, NONE);
                page.elements = Elements::encoded(stored.payload.slice(1..))?;
                page.dirty = false;
                list.len = page.elements.len() as u64;
                list.pages.insert(NONE, page);
            }
            PAGED => {
                let header = PagedHeader::read(&stored.payload)?;
                list.paged_id = Some(header.id);
                list.len = header.len;
                list.head = header.head;
                list.tail = header.tail;
                list.next_page = header.next_page;
            }
            NATIVE if engine.keeps_native() => {
                list.native = Some(Held::Attached);
                list.len = list.read_native(NativeList::len)?.expect("native") as u64;
            }
            _ => return Err(corrupt()),
        }
        Ok(Some(list))
    }

    /// The list at `key`, or a new empty one (stored by `commit` only if it gains elements).
    pub fn open_or_new(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> DataResult<Self> {
        match Self::open(engine, key, now_ms)? {
            Some(list) => Ok(list),
            None => {
                let mut list = Self::empty(engine, key);
                list.pages.insert(NONE, Page::new(NONE, NONE));
                Ok(list)
            }
        }
    }

    fn empty(engine: &'a dyn Engine, key: &'a [u8]) -> Self {
        Self {
            engine,
            key,
            expires_at_ms: None,
            paged_id: None,
            len: 0,
            head: NONE,
            tail: NONE,
            next_page: 1,
            pages: HashMap::new(),
            native: None,
            changed: false,
        }
    }

    /// Runs `read` on the native deque, if the list is one.
    fn read_native<T>(&self, read: impl FnOnce(&NativeList) -> T) -> DataResult<Option<T>> {
        self.native.as_ref().map(|held| held.read(self.engine, self.key, read)).transpose()
    }

    /// Runs `write` on the native deque, if the list is one; `write`
    /// answers, and says whether it changed the deque.
    fn write_native<T>(&mut self, write: impl FnOnce(&mut NativeList) -> (T, bool)) -> DataResult<Option<T>> {
        let (engine, key) = (self.engine, self.key);
        let Some(held) = self.native.as_mut() else { return Ok(None) };
        let (answer, len) = held.write(engine, key, |list| {
            let (answer, changed) = write(list);
            ((answer, list.len()), changed)
        })?;
        self.len = len as u64;
        Ok(Some(answer))
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn outer(&self, end: End) -> u64 {
        match end {
            End::Front => self.head,
            End::Back => self.tail,
        }
    }

    fn page(&mut self, id: u64) -> DataResult<&mut Page> {
        if !self.pages.contains_key(&id) {
            let paged_id = self.paged_id.ok_or_else(corrupt)?;
            let raw = self.engine.get(&entry_key(self.key, paged_id, PAGE, &id.to_be_bytes()))?;
            let page = Page::decode(&raw.ok_or_else(corrupt)?)?;
            self.pages.insert(id, page);
        }
        Ok(self.pages.get_mut(&id).expect("cached above"))
    }

    /// A new page linked between `before` and `after` (either may be NONE).
    fn new_page(&mut self, before: u64, after: u64) -> DataResult<u64> {
        let id = self.next_page;
        self.next_page += 1;
        self.pages.insert(id, Page::new(before, after));
        match before {
            NONE => self.head = id,
            before => self.page(before)?.set_link(End::Back, id),
        }
        match after {
            NONE => self.tail = id,
            after => self.page(after)?.set_link(End::Front, id),
        }
        Ok(id)
    }

    /// Drops an emptied page from the chain, unless it is the only one.
    fn unlink_if_empty(&mut self, id: u64) -> DataResult<()> {
        let page = self.page(id)?;
        if !page.elements.is_empty() || (page.prev == NONE && page.next == NONE) {
            return Ok(());
        }
        let (prev, next) = (page.prev, page.next);
        page.deleted = true;
        match prev {
            NONE => self.head = next,
            prev => self.page(prev)?.set_link(End::Back, next),
        }
        match next {
            NONE => self.tail = prev,
            next => self.page(next)?.set_link(End::Front, prev),
        }
        Ok(())
    }

    pub fn push(&mut self, end: End, element: Bytes) -> DataResult<()> {
        if self.write_native(|list| (list.push(end, &element), true))?.is_some() {
            self.changed = true;
            return Ok(());
        }
        let mut outer = self.outer(end);
        if self.paged_id.is_some() && self.page(outer)?.full() {
            outer = match end {
                End::Front => self.new_page(NONE, outer)?,
                End::Back => self.new_page(outer, NONE)?,
            };
        }
        self.page(outer)?.changing()?.push(end, element);
        self.len += 1;
        self.changed = true;
        Ok(())
    }

    pub fn pop(&mut self, end: End) -> DataResult<Option<Bytes>> {
        if self.len == 0 {
            return Ok(None);
        }
        if let Some(element) = self.write_native(|list| (list.pop(end), true))? {
            self.changed = true;
            return Ok(element);
        }
        let outer = self.outer(end);
        let element = self.page(outer)?.changing()?.pop(end)?.ok_or_else(corrupt)?;
        self.len -= 1;
        self.changed = true;
        self.unlink_if_empty(outer)?;
        Ok(Some(element))
    }

    /// The page and offset of element `index` (below `len`), found from the
    /// nearer end.
    fn locate(&mut self, index: u64) -> DataResult<(u64, usize)> {
        debug_assert!(index < self.len);
        let (from, mut left) =
            if index < self.len / 2 { (End::Front, index) } else { (End::Back, self.len - 1 - index) };
        let mut id = self.outer(from);
        loop {
            let page = self.page(id)?;
            let count = page.elements.len() as u64;
            if left < count {
                let offset = match from {
                    End::Front => left,
                    End::Back => count - 1 - left,
                };
                return Ok((id, offset as usize));
            }
            left -= count;
            id = page.link(from.other());
            if id == NONE {
                return Err(corrupt());
            }
        }
    }

    pub fn get(&mut self, index: u64) -> DataResult<Option<Bytes>> {
        if index >= self.len {
            return Ok(None);
        }
        if let Some(element) = self.read_native(|list| list.get(index))? {
            return Ok(element);
        }
        let (id, offset) = self.locate(index)?;
        Ok(self.page(id)?.elements.decoded()?.get(offset).cloned())
    }

    /// Replaces element `index`; false when there is none.
    pub fn set(&mut self, index: u64, element: Bytes) -> DataResult<bool> {
        if index >= self.len {
            return Ok(false);
        }
        self.changed = true;
        if let Some(set) = self.write_native(|list| {
            let set = list.set(index, &element);
            (set, set)
        })? {
            return Ok(set);
        }
        let (id, offset) = self.locate(index)?;
        let page = self.page(id)?;
        page.elements.decoded()?[offset] = element;
        page.dirty = true;
        if page.overfull() {
            self.split(id)?;
        }
        Ok(true)
    }

    /// Elements `start..=end` (indexes below `len`), front to back.
    pub fn range(&mut self, start: u64, end: u64) -> DataResult<Vec<Bytes>> {
        if start > end || start >= self.len {
            return Ok(Vec::new());
        }
        if let Some(elements) = self.read_native(|list| list.range(start, end))? {
            return Ok(elements);
        }
        let wanted = (end.min(self.len - 1) - start + 1) as usize;
        let mut out = Vec::with_capacity(wanted.min(1 << 16));
        let (mut id, mut offset) = self.locate(start)?;
        while out.len() < wanted {
            let page = self.page(id)?;
            let taken = wanted - out.len();
            out.extend(page.elements.decoded()?.iter().skip(offset).take(taken).cloned());
            offset = 0;
            id = page.next;
            if id == NONE && out.len() < wanted {
                return Err(corrupt());
            }
        }
        Ok(out)
    }

    /// Calls `visit` with elements `start..=end` (indexes below `len`),
    /// front to back, where a native list's lie: how many it visited.
    pub fn visit_range(&mut self, start: u64, end: u64, mut visit: impl FnMut(&[u8])) -> DataResult<usize> {
        if let Some(count) = self.read_native(|list| list.visit_range(start, end, &mut visit))? {
            return Ok(count);
        }
        let elements = self.range(start, end)?;
        elements.iter().for_each(|element| visit(element));
        Ok(elements.len())
    }

    /// Calls `visit` with each element's index and value from `from`'s end
    /// inward, until it returns false.
    pub fn walk(&mut self, from: End, mut visit: impl FnMut(u64, &Bytes) -> bool) -> DataResult<()> {
        if self.read_native(|list| list.walk(from, &mut visit))?.is_some() {
            return Ok(());
        }
        let mut id = self.outer(from);
        let mut index = match from {
            End::Front => 0i64,
            End::Back => self.len as i64 - 1,
        };
        while self.len > 0 {
            let page = self.page(id)?;
            let next = page.link(from.other());
            let elements = page.elements.decoded()?;
            let elements: Box<dyn Iterator<Item = &Bytes>> = match from {
                End::Front => Box::new(elements.iter()),
                End::Back => Box::new(elements.iter().rev()),
            };
            for element in elements {
                if !visit(index as u64, element) {
                    return Ok(());
                }
                index += if from == End::Front { 1 } else { -1 };
            }
            id = next;
            if id == NONE {
                break;
            }
        }
        Ok(())
    }

    /// Removes up to `limit` elements equal to `element` (0: all), from
    /// `from`'s end inward: how many it removed.
    pub fn remove(&mut self, element: &[u8], limit: u64, from: End) -> DataResult<u64> {
        if let Some(removed) = self.write_native(|list| {
            let removed = list.remove(element, limit, from);
            (removed, removed > 0)
        })? {
            self.changed |= removed > 0;
            return Ok(removed);
        }
        let mut removed = 0;
        let mut id = self.outer(from);
        while self.len > 0 && (limit == 0 || removed < limit) {
            let page = self.page(id)?;
            let next = page.link(from.other());
            let mut kept = VecDeque::with_capacity(page.elements.len());
            let mut taken = 0;
            let elements = page.elements.decoded()?;
            let ordered: Vec<Bytes> = match from {
                End::Front => elements.drain(..).collect(),
                End::Back => elements.drain(..).rev().collect(),
            };
            for candidate in ordered {
                if candidate.as_ref() == element && (limit == 0 || removed + taken < limit) {
                    taken += 1;
                } else {
                    match from {
                        End::Front => kept.push_back(candidate),
                        End::Back => kept.push_front(candidate),
                    }
                }
            }
            page.elements = Elements::Decoded(kept);
            if taken > 0 {
                page.dirty = true;
                removed += taken;
                self.len -= taken;
                self.changed = true;
                self.unlink_if_empty(id)?;
            }
            if next == NONE {
                break;
            }
            id = next;
        }
        Ok(removed)
    }

    /// Inserts `element` before or after the first `pivot` from the front:
    /// false when there is no pivot.
    pub fn insert(&mut self, pivot: &[u8], element: Bytes, after: bool) -> DataResult<bool> {
        if let Some(inserted) = self.write_native(|list| {
            let inserted = list.insert(pivot, &element, after);
            (inserted, inserted)
        })? {
            self.changed |= inserted;
            return Ok(inserted);
        }
        let mut found = None;
        self.walk(End::Front, |index, candidate| {
            if candidate.as_ref() == pivot {
                found = Some(index);
            }
            found.is_none()
        })?;
        let Some(index) = found else { return Ok(false) };
        let (id, offset) = self.locate(index)?;
        let page = self.page(id)?;
        page.elements.decoded()?.insert(offset + usize::from(after), element);
        page.dirty = true;
        self.len += 1;
        self.changed = true;
        if self.paged_id.is_some() && self.page(id)?.overfull() {
            self.split(id)?;
        }
        Ok(true)
    }

    /// Moves the back half of page `id` to a new page after it.
    fn split(&mut self, id: u64) -> DataResult<()> {
        if self.paged_id.is_none() {
            return Ok(()); // an inline list is paged whole when it commits
        }
        let next = self.page(id)?.next;
        let page = self.page(id)?;
        let half = page.elements.len() / 2;
        let moved = page.elements.decoded()?.split_off(half);
        page.dirty = true;
        let new = self.new_page(id, next)?;
        self.page(new)?.elements = Elements::Decoded(moved);
        Ok(())
    }

    /// Keeps elements `start..=end` only (indexes below `len`, `start <= end`).
    pub fn trim(&mut self, start: u64, end: u64) -> DataResult<()> {
        let trimmed = start > 0 || end + 1 < self.len;
        if self.write_native(|list| (list.trim(start, end), trimmed))?.is_some() {
            self.changed |= trimmed;
            return Ok(());
        }
        let drop_back = self.len - 1 - end;
        for _ in 0..start {
            self.pop(End::Front)?;
        }
        for _ in 0..drop_back {
            self.pop(End::Back)?;
        }
        Ok(())
    }

    /// Empties the list (LTRIM to nothing): pages not read are left to the
    /// expiry sweep, as when the key is deleted.
    pub fn clear(&mut self) {
        self.len = 0;
        self.changed = true;
    }

    /// Writes the changes; an emptied list is deleted, as in Redis.
    pub fn commit(mut self, reserved: &ReservedEntries) -> DataResult<()> {
        if !self.changed {
            return Ok(());
        }
        let mut changes = Changes::default();
        let stub = |expires_at_ms| move || typed::encode(Kind::List, expires_at_ms, &[NATIVE]);
        if let Some(held) = self.native.take() {
            return held.commit(self.engine, self.key, self.len, stub(self.expires_at_ms));
        }
        if self.len == 0 {
            if let Some(id) = self.paged_id {
                for (page_id, page) in &self.pages {
                    if page.in_engine {
                        changes.note(entry_key(self.key, id, PAGE, &page_id.to_be_bytes()), None, true);
                    }
                }
            }
            return changes.commit(self.engine, self.key, self.paged_id.unwrap_or(0), None, reserved);
        }
        if self.paged_id.is_none() {
            let page = self.pages.remove(&NONE).ok_or_else(corrupt)?;
            if page.elements.len() <= INLINE_ELEMENTS_MAX && page.bytes() <= INLINE_BYTES_MAX {
                let mut payload = BytesMut::with_capacity(1 + page.bytes());
                payload.put_u8(INLINE);
                page.elements.write_to(&mut payload);
                let main = typed::encode(Kind::List, self.expires_at_ms, &payload);
                return changes.commit(self.engine, self.key, 0, Some(main), reserved);
            }
            let mut elements = page.elements;
            let elements = std::mem::take(elements.decoded()?);
            if self.engine.keeps_native() {
                let list = Held::Built(Box::new(NativeList::from_elements(elements)));
                return list.commit(self.engine, self.key, self.len, stub(self.expires_at_ms));
            }
            self.page_out(elements)?;
        }
        let id = self.paged_id.expect("paged above");
        for (page_id, page) in &self.pages {
            let name = || entry_key(self.key, id, PAGE, &page_id.to_be_bytes());
            if page.deleted {
                if page.in_engine {
                    changes.note(name(), None, true);
                }
            } else if page.dirty {
                changes.note(name(), Some(page.encode()), page.in_engine);
            }
        }
        let mut payload = BytesMut::with_capacity(41);
        payload.put_u8(PAGED);
        for word in [id, self.len, self.head, self.tail, self.next_page] {
            payload.put_u64_le(word);
        }
        let main = typed::encode(Kind::List, self.expires_at_ms, &payload);
        changes.commit(self.engine, self.key, id, Some(main), reserved)
    }

    /// Turns an inline list grown past the limits into pages, with an id of
    /// its own.
    fn page_out(&mut self, elements: VecDeque<Bytes>) -> DataResult<()> {
        self.paged_id = Some(rand::random());
        self.head = NONE;
        self.tail = NONE;
        self.next_page = 1;
        let mut last = NONE;
        for element in elements {
            if last == NONE || self.page(last)?.full() {
                last = self.new_page(last, NONE)?;
            }
            self.page(last)?.changing()?.push(End::Back, element);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collection::{for_each_reserved, is_orphan, IdOf};

    const ID_OF: IdOf = |kind, payload| if kind == Kind::List { id_of(payload) } else { Ok(None) };
    use rand::{Rng, SeedableRng};
    use tessera_engine::{MemoryEngine, OrderedEngine};

    fn contents(engine: &dyn Engine) -> Vec<Bytes> {
        match List::open(engine, b"l", 0).unwrap() {
            Some(mut list) if !list.is_empty() => list.range(0, list.len() - 1).unwrap(),
            _ => Vec::new(),
        }
    }

    /// Random changes held to a VecDeque after every commit, through the
    /// inline form, paging out and many pages (or a native deque), on an
    /// engine that keeps native values, a volatile one that does not, and a
    /// persistent one.
    #[test]
    fn changes_match_a_model() {
        let dir = tempfile::tempdir().unwrap();
        let log = tessera_engine::LogEngine::open(dir.path(), Default::default()).unwrap();
        let engines: [&dyn Engine; 3] = [&MemoryEngine::new(), &OrderedEngine::new(), &log];
        for engine in engines {
            let reserved = ReservedEntries::default();
            let mut rng = rand::rngs::StdRng::seed_from_u64(11);
            let mut model: VecDeque<Bytes> = VecDeque::new();
            for round in 0..400 {
                let mut list = List::open_or_new(engine, b"l", 0).unwrap();
                for _ in 0..rng.gen_range(1..60) {
                    let element = Bytes::from(format!("e{}", rng.gen_range(0..50)));
                    let grow = round < 200;
                    match rng.gen_range(0..10) {
                        0..=3 if grow || rng.gen_bool(0.5) => {
                            let end = if rng.gen_bool(0.5) { End::Front } else { End::Back };
                            list.push(end, element.clone()).unwrap();
                            match end {
                                End::Front => model.push_front(element),
                                End::Back => model.push_back(element),
                            }
                        }
                        0..=5 => {
                            let popped = list.pop(End::Front).unwrap();
                            assert_eq!(popped, model.pop_front());
                        }
                        6 => {
                            let removed = list.remove(&element, 2, End::Back).unwrap();
                            let mut left = 2;
                            for index in (0..model.len()).rev() {
                                if left > 0 && model[index] == element {
                                    model.remove(index);
                                    left -= 1;
                                }
                            }
                            assert_eq!(removed, 2 - left);
                        }
                        7 => {
                            let pivot = Bytes::from(format!("e{}", rng.gen_range(0..50)));
                            let inserted = list.insert(&pivot, element.clone(), true).unwrap();
                            let at = model.iter().position(|candidate| *candidate == pivot);
                            assert_eq!(inserted, at.is_some());
                            if let Some(at) = at {
                                model.insert(at + 1, element);
                            }
                        }
                        _ if !model.is_empty() => {
                            let index = rng.gen_range(0..model.len());
                            assert_eq!(list.get(index as u64).unwrap().as_ref(), model.get(index));
                            list.set(index as u64, element.clone()).unwrap();
                            model[index] = element;
                        }
                        _ => {}
                    }
                    assert_eq!(list.len(), model.len() as u64);
                }
                list.commit(&reserved).unwrap();
                assert_eq!(contents(engine), Vec::from(model.clone()));
                if round == 199 && !engine.keeps_native() {
                    let mut pages = 0;
                    for_each_reserved(engine, |entry, _| {
                        pages += u32::from(!is_orphan(engine, entry, 0, ID_OF).unwrap())
                    })
                    .unwrap();
                    assert!(pages > 3, "the list spans several pages");
                }
            }
        }
    }

    /// Pushes and pops where the list lies, falling back to the general path
    /// as the commands do, mixed with general changes: held to a VecDeque
    /// through the inline form, paging out, pages filling and emptying, and
    /// the list emptying.
    #[test]
    fn pushes_and_pops_in_place_match_a_model() {
        let engines: [&dyn Engine; 2] = [&MemoryEngine::new(), &OrderedEngine::new()];
        for engine in engines {
            pushes_and_pops_in_place_match_a_model_on(engine);
        }
    }

    fn pushes_and_pops_in_place_match_a_model_on(engine: &dyn Engine) {
        let reserved = ReservedEntries::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut model: VecDeque<Bytes> = VecDeque::new();
        let (mut in_place, mut general) = (0, 0);
        for round in 0..6000 {
            let end = if rng.gen_bool(0.5) { End::Front } else { End::Back };
            let grow = (round / 1500) % 2 == 0;
            match rng.gen_range(0..10) {
                0..=5 if grow || rng.gen_bool(0.3) => {
                    let elements: Vec<Bytes> = (0..rng.gen_range(1..4))
                        .map(|_| Bytes::from("x".repeat(rng.gen_range(0..40))))
                        .collect();
                    let borrowed: Vec<&[u8]> = elements.iter().map(|element| element.as_ref()).collect();
                    match push_in_place(engine, b"l", end, &borrowed, 0).unwrap() {
                        Some(len) => {
                            in_place += 1;
                            assert_eq!(len, (model.len() + elements.len()) as u64);
                        }
                        None => {
                            general += 1;
                            let mut list = List::open_or_new(engine, b"l", 0).unwrap();
                            for element in &elements {
                                list.push(end, element.clone()).unwrap();
                            }
                            list.commit(&reserved).unwrap();
                        }
                    }
                    for element in elements {
                        match end {
                            End::Front => model.push_front(element),
                            End::Back => model.push_back(element),
                        }
                    }
                }
                0..=8 => {
                    let count = rng.gen_range(1..4);
                    let expected: Vec<Bytes> = (0..count)
                        .map_while(|_| match end {
                            End::Front => model.pop_front(),
                            End::Back => model.pop_back(),
                        })
                        .collect();
                    let popped = match pop_in_place(engine, b"l", end, count, 0).unwrap() {
                        Some(popped) => popped,
                        None => match List::open(engine, b"l", 0).unwrap() {
                            Some(mut list) => {
                                let popped = (0..count).map_while(|_| list.pop(end).unwrap()).collect();
                                list.commit(&reserved).unwrap();
                                popped
                            }
                            None => Vec::new(),
                        },
                    };
                    assert_eq!(popped, expected, "round {round}");
                }
                _ if !model.is_empty() => {
                    let index = rng.gen_range(0..model.len());
                    let mut list = List::open(engine, b"l", 0).unwrap().unwrap();
                    list.set(index as u64, Bytes::from_static(b"set")).unwrap();
                    list.commit(&reserved).unwrap();
                    model[index] = Bytes::from_static(b"set");
                }
                _ => {}
            }
            assert_eq!(contents(engine), Vec::from(model.clone()), "round {round}");
        }
        // A native list takes the general path only to be made and emptied;
        // a paged one also to page out and at full or emptied end pages.
        let general_least = if engine.keeps_native() { 5 } else { 50 };
        assert!(
            in_place > 1000 && general > general_least,
            "both paths ran: {in_place} in place, {general} general"
        );
    }

    #[test]
    fn a_persistent_engine_changes_an_inline_list_in_place_and_never_a_paged_one() {
        let dir = tempfile::tempdir().unwrap();
        let log = tessera_engine::LogEngine::open(dir.path(), Default::default()).unwrap();
        let mut list = List::open_or_new(&log, b"l", 0).unwrap();
        list.push(End::Back, Bytes::from_static(b"a")).unwrap();
        list.commit(&ReservedEntries::default()).unwrap();
        assert_eq!(push_in_place(&log, b"l", End::Back, &[b"b"], 0).unwrap(), Some(2));
        assert_eq!(pop_in_place(&log, b"l", End::Back, 1, 0).unwrap(), Some(vec![Bytes::from_static(b"b")]));

        // Past the inline form: a header and pages, which change together
        // only through the general path's intent on a persistent engine.
        let mut list = List::open_or_new(&log, b"p", 0).unwrap();
        for _ in 0..INLINE_ELEMENTS_MAX + 1 {
            list.push(End::Back, Bytes::from_static(b"element")).unwrap();
        }
        list.commit(&ReservedEntries::default()).unwrap();
        let stored = typed::read_kind(&log, b"p", Kind::List, 0).unwrap().unwrap();
        assert!(id_of(&stored.payload).unwrap().is_some(), "the list is paged");
        assert_eq!(push_in_place(&log, b"p", End::Back, &[b"b"], 0).unwrap(), None);
        assert_eq!(pop_in_place(&log, b"p", End::Back, 1, 0).unwrap(), None);
    }

    #[test]
    fn in_place_changes_meet_other_kinds_and_expired_lists_as_the_general_path_does() {
        let engine = MemoryEngine::new();
        engine.put(b"s", typed::encode(Kind::String, None, b"text")).unwrap();
        assert!(matches!(
            push_in_place(&engine, b"s", End::Back, &[b"x"], 0),
            Err(crate::DataError::WrongType)
        ));
        assert!(matches!(pop_in_place(&engine, b"s", End::Back, 1, 0), Err(crate::DataError::WrongType)));
        let mut list = List::open_or_new(&engine, b"l", 0).unwrap();
        list.push(End::Back, Bytes::from_static(b"a")).unwrap();
        list.push(End::Back, Bytes::from_static(b"b")).unwrap();
        list.expires_at_ms = Some(100);
        list.commit(&ReservedEntries::default()).unwrap();
        assert_eq!(push_in_place(&engine, b"l", End::Back, &[b"x"], 99).unwrap(), Some(3));
        assert_eq!(push_in_place(&engine, b"l", End::Back, &[b"x"], 100).unwrap(), None, "expired");
        assert_eq!(pop_in_place(&engine, b"l", End::Back, 1, 100).unwrap(), None, "expired");
    }

    #[test]
    fn a_push_to_a_long_list_writes_one_page_and_the_header() {
        let engine = OrderedEngine::new();
        let reserved = ReservedEntries::default();
        let mut list = List::open_or_new(&engine, b"l", 0).unwrap();
        for n in 0..10_000 {
            list.push(End::Back, Bytes::from(format!("{n}"))).unwrap();
        }
        list.commit(&reserved).unwrap();
        let mut list = List::open(&engine, b"l", 0).unwrap().unwrap();
        list.push(End::Front, Bytes::from_static(b"first")).unwrap();
        assert!(list.pages.len() <= 2, "only the head page was read (and one begun before it)");
        list.commit(&reserved).unwrap();
        assert_eq!(List::open(&engine, b"l", 0).unwrap().unwrap().get(0).unwrap().unwrap(), "first");
    }
}
