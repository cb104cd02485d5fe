//! Hash commands, atomic per key over any engine: every command, reads
//! included, runs under the key's lock because a large hash spans several
//! entries ([`crate::hashed`]).

use std::collections::HashSet;

use bytes::Bytes;
use tessera_wire::{Protocol, Request};

use super::sets::{insert_entries, scan_hashed, with_hashed};
use super::{integer_arg, is, wrong_arity, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::hashed::{Hashed, Layout};
use crate::long_double::LongDouble;
use crate::typed::parse_i64;

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
    CommandSpec { name: "hincrbyfloat", arity: 4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hincrbyfloat },
    CommandSpec { name: "hrandfield", arity: -2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hrandfield },
    CommandSpec { name: "hscan", arity: -3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: hscan },
];

/// Runs `change` on the hash at `key` (a new one if there is none) under
/// the key's lock, and writes what it changed.
fn change_hash<T>(
    context: &mut Context,
    key: &[u8],
    change: impl FnOnce(&mut Hashed) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key)?;
    let mut hash = Hashed::open_or_new(Layout::Hash, context.engine(key), key, context.now_ms)?;
    let answer = change(&mut hash)?;
    hash.commit(&context.table(key).reserved)?;
    Ok(answer)
}

fn set_fields(context: &mut Context, request: &Request) -> CommandResult<i64> {
    if !request.len().is_multiple_of(2) {
        return Err(wrong_arity(request));
    }
    let entries: Vec<(&[u8], &[u8])> =
        (2..request.len()).step_by(2).map(|index| (request.arg(index), request.arg(index + 1))).collect();
    let added = insert_entries(context, Layout::Hash, request.arg(1), &entries)?;
    // Redis counts HSET as a change of the key even when every field held
    // its value already: a transaction watching it aborts.
    context.node.versions.moved(request.arg(1));
    Ok(added)
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
    let added = change_hash(context, request.arg(1), |hash| {
        if hash.contains(request.arg(2))? {
            return Ok(false);
        }
        Ok(hash.insert(request.arg(2), Bytes::copy_from_slice(request.arg(3)))?)
    })?;
    context.out.integer(i64::from(added));
    Ok(())
}

/// The value of one field.
fn field(context: &mut Context, key: &[u8], field: &[u8]) -> CommandResult<Option<Bytes>> {
    with_hashed(context, Layout::Hash, key, |hash| match hash {
        Some(hash) => Ok(hash.get(field)?),
        None => Ok(None),
    })
}

fn hget(context: &mut Context, request: &Request) -> CommandResult {
    let value = field(context, request.arg(1), request.arg(2))?;
    context.out.bulk_or_null(value.as_deref());
    Ok(())
}

fn hmget(context: &mut Context, request: &Request) -> CommandResult {
    let values = with_hashed(context, Layout::Hash, request.arg(1), |mut hash| {
        request
            .args()
            .skip(2)
            .map(|field| match hash.as_deref_mut() {
                Some(hash) => Ok(hash.get(field)?),
                None => Ok(None),
            })
            .collect::<CommandResult<Vec<_>>>()
    })?;
    context.out.array(values.len());
    for value in &values {
        context.out.bulk_or_null(value.as_deref());
    }
    Ok(())
}

fn all_fields(context: &mut Context, key: &[u8]) -> CommandResult<Vec<(Bytes, Bytes)>> {
    with_hashed(context, Layout::Hash, key, |hash| match hash {
        Some(hash) => Ok(hash.entries()?),
        None => Ok(Vec::new()),
    })
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

/// HKEYS and HVALS: one part of every field.
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
    let removed = with_hashed(context, Layout::Hash, request.arg(1), |hash| {
        let Some(hash) = hash else { return Ok(0) };
        let mut removed = 0;
        for field in request.args().skip(2) {
            removed += i64::from(hash.remove(field)?);
        }
        Ok(removed)
    })?;
    context.out.integer(removed);
    Ok(())
}

