//! `tessera cluster`: a local cluster of processes on loopback, kept under one
//! directory.
//!
//! ```text
//! <dir>/layout.json         what `up` was asked for: ports, engine, mode, nodes
//! <dir>/cluster.secret      the cluster's secret (mode 0600)
//! <dir>/tls/                with `up --tls`: the CA and the certificate every
//!                           process presents on the cluster plane
//! <dir>/coordinator/        the coordinator's stored map
//! <dir>/nodes/<id>/         each node's data (its shards' engines)
//! <dir>/logs/<name>.log     each process's log
//! <dir>/run/<name>.pid      each running process's pid
//! ```
//!
//! The processes outlive the command that started them; every subcommand
//! works from the directory alone.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use tessera_bench::progress::Progress;
use tessera_cluster::auth::{ClusterSecret, ADMIN};
use tessera_cluster::map::{ReplicaMove, Shard};
use tessera_cluster::session::{CoordinatorSession, Credentials};
use tessera_cluster::tls::PeerTls;
use tessera_cluster::ClusterMap;
use tessera_node::memory::EvictionPolicy;
use tessera_wire::slot::key_slot;
use tessera_wire::{Client, Value};

mod design;
mod slot_balance;

/// The cluster's secret, in the cluster directory (mode 0600).
const SECRET_FILE: &str = "cluster.secret";
/// The bearer token metrics scrapes present, and a Prometheus configuration
/// that scrapes the cluster with it (`up --metrics-base-port`).
const METRICS_TOKEN_FILE: &str = "metrics.token";
const SCRAPE_CONFIG_FILE: &str = "prometheus.yml";
/// The token the dashboard's page presents (`up --dashboard-port`).
const DASHBOARD_TOKEN_FILE: &str = "dashboard.token";
/// The certificates of a cluster made with `up --tls`, as
/// [`tessera_cluster::tls::write_certificates`] writes them.
const TLS_DIR: &str = "tls";
/// How long `rebalance` and `remove-node` wait for one replica move.
const REPLICA_MOVE_WAIT: Duration = Duration::from_secs(300);
/// How long they wait for one head handover (a drain).
const HANDOVER_WAIT: Duration = Duration::from_secs(60);
/// How long a node taken out of the cluster keeps answering (MOVED) at most
/// before it is stopped, while clients still send it requests.
const REMOVED_NODE_GRACE: Duration = Duration::from_secs(10);
/// In a `--tls` cluster, node i's TLS client port is its client port plus this.
const TLS_PORT_OFFSET: u16 = 20_000;

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Start a coordinator and nodes as processes, wait until every slot is
    /// served, show a short demo and how to connect. On an existing directory,
    /// starts whatever is not running.
    Up(UpArgs),
    /// Nodes, roles, shards, views, liveness and per-node operations per second.
    Status(DirArgs),
    /// Kill a node (kill -9) by id, or the coordinator.
    Kill(TargetArgs),
    /// Stop a node (or the coordinator) if it runs, and start it again.
    Restart(TargetArgs),
    /// Add a standby node; it joins the first shard short of replicas.
    AddStandby(DirArgs),
    /// Start new nodes and add them to the cluster (then `rebalance` gives
    /// them replicas).
    AddNode(AddNodeArgs),
    /// Move group replicas from the nodes that hold the most to those that
    /// hold the fewest, one at a time, until every node holds as many as any
    /// other, give or take one; then hand heads over likewise, so that every
    /// node heads as many groups as any other, give or take one. With --by,
    /// move slots between groups instead, until the groups hold as many keys
    /// or bytes, or serve as much, as each other. Safe to interrupt and run
    /// again.
    Rebalance(RebalanceArgs),
    /// Move every replica off a node, then take it out of the cluster and
    /// stop it: no failure, no failover wait.
    RemoveNode(TargetArgs),
    /// Move slots from one group (shard) to another while both serve, and
    /// show the copy's progress until the slots have moved. Interrupting
    /// leaves the move running; run again with the same arguments to follow
    /// it, or with --cancel to stop it.
    MoveSlots(MoveSlotsArgs),
    /// Stop every process (data stays in the directory).
    Down(DirArgs),
}

