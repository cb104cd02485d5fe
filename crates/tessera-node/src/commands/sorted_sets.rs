//! Sorted-set commands, atomic per key over any engine: every command, reads
//! included, runs under the key's lock because a set spans several entries
//! ([`crate::zset`]).

use std::collections::HashMap;

use bytes::Bytes;
use tessera_wire::Request;

use super::{integer_arg, is, lists, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::glob::glob_match;
use crate::hashed::{Hashed, Layout};
use crate::node_state::ScanPosition;
use crate::typed::parse_i64;
use crate::zset::{self, parse_score, LexBound, ScoreBound, SortedSet};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "zadd", arity: -4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zadd },
    CommandSpec { name: "zincrby", arity: 4, flags: &["write", "denyoom", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zincrby },
    CommandSpec { name: "zrem", arity: -3, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrem },
    CommandSpec { name: "zscore", arity: 3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zscore },
    CommandSpec { name: "zmscore", arity: -3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zmscore },
    CommandSpec { name: "zcard", arity: 2, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zcard },
    CommandSpec { name: "zcount", arity: 4, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zcount },
    CommandSpec { name: "zrank", arity: -3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrank },
    CommandSpec { name: "zrevrank", arity: -3, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrevrank },
    CommandSpec { name: "zrange", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrange },
    CommandSpec { name: "zrevrange", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrevrange },
    CommandSpec { name: "zrangebyscore", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrangebyscore },
    CommandSpec { name: "zrangebylex", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrangebylex },
    CommandSpec { name: "zrevrangebylex", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrevrangebylex },
    CommandSpec { name: "zlexcount", arity: 4, flags: &["readonly", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zlexcount },
    CommandSpec { name: "zremrangebylex", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zremrangebylex },
    CommandSpec { name: "zrangestore", arity: -5, flags: &["write", "denyoom"], first_key: 1, last_key: 2, step: 1, scope: Scope::Keys, handler: zrangestore },
    CommandSpec { name: "zscan", arity: -3, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zscan },
    CommandSpec { name: "zrevrangebyscore", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrevrangebyscore },
    CommandSpec { name: "zpopmin", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zpopmin },
    CommandSpec { name: "zpopmax", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zpopmax },
    CommandSpec { name: "bzpopmin", arity: -3, flags: &["write", "fast", "blocking", "noscript"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: bzpopmin },
    CommandSpec { name: "bzpopmax", arity: -3, flags: &["write", "fast", "blocking", "noscript"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: bzpopmax },
    CommandSpec { name: "zmpop", arity: -4, flags: &["write", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zmpop },
    CommandSpec { name: "bzmpop", arity: -5, flags: &["write", "blocking", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: bzmpop },
    CommandSpec { name: "zremrangebyrank", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zremrangebyrank },
    CommandSpec { name: "zremrangebyscore", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zremrangebyscore },
    CommandSpec { name: "zunion", arity: -3, flags: &["readonly", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zunion },
    CommandSpec { name: "zinter", arity: -3, flags: &["readonly", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zinter },
    CommandSpec { name: "zdiff", arity: -3, flags: &["readonly", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zdiff },
    CommandSpec { name: "zintercard", arity: -3, flags: &["readonly", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zintercard },
    CommandSpec { name: "zunionstore", arity: -4, flags: &["write", "denyoom", "movablekeys"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zunionstore },
    CommandSpec { name: "zinterstore", arity: -4, flags: &["write", "denyoom", "movablekeys"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zinterstore },
    CommandSpec { name: "zdiffstore", arity: -4, flags: &["write", "denyoom", "movablekeys"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zdiffstore },
    CommandSpec { name: "zrandmember", arity: -2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrandmember },
];

/// Runs `body` on the set at `key` (`None` if there is none) under the key's lock.
fn read_set<T>(
    context: &mut Context,
    key: &[u8],
    body: impl FnOnce(Option<&mut SortedSet>) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key)?;
    let mut set = SortedSet::open(context.engine(key), key, context.now_ms)?;
    context.count_lookup(set.is_some());
    body(set.as_mut())
}

/// Runs `change` on the set at `key` (a new one if there is none) under the
/// key's lock and writes the result.
fn update_set<T>(
    context: &mut Context,
    key: &[u8],
    change: impl FnOnce(&mut SortedSet) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key)?;
    let mut set = SortedSet::open_or_new(context.engine(key), key, context.now_ms)?;
    let answer = change(&mut set)?;
    let grown = !set.is_empty();
    set.commit(&context.table(key).reserved)?;
    if grown {
        context.node.waiters.signal(key); // BZPOPMIN and its kin
    }
    Ok(answer)
}

#[derive(Default)]
struct AddOptions {
    only_new: bool,
    only_existing: bool,
    greater: bool,
    less: bool,
    count_changed: bool,
    increment: bool,
}

impl AddOptions {
    /// Whether a member whose score is `old` (`None`: absent) may take `new`.
    fn allows(&self, old: Option<f64>, new: f64) -> bool {
        match old {
            None => !self.only_existing,
            Some(old) => !self.only_new && (!self.greater || new > old) && (!self.less || new < old),
        }
    }
}

fn zadd(context: &mut Context, request: &Request) -> CommandResult {
    let mut options = AddOptions::default();
    let mut index = 2;
    while index < request.len() {
        let arg = request.arg(index);
        let flag = if is(arg, "nx") {
            &mut options.only_new
        } else if is(arg, "xx") {
            &mut options.only_existing
        } else if is(arg, "gt") {
            &mut options.greater
        } else if is(arg, "lt") {
            &mut options.less
        } else if is(arg, "ch") {
            &mut options.count_changed
        } else if is(arg, "incr") {
            &mut options.increment
        } else {
            break;
        };
        *flag = true;
        index += 1;
    }
    let pairs = &request.args().skip(index).collect::<Vec<_>>();
    if pairs.is_empty() || !pairs.len().is_multiple_of(2) {
        return Err(CommandError::Syntax);
    }
    if options.only_new && options.only_existing {
        return Err(CommandError::Other("XX and NX options at the same time are not compatible".into()));
    }
    if [options.only_new, options.greater, options.less].iter().filter(|set| **set).count() > 1 {
        return Err(CommandError::Other(
            "GT, LT, and/or NX options at the same time are not compatible".into(),
        ));
    }
    if options.increment && pairs.len() != 2 {
        return Err(CommandError::Other("INCR option supports a single increment-element pair".into()));
    }
    // Every score is checked before anything changes.
    let scores =
        pairs.iter().step_by(2).map(|score| Ok(parse_score(score)?)).collect::<CommandResult<Vec<_>>>()?;
    if options.increment {
        let new_score =
            update_set(context, request.arg(1), |set| increment(set, pairs[1], scores[0], &options))?;
        match new_score {
            Some(score) => context.out.double(score),
            None => context.out.null(),
        }
        return Ok(());
    }
    let counts =
        |old: Option<f64>, score: f64| old.is_none() || (options.count_changed && old != Some(score));
    if let ([score], [_, member]) = (&scores[..], &pairs[..]) {
        let key = request.arg(1);
        let _lock = context.lock_key(key)?;
        let (engine, reserved) = (context.engine(key), &context.table(key).reserved);
        let allows = |old| options.allows(old, *score);
        if let Some(old) =
            zset::insert_in_place(engine, key, member, *score, allows, context.now_ms, reserved)?
        {
            context.node.waiters.signal(key);
            context.out.integer(i64::from(allows(old) && counts(old, *score)));
            return Ok(());
        }
    }
    let counted = update_set(context, request.arg(1), |set| {
        let mut counted = 0;
        for (score, member) in scores.iter().zip(pairs.iter().skip(1).step_by(2)) {
            let old = set.score(member)?;
            if !options.allows(old, *score) {
                continue;
            }
            set.insert(member, *score)?;
            counted += i64::from(counts(old, *score));
        }
        Ok(counted)
    })?;
    context.out.integer(counted);
    Ok(())
}

/// Adds `by` to a member's score (0 if absent); `None` when the options forbid it.
fn increment(
    set: &mut SortedSet,
    member: &[u8],
    by: f64,
    options: &AddOptions,
) -> CommandResult<Option<f64>> {
    let old = set.score(member)?;
    let new = old.unwrap_or(0.0) + by;
    if new.is_nan() {
        return Err(CommandError::Other("resulting score is not a number (NaN)".into()));
    }
    if !options.allows(old, new) {
        return Ok(None);
    }
    set.insert(member, new)?;
    Ok(Some(new))
}

fn zincrby(context: &mut Context, request: &Request) -> CommandResult {
    let by = parse_score(request.arg(2))?;
    let score = update_set(context, request.arg(1), |set| {
        increment(set, request.arg(3), by, &AddOptions::default())
    })?;
    context.out.double(score.expect("no option forbids ZINCRBY"));
    Ok(())
}

fn zrem(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let _lock = context.lock_key(key)?;
    let mut removed = 0;
    if let Some(mut set) = SortedSet::open(context.engine(key), key, context.now_ms)? {
        for member in request.args().skip(2) {
            if set.remove(member)?.is_some() {
                removed += 1;
            }
        }
        set.commit(&context.table(key).reserved)?;
    }
    context.out.integer(removed);
    Ok(())
}

fn zscore(context: &mut Context, request: &Request) -> CommandResult {
    let score =
        read_set(context, request.arg(1), |set| set.map_or(Ok(None), |set| Ok(set.score(request.arg(2))?)))?;
    match score {
        Some(score) => context.out.double(score),
        None => context.out.null(),
    }
    Ok(())
}

fn zmscore(context: &mut Context, request: &Request) -> CommandResult {
    let scores = read_set(context, request.arg(1), |set| match set {
        Some(set) => request.args().skip(2).map(|member| Ok(set.score(member)?)).collect(),
        None => Ok(vec![None; request.len() - 2]),
    })?;
    context.out.array(scores.len());
    for score in scores {
        match score {
            Some(score) => context.out.double(score),
            None => context.out.null(),
        }
    }
    Ok(())
}

fn zcard(context: &mut Context, request: &Request) -> CommandResult {
    let len = read_set(context, request.arg(1), |set| Ok(set.map_or(0, |set| set.len())))?;
    context.out.integer(len as i64);
    Ok(())
}

fn zcount(context: &mut Context, request: &Request) -> CommandResult {
    let (min, max) = (ScoreBound::parse(request.arg(2))?, ScoreBound::parse(request.arg(3))?);
    let count = read_set(context, request.arg(1), |set| set.map_or(Ok(0), |set| Ok(set.count(min, max)?)))?;
    context.out.integer(count as i64);
    Ok(())
}

fn rank(context: &mut Context, request: &Request, reverse: bool) -> CommandResult {
    let with_score = match request.len() {
        3 => false,
        4 if is(request.arg(3), "withscore") => true,
        _ => return Err(CommandError::Syntax),
    };
    let found = read_set(context, request.arg(1), |set| {
        set.map_or(Ok(None), |set| Ok(set.rank(request.arg(2), reverse)?))
    })?;
    match found {
        None if with_score => context.out.null_array(),
        None => context.out.null(),
        Some((rank, score)) if with_score => {
            context.out.array(2);
            context.out.integer(rank as i64);
            context.out.double(score);
        }
        Some((rank, _)) => context.out.integer(rank as i64),
    }
    Ok(())
}

fn zrank(context: &mut Context, request: &Request) -> CommandResult {
    rank(context, request, false)
}

fn zrevrank(context: &mut Context, request: &Request) -> CommandResult {
    rank(context, request, true)
}

/// The options after a range's bounds: WITHSCORES, LIMIT, and (for ZRANGE
/// and ZRANGESTORE) BYSCORE, BYLEX and REV.
#[derive(Default)]
struct RangeOptions {
    with_scores: bool,
    by_score: bool,
    by_lex: bool,
    reverse: bool,
    /// LIMIT offset count; a negative count means no limit.
    limit: Option<(i64, i64)>,
}

fn range_options(request: &Request, from: usize, zrange: bool) -> CommandResult<RangeOptions> {
    let mut options = RangeOptions::default();
    let mut index = from;
    while index < request.len() {
        let arg = request.arg(index);
        if is(arg, "withscores") {
            options.with_scores = true;
        } else if is(arg, "limit") && index + 2 < request.len() {
            options.limit = Some((integer_arg(request, index + 1)?, integer_arg(request, index + 2)?));
            index += 2;
        } else if zrange && is(arg, "byscore") {
            options.by_score = true;
        } else if zrange && is(arg, "rev") {
            options.reverse = true;
        } else if zrange && is(arg, "bylex") {
            options.by_lex = true;
        } else {
            return Err(CommandError::Syntax);
        }
        index += 1;
    }
    Ok(options)
}

fn write_entries(context: &mut Context, entries: &[(f64, Bytes)], with_scores: bool) {
    let resp3 = context.out.protocol() == tessera_wire::Protocol::Resp3;
    if !with_scores {
        context.out.array(entries.len());
        for (_, member) in entries {
            context.out.bulk(member);
        }
    } else if resp3 {
        context.out.array(entries.len());
        for (score, member) in entries {
            context.out.array(2);
            context.out.bulk(member);
            context.out.double(*score);
        }
    } else {
        context.out.array(entries.len() * 2);
        for (score, member) in entries {
            context.out.bulk(member);
            context.out.double(*score);
        }
    }
}

/// A range by score; `first` and `second` are the bounds as given (upper
/// first when `reverse`, as ZREVRANGEBYSCORE takes them).
fn score_entries(
    context: &mut Context,
    key: &[u8],
    first: &[u8],
    second: &[u8],
    options: &RangeOptions,
) -> CommandResult<Vec<(f64, Bytes)>> {
    let (first, second) = (ScoreBound::parse(first)?, ScoreBound::parse(second)?);
    let (offset, limit) = skip_and_most(options.limit);
    read_set(context, key, |set| {
        set.map_or(Ok(Vec::new()), |set| {
            Ok(set.range_by_score(first, second, options.reverse, offset, limit)?)
        })
    })
}

fn score_range(
    context: &mut Context,
    key: &[u8],
    first: &[u8],
    second: &[u8],
    options: &RangeOptions,
) -> CommandResult {
    let entries = score_entries(context, key, first, second, options)?;
    write_entries(context, &entries, options.with_scores);
    Ok(())
}

/// LIMIT's offset and count as a skip and a most.
fn skip_and_most(limit: Option<(i64, i64)>) -> (usize, usize) {
    match limit {
        Some((offset, _)) if offset < 0 => (0, 0),
        Some((offset, count)) => (offset as usize, usize::try_from(count).unwrap_or(usize::MAX)),
        None => (0, usize::MAX),
    }
}

/// What ZRANGE and ZRANGESTORE select from the set at `key`: by rank, by
/// score or by member, with the bounds as given (upper first with REV).
fn ranged(
    context: &mut Context,
    key: &[u8],
    first: &[u8],
    second: &[u8],
    options: &RangeOptions,
) -> CommandResult<Vec<(f64, Bytes)>> {
    if options.by_score && options.by_lex {
        return Err(CommandError::Syntax);
    }
    if options.by_lex && options.with_scores {
        return Err(CommandError::Other(
            "syntax error, WITHSCORES not supported in combination with BYLEX".into(),
        ));
    }
    if options.by_score {
        return score_entries(context, key, first, second, options);
    }
    if options.by_lex {
        let (first, second) = (LexBound::parse(first)?, LexBound::parse(second)?);
        let (min, max) = if options.reverse { (second, first) } else { (first, second) };
        let (offset, limit) = skip_and_most(options.limit);
        return read_set(context, key, |set| {
            set.map_or(Ok(Vec::new()), |set| {
                Ok(set.range_by_lex(&min, &max, options.reverse, offset, limit)?)
            })
        });
    }
    if options.limit.is_some() {
        return Err(CommandError::Other(
            "syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX".into(),
        ));
    }
    let (start, stop) = (parse_i64(first)?, parse_i64(second)?);
    read_set(context, key, |set| {
        let Some(set) = set else { return Ok(Vec::new()) };
        let len = set.len() as i64;
        let start = if start < 0 { (start + len).max(0) } else { start };
        let stop = if stop < 0 { stop + len } else { stop.min(len - 1) };
        if start > stop || start >= len {
            return Ok(Vec::new());
        }
        Ok(set.range_by_rank(start as u64, stop as u64, options.reverse)?)
    })
}

fn zrange(context: &mut Context, request: &Request) -> CommandResult {
    let options = range_options(request, 4, true)?;
    let entries = ranged(context, request.arg(1), request.arg(2), request.arg(3), &options)?;
    write_entries(context, &entries, options.with_scores);
    Ok(())
}

/// ZREVRANGE: ZRANGE by rank, from the highest score down.
fn zrevrange(context: &mut Context, request: &Request) -> CommandResult {
    let options = RangeOptions { reverse: true, ..range_options(request, 4, false)? };
    let entries = ranged(context, request.arg(1), request.arg(2), request.arg(3), &options)?;
    write_entries(context, &entries, options.with_scores);
    Ok(())
}

fn zrangestore(context: &mut Context, request: &Request) -> CommandResult {
    let options = range_options(request, 5, true)?;
    if options.with_scores {
        return Err(CommandError::Syntax);
    }
    let (destination, source) = (request.arg(1), request.arg(2));
    let _locks = context.lock_keys([destination, source].into_iter())?;
    // Both keys' locks are held: the range reads under them.
    let locks_held = std::mem::replace(&mut context.locks_held, true);
    let stored = ranged(context, source, request.arg(3), request.arg(4), &options)
        .and_then(|entries| store_entries(context, destination, &entries).map(|()| entries.len()));
    context.locks_held = locks_held;
    context.out.integer(stored? as i64);
    Ok(())
}

fn lex_range(context: &mut Context, request: &Request, reverse: bool) -> CommandResult {
    let options = RangeOptions { by_lex: true, reverse, ..range_options(request, 4, false)? };
    let entries = ranged(context, request.arg(1), request.arg(2), request.arg(3), &options)?;
    write_entries(context, &entries, false);
    Ok(())
}

fn zrangebylex(context: &mut Context, request: &Request) -> CommandResult {
    lex_range(context, request, false)
}

fn zrevrangebylex(context: &mut Context, request: &Request) -> CommandResult {
    lex_range(context, request, true)
}

fn zlexcount(context: &mut Context, request: &Request) -> CommandResult {
    let (min, max) = (LexBound::parse(request.arg(2))?, LexBound::parse(request.arg(3))?);
    let count = read_set(context, request.arg(1), |set| {
        set.map_or(Ok(0), |set| Ok(set.range_by_lex(&min, &max, false, 0, usize::MAX)?.len()))
    })?;
    context.out.integer(count as i64);
    Ok(())
}

fn zremrangebylex(context: &mut Context, request: &Request) -> CommandResult {
    let (min, max) = (LexBound::parse(request.arg(2))?, LexBound::parse(request.arg(3))?);
    remove_range(context, request.arg(1), |set| Ok(set.range_by_lex(&min, &max, false, 0, usize::MAX)?))
}

/// Members ZSCAN returns per call on a large set; a set of at most this
/// many comes whole with cursor 0, as Redis answers for a small set.
const ZSCAN_WHOLE_MAX: u64 = 128;

/// ZSCAN: a small set whole; a large one in score order, the cursor naming
/// (in the node's cursor registry) the last member returned, so a member
/// present throughout with its score unchanged is returned once.
fn zscan(context: &mut Context, request: &Request) -> CommandResult {
    let key = request.arg(1);
    let cursor: u64 = std::str::from_utf8(request.arg(2))
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or(CommandError::InvalidCursor)?;
    let after = match cursor {
        0 => None,
        id => match context.node.scan_position(id) {
            Some(ScanPosition { table, cursor }) if table.as_bytes() == key && cursor.0.len() >= 8 => {
                let score = f64::from_be_bytes(cursor.0[..8].try_into().expect("8 bytes"));
                Some((score, cursor.0.slice(8..)))
            }
            _ => return Err(CommandError::InvalidCursor),
        },
    };
    let (entries, last, pattern) = read_set(context, key, |set| {
        let Some(set) = set else { return Ok((Vec::new(), None, None)) };
        // Options are read once the key is known to hold a set, as in Redis.
        let (pattern, count) = super::sets::parse_scan_options(request)?;
        if after.is_none() && set.len() <= ZSCAN_WHOLE_MAX {
            return Ok((set.range_by_rank(0, set.len() - 1, false)?, None, pattern));
        }
        let entries =
            set.entries_after(after.as_ref().map(|(score, member)| (*score, &member[..])), count as usize)?;
        let last = (entries.len() == count as usize).then(|| entries.last().cloned()).flatten();
        Ok((entries, last, pattern))
    })?;
    let next = match last {
        Some((score, member)) => {
            let mut position = score.to_be_bytes().to_vec();
            position.extend_from_slice(&member);
            context.node.save_scan_position(ScanPosition {
                table: String::from_utf8_lossy(key).into_owned(),
                cursor: tessera_engine::ScanCursor(position.into()),
            })
        }
        None => 0,
    };
    let entries: Vec<_> = entries
        .into_iter()
        .filter(|(_, member)| pattern.is_none_or(|pattern| glob_match(pattern, member)))
        .collect();
    context.out.array(2);
    context.out.bulk(next.to_string().as_bytes());
    context.out.array(entries.len() * 2);
    for (score, member) in &entries {
        context.out.bulk(member);
        context.out.bulk(tessera_wire::reply::format_double(*score).as_bytes());
    }
    Ok(())
}

fn zrangebyscore(context: &mut Context, request: &Request) -> CommandResult {
    let options = range_options(request, 4, false)?;
    score_range(context, request.arg(1), request.arg(2), request.arg(3), &options)
}

fn zrevrangebyscore(context: &mut Context, request: &Request) -> CommandResult {
    let options = RangeOptions { reverse: true, ..range_options(request, 4, false)? };
    score_range(context, request.arg(1), request.arg(2), request.arg(3), &options)
}

/// Takes up to `count` members from the low end (`max`: the high end) of
/// the set at `key`: `None` when there is no set.
fn pop_some(
    context: &mut Context,
    key: &[u8],
    max: bool,
    count: u64,
) -> CommandResult<Option<Vec<(f64, Bytes)>>> {
    let _lock = context.lock_key(key)?;
    if count == 1 {
        let (engine, reserved) = (context.engine(key), &context.table(key).reserved);
        if let Some(popped) = zset::pop_in_place(engine, key, max, context.now_ms, reserved)? {
            return Ok(Some(vec![popped]));
        }
    }
    let Some(mut set) = SortedSet::open(context.engine(key), key, context.now_ms)? else { return Ok(None) };
    if count == 0 || set.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let taken = set.range_by_rank(0, count.min(set.len()) - 1, max)?;
    for (_, member) in &taken {
        set.remove(member)?;
    }
    set.commit(&context.table(key).reserved)?;
    Ok(Some(taken))
}

/// Member, score, member, score …
fn write_flat(context: &mut Context, entries: &[(f64, Bytes)]) {
    context.out.array(entries.len() * 2);
    for (score, member) in entries {
        context.out.bulk(member);
        context.out.double(*score);
    }
}

fn zpop(context: &mut Context, request: &Request, max: bool) -> CommandResult {
    let count = match request.len() {
        2 => 1,
        // Redis answers a count that is not a number as it answers a negative one.
        3 => integer_arg(request, 2)
            .ok()
            .filter(|count| *count >= 0)
            .ok_or_else(|| CommandError::Other("value is out of range, must be positive".into()))?
            as u64,
        _ => return Err(CommandError::Syntax),
    };
    let taken = pop_some(context, request.arg(1), max, count)?.unwrap_or_default();
    write_flat(context, &taken);
    Ok(())
}

fn zpopmin(context: &mut Context, request: &Request) -> CommandResult {
    zpop(context, request, false)
}

fn zpopmax(context: &mut Context, request: &Request) -> CommandResult {
    zpop(context, request, true)
}

/// A key and the (score, member) pairs taken from its set.
type Popped = (Bytes, Vec<(f64, Bytes)>);

/// Pops up to `count` from the first non-empty set of `keys`.
fn pop_first(context: &mut Context, keys: &[&[u8]], max: bool, count: u64) -> CommandResult<Option<Popped>> {
    for key in keys {
        match pop_some(context, key, max, count)? {
            Some(taken) if !taken.is_empty() => return Ok(Some((Bytes::copy_from_slice(key), taken))),
            _ => {}
        }
    }
    Ok(None)
}

fn blocking_zpop(context: &mut Context, request: &Request, max: bool) -> CommandResult {
    let timeout = lists::parse_timeout(request.arg(request.len() - 1))?;
    let keys: Vec<&[u8]> = request.args().skip(1).take(request.len() - 2).collect();
    match pop_first(context, &keys, max, 1)? {
        Some((key, taken)) => {
            context.session.blocked = None;
            let (score, member) = &taken[0];
            context.out.array(3);
            context.out.bulk(&key);
            context.out.bulk(member);
            context.out.double(*score);
        }
        None => lists::wait_or_time_out(context, &keys, timeout),
    }
    Ok(())
}

fn bzpopmin(context: &mut Context, request: &Request) -> CommandResult {
    blocking_zpop(context, request, false)
}

fn bzpopmax(context: &mut Context, request: &Request) -> CommandResult {
    blocking_zpop(context, request, true)
}

fn parse_min_max(arg: &[u8]) -> CommandResult<bool> {
    if is(arg, "min") {
        Ok(false)
    } else if is(arg, "max") {
        Ok(true)
    } else {
        Err(CommandError::Syntax)
    }
}

/// ZMPOP's reply: the key, then [member, score] pairs.
fn write_mpop(context: &mut Context, popped: Option<Popped>) {
    let Some((key, taken)) = popped else {
        context.out.null_array();
        return;
    };
    context.out.array(2);
    context.out.bulk(&key);
    context.out.array(taken.len());
    for (score, member) in &taken {
        context.out.array(2);
        context.out.bulk(member);
        context.out.double(*score);
    }
}

fn zmpop(context: &mut Context, request: &Request) -> CommandResult {
    let (keys, max, count) = lists::parse_mpop(request, 1, parse_min_max)?;
    let popped = pop_first(context, &keys, max, count)?;
    write_mpop(context, popped);
    Ok(())
}

fn bzmpop(context: &mut Context, request: &Request) -> CommandResult {
    let timeout = lists::parse_timeout(request.arg(1))?;
    let (keys, max, count) = lists::parse_mpop(request, 2, parse_min_max)?;
    match pop_first(context, &keys, max, count)? {
        Some(popped) => {
            context.session.blocked = None;
            write_mpop(context, Some(popped));
        }
        None => lists::wait_or_time_out(context, &keys, timeout),
    }
    Ok(())
}

/// Removes what `select` picks from the set at `key`: how many.
fn remove_range(
    context: &mut Context,
    key: &[u8],
    select: impl FnOnce(&mut SortedSet) -> CommandResult<Vec<(f64, Bytes)>>,
) -> CommandResult {
    let removed = {
        let _lock = context.lock_key(key)?;
        match SortedSet::open(context.engine(key), key, context.now_ms)? {
            Some(mut set) => {
                let doomed = select(&mut set)?;
                for (_, member) in &doomed {
                    set.remove(member)?;
                }
                set.commit(&context.table(key).reserved)?;
                doomed.len()
            }
            None => 0,
        }
    };
    context.out.integer(removed as i64);
    Ok(())
}

fn zremrangebyrank(context: &mut Context, request: &Request) -> CommandResult {
    let (start, stop) = (integer_arg(request, 2)?, integer_arg(request, 3)?);
    remove_range(context, request.arg(1), |set| {
        let len = set.len() as i64;
        let start = if start < 0 { (start + len).max(0) } else { start };
        let stop = if stop < 0 { stop + len } else { stop.min(len - 1) };
        if start > stop || start >= len {
            return Ok(Vec::new());
        }
        Ok(set.range_by_rank(start as u64, stop as u64, false)?)
    })
}

fn zremrangebyscore(context: &mut Context, request: &Request) -> CommandResult {
    let (min, max) = (ScoreBound::parse(request.arg(2))?, ScoreBound::parse(request.arg(3))?);
    remove_range(context, request.arg(1), |set| Ok(set.range_by_score(min, max, false, 0, usize::MAX)?))
}

fn zrandmember(context: &mut Context, request: &Request) -> CommandResult {
    let (count, with_scores) = match request.len() {
        2 => (None, false),
        3 => (Some(integer_arg(request, 2)?), false),
        4 if is(request.arg(3), "withscores") => (Some(integer_arg(request, 2)?), true),
        _ => return Err(CommandError::Syntax),
    };
    let picked = read_set(context, request.arg(1), |set| {
        let Some(set) = set else { return Ok(Vec::new()) };
        let len = set.len();
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut pick = |rank: u64| -> CommandResult<(f64, Bytes)> {
            Ok(set.range_by_rank(rank, rank, false)?.pop().expect("a member at every rank below the length"))
        };
        match count {
            None => Ok(vec![pick(rand::random::<u64>() % len)?]),
            // Negative: that many picks, repeats allowed.
            Some(count) if count < 0 => {
                (0..count.unsigned_abs()).map(|_| pick(rand::random::<u64>() % len)).collect()
            }
            Some(count) if count as u64 >= len => Ok(set.range_by_rank(0, len - 1, false)?),
            Some(count) => {
                let ranks = rand::seq::index::sample(&mut rand::thread_rng(), len as usize, count as usize);
                ranks.into_iter().map(|rank| pick(rank as u64)).collect()
            }
        }
    })?;
    match count {
        None => context.out.bulk_or_null(picked.first().map(|(_, member)| &member[..])),
        Some(_) if with_scores => write_entries(context, &picked, true),
        Some(_) => write_entries(context, &picked, false),
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Combine {
    Union,
    Inter,
    Diff,
}

#[derive(Clone, Copy)]
enum Aggregate {
    Sum,
    Min,
    Max,
}

/// What ZUNION, ZINTER, ZDIFF and their STORE and CARD forms were asked.
struct Combination<'r> {
    keys: Vec<&'r [u8]>,
    weights: Vec<f64>,
    aggregate: Aggregate,
    with_scores: bool,
    limit: usize,
}

/// The sorted sets (or plain sets, every member scored 1) at `keys`, as
/// member → score; `None` for a missing key. `WRONGTYPE` for another type.
fn read_inputs(context: &mut Context, keys: &[&[u8]]) -> CommandResult<Vec<Option<HashMap<Bytes, f64>>>> {
    let mut inputs = Vec::with_capacity(keys.len());
    for key in keys {
        let engine = context.engine(key);
        let input = match SortedSet::open(engine, key, context.now_ms) {
            Ok(Some(set)) if set.is_empty() => Some(HashMap::new()),
            Ok(Some(mut set)) => {
                let len = set.len();
                Some(
                    set.range_by_rank(0, len - 1, false)?
                        .into_iter()
                        .map(|(score, member)| (member, score))
                        .collect(),
                )
            }
            Ok(None) => None,
            Err(tessera_data::DataError::WrongType) => {
                match Hashed::open(Layout::Set, engine, key, context.now_ms)? {
                    Some(mut set) => Some(set.members()?.into_iter().map(|member| (member, 1.0)).collect()),
                    None => None,
                }
            }
            Err(error) => return Err(error.into()),
        };
        inputs.push(input);
    }
    Ok(inputs)
}

/// The keys counted at `numkeys_at`, and where the options after them
/// start. The keys' types are checked before the options are read, as in
/// Redis, so these come apart.
fn parse_combination<'r>(
    request: &'r Request,
    numkeys_at: usize,
    command: &str,
) -> CommandResult<(Vec<&'r [u8]>, usize)> {
    let keys = integer_arg(request, numkeys_at)?;
    if keys < 1 {
        return Err(CommandError::Other(format!("at least 1 input key is needed for '{command}' command")));
    }
    if keys as u64 > (request.len() - numkeys_at - 1) as u64 {
        return Err(CommandError::Syntax);
    }
    let first = numkeys_at + 1;
    let after = first + keys as usize;
    Ok(((first..after).map(|index| request.arg(index)).collect(), after))
}

/// The options from `from` on: WEIGHTS and AGGREGATE (not for ZDIFF or
/// ZINTERCARD), WITHSCORES (not for a `store` form), LIMIT (`card` only).
fn parse_combination_options<'r>(
    request: &'r Request,
    keys: Vec<&'r [u8]>,
    from: usize,
    combine: Combine,
    store: bool,
    card: bool,
) -> CommandResult<Combination<'r>> {
    let mut combination = Combination {
        weights: vec![1.0; keys.len()],
        keys,
        aggregate: Aggregate::Sum,
        with_scores: false,
        limit: 0,
    };
    let mut index = from;
    while index < request.len() {
        let remaining = request.len() - index;
        let option = request.arg(index);
        let weighable = combine != Combine::Diff && !card;
        if weighable && remaining > combination.keys.len() && is(option, "weights") {
            for weight in combination.weights.iter_mut() {
                index += 1;
                *weight = parse_score(request.arg(index))
                    .map_err(|_| CommandError::Other("weight value is not a float".into()))?;
            }
        } else if weighable && remaining >= 2 && is(option, "aggregate") {
            index += 1;
            combination.aggregate = match request.arg(index) {
                name if is(name, "sum") => Aggregate::Sum,
                name if is(name, "min") => Aggregate::Min,
                name if is(name, "max") => Aggregate::Max,
                _ => return Err(CommandError::Syntax),
            };
        } else if !store && !card && is(option, "withscores") {
            combination.with_scores = true;
        } else if card && remaining >= 2 && is(option, "limit") {
            index += 1;
            combination.limit = match integer_arg(request, index) {
                Ok(limit) if limit >= 0 => limit as usize,
                _ => return Err(CommandError::Other("LIMIT can't be negative".into())),
            };
        } else {
            return Err(CommandError::Syntax);
        }
        index += 1;
    }
    Ok(combination)
}

/// A weighted score, as Redis computes it: NaN (inf × 0) counts as 0.
fn weighted(score: f64, weight: f64) -> f64 {
    let product = score * weight;
    if product.is_nan() {
        0.0
    } else {
        product
    }
}

fn aggregate(aggregate: Aggregate, a: f64, b: f64) -> f64 {
    match aggregate {
        Aggregate::Sum => {
            let sum = a + b;
            if sum.is_nan() {
                0.0
            } else {
                sum
            }
        }
        Aggregate::Min => a.min(b),
        Aggregate::Max => a.max(b),
    }
}

/// The result, ordered by score then member.
fn combined(
    combine: Combine,
    combination: &Combination,
    inputs: Vec<Option<HashMap<Bytes, f64>>>,
) -> Vec<(f64, Bytes)> {
    let mut inputs = inputs.into_iter().map(Option::unwrap_or_default);
    let first = inputs.next().unwrap_or_default();
    let mut result: HashMap<Bytes, f64> =
        first.into_iter().map(|(member, score)| (member, weighted(score, combination.weights[0]))).collect();
    for (index, input) in inputs.enumerate() {
        let weight = combination.weights[index + 1];
        match combine {
            Combine::Union => {
                for (member, score) in input {
                    let score = weighted(score, weight);
                    result
                        .entry(member)
                        .and_modify(|current| *current = aggregate(combination.aggregate, *current, score))
                        .or_insert(score);
                }
            }
            Combine::Inter => {
                result.retain(|member, current| match input.get(member) {
                    Some(&score) => {
                        *current = aggregate(combination.aggregate, *current, weighted(score, weight));
                        true
                    }
                    None => false,
                });
            }
            Combine::Diff => result.retain(|member, _| !input.contains_key(member)),
        }
    }
    let mut entries: Vec<(f64, Bytes)> = result.into_iter().map(|(member, score)| (score, member)).collect();
    entries.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    entries
}

fn combine_read(context: &mut Context, request: &Request, combine: Combine, command: &str) -> CommandResult {
    let (keys, after) = parse_combination(request, 1, command)?;
    let _locks = context.lock_keys(keys.iter().copied())?;
    let inputs = read_inputs(context, &keys)?;
    let combination = parse_combination_options(request, keys, after, combine, false, false)?;
    let entries = combined(combine, &combination, inputs);
    write_entries(context, &entries, combination.with_scores);
    Ok(())
}

fn zunion(context: &mut Context, request: &Request) -> CommandResult {
    combine_read(context, request, Combine::Union, "zunion")
}

fn zinter(context: &mut Context, request: &Request) -> CommandResult {
    combine_read(context, request, Combine::Inter, "zinter")
}

fn zdiff(context: &mut Context, request: &Request) -> CommandResult {
    combine_read(context, request, Combine::Diff, "zdiff")
}

fn zintercard(context: &mut Context, request: &Request) -> CommandResult {
    let (keys, after) = parse_combination(request, 1, "zintercard")?;
    let _locks = context.lock_keys(keys.iter().copied())?;
    let inputs = read_inputs(context, &keys)?;
    let combination = parse_combination_options(request, keys, after, Combine::Inter, false, true)?;
    let count = combined(Combine::Inter, &combination, inputs).len();
    let count = if combination.limit == 0 { count } else { count.min(combination.limit) };
    context.out.integer(count as i64);
    Ok(())
}

fn combine_store(context: &mut Context, request: &Request, combine: Combine, command: &str) -> CommandResult {
    let destination = request.arg(1);
    let (keys, after) = parse_combination(request, 2, command)?;
    let _locks = context.lock_keys(keys.iter().copied().chain([destination]))?;
    let inputs = read_inputs(context, &keys)?;
    let combination = parse_combination_options(request, keys, after, combine, true, false)?;
    let entries = combined(combine, &combination, inputs);
    store_entries(context, destination, &entries)?;
    context.out.integer(entries.len() as i64);
    Ok(())
}

/// Replaces whatever `destination` holds with a set of `entries` (none:
/// deletes it), as the STORE commands do; the caller holds its lock.
fn store_entries(context: &mut Context, destination: &[u8], entries: &[(f64, Bytes)]) -> CommandResult {
    let engine = context.engine(destination);
    engine.delete(destination)?;
    let mut set = SortedSet::open_or_new(engine, destination, context.now_ms)?;
    for (score, member) in entries {
        set.insert(member, *score)?;
    }
    set.commit(&context.table(destination).reserved)?;
    if !entries.is_empty() {
        context.node.waiters.signal(destination);
    }
    Ok(())
}

fn zunionstore(context: &mut Context, request: &Request) -> CommandResult {
    combine_store(context, request, Combine::Union, "zunionstore")
}

fn zinterstore(context: &mut Context, request: &Request) -> CommandResult {
    combine_store(context, request, Combine::Inter, "zinterstore")
}

fn zdiffstore(context: &mut Context, request: &Request) -> CommandResult {
    combine_store(context, request, Combine::Diff, "zdiffstore")
}