fn hlen(context: &mut Context, request: &Request) -> CommandResult {
    let length =
        with_hashed(context, Layout::Hash, request.arg(1), |hash| Ok(hash.map_or(0, |hash| hash.len())))?;
    context.out.integer(length as i64);
    Ok(())
}

fn hexists(context: &mut Context, request: &Request) -> CommandResult {
    let found = field(context, request.arg(1), request.arg(2))?.is_some();
    context.out.integer(i64::from(found));
    Ok(())
}

fn hstrlen(context: &mut Context, request: &Request) -> CommandResult {
    let length = field(context, request.arg(1), request.arg(2))?.map_or(0, |value| value.len());
    context.out.integer(length as i64);
    Ok(())
}

fn hincrby(context: &mut Context, request: &Request) -> CommandResult {
    let delta = parse_i64(request.arg(3))?;
    let field = request.arg(2);
    let updated = change_hash(context, request.arg(1), |hash| {
        let current = match hash.get(field)? {
            Some(value) => parse_i64(&value).map_err(|_| CommandError::HashValueNotInteger)?,
            None => 0,
        };
        let updated = current.checked_add(delta).ok_or(CommandError::Overflow)?;
        hash.insert(field, Bytes::from(updated.to_string()))?;
        Ok(updated)
    })?;
    context.out.integer(updated);
    Ok(())
}

fn hincrbyfloat(context: &mut Context, request: &Request) -> CommandResult {
    let delta = LongDouble::parse(request.arg(3))?;
    if !delta.is_finite() {
        return Err(CommandError::Other("value is NaN or Infinity".into()));
    }
    let field = request.arg(2);
    let updated = change_hash(context, request.arg(1), |hash| {
        let current = match hash.get(field)? {
            Some(value) => LongDouble::parse(&value)
                .map_err(|_| CommandError::Other("hash value is not a float".into()))?,
            None => LongDouble::parse(b"0")?,
        };
        let updated = Bytes::from(current.checked_add(delta)?.to_human());
        hash.insert(field, updated.clone())?;
        Ok(updated)
    })?;
    context.out.bulk(&updated);
    Ok(())
}

fn hrandfield(context: &mut Context, request: &Request) -> CommandResult {
    let (count, with_values) = match request.len() {
        2 => (None, false),
        3 => (Some(integer_arg(request, 2)?), false),
        4 if is(request.arg(3), "withvalues") => (Some(integer_arg(request, 2)?), true),
        _ => return Err(CommandError::Syntax),
    };
    let picked = with_hashed(context, Layout::Hash, request.arg(1), |hash| {
        let Some(hash) = hash else { return Ok(Vec::new()) };
        match count {
            None => Ok(hash.random_entry()?.into_iter().collect()),
            // Negative: that many picks, repeats allowed.
            Some(count) if count < 0 => {
                (0..count.unsigned_abs()).map(|_| Ok(hash.random_entry()?.expect("not empty"))).collect()
            }
            Some(count) if count as u64 >= hash.len() => Ok(hash.entries()?),
            Some(count) => {
                let mut seen = HashSet::new();
                let mut picked = Vec::new();
                while (picked.len() as i64) < count {
                    let entry = hash.random_entry()?.expect("not empty");
                    if seen.insert(entry.0.clone()) {
                        picked.push(entry);
                    }
                }
                Ok(picked)
            }
        }
    })?;
    let out = &mut *context.out;
    match count {
        None => out.bulk_or_null(picked.first().map(|(field, _)| &field[..])),
        Some(_) if with_values && out.protocol() == Protocol::Resp3 => {
            out.array(picked.len());
            for (field, value) in &picked {
                out.array(2);
                out.bulk(field);
                out.bulk(value);
            }
        }
        Some(_) => {
            out.array(picked.len() * if with_values { 2 } else { 1 });
            for (field, value) in &picked {
                out.bulk(field);
                if with_values {
                    out.bulk(value);
                }
            }
        }
    }
    Ok(())
}

fn hscan(context: &mut Context, request: &Request) -> CommandResult {
    scan_hashed(context, request, Layout::Hash)
}
