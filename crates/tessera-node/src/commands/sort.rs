//! SORT and SORT_RO: a list's, set's or sorted set's elements ordered by
//! number or by bytes, by themselves or by weights read from other keys,
//! windowed, mapped through GET patterns, answered or stored as a list.

use std::cmp::Ordering;

use bytes::Bytes;
use tessera_wire::Request;

use super::dump::{read_value, store_value};
use super::{integer_arg, is, Context};
use crate::error::{CommandError, CommandResult};
use crate::hashed::{Hashed, Layout};
use crate::rdb::Value;
use crate::typed::{read_live, Kind};

struct Options<'r> {
    descending: bool,
    alpha: bool,
    /// `(start, count)` as given: a negative start reads as 0, a negative
    /// count as "to the end".
    limit: Option<(i64, i64)>,
    /// BY's pattern, if it names other keys (it has a `*`).
    by: Option<&'r [u8]>,
    /// BY with a pattern without `*`: keep the value's own order.
    keep_order: bool,
    gets: Vec<&'r [u8]>,
    store: Option<&'r [u8]>,
}

fn parse<'r>(context: &Context, request: &'r Request, read_only: bool) -> CommandResult<Options<'r>> {
    let mut options = Options {
        descending: false,
        alpha: false,
        limit: None,
        by: None,
        keep_order: false,
        gets: vec![],
        store: None,
    };
    let mut at = 2;
    while at < request.len() {
        let (name, remaining) = (request.arg(at), request.len() - at - 1);
        if is(name, "asc") {
            options.descending = false;
        } else if is(name, "desc") {
            options.descending = true;
        } else if is(name, "alpha") {
            options.alpha = true;
        } else if is(name, "limit") && remaining >= 2 {
            options.limit = Some((integer_arg(request, at + 1)?, integer_arg(request, at + 2)?));
            at += 2;
        } else if !read_only && is(name, "store") && remaining >= 1 {
            options.store = Some(request.arg(at + 1));
            at += 1;
        } else if is(name, "by") && remaining >= 1 {
            let pattern = request.arg(at + 1);
            // As in Redis, a BY without `*` keeps the value's order even
            // if another BY follows it.
            if pattern.contains(&b'*') {
                refuse_other_keys(context, "BY")?;
                options.by = Some(pattern);
            } else {
                options.keep_order = true;
            }
            at += 1;
        } else if is(name, "get") && remaining >= 1 {
            refuse_other_keys(context, "GET")?;
            options.gets.push(request.arg(at + 1));
            at += 1;
        } else {
            return Err(CommandError::Syntax);
        }
        at += 1;
    }
    Ok(options)
}

/// BY and GET patterns read keys the command does not name: Redis refuses
/// them in a cluster (the keys may live anywhere) and to a user who may
/// not read every key.
fn refuse_other_keys(context: &Context, option: &str) -> CommandResult {
    if context.cluster.is_some() {
        return Err(CommandError::Other(format!("{option} option of SORT denied in Cluster mode.")));
    }
    if !context.session.reads_every_key() {
        return Err(CommandError::Other(format!(
            "{option} option of SORT denied due to insufficient ACL permissions."
        )));
    }
    Ok(())
}

/// The key a pattern names for `element` (its first `*` replaced), and the
/// hash field after a `->` that follows the `*`, if any.
fn substitute<'p>(pattern: &'p [u8], element: &[u8]) -> Option<(Vec<u8>, Option<&'p [u8]>)> {
    let star = pattern.iter().position(|&byte| byte == b'*')?;
    let after = &pattern[star + 1..];
    let arrow = after.windows(2).position(|pair| pair == b"->").filter(|&at| at + 2 < after.len());
    let (suffix, field) = match arrow {
        Some(at) => (&after[..at], Some(&after[at + 2..])),
        None => (after, None),
    };
    Some(([&pattern[..star], element, suffix].concat(), field))
}

