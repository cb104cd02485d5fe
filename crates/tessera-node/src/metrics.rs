//! What a node's Prometheus endpoint shows (docs/OPERATIONS.md, "Prometheus
//! metrics"): the figures INFO reads, from the same sources, rendered at
//! scrape time (docs/ARCHITECTURE.md, "Observing a node").

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tessera_cluster::metrics::{counter, counters, gauge, gauges, histograms, HistogramRow, Labels};

use crate::cluster::ClusterNode;
use crate::commands::all_commands;
use crate::membership::role_name;
use crate::memory::{resident_memory, used_memory};
use crate::node_state::{NodeState, TableCounters, LATENCY_BUCKETS};

/// Reads a node's figures at each scrape.
pub struct NodeCollector {
    pub node: Arc<NodeState>,
    pub cluster: Option<Arc<ClusterNode>>,
}

impl fmt::Debug for NodeCollector {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("NodeCollector").finish_non_exhaustive()
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let node = &self.node;
        let stats = &node.stats;
        let encoder = &mut encoder;
        gauge(
            encoder,
            "tessera_uptime_seconds",
            "Seconds since the node started.",
            node.started.elapsed().as_secs(),
        )?;
        gauge(
            encoder,
            "tessera_connected_clients",
            "Client connections open.",
            stats.connected_clients.load(Ordering::Relaxed),
        )?;
        gauge(
            encoder,
            "tessera_blocked_clients",
            "Clients waiting in a blocking command.",
            node.waiters.blocked_clients(),
        )?;
        counter(
            encoder,
            "tessera_connections_received",
            "Client connections accepted.",
            stats.connections_received.load(Ordering::Relaxed),
        )?;
        counter(
            encoder,
            "tessera_connections_rejected",
            "Client connections refused (maxclients).",
            stats.connections_rejected.load(Ordering::Relaxed),
        )?;
        counter(encoder, "tessera_commands", "Commands run.", node.worker_total(|worker| &worker.commands))?;
        counter(
            encoder,
            "tessera_net_input_bytes",
            "Bytes read from clients.",
            node.worker_total(|worker| &worker.net_input_bytes),
        )?;
        counter(
            encoder,
            "tessera_net_output_bytes",
            "Bytes written to clients.",
            node.worker_total(|worker| &worker.net_output_bytes),
        )?;
        counter(
            encoder,
            "tessera_keyspace_hits",
            "Key lookups that found the key.",
            node.worker_total(|worker| &worker.keyspace_hits),
        )?;
        counter(
            encoder,
            "tessera_keyspace_misses",
            "Key lookups that did not.",
            node.worker_total(|worker| &worker.keyspace_misses),
        )?;
        counter(
            encoder,
            "tessera_expired_keys",
            "Keys removed as expired.",
            stats.expired_keys.load(Ordering::Relaxed),
        )?;
        counter(
            encoder,
            "tessera_evicted_keys",
            "Keys evicted under maxmemory.",
            stats.evicted_keys.load(Ordering::Relaxed),
        )?;
        let used = used_memory();
        gauge(encoder, "tessera_memory_used_bytes", "Bytes allocated by the node.", used)?;
        gauge(encoder, "tessera_memory_resident_bytes", "The process's resident set.", resident_memory())?;
        gauge(
            encoder,
            "tessera_memory_peak_bytes",
            "The most bytes allocated so far.",
            node.memory_peak(used),
        )?;
        gauge(encoder, "tessera_maxmemory_bytes", "maxmemory (0: no limit).", node.settings.maxmemory())?;
        let (system, user) = crate::gauges::cpu_seconds();
        counters(
            encoder,
            "tessera_cpu_seconds",
            "CPU time the process used.",
            [(vec![("mode", "system")], system), (vec![("mode", "user")], user)],
        )?;
        self.encode_commands(encoder)?;
        self.encode_keys(encoder)?;
        if let Some(cluster) = &self.cluster {
            encode_groups(encoder, cluster)?;
        }
        Ok(())
    }
}

