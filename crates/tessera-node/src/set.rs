//! Sets over any engine, atomic per key (changed under the key's lock). A
//! small set is one value; past [`INLINE_MEMBERS_MAX`] members or
//! [`INLINE_BYTES_MAX`] bytes its members spread over buckets addressed by
//! linear hashing, so that SADD, SREM and SISMEMBER read and write one bucket
//! (and the header) whatever the set's size, on engines without range scans:
//!
//! ```text
//! key   'S' value, inline: 0 | (len u32, member) × n
//!       'S' value, paged:  1 | id u64 | members u64 | level u64 | split u64
//! R | key_len u32 | key | id | 'b' | bucket u64 BE    (len u32, member) × n
//! ```
//!
//! There are `2^level + split` buckets. A member hashing to `h` lives in
//! bucket `h mod 2^level`, or `h mod 2^(level+1)` when that is below `split`.
//! When the set averages more than [`BUCKET_LOAD`] members a bucket, bucket
//! `split` splits into itself and `split + 2^level`. Members only ever move
//! to higher buckets, so a scan in bucket order (SSCAN's cursor is a bucket)
//! sees every member present throughout. An inline set is bucket 0 of a
//! table of one, kept inside the value. Buckets are named and collected as
//! every collection's entries are ([`crate::collection`]).

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};
use tessera_engine::Engine;

use crate::collection::{corrupt, entry_key, put_bytes, Changes, Reader};
use crate::error::CommandResult;
use crate::typed::{self, read_kind, Kind, ReservedEntries};

/// The most members and bytes a set keeps in its value.
pub const INLINE_MEMBERS_MAX: usize = 128;
pub const INLINE_BYTES_MAX: usize = 8 << 10;
/// Average members per bucket past which a bucket splits.
const BUCKET_LOAD: u64 = 64;

const INLINE: u8 = 0;
const PAGED: u8 = 1;
const BUCKET: u8 = b'b';

/// A member's hash (FNV-1a, 64 bits): stable across processes and versions,
/// since it places members in stored buckets.
fn hash(member: &[u8]) -> u64 {
    member
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, &byte| (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3))
}

#[derive(Default)]
struct Bucket {
    members: Vec<Bytes>,
    in_engine: bool,
    dirty: bool,
}

impl Bucket {
    fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.members.iter().map(|member| member.len() + 4).sum());
        for member in &self.members {
            put_bytes(&mut out, member);
        }
        out.freeze()
    }

    fn decode(raw: &Bytes) -> CommandResult<Self> {
        let mut reader = Reader::new(raw);
        let mut members = Vec::new();
        while !reader.done() {
            members.push(reader.bytes()?);
        }
        Ok(Self { members, in_engine: true, dirty: false })
    }

    fn bytes(&self) -> usize {
        self.members.iter().map(|member| member.len() + 4).sum()
    }

    fn fits_inline(&self) -> bool {
        self.members.len() <= INLINE_MEMBERS_MAX && self.bytes() <= INLINE_BYTES_MAX
    }
}

/// The id of a paged set's buckets, from its stored value (payload).
pub fn id_of(payload: &[u8]) -> CommandResult<Option<u64>> {
    match payload.first() {
        Some(&PAGED) => {
            let id = payload.get(1..9).ok_or_else(corrupt)?;
            Ok(Some(u64::from_le_bytes(id.try_into().expect("8 bytes"))))
        }
        Some(&INLINE) => Ok(None),
        _ => Err(corrupt()),
    }
}

/// One set, read lazily and changed in memory until [`Set::commit`]. The
/// caller holds the key's lock for as long as it lives.
pub struct Set<'a> {
    engine: &'a dyn Engine,
    key: &'a [u8],
    expires_at_ms: Option<u64>,
    paged_id: Option<u64>,
    len: u64,
    level: u32,
    split: u64,
    buckets: HashMap<u64, Bucket>,
    changed: bool,
}

