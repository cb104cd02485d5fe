//! COMMAND DOCS: for each command and subcommand Tessera serves, the
//! version of Redis that added it, its group and its arguments, as Redis
//! 7.0 records them (`docs_table.rs`, generated), which is what redis-cli
//! builds its help and its hints from. The summary is the command's syntax,
//! written out from its arguments; Tessera's own commands say what they do.

use std::fmt::Write as _;

use tessera_wire::ReplyWriter;

use super::docs_table::DOCS;
use super::{command_info, subcommands, CommandSpec};

/// One argument, as COMMAND DOCS describes it.
pub struct Arg {
    pub name: &'static str,
    /// key, string, integer, double, pattern, unix-time, pure-token, oneof
    /// or block.
    pub kind: &'static str,
    pub token: Option<&'static str>,
    pub display: Option<&'static str>,
    /// Which of Redis's key specifications names it (a key).
    pub key_spec: Option<i64>,
    /// optional, multiple, multiple_token.
    pub flags: &'static [&'static str],
    pub args: &'static [Arg],
}

/// One command's or subcommand's documentation.
pub struct Doc {
    pub name: &'static str,
    pub since: &'static str,
    pub group: &'static str,
    pub args: &'static [Arg],
}

/// Tessera's own commands, which Redis does not record.
const TESSERA: &[(&str, &str)] = &[
    ("consistency", "Sets the consistency this connection's reads ask for (STRONG, EVENTUAL or CAUSAL)"),
    ("consistency.read", "Runs one read at the consistency it names, and says which one it got"),
    ("causal.token", "Returns the connection's causal context as a sealed token, or with SET takes one up"),
    ("relay.hello", "Between a cluster's nodes only: opens a forwarding link"),
    ("relay.auth", "Between a cluster's nodes only: proves a forwarding link knows the cluster secret"),
    ("relay.publish", "Between a cluster's nodes only: delivers a message published on another node"),
    ("table.create", "Creates a table: a key prefix with its engine, replication mode and partitioning"),
    ("table.drop", "Drops a table and its keys"),
    ("table.list", "Lists the tables"),
    ("table.alter", "Changes a table's mode (topology and consistency) while it serves"),
    ("table.info", "Describes a table"),
    ("table.range", "Reads a range-partitioned table's keys in order, across its shards"),
    (
        "backup.start",
        "Starts writing this node's keys (or the cluster shards named) to an RDB file, while it serves",
    ),
    ("backup.status", "Reports a backup's state, progress, file size and each shard's write position"),
    ("backup.read", "Reads up to 1 MiB of a finished backup's file from an offset"),
    ("backup.drop", "Forgets a finished backup and deletes its file"),
];

fn lookup(name: &str) -> Option<&'static Doc> {
    DOCS.iter().find(|doc| doc.name == name)
}

/// Writes `spec`'s documentation, keyed by name, as one entry of the map
/// COMMAND DOCS answers (the caller wrote the map's header).
pub fn write(out: &mut ReplyWriter, spec: &CommandSpec) {
    out.bulk(spec.name.as_bytes());
    let Some(doc) = lookup(spec.name) else {
        let summary = TESSERA.iter().find(|(name, _)| *name == spec.name).map_or("", |(_, summary)| summary);
        out.map(2);
        out.bulk(b"summary");
        out.bulk(summary.as_bytes());
        out.bulk(b"group");
        out.bulk(b"tessera");
        return;
    };
    let served: Vec<&Doc> = subcommands(spec.name)
        .into_iter()
        .flatten()
        .filter_map(|(name, _)| lookup(&format!("{}|{name}", spec.name)))
        .collect();
    let key_specs = command_info::key_spec_count(spec, None);
    write_doc(out, doc, key_specs, usize::from(!served.is_empty()));
    if !served.is_empty() {
        out.bulk(b"subcommands");
        out.map(served.len());
        for sub in served {
            out.bulk(sub.name.as_bytes());
            let subcommand = sub.name.split_once('|').map(|(_, name)| name);
            write_doc(out, sub, command_info::key_spec_count(spec, subcommand), 0);
        }
    }
}

/// A doc's fields; `extra` more follow (the subcommands).
fn write_doc(out: &mut ReplyWriter, doc: &Doc, key_specs: usize, extra: usize) {
    out.map(3 + usize::from(!doc.args.is_empty()) + extra);
    out.bulk(b"summary");
    out.bulk(usage(doc).as_bytes());
    out.bulk(b"since");
    out.bulk(doc.since.as_bytes());
    out.bulk(b"group");
    out.bulk(doc.group.as_bytes());
    if !doc.args.is_empty() {
        out.bulk(b"arguments");
        write_args(out, doc.args, key_specs);
    }
}

/// Arguments as Redis writes them; a key names the key specification of
/// Tessera's own (which may join two of Redis's in one range).
fn write_args(out: &mut ReplyWriter, args: &[Arg], key_specs: usize) {
    out.array(args.len());
    for arg in args {
        let key_spec = arg.key_spec.map(|index| index.min(key_specs.saturating_sub(1) as i64));
        let fields = 2
            + usize::from(key_spec.is_some())
            + usize::from(arg.token.is_some())
            + usize::from(arg.display.is_some())
            + usize::from(!arg.flags.is_empty())
            + usize::from(!arg.args.is_empty());
        out.map(fields);
        out.bulk(b"name");
        out.bulk(arg.name.as_bytes());
        out.bulk(b"type");
        out.bulk(arg.kind.as_bytes());
        if let Some(index) = key_spec {
            out.bulk(b"key_spec_index");
            out.integer(index);
        }
        if let Some(token) = arg.token {
            out.bulk(b"token");
            out.bulk(token.as_bytes());
        }
        if let Some(display) = arg.display {
            out.bulk(b"display_text");
            out.bulk(display.as_bytes());
        }
        if !arg.flags.is_empty() {
            out.bulk(b"flags");
            out.set(arg.flags.len());
            for flag in arg.flags {
                out.simple(flag);
            }
        }
        if !arg.args.is_empty() {
            out.bulk(b"arguments");
            write_args(out, arg.args, key_specs);
        }
    }
}

/// The command's syntax, from its arguments: `SET key value [NX | XX] ...`.
fn usage(doc: &Doc) -> String {
    let mut text = doc.name.replace('|', " ").to_ascii_uppercase();
    for arg in doc.args {
        text.push(' ');
        write_usage(&mut text, arg);
    }
    text
}

fn write_usage(text: &mut String, arg: &Arg) {
    let optional = arg.flags.contains(&"optional");
    let multiple = arg.flags.contains(&"multiple");
    if optional {
        text.push('[');
    }
    let start = text.len();
    if let Some(token) = arg.token {
        let _ = write!(text, "{token}");
        if arg.kind != "pure-token" {
            text.push(' ');
        }
    }
    match arg.kind {
        "pure-token" => {}
        "oneof" | "block" => {
            let separator = if arg.kind == "oneof" { " | " } else { " " };
            let nested = arg.token.is_some() || (arg.kind == "oneof" && !optional);
            if nested {
                text.push(if arg.kind == "oneof" { '<' } else { '(' });
            }
            for (index, child) in arg.args.iter().enumerate() {
                if index > 0 {
                    text.push_str(separator);
                }
                write_usage(text, child);
            }
            if nested {
                text.push(if arg.kind == "oneof" { '>' } else { ')' });
            }
        }
        _ => text.push_str(arg.display.unwrap_or(arg.name)),
    }
    if multiple {
        let once = text[start..].to_string();
        let _ = write!(text, " [{once} ...]");
    }
    if optional {
        text.push(']');
    }
}
