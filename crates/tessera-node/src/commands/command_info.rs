//! What COMMAND and COMMAND INFO say of a command, in Redis 7's ten fields:
//! name, arity, flags, the first and last key and the step between keys,
//! ACL categories, tips for cluster clients, key specifications and
//! subcommands. Everything is derived from the command table, so it cannot
//! drift from what the node does.

use tessera_wire::ReplyWriter;

use super::{acl, commands_by_family, counted_keys_at, subcommands, CommandSpec, Scope};

/// Where a key specification's search begins.
enum Begin {
    /// At this argument.
    Index(i64),
    /// After this keyword, searched from `from` (negative: from the end).
    Keyword(&'static str, i64),
}

/// How a key specification finds the keys from where its search began.
enum Find {
    /// Keys up to `last` (relative to the beginning; negative: from the
    /// end), `step` apart.
    Range { last: i64, step: i64 },
    /// The first argument counts the keys that follow it.
    Counted,
}

struct KeySpec {
    flags: &'static [&'static str],
    begin: Begin,
    find: Find,
}

/// A command's ten fields, with its subcommands'.
pub fn write(out: &mut ReplyWriter, spec: &CommandSpec) {
    let categories = categories_of(spec);
    // As in Redis, a container's categories are its subcommands'; it is
    // only slow or fast itself.
    let speed = [if spec.flags.contains(&"fast") { "fast" } else { "slow" }];
    let own_categories: &[&str] = if subcommands(spec.name).is_some() { &speed } else { &categories };
    write_entry(out, spec.name, spec.arity, spec, own_categories, &key_specs(spec, None));
    let Some(subcommands) = subcommands(spec.name) else {
        out.array(0);
        return;
    };
    out.array(subcommands.len());
    for (name, arity) in subcommands {
        let full_name = format!("{}|{name}", spec.name);
        write_entry(out, &full_name, *arity, spec, &categories, &key_specs(spec, Some(name)));
        out.array(0);
    }
}

/// The first nine fields (the caller writes the subcommands).
fn write_entry(
    out: &mut ReplyWriter,
    name: &str,
    arity: i32,
    spec: &CommandSpec,
    categories: &[&str],
    key_specs: &[KeySpec],
) {
    out.array(10);
    out.bulk(name.as_bytes());
    out.integer(arity as i64);
    out.set(spec.flags.len());
    for flag in spec.flags {
        out.simple(flag);
    }
    // A container's keys are its subcommands' (MEMORY USAGE's).
    let fixed = subcommands(spec.name).is_none();
    out.integer(if fixed { spec.first_key as i64 } else { 0 });
    out.integer(if fixed { spec.last_key as i64 } else { 0 });
    out.integer(if fixed { spec.step as i64 } else { 0 });
    out.set(categories.len());
    for category in categories {
        out.simple(&format!("@{category}"));
    }
    let tips = tips(spec);
    out.array(tips.len());
    for tip in tips {
        out.bulk(tip.as_bytes());
    }
    out.array(key_specs.len());
    for key_spec in key_specs {
        write_key_spec(out, key_spec);
    }
}

fn write_key_spec(out: &mut ReplyWriter, key_spec: &KeySpec) {
    out.map(3);
    out.bulk(b"flags");
    out.set(key_spec.flags.len());
    for flag in key_spec.flags {
        out.simple(flag);
    }
    out.bulk(b"begin_search");
    match key_spec.begin {
        Begin::Index(index) => write_search(out, "index", &[("index", Field::Integer(index))]),
        Begin::Keyword(keyword, from) => write_search(
            out,
            "keyword",
            &[("keyword", Field::Text(keyword)), ("startfrom", Field::Integer(from))],
        ),
    }
    out.bulk(b"find_keys");
    match key_spec.find {
        Find::Range { last, step } => write_search(
            out,
            "range",
            &[
                ("lastkey", Field::Integer(last)),
                ("keystep", Field::Integer(step)),
                ("limit", Field::Integer(0)),
            ],
        ),
        Find::Counted => write_search(
            out,
            "keynum",
            &[
                ("keynumidx", Field::Integer(0)),
                ("firstkey", Field::Integer(1)),
                ("keystep", Field::Integer(1)),
            ],
        ),
    }
}