/// What a BY or GET pattern reads for `element`: `#` is the element
/// itself; otherwise a string key, or a hash key's field; nothing when the
/// key is missing or of another type.
fn look_up(context: &Context, pattern: &[u8], element: &Bytes) -> CommandResult<Option<Bytes>> {
    if pattern == b"#" {
        return Ok(Some(element.clone()));
    }
    let Some((key, field)) = substitute(pattern, element) else { return Ok(None) };
    let engine = context.engine(&key);
    let Some(stored) = read_live(engine, &key, context.now_ms)? else { return Ok(None) };
    match (stored.kind, field) {
        (Kind::String, None) => Ok(Some(stored.payload)),
        (Kind::Hash, Some(field)) => match Hashed::open(Layout::Hash, engine, &key, context.now_ms)? {
            Some(mut hash) => Ok(hash.get(field)?),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

/// The value's elements in its own order, and whether it is a set (which
/// has none: its members come sorted, so that the order does not depend on
/// the layout); WRONGTYPE for a type SORT does not take.
fn elements_of(context: &Context, key: &[u8]) -> CommandResult<(Vec<Bytes>, bool)> {
    match read_value(context, key)?.map(|(value, _)| value) {
        None => Ok((Vec::new(), false)),
        Some(Value::List(elements)) => Ok((elements, false)),
        Some(Value::Set(mut members)) => {
            members.sort();
            Ok((members, true))
        }
        Some(Value::SortedSet(entries)) => {
            Ok((entries.into_iter().map(|(_, member)| member).collect(), false))
        }
        Some(Value::String(_) | Value::Hash(_)) => Err(CommandError::WrongType),
    }
}

/// A number as C's `strtod` reads it where SORT reads weights: leading
/// white space allowed, nothing after the number, no NaN, and no result out
/// of a double's range (neither overflowing nor underflowing). As in
/// Redis, the text ends at its first NUL byte, and an empty text reads as 0.
fn parse_weight(text: &[u8]) -> Option<f64> {
    let text = text.split(|&byte| byte == 0).next().unwrap_or_default();
    if text.is_empty() {
        return Some(0.0);
    }
    let text = std::str::from_utf8(text).ok()?.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
    let unsigned = text.trim_start_matches(['+', '-']);
    let value = match unsigned.get(..2) {
        Some("0x" | "0X") => {
            let magnitude = u64::from_str_radix(&unsigned[2..], 16).ok()? as f64;
            if text.starts_with('-') {
                -magnitude
            } else {
                magnitude
            }
        }
        _ => text.parse::<f64>().ok()?,
    };
    let spelled_infinite = unsigned.get(..3).is_some_and(|start| start.eq_ignore_ascii_case("inf"));
    let nonzero_digits = unsigned
        .split(['e', 'E'])
        .next()
        .is_some_and(|mantissa| mantissa.bytes().any(|b| matches!(b, b'1'..=b'9')));
    let out_of_range = (value.is_infinite() && !spelled_infinite)
        || (nonzero_digits && (value == 0.0 || value.is_subnormal()));
    (!value.is_nan() && !out_of_range).then_some(value)
}

/// What an element sorts by.
enum Weight {
    Number(f64),
    Bytes(Option<Bytes>),
    /// ALPHA without BY: the element itself.
    Itself,
}

pub fn sort(context: &mut Context, request: &Request) -> CommandResult {
    run(context, request, false)
}

pub fn sort_ro(context: &mut Context, request: &Request) -> CommandResult {
    run(context, request, true)
}

fn run(context: &mut Context, request: &Request, read_only: bool) -> CommandResult {
    let options = parse(context, request, read_only)?;
    let key = request.arg(1);
    let _locks = match options.store {
        Some(destination) => context.lock_keys([key, destination].into_iter())?,
        None => Vec::new(),
    };
    let (mut elements, a_set) = elements_of(context, key)?;
    let length = elements.len() as i64;
    let (start, count) = options.limit.unwrap_or((0, -1));
    let start = start.max(0);
    let end = if count < 0 { length - 1 } else { start.saturating_add(count) - 1 }.min(length - 1);
    // A set has no order of its own: sorted by bytes even under BY without
    // `*`, as Redis does whenever it must answer the same on every replica.
    let keep_order = options.keep_order && !a_set;
    let alpha = options.alpha || (options.keep_order && a_set);
    if keep_order {
        if options.descending {
            elements.reverse();
        }
    } else {
        let by = if options.keep_order { None } else { options.by };
        let mut weighted = Vec::with_capacity(elements.len());
        for element in elements {
            let weight = match (by, alpha) {
                (Some(pattern), true) => Weight::Bytes(look_up(context, pattern, &element)?),
                (None, true) => Weight::Itself,
                (Some(pattern), false) => match look_up(context, pattern, &element)? {
                    Some(text) => Weight::Number(parse_weight(&text).ok_or_else(not_a_double)?),
                    None => Weight::Number(0.0),
                },
                (None, false) => Weight::Number(parse_weight(&element).ok_or_else(not_a_double)?),
            };
            weighted.push((weight, element));
        }
        weighted.sort_by(|(left_weight, left), (right_weight, right)| {
            let order = match (left_weight, right_weight) {
                (Weight::Number(a), Weight::Number(b)) => {
                    a.partial_cmp(b).unwrap_or(Ordering::Equal).then_with(|| left.cmp(right))
                }
                (Weight::Bytes(a), Weight::Bytes(b)) => a.cmp(b),
                _ => left.cmp(right),
            };
            if options.descending {
                order.reverse()
            } else {
                order
            }
        });
        elements = weighted.into_iter().map(|(_, element)| element).collect();
    }
    let window = if start > end { &elements[..0] } else { &elements[start as usize..=end as usize] };
    let mut output: Vec<Option<Bytes>> = Vec::with_capacity(window.len() * options.gets.len().max(1));
    for element in window {
        if options.gets.is_empty() {
            output.push(Some(element.clone()));
        }
        for pattern in &options.gets {
            output.push(look_up(context, pattern, element)?);
        }
    }
    match options.store {
        None => {
            context.out.array(output.len());
            for value in &output {
                context.out.bulk_or_null(value.as_deref());
            }
        }
        Some(destination) => {
            let stored = output.len();
            if output.is_empty() {
                context.engine(destination).delete(destination)?;
            } else {
                let elements = output.into_iter().map(Option::unwrap_or_default).collect();
                store_value(context, destination, Value::List(elements), None)?;
            }
            context.out.integer(stored as i64);
        }
    }
    Ok(())
}

fn not_a_double() -> CommandError {
    CommandError::Other("One or more scores can't be converted into double".into())
}

/// Where SORT's STORE destination is among its arguments (the last STORE
/// counts, as in Redis), stepping over the other options' arguments.
pub fn store_key_position<'r>(count: usize, arg: impl Fn(usize) -> &'r [u8]) -> Option<usize> {
    let mut destination = None;
    let mut at = 2;
    while at < count {
        let name = arg(at);
        if is(name, "limit") {
            at += 2;
        } else if is(name, "get") || is(name, "by") {
            at += 1;
        } else if is(name, "store") && at + 1 < count {
            destination = Some(at + 1);
        }
        at += 1;
    }
    destination
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_read_as_strtod_reads_them() {
        assert_eq!(parse_weight(b""), Some(0.0));
        assert_eq!(parse_weight(b"  12"), Some(12.0));
        assert_eq!(parse_weight(b"-0x1A"), Some(-26.0));
        assert_eq!(parse_weight(b"-inf"), Some(f64::NEG_INFINITY));
        assert_eq!(parse_weight(b"1.5e3"), Some(1500.0));
        assert_eq!(parse_weight(b"0.0"), Some(0.0));
        assert_eq!(parse_weight(b"\0\0xyz"), Some(0.0));
        assert_eq!(parse_weight(b"4\0xyz"), Some(4.0));
        for bad in [&b"12 "[..], b"   ", b"abc", b"nan", b"1e400", b"1e-400", b"3.5x"] {
            assert_eq!(parse_weight(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn patterns_substitute_the_first_star_and_split_a_hash_field() {
        assert_eq!(substitute(b"w_*", b"a"), Some((b"w_a".to_vec(), None)));
        assert_eq!(substitute(b"h_*->f", b"a"), Some((b"h_a".to_vec(), Some(&b"f"[..]))));
        assert_eq!(substitute(b"h_*->", b"a"), Some((b"h_a->".to_vec(), None)));
        assert_eq!(substitute(b"x->f*", b"a"), Some((b"x->fa".to_vec(), None)));
        assert_eq!(substitute(b"nostar", b"a"), None);
    }

    #[test]
    fn the_last_store_names_the_destination() {
        let args: Vec<&[u8]> =
            vec![b"sort", b"k", b"by", b"store", b"limit", b"0", b"1", b"store", b"d", b"alpha"];
        assert_eq!(store_key_position(args.len(), |at| args[at]), Some(8));
        let args: Vec<&[u8]> = vec![b"sort", b"k", b"get", b"store"];
        assert_eq!(store_key_position(args.len(), |at| args[at]), None);
    }
}
