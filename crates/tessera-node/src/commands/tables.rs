//! Table management: TABLE.CREATE, TABLE.DROP, TABLE.LIST, TABLE.INFO,
//! TABLE.ALTER (a cluster table's replication mode), and TABLE.RANGE, the
//! ordered walk of a table's keys.

use std::collections::BTreeMap;

use bytes::Bytes;
use tessera_engine::{reserved, Engine, KeyRange, ScanCursor};
use tessera_wire::Request;

use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::tables::{escape_prefix, TableDef};
use crate::typed::Stored;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "table.create", arity: -6, flags: &["write", "admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Tables, handler: create },
    CommandSpec { name: "table.drop", arity: 2, flags: &["write", "admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Tables, handler: drop_table },
    CommandSpec { name: "table.list", arity: 1, flags: &["readonly", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Tables, handler: list },
    CommandSpec { name: "table.alter", arity: -4, flags: &["write", "admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Tables, handler: alter },
    CommandSpec { name: "table.info", arity: 2, flags: &["readonly", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Tables, handler: info },
    CommandSpec { name: "table.range", arity: -4, flags: &["readonly", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::TableRange, handler: range },
];

pub fn text(arg: &[u8]) -> CommandResult<String> {
    String::from_utf8(arg.to_vec())
        .map_err(|_| CommandError::Other("table arguments must be UTF-8 text".into()))
}

/// TABLE.CREATE name PREFIX p ENGINE e [option value ...]
fn create(context: &mut Context, request: &Request) -> CommandResult {
    let (def, split_keys) = parse_create(request)?;
    if split_keys.is_some() {
        return Err(CommandError::Other(
            "PARTITION RANGE divides a table among a cluster's shards; a single node holds all of it".into(),
        ));
    }
    context.node.create_table(def).map_err(|error| CommandError::Other(error.to_string()))?;
    context.out.ok();
    Ok(())
}

/// TABLE.ALTER on a single node: one copy has no replication mode to change.
fn alter(_context: &mut Context, request: &Request) -> CommandResult {
    parse_alter(request)?;
    Err(CommandError::Other(
        "TABLE.ALTER changes how a cluster's shards replicate; a single node keeps one copy".into(),
    ))
}

/// TABLE.ALTER name [TOPOLOGY ms|aa] [CONSISTENCY strong|eventual]: the table
/// and the topology and consistency asked for (`None`: unchanged).
pub fn parse_alter(request: &Request) -> CommandResult<(String, Option<String>, Option<String>)> {
    let usage = || {
        CommandError::Other("usage: TABLE.ALTER name [TOPOLOGY ms|aa] [CONSISTENCY strong|eventual]".into())
    };
    if !request.len().is_multiple_of(2) {
        return Err(usage());
    }
    let (mut topology, mut consistency) = (None, None);
    for index in (2..request.len()).step_by(2) {
        let value = text(request.arg(index + 1))?.to_ascii_lowercase();
        match text(request.arg(index))?.to_ascii_lowercase().as_str() {
            "topology" if matches!(value.as_str(), "ms" | "aa") => topology = Some(value),
            "consistency" if matches!(value.as_str(), "strong" | "eventual") => consistency = Some(value),
            _ => return Err(usage()),
        }
    }
    Ok((text(request.arg(1))?, topology, consistency))
}

/// The table a TABLE.CREATE asks for, and its split keys (ascending) if it
/// asks for range partitioning: `PARTITION RANGE` with `SPLIT key` repeated.
pub fn parse_create(request: &Request) -> CommandResult<(TableDef, Option<Vec<Vec<u8>>>)> {
    if !is(request.arg(2), "prefix") || !is(request.arg(4), "engine") || !request.len().is_multiple_of(2) {
        return Err(CommandError::Other(
            "usage: TABLE.CREATE name PREFIX prefix ENGINE engine [PARTITION HASH|RANGE] [SPLIT key]... [option value]..."
                .into(),
        ));
    }
    let mut options = BTreeMap::new();
    let mut range_partitioned = false;
    let mut splits = Vec::new();
    for index in (6..request.len()).step_by(2) {
        let value = request.arg(index + 1);
        match text(request.arg(index))?.to_ascii_lowercase().as_str() {
            "partition" if is(value, "range") => range_partitioned = true,
            "partition" if is(value, "hash") => range_partitioned = false,
            "partition" => return Err(CommandError::Other("PARTITION is HASH or RANGE".into())),
            "split" => splits.push(value.to_vec()),
            option => {
                options.insert(option.to_string(), text(value)?);
            }
        }
    }
    if !splits.is_empty() && !range_partitioned {
        return Err(CommandError::Other("SPLIT keys need PARTITION RANGE".into()));
    }
    splits.sort();
    let def = TableDef {
        name: text(request.arg(1))?,
        prefix: escape_prefix(request.arg(3)),
        engine: text(request.arg(5))?.to_ascii_lowercase(),
        options,
    };
    Ok((def, range_partitioned.then_some(splits)))
}

/// What a TABLE.RANGE asks for.
pub struct RangeQuery {
    pub table: String,
    /// The keys asked for: from `start` (inclusive) to `end` (exclusive).
    pub keys: KeyRange,
    /// At most this many keys are answered.
    pub count: usize,
}

/// TABLE.RANGE name min max [COUNT n]: bounds as in ZRANGEBYLEX (`[key`
/// inclusive, `(key` exclusive, `-` and `+` open).
pub fn parse_range(request: &Request) -> CommandResult<RangeQuery> {
    let bound = |arg: &[u8], lowest: bool| -> CommandResult<Option<Bytes>> {
        let after = |key: &[u8]| Bytes::from([key, b"\0"].concat());
        match (arg.split_first(), lowest) {
            (Some((b'-', [])), true) | (Some((b'+', [])), false) => Ok(None),
            (Some((b'[', key)), true) | (Some((b'(', key)), false) => Ok(Some(Bytes::copy_from_slice(key))),
            (Some((b'(', key)), true) | (Some((b'[', key)), false) => Ok(Some(after(key))),
            _ => Err(CommandError::Other(
                "min and max start with '[' (inclusive) or '(' (exclusive), or are '-' and '+'".into(),
            )),
        }
    };
    let count = match request.len() {
        4 => usize::MAX,
        6 if is(request.arg(4), "count") => integer_arg(request, 5)?
            .try_into()
            .ok()
            .filter(|count| *count >= 1)
            .ok_or(CommandError::Syntax)?,
        _ => return Err(CommandError::Syntax),
    };
    Ok(RangeQuery {
        table: text(request.arg(1))?,
        keys: KeyRange { start: bound(request.arg(2), true)?, end: bound(request.arg(3), false)? },
        count,
    })
}

/// Up to `limit` live keys of `range` in ascending order, from an ordered
/// engine holding values as commands store them.
pub fn ordered_keys(
    engine: &dyn Engine,
    range: &KeyRange,
    limit: usize,
    now_ms: u64,
) -> CommandResult<Vec<Bytes>> {
    if !engine.capabilities().ordered {
        return Err(CommandError::Other(
            "TABLE.RANGE needs a table on an ordered engine (ordered, lsm)".into(),
        ));
    }
    let mut keys = Vec::new();
    if matches!((&range.start, &range.end), (Some(start), Some(end)) if start >= end) {
        return Ok(keys);
    }
    let mut cursor = ScanCursor::start();
    while keys.len() < limit {
        let page = engine.scan(range, &cursor, (limit - keys.len()).min(1024))?;
        for (key, raw) in page.entries {
            let live = Stored::decode(raw).is_ok_and(|stored| !stored.is_expired(now_ms));
            if live && !reserved::is_reserved(&key) && keys.len() < limit {
                keys.push(key);
            }
        }
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    Ok(keys)
}

fn range(context: &mut Context, request: &Request) -> CommandResult {
    let query = parse_range(request)?;
    let table = context
        .tables
        .get(&query.table)
        .ok_or_else(|| CommandError::Other(format!("no such table '{}'", query.table)))?;
    let keys = ordered_keys(table.engine.as_ref(), &query.keys, query.count, context.now_ms)?;
    context.out.array(keys.len());
    for key in keys {
        context.out.bulk(&key);
    }
    Ok(())
}

fn drop_table(context: &mut Context, request: &Request) -> CommandResult {
    let name = text(request.arg(1))?;
    context.node.drop_table(&name).map_err(|error| CommandError::Other(error.to_string()))?;
    context.out.ok();
    Ok(())
}

fn list(context: &mut Context, _request: &Request) -> CommandResult {
    let tables = context.tables.by_name();
    context.out.array(tables.len());
    for table in tables {
        context.out.bulk(table.def.name.as_bytes());
    }
    Ok(())
}

fn info(context: &mut Context, request: &Request) -> CommandResult {
    let name = text(request.arg(1))?;
    let table =
        context.tables.get(&name).ok_or_else(|| CommandError::Other(format!("no such table '{name}'")))?;
    let capabilities = table.engine.capabilities();
    let keys = table.engine.len()?;
    let stats = table.engine.stats();
    let options: Vec<String> = table
        .def
        .options
        .iter()
        .filter(|(option, _)| option.as_str() != "password")
        .map(|(option, value)| format!("{option}={value}"))
        .collect();
    let out = &mut *context.out;
    out.map(7 + stats.len());
    out.bulk(b"name");
    out.bulk(table.def.name.as_bytes());
    out.bulk(b"prefix");
    out.bulk(&table.prefix);
    out.bulk(b"engine");
    out.bulk(table.spec.kind.name().as_bytes());
    out.bulk(b"options");
    out.bulk(options.join(" ").as_bytes());
    out.bulk(b"keys");
    out.integer(keys as i64);
    out.bulk(b"ordered");
    out.boolean(capabilities.ordered);
    out.bulk(b"persistent");
    out.boolean(capabilities.persistent);
    for (name, value) in stats {
        out.bulk(name.as_bytes());
        out.integer(value as i64);
    }
    Ok(())
}