enum Field {
    Integer(i64),
    Text(&'static str),
}

/// One step of a key specification: `{type, spec: {fields}}`.
fn write_search(out: &mut ReplyWriter, kind: &str, fields: &[(&str, Field)]) {
    out.map(2);
    out.bulk(b"type");
    out.bulk(kind.as_bytes());
    out.bulk(b"spec");
    out.map(fields.len());
    for (name, value) in fields {
        out.bulk(name.as_bytes());
        match value {
            Field::Integer(value) => out.integer(*value),
            Field::Text(value) => out.bulk(value.as_bytes()),
        }
    }
}

/// The command's ACL categories, as ACL checks them (`@all`, which every
/// command is in, left out as Redis leaves it).
fn categories_of(spec: &CommandSpec) -> Vec<&'static str> {
    let family = commands_by_family().find(|(_, known)| known.name == spec.name).map(|(family, _)| family);
    let mut categories = acl::categories(family.expect("every command has a family"), spec);
    categories.retain(|category| *category != "all");
    categories
}

/// How many key specifications the command (or one of its subcommands) has.
pub fn key_spec_count(spec: &CommandSpec, subcommand: Option<&str>) -> usize {
    key_specs(spec, subcommand).len()
}

/// Key specifications: the fixed range, then the keys a count, a keyword or
/// a subcommand introduces. What a command does to its keys is told coarsely:
/// RW for a command that writes, RO for one that reads.
fn key_specs(spec: &CommandSpec, subcommand: Option<&str>) -> Vec<KeySpec> {
    let writes = spec.flags.contains(&"write");
    let flags: &'static [&'static str] = if writes { &["RW", "access", "update"] } else { &["RO", "access"] };
    let mut specs = Vec::new();
    if subcommands(spec.name).is_some() {
        if spec.name == "memory" && subcommand == Some("usage") {
            specs.push(KeySpec { flags, begin: Begin::Index(2), find: Find::Range { last: 0, step: 1 } });
        }
        return specs;
    }
    if spec.first_key > 0 {
        let first = i64::from(spec.first_key);
        let last =
            if spec.last_key < 0 { i64::from(spec.last_key) } else { i64::from(spec.last_key) - first };
        let find = Find::Range { last, step: i64::from(spec.step.max(1)) };
        specs.push(KeySpec { flags, begin: Begin::Index(first), find });
    }
    if let Some(at) = counted_keys_at(spec.name) {
        specs.push(KeySpec { flags, begin: Begin::Index(at as i64), find: Find::Counted });
    }
    match spec.name {
        "sort" => specs.push(KeySpec {
            flags: &["OW", "update"],
            begin: Begin::Keyword("STORE", 2),
            find: Find::Range { last: 0, step: 1 },
        }),
        "migrate" => specs.push(KeySpec {
            flags: &["RW", "access", "delete"],
            begin: Begin::Keyword("KEYS", -2),
            find: Find::Range { last: -1, step: 1 },
        }),
        _ => {}
    }
    specs
}

/// Tips for cluster clients: the commands that cover only the shards this
/// node heads, to be sent to every node.
fn tips(spec: &CommandSpec) -> &'static [&'static str] {
    match (spec.scope, spec.name) {
        (Scope::NodeWide, "dbsize") => &["request_policy:all_shards", "response_policy:agg_sum"],
        (Scope::NodeWide, "keys") => &["request_policy:all_shards", "nondeterministic_output_order"],
        (Scope::NodeWide, "randomkey") => {
            &["request_policy:all_shards", "response_policy:special", "nondeterministic_output"]
        }
        (Scope::Flush, _) => &["request_policy:all_shards", "response_policy:all_succeeded"],
        _ => &[],
    }
}
