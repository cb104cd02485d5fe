//! Redis's serialization format (RDB) for one value: what DUMP answers,
//! RESTORE reads and MIGRATE carries between Tessera and Redis.
//!
//! A payload is `type byte | object | RDB version (u16 LE) | CRC-64/Jones of
//! everything before it (u64 LE)`. Tessera writes the plain encodings
//! every Redis since 4.0 reads (a list, set and hash as counted strings, a
//! sorted set with binary scores) under version 9, and reads every encoding
//! Redis 2.8 to 7.2 write for strings, lists, sets, hashes and sorted sets:
//! integers and LZF inside strings, ziplists, intsets, quicklists and
//! listpacks. Streams and module values are refused by name.

use bytes::Bytes;
use crc::{Crc, CRC_64_REDIS};

/// A static, not a const: a file's checksum is a digest that borrows it.
static CRC64: Crc<u64> = Crc::<u64>::new(&CRC_64_REDIS);

/// The version DUMP writes: Redis 4.0 and every later one read it.
pub const DUMP_VERSION: u16 = 9;
/// The newest version RESTORE reads (Redis 7.4's); what a later version
/// adds would be refused by type anyway.
const NEWEST_VERSION: u16 = 12;

mod object_type {
    pub const STRING: u8 = 0;
    pub const LIST: u8 = 1;
    pub const SET: u8 = 2;
    pub const ZSET: u8 = 3;
    pub const HASH: u8 = 4;
    pub const ZSET_2: u8 = 5;
    pub const MODULE: u8 = 6;
    pub const MODULE_2: u8 = 7;
    pub const HASH_ZIPMAP: u8 = 9;
    pub const LIST_ZIPLIST: u8 = 10;
    pub const SET_INTSET: u8 = 11;
    pub const ZSET_ZIPLIST: u8 = 12;
    pub const HASH_ZIPLIST: u8 = 13;
    pub const LIST_QUICKLIST: u8 = 14;
    pub const STREAM_LISTPACKS: u8 = 15;
    pub const HASH_LISTPACK: u8 = 16;
    pub const ZSET_LISTPACK: u8 = 17;
    pub const LIST_QUICKLIST_2: u8 = 18;
    pub const STREAM_LISTPACKS_2: u8 = 19;
    pub const SET_LISTPACK: u8 = 20;
    pub const STREAM_LISTPACKS_3: u8 = 21;
}