impl NodeCollector {
    /// Calls, failures, refusals and latency by command, for the commands
    /// that ran at least once.
    fn encode_commands(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let names: Vec<&str> = all_commands().map(|spec| spec.name).collect();
        let totals = self.node.command_totals();
        let labels = |index: usize| -> Labels { vec![("command", names[index].to_string())] };
        counters(
            encoder,
            "tessera_command_calls",
            "Commands run, by command.",
            totals.iter().map(|(index, total)| (labels(*index), total.calls)),
        )?;
        counters(
            encoder,
            "tessera_command_errors",
            "Commands that ran and answered an error, by command.",
            totals.iter().map(|(index, total)| (labels(*index), total.failed)),
        )?;
        counters(
            encoder,
            "tessera_command_rejected",
            "Commands refused before they ran (arity, permission, a busy script ...), by command.",
            totals.iter().map(|(index, total)| (labels(*index), total.rejected)),
        )?;
        let tables = self.node.table_totals();
        let table = |counted: &TableCounters| -> Labels { vec![("table", counted.table.clone())] };
        counters(
            encoder,
            "tessera_table_commands",
            "Commands run on keys of each table (by their first key), here.",
            tables.iter().map(|counted| (table(counted), counted.calls)),
        )?;
        counters(
            encoder,
            "tessera_table_command_errors",
            "Commands on keys of each table that ran and answered an error.",
            tables.iter().map(|counted| (table(counted), counted.failed)),
        )?;
        histograms(
            encoder,
            "tessera_command_duration_seconds",
            "Time to run a command, by command.",
            totals.iter().filter(|(_, total)| total.latency.iter().any(|count| *count > 0)).map(
                |(index, total)| {
                    // Bucket i counts calls under 2^i µs; the last also every longer one.
                    let buckets = (0..LATENCY_BUCKETS)
                        .map(|bucket| {
                            let bound = if bucket + 1 == LATENCY_BUCKETS {
                                f64::INFINITY
                            } else {
                                (1u64 << bucket) as f64 / 1e6
                            };
                            (bound, total.latency[bucket])
                        })
                        .collect();
                    HistogramRow { labels: labels(*index), sum: total.nanos as f64 / 1e9, buckets }
                },
            ),
        )
    }

    /// A node of its own: each table's keys. (A cluster node reports its
    /// groups' instead.)
    fn encode_keys(&self, encoder: &mut DescriptorEncoder) -> fmt::Result {
        let census = self.node.census.lock().total();
        gauge(
            encoder,
            "tessera_expiring_keys",
            "Keys with a time to live, at the expiry sweep's last pass.",
            census.expiring,
        )?;
        let keyspaces = self.node.census.lock().by_keyspace();
        if self.cluster.is_some() {
            // A cluster node's keyspaces are the groups it heads, `table@group`.
            let rows = keyspaces.iter().filter_map(|(name, count)| {
                let (table, group) = name.rsplit_once('@')?;
                Some((vec![("group", group.to_string()), ("table", table.to_string())], count.bytes))
            });
            return gauges(
                encoder,
                "tessera_group_bytes",
                "Bytes of the keys in each group this node heads, as MEMORY USAGE estimates them, at the expiry sweep's last pass.",
                rows,
            );
        }
        let tables = self.node.tables();
        let tables = tables.by_name();
        let bytes_of = |name: &str| {
            keyspaces.iter().find(|(keyspace, _)| keyspace == name).map(|(_, count)| count.bytes)
        };
        gauges(
            encoder,
            "tessera_table_bytes",
            "Bytes of the keys in each table, as MEMORY USAGE estimates them, at the expiry sweep's last pass.",
            tables.iter().filter_map(|table| {
                let labels =
                    vec![("table", table.def.name.clone()), ("engine", table.spec.kind.name().to_string())];
                Some((labels, bytes_of(&table.def.name)?))
            }),
        )?;
        let rows: Vec<(Labels, u64)> = tables
            .iter()
            .map(|table| {
                let keys = table.reserved.keys_in(table.engine.as_ref()).unwrap_or(0);
                (
                    vec![("table", table.def.name.clone()), ("engine", table.spec.kind.name().to_string())],
                    keys,
                )
            })
            .collect();
        gauges(encoder, "tessera_table_keys", "Keys in each table.", rows)?;
        let engine_stats: Vec<(Labels, u64)> = tables
            .iter()
            .flat_map(|table| {
                table.engine.stats().into_iter().map(|(name, value)| {
                    (vec![("table", table.def.name.clone()), ("figure", name.to_string())], value)
                })
            })
            .collect();
        gauges(
            encoder,
            "tessera_engine_figure",
            "What each table's engine counts of itself (TABLE.INFO).",
            engine_stats,
        )
    }
}