#[derive(Args)]
pub struct DirArgs {
    /// The cluster's directory.
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct RebalanceArgs {
    /// Move slots between groups to even out what they hold or serve:
    /// keys, bytes, or load (request and reply bytes over --window).
    #[arg(long, value_enum)]
    by: Option<slot_balance::Weight>,
    /// With --by load: how many seconds to measure the load over.
    #[arg(long, default_value_t = 5)]
    window: u64,
    /// With --by: stop once the heaviest and the lightest group differ by at
    /// most this percentage of the mean.
    #[arg(long, default_value_t = 10)]
    threshold: u64,
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct AddNodeArgs {
    /// How many nodes to add.
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct MoveSlotsArgs {
    /// The group the slots leave (a shard id, as `cluster status` shows).
    from: u32,
    /// The group they join (a shard of the same table).
    to: u32,
    /// Slots as FIRST-LAST ranges or single slots.
    #[arg(required = true)]
    slots: Vec<String>,
    /// Cancel the move under way between the two groups instead.
    #[arg(long)]
    cancel: bool,
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct TargetArgs {
    /// A node id, or `coordinator`.
    target: String,
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
}

#[derive(Args)]
pub struct UpArgs {
    #[arg(long, default_value = "tessera-cluster")]
    dir: PathBuf,
    /// A cluster described in a TOML file (the dashboard's designer writes
    /// them): its keys override these flags, and its tables are created
    /// once the cluster serves.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Nodes that serve from the start.
    #[arg(long, default_value_t = 6)]
    nodes: u32,
    /// Replica groups (shards) splitting the slots, spread over the nodes
    /// (each node heads about groups / nodes) [default: four per node].
    #[arg(long)]
    groups: Option<usize>,
    /// Copies of each shard.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// ms (master–slave) or aa (active–active).
    #[arg(long, default_value = "ms")]
    topology: String,
    /// strong or eventual (ms: chain replication or primary–backup; aa:
    /// multi-master, last writer wins); with --datacenters, a causal
    /// protocol: geo-eventual, cops, gentle-rain or causal-spartan.
    #[arg(long, default_value = "strong")]
    consistency: String,
    /// Lay the nodes out across this many datacenters, each a whole copy
    /// partitioned over its nodes (--nodes must split evenly; --replicas and
    /// --groups do not apply): clients of a node stay in its datacenter.
    #[arg(long)]
    datacenters: Option<usize>,
    /// With --datacenters, a test and benchmark option: messages between
    /// nodes of different datacenters arrive this much later (one way).
    #[arg(long, default_value_t = 0, requires = "datacenters")]
    datacenter_delay_ms: u64,
    /// Each node's limit on one snapshot stream (a joining replica's, a
    /// migration's, a backup's), as `serve --snapshot-rate`.
    #[arg(long, value_parser = crate::parse_maxmemory)]
    snapshot_rate: Option<u64>,
    /// A test and benchmark option: the clocks of odd-numbered nodes run
    /// this many milliseconds ahead of the others' (clock skew on one machine).
    #[arg(long, default_value_t = 0)]
    clock_skew_ms: u64,
    /// Each node's engine: memory, ordered, log or lsm.
    #[arg(long, default_value = "memory")]
    engine: String,
    /// The coordinator listens here; node i on base-port + 1 + i (peers on +10000).
    #[arg(long, default_value_t = 7000)]
    base_port: u16,
    /// Worker threads per node.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    #[arg(long, default_value_t = 1000)]
    lease_ms: u64,
    #[arg(long, default_value_t = 1500)]
    failure_timeout_ms: u64,
    /// Run the cluster plane (peer links and coordinator sessions) in
    /// mutual TLS, with a CA and certificates made in <dir>/tls, and give
    /// each node a TLS client port (its port + 20000) beside its plain one.
    #[arg(long)]
    tls: bool,
    /// Each node's maxmemory (bytes, or a number with kb, mb, gb); past it,
    /// writes evict keys or are refused [default: none].
    #[arg(long, value_parser = crate::parse_maxmemory)]
    maxmemory: Option<u64>,
    /// What a write past maxmemory does (as `serve --maxmemory-policy`).
    #[arg(long, value_parser = crate::parse_eviction_policy)]
    maxmemory_policy: Option<EvictionPolicy>,
    /// Serve Prometheus metrics: the coordinator's on this port, node i's
    /// on this + 1 + i, each answering scrapes that present the bearer token
    /// in <dir>/metrics.token; <dir>/prometheus.yml scrapes them all.
    #[arg(long)]
    metrics_base_port: Option<u16>,
    /// Serve the coordinator's web dashboard on this port; its token is in
    /// <dir>/dashboard.token, and `up` prints the page's address with it.
    #[arg(long)]
    dashboard_port: Option<u16>,
    /// Skip the demo of writes and reads.
    #[arg(long)]
    no_demo: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Layout {
    cluster_id: String,
    host: String,
    coordinator_port: u16,
    /// Node id → client port, in id order.
    nodes: Vec<(u32, u16)>,
    replicas: usize,
    /// Replica groups; `None`: the coordinator's default, four per node.
    #[serde(default)]
    groups: Option<usize>,
    #[serde(default = "master_slave")]
    topology: String,
    consistency: String,
    /// Laid out across datacenters (`up --datacenters`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    datacenters: Option<usize>,
    /// The delay injected between datacenters (`up --datacenter-delay-ms`).
    #[serde(default)]
    datacenter_delay_ms: u64,
    /// How far the clocks of odd-numbered nodes run ahead (`up --clock-skew-ms`).
    #[serde(default)]
    clock_skew_ms: u64,
    /// Each node's snapshot stream limit (`up --snapshot-rate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot_rate: Option<u64>,
    engine: String,
    threads: usize,
    lease_ms: u64,
    failure_timeout_ms: u64,
    /// The cluster plane runs in mutual TLS (`up --tls`).
    #[serde(default)]
    tls: bool,
    /// Each node's maxmemory in bytes, and its policy's name.
    #[serde(default)]
    maxmemory: Option<u64>,
    #[serde(default)]
    maxmemory_policy: Option<String>,
    /// Where metrics are served (`up --metrics-base-port`): the coordinator
    /// on this port, each node this far above it as its client port is.
    #[serde(default)]
    metrics_base_port: Option<u16>,
    /// Where the coordinator serves its dashboard (`up --dashboard-port`).
    #[serde(default)]
    dashboard_port: Option<u16>,
}

fn master_slave() -> String {
    "ms".into()
}

impl Layout {
    fn path(dir: &Path) -> PathBuf {
        dir.join("layout.json")
    }

    fn load(dir: &Path) -> Result<Self, String> {
        let path = Self::path(dir);
        let text = fs::read_to_string(&path)
            .map_err(|error| format!("no cluster in {} ({}: {error})", dir.display(), path.display()))?;
        serde_json::from_str(&text).map_err(|error| format!("{}: {error}", path.display()))
    }

    fn save(&self, dir: &Path) -> Result<(), String> {
        let path = Self::path(dir);
        let temporary = path.with_extension("tmp");
        let text = serde_json::to_string_pretty(self).map_err(|error| error.to_string())?;
        fs::write(&temporary, text)
            .and_then(|()| fs::rename(&temporary, &path))
            .map_err(|error| format!("{}: {error}", path.display()))
    }

    fn coordinator_address(&self) -> String {
        format!("{}:{}", self.host, self.coordinator_port)
    }

    fn node_address(&self, port: u16) -> String {
        format!("{}:{port}", self.host)
    }

    /// The metrics port of the process whose client port is `port`.
    fn metrics_port(&self, port: u16) -> Option<u16> {
        self.metrics_base_port.map(|base| base + (port - self.coordinator_port))
    }

    fn port_of(&self, node: u32) -> Result<u16, String> {
        self.nodes
            .iter()
            .find(|(id, _)| *id == node)
            .map(|(_, port)| *port)
            .ok_or_else(|| format!("no node {node} in this cluster"))
    }
}

pub fn run(command: ClusterCommand) -> Result<(), String> {
    // Printing into a closed pipe (`tessera cluster status | head`) ends the
    // command quietly, as for other Unix tools, instead of panicking.
    // SAFETY: restoring a signal's default disposition has no memory effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match command {
        ClusterCommand::Up(args) => up(args),
        ClusterCommand::Status(args) => status(&args.dir),
        ClusterCommand::Kill(args) => {
            let layout = Layout::load(&args.dir)?;
            let name = process_name(&layout, &args.target)?;
            match running_pid(&args.dir, &name) {
                Some(pid) => {
                    signal(pid, libc::SIGKILL)?;
                    let _ = fs::remove_file(pid_path(&args.dir, &name));
                    println!("killed {name} (pid {pid})");
                    Ok(())
                }
                None => Err(format!("{name} is not running")),
            }
        }
        ClusterCommand::Restart(args) => {
            let layout = Layout::load(&args.dir)?;
            let name = process_name(&layout, &args.target)?;
            stop(&args.dir, &name, Duration::from_secs(10))?;
            start(&args.dir, &layout, &name)?;
            println!("restarted {name}");
            Ok(())
        }
        ClusterCommand::AddStandby(args) => add_standby(&args.dir),
        ClusterCommand::AddNode(args) => {
            for _ in 0..args.count {
                add_standby(&args.dir)?;
            }
            println!("run `tessera cluster rebalance --dir {}` to give them replicas", args.dir.display());
            Ok(())
        }
        ClusterCommand::Rebalance(args) => match args.by {
            None => rebalance(&args.dir),
            Some(weight) => slot_balance::rebalance_slots(&args.dir, weight, args.window, args.threshold),
        },
        ClusterCommand::RemoveNode(args) => remove_node(&args.dir, &args.target),
        ClusterCommand::MoveSlots(args) => move_slots(&args),
        ClusterCommand::Down(args) => down(&args.dir),
    }
}

/// `args` with what the design file, if any, says in place of the flags.
fn apply_design(mut args: UpArgs) -> Result<(UpArgs, Vec<design::DesignedTable>), String> {
    let Some(path) = &args.config else { return Ok((args, Vec::new())) };
    let design = design::Design::load(path)?;
    macro_rules! take {
        ($($field:ident),*) => { $( if let Some(value) = design.$field { args.$field = value; } )* };
    }
    macro_rules! take_optional {
        ($($field:ident),*) => { $( if design.$field.is_some() { args.$field = design.$field; } )* };
    }
    take!(nodes, replicas, topology, consistency, engine, base_port, threads, lease_ms, failure_timeout_ms);
    take_optional!(groups, datacenters, metrics_base_port, dashboard_port);
    Ok((args, design.tables))
}

/// Creates the designed tables that do not exist yet, through one node.
fn create_tables(layout: &Layout, tables: &[design::DesignedTable]) -> Result<(), String> {
    let Some((_, port)) = layout.nodes.first() else { return Ok(()) };
    let mut client = Client::connect(layout.node_address(*port), Duration::from_secs(30))
        .map_err(|error| error.to_string())?;
    for table in tables {
        let existing =
            client.command(&["TABLE.INFO", table.name.as_str()]).map_err(|error| error.to_string())?;
        if !matches!(existing, Value::Error(_)) {
            continue;
        }
        for command in table.commands() {
            if let Value::Error(message) = client.command(&command).map_err(|error| error.to_string())? {
                return Err(format!("table {}: {}: {message}", table.name, command.join(" ")));
            }
        }
        println!("table {} (prefix {}): engine {}", table.name, table.prefix, table.engine);
    }
    Ok(())
}

fn up(args: UpArgs) -> Result<(), String> {
    let (args, tables) = apply_design(args)?;
    let dir = &args.dir;
    let layout = match Layout::load(dir) {
        Ok(layout) => {
            println!("resuming the cluster in {} (its layout.json wins over flags)", dir.display());
            layout
        }
        Err(_) => {
            let replicas = match args.datacenters {
                Some(datacenters) => {
                    tessera_protocol::Mode::causal(&args.consistency)?;
                    if datacenters < 2 || !(args.nodes as usize).is_multiple_of(datacenters) {
                        return Err(format!(
                            "--datacenters {datacenters}: at least 2, and --nodes ({}) must split evenly into them",
                            args.nodes
                        ));
                    }
                    datacenters
                }
                None => {
                    tessera_protocol::Mode::for_table(&args.topology, &args.consistency)?;
                    args.replicas
                }
            };
            if !["memory", "ordered", "log", "lsm"].contains(&args.engine.as_str()) {
                return Err(format!(
                    "engine {:?} cannot back a cluster; choose memory, ordered, log or lsm",
                    args.engine
                ));
            }
            if args.nodes == 0 || replicas == 0 || (args.nodes as usize) < replicas {
                return Err(format!("{} nodes cannot keep {replicas} replicas of each shard", args.nodes));
            }
            if args.clock_skew_ms > tessera_node::config::CLOCK_AHEAD_MAX_MS {
                return Err(format!("--clock-skew-ms: at most {}", tessera_node::config::CLOCK_AHEAD_MAX_MS));
            }
            if args.groups.is_some_and(|groups| groups == 0 || groups > tessera_wire::slot::SLOTS) {
                return Err(format!("--groups: between 1 and {}", tessera_wire::slot::SLOTS));
            }
            let last_port = u32::from(args.base_port) + args.nodes + 10_000;
            if last_port > u32::from(u16::MAX) {
                return Err("--base-port too high: nodes need port + 10000 for their peers".into());
            }
            // Room for the nodes' metrics ports, and for a few standbys.
            if args
                .metrics_base_port
                .is_some_and(|base| u32::from(base) + args.nodes + 8 > u32::from(u16::MAX))
            {
                return Err("--metrics-base-port too high for this many nodes".into());
            }
            if args.tls && last_port - 10_000 + u32::from(TLS_PORT_OFFSET) > u32::from(u16::MAX) {
                return Err(
                    "--base-port too high: with --tls, nodes need port + 20000 for TLS clients".into()
                );
            }
            let layout = Layout {
                cluster_id: format!("tessera-{}", std::process::id()),
                host: "127.0.0.1".into(),
                coordinator_port: args.base_port,
                nodes: (0..args.nodes).map(|id| (id, args.base_port + 1 + id as u16)).collect(),
                replicas,
                groups: args.groups.filter(|_| args.datacenters.is_none()),
                topology: args.topology.clone(),
                consistency: args.consistency.clone(),
                datacenters: args.datacenters,
                datacenter_delay_ms: args.datacenter_delay_ms,
                clock_skew_ms: args.clock_skew_ms,
                snapshot_rate: args.snapshot_rate,
                engine: args.engine.clone(),
                threads: args.threads,
                lease_ms: args.lease_ms,
                failure_timeout_ms: args.failure_timeout_ms,
                tls: args.tls,
                maxmemory: args.maxmemory,
                maxmemory_policy: args.maxmemory_policy.map(|policy| policy.name().to_string()),
                metrics_base_port: args.metrics_base_port,
                dashboard_port: args.dashboard_port,
            };
            fs::create_dir_all(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
            layout.save(dir)?;
            layout
        }
    };
    // A cluster made before clusters had secrets gets one as it resumes.
    if !dir.join(SECRET_FILE).exists() {
        ClusterSecret::generate().save(&dir.join(SECRET_FILE)).map_err(|error| error.to_string())?;
    }
    if layout.tls && !dir.join(TLS_DIR).join("ca.crt").exists() {
        tessera_cluster::tls::write_certificates(&dir.join(TLS_DIR), std::slice::from_ref(&layout.host))?;
    }
    write_scrape_config(dir, &layout)?;
    let dashboard_token = match layout.dashboard_port {
        Some(_) => Some(ensure_token(&dir.join(DASHBOARD_TOKEN_FILE))?),
        None => None,
    };
    let started = Instant::now();
    for name in
        std::iter::once("coordinator".to_string()).chain(layout.nodes.iter().map(|(id, _)| node_name(*id)))
    {
        if running_pid(dir, &name).is_none() {
            start(dir, &layout, &name)?;
        }
    }
    let map = wait_until_served(&layout, dir, Duration::from_secs(60))?;
    println!(
        "cluster {} is serving: {} nodes, {} shards, {} ({} replicas), engine {}, ready in {:.1} s",
        map.cluster_id,
        map.nodes.len(),
        map.slot_shards().count(),
        map.mode.label(),
        map.replicas,
        layout.engine,
        started.elapsed().as_secs_f64()
    );
    if layout.tls {
        let certificates = dir.join(TLS_DIR);
        println!(
            "peer links and coordinator sessions run in mutual TLS (certificates in {})",
            certificates.display()
        );
        let first = layout.nodes.first().map(|(_, port)| *port + TLS_PORT_OFFSET).unwrap_or_default();
        let file = |name: &str| certificates.join(name).display().to_string();
        println!(
            "tls:      redis-cli -c --tls --cacert {} --cert {} --key {} -p {first}",
            file("ca.crt"),
            file("server.crt"),
            file("server.key")
        );
    }
    create_tables(&layout, &tables)?;
    if !args.no_demo {
        demo(&layout, &map)?;
    }
    let first = layout.nodes.first().map(|(_, port)| *port).unwrap_or_default();
    println!();
    if let (Some(port), Some(token)) = (layout.dashboard_port, &dashboard_token) {
        println!("dashboard: http://{}:{port}/#token={token}", layout.host);
    }
    if let Some(port) = layout.metrics_base_port {
        println!(
            "metrics:  prometheus --config.file {}   (or curl -H \"Authorization: Bearer $(cat {})\" {}:{port}/metrics)",
            dir.join(SCRAPE_CONFIG_FILE).display(),
            dir.join(METRICS_TOKEN_FILE).display(),
            layout.host
        );
    }
    println!("connect:  redis-cli -c -p {first}        (any node; plain clients are forwarded, cluster clients follow MOVED)");
    println!("status:   tessera cluster status --dir {}", dir.display());
    println!("failover: tessera cluster kill 1 --dir {0} && tessera cluster status --dir {0}", dir.display());
    println!("stop:     tessera cluster down --dir {}", dir.display());
    Ok(())
}

/// Writes keys through one node (plain client: requests for other shards are
/// forwarded), reads them back through another, and shows where they live.
fn demo(layout: &Layout, map: &ClusterMap) -> Result<(), String> {
    let (first, last) = match (layout.nodes.first(), layout.nodes.last()) {
        (Some(first), Some(last)) => (first.1, last.1),
        _ => return Ok(()),
    };
    let connect = |port| {
        Client::connect(layout.node_address(port), Duration::from_secs(5)).map_err(|error| error.to_string())
    };
    let mut writer = connect(first)?;
    let count = 1000;
    let started = Instant::now();
    let commands: Vec<Vec<String>> = (0..count)
        .map(|index| vec!["SET".into(), format!("demo:{index}"), format!("value-{index}")])
        .collect();
    let replies = writer.pipeline(&commands).map_err(|error| error.to_string())?;
    let written = replies.iter().filter(|reply| matches!(reply, Value::Simple(_))).count();
    let write_time = started.elapsed();
    let mut reader = connect(last)?;
    let started = Instant::now();
    let commands: Vec<Vec<String>> =
        (0..count).map(|index| vec!["GET".into(), format!("demo:{index}")]).collect();
    // Across datacenters the last node reads its own datacenter's copy,
    // which the writes reach a moment later.
    let patience = if map.mode.geo { Duration::from_secs(5) } else { Duration::ZERO };
    let matching = loop {
        let replies = reader.pipeline(&commands).map_err(|error| error.to_string())?;
        let matching = replies
            .iter()
            .enumerate()
            .filter(|(index, reply)| reply.as_bytes() == Some(format!("value-{index}").as_bytes()))
            .count();
        if matching == count || started.elapsed() >= patience {
            break matching;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    println!(
        "demo: {written}/{count} SETs through node on port {first} in {:.0} ms, {matching}/{count} read back through port {last} in {:.0} ms",
        write_time.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64() * 1e3
    );
    let shards: Vec<_> = map.slot_shards().collect();
    let mut per_shard = vec![0usize; shards.len()];
    for index in 0..count {
        let slot = key_slot(format!("demo:{index}").as_bytes()) as u16;
        if let Some(position) = shards.iter().position(|shard| shard.owns(slot)) {
            per_shard[position] += 1;
        }
    }
    for (shard, keys) in shards.iter().zip(per_shard) {
        let copies: Vec<String> = shard.members.iter().map(|node| format!("n{node}")).collect();
        println!(
            "  shard {} (slots {:?}): {keys} keys on {}",
            shard.id,
            shard.slots,
            copies.join(members_joiner(map))
        );
    }
    if written != count || matching != count {
        return Err("the demo's writes did not all read back".into());
    }
    Ok(())
}

/// Waits until the coordinator has a map and every shard's head takes a write.
fn wait_until_served(layout: &Layout, dir: &Path, timeout: Duration) -> Result<ClusterMap, String> {
    let deadline = Instant::now() + timeout;
    let mut last_problem = String::new();
    let progress = Progress::new("groups ready", None);
    while Instant::now() < deadline {
        if let Some((id, _)) = layout.nodes.iter().find(|(id, _)| running_pid(dir, &node_name(*id)).is_none())
        {
            let log = dir.join("logs").join(format!("{}.log", node_name(*id)));
            let text = fs::read_to_string(&log).unwrap_or_default();
            let last = text.lines().last().unwrap_or("no log");
            return Err(format!("node {id} exited: {last} (log: {})", log.display()));
        }
        let nodes_up = layout
            .nodes
            .iter()
            .filter(|(_, port)| {
                let address = layout.node_address(*port);
                Client::connect(address.as_str(), Duration::from_millis(200))
                    .and_then(|mut client| client.command(&["PING"]))
                    .is_ok()
            })
            .count();
        let probed = fetch_map(dir, layout).map(|map| {
            let readiness = probe(&map);
            (map, readiness)
        });
        let (ready, total) =
            probed.as_ref().map_or((0, 0), |(_, readiness)| (readiness.ready, readiness.total));
        progress
            .set(ready as u64, &format!("of {total}; nodes answering {nodes_up} of {}", layout.nodes.len()));
        match probed {
            Ok((map, Readiness { problem: None, .. })) => {
                progress.finish();
                return Ok(map);
            }
            Ok((_, Readiness { problem: Some(problem), .. })) | Err(problem) => last_problem = problem,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    progress.finish();
    Err(format!(
        "the cluster did not serve within {} s ({last_problem}); see the logs in {}",
        timeout.as_secs(),
        dir.join("logs").display()
    ))
}

/// How many shards take a write, and why the first that does not.
struct Readiness {
    ready: usize,
    total: usize,
    problem: Option<String>,
}

/// Which shards take a write at their head (in a layout across
/// datacenters, at their copy in each datacenter).
fn probe(map: &ClusterMap) -> Readiness {
    let mut readiness = Readiness { ready: 0, total: 0, problem: None };
    for shard in map.slot_shards() {
        readiness.total += 1;
        match probe_shard(map, shard) {
            Ok(()) => readiness.ready += 1,
            Err(problem) => {
                readiness.problem.get_or_insert(problem);
            }
        }
    }
    readiness
}

fn probe_shard(map: &ClusterMap, shard: &Shard) -> Result<(), String> {
    let writers =
        if map.mode.geo { &shard.members[..] } else { &shard.members[..1.min(shard.members.len())] };
    if writers.is_empty() {
        return Err(format!("shard {} has no members", shard.id));
    }
    if shard.slots.is_empty() {
        return Err(format!("shard {} owns no slots", shard.id));
    }
    let key = (0u32..)
        .map(|index| format!("tessera:probe:{index}"))
        .find(|key| shard.owns(key_slot(key.as_bytes()) as u16))
        .expect("some key hashes into any slot");
    for writer in writers {
        let address = &map.node(*writer).ok_or("a head that is not in the map")?.address;
        let mut client = Client::connect(address.as_str(), Duration::from_secs(1))
            .map_err(|error| format!("{address}: {error}"))?;
        // A write that commits and a delete, so that the probe leaves no key
        // behind in the user's keyspace (a restore would find it in the way).
        match client.command(&["SET", key.as_str(), "1"]).map_err(|error| error.to_string())? {
            Value::Simple(_) => {}
            other => return Err(format!("shard {} answers {other:?} at node {writer}", shard.id)),
        }
        match client.command(&["DEL", key.as_str()]).map_err(|error| error.to_string())? {
            Value::Integer(_) => {}
            other => return Err(format!("shard {} answers {other:?} at node {writer}", shard.id)),
        }
    }
    Ok(())
}

fn fetch_map(dir: &Path, layout: &Layout) -> Result<ClusterMap, String> {
    match AdminSession::open(dir, layout)?.command(&["COORD.MAP"])? {
        Value::Bulk(json) => {
            ClusterMap::from_json(&String::from_utf8_lossy(&json)).map_err(|error| error.to_string())
        }
        other => Err(format!("the coordinator answered {other:?}")),
    }
}

fn status(dir: &Path) -> Result<(), String> {
    let layout = Layout::load(dir)?;
    let coordinator = match running_pid(dir, "coordinator") {
        Some(pid) => format!("running (pid {pid}) on {}", layout.coordinator_address()),
        None => "NOT RUNNING".into(),
    };
    println!("cluster {} in {}; coordinator {coordinator}", layout.cluster_id, dir.display());
    if layout.tls {
        println!("cluster plane in mutual tls; certificates in {}", dir.join(TLS_DIR).display());
    }
    let map = fetch_map(dir, &layout).ok();
    let before = commands_per_node(&layout);
    let sampled = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let after = commands_per_node(&layout);
    let seconds = sampled.elapsed().as_secs_f64();
    println!("{:<6} {:<18} {:<16} {:>9}  roles", "node", "address", "process", "ops/s");
    for ((id, port), (before, after)) in layout.nodes.iter().zip(before.iter().zip(&after)) {
        let process = match running_pid(dir, &node_name(*id)) {
            Some(pid) => format!("up (pid {pid})"),
            None => "down".into(),
        };
        let rate = match (before, after) {
            (Some(before), Some(after)) => format!("{:.0}", after.saturating_sub(*before) as f64 / seconds),
            _ => "-".into(),
        };
        let roles = map.as_ref().map_or_else(|| "?".into(), |map| roles_of(map, *id));
        println!("n{id:<5} {:<18} {process:<16} {rate:>9}  {roles}", layout.node_address(*port));
    }
    match &map {
        Some(map) => {
            println!(
                "map epoch {}, default mode {}, {} replicas per shard",
                map.epoch,
                map.mode.label(),
                map.replicas
            );
            for shard in &map.shards {
                let chain: Vec<String> = shard.members.iter().map(|node| format!("n{node}")).collect();
                let learners: Vec<String> = shard.learners.iter().map(|node| format!("n{node}")).collect();
                println!(
                    "  shard {:<3} {:<10} slots {:<14} view {:<4} {:<14} {}{}",
                    shard.id,
                    shard.table,
                    format!("{:?}", shard.slots),
                    shard.view_number,
                    chain.join(members_joiner(map)),
                    map.mode_label(shard),
                    if learners.is_empty() {
                        String::new()
                    } else {
                        format!("  (learning: {})", learners.join(", "))
                    }
                );
            }
        }
        None => println!("the coordinator does not answer: no map"),
    }
    Ok(())
}

/// How a shard's members are listed: a chain in order, or a causal
/// partition's copies, one per datacenter.
fn members_joiner(map: &ClusterMap) -> &'static str {
    if map.mode.geo {
        " + "
    } else {
        " → "
    }
}

fn roles_of(map: &ClusterMap, node: u32) -> String {
    let roles: Vec<String> = map
        .shards
        .iter()
        .filter_map(|shard| {
            let position = shard.members.iter().position(|member| *member == node);
            if let (true, Some(datacenter)) = (map.mode.geo, position) {
                return Some(format!("dc{datacenter} copy of {}", shard.id));
            }
            let role = match position {
                Some(0) => "head",
                Some(position) if position + 1 == shard.members.len() => "tail",
                Some(_) => "middle",
                None if shard.learners.contains(&node) => "learner",
                None => return None,
            };
            Some(format!("{role} of {}", shard.id))
        })
        .collect();
    if roles.is_empty() {
        "standby".into()
    } else {
        roles.join(", ")
    }
}

/// Each node's total_commands_processed, or None where it does not answer.
fn commands_per_node(layout: &Layout) -> Vec<Option<u64>> {
    layout.nodes.iter().map(|(_, port)| node_stat(layout, *port, "total_commands_processed")).collect()
}

/// The probe [`node_stat`] sends, as it travels.
const STATS_PROBE: &[u8] = b"*2\r\n$4\r\nINFO\r\n$5\r\nstats\r\n";

/// A counter of a node's INFO stats section.
fn node_stat(layout: &Layout, port: u16, name: &str) -> Option<u64> {
    let mut client = Client::connect(layout.node_address(port), Duration::from_millis(300)).ok()?;
    let info = client.command(&["INFO", "stats"]).ok()?;
    let text = String::from_utf8_lossy(info.as_bytes()?).into_owned();
    text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
}

/// Waits until a node taken out of the cluster has received nothing but
/// these probes for two seconds (clients that still routed a slot to it
/// were told MOVED and have learnt the new map; a slot a client uses less
/// often than that may still be routed here), for at most
/// `REMOVED_NODE_GRACE`: stopping it then fails no request in flight.
/// Bytes received, since commands answered with MOVED are not counted as
/// processed, as in Redis.
fn wait_until_unused(layout: &Layout, port: u16) {
    let deadline = Instant::now() + REMOVED_NODE_GRACE;
    let received = || node_stat(layout, port, "total_net_input_bytes");
    let mut before = received();
    let mut quiet = 0;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        let after = received();
        let idle = matches!((before, after), (Some(before), Some(after)) if after <= before + STATS_PROBE.len() as u64);
        quiet = if idle { quiet + 1 } else { 0 };
        if quiet == 4 {
            return;
        }
        before = after;
    }
}

/// A session with the coordinator as the operator (`admin`), proved with the
/// cluster's secret, in TLS when the cluster runs it.
struct AdminSession {
    runtime: tokio::runtime::Runtime,
    session: CoordinatorSession,
}

impl AdminSession {
    fn open(dir: &Path, layout: &Layout) -> Result<Self, String> {
        let secret = ClusterSecret::load(&dir.join(SECRET_FILE)).map_err(|error| error.to_string())?;
        let tls = match layout.tls {
            true => {
                let certificates = dir.join(TLS_DIR);
                let file = |name: &str| certificates.join(name);
                Some(
                    PeerTls::from_files(&file("server.crt"), &file("server.key"), &file("ca.crt"))
                        .map_err(|error| error.to_string())?,
                )
            }
            false => None,
        };
        let credentials =
            Credentials { cluster: &layout.cluster_id, identity: ADMIN, secret: &secret, tls: tls.as_ref() };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        let session = runtime
            .block_on(CoordinatorSession::open(&layout.coordinator_address(), credentials))
            .map_err(|error| format!("coordinator: {error}"))?;
        Ok(Self { runtime, session })
    }

    fn command(&mut self, args: &[&str]) -> Result<Value, String> {
        self.runtime.block_on(self.session.call(args)).map_err(|error| error.to_string())
    }
}

fn add_standby(dir: &Path) -> Result<(), String> {
    let mut layout = Layout::load(dir)?;
    let port = layout.nodes.iter().map(|(_, port)| *port).max().unwrap_or(layout.coordinator_port) + 1;
    let address = layout.node_address(port);
    let mut session = AdminSession::open(dir, &layout)?;
    let id = match session.command(&["COORD.ADD-NODE", address.as_str()])? {
        Value::Integer(id) => id as u32,
        other => return Err(format!("the coordinator refused the node: {other:?}")),
    };
    layout.nodes.push((id, port));
    layout.save(dir)?;
    write_scrape_config(dir, &layout)?;
    start(dir, &layout, &node_name(id))?;
    println!("added standby n{id} on {address}; it joins a shard short of replicas, if one is");
    Ok(())
}

/// How many of something each node of the map has: `counted` names the
/// nodes a shard counts for.
fn per_node<'m, I: IntoIterator<Item = &'m u32>>(
    map: &'m ClusterMap,
    counted: impl Fn(&'m Shard) -> I,
) -> BTreeMap<u32, usize> {
    let mut counts: BTreeMap<u32, usize> = map.nodes.iter().map(|node| (node.id, 0)).collect();
    for node in map.shards.iter().flat_map(counted) {
        *counts.entry(*node).or_default() += 1;
    }
    counts
}

/// How many replicas (members and learners) each node of the map holds.
fn replica_counts(map: &ClusterMap) -> BTreeMap<u32, usize> {
    per_node(map, |shard| shard.members.iter().chain(&shard.learners))
}

/// Replica moves `(shard, from, to)` that even out the replicas per node
/// (within one): each from a node holding the most to one holding the
/// fewest that the shard does not use yet, a replica that is not the head
/// first (moving a head hands its role to the next member).
fn plan_rebalance(map: &ClusterMap) -> Vec<(u32, u32, u32)> {
    let mut map = map.clone();
    let mut moves = Vec::new();
    loop {
        let counts = replica_counts(&map);
        let Some((&most, &high)) =
            counts.iter().max_by_key(|(node, count)| (**count, std::cmp::Reverse(**node)))
        else {
            return moves;
        };
        let Some((&fewest, &low)) = counts.iter().min_by_key(|(node, count)| (**count, **node)) else {
            return moves;
        };
        if high <= low + 1 {
            return moves;
        }
        let candidate = map
            .shards
            .iter_mut()
            .filter(|shard| shard.members.contains(&most) && !shard.members.contains(&fewest))
            .filter(|shard| !shard.learners.contains(&fewest))
            .min_by_key(|shard| (shard.members.first() == Some(&most), shard.id));
        let Some(shard) = candidate else { return moves };
        shard.members.retain(|node| *node != most);
        shard.members.push(fewest);
        moves.push((shard.id, most, fewest));
    }
}

/// How many groups each node of the map heads.
fn head_counts(map: &ClusterMap) -> BTreeMap<u32, usize> {
    per_node(map, |shard| shard.members.first())
}

/// Head handovers `(shard, from, to)` that even out the groups each node
/// heads (within one). Each round takes a head from a node heading the most
/// along the shortest path of handovers (each to a member of a group the
/// giver heads) to a node heading at least two fewer: the nodes between
/// give one head and take one.
fn plan_head_moves(map: &ClusterMap) -> Vec<(u32, u32, u32)> {
    let mut map = map.clone();
    let mut moves = Vec::new();
    loop {
        let counts = head_counts(&map);
        let Some((&most, &high)) =
            counts.iter().max_by_key(|(node, count)| (**count, std::cmp::Reverse(**node)))
        else {
            return moves;
        };
        // Breadth first from `most`: each node reached, by which shard and from whom.
        let mut reached: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        let mut frontier = std::collections::VecDeque::from([most]);
        let mut found = None;
        while let Some(giver) = frontier.pop_front() {
            if giver != most && counts[&giver] + 2 <= high {
                found = Some(giver);
                break;
            }
            for shard in map.shards.iter().filter(|shard| shard.members.first() == Some(&giver)) {
                for member in &shard.members[1..] {
                    if *member != most && !reached.contains_key(member) {
                        reached.insert(*member, (shard.id, giver));
                        frontier.push_back(*member);
                    }
                }
            }
        }
        let Some(mut taker) = found else { return moves };
        let mut path = Vec::new();
        while taker != most {
            let (shard, giver) = reached[&taker];
            path.push((shard, giver, taker));
            taker = giver;
        }
        for (shard, giver, taker) in path.into_iter().rev() {
            let entry = map.shards.iter_mut().find(|entry| entry.id == shard).expect("a shard of the map");
            debug_assert_eq!(entry.members.first(), Some(&giver));
            entry.members.retain(|node| *node != taker);
            entry.members.insert(0, taker);
            moves.push((shard, giver, taker));
        }
    }
}

/// Hands one group's head over and waits until the new head serves.
fn move_head(dir: &Path, layout: &Layout, (shard, from, to): (u32, u32, u32)) -> Result<(), String> {
    let mut session = AdminSession::open(dir, layout)?;
    let (shard_arg, to_arg) = (shard.to_string(), to.to_string());
    if let Value::Error(message) = session.command(&["COORD.MOVE-HEAD", &shard_arg, &to_arg])? {
        return Err(message);
    }
    let handing = |map: &ClusterMap| map.shard(shard).is_some_and(|entry| entry.next_head.is_some());
    let map = wait_for_map(
        dir,
        layout,
        HANDOVER_WAIT,
        &format!("shard {shard}'s handover from n{from} to n{to}"),
        handing,
    )?;
    let entry = map.shard(shard).ok_or_else(|| format!("shard {shard} left the map"))?;
    match entry.members.first() {
        Some(head) if *head == to => Ok(()),
        Some(head) => Err(format!(
            "shard {shard}'s head went to n{head}, not n{to} (n{to} left the group meanwhile?); run rebalance again"
        )),
        None => Err(format!("shard {shard} has no members")),
    }
}

/// Moves one replica and waits until the move is done: the new replica
/// joins, and the old one leaves with the view that ends a drain (a head
/// hands its place to the next member then).
fn move_replica(dir: &Path, layout: &Layout, (shard, from, to): (u32, u32, u32)) -> Result<(), String> {
    let mut session = AdminSession::open(dir, layout)?;
    let (shard_arg, from_arg, to_arg) = (shard.to_string(), from.to_string(), to.to_string());
    if let Value::Error(message) = session.command(&["COORD.MOVE-REPLICA", &shard_arg, &from_arg, &to_arg])? {
        return Err(message);
    }
    wait_for_replica_moves(dir, layout, |replica_move| replica_move.shard == shard)
}

/// Polls the map until `busy` no longer holds (for at most `limit`) and
/// returns it; `what` names what the wait is for in the error.
fn wait_for_map(
    dir: &Path,
    layout: &Layout,
    limit: Duration,
    what: &str,
    busy: impl Fn(&ClusterMap) -> bool,
) -> Result<ClusterMap, String> {
    let deadline = Instant::now() + limit;
    loop {
        let map = fetch_map(dir, layout)?;
        if !busy(&map) {
            return Ok(map);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{what} has not finished in {} s; `cluster status` shows where it is",
                limit.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until no replica move that `pending` picks is left in the map.
fn wait_for_replica_moves(
    dir: &Path,
    layout: &Layout,
    pending: impl Fn(&ReplicaMove) -> bool,
) -> Result<(), String> {
    let moving = |map: &ClusterMap| map.replica_moves.iter().any(&pending);
    wait_for_map(dir, layout, REPLICA_MOVE_WAIT, "a replica move", moving).map(drop)
}

/// Waits until no group is handing its head over.
fn wait_for_handovers(dir: &Path, layout: &Layout) -> Result<(), String> {
    let handing = |map: &ClusterMap| map.shards.iter().any(|shard| shard.next_head.is_some());
    wait_for_map(dir, layout, HANDOVER_WAIT, "a head handover", handing).map(drop)
}

fn rebalance(dir: &Path) -> Result<(), String> {
    let layout = Layout::load(dir)?;
    // The moves and handovers an interrupted run left finish first.
    wait_for_replica_moves(dir, &layout, |_| true)?;
    wait_for_handovers(dir, &layout)?;
    let started = Instant::now();
    let replica_plan = plan_rebalance(&fetch_map(dir, &layout)?);
    for (index, step) in replica_plan.iter().enumerate() {
        let (shard, from, to) = *step;
        move_replica(dir, &layout, *step)?;
        println!(
            "[{}/{}] moved shard {shard}'s replica from n{from} to n{to} ({:.1} s{})",
            index + 1,
            replica_plan.len(),
            started.elapsed().as_secs_f64(),
            remaining(started, index + 1, replica_plan.len()),
        );
    }
    // Heads last: a replica move hands a head on by itself.
    balance_heads(dir, &layout, started)?;
    let map = fetch_map(dir, &layout)?;
    println!("balanced: {:?} replicas and {:?} heads per node", replica_counts(&map), head_counts(&map));
    Ok(())
}

/// Hands heads over until every node heads as many groups as any other,
/// within one; `started` is when the whole operation began.
fn balance_heads(dir: &Path, layout: &Layout, started: Instant) -> Result<(), String> {
    let plan = plan_head_moves(&fetch_map(dir, layout)?);
    let heads_started = Instant::now();
    for (index, step) in plan.iter().enumerate() {
        let (shard, from, to) = *step;
        move_head(dir, layout, *step)?;
        println!(
            "[{}/{}] handed shard {shard}'s head from n{from} to n{to} ({:.1} s{})",
            index + 1,
            plan.len(),
            started.elapsed().as_secs_f64(),
            remaining(heads_started, index + 1, plan.len()),
        );
    }
    Ok(())
}

/// `, about N s left` after `done` of `total` steps taken since `started`.
fn remaining(started: Instant, done: usize, total: usize) -> String {
    if done >= total || done == 0 {
        return String::new();
    }
    let per_step = started.elapsed().as_secs_f64() / done as f64;
    format!(", about {:.0} s left", per_step * (total - done) as f64)
}

fn remove_node(dir: &Path, target: &str) -> Result<(), String> {
    let mut layout = Layout::load(dir)?;
    let name = process_name(&layout, target)?;
    let node: u32 =
        target.trim_start_matches('n').parse().map_err(|_| format!("{target:?} is not a node id"))?;
    wait_for_replica_moves(dir, &layout, |_| true)?;
    wait_for_handovers(dir, &layout)?;
    let started = Instant::now();
    loop {
        let map = fetch_map(dir, &layout)?;
        let Some(shard) = map.shards_of(node).next() else { break };
        let counts = replica_counts(&map);
        let to = counts
            .iter()
            .filter(|(other, _)| {
                **other != node && !shard.members.contains(other) && !shard.learners.contains(other)
            })
            .min_by_key(|(other, count)| (**count, **other))
            .map(|(other, _)| *other)
            .ok_or_else(|| format!("no other node can take shard {}'s replica", shard.id))?;
        let shard = shard.id;
        move_replica(dir, &layout, (shard, node, to))?;
        println!("moved shard {shard}'s replica from n{node} to n{to}");
    }
    let mut session = AdminSession::open(dir, &layout)?;
    let node_arg = node.to_string();
    if let Value::Error(message) = session.command(&["COORD.REMOVE-NODE", &node_arg])? {
        return Err(message);
    }
    // Clients that still route a slot here are told MOVED, not refused a
    // connection, until they have all heard of the new map.
    wait_until_unused(&layout, layout.port_of(node)?);
    stop(dir, &name, Duration::from_secs(10))?;
    layout.nodes.retain(|(id, _)| *id != node);
    layout.save(dir)?;
    println!("removed n{node}: it held no replica any more, and it is stopped");
    // The heads it gave up went to the next member of each group.
    balance_heads(dir, &layout, started)
}

/// One migration as `COORD.MIGRATIONS` lists it.
struct MigrationStatus {
    id: u64,
    from: u32,
    to: u32,
    /// Slot ranges, first and last.
    slots: Vec<(u16, u16)>,
    phase: String,
    entries: u64,
    bytes: u64,
    caught_up: bool,
}

fn migrations(session: &mut AdminSession) -> Result<Vec<MigrationStatus>, String> {
    let Value::Array(items) = session.command(&["COORD.MIGRATIONS"])? else {
        return Err("the coordinator answered COORD.MIGRATIONS with something else".into());
    };
    items
        .into_iter()
        .map(|item| {
            let fields = item.into_items().filter(|fields| fields.len() == 8);
            let fields = fields.ok_or("a migration the coordinator described oddly")?;
            let number = |index: usize| fields[index].as_integer().unwrap_or(0);
            let text = |index: usize| match &fields[index] {
                Value::Bulk(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => String::new(),
            };
            let slots = text(3)
                .split(',')
                .filter_map(|range| {
                    let (first, last) = range.split_once('-')?;
                    Some((first.parse().ok()?, last.parse().ok()?))
                })
                .collect();
            Ok(MigrationStatus {
                id: number(0) as u64,
                from: number(1) as u32,
                to: number(2) as u32,
                slots,
                phase: text(4),
                entries: number(5) as u64,
                bytes: number(6) as u64,
                caught_up: number(7) != 0,
            })
        })
        .collect()
}

fn move_slots(args: &MoveSlotsArgs) -> Result<(), String> {
    let layout = Layout::load(&args.dir)?;
    let mut session = AdminSession::open(&args.dir, &layout)?;
    let between = |migration: &MigrationStatus| (migration.from, migration.to) == (args.from, args.to);
    let under_way = migrations(&mut session)?.into_iter().find(between);
    if args.cancel {
        let migration = under_way.ok_or("no move under way between these groups")?;
        let id = migration.id.to_string();
        match session.command(&["COORD.MIGRATE-CANCEL", id.as_str()])? {
            Value::Error(message) => return Err(message),
            _ => println!("cancelled migration {id}: group {} keeps its slots", args.from),
        }
        return Ok(());
    }
    let id = match under_way {
        Some(migration) => {
            println!(
                "following migration {} under way from group {} to group {}",
                migration.id, args.from, args.to
            );
            migration.id
        }
        None => start_migration(&mut session, args.from, args.to, &args.slots)?,
    };
    follow_migration(&mut session, &layout, id, args.to)
}

/// Asks the coordinator to move `slots` (ranges as `FIRST-LAST`) from group
/// `from` to group `to`; returns the migration's id.
fn start_migration(session: &mut AdminSession, from: u32, to: u32, slots: &[String]) -> Result<u64, String> {
    let (from, to) = (from.to_string(), to.to_string());
    let mut command = vec!["COORD.MIGRATE", from.as_str(), to.as_str()];
    command.extend(slots.iter().map(String::as_str));
    match session.command(&command)? {
        Value::Integer(id) => Ok(id as u64),
        Value::Error(message) => Err(message),
        other => Err(format!("unexpected answer to COORD.MIGRATE: {other:?}")),
    }
}

/// Prints a migration's progress until it is done (its slots are group
/// `to`'s): what it sent, the rate, and the time left at that rate for the
/// bytes its slots held when it was first seen (CLUSTER SLOT-STATS).
fn follow_migration(session: &mut AdminSession, layout: &Layout, id: u64, to: u32) -> Result<(), String> {
    let started = Instant::now();
    let mut last_line = String::new();
    // What the slots held, once asked; `None` inside if a node did not say.
    let mut total_bytes: Option<Option<u64>> = None;
    loop {
        let Some(migration) = migrations(session)?.into_iter().find(|migration| migration.id == id) else {
            println!(
                "migration {id} done: the slots are group {to}'s ({:.1} s)",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        };
        let slots: u64 = migration.slots.iter().map(|(first, last)| u64::from(last - first) + 1).sum();
        let total = *total_bytes.get_or_insert_with(|| {
            let weights = slot_balance::slot_weights(layout, slot_balance::Weight::Bytes, 0).ok()?;
            let held = |(first, last): &(u16, u16)| -> u64 {
                weights.get(usize::from(*first)..=usize::from(*last)).map_or(0, |slots| slots.iter().sum())
            };
            Some(migration.slots.iter().map(held).sum())
        });
        let mebibytes = |bytes: u64| bytes as f64 / (1 << 20) as f64;
        let rate = mebibytes(migration.bytes) / started.elapsed().as_secs_f64().max(0.001);
        let of_total = total.map_or(String::new(), |total| format!(" of about {:.1}", mebibytes(total)));
        let left = match (migration.phase.as_str(), total.filter(|total| *total > migration.bytes)) {
            ("copying", Some(total)) if rate > 0.0 => {
                format!(", about {:.0} s left", mebibytes(total - migration.bytes) / rate)
            }
            _ => String::new(),
        };
        let line = format!(
            "migration {id}: {}{}, {slots} slots, {} keys, {:.1}{of_total} MiB sent, {rate:.1} MiB/s{left}",
            migration.phase,
            if migration.caught_up { " (caught up)" } else { "" },
            migration.entries,
            mebibytes(migration.bytes),
        );
        if line != last_line {
            println!("{line}");
            last_line = line;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn down(dir: &Path) -> Result<(), String> {
    let layout = Layout::load(dir)?;
    let names: Vec<String> = layout
        .nodes
        .iter()
        .map(|(id, _)| node_name(*id))
        .chain(std::iter::once("coordinator".into()))
        .collect();
    for name in &names {
        stop(dir, name, Duration::from_secs(10))?;
    }
    println!("cluster {} stopped; its data stays in {}", layout.cluster_id, dir.display());
    Ok(())
}

fn node_name(id: u32) -> String {
    format!("node-{id}")
}

fn process_name(layout: &Layout, target: &str) -> Result<String, String> {
    if target == "coordinator" {
        return Ok(target.into());
    }
    let id = target
        .trim_start_matches('n')
        .parse::<u32>()
        .map_err(|_| format!("{target:?} is neither a node id nor coordinator"))?;
    layout.port_of(id)?;
    Ok(node_name(id))
}

fn pid_path(dir: &Path, name: &str) -> PathBuf {
    dir.join("run").join(format!("{name}.pid"))
}

/// The pid of a process this directory started, if it still runs.
fn running_pid(dir: &Path, name: &str) -> Option<i32> {
    let pid: i32 = fs::read_to_string(pid_path(dir, name)).ok()?.trim().parse().ok()?;
    // The pid may have been reused: it must still be a tessera process of this directory.
    let command_line = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    let marker = dir.canonicalize().ok()?.to_string_lossy().into_owned();
    // A process in the middle of exec shows an empty command line for a moment.
    let ours = command_line.is_empty() || String::from_utf8_lossy(&command_line).contains(&marker);
    (ours && state != Some('Z')).then_some(pid)
}

fn signal(pid: i32, signal: i32) -> Result<(), String> {
    // SAFETY: kill(2) has no memory effects; the pid was checked to be ours.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(format!("cannot signal pid {pid}: {}", std::io::Error::last_os_error()))
    }
}

/// Stops a process gracefully (SIGTERM, then SIGKILL after `grace`).
fn stop(dir: &Path, name: &str, grace: Duration) -> Result<(), String> {
    if let Some(pid) = running_pid(dir, name) {
        signal(pid, libc::SIGTERM)?;
        let deadline = Instant::now() + grace;
        while running_pid(dir, name).is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if running_pid(dir, name).is_some() {
            signal(pid, libc::SIGKILL)?;
        }
    }
    let _ = fs::remove_file(pid_path(dir, name));
    Ok(())
}

/// The certificate, key and CA a process of a `--tls` cluster presents and
/// trusts on the cluster plane.
fn tls_flags(dir: &Path, layout: &Layout) -> Vec<String> {
    if !layout.tls {
        return Vec::new();
    }
    let file = |name: &str| dir.join(TLS_DIR).join(name).display().to_string();
    vec![
        "--tls-cert-file".into(),
        file("server.crt"),
        "--tls-key-file".into(),
        file("server.key"),
        "--tls-ca-cert-file".into(),
        file("ca.crt"),
    ]
}

/// The flags that make the process with client port `port` serve metrics.
fn metrics_flags(dir: &Path, layout: &Layout, port: u16) -> Vec<String> {
    let Some(metrics_port) = layout.metrics_port(port) else { return Vec::new() };
    vec![
        "--metrics-bind".into(),
        format!("{}:{metrics_port}", layout.host),
        "--metrics-token-file".into(),
        dir.join(METRICS_TOKEN_FILE).display().to_string(),
    ]
}

/// A random bearer token in `path`, made once (as a cluster secret is: 64
/// hexadecimal digits, mode 0600); returns it.
fn ensure_token(path: &Path) -> Result<String, String> {
    if !path.exists() {
        ClusterSecret::generate().save(path).map_err(|error| error.to_string())?;
    }
    let token = tessera_cluster::http::load_token(path)?;
    Ok(String::from_utf8_lossy(&token).into_owned())
}

/// With metrics on: the scrapes' token (made once, mode 0600) and a
/// Prometheus configuration that scrapes every process of the cluster.
fn write_scrape_config(dir: &Path, layout: &Layout) -> Result<(), String> {
    if layout.metrics_base_port.is_none() {
        return Ok(());
    }
    let dir = dir.canonicalize().map_err(|error| format!("{}: {error}", dir.display()))?;
    let token_path = dir.join(METRICS_TOKEN_FILE);
    ensure_token(&token_path)?;
    let target = |port: u16| format!("'{}:{}'", layout.host, layout.metrics_port(port).unwrap_or_default());
    let nodes: Vec<String> = layout.nodes.iter().map(|(_, port)| target(*port)).collect();
    let job = |name: &str, targets: &str| {
        format!(
            "  - job_name: {name}\n    authorization:\n      credentials_file: {}\n    static_configs:\n      - targets: [{targets}]\n",
            token_path.display()
        )
    };
    let text = format!(
        "# Written by `tessera cluster up`: scrapes the coordinator and every node of {}.\n\
         global:\n  scrape_interval: 5s\nscrape_configs:\n{}{}",
        layout.cluster_id,
        job("tessera-coordinator", &target(layout.coordinator_port)),
        job("tessera-nodes", &nodes.join(", ")),
    );
    let path = dir.join(SCRAPE_CONFIG_FILE);
    fs::write(&path, text).map_err(|error| format!("{}: {error}", path.display()))
}

/// Starts a process of the cluster, detached, logging to `<dir>/logs`.
fn start(dir: &Path, layout: &Layout, name: &str) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let dir = dir.canonicalize().map_err(|error| format!("{}: {error}", dir.display()))?;
    for sub in ["logs", "run", "nodes"] {
        fs::create_dir_all(dir.join(sub)).map_err(|error| format!("{}: {error}", dir.join(sub).display()))?;
    }
    let exe = std::env::current_exe().map_err(|error| format!("cannot find the tessera binary: {error}"))?;
    let mut args: Vec<String> = Vec::new();
    if name == "coordinator" {
        let state = dir.join("coordinator");
        args.extend(["coordinator".into(), "--dir".into(), state.display().to_string()]);
        args.extend([
            "--bind".into(),
            layout.host.clone(),
            "--port".into(),
            layout.coordinator_port.to_string(),
        ]);
        args.extend(["--lease-ms".into(), layout.lease_ms.to_string()]);
        args.extend(["--cluster-secret-file".into(), dir.join(SECRET_FILE).display().to_string()]);
        args.extend(["--failure-timeout-ms".into(), layout.failure_timeout_ms.to_string()]);
        args.extend(tls_flags(&dir, layout));
        args.extend(metrics_flags(&dir, layout, layout.coordinator_port));
        if let Some(port) = layout.dashboard_port {
            args.extend([
                "--dashboard-bind".into(),
                format!("{}:{port}", layout.host),
                "--dashboard-token-file".into(),
                dir.join(DASHBOARD_TOKEN_FILE).display().to_string(),
            ]);
        }
        if !state.join("cluster.json").exists() {
            let addresses: Vec<String> =
                layout.nodes.iter().map(|(_, port)| layout.node_address(*port)).collect();
            args.extend([
                "--cluster-id".into(),
                layout.cluster_id.clone(),
                "--nodes".into(),
                addresses.join(","),
            ]);
            args.extend(["--replicas".into(), layout.replicas.to_string()]);
            if let Some(groups) = layout.groups {
                args.extend(["--groups".into(), groups.to_string()]);
            }
            args.extend(["--topology".into(), layout.topology.clone()]);
            args.extend(["--consistency".into(), layout.consistency.clone()]);
            if let Some(datacenters) = layout.datacenters {
                args.extend(["--datacenters".into(), datacenters.to_string()]);
            }
        }
    } else {
        let id: u32 = name.trim_start_matches("node-").parse().map_err(|_| format!("no process {name}"))?;
        let port = layout.port_of(id)?;
        args.extend([
            "serve".into(),
            "--bind".into(),
            layout.host.clone(),
            "--port".into(),
            port.to_string(),
        ]);
        args.extend(["--dir".into(), dir.join("nodes").join(id.to_string()).display().to_string()]);
        args.extend([
            "--engine".into(),
            layout.engine.clone(),
            "--threads".into(),
            layout.threads.to_string(),
        ]);
        args.extend(["--cluster-id".into(), layout.cluster_id.clone(), "--node-id".into(), id.to_string()]);
        args.extend(["--coordinator".into(), layout.coordinator_address()]);
        args.extend(["--cluster-secret-file".into(), dir.join(SECRET_FILE).display().to_string()]);
        if layout.tls {
            args.push("--tls-cluster".into());
            args.extend(tls_flags(&dir, layout));
            args.extend(["--tls-port".into(), (port + TLS_PORT_OFFSET).to_string()]);
        }
        if let Some(bytes) = layout.maxmemory {
            args.extend(["--maxmemory".into(), bytes.to_string()]);
        }
        if let Some(policy) = &layout.maxmemory_policy {
            args.extend(["--maxmemory-policy".into(), policy.clone()]);
        }
        if layout.datacenter_delay_ms > 0 {
            args.extend(["--datacenter-delay-ms".into(), layout.datacenter_delay_ms.to_string()]);
        }
        if let Some(rate) = layout.snapshot_rate {
            args.extend(["--snapshot-rate".into(), rate.to_string()]);
        }
        args.extend(metrics_flags(&dir, layout, port));
        if layout.clock_skew_ms > 0 && id % 2 == 1 {
            args.extend(["--clock-ahead-ms".into(), layout.clock_skew_ms.to_string()]);
        }
    }
    let log_path = dir.join("logs").join(format!("{name}.log"));
    // The process rotates its own log; what it prints before it can goes
    // to the same file.
    args.extend(["--log-file".into(), log_path.display().to_string()]);
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|error| format!("{}: {error}", log_path.display()))?;
    let child = std::process::Command::new(exe)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|error| error.to_string())?)
        .stderr(log)
        // Its own process group: Ctrl-C on this command does not reach it.
        .process_group(0)
        .spawn()
        .map_err(|error| format!("cannot start {name}: {error}"))?;
    fs::write(pid_path(&dir, name), child.id().to_string()).map_err(|error| error.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tessera_protocol::Mode;

    use super::*;

    #[test]
    fn a_rebalance_plan_evens_out_replicas_without_putting_two_of_a_shard_on_one_node() {
        let addresses: Vec<String> = (0..7).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        // Four nodes serve twelve groups of three; three new ones hold nothing.
        let mut map =
            ClusterMap::place_groups("c1", Mode::named("ms+sc").unwrap(), 3, &addresses, 4, 12).unwrap();
        let plan = plan_rebalance(&map);
        assert!(!plan.is_empty());
        for (shard, from, to) in plan {
            let shard = map.shards.iter_mut().find(|entry| entry.id == shard).unwrap();
            assert!(shard.members.contains(&from) && !shard.members.contains(&to));
            shard.members.retain(|node| *node != from);
            shard.members.push(to);
        }
        map.validate().unwrap();
        let counts = replica_counts(&map);
        assert!(counts.values().all(|count| (5..=6).contains(count)), "36 replicas over 7 nodes: {counts:?}");
        assert!(plan_rebalance(&map).is_empty(), "balanced: nothing more to move");
    }

    /// Replicas first, as `rebalance` does; then heads.
    fn rebalanced(serving: usize, nodes: usize, groups: usize) -> ClusterMap {
        let addresses: Vec<String> = (0..nodes).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        let mut map =
            ClusterMap::place_groups("c1", Mode::named("ms+sc").unwrap(), 3, &addresses, serving, groups)
                .unwrap();
        for (shard, from, to) in plan_rebalance(&map) {
            let shard = map.shards.iter_mut().find(|entry| entry.id == shard).unwrap();
            shard.members.retain(|node| *node != from);
            shard.members.push(to);
        }
        for (shard, from, to) in plan_head_moves(&map) {
            let shard = map.shards.iter_mut().find(|entry| entry.id == shard).unwrap();
            assert_eq!(shard.members[0], from, "handed over by its head at the time");
            let at = shard.members.iter().position(|node| *node == to).expect("a member takes over");
            shard.members.remove(at);
            shard.members.insert(0, to);
        }
        map.validate().unwrap();
        assert!(plan_head_moves(&map).is_empty(), "balanced: nothing more to hand over");
        map
    }

    #[test]
    fn a_head_plan_spreads_heads_over_every_node() {
        // Three new nodes got replicas, but head none until handed some.
        let counts = head_counts(&rebalanced(3, 6, 12));
        assert!(counts.values().all(|count| *count == 2), "twelve heads over six nodes: {counts:?}");
        // Six groups on six nodes: the node heading two groups may be in no
        // group with the node heading none; a path of handovers gets there.
        let counts = head_counts(&rebalanced(3, 6, 6));
        assert!(counts.values().all(|count| *count == 1), "six heads over six nodes: {counts:?}");
        let counts = head_counts(&rebalanced(4, 7, 10));
        assert!(
            counts.values().all(|count| (1..=2).contains(count)),
            "ten heads over seven nodes: {counts:?}"
        );
    }
}
