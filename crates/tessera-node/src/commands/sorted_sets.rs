//! Sorted-set commands, atomic per key over any engine: every command, reads
//! included, runs under the key's lock because a set spans several entries
//! ([`crate::zset`]).

use bytes::Bytes;
use tessera_wire::Request;

use super::{integer_arg, is, lists, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::zset::{parse_score, ScoreBound, SortedSet};

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
    CommandSpec { name: "zrangebyscore", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrangebyscore },
    CommandSpec { name: "zrevrangebyscore", arity: -4, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrevrangebyscore },
    CommandSpec { name: "zpopmin", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zpopmin },
    CommandSpec { name: "zpopmax", arity: -2, flags: &["write", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zpopmax },
    CommandSpec { name: "bzpopmin", arity: -3, flags: &["write", "fast", "blocking"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: bzpopmin },
    CommandSpec { name: "bzpopmax", arity: -3, flags: &["write", "fast", "blocking"], first_key: 1, last_key: -2, step: 1, scope: Scope::Keys, handler: bzpopmax },
    CommandSpec { name: "zmpop", arity: -4, flags: &["write", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: zmpop },
    CommandSpec { name: "bzmpop", arity: -5, flags: &["write", "blocking", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: bzmpop },
    CommandSpec { name: "zremrangebyrank", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zremrangebyrank },
    CommandSpec { name: "zremrangebyscore", arity: 4, flags: &["write"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zremrangebyscore },
    CommandSpec { name: "zrandmember", arity: -2, flags: &["readonly"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: zrandmember },
];

/// Runs `body` on the set at `key` (`None` if there is none) under the key's lock.
fn read_set<T>(
    context: &mut Context,
    key: &[u8],
    body: impl FnOnce(Option<&mut SortedSet>) -> CommandResult<T>,
) -> CommandResult<T> {
    let _lock = context.lock_key(key);
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
    let _lock = context.lock_key(key);
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
        pairs.iter().step_by(2).map(|score| parse_score(score)).collect::<CommandResult<Vec<_>>>()?;
    if options.increment {
        let new_score =
            update_set(context, request.arg(1), |set| increment(set, pairs[1], scores[0], &options))?;
        match new_score {
            Some(score) => context.out.double(score),
            None => context.out.null(),
        }
        return Ok(());
    }
    let counted = update_set(context, request.arg(1), |set| {
        let mut counted = 0;
        for (score, member) in scores.iter().zip(pairs.iter().skip(1).step_by(2)) {
            let old = set.score(member)?;
            if !options.allows(old, *score) {
                continue;
            }
            set.insert(member, *score)?;
            if old.is_none() || (options.count_changed && old != Some(*score)) {
                counted += 1;
            }
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
    let _lock = context.lock_key(key);
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
        read_set(context, request.arg(1), |set| set.map_or(Ok(None), |set| set.score(request.arg(2))))?;
    match score {
        Some(score) => context.out.double(score),
        None => context.out.null(),
    }
    Ok(())
}

fn zmscore(context: &mut Context, request: &Request) -> CommandResult {
    let scores = read_set(context, request.arg(1), |set| match set {
        Some(set) => request.args().skip(2).map(|member| set.score(member)).collect(),
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
    let count = read_set(context, request.arg(1), |set| set.map_or(Ok(0), |set| set.count(min, max)))?;
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
        set.map_or(Ok(None), |set| set.rank(request.arg(2), reverse))
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

/// The options after a range's bounds: WITHSCORES, LIMIT, and (for ZRANGE) BYSCORE and REV.
#[derive(Default)]
struct RangeOptions {
    with_scores: bool,
    by_score: bool,
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
            return Err(CommandError::Other("BYLEX is not supported by Tessera".into()));
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
fn score_range(
    context: &mut Context,
    key: &[u8],
    first: &[u8],
    second: &[u8],
    options: &RangeOptions,
) -> CommandResult {
    let (first, second) = (ScoreBound::parse(first)?, ScoreBound::parse(second)?);
    let (offset, limit) = match options.limit {
        Some((offset, _)) if offset < 0 => (0, 0),
        Some((offset, count)) => (offset as usize, usize::try_from(count).unwrap_or(usize::MAX)),
        None => (0, usize::MAX),
    };
    let entries = read_set(context, key, |set| {
        set.map_or(Ok(Vec::new()), |set| set.range_by_score(first, second, options.reverse, offset, limit))
    })?;
    write_entries(context, &entries, options.with_scores);
    Ok(())
}

fn zrange(context: &mut Context, request: &Request) -> CommandResult {
    let options = range_options(request, 4, true)?;
    let key = request.arg(1);
    if options.by_score {
        // With REV the bounds come upper first, as in ZREVRANGEBYSCORE.
        return score_range(context, key, request.arg(2), request.arg(3), &options);
    }
    if options.limit.is_some() {
        return Err(CommandError::Other(
            "syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX".into(),
        ));
    }
    let (start, stop) = (integer_arg(request, 2)?, integer_arg(request, 3)?);
    let entries = read_set(context, key, |set| {
        let Some(set) = set else { return Ok(Vec::new()) };
        let len = set.len() as i64;
        let start = if start < 0 { (start + len).max(0) } else { start };
        let stop = if stop < 0 { stop + len } else { stop.min(len - 1) };
        if start > stop || start >= len {
            return Ok(Vec::new());
        }
        set.range_by_rank(start as u64, stop as u64, options.reverse)
    })?;
    write_entries(context, &entries, options.with_scores);
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
    let _lock = context.lock_key(key);
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
        let _lock = context.lock_key(key);
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
        set.range_by_rank(start as u64, stop as u64, false)
    })
}

fn zremrangebyscore(context: &mut Context, request: &Request) -> CommandResult {
    let (min, max) = (ScoreBound::parse(request.arg(2))?, ScoreBound::parse(request.arg(3))?);
    remove_range(context, request.arg(1), |set| set.range_by_score(min, max, false, 0, usize::MAX))
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
            Some(count) if count as u64 >= len => set.range_by_rank(0, len - 1, false),
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
