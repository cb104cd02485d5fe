//! Server commands: INFO, COMMAND, CONFIG GET, TIME, WAIT.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use tessera_cluster::Shard;
use tessera_protocol::Role;
use tessera_wire::Request;

use super::{all_commands, command_info, docs, is, lookup, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::gauges::cpu_seconds as total_cpu_seconds;
use crate::membership::role_name;
use crate::memory::{
    human_bytes, parse_size, resident_memory, total_system_memory, used_memory, EvictionPolicy,
};
use crate::pubsub::Kind;
use crate::tables::escape_prefix;
use crate::typed::parse_i64;
use crate::REDIS_COMPATIBLE_VERSION;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "info", arity: -1, flags: &["loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: info },
    CommandSpec { name: "command", arity: -1, flags: &["loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: command },
    CommandSpec { name: "config", arity: -2, flags: &["admin", "loading", "stale", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: config },
    CommandSpec { name: "time", arity: 1, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: time },
    CommandSpec { name: "wait", arity: 3, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: wait },
];

/// How often a WAIT that is short of replicas looks again.
const WAIT_RECHECK: std::time::Duration = std::time::Duration::from_millis(2);

/// INFO [section ...]: the sections Redis tools read, in Redis's format and
/// field names, plus Tessera's tables and replica groups.
fn info(context: &mut Context, request: &Request) -> CommandResult {
    let wanted: Vec<String> =
        request.args().skip(1).map(|section| String::from_utf8_lossy(section).to_ascii_lowercase()).collect();
    let include = |section: &str| {
        // Per-command sections are left out of the default, as in Redis.
        let by_default = !matches!(section, "commandstats" | "latencystats");
        wanted.iter().any(|name| name == section || name == "all" || name == "everything")
            || (by_default && (wanted.is_empty() || wanted.iter().any(|name| name == "default")))
    };
    let node = context.node;
    let stats = &node.stats;
    let mut text = String::new();
    if include("server") {
        let uptime = node.started.elapsed().as_secs();
        let _ = write!(
            text,
            "# Server\r\nredis_version:{REDIS_COMPATIBLE_VERSION}\r\ntessera_version:{}\r\nredis_mode:{}\r\n\
             os:{}\r\narch_bits:64\r\nprocess_id:{}\r\nrun_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{uptime}\r\n\
             uptime_in_days:{}\r\nhz:{}\r\nexecutable:tessera\r\n\r\n",
            env!("CARGO_PKG_VERSION"),
            if context.cluster.is_some() { "cluster" } else { "standalone" },
            std::env::consts::OS,
            std::process::id(),
            node.run_id,
            node.config.port,
            uptime / 86400,
            (1000 / node.config.expiry_sweep_interval_ms.max(1)).max(1),
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
        let (used, resident, limit) = (used_memory(), resident_memory(), node.settings.maxmemory());
        let peak = node.memory_peak(used);
        let system = total_system_memory();
        let _ = write!(
            text,
            "# Memory\r\nused_memory:{used}\r\nused_memory_human:{}\r\nused_memory_rss:{resident}\r\n\
             used_memory_rss_human:{}\r\nused_memory_peak:{peak}\r\nused_memory_peak_human:{}\r\n\
             total_system_memory:{system}\r\ntotal_system_memory_human:{}\r\nmaxmemory:{limit}\r\n\
             maxmemory_human:{}\r\nmaxmemory_policy:{}\r\nmem_fragmentation_ratio:{:.2}\r\n\r\n",
            human_bytes(used as u64),
            human_bytes(resident),
            human_bytes(peak as u64),
            human_bytes(system),
            human_bytes(limit),
            node.settings.maxmemory_policy().name(),
            resident as f64 / used.max(1) as f64,
        );
    }
    if include("persistence") {
        // No AOF: what a persistent engine writes is its own log, counted in
        // the Tables section. The RDB fields are SAVE's and BGSAVE's.
        let (running, last_failed, writes_at_last_save) = node.backups.status();
        let now_secs = crate::clock::now_ms() / 1000;
        let current_secs =
            running.as_ref().map_or(-1, |job| now_secs.saturating_sub(job.started_unix_ms / 1000) as i64);
        let _ = write!(
            text,
            "# Persistence\r\nloading:0\r\nasync_loading:0\r\nrdb_changes_since_last_save:{}\r\n\
             rdb_bgsave_in_progress:{}\r\nrdb_last_save_time:{}\r\nrdb_last_bgsave_status:{}\r\n\
             rdb_current_bgsave_time_sec:{current_secs}\r\n\
             aof_enabled:0\r\naof_rewrite_in_progress:0\r\naof_last_write_status:ok\r\n\r\n",
            node.worker_total(|worker| &worker.writes).saturating_sub(writes_at_last_save),
            u8::from(running.is_some()),
            node.backups.last_success_unix(),
            if last_failed { "err" } else { "ok" },
        );
    }
    if include("stats") {
        let rates = node.rates.lock().per_second();
        let _ = write!(
            text,
            "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n\
             instantaneous_ops_per_sec:{}\r\ntotal_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\n\
             instantaneous_input_kbps:{:.2}\r\ninstantaneous_output_kbps:{:.2}\r\nrejected_connections:{}\r\n\
             expired_keys:{}\r\nevicted_keys:{}\r\nkeyspace_hits:{}\r\nkeyspace_misses:{}\r\n\
             pubsub_channels:{}\r\npubsub_patterns:{}\r\nlatest_fork_usec:0\r\n\
             disk_reads_fetched:{}\r\ndisk_reads_in_flight:{}\r\n\r\n",
            stats.connections_received.load(Ordering::Relaxed),
            node.worker_total(|worker| &worker.commands),
            rates.commands.round() as u64,
            node.worker_total(|worker| &worker.net_input_bytes),
            node.worker_total(|worker| &worker.net_output_bytes),
            rates.input_bytes / 1024.0,
            rates.output_bytes / 1024.0,
            stats.connections_rejected.load(Ordering::Relaxed),
            stats.expired_keys.load(Ordering::Relaxed),
            stats.evicted_keys.load(Ordering::Relaxed),
            node.worker_total(|worker| &worker.keyspace_hits),
            node.worker_total(|worker| &worker.keyspace_misses),
            node.pubsub.channels(Kind::Channel, None).len(),
            node.pubsub.patterns(),
            node.disk_reads.fetched.load(Ordering::Relaxed),
            node.disk_reads.in_flight(),
        );
    }
    if include("replication") {
        text.push_str(&replication(context));
    }
    if include("cpu") {
        let (system, user) = total_cpu_seconds();
        let _ = write!(
            text,
            "# CPU\r\nused_cpu_sys:{system:.6}\r\nused_cpu_user:{user:.6}\r\nused_cpu_sys_children:0.000000\r\n\
             used_cpu_user_children:0.000000\r\n\r\n"
        );
    }
    if include("commandstats") || include("latencystats") {
        let totals = node.command_totals();
        let names: Vec<&str> = all_commands().map(|spec| spec.name).collect();
        if include("commandstats") {
            text.push_str("# Commandstats\r\n");
            for (index, total) in &totals {
                let per_call = total.nanos as f64 / 1000.0 / total.calls.max(1) as f64;
                let _ = write!(
                    text,
                    "cmdstat_{}:calls={},usec={},usec_per_call={per_call:.2},rejected_calls={},failed_calls={}\r\n",
                    names[*index],
                    total.calls,
                    total.nanos / 1000,
                    total.rejected,
                    total.failed
                );
            }
            text.push_str("\r\n");
        }
        if include("latencystats") {
            text.push_str("# Latencystats\r\n");
            for (index, total) in
                totals.iter().filter(|(_, total)| total.latency.iter().any(|count| *count > 0))
            {
                let [p50, p99, p999] =
                    [0.5, 0.99, 0.999].map(|quantile| total.latency_quantile_micros(quantile));
                let _ = write!(
                    text,
                    "latency_percentiles_usec_{}:p50={p50}.000,p99={p99}.000,p99.9={p999}.000\r\n",
                    names[*index]
                );
            }
            text.push_str("\r\n");
        }
    }
    if include("cluster") {
        let _ = write!(text, "# Cluster\r\ncluster_enabled:{}\r\n\r\n", u8::from(context.cluster.is_some()));
    }
    let tables = context.tables.by_name();
    // Each table's keys, counted once for both sections that show them.
    let mut table_keys = Vec::new();
    if include("tables") || (include("keyspace") && context.cluster.is_none()) {
        for table in &tables {
            table_keys.push(table.reserved.keys_in(table.engine.as_ref())?);
        }
    }
    if include("keyspace") {
        // A cluster node counts the shards it heads (as DBSIZE does), by the
        // expiry sweep's last pass over each; a node of its own counts its
        // tables' keys now. Keys with a time to live are the sweep's count.
        let census = node.census.lock().total();
        let keys = match context.cluster {
            Some(_) => census.keys,
            None => table_keys.iter().sum(),
        };
        text.push_str("# Keyspace\r\n");
        if keys > 0 {
            let expires = census.expiring.min(keys);
            let average_ttl = census.ttl_ms_sum.checked_div(u128::from(census.expiring)).unwrap_or(0);
            let _ = write!(text, "db0:keys={keys},expires={expires},avg_ttl={average_ttl}\r\n");
        }
        text.push_str("\r\n");
    }
    if include("tables") {
        text.push_str("# Tables\r\n");
        let counted = node.table_totals();
        for (table, keys) in tables.iter().zip(&table_keys) {
            let (calls, failed) = counted
                .iter()
                .find(|counted| counted.table == table.def.name)
                .map_or((0, 0), |counted| (counted.calls, counted.failed));
            let _ = write!(
                text,
                "table_{}:prefix={},engine={},keys={keys},calls={calls},failed_calls={failed}\r\n",
                table.def.name,
                escape_prefix(&table.prefix),
                table.spec.kind.name(),
            );
        }
        text.push_str("\r\n");
    }
    context.out.verbatim(&text);
    Ok(())
}

/// INFO's Replication section. A node of its own is a master with no
/// replicas. A cluster node heads some groups and is a member of others: it
/// reports `role:master` if it heads any (with their other members as its
/// replicas), `role:slave` of the first group's head otherwise, and then a
/// line per group it holds.
fn replication(context: &Context) -> String {
    let mut text = String::from("# Replication\r\n");
    let Some(cluster) = context.cluster else {
        let _ = write!(
            text,
            "role:master\r\nconnected_slaves:0\r\nmaster_replid:{}\r\nmaster_repl_offset:0\r\n\r\n",
            context.node.run_id
        );
        return text;
    };
    let agent = &cluster.agent;
    let me = agent.node_id();
    let map = agent.routing().map(|routing| routing.map);
    let held = agent.shards();
    let groups: Vec<(&Shard, Option<Role>)> = map
        .iter()
        .flat_map(|map| map.shards.iter())
        .filter(|shard| held.contains_key(&shard.id))
        .map(|shard| (shard, agent.role(shard.id)))
        .collect();
    let heads = |role: &Option<Role>| matches!(role, Some(Role::Head | Role::Alone));
    let offset: u64 = held.values().map(|progress| progress.applied).sum();
    let address = |node: u32| {
        map.as_ref().and_then(|map| map.node(node)).map(|info| info.address.clone()).unwrap_or_default()
    };
    if groups.iter().any(|(_, role)| heads(role)) || groups.is_empty() {
        let replicas: Vec<u32> = groups
            .iter()
            .filter(|(_, role)| heads(role))
            .flat_map(|(shard, _)| shard.members.iter().chain(&shard.learners).copied())
            .filter(|member| *member != me)
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect();
        let _ = write!(text, "role:master\r\nconnected_slaves:{}\r\n", replicas.len());
        for (index, replica) in replicas.iter().enumerate() {
            let (ip, port) = split_address(&address(*replica));
            let _ = write!(text, "slave{index}:ip={ip},port={port},state=online,offset={offset},lag=0\r\n");
        }
    } else {
        let head = groups.first().and_then(|(shard, _)| shard.members.first().copied());
        let (host, port) = split_address(&head.map(address).unwrap_or_default());
        let _ = write!(
            text,
            "role:slave\r\nmaster_host:{host}\r\nmaster_port:{port}\r\nmaster_link_status:up\r\n\
             slave_repl_offset:{offset}\r\nconnected_slaves:0\r\n"
        );
    }
    let _ = write!(text, "master_replid:{}\r\nmaster_repl_offset:{offset}\r\n", context.node.run_id);
    for (shard, role) in &groups {
        let role = role_name(*role);
        let mode = map.as_ref().map(|map| map.mode_of(shard).to_string()).unwrap_or_default();
        let members: Vec<String> = shard.members.iter().map(u32::to_string).collect();
        let _ = write!(
            text,
            "group{}:table={},role={role},mode={mode},view={},members={},applied={}\r\n",
            shard.id,
            shard.table,
            shard.view_number,
            members.join("|"),
            held.get(&shard.id).map_or(0, |progress| progress.applied),
        );
    }
    text.push_str("\r\n");
    text
}

/// A node's `host:port` as INFO's separate fields.
fn split_address(address: &str) -> (String, String) {
    let (host, port) = address.rsplit_once(':').unwrap_or((address, "0"));
    (host.to_string(), port.to_string())
}

/// COMMAND, COMMAND COUNT / INFO / LIST / DOCS / GETKEYS.
fn command(context: &mut Context, request: &Request) -> CommandResult {
    let out = &mut *context.out;
    if request.len() == 1 {
        let specs: Vec<_> = all_commands().collect();
        out.array(specs.len());
        for spec in specs {
            command_info::write(out, spec);
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
                Some(spec) => command_info::write(out, spec),
                None => out.null_array(),
            }
        }
    } else if is(subcommand, "docs") {
        // Every command, or those named (names Tessera does not serve are
        // left out, as Redis leaves them).
        let specs: Vec<&CommandSpec> = match request.len() {
            2 => all_commands().collect(),
            _ => request.args().skip(2).filter_map(lookup).collect(),
        };
        out.map(specs.len());
        for spec in specs {
            docs::write(out, spec);
        }
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

/// COMMAND's subcommands and their arities.
pub const COMMAND_SUBCOMMANDS: &[(&str, i32)] =
    &[("count", 2), ("docs", -2), ("getkeys", -4), ("info", -2), ("list", -2)];

/// CONFIG's subcommands and their arities.
pub const CONFIG_SUBCOMMANDS: &[(&str, i32)] =
    &[("get", -3), ("set", -4), ("resetstat", 2), ("rewrite", 2), ("help", 2)];

/// Redis's encoding and tuning parameters, with their defaults: CONFIG SET
/// accepts them (so tools and configs written for Redis apply) and Tessera,
/// whose values have encodings of their own, ignores them. docs/OPERATIONS.md
/// lists them.
pub const ACCEPTED_AND_IGNORED: &[(&str, &str, ValueKind)] = &[
    ("hash-max-listpack-entries", "128", ValueKind::Integer),
    ("hash-max-listpack-value", "64", ValueKind::Memory),
    ("hash-max-ziplist-entries", "128", ValueKind::Integer),
    ("hash-max-ziplist-value", "64", ValueKind::Memory),
    ("set-max-intset-entries", "512", ValueKind::Integer),
    ("set-max-listpack-entries", "128", ValueKind::Integer),
    ("set-max-listpack-value", "64", ValueKind::Memory),
    ("zset-max-listpack-entries", "128", ValueKind::Integer),
    ("zset-max-listpack-value", "64", ValueKind::Memory),
    ("zset-max-ziplist-entries", "128", ValueKind::Integer),
    ("zset-max-ziplist-value", "64", ValueKind::Memory),
    ("list-max-listpack-size", "-2", ValueKind::Integer),
    ("list-max-ziplist-size", "-2", ValueKind::Integer),
    ("list-compress-depth", "0", ValueKind::Integer),
    ("stream-node-max-bytes", "4096", ValueKind::Memory),
    ("stream-node-max-entries", "100", ValueKind::Integer),
    ("hll-sparse-max-bytes", "3000", ValueKind::Memory),
    ("activerehashing", "yes", ValueKind::YesNo),
    ("lazyfree-lazy-eviction", "no", ValueKind::YesNo),
    ("lazyfree-lazy-expire", "no", ValueKind::YesNo),
    ("lazyfree-lazy-server-del", "no", ValueKind::YesNo),
    ("lazyfree-lazy-user-del", "no", ValueKind::YesNo),
    ("lazyfree-lazy-user-flush", "no", ValueKind::YesNo),
];

/// How an accepted-and-ignored parameter's value is checked.
#[derive(Clone, Copy, Debug)]
pub enum ValueKind {
    Integer,
    /// Bytes, with Redis's units (`64`, `4kb`).
    Memory,
    YesNo,
}

/// A parameter's value as CONFIG GET shows it, and whether CONFIG SET may
/// change it while the node serves.
fn parameters(context: &Context) -> Vec<(&'static str, String, bool)> {
    let (config, settings) = (&context.node.config, &context.node.settings);
    let busy_threshold = context.node.scripts.busy_threshold_ms().to_string();
    let ignored = settings.accepted_and_ignored.lock();
    let accepted = ACCEPTED_AND_IGNORED.iter().map(|(name, default, _)| {
        (*name, ignored.get(name).cloned().unwrap_or_else(|| default.to_string()), true)
    });
    let (slowlog, latency) = (&context.node.slowlog, &context.node.latency);
    vec![
        ("bind", config.bind.clone(), false),
        ("port", config.port.to_string(), false),
        ("dir", config.dir.display().to_string(), false),
        ("maxclients", config.max_clients.to_string(), false),
        ("proto-max-bulk-len", config.bulk_bytes_max.to_string(), false),
        ("maxmemory", settings.maxmemory().to_string(), true),
        ("maxmemory-policy", settings.maxmemory_policy().name().to_string(), true),
        ("maxmemory-samples", settings.maxmemory_samples().to_string(), true),
        ("timeout", settings.timeout().to_string(), true),
        ("busy-reply-threshold", busy_threshold.clone(), true),
        ("lua-time-limit", busy_threshold, true),
        ("databases", "1".into(), false),
        ("save", String::new(), false),
        ("appendonly", "no".into(), false),
        ("cluster-enabled", if context.cluster.is_some() { "yes" } else { "no" }.into(), false),
        ("slowlog-log-slower-than", slowlog.threshold_us().to_string(), true),
        ("slowlog-max-len", slowlog.max_len().to_string(), true),
        ("latency-monitor-threshold", latency.threshold_ms().to_string(), true),
    ]
    .into_iter()
    .chain(accepted)
    .collect()
}

/// Applies one CONFIG SET pair, or says what is wrong with its value.
fn set_parameter(context: &Context, name: &str, value: &str) -> Result<(), String> {
    let settings = &context.node.settings;
    let integer = |min: i64, max: i64| -> Result<i64, String> {
        let number: i64 =
            value.parse().map_err(|_| "argument couldn't be parsed into an integer".to_string())?;
        if !(min..=max).contains(&number) {
            return Err(format!("argument must be between {min} and {max} inclusive"));
        }
        Ok(number)
    };
    match name {
        "maxmemory" => settings.set_maxmemory(parse_size(value).ok_or("argument must be a memory value")?),
        "maxmemory-policy" => settings.set_maxmemory_policy(EvictionPolicy::parse(value).ok_or(
            "argument(s) must be one of the following: volatile-lru, allkeys-lru, volatile-random, \
             allkeys-random, volatile-ttl, noeviction",
        )?),
        "maxmemory-samples" => settings.set_maxmemory_samples(integer(1, i32::MAX.into())? as usize),
        "timeout" => settings.set_timeout(integer(0, i32::MAX.into())? as u64),
        "busy-reply-threshold" | "lua-time-limit" => {
            context.node.scripts.set_busy_threshold_ms(integer(0, i64::MAX)? as u64)
        }
        "slowlog-log-slower-than" => context.node.slowlog.set_threshold_us(integer(-1, i64::MAX)?),
        "slowlog-max-len" => context.node.slowlog.set_max_len(integer(0, i64::from(i32::MAX))? as usize),
        "latency-monitor-threshold" => context.node.latency.set_threshold_ms(integer(0, i64::MAX)? as u64),
        name => {
            let (name, _, kind) =
                ACCEPTED_AND_IGNORED.iter().find(|(known, _, _)| *known == name).expect("listed as settable");
            match kind {
                ValueKind::Integer if value.parse::<i64>().is_err() => {
                    return Err("argument couldn't be parsed into an integer".into())
                }
                ValueKind::Memory if parse_size(value).is_none() => {
                    return Err("argument must be a memory value".into())
                }
                ValueKind::YesNo if !matches!(value.to_ascii_lowercase().as_str(), "yes" | "no") => {
                    return Err("argument must be 'yes' or 'no'".into())
                }
                _ => {}
            }
            settings.accepted_and_ignored.lock().insert(name, value.to_ascii_lowercase());
        }
    }
    Ok(())
}

/// CONFIG GET answers for the parameters Redis tools ask about; CONFIG SET
/// changes those the node can change while it serves (memory limit and
/// policy, idle timeout, the script busy threshold), all or none of a call's.
fn config(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    if is(subcommand, "get") {
        let parameters = parameters(context);
        let matched: Vec<_> = parameters
            .iter()
            .filter(|(name, _, _)| {
                request
                    .args()
                    .skip(2)
                    .any(|pattern| crate::glob::glob_match(&pattern.to_ascii_lowercase(), name.as_bytes()))
            })
            .collect();
        context.out.map(matched.len());
        for (name, value, _) in matched {
            context.out.bulk(name.as_bytes());
            context.out.bulk(value.as_bytes());
        }
    } else if is(subcommand, "set") {
        if !request.len().is_multiple_of(2) {
            return Err(CommandError::WrongArity("config|set".into()));
        }
        let parameters = parameters(context);
        let failed = |name: &str, why: &str| {
            CommandError::Other(format!("CONFIG SET failed (possibly related to argument '{name}') - {why}"))
        };
        let mut pairs: Vec<(&'static str, String)> = Vec::new();
        for index in (2..request.len()).step_by(2) {
            let asked = String::from_utf8_lossy(request.arg(index)).to_ascii_lowercase();
            let value = String::from_utf8_lossy(request.arg(index + 1)).into_owned();
            let Some((name, current, settable)) = parameters.iter().find(|(name, _, _)| *name == asked)
            else {
                return Err(CommandError::Other(format!(
                    "Unknown option or number of arguments for CONFIG SET - '{asked}'"
                )));
            };
            if pairs.iter().any(|(seen, _)| seen == name) {
                return Err(failed(name, "duplicate parameter"));
            }
            // A fixed parameter may be "set" to what it is (tools do so).
            if !settable && *current != value {
                return Err(failed(name, "can't set immutable config"));
            }
            if *settable {
                pairs.push((name, value));
            }
        }
        // Every value is checked before any is applied.
        let saved: Vec<(&str, String)> = pairs
            .iter()
            .map(|(name, _)| (*name, parameters.iter().find(|p| p.0 == *name).expect("listed").1.clone()))
            .collect();
        for (name, value) in &pairs {
            if let Err(why) = set_parameter(context, name, value) {
                for (name, value) in &saved {
                    set_parameter(context, name, value).expect("a value it had is valid");
                }
                return Err(failed(name, &why));
            }
        }
        context.out.ok();
    } else if is(subcommand, "resetstat") {
        context.node.reset_stats();
        context.out.ok();
    } else if is(subcommand, "rewrite") {
        return Err(CommandError::Other(
            "CONFIG REWRITE is not supported: settings live in the config file given at start".into(),
        ));
    } else {
        let lines = [
            "CONFIG <subcommand>, where <subcommand> is one of:",
            "GET <pattern> [<pattern> ...] -- the parameters matching the patterns, with their values",
            "SET <parameter> <value> [<parameter> <value> ...] -- change maxmemory, maxmemory-policy,",
            "    maxmemory-samples, timeout, busy-reply-threshold (lua-time-limit), slowlog-log-slower-than,",
            "    slowlog-max-len or latency-monitor-threshold while serving; Redis's encoding parameters",
            "    are accepted and ignored",
            "RESETSTAT -- the statistics INFO shows start again from zero",
            "HELP -- this text",
        ];
        super::write_help(context, &lines);
    }
    Ok(())
}

/// WAIT numreplicas timeout: until at least `numreplicas` other members
/// hold every write this connection made (in each shard it wrote), or
/// `timeout` milliseconds (0: for ever); answers how many do. A node outside
/// a cluster has no replicas (0, as a Redis without any). In MS+SC a write
/// is answered only once every member holds it, so WAIT answers at once.
fn wait(context: &mut Context, request: &Request) -> CommandResult {
    let wanted = parse_i64(request.arg(1))?;
    let timeout_ms = parse_i64(request.arg(2))
        .map_err(|_| CommandError::Other("timeout is not an integer or out of range".into()))?;
    if timeout_ms < 0 {
        return Err(CommandError::Other("timeout is negative".into()));
    }
    let holding = match context.cluster {
        None => 0,
        Some(cluster) if context.session.written.is_empty() => cluster.agent.replicas_in_step(),
        Some(cluster) => {
            let written = &context.session.written;
            written
                .iter()
                .map(|(shard, position)| cluster.agent.replicas_holding(*shard, *position))
                .min()
                .unwrap_or(0)
        }
    };
    let timed_out = context.session.blocked.as_ref().is_some_and(|blocked| blocked.timed_out);
    if holding as i64 >= wanted || timed_out || context.session.deny_blocking {
        context.session.blocked = None;
        context.out.integer(holding as i64);
    } else if context.session.blocked.is_none() {
        context.session.blocked = Some(crate::blocking::Blocked {
            keys: Vec::new(),
            deadline: (timeout_ms > 0)
                .then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms as u64)),
            timed_out: false,
            // Outside a cluster nothing changes the count: only the deadline.
            recheck: context.cluster.map(|_| WAIT_RECHECK),
        });
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
