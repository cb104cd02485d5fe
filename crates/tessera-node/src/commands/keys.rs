//! Commands on keys of any type: DEL, EXISTS, expiry, TYPE, RENAME and COPY,
//! SCAN, KEYS, RANDOMKEY, DBSIZE, FLUSHDB.

use tessera_engine::{reserved, KeyRange, ScanCursor};
use tessera_wire::Request;

use super::dump::{read_value, store_value};
use super::strings::deadline;
use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::glob::glob_match;
use crate::hashed::{Hashed, Layout};
use crate::node_state::ScanPosition;
use crate::typed::{read_live, set_deadline};
use crate::typed::{Kind, Stored};
use crate::{list, zset};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "del", arity: -2, flags: &["write"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: del },
    CommandSpec { name: "unlink", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: del },
    CommandSpec { name: "exists", arity: -2, flags: &["readonly", "fast"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: exists },
    CommandSpec { name: "expire", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: expire },
    CommandSpec { name: "pexpire", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: pexpire },
    CommandSpec { name: "expireat", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: expireat },
    CommandSpec { name: "pexpireat", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: pexpireat },
    CommandSpec { name: "ttl", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: ttl },
    CommandSpec { name: "pttl", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: pttl },
    CommandSpec { name: "persist", arity: 2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: persist },
    CommandSpec { name: "type", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: key_type },
    CommandSpec { name: "scan", arity: -2, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, scope: Scope::NodeWide, handler: scan },
    CommandSpec { name: "keys", arity: 2, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, scope: Scope::NodeWide, handler: keys },
    CommandSpec { name: "dbsize", arity: 1, flags: &["readonly", "fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::NodeWide, handler: dbsize },
    CommandSpec { name: "flushdb", arity: -1, flags: &["write"], first_key: 0, last_key: 0, step: 0, scope: Scope::Flush, handler: flushdb },
    CommandSpec { name: "expiretime", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: expiretime },
    CommandSpec { name: "pexpiretime", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: pexpiretime },
    CommandSpec { name: "object", arity: -2, flags: &["readonly"], first_key: 2, last_key: -1, step: 1, scope: Scope::Keys, handler: object },
    CommandSpec { name: "touch", arity: -2, flags: &["readonly", "fast"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: exists },
    CommandSpec { name: "rename", arity: 3, flags: &["write"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: rename },
    CommandSpec { name: "renamenx", arity: 3, flags: &["write", "fast"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: renamenx },
    CommandSpec { name: "copy", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: copy },
    CommandSpec { name: "dump", arity: 2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::dump::dump },
    CommandSpec { name: "restore", arity: -4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::dump::restore },
    CommandSpec { name: "restore-asking", arity: -4, flags: &["write", "denyoom", "asking"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::dump::restore },
    CommandSpec { name: "sort", arity: -2, flags: &["write", "denyoom", "movablekeys"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::sort::sort },
    CommandSpec { name: "sort_ro", arity: -2, flags: &["readonly", "movablekeys"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::sort::sort_ro },
    CommandSpec { name: "randomkey", arity: 1, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, scope: Scope::NodeWide, handler: randomkey },
    CommandSpec { name: "flushall", arity: -1, flags: &["write"], first_key: 0, last_key: 0, step: 0, scope: Scope::Flush, handler: flushdb },
];

fn del(context: &mut Context, request: &Request) -> CommandResult {
    let _locks = context.lock_keys(request.args().skip(1))?;
    let mut deleted = 0;
    for key in request.args().skip(1) {
        let engine = context.engine(key);
        // An expired key is removed too, but not counted: it was already gone.
        let live = read_live(engine, key, context.now_ms)?.is_some();
        if engine.delete(key)? && live {
            deleted += 1;
        }
    }
    context.out.integer(deleted);
    Ok(())
}

fn exists(context: &mut Context, request: &Request) -> CommandResult {
    let mut count = 0;
    for key in request.args().skip(1) {
        if read_live(context.engine(key), key, context.now_ms)?.is_some() {
            count += 1;
        }
    }
    context.out.integer(count);
    Ok(())
}

/// EXPIRE and its variants: sets a deadline subject to NX / XX / GT / LT.
fn set_expiry(
    context: &mut Context,
    request: &Request,
    unit_ms: i64,
    absolute: bool,
    command: &str,
) -> CommandResult {
    let key = request.arg(1);
    let amount = integer_arg(request, 2)?;
    let deadline_ms = deadline(context.now_ms, amount, unit_ms, absolute, command)?;
    let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
    for option in request.args().skip(3) {
        match () {
            _ if is(option, "nx") => nx = true,
            _ if is(option, "xx") => xx = true,
            _ if is(option, "gt") => gt = true,
            _ if is(option, "lt") => lt = true,
            _ => {
                return Err(CommandError::Other(format!(
                    "Unsupported option {}",
                    String::from_utf8_lossy(option)
                )))
            }
        }
    }
    if nx && (xx || gt || lt) || gt && lt {
        return Err(CommandError::Other(
            "NX and XX, GT or LT options at the same time are not compatible".into(),
        ));
    }
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let Some(stored) = read_live(engine, key, context.now_ms)? else {
        context.out.integer(0);
        return Ok(());
    };
    // No deadline counts as an infinite one for GT and LT.
    let allowed = match stored.expires_at_ms {
        None => !xx && !gt,
        Some(current) => {
            !nx && (!gt || deadline_ms > current as i64) && (!lt || deadline_ms < current as i64)
        }
    };
    if !allowed {
        context.out.integer(0);
        return Ok(());
    }
    if deadline_ms <= context.now_ms as i64 {
        engine.delete(key)?;
    } else {
        set_deadline(engine, key, Some(deadline_ms as u64))?;
    }
    context.out.integer(1);
    Ok(())
}

fn expire(context: &mut Context, request: &Request) -> CommandResult {
    set_expiry(context, request, 1000, false, "expire")
}

fn pexpire(context: &mut Context, request: &Request) -> CommandResult {
    set_expiry(context, request, 1, false, "pexpire")
}

fn expireat(context: &mut Context, request: &Request) -> CommandResult {
    set_expiry(context, request, 1000, true, "expireat")
}

fn pexpireat(context: &mut Context, request: &Request) -> CommandResult {
    set_expiry(context, request, 1, true, "pexpireat")
}

/// -2 for a missing key, -1 for no deadline, else the time left in `unit_ms`.
fn time_to_live(context: &mut Context, request: &Request, unit_ms: u64) -> CommandResult {
    let key = request.arg(1);
    let answer = match read_live(context.engine(key), key, context.now_ms)? {
        None => -2,
        Some(Stored { expires_at_ms: None, .. }) => -1,
        Some(Stored { expires_at_ms: Some(deadline), .. }) => {
            let left_ms = deadline.saturating_sub(context.now_ms);
            left_ms.div_ceil(unit_ms).min(i64::MAX as u64) as i64
        }
    };
    context.out.integer(answer);
    Ok(())
}

/// -2 for a missing key, -1 for no deadline, else the deadline in unix `unit_ms`.
fn expiry_time(context: &mut Context, request: &Request, unit_ms: u64) -> CommandResult {
    let key = request.arg(1);
    let answer = match read_live(context.engine(key), key, context.now_ms)? {
        None => -2,
        Some(Stored { expires_at_ms: None, .. }) => -1,
        Some(Stored { expires_at_ms: Some(deadline), .. }) => {
            (deadline / unit_ms).min(i64::MAX as u64) as i64
        }
    };
    context.out.integer(answer);
    Ok(())
}

fn expiretime(context: &mut Context, request: &Request) -> CommandResult {
    expiry_time(context, request, 1000)
}

fn pexpiretime(context: &mut Context, request: &Request) -> CommandResult {
    expiry_time(context, request, 1)
}

/// Writes a copy of the value at `from` (which holds one) at `to`, replacing
/// what `to` held, deadline included. The caller holds both keys' locks.
fn copy_value(context: &Context, from: &[u8], to: &[u8]) -> CommandResult {
    let (value, deadline) = read_value(context, from)?.ok_or_else(crate::collection::corrupt)?;
    store_value(context, to, value, deadline)
}

/// RENAME and RENAMENX: whether the key moved.
fn move_key(context: &mut Context, request: &Request, replace: bool) -> CommandResult<bool> {
    let (from, to) = (request.arg(1), request.arg(2));
    let _locks = context.lock_keys([from, to].into_iter())?;
    if read_live(context.engine(from), from, context.now_ms)?.is_none() {
        return Err(CommandError::Other("no such key".into()));
    }
    if from == to {
        return Ok(replace);
    }
    if !replace && read_live(context.engine(to), to, context.now_ms)?.is_some() {
        return Ok(false);
    }
    copy_value(context, from, to)?;
    context.engine(from).delete(from)?;
    Ok(true)
}

fn rename(context: &mut Context, request: &Request) -> CommandResult {
    move_key(context, request, true)?;
    context.out.ok();
    Ok(())
}

fn renamenx(context: &mut Context, request: &Request) -> CommandResult {
    let moved = move_key(context, request, false)?;
    context.out.integer(i64::from(moved));
    Ok(())
}

fn copy(context: &mut Context, request: &Request) -> CommandResult {
    let mut replace = false;
    let mut index = 3;
    while index < request.len() {
        let option = request.arg(index);
        if is(option, "replace") {
            replace = true;
            index += 1;
        } else if is(option, "db") && index + 1 < request.len() {
            if integer_arg(request, index + 1)? != 0 {
                return Err(CommandError::Other(
                    "DB index is out of range (Tessera has one database; use tables)".into(),
                ));
            }
            index += 2;
        } else {
            return Err(CommandError::Syntax);
        }
    }
    let (from, to) = (request.arg(1), request.arg(2));
    if from == to {
        return Err(CommandError::Other("source and destination objects are the same".into()));
    }
    let _locks = context.lock_keys([from, to].into_iter())?;
    let copied = read_live(context.engine(from), from, context.now_ms)?.is_some()
        && (replace || read_live(context.engine(to), to, context.now_ms)?.is_none());
    if copied {
        copy_value(context, from, to)?;
    }
    context.out.integer(i64::from(copied));
    Ok(())
}

fn ttl(context: &mut Context, request: &Request) -> CommandResult {
    time_to_live(context, request, 1000)
}

fn pttl(context: &mut Context, request: &Request) -> CommandResult {
    time_to_live(context, request, 1)
}

fn persist(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let changed = match read_live(engine, key, context.now_ms)? {
        Some(stored) if stored.expires_at_ms.is_some() => {
            set_deadline(engine, key, None)?;
            true
        }
        _ => false,
    };
    context.out.integer(i64::from(changed));
    Ok(())
}

fn key_type(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let stored = read_live(context.engine(key), key, context.now_ms)?;
    context.out.simple(stored.map_or("none", |stored| stored.kind.name()));
    Ok(())
}

/// OBJECT's subcommands and their arities.
pub const OBJECT_SUBCOMMANDS: &[(&str, i32)] =
    &[("encoding", 3), ("freq", 3), ("idletime", 3), ("refcount", 3), ("help", 2)];

/// Redis's refcount of a shared object (small integers are shared).
const SHARED_REFCOUNT: i64 = i32::MAX as i64;

/// OBJECT ENCODING, FREQ, IDLETIME, REFCOUNT. ENCODING names what Redis 7.2
/// would keep the value as, by its default limits (a list by Tessera's own
/// layout: inline or paged); idle time comes from the node's access clock
/// (OBJECT itself does not count as an access).
fn object(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = String::from_utf8_lossy(request.arg(1)).to_ascii_lowercase();
    if subcommand == "help" {
        let lines = [
            "OBJECT <subcommand> <key>, where <subcommand> is one of:",
            "ENCODING <key> -- how Redis would keep the value at <key>",
            "FREQ <key> -- access frequency (needs an LFU policy, which Tessera has not)",
            "IDLETIME <key> -- seconds since <key> was last read or written",
            "REFCOUNT <key> -- references to the value (shared small integers count as many)",
            "HELP -- this text",
        ];
        super::write_help(context, &lines);
        return Ok(());
    }
    let key = request.arg(2);
    let engine = context.engine(key);
    let Some(stored) = read_live(engine, key, context.now_ms)? else {
        context.out.null();
        return Ok(());
    };
    match subcommand.as_str() {
        "encoding" => {
            let encoding = match stored.kind {
                Kind::String => string_encoding(&stored.payload).0,
                Kind::List if list::is_inline(&stored.payload)? => "listpack",
                Kind::List => "quicklist",
                Kind::Hash | Kind::Set => {
                    let layout = Layout::of(stored.kind).expect("a set or a hash");
                    let mut value = Hashed::open(layout, engine, key, context.now_ms)?.expect("read above");
                    let len = value.len();
                    if stored.kind == Kind::Set && len <= 512 {
                        let members = value.members()?;
                        if members.iter().all(|member| canonical_integer(member).is_some()) {
                            "intset"
                        } else if len <= 128 && members.iter().all(|member| member.len() <= 64) {
                            "listpack"
                        } else {
                            "hashtable"
                        }
                    } else if stored.kind == Kind::Hash
                        && len <= 512
                        && value
                            .entries()?
                            .iter()
                            .all(|(field, value)| field.len() <= 64 && value.len() <= 64)
                    {
                        "listpack"
                    } else {
                        "hashtable"
                    }
                }
                Kind::SortedSet => {
                    let mut set = zset::SortedSet::open(engine, key, context.now_ms)?.expect("read above");
                    let small = set.len() <= 128
                        && set
                            .range_by_rank(0, set.len().saturating_sub(1), false)?
                            .iter()
                            .all(|(_, member)| member.len() <= 64);
                    if small {
                        "listpack"
                    } else {
                        "skiplist"
                    }
                }
            };
            context.out.bulk(encoding.as_bytes());
        }
        "freq" => return Err(CommandError::Other(
            "An LFU maxmemory policy is not selected, access frequency not tracked. Please note that when \
                 switching between policies at runtime LRU and LFU data will take some time to adjust."
                .into(),
        )),
        "idletime" => {
            // The clock keeps tenths of a second in 32 bits, wrapping.
            let last_tenths = context.node.access.last_access(key);
            let now_tenths = (context.now_ms / 100) as u32;
            let idle_seconds = if last_tenths == 0 {
                context.node.started.elapsed().as_secs()
            } else {
                u64::from(now_tenths.wrapping_sub(last_tenths)) / 10
            };
            context.out.integer(idle_seconds as i64);
        }
        _ => {
            let shared = stored.kind == Kind::String
                && string_encoding(&stored.payload).1.is_some_and(|value| (0..10_000).contains(&value));
            context.out.integer(if shared { SHARED_REFCOUNT } else { 1 });
        }
    }
    Ok(())
}

/// The bytes as the integer Redis would keep them as (no sign but `-`, no
/// leading zeros).
fn canonical_integer(bytes: &[u8]) -> Option<i64> {
    let value: i64 = std::str::from_utf8(bytes).ok()?.parse().ok()?;
    (value.to_string().as_bytes() == bytes).then_some(value)
}

/// A string's encoding by Redis's rules, and its integer if it is one.
fn string_encoding(value: &[u8]) -> (&'static str, Option<i64>) {
    match canonical_integer(value) {
        Some(integer) if value.len() <= 20 => ("int", Some(integer)),
        _ if value.len() <= 44 => ("embstr", None),
        _ => ("raw", None),
    }
}

/// SCAN's filters.
struct ScanFilter<'a> {
    pattern: Option<&'a [u8]>,
    kind: Option<Kind>,
}

impl ScanFilter<'_> {
    fn accepts(&self, key: &[u8], raw: bytes::Bytes, now_ms: u64) -> bool {
        live_kind(key, raw, now_ms).is_some_and(|kind| self.kind.is_none_or(|wanted| wanted == kind))
            && self.pattern.is_none_or(|pattern| glob_match(pattern, key))
    }
}

/// The type of a key as an engine holds it, unless it is one of Tessera's
/// own (reserved) entries or has expired.
pub fn live_kind(key: &[u8], raw: bytes::Bytes, now_ms: u64) -> Option<Kind> {
    if reserved::is_reserved(key) {
        return None;
    }
    let stored = Stored::decode(raw).ok()?;
    (!stored.is_expired(now_ms)).then_some(stored.kind)
}

/// SCAN walks the tables in name order, each with its engine's own cursor. The
/// integer cursor a client sees names a saved (table, engine cursor) position.
fn scan(context: &mut Context, request: &Request) -> CommandResult {
    let cursor_text = request.arg(1);
    let cursor_id: u64 = std::str::from_utf8(cursor_text)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or(CommandError::InvalidCursor)?;
    let mut filter = ScanFilter { pattern: None, kind: None };
    let mut count = 10usize;
    let mut index = 2;
    while index < request.len() {
        let option = request.arg(index);
        let value =
            (index + 1 < request.len()).then(|| request.arg(index + 1)).ok_or(CommandError::Syntax)?;
        if is(option, "match") {
            filter.pattern = Some(value).filter(|pattern| *pattern != b"*");
        } else if is(option, "count") {
            count = integer_arg(request, index + 1)?
                .try_into()
                .ok()
                .filter(|count| *count >= 1)
                .ok_or(CommandError::Syntax)?;
        } else if is(option, "type") {
            let Some(kind) = Kind::ALL.into_iter().find(|kind| is(value, kind.name())) else {
                // No key has a type Tessera does not store.
                context.out.array(2);
                context.out.bulk(b"0");
                context.out.array(0);
                return Ok(());
            };
            filter.kind = Some(kind);
        } else {
            return Err(CommandError::Syntax);
        }
        index += 2;
    }
    let tables = context.tables.by_name();
    let Some(first) = tables.first() else {
        // A cluster node that heads no shard holds no keys of its own.
        context.out.array(2);
        context.out.bulk(b"0");
        context.out.array(0);
        return Ok(());
    };
    let mut position = if cursor_id == 0 {
        ScanPosition { table: first.def.name.clone(), cursor: ScanCursor::start() }
    } else {
        context.node.scan_position(cursor_id).ok_or(CommandError::InvalidCursor)?
    };
    let mut keys = Vec::new();
    let next = loop {
        // A table dropped mid-scan is skipped: the scan goes on with the next name.
        let Some(table) = tables.iter().find(|table| table.def.name >= position.table) else { break None };
        if table.def.name != position.table {
            position = ScanPosition { table: table.def.name.clone(), cursor: ScanCursor::start() };
        }
        let page = table.engine.scan(&KeyRange::all(), &position.cursor, count)?;
        for (key, raw) in page.entries {
            if filter.accepts(&key, raw, context.now_ms) {
                keys.push(key);
            }
        }
        match page.next {
            Some(cursor) => position.cursor = cursor,
            None => {
                let next_table = tables.iter().find(|other| other.def.name > table.def.name);
                match next_table {
                    Some(next) => {
                        position = ScanPosition { table: next.def.name.clone(), cursor: ScanCursor::start() }
                    }
                    None => break None,
                }
            }
        }
        if keys.len() >= count {
            break Some(position);
        }
    };
    let next_id = next.map_or(0, |position| context.node.save_scan_position(position));
    context.out.array(2);
    context.out.bulk(next_id.to_string().as_bytes());
    context.out.array(keys.len());
    for key in &keys {
        context.out.bulk(key);
    }
    Ok(())
}

fn keys(context: &mut Context, request: &Request) -> CommandResult {
    let filter = ScanFilter { pattern: Some(request.arg(1)).filter(|pattern| *pattern != b"*"), kind: None };
    let mut keys = Vec::new();
    walk_keys(context, &filter, |key| keys.push(key))?;
    context.out.array(keys.len());
    for key in &keys {
        context.out.bulk(key);
    }
    Ok(())
}

/// Entries RANDOMKEY samples at a time, and how many samples it takes before
/// it looks for any key at all (the samples held only expired keys or
/// Tessera's own entries).
const RANDOM_KEY_SAMPLE: usize = 64;
const RANDOM_KEY_SAMPLES_MAX: usize = 16;

/// A key picked at random from a sample: a table chosen in proportion to its
/// keys, the next entries from where the last sample there stopped (so
/// that successive calls travel the whole table), one live key among them.
fn randomkey(context: &mut Context, _request: &Request) -> CommandResult {
    let tables = context.tables.by_name();
    let mut weights = Vec::with_capacity(tables.len());
    for table in &tables {
        weights.push(table.reserved.keys_in(table.engine.as_ref())?);
    }
    let total: u64 = weights.iter().sum();
    for _ in 0..RANDOM_KEY_SAMPLES_MAX {
        if total == 0 {
            break;
        }
        let mut pick = rand::random::<u64>() % total;
        let index = weights.iter().position(|&weight| {
            pick < weight || {
                pick -= weight;
                false
            }
        });
        let table = &tables[index.expect("the pick is below the total")];
        let name = &table.def.name;
        let cursor = context.node.random_key_positions.lock().remove(name).unwrap_or_default();
        let page = table.engine.scan(&KeyRange::all(), &cursor, RANDOM_KEY_SAMPLE)?;
        if let Some(next) = page.next {
            context.node.random_key_positions.lock().insert(name.clone(), next);
        }
        let live: Vec<_> = page
            .entries
            .into_iter()
            .filter(|(key, raw)| live_kind(key, raw.clone(), context.now_ms).is_some())
            .collect();
        if !live.is_empty() {
            let (key, _) = &live[rand::random::<usize>() % live.len()];
            context.out.bulk(key);
            return Ok(());
        }
    }
    let mut first = None;
    walk_keys(context, &ScanFilter { pattern: None, kind: None }, |key| {
        first.get_or_insert(key);
    })?;
    context.out.bulk_or_null(first.as_deref());
    Ok(())
}

/// Calls `found` with every live key of every table that `filter` accepts.
fn walk_keys(context: &Context, filter: &ScanFilter, mut found: impl FnMut(bytes::Bytes)) -> CommandResult {
    for table in context.tables.by_name() {
        let mut cursor = ScanCursor::start();
        loop {
            let page = table.engine.scan(&KeyRange::all(), &cursor, 1024)?;
            for (key, raw) in page.entries {
                if filter.accepts(&key, raw, context.now_ms) {
                    found(key);
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
    }
    Ok(())
}

fn dbsize(context: &mut Context, _request: &Request) -> CommandResult {
    let mut total = 0;
    if context.cluster.is_some() {
        // Replicated shards keep tombstones and no count of sorted-set
        // entries: count their live keys by walking them.
        walk_keys(context, &ScanFilter { pattern: None, kind: None }, |_| total += 1)?;
    } else {
        for table in context.tables.by_name() {
            total += table.reserved.keys_in(table.engine.as_ref())?;
        }
    }
    context.out.integer(total as i64);
    Ok(())
}

fn flushdb(context: &mut Context, request: &Request) -> CommandResult {
    if request.len() > 2
        || (request.len() == 2 && !is(request.arg(1), "sync") && !is(request.arg(1), "async"))
    {
        return Err(CommandError::Syntax);
    }
    let _locks = if context.locks_held { Vec::new() } else { context.node.lock_all_unless_busy()? };
    for table in context.tables.by_name() {
        table.reserved.clear(table.engine.as_ref())?;
    }
    context.out.ok();
    Ok(())
}