impl<'a> Set<'a> {
    /// The set at `key`, if there is one; `WRONGTYPE` for another kind of value.
    pub fn open(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> CommandResult<Option<Self>> {
        let Some(stored) = read_kind(engine, key, Kind::Set, now_ms)? else { return Ok(None) };
        let mut set = Self::empty(engine, key);
        set.expires_at_ms = stored.expires_at_ms;
        let mut reader = Reader::new(&stored.payload);
        match reader.u8()? {
            INLINE => {
                let mut bucket = Bucket::default();
                while !reader.done() {
                    bucket.members.push(reader.bytes()?);
                }
                set.len = bucket.members.len() as u64;
                set.buckets.insert(0, bucket);
            }
            PAGED => {
                set.paged_id = Some(reader.u64()?);
                set.len = reader.u64()?;
                set.level = reader.u64()? as u32;
                set.split = reader.u64()?;
                if set.level >= 63 || set.split >= 1 << set.level {
                    return Err(corrupt());
                }
            }
            _ => return Err(corrupt()),
        }
        Ok(Some(set))
    }

    /// The set at `key`, or a new empty one (stored by `commit` only if it gains members).
    pub fn open_or_new(engine: &'a dyn Engine, key: &'a [u8], now_ms: u64) -> CommandResult<Self> {
        match Self::open(engine, key, now_ms)? {
            Some(set) => Ok(set),
            None => {
                let mut set = Self::empty(engine, key);
                set.buckets.insert(0, Bucket::default());
                Ok(set)
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
            level: 0,
            split: 0,
            buckets: HashMap::new(),
            changed: false,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many buckets there are (1 for an inline set).
    pub fn bucket_count(&self) -> u64 {
        (1 << self.level) + self.split
    }

    fn bucket_of(&self, member: &[u8]) -> u64 {
        let hash = hash(member);
        let low = hash & ((1 << self.level) - 1);
        if low < self.split {
            hash & ((1 << (self.level + 1)) - 1)
        } else {
            low
        }
    }

    fn bucket(&mut self, index: u64) -> CommandResult<&mut Bucket> {
        if !self.buckets.contains_key(&index) {
            let id = self.paged_id.ok_or_else(corrupt)?;
            let bucket = match self.engine.get(&entry_key(self.key, id, BUCKET, &index.to_be_bytes()))? {
                Some(raw) => Bucket::decode(&raw)?,
                None => Bucket::default(), // an empty bucket is not stored
            };
            self.buckets.insert(index, bucket);
        }
        Ok(self.buckets.get_mut(&index).expect("cached above"))
    }

    pub fn contains(&mut self, member: &[u8]) -> CommandResult<bool> {
        if self.len == 0 {
            return Ok(false);
        }
        let index = self.bucket_of(member);
        Ok(self.bucket(index)?.members.iter().any(|candidate| candidate.as_ref() == member))
    }

    /// Adds a member: whether it is new.
    pub fn insert(&mut self, member: &[u8]) -> CommandResult<bool> {
        let index = self.bucket_of(member);
        let inline = self.paged_id.is_none();
        let bucket = self.bucket(index)?;
        if bucket.members.iter().any(|candidate| candidate.as_ref() == member) {
            return Ok(false);
        }
        bucket.members.push(Bytes::copy_from_slice(member));
        bucket.dirty = true;
        let outgrown = inline && !bucket.fits_inline();
        self.len += 1;
        self.changed = true;
        if outgrown {
            // At once, not at commit: an inline set is searched member by member.
            let members = std::mem::take(&mut self.bucket(0)?.members);
            self.page_out(members);
        } else if self.paged_id.is_some() && self.len > BUCKET_LOAD * self.bucket_count() {
            self.split_next()?;
        }
        Ok(true)
    }

    /// Removes a member: whether it was there.
    pub fn remove(&mut self, member: &[u8]) -> CommandResult<bool> {
        if self.len == 0 {
            return Ok(false);
        }
        let index = self.bucket_of(member);
        let bucket = self.bucket(index)?;
        let Some(at) = bucket.members.iter().position(|candidate| candidate.as_ref() == member) else {
            return Ok(false);
        };
        bucket.members.swap_remove(at);
        bucket.dirty = true;
        self.len -= 1;
        self.changed = true;
        Ok(true)
    }

    /// Splits bucket `split` into itself and `split + 2^level`.
    fn split_next(&mut self) -> CommandResult<()> {
        let (old, new) = (self.split, self.split + (1 << self.level));
        let mask = (1u64 << (self.level + 1)) - 1;
        let members = std::mem::take(&mut self.bucket(old)?.members);
        self.bucket(new)?; // read (it is absent unless a crash left one)
        for member in members {
            let target = if hash(&member) & mask == new { new } else { old };
            self.bucket(target)?.members.push(member);
        }
        for index in [old, new] {
            self.bucket(index)?.dirty = true;
        }
        self.split += 1;
        if self.split == 1 << self.level {
            self.level += 1;
            self.split = 0;
        }
        Ok(())
    }

    /// The members of bucket `index` (below [`Set::bucket_count`]).
    pub fn bucket_members(&mut self, index: u64) -> CommandResult<Vec<Bytes>> {
        Ok(self.bucket(index)?.members.clone())
    }

    pub fn members(&mut self) -> CommandResult<Vec<Bytes>> {
        let mut all = Vec::with_capacity(self.len.min(1 << 16) as usize);
        for index in 0..self.bucket_count() {
            all.extend(self.bucket(index)?.members.iter().cloned());
        }
        Ok(all)
    }

    /// A member picked at random (about uniformly: a random bucket, then a
    /// random member of it; empty buckets are drawn again).
    pub fn random_member(&mut self) -> CommandResult<Option<Bytes>> {
        if self.len == 0 {
            return Ok(None);
        }
        loop {
            let index = rand::random::<u64>() % self.bucket_count();
            let bucket = self.bucket(index)?;
            if !bucket.members.is_empty() {
                return Ok(Some(bucket.members[rand::random::<usize>() % bucket.members.len()].clone()));
            }
        }
    }

    /// Writes the changes; an emptied set is deleted, as in Redis.
    pub fn commit(self, reserved: &ReservedEntries) -> CommandResult<()> {
        if !self.changed {
            return Ok(());
        }
        let mut changes = Changes::default();
        if self.len == 0 {
            if let Some(id) = self.paged_id {
                for (index, bucket) in &self.buckets {
                    if bucket.in_engine {
                        changes.note(entry_key(self.key, id, BUCKET, &index.to_be_bytes()), None, true);
                    }
                }
            }
            return changes.commit(self.engine, self.key, self.paged_id.unwrap_or(0), None, reserved);
        }
        if self.paged_id.is_none() {
            let bucket = self.buckets.get(&0).ok_or_else(corrupt)?;
            debug_assert!(bucket.fits_inline(), "an outgrown set is paged out when it outgrows");
            let mut payload = BytesMut::with_capacity(1 + bucket.bytes());
            payload.put_u8(INLINE);
            for member in &bucket.members {
                put_bytes(&mut payload, member);
            }
            let main = typed::encode(Kind::Set, self.expires_at_ms, &payload);
            return changes.commit(self.engine, self.key, 0, Some(main), reserved);
        }
        let id = self.paged_id.expect("paged above");
        for (index, bucket) in &self.buckets {
            if bucket.dirty {
                let value = (!bucket.members.is_empty()).then(|| bucket.encode());
                if value.is_some() || bucket.in_engine {
                    changes.note(
                        entry_key(self.key, id, BUCKET, &index.to_be_bytes()),
                        value,
                        bucket.in_engine,
                    );
                }
            }
        }
        let mut payload = BytesMut::with_capacity(33);
        payload.put_u8(PAGED);
        for word in [id, self.len, u64::from(self.level), self.split] {
            payload.put_u64_le(word);
        }
        let main = typed::encode(Kind::Set, self.expires_at_ms, &payload);
        changes.commit(self.engine, self.key, id, Some(main), reserved)
    }

    /// Spreads an inline set grown past the limits over enough buckets for
    /// about half the load that splits one.
    fn page_out(&mut self, members: Vec<Bytes>) {
        self.paged_id = Some(rand::random());
        self.level = 0;
        while (1u64 << self.level) * BUCKET_LOAD / 2 < members.len() as u64 {
            self.level += 1;
        }
        self.split = 0;
        self.buckets.clear();
        for member in members {
            let index = self.bucket_of(&member);
            let bucket = self.buckets.entry(index).or_default();
            bucket.members.push(member);
            bucket.dirty = true;
        }
    }
}

/// Writes `members` as the set at `key` in place of what `key` held (STORE
/// forms, COPY, RENAME), with `expires_at_ms`; no members deletes `key`.
pub fn store(
    engine: &dyn Engine,
    key: &[u8],
    members: impl IntoIterator<Item = Bytes>,
    expires_at_ms: Option<u64>,
    now_ms: u64,
    reserved: &ReservedEntries,
) -> CommandResult<u64> {
    engine.delete(key)?;
    let mut set = Set::open_or_new(engine, key, now_ms)?;
    set.expires_at_ms = expires_at_ms;
    for member in members {
        set.insert(&member)?;
    }
    let len = set.len();
    set.changed = true;
    set.commit(reserved)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collection::{for_each_reserved, is_orphan};
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;
    use tessera_engine::MemoryEngine;

    #[test]
    fn changes_match_a_model_through_paging_and_splits() {
        let dir = tempfile::tempdir().unwrap();
        let log = tessera_engine::LogEngine::open(dir.path(), Default::default()).unwrap();
        let engines: [&dyn Engine; 2] = [&MemoryEngine::new(), &log];
        for engine in engines {
            let reserved = ReservedEntries::default();
            let mut rng = rand::rngs::StdRng::seed_from_u64(5);
            let mut model = BTreeSet::new();
            for round in 0..300 {
                let mut set = Set::open_or_new(engine, b"s", 0).unwrap();
                for _ in 0..rng.gen_range(1..80) {
                    let member = format!("m{}", rng.gen_range(0..5000)).into_bytes();
                    if rng.gen_bool(if round < 200 { 0.85 } else { 0.2 }) {
                        assert_eq!(set.insert(&member).unwrap(), model.insert(member));
                    } else {
                        assert_eq!(set.remove(&member).unwrap(), model.remove(&member));
                    }
                }
                set.commit(&reserved).unwrap();
                let mut set = match Set::open(engine, b"s", 0).unwrap() {
                    Some(set) => set,
                    None => {
                        assert!(model.is_empty());
                        continue;
                    }
                };
                assert_eq!(set.len(), model.len() as u64);
                let members: BTreeSet<Vec<u8>> =
                    set.members().unwrap().iter().map(|member| member.to_vec()).collect();
                assert_eq!(members, model);
                let probe = format!("m{}", rng.gen_range(0..5000)).into_bytes();
                assert_eq!(set.contains(&probe).unwrap(), model.contains(&probe));
                if round == 199 {
                    assert!(set.bucket_count() > 16, "the set spread over buckets");
                    let mut live = 0;
                    for_each_reserved(engine, |entry, _| {
                        live += u32::from(!is_orphan(engine, entry, 0).unwrap())
                    })
                    .unwrap();
                    assert!(live as u64 <= set.bucket_count());
                }
            }
        }
    }

    #[test]
    fn an_add_to_a_large_set_reads_one_bucket() {
        let engine = MemoryEngine::new();
        let reserved = ReservedEntries::default();
        store(&engine, b"s", (0..50_000).map(|n| Bytes::from(format!("{n}"))), None, 0, &reserved).unwrap();
        let mut set = Set::open(&engine, b"s", 0).unwrap().unwrap();
        assert!(set.insert(b"new member").unwrap());
        assert!(set.buckets.len() <= 3, "one bucket, and two more if it split one");
    }
}
