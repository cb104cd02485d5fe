//! String commands: GET, SET and friends, counters, APPEND, ranges and bits.

use bytes::Bytes;
use tessera_data::DataError;
use tessera_engine::Engine;
use tessera_wire::Request;

use super::{integer_arg, is, wrong_arity, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::long_double::LongDouble;
use crate::node_state::WorkerStats;
use crate::typed::{change_string, read_kind, read_live, write};
use crate::typed::{decode_header, parse_i64, Kind};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "get", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: get },
    CommandSpec { name: "set", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: set },
    CommandSpec { name: "setnx", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: setnx },
    CommandSpec { name: "setex", arity: 4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: setex },
    CommandSpec { name: "psetex", arity: 4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: psetex },
    CommandSpec { name: "getset", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getset },
    CommandSpec { name: "getdel", arity: 2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getdel },
    CommandSpec { name: "mget", arity: -2, flags: &["readonly", "fast"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: mget },
    CommandSpec { name: "mset", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: -1, step: 2, scope: Scope::Keys, handler: mset },
    CommandSpec { name: "incr", arity: 2, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: incr },
    CommandSpec { name: "decr", arity: 2, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: decr },
    CommandSpec { name: "incrby", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: incrby },
    CommandSpec { name: "decrby", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: decrby },
    CommandSpec { name: "append", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: append },
    CommandSpec { name: "strlen", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: strlen },
    CommandSpec { name: "getex", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getex },
    CommandSpec { name: "getrange", arity: 4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getrange },
    CommandSpec { name: "lcs", arity: -3, flags: &["readonly"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: lcs },
    CommandSpec { name: "bitop", arity: -4, flags: &["write", "denyoom"], first_key: 2, last_key: -1, step: 1, scope: Scope::Keys, handler: bitop },
    CommandSpec { name: "substr", arity: 4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getrange },
    CommandSpec { name: "setrange", arity: 4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: setrange },
    CommandSpec { name: "msetnx", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: -1, step: 2, scope: Scope::Keys, handler: msetnx },
    CommandSpec { name: "incrbyfloat", arity: 3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: incrbyfloat },
    CommandSpec { name: "setbit", arity: 4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: setbit },
    CommandSpec { name: "getbit", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: getbit },
    CommandSpec { name: "bitcount", arity: -2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: bitcount },
    CommandSpec { name: "bitpos", arity: -3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: bitpos },
    CommandSpec { name: "bitfield", arity: -2, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::bitfield::bitfield },
    CommandSpec { name: "bitfield_ro", arity: -2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: super::bitfield::bitfield_ro },
];

/// Turns a relative or absolute expiry argument into a deadline in unix ms.
/// `unit_ms` is 1000 for seconds; `absolute` for EXAT/PXAT-style arguments.
pub fn deadline(now_ms: u64, amount: i64, unit_ms: i64, absolute: bool, command: &str) -> CommandResult<i64> {
    let invalid = || CommandError::InvalidExpire(command.into());
    let amount_ms = amount.checked_mul(unit_ms).ok_or_else(invalid)?;
    if absolute {
        Ok(amount_ms)
    } else {
        amount_ms.checked_add(now_ms as i64).ok_or_else(invalid)
    }
}

/// The hot path: the reply is written from the engine's own copy of the value.
fn get(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let now_ms = context.now_ms;
    let engine = context.engine(key);
    let out = &mut *context.out;
    let mut found = Ok(false);
    engine.get_with(key, &mut |raw| {
        found = match raw.map(decode_header).transpose() {
            Ok(Some((Kind::String, deadline, start)))
                if deadline.is_none_or(|deadline| deadline > now_ms) =>
            {
                out.bulk(&raw.unwrap_or_default()[start..]);
                Ok(true)
            }
            Ok(Some((_, deadline, _))) if deadline.is_none_or(|deadline| deadline > now_ms) => {
                Err(CommandError::WrongType)
            }
            Ok(_) => {
                out.null();
                Ok(false)
            }
            Err(error) => Err(error.into()),
        };
    })?;
    let found = found?;
    context.count_lookup(found);
    Ok(())
}

#[derive(Default)]
struct SetOptions {
    only_if_absent: bool,
    only_if_present: bool,
    return_old: bool,
    keep_ttl: bool,
    expires_at_ms: Option<i64>,
}

fn parse_set_options(context: &Context, request: &Request) -> CommandResult<SetOptions> {
    let mut options = SetOptions::default();
    let mut index = 3;
    while index < request.len() {
        let arg = request.arg(index);
        let expiry = [("ex", 1000, false), ("px", 1, false), ("exat", 1000, true), ("pxat", 1, true)]
            .into_iter()
            .find(|(name, _, _)| is(arg, name));
        if let Some((_, unit_ms, absolute)) = expiry {
            if options.expires_at_ms.is_some() || options.keep_ttl || index + 1 >= request.len() {
                return Err(CommandError::Syntax);
            }
            let amount = integer_arg(request, index + 1)?;
            if amount <= 0 {
                return Err(CommandError::InvalidExpire("set".into()));
            }
            options.expires_at_ms = Some(deadline(context.now_ms, amount, unit_ms, absolute, "set")?);
            index += 2;
            continue;
        }
        if is(arg, "nx") && !options.only_if_present {
            options.only_if_absent = true;
        } else if is(arg, "xx") && !options.only_if_absent {
            options.only_if_present = true;
        } else if is(arg, "get") {
            options.return_old = true;
        } else if is(arg, "keepttl") && options.expires_at_ms.is_none() {
            options.keep_ttl = true;
        } else {
            return Err(CommandError::Syntax);
        }
        index += 1;
    }
    Ok(options)
}

/// The shared body of SET, SETNX, SETEX, GETSET: writes `value` under `key`.
/// Returns whether it wrote, and the old string when `options.return_old`.
fn set_value(
    context: &mut Context,
    key: &[u8],
    value: &[u8],
    options: &SetOptions,
) -> CommandResult<(bool, Option<Bytes>)> {
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    // Plain SET needs no read; options that depend on the old value do.
    let needs_old =
        options.only_if_absent || options.only_if_present || options.return_old || options.keep_ttl;
    let old = if needs_old { read_live(engine, key, context.now_ms)? } else { None };
    if options.return_old {
        if let Some(old) = &old {
            if old.kind != Kind::String {
                return Err(CommandError::WrongType);
            }
        }
    }
    let old_payload = old.as_ref().map(|old| old.payload.clone());
    if (options.only_if_absent && old.is_some()) || (options.only_if_present && old.is_none()) {
        return Ok((false, old_payload));
    }
    let expires_at_ms = match options.expires_at_ms {
        Some(deadline) if deadline <= context.now_ms as i64 => {
            // A deadline already past: the key is set and gone at once.
            engine.delete(key)?;
            return Ok((true, old_payload));
        }
        Some(deadline) => Some(deadline as u64),
        None if options.keep_ttl => old.as_ref().and_then(|old| old.expires_at_ms),
        None => None,
    };
    write(engine, key, Kind::String, expires_at_ms, value, context.bulk_bytes_max())?;
    Ok((true, old_payload))
}

fn set(context: &mut Context, request: &Request) -> CommandResult {
    let options = parse_set_options(context, request)?;
    let (written, old) = set_value(context, request.arg(1), request.arg(2), &options)?;
    if options.return_old {
        context.out.bulk_or_null(old.as_deref());
    } else if written {
        context.out.ok();
    } else {
        context.out.null();
    }
    Ok(())
}

fn setnx(context: &mut Context, request: &Request) -> CommandResult {
    let options = SetOptions { only_if_absent: true, ..SetOptions::default() };
    let (written, _) = set_value(context, request.arg(1), request.arg(2), &options)?;
    context.out.integer(i64::from(written));
    Ok(())
}

fn set_with_expiry(context: &mut Context, request: &Request, unit_ms: i64, command: &str) -> CommandResult {
    let amount = integer_arg(request, 2)?;
    if amount <= 0 {
        return Err(CommandError::InvalidExpire(command.into()));
    }
    let expires_at_ms = Some(deadline(context.now_ms, amount, unit_ms, false, command)?);
    let options = SetOptions { expires_at_ms, ..SetOptions::default() };
    set_value(context, request.arg(1), request.arg(3), &options)?;
    context.out.ok();
    Ok(())
}

fn setex(context: &mut Context, request: &Request) -> CommandResult {
    set_with_expiry(context, request, 1000, "setex")
}

fn psetex(context: &mut Context, request: &Request) -> CommandResult {
    set_with_expiry(context, request, 1, "psetex")
}

fn getset(context: &mut Context, request: &Request) -> CommandResult {
    let options = SetOptions { return_old: true, ..SetOptions::default() };
    let (_, old) = set_value(context, request.arg(1), request.arg(2), &options)?;
    context.out.bulk_or_null(old.as_deref());
    Ok(())
}

fn getdel(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let stored = read_kind(engine, key, Kind::String, context.now_ms)?;
    if stored.is_some() {
        engine.delete(key)?;
    }
    context.out.bulk_or_null(stored.as_ref().map(|stored| stored.payload.as_ref()));
    Ok(())
}

/// MGET: the keys' values as one batch where they share an engine (the
/// hybrid engine overlaps a batch's reads), straight from the engine's
/// memory into the reply. A key of another type answers nil rather than
/// failing, as in Redis.
fn mget(context: &mut Context, request: &Request) -> CommandResult {
    let keys: Vec<&[u8]> = request.args().skip(1).collect();
    let engines: Vec<&dyn Engine> = keys.iter().map(|key| context.engine(key)).collect();
    let one_engine = engines.iter().all(|engine| std::ptr::addr_eq(*engine, engines[0]));
    let (now_ms, stats) = (context.now_ms, context.stats);
    let mark = context.out.len();
    let out = &mut *context.out;
    out.array(keys.len());
    let mut failure = None;
    let mut answer = |raw: Option<&[u8]>| match raw.map(decode_header).transpose() {
        Ok(Some((Kind::String, deadline, start))) if deadline.is_none_or(|deadline| deadline > now_ms) => {
            out.bulk(&raw.unwrap_or_default()[start..]);
            WorkerStats::add(&stats.keyspace_hits, 1);
        }
        Ok(_) => {
            out.null();
            WorkerStats::add(&stats.keyspace_misses, 1);
        }
        Err(error) => {
            out.null();
            failure.get_or_insert(error);
        }
    };
    let read = match one_engine {
        true => engines[0].get_many_with(&keys, &mut |_, raw| answer(raw)),
        false => keys.iter().zip(&engines).try_for_each(|(key, engine)| engine.get_with(key, &mut answer)),
    };
    let answered =
        read.map_err(CommandError::from).and_then(|()| failure.map_or(Ok(()), |error| Err(error.into())));
    if answered.is_err() {
        context.out.truncate(mark);
    }
    answered
}

fn mset(context: &mut Context, request: &Request) -> CommandResult {
    if request.len().is_multiple_of(2) {
        return Err(wrong_arity(request));
    }
    let pairs: Vec<(&[u8], &[u8])> =
        (1..request.len()).step_by(2).map(|index| (request.arg(index), request.arg(index + 1))).collect();
    let _locks = context.lock_keys(pairs.iter().map(|(key, _)| *key))?;
    for (key, value) in pairs {
        write(context.engine(key), key, Kind::String, None, value, context.bulk_bytes_max())?;
    }
    context.out.ok();
    Ok(())
}

/// Adds `delta` to the integer stored at `key` (0 if absent), keeping its TTL.
fn add(context: &mut Context, key: &[u8], delta: i64) -> CommandResult {
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let updated = change_string(engine, key, context.now_ms, usize::MAX, |payload, new| {
        let current = payload.map_or(Ok(0), parse_i64)?;
        let updated = current.checked_add(delta).ok_or(DataError::Overflow)?;
        new.extend_from_slice(itoa::Buffer::new().format(updated).as_bytes());
        Ok(updated)
    })?;
    context.out.integer(updated);
    Ok(())
}

fn incr(context: &mut Context, request: &Request) -> CommandResult {
    add(context, request.arg(1), 1)
}

fn decr(context: &mut Context, request: &Request) -> CommandResult {
    add(context, request.arg(1), -1)
}

fn incrby(context: &mut Context, request: &Request) -> CommandResult {
    let delta = integer_arg(request, 2)?;
    add(context, request.arg(1), delta)
}

fn decrby(context: &mut Context, request: &Request) -> CommandResult {
    let delta = integer_arg(request, 2)?.checked_neg().ok_or(CommandError::Overflow)?;
    add(context, request.arg(1), delta)
}

fn append(context: &mut Context, request: &Request) -> CommandResult {
    let (key, suffix) = (request.arg(1), request.arg(2));
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let length = change_string(engine, key, context.now_ms, context.bulk_bytes_max(), |payload, new| {
        new.extend_from_slice(payload.unwrap_or_default());
        new.extend_from_slice(suffix);
        Ok(new.len())
    })?;
    context.out.integer(length as i64);
    Ok(())
}

fn strlen(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
    context.out.integer(stored.map_or(0, |stored| stored.payload.len() as i64));
    Ok(())
}

fn getex(context: &mut Context, request: &Request) -> CommandResult {
    // The options first (a syntax error whatever the key holds), then the
    // key, then the deadline's value (none checked for a missing key).
    let mut expiry = None;
    let mut persist = false;
    let mut index = 2;
    while index < request.len() {
        let arg = request.arg(index);
        let unit = [("ex", 1000, false), ("px", 1, false), ("exat", 1000, true), ("pxat", 1, true)]
            .into_iter()
            .find(|(name, _, _)| is(arg, name));
        match unit {
            Some((_, unit_ms, absolute)) if expiry.is_none() && !persist && index + 1 < request.len() => {
                expiry = Some((index + 1, unit_ms, absolute));
                index += 2;
            }
            None if is(arg, "persist") && expiry.is_none() && !persist => {
                persist = true;
                index += 1;
            }
            _ => return Err(CommandError::Syntax),
        }
    }
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let Some(stored) = read_kind(engine, key, Kind::String, context.now_ms)? else {
        context.out.null();
        return Ok(());
    };
    let deadline_ms = match expiry {
        Some((at, unit_ms, absolute)) => {
            let amount = integer_arg(request, at)?;
            if amount <= 0 {
                return Err(CommandError::InvalidExpire("getex".into()));
            }
            Some(deadline(context.now_ms, amount, unit_ms, absolute, "getex")?)
        }
        None => None,
    };
    match deadline_ms {
        Some(deadline) if deadline <= context.now_ms as i64 => {
            engine.delete(key)?;
        }
        Some(deadline) => {
            write(engine, key, Kind::String, Some(deadline as u64), &stored.payload, usize::MAX)?
        }
        None if persist && stored.expires_at_ms.is_some() => {
            write(engine, key, Kind::String, None, &stored.payload, usize::MAX)?
        }
        None => {}
    }
    context.out.bulk(&stored.payload);
    Ok(())
}

/// Redis's reading of a range `start..=end` over `length` units, negative
/// indexes counting from the end: `None` when it holds nothing. GETRANGE
/// and BITCOUNT (not BITPOS) call a range of two negative indexes in the
/// wrong order empty before clamping them.
fn clamp_range(start: i64, end: i64, length: i64) -> Option<(i64, i64)> {
    if start < 0 && end < 0 && start > end {
        return None;
    }
    clamp_indexes(start, end, length)
}

fn clamp_indexes(start: i64, end: i64, length: i64) -> Option<(i64, i64)> {
    let from_end = |index: i64| if index < 0 { length.saturating_add(index).max(0) } else { index };
    let (start, end) = (from_end(start), from_end(end).min(length - 1));
    (start <= end && length > 0).then_some((start, end))
}

fn getrange(context: &mut Context, request: &Request) -> CommandResult {
    let (start, end) = (integer_arg(request, 2)?, integer_arg(request, 3)?);
    let key = request.arg(1);
    let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
    let value = stored.map(|stored| stored.payload).unwrap_or_default();
    match clamp_range(start, end, value.len() as i64) {
        Some((start, end)) => context.out.bulk(&value[start as usize..=end as usize]),
        None => context.out.bulk(b""),
    }
    Ok(())
}

/// LCS: the longest common subsequence of two strings, its length, or
/// where its runs lie in each (IDX), as Redis answers. The table it is
/// computed over is (len1 + 1) × (len2 + 1) counters, bounded, as in Redis,
/// by proto-max-bulk-len.
fn lcs(context: &mut Context, request: &Request) -> CommandResult {
    let read = |key: &[u8]| -> CommandResult<Bytes> {
        let stored =
            read_kind(context.engine(key), key, Kind::String, context.now_ms).map_err(
                |error| match error {
                    tessera_data::DataError::WrongType => {
                        CommandError::Other("The specified keys must contain string values".into())
                    }
                    other => other.into(),
                },
            )?;
        Ok(stored.map(|stored| stored.payload).unwrap_or_default())
    };
    let (a, b) = (read(request.arg(1))?, read(request.arg(2))?);
    let (mut length_only, mut indexes, mut min_match, mut with_match_length) = (false, false, 0u64, false);
    let mut index = 3;
    while index < request.len() {
        let option = request.arg(index);
        if is(option, "len") {
            length_only = true;
        } else if is(option, "idx") {
            indexes = true;
        } else if is(option, "withmatchlen") {
            with_match_length = true;
        } else if is(option, "minmatchlen") && index + 1 < request.len() {
            min_match = integer_arg(request, index + 1)?.max(0) as u64;
            index += 1;
        } else {
            return Err(CommandError::Syntax);
        }
        index += 1;
    }
    if length_only && indexes {
        return Err(CommandError::Other(
            "If you want both the length and indexes, please just use IDX.".into(),
        ));
    }
    let cells = (a.len() as u128 + 1) * (b.len() as u128 + 1);
    if cells * 4 > context.bulk_bytes_max() as u128 {
        return Err(CommandError::Other(
            "Insufficient memory, transient memory for LCS exceeds proto-max-bulk-len".into(),
        ));
    }
    // table[i * width + j]: the LCS length of a[..i] and b[..j].
    let width = b.len() + 1;
    let mut table = vec![0u32; cells as usize];
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            table[i * width + j] = if a[i - 1] == b[j - 1] {
                table[(i - 1) * width + j - 1] + 1
            } else {
                table[(i - 1) * width + j].max(table[i * width + j - 1])
            };
        }
    }
    let total = table[a.len() * width + b.len()] as usize;
    if length_only {
        context.out.integer(total as i64);
        return Ok(());
    }
    // Walk back from the end: the subsequence, and its runs in both strings.
    let mut common = vec![0u8; total];
    let mut runs: Vec<((usize, usize), (usize, usize))> = Vec::new();
    let (mut i, mut j, mut filled) = (a.len(), b.len(), total);
    let mut open: Option<((usize, usize), (usize, usize))> = None;
    while i > 0 && j > 0 {
        let close;
        if a[i - 1] == b[j - 1] {
            filled -= 1;
            common[filled] = a[i - 1];
            open = Some(match open {
                // A run grows backwards while both sides stay contiguous.
                Some(((a_start, a_end), (b_start, b_end))) if a_start == i && b_start == j => {
                    ((a_start - 1, a_end), (b_start - 1, b_end))
                }
                _ => ((i - 1, i - 1), (j - 1, j - 1)),
            });
            let ((a_start, _), (b_start, _)) = open.expect("set above");
            close = a_start == 0 || b_start == 0;
            i -= 1;
            j -= 1;
        } else {
            if table[(i - 1) * width + j] > table[i * width + j - 1] {
                i -= 1;
            } else {
                j -= 1;
            }
            close = open.is_some();
        }
        if close {
            if let Some(run) = open.take() {
                if (run.0 .1 - run.0 .0 + 1) as u64 >= min_match {
                    runs.push(run);
                }
            }
        }
    }
    if !indexes {
        context.out.bulk(&common);
        return Ok(());
    }
    let resp3 = context.out.protocol() == tessera_wire::Protocol::Resp3;
    if resp3 {
        context.out.map(2);
    } else {
        context.out.array(4);
    }
    context.out.bulk(b"matches");
    context.out.array(runs.len());
    for ((a_start, a_end), (b_start, b_end)) in runs {
        context.out.array(if with_match_length { 3 } else { 2 });
        for (start, end) in [(a_start, a_end), (b_start, b_end)] {
            context.out.array(2);
            context.out.integer(start as i64);
            context.out.integer(end as i64);
        }
        if with_match_length {
            context.out.integer((a_end - a_start + 1) as i64);
        }
    }
    context.out.bulk(b"len");
    context.out.integer(total as i64);
    Ok(())
}

