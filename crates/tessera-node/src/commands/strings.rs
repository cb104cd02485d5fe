//! String commands: GET, SET and friends, counters, APPEND.

use bytes::Bytes;
use tessera_wire::Request;

use super::{integer_arg, is, wrong_arity, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::typed::{decode_header, parse_i64, Kind};
use crate::typed::{read_kind, read_live, write};

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
            Err(error) => Err(error),
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
    let _lock = context.lock_key(key);
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
    let _lock = context.lock_key(key);
    let stored = read_kind(engine, key, Kind::String, context.now_ms)?;
    if stored.is_some() {
        engine.delete(key)?;
    }
    context.out.bulk_or_null(stored.as_ref().map(|stored| stored.payload.as_ref()));
    Ok(())
}

fn mget(context: &mut Context, request: &Request) -> CommandResult {
    context.out.array(request.len() - 1);
    for key in request.args().skip(1) {
        // MGET answers nil for a key of another type rather than failing.
        let stored =
            read_live(context.engine(key), key, context.now_ms)?.filter(|stored| stored.kind == Kind::String);
        context.count_lookup(stored.is_some());
        context.out.bulk_or_null(stored.as_ref().map(|stored| stored.payload.as_ref()));
    }
    Ok(())
}

fn mset(context: &mut Context, request: &Request) -> CommandResult {
    if request.len().is_multiple_of(2) {
        return Err(wrong_arity(request));
    }
    let pairs: Vec<(&[u8], &[u8])> =
        (1..request.len()).step_by(2).map(|index| (request.arg(index), request.arg(index + 1))).collect();
    let _locks = context.lock_keys(pairs.iter().map(|(key, _)| *key));
    for (key, value) in pairs {
        write(context.engine(key), key, Kind::String, None, value, context.bulk_bytes_max())?;
    }
    context.out.ok();
    Ok(())
}

/// Adds `delta` to the integer stored at `key` (0 if absent), keeping its TTL.
fn add(context: &mut Context, key: &[u8], delta: i64) -> CommandResult {
    let engine = context.engine(key);
    let _lock = context.lock_key(key);
    let old = read_kind(engine, key, Kind::String, context.now_ms)?;
    let current = match &old {
        Some(old) => parse_i64(&old.payload)?,
        None => 0,
    };
    let updated = current.checked_add(delta).ok_or(CommandError::Overflow)?;
    let mut digits = itoa::Buffer::new();
    let expires_at_ms = old.and_then(|old| old.expires_at_ms);
    write(engine, key, Kind::String, expires_at_ms, digits.format(updated).as_bytes(), usize::MAX)?;
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
    let _lock = context.lock_key(key);
    let old = read_kind(engine, key, Kind::String, context.now_ms)?;
    let mut value = old.as_ref().map(|old| old.payload.to_vec()).unwrap_or_default();
    if value.len() + suffix.len() > context.bulk_bytes_max() {
        return Err(CommandError::TooLarge);
    }
    value.extend_from_slice(suffix);
    let expires_at_ms = old.and_then(|old| old.expires_at_ms);
    write(engine, key, Kind::String, expires_at_ms, &value, context.bulk_bytes_max())?;
    context.out.integer(value.len() as i64);
    Ok(())
}

fn strlen(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let stored = read_kind(context.engine(key), key, Kind::String, context.now_ms)?;
    context.out.integer(stored.map_or(0, |stored| stored.payload.len() as i64));
    Ok(())
}
