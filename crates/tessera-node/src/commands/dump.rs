//! DUMP and RESTORE in Redis's serialization format ([`crate::rdb`]), so that
//! values move between Tessera and Redis (`redis-cli --cluster import`,
//! MIGRATE from a Redis node).

use bytes::Bytes;
use tessera_wire::Request;

use super::{integer_arg, is, Context};
use crate::error::{CommandError, CommandResult};
use crate::hashed::{self, Hashed, Layout};
use crate::list::{End, List};
use crate::rdb::{self, Value};
use crate::typed::{encode, read_live, write, Kind};
use crate::zset::SortedSet;

/// The value at `key` as the format carries it, and its deadline.
pub fn read_value(context: &Context, key: &[u8]) -> CommandResult<Option<(Value, Option<u64>)>> {
    let engine = context.engine(key);
    let now = context.now_ms;
    let Some(stored) = read_live(engine, key, now)? else { return Ok(None) };
    let value = match stored.kind {
        Kind::String => Value::String(stored.payload),
        Kind::List => {
            let mut list = List::open(engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            Value::List(if list.is_empty() { Vec::new() } else { list.range(0, list.len() - 1)? })
        }
        Kind::Set | Kind::Hash => {
            let layout = Layout::of(stored.kind).expect("a set or a hash");
            let mut value = Hashed::open(layout, engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            if layout == Layout::Set {
                Value::Set(value.members()?)
            } else {
                Value::Hash(value.entries()?)
            }
        }
        Kind::SortedSet => {
            let mut set = SortedSet::open(engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            Value::SortedSet(if set.is_empty() {
                Vec::new()
            } else {
                set.range_by_rank(0, set.len() - 1, false)?
            })
        }
    };
    Ok(Some((value, stored.expires_at_ms)))
}

/// Writes `value` at `key` in place of whatever was there. The caller holds
/// the key's lock.
pub fn store_value(context: &Context, key: &[u8], value: Value, expires_at_ms: Option<u64>) -> CommandResult {
    let engine = context.engine(key);
    let reserved = &context.table(key).reserved;
    let now = context.now_ms;
    engine.delete(key)?;
    match value {
        Value::String(bytes) => return write(engine, key, Kind::String, expires_at_ms, &bytes, usize::MAX),
        Value::List(elements) => {
            let mut list = List::open_or_new(engine, key, now)?;
            for element in elements {
                list.push(End::Back, element)?;
            }
            list.commit(reserved)?;
        }
        Value::Set(members) => {
            let entries = members.into_iter().map(|member| (member, Bytes::new()));
            hashed::store(Layout::Set, engine, key, entries, None, now, reserved)?;
        }
        Value::Hash(entries) => {
            hashed::store(Layout::Hash, engine, key, entries, None, now, reserved)?;
        }
        Value::SortedSet(entries) => {
            let mut set = SortedSet::open_or_new(engine, key, now)?;
            for (score, member) in &entries {
                set.insert(member, *score)?;
            }
            set.commit(reserved)?;
        }
    }
    // A collection's deadline is in the value at its key, as EXPIRE sets it.
    if let Some(deadline) = expires_at_ms {
        let stored = read_live(engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
        engine.put(key, encode(stored.kind, Some(deadline), &stored.payload))?;
    }
    context.node.waiters.signal(key);
    Ok(())
}

pub fn dump(context: &mut Context, request: &Request) -> CommandResult {
    match read_value(context, request.arg(1))? {
        Some((value, _)) => context.out.bulk(&rdb::dump(&value)),
        None => context.out.null(),
    }
    Ok(())
}

/// `RESTORE key ttl payload [REPLACE] [ABSTTL] [IDLETIME s] [FREQ f]`, checked
/// in Redis's order: options, then the key's absence, the TTL, the payload.
pub fn restore(context: &mut Context, request: &Request) -> CommandResult {
    let (mut replace, mut absolute, mut idle_seconds, mut frequency_given) = (false, false, None, false);
    let mut at = 4;
    while at < request.len() {
        let (option, more) = (request.arg(at), at + 1 < request.len());
        if is(option, "replace") {
            replace = true;
        } else if is(option, "absttl") {
            absolute = true;
        } else if is(option, "idletime") && more && !frequency_given {
            let idle = integer_arg(request, at + 1)?;
            if idle < 0 {
                return Err(CommandError::Other("Invalid IDLETIME value, must be >= 0".into()));
            }
            idle_seconds = Some(idle as u64);
            at += 1;
        } else if is(option, "freq") && more && idle_seconds.is_none() {
            // Kept by Redis under an LFU policy only, which Tessera has not.
            let count = integer_arg(request, at + 1)?;
            if !(0..=255).contains(&count) {
                return Err(CommandError::Other("Invalid FREQ value, must be >= 0 and <= 255".into()));
            }
            frequency_given = true;
            at += 1;
        } else {
            return Err(CommandError::Syntax);
        }
        at += 1;
    }
    let key = request.arg(1);
    let _lock = context.lock_key(key)?;
    let exists = read_live(context.engine(key), key, context.now_ms)?.is_some();
    if exists && !replace {
        return Err(CommandError::BusyKey);
    }
    let ttl = integer_arg(request, 2)?;
    if ttl < 0 {
        return Err(CommandError::Other("Invalid TTL value, must be >= 0".into()));
    }
    let value = rdb::restore(request.arg(3), context.bulk_bytes_max()).map_err(|error| {
        tracing::debug!(%error, ?error, "RESTORE refused a payload");
        CommandError::Other(error.to_string())
    })?;
    let deadline = match ttl {
        0 => None,
        ttl if absolute => Some(ttl as u64),
        ttl => Some(context.now_ms.saturating_add(ttl as u64)),
    };
    if deadline.is_some_and(|deadline| deadline <= context.now_ms) {
        // Already past: as in Redis, the key is replaced by nothing.
        if exists {
            context.engine(key).delete(key)?;
        }
    } else {
        store_value(context, key, value, deadline)?;
        if let Some(idle) = idle_seconds {
            context.node.access.touch(key, context.now_ms.saturating_sub(idle.saturating_mul(1000)));
        }
    }
    context.out.ok();
    Ok(())
}