/// BITOP AND|OR|XOR|NOT: the sources combined byte by byte (a shorter or
/// missing one read as zeros) into the destination, replaced whole (deleted
/// when the result is empty); answers the result's length.
fn bitop(context: &mut Context, request: &Request) -> CommandResult {
    let operation = request.arg(1);
    let not = is(operation, "not");
    let combine: fn(u8, u8) -> u8 = if is(operation, "and") {
        |a, b| a & b
    } else if is(operation, "or") {
        |a, b| a | b
    } else if is(operation, "xor") {
        |a, b| a ^ b
    } else if not {
        if request.len() != 4 {
            return Err(CommandError::Other("BITOP NOT must be called with a single source key.".into()));
        }
        |a, _| a // one source: nothing to combine
    } else {
        return Err(CommandError::Syntax);
    };
    let destination = request.arg(2);
    let _locks = context.lock_keys(request.args().skip(2))?;
    let mut sources = Vec::with_capacity(request.len() - 3);
    for key in request.args().skip(3) {
        let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
        sources.push(stored.map(|stored| stored.payload).unwrap_or_default());
    }
    let length = sources.iter().map(Bytes::len).max().unwrap_or(0);
    let byte_of = |source: &Bytes, index: usize| source.get(index).copied().unwrap_or(0);
    let result: Vec<u8> = (0..length)
        .map(|index| {
            let first = byte_of(&sources[0], index);
            let first = if not { !first } else { first };
            sources[1..].iter().fold(first, |result, source| combine(result, byte_of(source, index)))
        })
        .collect();
    let engine = context.engine(destination);
    if result.is_empty() {
        engine.delete(destination)?;
    } else {
        write(engine, destination, Kind::String, None, &result, usize::MAX)?;
    }
    context.out.integer(result.len() as i64);
    Ok(())
}

