//! SLOWLOG, LATENCY and MEMORY: what a node tells operators about its own
//! behaviour, in Redis's replies ([`crate::diagnostics`] keeps the records).

use std::fmt::Write as _;

use tessera_wire::Request;

use super::{integer_arg, is, write_help, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::memory::{estimated_bytes, resident_memory, used_memory};
use crate::typed::read_live;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "slowlog", arity: -2, flags: &["admin", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: slowlog },
    CommandSpec { name: "latency", arity: -2, flags: &["admin", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: latency },
    CommandSpec { name: "memory", arity: -2, flags: &["readonly"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: memory },
];

/// The subcommands and their arities (checked on the way in).
pub const SLOWLOG_SUBCOMMANDS: &[(&str, i32)] = &[("get", -2), ("len", 2), ("reset", 2), ("help", 2)];
pub const LATENCY_SUBCOMMANDS: &[(&str, i32)] =
    &[("latest", 2), ("history", 3), ("reset", -2), ("doctor", 2), ("help", 2)];
pub const MEMORY_SUBCOMMANDS: &[(&str, i32)] =
    &[("usage", -3), ("stats", 2), ("doctor", 2), ("purge", 2), ("malloc-stats", 2), ("help", 2)];

fn slowlog(context: &mut Context, request: &Request) -> CommandResult {
    let log = &context.node.slowlog;
    let subcommand = request.arg(1);
    if is(subcommand, "get") {
        let count = match request.len() {
            2 => Some(10),
            3 => match integer_arg(request, 2) {
                Ok(-1) => None,
                Ok(count) if count >= 0 => Some(count as usize),
                _ => return Err(CommandError::Other("count should be greater than or equal to -1".into())),
            },
            _ => {
                return Err(CommandError::SubcommandSyntax(
                    String::from_utf8_lossy(subcommand).into_owned(),
                    "SLOWLOG",
                ))
            }
        };
        let entries = log.latest(count);
        let out = &mut *context.out;
        out.array(entries.len());
        for entry in entries {
            out.array(6);
            out.integer(entry.id as i64);
            out.integer(entry.unix_seconds as i64);
            out.integer(entry.duration_us as i64);
            out.array(entry.args.len());
            for arg in &entry.args {
                out.bulk(arg);
            }
            out.bulk(entry.client_address.as_bytes());
            out.bulk(&entry.client_name);
        }
    } else if is(subcommand, "len") {
        context.out.integer(log.len() as i64);
    } else if is(subcommand, "reset") {
        log.reset();
        context.out.ok();
    } else {
        write_help(
            context,
            &[
                "SLOWLOG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
                "GET [<count>]",
                "    Return top <count> entries from the slowlog (default: 10, -1 mean all).",
                "    Entries are made of:",
                "    id, timestamp, time in microseconds, arguments array, client IP and port,",
                "    client name",
                "LEN",
                "    Return the length of the slowlog.",
                "RESET",
                "    Reset the slowlog.",
            ],
        );
    }
    Ok(())
}

fn latency(context: &mut Context, request: &Request) -> CommandResult {
    let monitor = &context.node.latency;
    let subcommand = request.arg(1);
    if is(subcommand, "latest") {
        let events = monitor.events();
        let out = &mut *context.out;
        out.array(events.len());
        for (name, history) in events {
            let (second, latest) = history.samples.back().copied().unwrap_or_default();
            out.array(4);
            out.bulk(name.as_bytes());
            out.integer(second as i64);
            out.integer(latest as i64);
            out.integer(history.max_ms as i64);
        }
    } else if is(subcommand, "history") {
        let wanted = request.arg(2);
        let events = monitor.events();
        let samples =
            events.iter().find(|(name, _)| name.as_bytes() == wanted).map(|(_, history)| &history.samples);
        let out = &mut *context.out;
        out.array(samples.map_or(0, |samples| samples.len()));
        for (second, latency_ms) in samples.into_iter().flatten() {
            out.array(2);
            out.integer(*second as i64);
            out.integer(*latency_ms as i64);
        }
    } else if is(subcommand, "reset") {
        let names: Vec<&[u8]> = request.args().skip(2).collect();
        context.out.integer(monitor.reset(&names) as i64);
    } else if is(subcommand, "doctor") {
        let threshold = monitor.threshold_ms();
        let events = monitor.events();
        let mut text = String::new();
        if threshold == 0 {
            text.push_str(
                "Latency monitoring is disabled in this Tessera node. Enable it with \
                 \"CONFIG SET latency-monitor-threshold <milliseconds>\".\n",
            );
        } else if events.is_empty() {
            let _ = writeln!(text, "No latency spikes of {threshold} ms or more were observed on this node.");
        } else {
            let _ = writeln!(text, "Latency spikes of {threshold} ms or more observed on this node:");
            for (name, history) in events {
                let average = history.samples.iter().map(|(_, ms)| ms).sum::<u64>()
                    / history.samples.len().max(1) as u64;
                let _ = writeln!(
                    text,
                    "- {name}: {} samples in the last {} seconds kept, average {average} ms, worst {} ms.",
                    history.samples.len(),
                    history
                        .samples
                        .back()
                        .zip(history.samples.front())
                        .map_or(0, |(last, first)| last.0 - first.0),
                    history.max_ms,
                );
            }
            text.push_str(
                "A command over the threshold is slow itself (see SLOWLOG GET) or waited for its keys' locks \
                 or for replication; in a cluster, compare with the node's peers.\n",
            );
        }
        context.out.verbatim(&text);
    } else {
        write_help(
            context,
            &[
                "LATENCY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
                "DOCTOR",
                "    Return a human readable latency analysis report.",
                "HISTORY <event>",
                "    Return time-latency samples for the <event> class.",
                "LATEST",
                "    Return the latest latency samples for all events.",
                "RESET [<event> ...]",
                "    Reset latency data of one or more <event> classes.",
                "    (default: reset all data for all event classes)",
            ],
        );
    }
    Ok(())
}

fn memory(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    if is(subcommand, "usage") {
        let samples = match request.len() {
            3 => 5,
            5 if is(request.arg(3), "samples") => match integer_arg(request, 4)? {
                0 => usize::MAX,
                count if count > 0 => count as usize,
                _ => return Err(CommandError::Syntax),
            },
            _ => return Err(CommandError::Syntax),
        };
        let (key, engine) = (request.arg(2), context.engine(request.arg(2)));
        match read_live(engine, key, context.now_ms)? {
            Some(stored) => {
                let bytes = estimated_bytes(engine, key, &stored, context.now_ms, samples)?;
                context.out.integer(bytes as i64);
            }
            None => context.out.null(),
        }
    } else if is(subcommand, "stats") {
        let node = context.node;
        let mut keys = 0;
        for table in context.tables.by_name() {
            keys += table.engine.len()?;
        }
        let used = used_memory() as u64;
        let stats: [(&str, u64); 8] = [
            ("peak.allocated", used),
            ("total.allocated", used),
            ("startup.allocated", 0),
            ("clients.normal", node.clients.all().len() as u64),
            ("keys.count", keys),
            ("keys.bytes-per-key", used.checked_div(keys).unwrap_or(0)),
            ("dataset.bytes", used),
            ("rss-bytes", resident_memory()),
        ];
        context.out.map(stats.len());
        for (name, value) in stats {
            context.out.bulk(name.as_bytes());
            context.out.integer(value as i64);
        }
    } else if is(subcommand, "doctor") {
        context.out.verbatim(
            "Tessera keeps no allocator fragmentation report; see INFO memory (used_memory, used_memory_rss) \
             and MEMORY USAGE <key>.\n",
        );
    } else if is(subcommand, "purge") {
        context.out.ok();
    } else if is(subcommand, "malloc-stats") {
        context.out.verbatim("Stats not supported for the current allocator\n");
    } else {
        write_help(
            context,
            &[
                "MEMORY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
                "DOCTOR",
                "    Return memory problems reports.",
                "MALLOC-STATS",
                "    Return internal statistics report from the memory allocator.",
                "PURGE",
                "    Attempt to purge dirty pages for reclamation by the allocator.",
                "STATS",
                "    Return information about the memory usage of the server.",
                "USAGE <key> [SAMPLES <count>]",
                "    Return memory in bytes used by <key> and its value. Nested values are",
                "    sampled up to <count> times (default: 5, 0 means sample all).",
            ],
        );
    }
    Ok(())
}