/// A value as the format carries it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    String(Bytes),
    List(Vec<Bytes>),
    Set(Vec<Bytes>),
    Hash(Vec<(Bytes, Bytes)>),
    /// Members with their scores, in any order.
    SortedSet(Vec<(f64, Bytes)>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RdbError {
    #[error("DUMP payload version or checksum are wrong")]
    Footer,
    /// Malformed: the wording is Redis's; the detail goes to the log.
    #[error("Bad data format")]
    Format(&'static str),
    #[error("Bad data format: {0} values are not supported by Tessera")]
    Unsupported(&'static str),
    #[error("Bad data format: the value would take more than {0} bytes")]
    TooLarge(usize),
}

impl RdbError {
    /// The error with what a client's reply leaves to the log: which part
    /// of the format was wrong.
    pub fn detail(&self) -> String {
        match self {
            Self::Format(detail) => format!("{self}: {detail}"),
            _ => self.to_string(),
        }
    }
}

type Result<T> = std::result::Result<T, RdbError>;

/// DUMP's payload for `value`.
pub fn dump(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_object(&mut out, value);
    out.extend_from_slice(&DUMP_VERSION.to_le_bytes());
    let checksum = CRC64.checksum(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

/// The value in a DUMP payload, whose decoded elements may take at most
/// `bytes_max` bytes together.
pub fn restore(payload: &[u8], bytes_max: usize) -> Result<Value> {
    let Some(body_length) = payload.len().checked_sub(10) else { return Err(RdbError::Footer) };
    let (body, footer) = payload.split_at(body_length);
    let version = u16::from_le_bytes([footer[0], footer[1]]);
    let checksum = u64::from_le_bytes(footer[2..].try_into().expect("8 bytes"));
    if version > NEWEST_VERSION || CRC64.checksum(&payload[..body_length + 2]) != checksum {
        return Err(RdbError::Footer);
    }
    let mut reader = Reader::new(body, bytes_max);
    let kind = reader.byte()?;
    let value = reader.object(kind)?;
    if !reader.is_done() {
        return Err(RdbError::Format("bytes after the value"));
    }
    Ok(value)
}

/// Opcodes of an RDB file, between its keys.
mod opcode {
    pub const SLOT_INFO: u8 = 0xf4;
    pub const FUNCTION: u8 = 0xf5;
    pub const FUNCTION_PRE_GA: u8 = 0xf6;
    pub const MODULE_AUX: u8 = 0xf7;
    pub const IDLE: u8 = 0xf8;
    pub const FREQ: u8 = 0xf9;
    pub const AUX: u8 = 0xfa;
    pub const RESIZE_DB: u8 = 0xfb;
    pub const EXPIRE_MS: u8 = 0xfc;
    pub const EXPIRE_SECONDS: u8 = 0xfd;
    pub const SELECT_DB: u8 = 0xfe;
    pub const EOF: u8 = 0xff;
}

/// One key of an RDB file.
#[derive(Clone, Debug, PartialEq)]
pub struct FileEntry {
    pub db: u64,
    pub key: Bytes,
    pub value: Value,
    /// When it expires, in Unix milliseconds.
    pub expires_at_ms: Option<u64>,
}

/// Reads a whole RDB file (`SAVE`'s or `BGSAVE`'s dump.rdb), key by key,
/// for `tessera import-rdb`: the file's header, its databases, expiry times
/// and every value type [`Reader::object`] reads. Auxiliary fields, LRU and
/// LFU hints and slot sizes are passed over; Redis functions are counted and
/// passed over; module data is refused. The checksum is checked at the end.
pub struct FileReader<'a> {
    reader: Reader<'a>,
    db: u64,
    /// Functions libraries passed over.
    functions: u64,
    done: bool,
}

impl<'a> FileReader<'a> {
    /// A reader of the file `bytes`, each of whose values may decode to at
    /// most `value_bytes_max` bytes.
    pub fn new(bytes: &'a [u8], value_bytes_max: usize) -> Result<Self> {
        let mut reader = Reader::new(bytes, value_bytes_max);
        let header = reader.take(9).map_err(|_| RdbError::Format("not an RDB file: too short"))?;
        let version = header
            .strip_prefix(b"REDIS")
            .and_then(|digits| std::str::from_utf8(digits).ok())
            .and_then(|digits| digits.parse::<u16>().ok())
            .ok_or(RdbError::Format("not an RDB file: no REDIS header"))?;
        if version > NEWEST_VERSION {
            return Err(RdbError::Format("an RDB version newer than Redis 7.4's"));
        }
        Ok(Self { reader, db: 0, functions: 0, done: false })
    }

    /// Where the reader is in the file, for error messages.
    pub fn offset(&self) -> usize {
        self.reader.at
    }

    /// Redis function libraries met so far (not loaded: Tessera has no
    /// functions).
    pub fn functions(&self) -> u64 {
        self.functions
    }

    /// The next key, or `None` at the end of a file whose checksum matches.
    pub fn next_entry(&mut self) -> Result<Option<FileEntry>> {
        let mut expires_at_ms = None;
        while !self.done {
            let start = self.reader.at;
            let kind = self.reader.byte()?;
            match kind {
                opcode::EOF => {
                    self.done = true;
                    let checksum = u64::from_le_bytes(self.reader.array()?);
                    // Zero: written with rdbchecksum off.
                    if checksum != 0 && checksum != CRC64.checksum(&self.reader.bytes[..start + 1]) {
                        return Err(RdbError::Format("the file's checksum does not match: it is damaged"));
                    }
                }
                opcode::SELECT_DB => self.db = self.reader.plain_length()?,
                opcode::RESIZE_DB => {
                    self.reader.plain_length()?;
                    self.reader.plain_length()?;
                }
                opcode::SLOT_INFO => {
                    for _ in 0..3 {
                        self.reader.plain_length()?;
                    }
                }
                opcode::AUX => {
                    self.reader.unbudgeted_string()?;
                    self.reader.unbudgeted_string()?;
                }
                opcode::EXPIRE_MS => expires_at_ms = Some(u64::from_le_bytes(self.reader.array()?)),
                opcode::EXPIRE_SECONDS => {
                    expires_at_ms = Some(u64::from(u32::from_le_bytes(self.reader.array()?)) * 1000);
                }
                opcode::IDLE => {
                    self.reader.plain_length()?;
                }
                opcode::FREQ => {
                    self.reader.byte()?;
                }
                opcode::FUNCTION | opcode::FUNCTION_PRE_GA => {
                    if kind == opcode::FUNCTION_PRE_GA {
                        return Err(RdbError::Unsupported("Redis 7.0 release-candidate function"));
                    }
                    self.reader.unbudgeted_string()?;
                    self.functions += 1;
                }
                opcode::MODULE_AUX => return Err(RdbError::Unsupported("module auxiliary")),
                _ => {
                    self.reader.renew_budget();
                    let key = self.reader.string()?;
                    let value = self.reader.object(kind)?;
                    return Ok(Some(FileEntry { db: self.db, key, value, expires_at_ms }));
                }
            }
        }
        Ok(None)
    }
}

/// The type byte and the object, in the encodings DUMP writes.
pub fn write_object(out: &mut Vec<u8>, value: &Value) {
    out.push(type_byte(value));
    write_payload(out, value);
}

fn type_byte(value: &Value) -> u8 {
    match value {
        Value::String(_) => object_type::STRING,
        Value::List(_) => object_type::LIST,
        Value::Set(_) => object_type::SET,
        Value::Hash(_) => object_type::HASH,
        Value::SortedSet(_) => object_type::ZSET_2,
    }
}

/// The object after its type byte.
fn write_payload(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(bytes) => write_string(out, bytes),
        Value::List(elements) | Value::Set(elements) => {
            write_length(out, elements.len() as u64);
            for element in elements {
                write_string(out, element);
            }
        }
        Value::Hash(entries) => {
            write_length(out, entries.len() as u64);
            for (field, entry) in entries {
                write_string(out, field);
                write_string(out, entry);
            }
        }
        Value::SortedSet(entries) => {
            write_length(out, entries.len() as u64);
            for (score, member) in entries {
                write_string(out, member);
                out.extend_from_slice(&score.to_le_bytes());
            }
        }
    }
}

/// Writes an RDB file key by key (`SAVE`'s dump.rdb, a backup's file per
/// group), in database 0, under [`DUMP_VERSION`] so that every Redis since
/// 4.0 loads it, and so does [`FileReader`]. It buffers what it writes
/// itself, 64 KiB at a time.
pub struct FileWriter<W: std::io::Write> {
    out: W,
    digest: crc::Digest<'static, u64>,
    buffer: Vec<u8>,
}

impl<W: std::io::Write> FileWriter<W> {
    /// The header, `aux` fields (name and value) and database 0's selector.
    pub fn new(out: W, aux: &[(&str, &str)]) -> std::io::Result<Self> {
        let mut writer = Self { out, digest: CRC64.digest(), buffer: Vec::new() };
        writer.buffer.extend_from_slice(format!("REDIS{DUMP_VERSION:04}").as_bytes());
        for (name, value) in aux {
            writer.put_aux(name, value);
        }
        writer.buffer.extend_from_slice(&[opcode::SELECT_DB, 0]);
        writer.spill()?;
        Ok(writer)
    }

    /// One key, with its deadline in Unix milliseconds if it has one.
    pub fn entry(&mut self, key: &[u8], value: &Value, expires_at_ms: Option<u64>) -> std::io::Result<()> {
        if let Some(at) = expires_at_ms {
            self.buffer.push(opcode::EXPIRE_MS);
            self.buffer.extend_from_slice(&at.to_le_bytes());
        }
        self.buffer.push(type_byte(value));
        write_string(&mut self.buffer, key);
        write_payload(&mut self.buffer, value);
        if self.buffer.len() >= 1 << 16 {
            self.spill()?;
        }
        Ok(())
    }

    /// An auxiliary field between keys (Redis and [`FileReader`] skip those
    /// they do not know).
    pub fn aux(&mut self, name: &str, value: &str) -> std::io::Result<()> {
        self.put_aux(name, value);
        self.spill()
    }

    /// The end marker and the checksum; the writer it wrote to.
    pub fn finish(mut self) -> std::io::Result<W> {
        self.buffer.push(opcode::EOF);
        self.spill()?;
        let checksum = self.digest.finalize();
        self.out.write_all(&checksum.to_le_bytes())?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn put_aux(&mut self, name: &str, value: &str) {
        self.buffer.push(opcode::AUX);
        write_string(&mut self.buffer, name.as_bytes());
        write_string(&mut self.buffer, value.as_bytes());
    }

    fn spill(&mut self) -> std::io::Result<()> {
        self.digest.update(&self.buffer);
        self.out.write_all(&self.buffer)?;
        self.buffer.clear();
        Ok(())
    }
}

fn write_length(out: &mut Vec<u8>, length: u64) {
    if length < 1 << 6 {
        out.push(length as u8);
    } else if length < 1 << 14 {
        out.extend_from_slice(&[0x40 | (length >> 8) as u8, length as u8]);
    } else if length <= u64::from(u32::MAX) {
        out.push(0x80);
        out.extend_from_slice(&(length as u32).to_be_bytes());
    } else {
        out.push(0x81);
        out.extend_from_slice(&length.to_be_bytes());
    }
}

fn write_string(out: &mut Vec<u8>, bytes: &[u8]) {
    write_length(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A length, or one of the special string encodings.
enum Length {
    Plain(u64),
    Int8,
    Int16,
    Int32,
    Lzf,
}

/// Reads objects from a payload (or, later, a whole RDB file), counting the
/// bytes of what it decodes against a budget.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    budget: usize,
    budget_max: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8], bytes_max: usize) -> Self {
        Self { bytes, at: 0, budget: bytes_max, budget_max: bytes_max }
    }

    pub fn is_done(&self) -> bool {
        self.at == self.bytes.len()
    }

    /// A new value begins: it has the whole budget.
    fn renew_budget(&mut self) {
        self.budget = self.budget_max;
    }

    /// A length that is a number, not a string encoding.
    fn plain_length(&mut self) -> Result<u64> {
        match self.length_or_encoding()? {
            Length::Plain(length) => Ok(length),
            _ => Err(RdbError::Format("an encoded string where a length belongs")),
        }
    }

    /// A string outside any value (an auxiliary field), not counted against
    /// a value's budget.
    fn unbudgeted_string(&mut self) -> Result<Bytes> {
        self.renew_budget();
        self.string()
    }

    fn take(&mut self, count: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(count).filter(|end| *end <= self.bytes.len());
        let end = end.ok_or(RdbError::Format("the value ends early"))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    pub fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn spend(&mut self, bytes: usize) -> Result<()> {
        self.budget = self.budget.checked_sub(bytes).ok_or(RdbError::TooLarge(self.budget_max))?;
        Ok(())
    }

    fn length_or_encoding(&mut self) -> Result<Length> {
        let first = self.byte()?;
        Ok(match first >> 6 {
            0 => Length::Plain(u64::from(first & 0x3f)),
            1 => Length::Plain(u64::from(first & 0x3f) << 8 | u64::from(self.byte()?)),
            2 if first == 0x80 => Length::Plain(u64::from(u32::from_be_bytes(self.array()?))),
            2 if first == 0x81 => Length::Plain(u64::from_be_bytes(self.array()?)),
            3 => match first & 0x3f {
                0 => Length::Int8,
                1 => Length::Int16,
                2 => Length::Int32,
                3 => Length::Lzf,
                _ => return Err(RdbError::Format("unknown string encoding")),
            },
            _ => return Err(RdbError::Format("unknown length encoding")),
        })
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    /// A length that counts items each taking at least a byte of what is left.
    fn count(&mut self) -> Result<usize> {
        match self.length_or_encoding()? {
            Length::Plain(length) if length <= (self.bytes.len() - self.at) as u64 => Ok(length as usize),
            Length::Plain(_) => Err(RdbError::Format("a count past the value's end")),
            _ => Err(RdbError::Format("an encoded string where a count belongs")),
        }
    }

    fn string(&mut self) -> Result<Bytes> {
        let bytes = match self.length_or_encoding()? {
            Length::Plain(length) => {
                let length =
                    usize::try_from(length).map_err(|_| RdbError::Format("a string past the value's end"))?;
                Bytes::copy_from_slice(self.take(length)?)
            }
            Length::Int8 => Bytes::from((self.byte()? as i8).to_string()),
            Length::Int16 => Bytes::from(i16::from_le_bytes(self.array()?).to_string()),
            Length::Int32 => Bytes::from(i32::from_le_bytes(self.array()?).to_string()),
            Length::Lzf => {
                let compressed = self.count()?;
                let Length::Plain(length) = self.length_or_encoding()? else {
                    return Err(RdbError::Format("an encoded LZF length"));
                };
                let length = usize::try_from(length).map_err(|_| RdbError::TooLarge(self.budget_max))?;
                if length > self.budget {
                    return Err(RdbError::TooLarge(self.budget_max));
                }
                Bytes::from(lzf_decompress(self.take(compressed)?, length)?)
            }
        };
        self.spend(bytes.len())?;
        Ok(bytes)
    }

    /// The object of type `kind`, the type byte already read.
    pub fn object(&mut self, kind: u8) -> Result<Value> {
        use object_type::*;
        let value = match kind {
            STRING => return Ok(Value::String(self.string()?)),
            LIST => Value::List(self.strings()?),
            SET => Value::Set(self.strings()?),
            HASH => {
                let count = self.count()?;
                let mut entries = Vec::with_capacity(count.min(1 << 16));
                for _ in 0..count {
                    entries.push((self.string()?, self.string()?));
                }
                Value::Hash(entries)
            }
            ZSET | ZSET_2 => {
                let count = self.count()?;
                let mut entries = Vec::with_capacity(count.min(1 << 16));
                for _ in 0..count {
                    let member = self.string()?;
                    let score =
                        if kind == ZSET_2 { f64::from_le_bytes(self.array()?) } else { self.text_score()? };
                    entries.push((score, member));
                }
                Value::SortedSet(entries)
            }
            LIST_ZIPLIST => Value::List(self.packed(ziplist)?),
            SET_INTSET => Value::Set(intset(&self.string()?)?),
            SET_LISTPACK => Value::Set(self.packed(listpack)?),
            ZSET_ZIPLIST | ZSET_LISTPACK => {
                let entries = self.packed(if kind == ZSET_ZIPLIST { ziplist } else { listpack })?;
                Value::SortedSet(pairs(entries)?.into_iter().map(parse_packed_score).collect::<Result<_>>()?)
            }
            HASH_ZIPLIST | HASH_LISTPACK => {
                Value::Hash(pairs(self.packed(if kind == HASH_ZIPLIST { ziplist } else { listpack })?)?)
            }
            LIST_QUICKLIST | LIST_QUICKLIST_2 => {
                let nodes = self.count()?;
                let mut elements = Vec::new();
                for _ in 0..nodes {
                    if kind == LIST_QUICKLIST {
                        elements.extend(self.packed(ziplist)?);
                        continue;
                    }
                    match self.length_or_encoding()? {
                        Length::Plain(1) => elements.push(self.string()?),
                        Length::Plain(2) => elements.extend(self.packed(listpack)?),
                        _ => return Err(RdbError::Format("unknown quicklist node container")),
                    }
                }
                Value::List(elements)
            }
            STREAM_LISTPACKS | STREAM_LISTPACKS_2 | STREAM_LISTPACKS_3 => {
                return Err(RdbError::Unsupported("stream"))
            }
            MODULE | MODULE_2 => return Err(RdbError::Unsupported("module")),
            HASH_ZIPMAP => return Err(RdbError::Unsupported("zipmap-encoded hash (Redis 2.4)")),
            _ => return Err(RdbError::Format("unknown value type")),
        };
        check_collection(&value)?;
        Ok(value)
    }

    fn strings(&mut self) -> Result<Vec<Bytes>> {
        let count = self.count()?;
        let mut elements = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            elements.push(self.string()?);
        }
        Ok(elements)
    }

    /// A string holding a ziplist or listpack, read by `entries_of`.
    fn packed(&mut self, entries_of: fn(&[u8]) -> Result<Vec<Bytes>>) -> Result<Vec<Bytes>> {
        let blob = self.string()?;
        let entries = entries_of(&blob)?;
        // Integers decode longer than they were packed.
        self.spend(entries.iter().map(Bytes::len).sum::<usize>().saturating_sub(blob.len()))?;
        Ok(entries)
    }

    /// A score written as text (the first sorted-set encoding): a length
    /// byte, or 253, 254, 255 for NaN, +inf, -inf.
    fn text_score(&mut self) -> Result<f64> {
        match self.byte()? {
            253 => Ok(f64::NAN),
            254 => Ok(f64::INFINITY),
            255 => Ok(f64::NEG_INFINITY),
            length => parse_score_text(self.take(usize::from(length))?),
        }
    }
}

/// What Redis refuses to load as well: an empty collection, a NaN score, a
/// member or field twice.
fn check_collection(value: &Value) -> Result<()> {
    fn distinct<'v>(items: impl ExactSizeIterator<Item = &'v Bytes>) -> bool {
        let count = items.len();
        items.collect::<hashbrown::HashSet<_>>().len() == count
    }
    let (empty, unique) = match value {
        Value::String(_) => return Ok(()),
        Value::List(elements) => (elements.is_empty(), true),
        Value::Set(members) => (members.is_empty(), distinct(members.iter())),
        Value::Hash(entries) => (entries.is_empty(), distinct(entries.iter().map(|(field, _)| field))),
        Value::SortedSet(entries) => {
            if entries.iter().any(|(score, _)| score.is_nan()) {
                return Err(RdbError::Format("a NaN score"));
            }
            (entries.is_empty(), distinct(entries.iter().map(|(_, member)| member)))
        }
    };
    if empty {
        return Err(RdbError::Format("an empty collection"));
    }
    if !unique {
        return Err(RdbError::Format("a member twice"));
    }
    Ok(())
}

fn pairs(entries: Vec<Bytes>) -> Result<Vec<(Bytes, Bytes)>> {
    if !entries.len().is_multiple_of(2) {
        return Err(RdbError::Format("an odd number of entries in pairs"));
    }
    let mut entries = entries.into_iter();
    let mut out = Vec::with_capacity(entries.len() / 2);
    while let (Some(first), Some(second)) = (entries.next(), entries.next()) {
        out.push((first, second));
    }
    Ok(out)
}

fn parse_packed_score((member, score): (Bytes, Bytes)) -> Result<(f64, Bytes)> {
    Ok((parse_score_text(&score)?, member))
}

fn parse_score_text(text: &[u8]) -> Result<f64> {
    let invalid = || RdbError::Format("a score that is not a number");
    let text = std::str::from_utf8(text).map_err(|_| invalid())?;
    match text {
        "inf" | "+inf" => Ok(f64::INFINITY),
        "-inf" => Ok(f64::NEG_INFINITY),
        _ => text.parse().map_err(|_| invalid()),
    }
}

fn little_endian(bytes: &[u8]) -> i64 {
    let mut padded = [0u8; 8];
    padded[..bytes.len()].copy_from_slice(bytes);
    // Sign-extend from the top byte given.
    let shift = 64 - 8 * bytes.len() as u32;
    (i64::from_le_bytes(padded) << shift) >> shift
}

/// A cursor over a ziplist's or listpack's bytes.
struct Packed<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Packed<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(count).filter(|end| *end <= self.bytes.len());
        let end = end.ok_or(RdbError::Format("a packed entry past its end"))?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn number(&mut self, width: usize) -> Result<Bytes> {
        Ok(Bytes::from(little_endian(self.take(width)?).to_string()))
    }

    /// Checks the header's total length and returns the cursor after it.
    fn open(bytes: &'a [u8], header: usize) -> Result<Self> {
        let total = bytes.get(..4).map(|total| u32::from_le_bytes(total.try_into().expect("4 bytes")));
        if bytes.len() < header + 1 || total != Some(bytes.len() as u32) || bytes[bytes.len() - 1] != 0xff {
            return Err(RdbError::Format("a packed value's header or end"));
        }
        Ok(Self { bytes, at: header })
    }

    fn finish(&self) -> Result<()> {
        if self.at + 1 == self.bytes.len() {
            Ok(())
        } else {
            Err(RdbError::Format("bytes after a packed value's last entry"))
        }
    }
}

/// A ziplist's entries (Redis up to 6.2): header `zlbytes zltail zllen`,
/// entries each after the previous one's length, and 0xFF.
fn ziplist(bytes: &[u8]) -> Result<Vec<Bytes>> {
    let mut cursor = Packed::open(bytes, 10)?;
    let mut entries = Vec::new();
    while cursor.bytes[cursor.at] != 0xff {
        if cursor.byte()? == 0xfe {
            cursor.take(4)?; // the previous entry's length, past 253 bytes
        }
        let encoding = cursor.byte()?;
        let entry = match encoding {
            0x00..=0x3f => Bytes::copy_from_slice(cursor.take(usize::from(encoding))?),
            0x40..=0x7f => {
                let length = usize::from(encoding & 0x3f) << 8 | usize::from(cursor.byte()?);
                Bytes::copy_from_slice(cursor.take(length)?)
            }
            0x80 => {
                let length = u32::from_be_bytes(cursor.take(4)?.try_into().expect("4 bytes")) as usize;
                Bytes::copy_from_slice(cursor.take(length)?)
            }
            0xc0 => cursor.number(2)?,
            0xd0 => cursor.number(4)?,
            0xe0 => cursor.number(8)?,
            0xf0 => cursor.number(3)?,
            0xfe => cursor.number(1)?,
            0xf1..=0xfd => Bytes::from(((encoding & 0x0f) - 1).to_string()),
            _ => return Err(RdbError::Format("unknown ziplist entry encoding")),
        };
        entries.push(entry);
        if cursor.at >= cursor.bytes.len() {
            return Err(RdbError::Format("a ziplist without its end"));
        }
    }
    cursor.finish()?;
    Ok(entries)
}

/// A listpack's entries (Redis 7): header `total-bytes count`, entries each
/// followed by its own length backwards, and 0xFF.
fn listpack(bytes: &[u8]) -> Result<Vec<Bytes>> {
    let mut cursor = Packed::open(bytes, 6)?;
    let mut entries = Vec::new();
    while cursor.bytes[cursor.at] != 0xff {
        let start = cursor.at;
        let encoding = cursor.byte()?;
        let entry = match encoding {
            0x00..=0x7f => Bytes::from(encoding.to_string()),
            0x80..=0xbf => Bytes::copy_from_slice(cursor.take(usize::from(encoding & 0x3f))?),
            0xc0..=0xdf => {
                let raw = i64::from(encoding & 0x1f) << 8 | i64::from(cursor.byte()?);
                Bytes::from((if raw >= 1 << 12 { raw - (1 << 13) } else { raw }).to_string())
            }
            0xe0..=0xef => {
                let length = usize::from(encoding & 0x0f) << 8 | usize::from(cursor.byte()?);
                Bytes::copy_from_slice(cursor.take(length)?)
            }
            0xf0 => {
                let length = u32::from_le_bytes(cursor.take(4)?.try_into().expect("4 bytes")) as usize;
                Bytes::copy_from_slice(cursor.take(length)?)
            }
            0xf1 => cursor.number(2)?,
            0xf2 => cursor.number(3)?,
            0xf3 => cursor.number(4)?,
            0xf4 => cursor.number(8)?,
            _ => return Err(RdbError::Format("unknown listpack entry encoding")),
        };
        let entry_length = cursor.at - start;
        let back_length = match entry_length {
            0..=127 => 1,
            128..=16382 => 2,
            16383..=2_097_150 => 3,
            2_097_151..=268_435_454 => 4,
            _ => 5,
        };
        cursor.take(back_length)?;
        entries.push(entry);
        if cursor.at >= cursor.bytes.len() {
            return Err(RdbError::Format("a listpack without its end"));
        }
    }
    cursor.finish()?;
    Ok(entries)
}

/// An intset's members: `encoding (2, 4 or 8) count` and the integers.
fn intset(bytes: &[u8]) -> Result<Vec<Bytes>> {
    let word =
        |at: usize| bytes.get(at..at + 4).map(|word| u32::from_le_bytes(word.try_into().expect("4 bytes")));
    let (Some(width), Some(count)) = (word(0), word(4)) else {
        return Err(RdbError::Format("an intset's header"));
    };
    let (width, count) = (width as usize, count as usize);
    if !matches!(width, 2 | 4 | 8)
        || count.checked_mul(width).and_then(|body| body.checked_add(8)) != Some(bytes.len())
    {
        return Err(RdbError::Format("an intset's length"));
    }
    Ok(bytes[8..].chunks_exact(width).map(|member| Bytes::from(little_endian(member).to_string())).collect())
}

/// LZF's decompression: literal runs (a control byte below 32 says how
/// many bytes follow) and back references (length in the top three bits,
/// extended by a byte when they are all set; distance in the rest and the
/// next byte). The result must be exactly `length` bytes.
fn lzf_decompress(input: &[u8], length: usize) -> Result<Vec<u8>> {
    let bad = || RdbError::Format("a bad LZF-compressed string");
    let mut out = Vec::with_capacity(length);
    let mut at = 0;
    while at < input.len() {
        let control = usize::from(input[at]);
        at += 1;
        if control < 32 {
            let run = input.get(at..at + control + 1).ok_or_else(bad)?;
            out.extend_from_slice(run);
            at += control + 1;
        } else {
            let mut run = control >> 5;
            if run == 7 {
                run += usize::from(*input.get(at).ok_or_else(bad)?);
                at += 1;
            }
            let low = usize::from(*input.get(at).ok_or_else(bad)?);
            at += 1;
            let distance = ((control & 0x1f) << 8) + low + 1;
            let from = out.len().checked_sub(distance).ok_or_else(bad)?;
            for index in 0..run + 2 {
                out.push(out[from + index]); // may read what this run wrote
            }
        }
        if out.len() > length {
            return Err(bad());
        }
    }
    if out.len() != length {
        return Err(bad());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn bytes(items: &[&str]) -> Vec<Bytes> {
        items.iter().map(|item| Bytes::copy_from_slice(item.as_bytes())).collect()
    }

    /// A file of `body` (opcodes and keys) between the header and the
    /// checksum.
    fn rdb_file(body: &[u8]) -> Vec<u8> {
        let mut file = b"REDIS0011".to_vec();
        file.extend_from_slice(body);
        file.push(opcode::EOF);
        let checksum = CRC64.checksum(&file);
        file.extend_from_slice(&checksum.to_le_bytes());
        file
    }

    #[test]
    fn a_file_reads_key_by_key_with_databases_and_expiry_and_its_checksum_is_checked() {
        let mut body = vec![opcode::AUX];
        write_string(&mut body, b"redis-ver");
        write_string(&mut body, b"7.0.15");
        body.extend_from_slice(&[opcode::SELECT_DB, 0, opcode::RESIZE_DB, 2, 1]);
        body.push(opcode::EXPIRE_MS);
        body.extend_from_slice(&1_900_000_000_000u64.to_le_bytes());
        body.extend_from_slice(&[opcode::FREQ, 5]);
        body.push(object_type::STRING);
        write_string(&mut body, b"k1");
        write_string(&mut body, b"v1");
        body.extend_from_slice(&[opcode::SELECT_DB, 3]);
        let list = Value::List(bytes(&["a", "b"]));
        let mut object = Vec::new();
        write_object(&mut object, &list);
        body.push(object[0]);
        write_string(&mut body, b"k2");
        body.extend_from_slice(&object[1..]);
        let file = rdb_file(&body);

        let mut reader = FileReader::new(&file, 1 << 20).unwrap();
        let first = reader.next_entry().unwrap().unwrap();
        assert_eq!((first.db, &first.key[..], first.expires_at_ms), (0, &b"k1"[..], Some(1_900_000_000_000)));
        assert_eq!(first.value, Value::String(Bytes::from_static(b"v1")));
        let second = reader.next_entry().unwrap().unwrap();
        assert_eq!(
            (second.db, &second.key[..], second.expires_at_ms, second.value),
            (3, &b"k2"[..], None, list)
        );
        assert_eq!(reader.next_entry(), Ok(None));

        // Any byte changed is caught (by the format or by the checksum);
        // any cut, and no input panics.
        for at in 9..file.len() - 8 {
            let mut damaged = file.clone();
            damaged[at] ^= 0x21;
            let mut reader = FileReader::new(&damaged, 1 << 20).unwrap();
            let outcome =
                std::iter::from_fn(|| Some(reader.next_entry())).find(|next| !matches!(next, Ok(Some(_))));
            assert!(matches!(outcome, Some(Err(_))), "a change at byte {at} went unnoticed");
        }
        for length in 0..file.len() {
            if let Ok(mut reader) = FileReader::new(&file[..length], 1 << 20) {
                let outcome = std::iter::from_fn(|| Some(reader.next_entry()))
                    .find(|next| !matches!(next, Ok(Some(_))));
                assert!(matches!(outcome, Some(Err(_))), "a file cut at {length} bytes read as whole");
            }
        }
        assert!(FileReader::new(b"REDIS0099", 1 << 20).is_err(), "a version from the future");
        assert!(FileReader::new(b"PNG\x00\x00\x00\x00\x00\x00", 1 << 20).is_err());
    }

    #[test]
    fn the_checksum_is_redis_crc64() {
        assert_eq!(CRC64.checksum(b"123456789"), 0xe9c6_d914_c4b8_d9ca);
    }

    #[test]
    fn every_value_comes_back_from_its_dump() {
        let long = "x".repeat(20_000);
        let values = [
            Value::String(Bytes::from_static(b"hello")),
            Value::String(Bytes::from(long.clone())),
            Value::List(bytes(&["a", "", "a", &long])),
            Value::Set(bytes(&["m1", "m2"])),
            Value::Hash(vec![(Bytes::from_static(b"f"), Bytes::from_static(b"v"))]),
            Value::SortedSet(vec![
                (1.5, Bytes::from_static(b"m")),
                (f64::NEG_INFINITY, Bytes::from_static(b"n")),
            ]),
        ];
        for value in values {
            assert_eq!(restore(&dump(&value), 1 << 20), Ok(value));
        }
    }

    #[test]
    fn a_changed_payload_is_refused_by_its_footer() {
        let mut payload = dump(&Value::String(Bytes::from_static(b"hello")));
        payload[3] ^= 1;
        assert_eq!(restore(&payload, 1 << 20), Err(RdbError::Footer));
        assert_eq!(restore(b"short", 1 << 20), Err(RdbError::Footer));
    }

    /// Payloads redis-server 7.0 answered DUMP with.
    #[test]
    fn redis_encodings_are_read() {
        let cases: [(&[u8], Value); 6] = [
            // SET k 123: an int8-encoded string.
            (b"\x00\xc0{\n\x00H\xe2S\xe1\x00zg\xb9", Value::String(Bytes::from_static(b"123"))),
            // SET c abcabc…: an LZF-compressed string.
            (
                b"\x00\xc3\x0b@Z\x03abca\xe0K\x02\x01bc\n\x00#\x806\xf9\xe2\xd0\xc7\x80",
                Value::String(Bytes::from("abc".repeat(30))),
            ),
            // RPUSH l a 1 -5000: a quicklist of one listpack node.
            (
                b"\x12\x01\x02\x10\x10\x00\x00\x00\x03\x00\x81a\x02\x01\x01\xf1x\xec\x03\xff\n\x00\xbetw%\xa2q\x99\xb2",
                Value::List(bytes(&["a", "1", "-5000"])),
            ),
            // SADD s 1 2 300: an intset.
            (
                b"\x0b\x0e\x02\x00\x00\x00\x03\x00\x00\x00\x01\x00\x02\x00,\x01\n\x00\xe5\x10\xb2\x8e{\x95)\xaa",
                Value::Set(bytes(&["1", "2", "300"])),
            ),
            // HSET h f v: a listpack.
            (
                b"\x10\r\r\x00\x00\x00\x02\x00\x81f\x02\x81v\x02\xff\n\x00 \xf1=D#T\x08\x9d",
                Value::Hash(vec![(Bytes::from_static(b"f"), Bytes::from_static(b"v"))]),
            ),
            // ZADD z 1.5 m: a listpack with the score as text.
            (
                b"\x11\x0f\x0f\x00\x00\x00\x02\x00\x81m\x02\x831.5\x04\xff\n\x00I\xd9\x87`x%N\x8a",
                Value::SortedSet(vec![(1.5, Bytes::from_static(b"m"))]),
            ),
        ];
        for (payload, expected) in cases {
            assert_eq!(restore(payload, 1 << 20), Ok(expected));
        }
    }

    #[test]
    fn lzf_reads_literals_and_overlapping_references() {
        // "aaaaaaaaaa": one literal 'a', then a reference one back, 9 long.
        assert_eq!(lzf_decompress(&[0x00, b'a', 0xe0, 0x00, 0x00], 10).unwrap(), b"a".repeat(10));
        assert!(lzf_decompress(&[0x20, 0x05], 3).is_err(), "a reference before the start");
        assert!(lzf_decompress(&[0x05, b'a'], 6).is_err(), "a literal run past the input");
    }

    #[test]
    fn malformed_payloads_are_errors_never_panics() {
        let value = Value::Hash(
            (0..50).map(|n| (Bytes::from(format!("f{n}")), Bytes::from(format!("{n}")))).collect(),
        );
        let payload = dump(&value);
        for cut in 0..payload.len() - 10 {
            let mut body = payload[..cut].to_vec();
            body.extend_from_slice(&DUMP_VERSION.to_le_bytes());
            let checksum = CRC64.checksum(&body);
            body.extend_from_slice(&checksum.to_le_bytes());
            assert!(restore(&body, 1 << 20).is_err(), "cut at {cut}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let mut body: Vec<u8> = payload[..payload.len() - 10].to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..body.len());
                body[at] = rng.gen();
            }
            body.extend_from_slice(&DUMP_VERSION.to_le_bytes());
            let checksum = CRC64.checksum(&body);
            body.extend_from_slice(&checksum.to_le_bytes());
            let _ = restore(&body, 1 << 20);
        }
    }
}