fn setrange(context: &mut Context, request: &Request) -> CommandResult {
    let offset = integer_arg(request, 2)?;
    if offset < 0 {
        return Err(CommandError::Other("offset is out of range".into()));
    }
    let (key, patch) = (request.arg(1), request.arg(3));
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    if patch.is_empty() {
        // Nothing to write: a missing key stays missing.
        let old = read_kind(engine, key, Kind::String, context.now_ms)?;
        context.out.integer(old.map_or(0, |old| old.payload.len()) as i64);
        return Ok(());
    }
    let offset = offset as usize;
    if offset.saturating_add(patch.len()) > context.bulk_bytes_max() {
        return Err(CommandError::TooLarge);
    }
    let length = change_string(engine, key, context.now_ms, usize::MAX, |payload, new| {
        new.extend_from_slice(payload.unwrap_or_default());
        if new.len() < offset + patch.len() {
            new.resize(offset + patch.len(), 0);
        }
        new[offset..offset + patch.len()].copy_from_slice(patch);
        Ok(new.len())
    })?;
    context.out.integer(length as i64);
    Ok(())
}

fn msetnx(context: &mut Context, request: &Request) -> CommandResult {
    if request.len().is_multiple_of(2) {
        return Err(wrong_arity(request));
    }
    let pairs: Vec<(&[u8], &[u8])> =
        (1..request.len()).step_by(2).map(|index| (request.arg(index), request.arg(index + 1))).collect();
    let _locks = context.lock_keys(pairs.iter().map(|(key, _)| *key))?;
    for (key, _) in &pairs {
        if read_live(context.engine(key), key, context.now_ms)?.is_some() {
            context.out.integer(0);
            return Ok(());
        }
    }
    for (key, value) in pairs {
        write(context.engine(key), key, Kind::String, None, value, context.bulk_bytes_max())?;
    }
    context.out.integer(1);
    Ok(())
}

