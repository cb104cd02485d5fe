//! Hash commands, atomic per key over any engine: a hash is one engine value,
//! changed under the key's lock.

use bytes::Bytes;
use tessera_wire::Request;

use super::{wrong_arity, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::typed::{parse_i64, Hash, HashFields, Kind, Stored};
use crate::typed::{read_kind, write};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "hset", arity: -4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hset },
    CommandSpec { name: "hmset", arity: -4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hmset },
    CommandSpec { name: "hsetnx", arity: 4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hsetnx },
    CommandSpec { name: "hget", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hget },
    CommandSpec { name: "hmget", arity: -3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hmget },
    CommandSpec { name: "hgetall", arity: 2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hgetall },
    CommandSpec { name: "hdel", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hdel },
    CommandSpec { name: "hlen", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hlen },
    CommandSpec { name: "hexists", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hexists },
    CommandSpec { name: "hkeys", arity: 2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hkeys },
    CommandSpec { name: "hvals", arity: 2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hvals },
    CommandSpec { name: "hstrlen", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hstrlen },
    CommandSpec { name: "hincrby", arity: 4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hincrby },
];

fn read_hash(context: &mut Context, key: &[u8]) -> CommandResult<Option<Stored>> {
    let stored = read_kind(context.engine(key), key, Kind::Hash, context.now_ms)?;
    context.count_lookup(stored.is_some());
    Ok(stored)
}

/// Runs `change` on the hash at `key` under the key's lock and stores the
/// result, keeping its TTL; an emptied hash is deleted, as in Redis.
fn update_hash<T>(
    context: &mut Context,
    key: &[u8],
    change: impl FnOnce(&mut Hash) -> CommandResult<T>,
) -> CommandResult<T> {
    let engine = context.engine(key);
    let _lock = context.lock_key(key);
    let old = read_kind(engine, key, Kind::Hash, context.now_ms)?;
    let (mut hash, expires_at_ms) = match &old {
        Some(old) => (Hash::decode(&old.payload)?, old.expires_at_ms),
        None => (Hash::default(), None),
    };
    let answer = change(&mut hash)?;
    if hash.fields.is_empty() {
        if old.is_some() {
            engine.delete(key)?;
        }
    } else {
        write(engine, key, Kind::Hash, expires_at_ms, &hash.encode(), context.bulk_bytes_max())?;
    }
    Ok(answer)
}

fn set_fields(context: &mut Context, request: &Request) -> CommandResult<i64> {
    if !request.len().is_multiple_of(2) {
        return Err(wrong_arity(request));
    }
    update_hash(context, request.arg(1), |hash| {
        let mut added = 0;
        for index in (2..request.len()).step_by(2) {
            if hash.set(request.arg(index), Bytes::copy_from_slice(request.arg(index + 1))) {
                added += 1;
            }
        }
        Ok(added)
    })
}

fn hset(context: &mut Context, request: &Request) -> CommandResult {
    let added = set_fields(context, request)?;
    context.out.integer(added);
    Ok(())
}

fn hmset(context: &mut Context, request: &Request) -> CommandResult {
    set_fields(context, request)?;
    context.out.ok();
    Ok(())
}

fn hsetnx(context: &mut Context, request: &Request) -> CommandResult {
    let added = update_hash(context, request.arg(1), |hash| {
        Ok(hash.get(request.arg(2)).is_none()
            && hash.set(request.arg(2), Bytes::copy_from_slice(request.arg(3))))
    })?;
    context.out.integer(i64::from(added));
    Ok(())
}

/// Finds one field without decoding the whole hash.
fn field_of(stored: &Stored, field: &[u8]) -> CommandResult<Option<Bytes>> {
    for pair in HashFields::new(&stored.payload) {
        let (name, value) = pair?;
        if name.as_ref() == field {
            return Ok(Some(value));
        }
    }
    Ok(None)
}

fn hget(context: &mut Context, request: &Request) -> CommandResult {
    let value = match read_hash(context, request.arg(1))? {
        Some(stored) => field_of(&stored, request.arg(2))?,
        None => None,
    };
    context.out.bulk_or_null(value.as_deref());
    Ok(())
}

fn hmget(context: &mut Context, request: &Request) -> CommandResult {
    let hash = match read_hash(context, request.arg(1))? {
        Some(stored) => Hash::decode(&stored.payload)?,
        None => Hash::default(),
    };
    context.out.array(request.len() - 2);
    for field in request.args().skip(2) {
        context.out.bulk_or_null(hash.get(field).map(|value| value.as_ref()));
    }
    Ok(())
}

fn all_fields(context: &mut Context, key: &[u8]) -> CommandResult<Vec<(Bytes, Bytes)>> {
    match read_hash(context, key)? {
        Some(stored) => Ok(Hash::decode(&stored.payload)?.fields),
        None => Ok(Vec::new()),
    }
}

fn hgetall(context: &mut Context, request: &Request) -> CommandResult {
    let fields = all_fields(context, request.arg(1))?;
    context.out.map(fields.len());
    for (field, value) in &fields {
        context.out.bulk(field);
        context.out.bulk(value);
    }
    Ok(())
}

/// HKEYS and HVALS: one part of every field, in insertion order.
fn reply_field_parts(
    context: &mut Context,
    request: &Request,
    part: fn(&(Bytes, Bytes)) -> &Bytes,
) -> CommandResult {
    let fields = all_fields(context, request.arg(1))?;
    context.out.array(fields.len());
    for field in &fields {
        context.out.bulk(part(field));
    }
    Ok(())
}

fn hkeys(context: &mut Context, request: &Request) -> CommandResult {
    reply_field_parts(context, request, |(field, _)| field)
}

fn hvals(context: &mut Context, request: &Request) -> CommandResult {
    reply_field_parts(context, request, |(_, value)| value)
}

fn hdel(context: &mut Context, request: &Request) -> CommandResult {
    let removed = update_hash(context, request.arg(1), |hash| {
        Ok(request.args().skip(2).filter(|field| hash.remove(field)).count() as i64)
    })?;
    context.out.integer(removed);
    Ok(())
}

fn hlen(context: &mut Context, request: &Request) -> CommandResult {
    let length = match read_hash(context, request.arg(1))? {
        Some(stored) => HashFields::new(&stored.payload).count() as i64,
        None => 0,
    };
    context.out.integer(length);
    Ok(())
}

fn hexists(context: &mut Context, request: &Request) -> CommandResult {
    let found = match read_hash(context, request.arg(1))? {
        Some(stored) => field_of(&stored, request.arg(2))?.is_some(),
        None => false,
    };
    context.out.integer(i64::from(found));
    Ok(())
}

fn hstrlen(context: &mut Context, request: &Request) -> CommandResult {
    let length = match read_hash(context, request.arg(1))? {
        Some(stored) => field_of(&stored, request.arg(2))?.map_or(0, |value| value.len()),
        None => 0,
    };
    context.out.integer(length as i64);
    Ok(())
}

fn hincrby(context: &mut Context, request: &Request) -> CommandResult {
    let delta = parse_i64(request.arg(3))?;
    let field = request.arg(2);
    let updated = update_hash(context, request.arg(1), |hash| {
        let current = match hash.get(field) {
            Some(value) => parse_i64(value).map_err(|_| CommandError::HashValueNotInteger)?,
            None => 0,
        };
        let updated = current.checked_add(delta).ok_or(CommandError::Overflow)?;
        hash.set(field, Bytes::from(updated.to_string()));
        Ok(updated)
    })?;
    context.out.integer(updated);
    Ok(())
}
