//! Server commands: INFO, COMMAND, CONFIG GET, TIME.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use tessera_wire::{ReplyWriter, Request};

use super::{all_commands, is, lookup, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::memory::{human_bytes, resident_memory, used_memory};
use crate::tables::escape_prefix;
use crate::REDIS_COMPATIBLE_VERSION;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "info", arity: -1, flags: &["loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: info },
    CommandSpec { name: "command", arity: -1, flags: &["loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: command },
    CommandSpec { name: "config", arity: -2, flags: &["admin", "loading", "stale", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: config },
    CommandSpec { name: "time", arity: 1, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: time },
];

/// INFO [section ...]: the sections Redis tools read, in Redis's format, plus
/// Tessera's tables.
fn info(context: &mut Context, request: &Request) -> CommandResult {
    let wanted: Vec<String> =
        request.args().skip(1).map(|section| String::from_utf8_lossy(section).to_ascii_lowercase()).collect();
    let include = |section: &str| {
        wanted.is_empty()
            || wanted
                .iter()
                .any(|name| name == section || name == "all" || name == "everything" || name == "default")
    };
    let node = context.node;
    let stats = &node.stats;
    let mut text = String::new();
    if include("server") {
        let uptime = node.started.elapsed().as_secs();
        let _ = write!(
            text,
            "# Server\r\nredis_version:{REDIS_COMPATIBLE_VERSION}\r\ntessera_version:{}\r\nredis_mode:{}\r\n\
             os:{}\r\narch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{uptime}\r\n\
             uptime_in_days:{}\r\nexecutable:tessera\r\n\r\n",
            env!("CARGO_PKG_VERSION"),
            if context.cluster.is_some() { "cluster" } else { "standalone" },
            std::env::consts::OS,
            std::process::id(),
            node.config.port,
            uptime / 86400,
        );
    }
    if include("clients") {
        let _ = write!(
            text,
            "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\nblocked_clients:{}\r\n\r\n",
            stats.connected_clients.load(Ordering::Relaxed),
            node.config.max_clients,
            node.waiters.blocked_clients(),
        );
    }
    if include("memory") {
        let (used, resident, limit) = (used_memory(), resident_memory(), node.config.maxmemory);
        let _ = write!(
            text,
            "# Memory\r\nused_memory:{used}\r\nused_memory_human:{}\r\nused_memory_rss:{resident}\r\n\
             used_memory_rss_human:{}\r\nmaxmemory:{limit}\r\nmaxmemory_human:{}\r\nmaxmemory_policy:{}\r\n\r\n",
            human_bytes(used as u64),
            human_bytes(resident),
            human_bytes(limit),
            node.config.maxmemory_policy.name(),
        );
    }
    if include("stats") {
        let _ = write!(
            text,
            "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n\
             total_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\nrejected_connections:{}\r\n\
             expired_keys:{}\r\nevicted_keys:{}\r\nkeyspace_hits:{}\r\nkeyspace_misses:{}\r\n\r\n",
            stats.connections_received.load(Ordering::Relaxed),
            node.worker_total(|worker| &worker.commands),
            node.worker_total(|worker| &worker.net_input_bytes),
            node.worker_total(|worker| &worker.net_output_bytes),
            stats.connections_rejected.load(Ordering::Relaxed),
            stats.expired_keys.load(Ordering::Relaxed),
            stats.evicted_keys.load(Ordering::Relaxed),
            node.worker_total(|worker| &worker.keyspace_hits),
            node.worker_total(|worker| &worker.keyspace_misses),
        );
    }
    if include("cluster") {
        let _ = write!(text, "# Cluster\r\ncluster_enabled:{}\r\n\r\n", u8::from(context.cluster.is_some()));
    }
    let tables = context.tables.by_name();
    if include("keyspace") {
        let mut keys = 0;
        for table in &tables {
            keys += table.engine.len()?;
        }
        text.push_str("# Keyspace\r\n");
        if keys > 0 {
            let _ = write!(text, "db0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        text.push_str("\r\n");
    }
    if include("tables") {
        text.push_str("# Tables\r\n");
        for table in &tables {
            let _ = write!(
                text,
                "table_{}:prefix={},engine={},keys={}\r\n",
                table.def.name,
                escape_prefix(&table.prefix),
                table.spec.kind.name(),
                table.engine.len()?
            );
        }
        text.push_str("\r\n");
    }
    context.out.verbatim(&text);
    Ok(())
}

fn write_command_info(out: &mut ReplyWriter, spec: &CommandSpec) {
    // Redis 7's ten fields; the last four are empty (no ACL categories, tips,
    // key specs or subcommands), which clients accept.
    out.array(10);
    out.bulk(spec.name.as_bytes());
    out.integer(spec.arity as i64);
    out.set(spec.flags.len());
    for flag in spec.flags {
        out.simple(flag);
    }
    out.integer(spec.first_key as i64);
    out.integer(spec.last_key as i64);
    out.integer(spec.step as i64);
    for _ in 0..4 {
        out.array(0);
    }
}

/// COMMAND, COMMAND COUNT / INFO / LIST / DOCS / GETKEYS.
fn command(context: &mut Context, request: &Request) -> CommandResult {
    let out = &mut *context.out;
    if request.len() == 1 {
        let specs: Vec<_> = all_commands().collect();
        out.array(specs.len());
        for spec in specs {
            write_command_info(out, spec);
        }
        return Ok(());
    }
    let subcommand = request.arg(1);
    if is(subcommand, "count") {
        out.integer(all_commands().count() as i64);
    } else if is(subcommand, "list") {
        let specs: Vec<_> = all_commands().collect();
        out.array(specs.len());
        for spec in specs {
            out.bulk(spec.name.as_bytes());
        }
    } else if is(subcommand, "info") {
        out.array(request.len() - 2);
        for name in request.args().skip(2) {
            match lookup(name) {
                Some(spec) => write_command_info(out, spec),
                None => out.null_array(),
            }
        }
    } else if is(subcommand, "docs") {
        // Documentation is optional for clients (redis-cli uses it for hints).
        out.map(0);
    } else if is(subcommand, "getkeys") {
        if request.len() < 3 {
            return Err(CommandError::WrongArity("command|getkeys".into()));
        }
        let spec =
            lookup(request.arg(2)).ok_or_else(|| CommandError::Other("Invalid command specified".into()))?;
        let args: Vec<&[u8]> = request.args().skip(2).collect();
        let keys: Vec<&[u8]> = spec
            .key_positions(args.len(), |index| args[index])
            .filter_map(|index| args.get(index).copied())
            .collect();
        if keys.is_empty() {
            return Err(CommandError::Other("The command has no key arguments".into()));
        }
        out.array(keys.len());
        for key in keys {
            out.bulk(key);
        }
    } else {
        return Err(CommandError::UnknownSubcommand(
            String::from_utf8_lossy(subcommand).into_owned(),
            "COMMAND".into(),
        ));
    }
    Ok(())
}

/// CONFIG GET answers for the parameters Redis tools ask about; settings are
/// changed in the config file, not at run time.
fn config(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    if is(subcommand, "get") {
        if request.len() < 3 {
            return Err(CommandError::WrongArity("config|get".into()));
        }
        let config = &context.node.config;
        let parameters = [
            ("bind", config.bind.clone()),
            ("port", config.port.to_string()),
            ("dir", config.dir.display().to_string()),
            ("maxclients", config.max_clients.to_string()),
            ("proto-max-bulk-len", config.bulk_bytes_max.to_string()),
            ("maxmemory", config.maxmemory.to_string()),
            ("maxmemory-policy", config.maxmemory_policy.name().to_string()),
            ("maxmemory-samples", config.maxmemory_samples.to_string()),
            ("databases", "1".into()),
            ("save", String::new()),
            ("appendonly", "no".into()),
            ("cluster-enabled", "no".into()),
        ];
        let matched: Vec<_> = parameters
            .iter()
            .filter(|(name, _)| {
                request
                    .args()
                    .skip(2)
                    .any(|pattern| crate::glob::glob_match(&pattern.to_ascii_lowercase(), name.as_bytes()))
            })
            .collect();
        context.out.map(matched.len());
        for (name, value) in matched {
            context.out.bulk(name.as_bytes());
            context.out.bulk(value.as_bytes());
        }
    } else if is(subcommand, "set") || is(subcommand, "rewrite") {
        return Err(CommandError::Other(
            "CONFIG SET and REWRITE are not supported: edit the config file and restart".into(),
        ));
    } else {
        return Err(CommandError::UnknownSubcommand(
            String::from_utf8_lossy(subcommand).into_owned(),
            "CONFIG".into(),
        ));
    }
    Ok(())
}

fn time(context: &mut Context, _request: &Request) -> CommandResult {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    context.out.array(2);
    context.out.bulk(now.as_secs().to_string().as_bytes());
    context.out.bulk(now.subsec_micros().to_string().as_bytes());
    Ok(())
}