fn incrbyfloat(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let updated = change_string(engine, key, context.now_ms, usize::MAX, |payload, new| {
        // The kind is checked first, then the increment, as Redis does.
        let increment = LongDouble::parse(request.arg(2))?;
        let current = LongDouble::parse(payload.unwrap_or(b"0"))?;
        let updated = current.checked_add(increment)?.to_human();
        new.extend_from_slice(updated.as_bytes());
        Ok(updated)
    })?;
    context.out.bulk(updated.as_bytes());
    Ok(())
}

/// A bit offset argument: within a string of at most `bulk_bytes_max` bytes.
fn bit_offset(context: &Context, request: &Request, index: usize) -> CommandResult<usize> {
    let invalid = || CommandError::Other("bit offset is not an integer or out of range".into());
    let offset = integer_arg(request, index).map_err(|_| invalid())?;
    if offset < 0 || (offset >> 3) as u64 >= context.bulk_bytes_max() as u64 {
        return Err(invalid());
    }
    Ok(offset as usize)
}

fn setbit(context: &mut Context, request: &Request) -> CommandResult {
    let offset = bit_offset(context, request, 2)?;
    let on = match request.arg(3) {
        b"0" => false,
        b"1" => true,
        _ => return Err(CommandError::Other("bit is not an integer or out of range".into())),
    };
    let key = request.arg(1);
    let engine = context.engine(key);
    let _lock = context.lock_key(key)?;
    let old = read_kind(engine, key, Kind::String, context.now_ms)?;
    let mut value = old.as_ref().map(|old| old.payload.to_vec()).unwrap_or_default();
    let (byte, mask) = (offset >> 3, 0x80u8 >> (offset & 7));
    if value.len() <= byte {
        value.resize(byte + 1, 0);
    }
    let was_on = value[byte] & mask != 0;
    if on {
        value[byte] |= mask;
    } else {
        value[byte] &= !mask;
    }
    write(engine, key, Kind::String, old.and_then(|old| old.expires_at_ms), &value, usize::MAX)?;
    context.out.integer(i64::from(was_on));
    Ok(())
}

