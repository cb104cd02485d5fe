//! Set commands, atomic per key over any engine: every command, reads
//! included, runs under its keys' locks because a large set spans several
//! entries ([`crate::hashed`]).

use std::collections::HashSet;

use bytes::Bytes;
use tessera_wire::Request;

use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::glob::glob_match;
use crate::hashed::{self, Hashed, Layout};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "sadd", arity: -3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: sadd },
    CommandSpec { name: "srem", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: srem },
    CommandSpec { name: "sismember", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: sismember },
    CommandSpec { name: "smismember", arity: -3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: smismember },
    CommandSpec { name: "scard", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: scard },
    CommandSpec { name: "smembers", arity: 2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: smembers },
    CommandSpec { name: "spop", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: spop },
    CommandSpec { name: "srandmember", arity: -2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: srandmember },
    CommandSpec { name: "smove", arity: 4, flags: &["write", "fast"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: smove },
    CommandSpec { name: "sinter", arity: -2, flags: &["readonly"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sinter },
    CommandSpec { name: "sunion", arity: -2, flags: &["readonly"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sunion },
    CommandSpec { name: "sdiff", arity: -2, flags: &["readonly"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sdiff },
    CommandSpec { name: "sinterstore", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sinterstore },
    CommandSpec { name: "sunionstore", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sunionstore },
    CommandSpec { name: "sdiffstore", arity: -3, flags: &["write", "denyoom"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sdiffstore },
    CommandSpec { name: "sintercard", arity: -3, flags: &["readonly", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: sintercard },
    CommandSpec { name: "sscan", arity: -3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: sscan },
];

/// Runs `body` on the set or hash at `key` (`None` if there is none) under
/// the key's lock, and writes what it changed, keeping the TTL; an emptied
/// one is deleted, as in Redis.
pub(super) fn with_hashed<T>(
    context: &mut Context,
    layout: Layout,
    key: &[u8],
    body: impl FnOnce(Option<&mut Hashed>) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key)?;
    let mut value = Hashed::open(layout, context.engine(key), key, context.now_ms)?;
    context.count_lookup(value.is_some());
    let answer = body(value.as_mut())?;
    if let Some(value) = value {
        value.commit(&context.table(key).reserved)?;
    }
    Ok(answer)
}

/// Sets each field to its value (a set's members to nothing), where the
/// value lies when it can: how many fields are new.
pub(super) fn insert_entries(
    context: &mut Context,
    layout: Layout,
    key: &[u8],
    entries: &[(&[u8], &[u8])],
) -> CommandResult<i64> {
    let _lock = context.lock_key(key)?;
    let (engine, reserved) = (context.engine(key), &context.table(key).reserved);
    if let Some(added) = hashed::insert_in_place(layout, engine, key, entries, context.now_ms, reserved)? {
        return Ok(added as i64);
    }
    let mut value = Hashed::open_or_new(layout, engine, key, context.now_ms)?;
    let mut added = 0;
    for (field, entry) in entries {
        added += i64::from(value.insert(field, Bytes::copy_from_slice(entry))?);
    }
    value.commit(reserved)?;
    Ok(added)
}

fn sadd(context: &mut Context, request: &Request) -> CommandResult {
    let members: Vec<(&[u8], &[u8])> = request.args().skip(2).map(|member| (member, &b""[..])).collect();
    let added = insert_entries(context, Layout::Set, request.arg(1), &members)?;
    context.out.integer(added);
    Ok(())
}

fn srem(context: &mut Context, request: &Request) -> CommandResult {
    let removed = with_hashed(context, Layout::Set, request.arg(1), |set| {
        let Some(set) = set else { return Ok(0) };
        let mut removed = 0;
        for member in request.args().skip(2) {
            removed += i64::from(set.remove(member)?);
        }
        Ok(removed)
    })?;
    context.out.integer(removed);
    Ok(())
}

fn sismember(context: &mut Context, request: &Request) -> CommandResult {
    let found = with_hashed(context, Layout::Set, request.arg(1), |set| match set {
        Some(set) => Ok(set.contains(request.arg(2))?),
        None => Ok(false),
    })?;
    context.out.integer(i64::from(found));
    Ok(())
}

fn smismember(context: &mut Context, request: &Request) -> CommandResult {
    let found = with_hashed(context, Layout::Set, request.arg(1), |mut set| {
        request
            .args()
            .skip(2)
            .map(|member| match set.as_deref_mut() {
                Some(set) => Ok(set.contains(member)?),
                None => Ok(false),
            })
            .collect::<CommandResult<Vec<bool>>>()
    })?;
    context.out.array(found.len());
    for found in found {
        context.out.integer(i64::from(found));
    }
    Ok(())
}

fn scard(context: &mut Context, request: &Request) -> CommandResult {
    let length = with_hashed(context, Layout::Set, request.arg(1), |set| Ok(set.map_or(0, |set| set.len())))?;
    context.out.integer(length as i64);
    Ok(())
}

fn write_set(context: &mut Context, members: &[Bytes]) {
    context.out.set(members.len());
    for member in members {
        context.out.bulk(member);
    }
}

fn smembers(context: &mut Context, request: &Request) -> CommandResult {
    let members = with_hashed(context, Layout::Set, request.arg(1), |set| match set {
        Some(set) => Ok(set.members()?),
        None => Ok(Vec::new()),
    })?;
    write_set(context, &members);
    Ok(())
}

fn spop(context: &mut Context, request: &Request) -> CommandResult {
    let count = match request.len() {
        2 => None,
        // Redis answers a count that is not a number as it answers a negative one.
        3 => Some(
            integer_arg(request, 2)
                .ok()
                .filter(|count| *count >= 0)
                .ok_or_else(|| CommandError::Other("value is out of range, must be positive".into()))?,
        ),
        _ => return Err(CommandError::Syntax),
    };
    if count.is_none() {
        let key = request.arg(1);
        let _lock = context.lock_key(key)?;
        let (engine, reserved) = (context.engine(key), &context.table(key).reserved);
        if let Some(member) = hashed::pop_random_in_place(engine, key, context.now_ms, reserved)? {
            context.out.bulk(&member);
            return Ok(());
        }
    }
    let popped = with_hashed(context, Layout::Set, request.arg(1), |set| {
        let Some(set) = set else { return Ok(Vec::new()) };
        let mut popped = Vec::new();
        for _ in 0..count.unwrap_or(1).min(set.len() as i64) {
            let (member, _) = set.random_entry()?.expect("the set is not empty");
            set.remove(&member)?;
            popped.push(member);
        }
        Ok(popped)
    })?;
    match count {
        None => context.out.bulk_or_null(popped.first().map(|member| &member[..])),
        Some(_) => write_set(context, &popped),
    }
    Ok(())
}

fn srandmember(context: &mut Context, request: &Request) -> CommandResult {
    let count = match request.len() {
        2 => None,
        3 => Some(integer_arg(request, 2)?),
        _ => return Err(CommandError::Syntax),
    };
    let picked = with_hashed(context, Layout::Set, request.arg(1), |set| {
        let Some(set) = set else { return Ok(Vec::new()) };
        match count {
            None => Ok(set.random_entry()?.into_iter().map(|(member, _)| member).collect()),
            // Negative: that many picks, repeats allowed.
            Some(count) if count < 0 => {
                (0..count.unsigned_abs()).map(|_| Ok(set.random_entry()?.expect("not empty").0)).collect()
            }
            Some(count) if count as u64 >= set.len() => Ok(set.members()?),
            Some(count) => {
                let mut picked = HashSet::new();
                while (picked.len() as i64) < count {
                    picked.insert(set.random_entry()?.expect("not empty").0);
                }
                Ok(picked.into_iter().collect())
            }
        }
    })?;
    match count {
        None => context.out.bulk_or_null(picked.first().map(|member| &member[..])),
        Some(_) => {
            context.out.array(picked.len());
            for member in &picked {
                context.out.bulk(member);
            }
        }
    }
    Ok(())
}

fn smove(context: &mut Context, request: &Request) -> CommandResult {
    let (source, destination, member) = (request.arg(1), request.arg(2), request.arg(3));
    let moved = {
        let _locks = context.lock_keys([source, destination].into_iter())?;
        match Hashed::open(Layout::Set, context.engine(source), source, context.now_ms)? {
            None => false,
            Some(mut from) if source == destination => from.contains(member)?,
            Some(mut from) => {
                // The destination's type is checked before anything moves.
                let mut to = Hashed::open_or_new(
                    Layout::Set,
                    context.engine(destination),
                    destination,
                    context.now_ms,
                )?;
                let moved = from.remove(member)?;
                if moved {
                    to.add(member)?;
                    from.commit(&context.table(source).reserved)?;
                    to.commit(&context.table(destination).reserved)?;
                }
                moved
            }
        }
    };
    context.out.integer(i64::from(moved));
    Ok(())
}

#[derive(Clone, Copy)]
enum Algebra {
    Inter,
    Union,
    Diff,
}

/// The members the operation gives over the sets at `keys` (a missing key
/// is an empty set); `WRONGTYPE` if any key holds another type. The caller
/// holds the keys' locks.
fn combine(context: &Context, keys: &[&[u8]], algebra: Algebra) -> CommandResult<Vec<Bytes>> {
    let mut sets = Vec::with_capacity(keys.len());
    for key in keys {
        sets.push(Hashed::open(Layout::Set, context.engine(key), key, context.now_ms)?);
    }
    let mut result: Vec<Bytes> = match (algebra, sets.first_mut()) {
        (_, Some(Some(first))) => first.members()?,
        _ => Vec::new(),
    };
    for set in sets.iter_mut().skip(1) {
        match (algebra, set) {
            (Algebra::Inter, None) => result.clear(),
            (Algebra::Inter, Some(set)) => {
                let mut kept = Vec::with_capacity(result.len());
                for member in result {
                    if set.contains(&member)? {
                        kept.push(member);
                    }
                }
                result = kept;
            }
            (Algebra::Union, Some(set)) => {
                let mut seen: HashSet<Bytes> = result.iter().cloned().collect();
                for member in set.members()? {
                    if seen.insert(member.clone()) {
                        result.push(member);
                    }
                }
            }
            (Algebra::Diff, Some(set)) => {
                let mut kept = Vec::with_capacity(result.len());
                for member in result {
                    if !set.contains(&member)? {
                        kept.push(member);
                    }
                }
                result = kept;
            }
            (Algebra::Union | Algebra::Diff, None) => {}
        }
    }
    Ok(result)
}

fn read_algebra(context: &mut Context, request: &Request, algebra: Algebra) -> CommandResult {
    let keys: Vec<&[u8]> = request.args().skip(1).collect();
    let members = {
        let _locks = context.lock_keys(keys.iter().copied())?;
        combine(context, &keys, algebra)?
    };
    write_set(context, &members);
    Ok(())
}

fn sinter(context: &mut Context, request: &Request) -> CommandResult {
    read_algebra(context, request, Algebra::Inter)
}

fn sunion(context: &mut Context, request: &Request) -> CommandResult {
    read_algebra(context, request, Algebra::Union)
}

fn sdiff(context: &mut Context, request: &Request) -> CommandResult {
    read_algebra(context, request, Algebra::Diff)
}

/// The STORE forms: the result replaces the destination (an empty one
/// deletes it); the reply is its size.
fn store_algebra(context: &mut Context, request: &Request, algebra: Algebra) -> CommandResult {
    let destination = request.arg(1);
    let keys: Vec<&[u8]> = request.args().skip(2).collect();
    let _locks = context.lock_keys(request.args().skip(1))?;
    let members = combine(context, &keys, algebra)?;
    let reserved = &context.table(destination).reserved;
    let entries = members.into_iter().map(|member| (member, Bytes::new()));
    let engine = context.engine(destination);
    let stored = hashed::store(Layout::Set, engine, destination, entries, None, context.now_ms, reserved)?;
    context.out.integer(stored as i64);
    Ok(())
}

fn sinterstore(context: &mut Context, request: &Request) -> CommandResult {
    store_algebra(context, request, Algebra::Inter)
}

fn sunionstore(context: &mut Context, request: &Request) -> CommandResult {
    store_algebra(context, request, Algebra::Union)
}

fn sdiffstore(context: &mut Context, request: &Request) -> CommandResult {
    store_algebra(context, request, Algebra::Diff)
}

fn sintercard(context: &mut Context, request: &Request) -> CommandResult {
    let keys = match integer_arg(request, 1) {
        Ok(keys) if keys > 0 => keys as u64,
        _ => return Err(CommandError::Other("numkeys should be greater than 0".into())),
    };
    if keys > (request.len() - 2) as u64 {
        return Err(CommandError::Other("Number of keys can't be greater than number of args".into()));
    }
    let after_keys = 2 + keys as usize;
    let limit = match request.len() - after_keys {
        0 => 0,
        2 if is(request.arg(after_keys), "limit") => match integer_arg(request, after_keys + 1) {
            Ok(limit) if limit >= 0 => limit as usize,
            _ => return Err(CommandError::Other("LIMIT can't be negative".into())),
        },
        _ => return Err(CommandError::Syntax),
    };
    let keys: Vec<&[u8]> = (2..after_keys).map(|index| request.arg(index)).collect();
    let members = {
        let _locks = context.lock_keys(keys.iter().copied())?;
        combine(context, &keys, Algebra::Inter)?
    };
    let count = if limit == 0 { members.len() } else { members.len().min(limit) };
    context.out.integer(count as i64);
    Ok(())
}

/// SSCAN and HSCAN: the cursor is a bucket ([`crate::hashed`]); an inline
/// value is answered whole with cursor 0, as Redis answers a small one. As
/// in Redis, a missing key is answered before the options are read.
pub(super) fn scan_hashed(context: &mut Context, request: &Request, layout: Layout) -> CommandResult {
    let cursor: u64 = std::str::from_utf8(request.arg(2))
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or(CommandError::InvalidCursor)?;
    let (next, entries) = with_hashed(context, layout, request.arg(1), |value| {
        let Some(value) = value else { return Ok((0, Vec::new())) };
        let (pattern, count) = parse_scan_options(request)?;
        let (next, mut entries) = value.scan(cursor, count)?;
        entries
            .retain(|(field, _): &(Bytes, Bytes)| pattern.is_none_or(|pattern| glob_match(pattern, field)));
        Ok((next, entries))
    })?;
    let with_values = layout == Layout::Hash;
    context.out.array(2);
    context.out.bulk(next.to_string().as_bytes());
    context.out.array(entries.len() * if with_values { 2 } else { 1 });
    for (field, value) in &entries {
        context.out.bulk(field);
        if with_values {
            context.out.bulk(value);
        }
    }
    Ok(())
}

fn sscan(context: &mut Context, request: &Request) -> CommandResult {
    scan_hashed(context, request, Layout::Set)
}

/// SSCAN's and HSCAN's MATCH and COUNT.
pub(super) fn parse_scan_options<'r>(request: &'r Request) -> CommandResult<(Option<&'r [u8]>, u64)> {
    let (mut pattern, mut count) = (None, 10u64);
    let mut index = 3;
    while index < request.len() {
        if index + 1 >= request.len() {
            return Err(CommandError::Syntax);
        }
        let (option, value) = (request.arg(index), request.arg(index + 1));
        if is(option, "match") {
            pattern = Some(value).filter(|pattern| *pattern != b"*");
        } else if is(option, "count") {
            count = match integer_arg(request, index + 1)? {
                count if count >= 1 => count as u64,
                _ => return Err(CommandError::Syntax),
            };
        } else {
            return Err(CommandError::Syntax);
        }
        index += 2;
    }
    Ok((pattern, count))
}