/// Each replica group this node runs: its place, progress and lease.
fn encode_groups(encoder: &mut DescriptorEncoder, cluster: &ClusterNode) -> fmt::Result {
    let agent = &cluster.agent;
    let groups = agent.group_states();
    let map = agent.routing().map(|routing| routing.map);
    let table_of = |shard: u32| {
        map.as_ref().and_then(|map| map.shard(shard)).map(|shard| shard.table.clone()).unwrap_or_default()
    };
    let labels = |shard: u32| -> Labels { vec![("group", shard.to_string()), ("table", table_of(shard))] };
    gauge(
        encoder,
        "tessera_cluster_epoch",
        "The cluster map's epoch this node knows.",
        map.as_ref().map_or(0, |map| map.epoch),
    )?;
    gauges(
        encoder,
        "tessera_group_info",
        "Each group this node runs: its role here and its mode (always 1).",
        groups.iter().map(|group| {
            let mut labels = labels(group.shard);
            labels.push(("role", role_name(group.role).to_string()));
            labels.push(("mode", group.mode.to_string()));
            (labels, 1)
        }),
    )?;
    gauges(
        encoder,
        "tessera_group_view",
        "The view number this replica runs in.",
        groups.iter().map(|group| (labels(group.shard), group.view)),
    )?;
    gauges(
        encoder,
        "tessera_group_applied_writes",
        "The highest write sequence number applied here (commits).",
        groups.iter().map(|group| (labels(group.shard), group.applied)),
    )?;
    gauges(
        encoder,
        "tessera_group_keys",
        "Live keys in the group's copy here.",
        groups.iter().map(|group| (labels(group.shard), group.live_keys)),
    )?;
    gauges(
        encoder,
        "tessera_group_lease_remaining_seconds",
        "How long this replica may still act alone without hearing from the coordinator.",
        groups.iter().map(|group| (labels(group.shard), group.lease_remaining_ms as f64 / 1000.0)),
    )?;
    gauges(
        encoder,
        "tessera_group_draining",
        "1 while the group switches modes or cuts a migration over.",
        groups.iter().map(|group| (labels(group.shard), u32::from(group.draining))),
    )?;
    gauges(
        encoder,
        "tessera_group_waiting_requests",
        "Client requests waiting for the group's protocol.",
        groups.iter().map(|group| (labels(group.shard), group.waiting_requests)),
    )?;
    let lags: Vec<_> =
        groups.iter().filter_map(|group| group.replication_lag.map(|lag| (group.shard, lag))).collect();
    gauges(
        encoder,
        "tessera_group_replication_lag_writes",
        "Writes taken here that another member is not known to hold (heads, primaries, active-active members).",
        lags.iter().map(|(shard, lag)| (labels(*shard), lag.writes)),
    )?;
    gauges(
        encoder,
        "tessera_group_replication_lag_seconds",
        "How long ago the oldest of those writes was taken (to within a tick).",
        lags.iter().map(|(shard, lag)| (labels(*shard), lag.oldest_ms as f64 / 1000.0)),
    )?;
    gauges(
        encoder,
        "tessera_group_migration_sent_bytes",
        "Bytes a migration out of this group has streamed so far.",
        groups
            .iter()
            .filter_map(|group| group.migration.as_ref().map(|report| (labels(group.shard), report.bytes))),
    )?;
    gauge(
        encoder,
        "tessera_replication_buffer_bytes",
        "Bytes of messages waiting to go to peers.",
        agent.replication_buffer_bytes(),
    )
}