fn getbit(context: &mut Context, request: &Request) -> CommandResult {
    let offset = bit_offset(context, request, 2)?;
    let key = request.arg(1);
    let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
    let on = stored
        .and_then(|stored| stored.payload.get(offset >> 3).copied())
        .is_some_and(|byte| byte & (0x80 >> (offset & 7)) != 0);
    context.out.integer(i64::from(on));
    Ok(())
}

fn bit_at(value: &[u8], position: i64) -> bool {
    value[(position >> 3) as usize] & (0x80 >> (position & 7)) != 0
}

/// BITCOUNT's and BITPOS's range: `start` and `end` (arguments at those
/// indexes, `end` possibly absent) in bytes or, with `BIT` after them, in
/// bits; the bits it covers, or `None` when it is empty.
fn bit_range(
    request: &Request,
    start_at: usize,
    value_length: usize,
    clamp: fn(i64, i64, i64) -> Option<(i64, i64)>,
) -> CommandResult<Option<(i64, i64)>> {
    let start = integer_arg(request, start_at)?;
    let in_bits = match request.len() {
        length if length == start_at + 3 => {
            let unit = request.arg(start_at + 2);
            if is(unit, "bit") {
                true
            } else if is(unit, "byte") {
                false
            } else {
                return Err(CommandError::Syntax);
            }
        }
        _ => false,
    };
    let length = value_length as i64 * if in_bits { 8 } else { 1 };
    let end = if request.len() > start_at + 1 { integer_arg(request, start_at + 1)? } else { length - 1 };
    Ok(clamp(start, end, length)
        .map(|(start, end)| if in_bits { (start, end) } else { (start * 8, end * 8 + 7) }))
}

