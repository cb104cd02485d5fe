//! List commands, atomic per key over any engine: every command, reads
//! included, runs under the key's lock because a large list spans several
//! entries ([`crate::list`]). The blocking pops wait in the connection
//! ([`crate::blocking`]) and run again when a push wakes them.

use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_wire::{ReplyWriter, Request};

use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::blocking::Blocked;
use crate::error::{CommandError, CommandResult};
use crate::list::{self, End, List};
use crate::long_double::LongDouble;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "lpush", arity: -3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lpush },
    CommandSpec { name: "rpush", arity: -3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: rpush },
    CommandSpec { name: "lpushx", arity: -3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lpushx },
    CommandSpec { name: "rpushx", arity: -3, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: rpushx },
    CommandSpec { name: "lpop", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lpop },
    CommandSpec { name: "rpop", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: rpop },
    CommandSpec { name: "llen", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: llen },
    CommandSpec { name: "lindex", arity: 3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lindex },
    CommandSpec { name: "lset", arity: 4, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lset },
    CommandSpec { name: "lrange", arity: 4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lrange },
    CommandSpec { name: "ltrim", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: ltrim },
    CommandSpec { name: "lrem", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lrem },
    CommandSpec { name: "linsert", arity: 5, flags: &["write", "denyoom"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: linsert },
    CommandSpec { name: "lpos", arity: -3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: lpos },
    CommandSpec { name: "lmove", arity: 5, flags: &["write", "denyoom"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: lmove },
    CommandSpec { name: "rpoplpush", arity: 3, flags: &["write", "denyoom"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: rpoplpush },
    CommandSpec { name: "lmpop", arity: -4, flags: &["write", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: lmpop },
    CommandSpec { name: "blpop", arity: -3, flags: &["write", "blocking", "noscript"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: blpop },
    CommandSpec { name: "brpop", arity: -3, flags: &["write", "blocking", "noscript"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: brpop },
    CommandSpec { name: "blmove", arity: 6, flags: &["write", "denyoom", "blocking", "noscript"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: blmove },
    CommandSpec { name: "brpoplpush", arity: 4, flags: &["write", "denyoom", "blocking", "noscript"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: brpoplpush },
    CommandSpec { name: "blmpop", arity: -5, flags: &["write", "blocking", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: blmpop },
];

/// Runs `body` on the list at `key` (`None` if there is none) under the key's
/// lock, and writes what it changed.
fn with_list<T>(
    context: &mut Context,
    key: &[u8],
    body: impl FnOnce(Option<&mut List>) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key)?;
    let mut list = List::open(context.engine(key), key, context.now_ms)?;
    let answer = body(list.as_mut())?;
    if let Some(list) = list {
        list.commit(&context.table(key).reserved)?;
    }
    Ok(answer)
}

/// LPUSH, RPUSH and their X forms: the list's new length.
fn push(context: &mut Context, request: &Request, end: End, only_if_present: bool) -> CommandResult {
    let key = request.arg(1);
    let length = {
        let _lock = context.lock_key(key)?;
        let engine = context.engine(key);
        let elements: Vec<&[u8]> = request.args().skip(2).collect();
        let in_place = list::push_in_place(engine, key, end, &elements, context.now_ms)?;
        let list = if in_place.is_some() {
            None
        } else if only_if_present {
            List::open(engine, key, context.now_ms)?
        } else {
            Some(List::open_or_new(engine, key, context.now_ms)?)
        };
        match list {
            Some(mut list) => {
                for element in elements {
                    list.push(end, Bytes::copy_from_slice(element))?;
                }
                let length = list.len();
                list.commit(&context.table(key).reserved)?;
                length
            }
            None => in_place.unwrap_or(0),
        }
    };
    if length > 0 {
        context.node.waiters.signal(key);
    }
    context.out.integer(length as i64);
    Ok(())
}

fn lpush(context: &mut Context, request: &Request) -> CommandResult {
    push(context, request, End::Front, false)
}

fn rpush(context: &mut Context, request: &Request) -> CommandResult {
    push(context, request, End::Back, false)
}

fn lpushx(context: &mut Context, request: &Request) -> CommandResult {
    push(context, request, End::Front, true)
}

fn rpushx(context: &mut Context, request: &Request) -> CommandResult {
    push(context, request, End::Back, true)
}

/// Pops up to `count` elements from `end` of the list at `key`: `None` when
/// there is no list.
fn pop_some(context: &mut Context, key: &[u8], end: End, count: u64) -> CommandResult<Option<Vec<Bytes>>> {
    {
        let _lock = context.lock_key(key)?;
        if let Some(popped) = list::pop_in_place(context.engine(key), key, end, count, context.now_ms)? {
            return Ok(Some(popped));
        }
    }
    with_list(context, key, |list| {
        let Some(list) = list else { return Ok(None) };
        let mut popped = Vec::with_capacity(count.min(list.len()) as usize);
        while (popped.len() as u64) < count {
            match list.pop(end)? {
                Some(element) => popped.push(element),
                None => break,
            }
        }
        Ok(Some(popped))
    })
}

/// An argument that must be a number above zero: `message` for anything else.
pub(super) fn positive(request: &Request, index: usize, message: &str) -> CommandResult<u64> {
    match integer_arg(request, index) {
        Ok(count) if count > 0 => Ok(count as u64),
        _ => Err(CommandError::Other(message.into())),
    }
}

fn pop(context: &mut Context, request: &Request, end: End) -> CommandResult {
    if request.len() > 3 {
        return Err(super::wrong_arity(request));
    }
    let key = request.arg(1);
    if request.len() == 2 {
        let popped = pop_some(context, key, end, 1)?;
        context
            .out
            .bulk_or_null(popped.as_ref().and_then(|popped| popped.first()).map(|element| &element[..]));
        return Ok(());
    }
    // Redis answers a count that is not a number as it answers a negative one.
    let count = integer_arg(request, 2)
        .ok()
        .filter(|count| *count >= 0)
        .ok_or_else(|| CommandError::Other("value is out of range, must be positive".into()))?;
    match pop_some(context, key, end, count as u64)? {
        Some(popped) => {
            context.out.array(popped.len());
            for element in &popped {
                context.out.bulk(element);
            }
        }
        None => context.out.null_array(),
    }
    Ok(())
}

fn lpop(context: &mut Context, request: &Request) -> CommandResult {
    pop(context, request, End::Front)
}

fn rpop(context: &mut Context, request: &Request) -> CommandResult {
    pop(context, request, End::Back)
}

fn llen(context: &mut Context, request: &Request) -> CommandResult {
    let length = with_list(context, request.arg(1), |list| Ok(list.map_or(0, |list| list.len())))?;
    context.out.integer(length as i64);
    Ok(())
}

/// A list index counted from the end when negative: `None` when outside.
fn resolve_index(index: i64, length: u64) -> Option<u64> {
    let resolved = if index < 0 { length as i64 + index } else { index };
    (0..length as i64).contains(&resolved).then_some(resolved as u64)
}

fn lindex(context: &mut Context, request: &Request) -> CommandResult {
    let element = with_list(context, request.arg(1), |list| {
        let Some(list) = list else { return Ok(None) };
        let index = integer_arg(request, 2)?;
        match resolve_index(index, list.len()) {
            Some(index) => Ok(list.get(index)?),
            None => Ok(None),
        }
    })?;
    context.out.bulk_or_null(element.as_deref());
    Ok(())
}

fn lset(context: &mut Context, request: &Request) -> CommandResult {
    with_list(context, request.arg(1), |list| {
        let list = list.ok_or_else(|| CommandError::Other("no such key".into()))?;
        let index = integer_arg(request, 2)?;
        let index = resolve_index(index, list.len())
            .ok_or_else(|| CommandError::Other("index out of range".into()))?;
        list.set(index, Bytes::copy_from_slice(request.arg(3)))?;
        Ok(())
    })?;
    context.out.ok();
    Ok(())
}

/// LRANGE's and LTRIM's reading of `start` and `end`: the indexes kept, or
/// `None` for none.
fn clamp(start: i64, end: i64, length: u64) -> Option<(u64, u64)> {
    let length = length as i64;
    let start = if start < 0 { (length + start).max(0) } else { start };
    let end = if end < 0 { length + end } else { end };
    if start > end || start >= length {
        return None;
    }
    Some((start as u64, end.min(length - 1) as u64))
}

fn lrange(context: &mut Context, request: &Request) -> CommandResult {
    let (start, end) = (integer_arg(request, 2)?, integer_arg(request, 3)?);
    // The elements are written as they are visited, where a native list's
    // lie, into a reply of their own (the list holds the context).
    let mut elements = ReplyWriter::new(context.out.protocol());
    let count = with_list(context, request.arg(1), |list| match list {
        Some(list) => match clamp(start, end, list.len()) {
            Some((start, end)) => Ok(list.visit_range(start, end, |element| elements.bulk(element))?),
            None => Ok(0),
        },
        None => Ok(0),
    })?;
    context.out.array(count);
    context.out.raw(elements.as_bytes());
    Ok(())
}

fn ltrim(context: &mut Context, request: &Request) -> CommandResult {
    let (start, end) = (integer_arg(request, 2)?, integer_arg(request, 3)?);
    with_list(context, request.arg(1), |list| {
        if let Some(list) = list {
            match clamp(start, end, list.len()) {
                Some((start, end)) => list.trim(start, end)?,
                None => list.clear(),
            }
        }
        Ok(())
    })?;
    context.out.ok();
    Ok(())
}

fn lrem(context: &mut Context, request: &Request) -> CommandResult {
    let count = integer_arg(request, 2)?;
    let removed = with_list(context, request.arg(1), |list| match list {
        Some(list) => {
            let from = if count < 0 { End::Back } else { End::Front };
            Ok(list.remove(request.arg(3), count.unsigned_abs(), from)?)
        }
        None => Ok(0),
    })?;
    context.out.integer(removed as i64);
    Ok(())
}

fn linsert(context: &mut Context, request: &Request) -> CommandResult {
    let after = match request.arg(2) {
        place if is(place, "after") => true,
        place if is(place, "before") => false,
        _ => return Err(CommandError::Syntax),
    };
    let answer = with_list(context, request.arg(1), |list| match list {
        Some(list) => {
            let inserted = list.insert(request.arg(3), Bytes::copy_from_slice(request.arg(4)), after)?;
            Ok(if inserted { list.len() as i64 } else { -1 })
        }
        None => Ok(0),
    })?;
    context.out.integer(answer);
    Ok(())
}

fn lpos(context: &mut Context, request: &Request) -> CommandResult {
    let (mut rank, mut count, mut max_length) = (1i64, None, 0u64);
    let mut index = 3;
    while index < request.len() {
        let option = request.arg(index);
        if index + 1 >= request.len() {
            return Err(CommandError::Syntax);
        }
        let value = integer_arg(request, index + 1)?;
        if is(option, "rank") {
            if value == 0 || value == i64::MIN {
                return Err(CommandError::Other(
                    "RANK can't be zero: use 1 to start from the first match, 2 from the second ... \
                     or use negative to start from the end of the list"
                        .into(),
                ));
            }
            rank = value;
        } else if is(option, "count") {
            if value < 0 {
                return Err(CommandError::Other("COUNT can't be negative".into()));
            }
            count = Some(value as u64);
        } else if is(option, "maxlen") {
            if value < 0 {
                return Err(CommandError::Other("MAXLEN can't be negative".into()));
            }
            max_length = value as u64;
        } else {
            return Err(CommandError::Syntax);
        }
        index += 2;
    }
    let wanted = request.arg(2);
    let matches = with_list(context, request.arg(1), |list| {
        let mut matches = Vec::new();
        let Some(list) = list else { return Ok(matches) };
        let from = if rank < 0 { End::Back } else { End::Front };
        let (mut skip, limit) = (rank.unsigned_abs() - 1, count.unwrap_or(1));
        let mut compared = 0;
        list.walk(from, |position, element| {
            if max_length != 0 && compared >= max_length {
                return false;
            }
            compared += 1;
            if element.as_ref() == wanted {
                if skip > 0 {
                    skip -= 1;
                } else {
                    matches.push(position);
                }
            }
            limit == 0 || (matches.len() as u64) < limit
        })?;
        Ok(matches)
    })?;
    match count {
        Some(_) => {
            context.out.array(matches.len());
            for position in matches {
                context.out.integer(position as i64);
            }
        }
        None => match matches.first() {
            Some(&position) => context.out.integer(position as i64),
            None => context.out.null(),
        },
    }
    Ok(())
}

fn parse_end(arg: &[u8]) -> CommandResult<End> {
    if is(arg, "left") {
        Ok(End::Front)
    } else if is(arg, "right") {
        Ok(End::Back)
    } else {
        Err(CommandError::Syntax)
    }
}

/// Pops from `from` of `source` and pushes to `to` of `destination`: the
/// element, or `None` when the source is empty. The destination's type is
/// checked before anything moves.
fn move_element(
    context: &mut Context,
    source: &[u8],
    destination: &[u8],
    from: End,
    to: End,
) -> CommandResult<Option<Bytes>> {
    let moved = {
        let _locks = context.lock_keys([source, destination].into_iter())?;
        let Some(mut list) = List::open(context.engine(source), source, context.now_ms)? else {
            return Ok(None);
        };
        if source == destination {
            // A rotation: one list, changed once.
            let element = list.pop(from)?.ok_or_else(crate::collection::corrupt)?;
            list.push(to, element.clone())?;
            list.commit(&context.table(source).reserved)?;
            element
        } else {
            let mut target = List::open_or_new(context.engine(destination), destination, context.now_ms)?;
            let element = list.pop(from)?.ok_or_else(crate::collection::corrupt)?;
            target.push(to, element.clone())?;
            list.commit(&context.table(source).reserved)?;
            target.commit(&context.table(destination).reserved)?;
            element
        }
    };
    context.node.waiters.signal(destination);
    Ok(Some(moved))
}

fn lmove(context: &mut Context, request: &Request) -> CommandResult {
    let (from, to) = (parse_end(request.arg(3))?, parse_end(request.arg(4))?);
    let moved = move_element(context, request.arg(1), request.arg(2), from, to)?;
    context.out.bulk_or_null(moved.as_deref());
    Ok(())
}

fn rpoplpush(context: &mut Context, request: &Request) -> CommandResult {
    let moved = move_element(context, request.arg(1), request.arg(2), End::Back, End::Front)?;
    context.out.bulk_or_null(moved.as_deref());
    Ok(())
}

/// LMPOP's and BLMPOP's (and ZMPOP's) arguments from `numkeys_at` on: the
/// keys, the end (read by `parse_end`) and the count.
pub(super) fn parse_mpop<'r, E>(
    request: &'r Request,
    numkeys_at: usize,
    parse_end: fn(&[u8]) -> CommandResult<E>,
) -> CommandResult<(Vec<&'r [u8]>, E, u64)> {
    let keys = positive(request, numkeys_at, "numkeys should be greater than 0")?;
    let first_key = numkeys_at + 1;
    let end_at = (first_key as u64).saturating_add(keys);
    if end_at >= request.len() as u64 {
        return Err(CommandError::Syntax);
    }
    let end_at = end_at as usize;
    let end = parse_end(request.arg(end_at))?;
    let count = match request.len() - end_at {
        1 => 1,
        3 if is(request.arg(end_at + 1), "count") => {
            positive(request, end_at + 2, "count should be greater than 0")?
        }
        _ => return Err(CommandError::Syntax),
    };
    Ok(((first_key..end_at).map(|index| request.arg(index)).collect(), end, count))
}

/// Pops up to `count` from `end` of the first non-empty list of `keys`: the
/// key and what it popped. `WRONGTYPE` for a key of another type reached
/// before one.
fn pop_first(
    context: &mut Context,
    keys: &[&[u8]],
    end: End,
    count: u64,
) -> CommandResult<Option<(Bytes, Vec<Bytes>)>> {
    for key in keys {
        if let Some(popped) = pop_some(context, key, end, count)? {
            if !popped.is_empty() {
                return Ok(Some((Bytes::copy_from_slice(key), popped)));
            }
        }
    }
    Ok(None)
}

fn write_mpop(context: &mut Context, popped: Option<(Bytes, Vec<Bytes>)>) {
    match popped {
        Some((key, elements)) => {
            context.out.array(2);
            context.out.bulk(&key);
            context.out.array(elements.len());
            for element in &elements {
                context.out.bulk(element);
            }
        }
        None => context.out.null_array(),
    }
}

fn lmpop(context: &mut Context, request: &Request) -> CommandResult {
    let (keys, end, count) = parse_mpop(request, 1, parse_end)?;
    let popped = pop_first(context, &keys, end, count)?;
    write_mpop(context, popped);
    Ok(())
}

/// A blocking command's timeout in seconds (a float; 0 waits for ever).
pub(super) fn parse_timeout(arg: &[u8]) -> CommandResult<Option<Duration>> {
    let seconds: f64 = std::str::from_utf8(arg)
        .ok()
        .filter(|_| LongDouble::parse(arg).is_ok())
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| CommandError::Other("timeout is not a float or out of range".into()))?;
    if seconds < 0.0 {
        return Err(CommandError::Other("timeout is negative".into()));
    }
    if !seconds.is_finite() || seconds * 1000.0 > i64::MAX as f64 {
        return Err(CommandError::Other("timeout is out of range".into()));
    }
    Ok((seconds > 0.0).then(|| Duration::from_secs_f64(seconds)))
}

/// What a blocking command does when it found nothing to pop: the first
/// time, it asks the connection to wait on `keys` until `timeout`; woken,
/// it waits on; past its deadline it answers the null array.
pub(super) fn wait_or_time_out(context: &mut Context, keys: &[&[u8]], timeout: Option<Duration>) {
    match &context.session.blocked {
        Some(blocked) if blocked.timed_out => {
            context.session.blocked = None;
            context.out.null_array();
        }
        Some(_) => {}
        None => {
            context.session.blocked = Some(Blocked {
                keys: keys.iter().map(|key| Bytes::copy_from_slice(key)).collect(),
                deadline: timeout.map(|timeout| Instant::now() + timeout),
                timed_out: false,
                recheck: None,
            });
        }
    }
}

fn blocking_pop(context: &mut Context, request: &Request, end: End) -> CommandResult {
    let timeout = parse_timeout(request.arg(request.len() - 1))?;
    let keys: Vec<&[u8]> = request.args().skip(1).take(request.len() - 2).collect();
    match pop_first(context, &keys, end, 1)? {
        Some((key, mut elements)) => {
            context.session.blocked = None;
            context.out.array(2);
            context.out.bulk(&key);
            context.out.bulk(&elements.pop().expect("one popped"));
        }
        None => wait_or_time_out(context, &keys, timeout),
    }
    Ok(())
}

fn blpop(context: &mut Context, request: &Request) -> CommandResult {
    blocking_pop(context, request, End::Front)
}

fn brpop(context: &mut Context, request: &Request) -> CommandResult {
    blocking_pop(context, request, End::Back)
}

fn blocking_move(
    context: &mut Context,
    request: &Request,
    from: End,
    to: End,
    timeout_at: usize,
) -> CommandResult {
    let timeout = parse_timeout(request.arg(timeout_at))?;
    let (source, destination) = (request.arg(1), request.arg(2));
    match move_element(context, source, destination, from, to)? {
        Some(element) => {
            context.session.blocked = None;
            context.out.bulk(&element);
        }
        None => wait_or_time_out(context, &[source], timeout),
    }
    Ok(())
}

fn blmove(context: &mut Context, request: &Request) -> CommandResult {
    let (from, to) = (parse_end(request.arg(3))?, parse_end(request.arg(4))?);
    blocking_move(context, request, from, to, 5)
}

fn brpoplpush(context: &mut Context, request: &Request) -> CommandResult {
    blocking_move(context, request, End::Back, End::Front, 3)
}

fn blmpop(context: &mut Context, request: &Request) -> CommandResult {
    let timeout = parse_timeout(request.arg(1))?;
    let (keys, end, count) = parse_mpop(request, 2, parse_end)?;
    match pop_first(context, &keys, end, count)? {
        Some(popped) => {
            context.session.blocked = None;
            write_mpop(context, Some(popped));
        }
        None => wait_or_time_out(context, &keys, timeout),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_and_ranges_read_as_in_redis() {
        assert_eq!(resolve_index(-1, 3), Some(2));
        assert_eq!(resolve_index(3, 3), None);
        assert_eq!(resolve_index(-4, 3), None);
        assert_eq!(clamp(0, -1, 3), Some((0, 2)));
        assert_eq!(clamp(-100, 100, 3), Some((0, 2)));
        assert_eq!(clamp(2, 1, 3), None);
        assert_eq!(clamp(5, 10, 3), None);
    }

    #[test]
    fn timeouts_parse_as_in_redis() {
        assert_eq!(parse_timeout(b"0").unwrap(), None);
        assert_eq!(parse_timeout(b"0.5").unwrap(), Some(Duration::from_millis(500)));
        assert!(parse_timeout(b"-1").is_err());
        assert!(parse_timeout(b"x").is_err());
        assert!(parse_timeout(b"inf").is_err());
    }
}