fn bitcount(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
    let Some(stored) = stored else {
        context.out.integer(0);
        return Ok(());
    };
    let value = stored.payload;
    let range = match request.len() {
        2 => clamp_range(0, -1, value.len() as i64).map(|(start, end)| (start * 8, end * 8 + 7)),
        4 | 5 => bit_range(request, 2, value.len(), clamp_range)?,
        _ => return Err(CommandError::Syntax),
    };
    let count = range.map_or(0, |(first, last)| (first..=last).filter(|&bit| bit_at(&value, bit)).count());
    context.out.integer(count as i64);
    Ok(())
}

fn bitpos(context: &mut Context, request: &Request) -> CommandResult {
    let wanted = match integer_arg(request, 2)? {
        0 => false,
        1 => true,
        _ => return Err(CommandError::Other("The bit argument must be 1 or 0.".into())),
    };
    let key = request.arg(1);
    let Some(stored) = read_kind(context.engine(key), key, Kind::String, context.now_ms)? else {
        // A missing key reads as endless zero bits.
        context.out.integer(if wanted { -1 } else { 0 });
        return Ok(());
    };
    let value = stored.payload;
    let range = match request.len() {
        3 => clamp_range(0, -1, value.len() as i64).map(|(start, end)| (start * 8, end * 8 + 7)),
        4..=6 => bit_range(request, 3, value.len(), clamp_indexes)?,
        _ => return Err(CommandError::Syntax),
    };
    let end_given = request.len() >= 5;
    let position = match range {
        None => -1,
        Some((first, last)) => match (first..=last).find(|&bit| bit_at(&value, bit) == wanted) {
            Some(bit) => bit,
            // Without an end the string goes on in zeros past the range.
            None if !wanted && !end_given => last + 1,
            None => -1,
        },
    };
    context.out.integer(position);
    Ok(())
}
