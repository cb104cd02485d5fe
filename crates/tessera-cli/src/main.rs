//! `tessera`: run a node, or talk to one.

mod backup;
mod cluster;
mod import_rdb;
mod log_file;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tessera_bench::progress::Progress;
use tessera_node::config::AuthClients;
use tessera_node::memory::{parse_size, CountingAllocator, EvictionPolicy};
use tessera_node::{Config, Server};
use tessera_wire::{Client, Value};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Tessera: scale-out key-value stores from single-node engines, spoken to over the Redis protocol"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    connection: ConnectionArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node: a RESP server over tables of chosen engines.
    Serve(Box<ServeArgs>),
    /// Read a key.
    Get { key: String },
    /// Write a key.
    Set {
        key: String,
        value: String,
        /// Expire after this many seconds.
        #[arg(long)]
        ex: Option<u64>,
    },
    /// Delete keys.
    Del {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// List keys, optionally matching a glob pattern.
    Scan {
        /// Glob pattern (`*`, `?`, `[abc]`).
        #[arg(long = "match")]
        pattern: Option<String>,
        /// Keys fetched per round trip.
        #[arg(long, default_value_t = 1000)]
        count: u32,
    },
    /// Run a cluster's coordinator: the shard map, liveness and failover.
    Coordinator(Box<CoordinatorArgs>),
    /// A local cluster of processes: up, status, kill, restart, add-standby, down.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Drive a YCSB workload against RESP endpoints (Tessera, Redis, ...) and
    /// report throughput and latency percentiles.
    Bench(Box<BenchArgs>),
    /// Run replication protocols in the deterministic simulator, with faults,
    /// and check their histories. Exits non-zero on any violation.
    Sim(SimArgs),
    /// Check a history recorded from real clients (JSON lines, see
    /// docs/OPERATIONS.md) for linearizability, with the simulator's checker.
    CheckHistory { file: PathBuf },
    /// Load a Redis dump (dump.rdb) into the node or cluster at --addr, key
    /// by key with RESTORE; a file it cannot load whole loads nothing.
    ImportRdb {
        file: PathBuf,
        /// The file's database to load (Tessera has one keyspace).
        #[arg(long, default_value_t = 0)]
        db: u64,
        /// Overwrite keys that exist (otherwise they are left and reported).
        #[arg(long)]
        replace: bool,
    },
    /// Back up the node or cluster at --addr while it serves: one RDB file
    /// per group, each at one write position, and a manifest of the tables
    /// (docs/OPERATIONS.md, "Backup and restore").
    Backup {
        /// A new or empty directory for the files.
        #[arg(long)]
        to: PathBuf,
    },
    /// Rebuild a node or cluster from a backup: creates its tables on the
    /// node or cluster at --addr and loads every group's file.
    Restore {
        /// A directory `tessera backup` wrote.
        #[arg(long)]
        from: PathBuf,
        /// Overwrite keys that exist (otherwise they are left and reported).
        #[arg(long)]
        replace: bool,
    },
    /// Check a history of causal sessions recorded from real clients (JSON
    /// lines) for causal consistency, with the simulator's checker: per
    /// session, and with --datacenters also per datacenter (what COPS
    /// promises; see docs/PROTOCOLS.md, "What the checker asks of each").
    CheckCausal {
        file: PathBuf,
        #[arg(long)]
        datacenters: bool,
    },
    /// Salvage the `log` engine's data under a stopped node's directory that
    /// refused to open over damage: every record that passes its checksum is
    /// kept, only the damaged bytes are dropped.
    Repair {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Write a private CA, a node certificate for the given hosts and a
    /// client certificate (PEM), for TLS in tests and local deployments.
    TlsCerts {
        #[arg(long)]
        dir: PathBuf,
        /// Names and IP addresses the node certificate is valid for.
        #[arg(long = "host", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
        hosts: Vec<String>,
    },
    /// Manage tables.
    Table {
        #[command(subcommand)]
        command: TableCommand,
    },
}

#[derive(Args)]
struct BenchArgs {
    #[command(subcommand)]
    action: Option<BenchAction>,
    /// Endpoints, host:port[,host:port...]; keys are sharded over several
    /// (with --cluster: nodes to ask for the slot map).
    #[arg(long, value_delimiter = ',')]
    target: Vec<String>,
    /// Route by the Redis Cluster slot map (CLUSTER SLOTS), following MOVED and ASK.
    #[arg(long)]
    cluster: bool,
    /// YCSB core workload A, B, C, D, E, F; W (write only); joblaunch or
    /// ioforward (the HPC mixes of BespoKV's evaluation).
    #[arg(long, default_value = "A")]
    workload: String,
    /// A custom mix instead of the workload's, e.g. read=0.62,update=0.38.
    #[arg(long)]
    mix: Option<String>,
    /// Key distribution: uniform, zipfian[:θ], latest[:θ], hotspot[:keys,ops];
    /// default: the workload's.
    #[arg(long)]
    distribution: Option<String>,
    /// load (insert the records), run (the mix), or both.
    #[arg(long, default_value = "both")]
    phase: String,
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    #[arg(long, default_value_t = 1_000_000)]
    operations: u64,
    /// Concurrent connections (per endpoint).
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Operations in flight per connection.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Records as hashes (YCSB's Redis binding) or strings (redis-benchmark).
    #[arg(long, default_value = "hash")]
    record: String,
    /// Fields per hash record, and bytes per field or per string value
    /// (YCSB: 10 x 100).
    #[arg(long, default_value_t = 10)]
    fields: usize,
    /// Bytes per field or string value: N or MIN..MAX (uniform).
    #[arg(long, default_value = "100")]
    field_bytes: String,
    /// Pad keys to N or MIN..MAX bytes (fixed per record); default: user<n>.
    #[arg(long)]
    key_bytes: Option<String>,
    /// Internal writes per update or insert request (amplified requests, as in
    /// DKVF's evaluation); throughput and latency count requests.
    #[arg(long, default_value_t = 1)]
    amplify: usize,
    /// With --cluster: the share of reads sent to the slot's master; the rest
    /// go to replicas on READONLY connections (eventual reads, reported apart).
    #[arg(long)]
    strong_reads: Option<f64>,
    /// Each connection is a causal session (CONSISTENCY CAUSAL) kept on one
    /// target, which runs all its keys: list a datacenter's nodes, not --cluster.
    #[arg(long)]
    causal: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Open loop at this many operations per second in total; latencies are
    /// timed from each batch's scheduled send (no coordinated omission).
    #[arg(long)]
    rate: Option<f64>,
    /// Run for this many seconds instead of --operations.
    #[arg(long)]
    duration: Option<f64>,
    /// Client threads; 0 = one per core. On a machine shared with the server,
    /// 1 leaves the server the other cores (as redis-benchmark does).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// No live progress line on stderr.
    #[arg(long)]
    quiet: bool,
    /// Write the run's report as JSON / CSV to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw throughput over time and the latency CDF as SVG files in this directory.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct CoordinatorArgs {
    /// Where the cluster map is kept (cluster.json); a restart resumes from it.
    #[arg(long, default_value = "tessera-coordinator")]
    dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    #[arg(long, default_value_t = 7300)]
    port: u16,
    /// To start a new cluster: its id (nodes started for another are refused).
    #[arg(long)]
    cluster_id: Option<String>,
    /// The cluster's secret, shared by its nodes and coordinators (mode
    /// 0600; `cluster up` writes one): only who proves it may change the map.
    #[arg(long)]
    cluster_secret_file: PathBuf,
    /// To start a new cluster: every node's host:port, in node-id order.
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<String>,
    /// How many of --nodes serve from the start; the rest stand by. Default: all.
    #[arg(long)]
    members: Option<usize>,
    /// Replica groups (shards) splitting the slots; a node hosts several.
    /// Default: four per serving node.
    #[arg(long)]
    groups: Option<usize>,
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// ms (master–slave) or aa (active–active).
    #[arg(long, default_value = "ms")]
    topology: String,
    /// strong or eventual: with ms, chain replication or primary–backup; with
    /// aa, eventual is multi-master last-writer-wins. With --datacenters, a
    /// causal protocol: geo-eventual, cops, gentle-rain or causal-spartan.
    #[arg(long, default_value = "strong")]
    consistency: String,
    /// To start a new cluster across this many datacenters: --nodes split
    /// into that many consecutive, equal shares, each holding a whole copy
    /// partitioned over its nodes, replicated by the causal protocol
    /// --consistency names (--replicas, --groups and --topology do not apply).
    #[arg(long)]
    datacenters: Option<usize>,
    /// A replica acts alone (tail reads, acknowledgements) for this long after
    /// each heartbeat it sends.
    #[arg(long, default_value_t = 1000)]
    lease_ms: u64,
    /// A replica not heard from for this long is removed (once its lease ran out).
    #[arg(long, default_value_t = 1500)]
    failure_timeout_ms: u64,
    /// Keep the map in etcd instead of --dir (host:port,... of its members);
    /// needs --cluster-id. Several coordinators may run: one leads, the others
    /// wait and take over when its etcd lease lapses.
    #[arg(long)]
    etcd: Option<String>,
    /// The CA that signed etcd's certificate, for https:// endpoints
    /// [default: the public roots].
    #[arg(long)]
    etcd_ca_file: Option<PathBuf>,
    /// A client certificate and key to present to etcd (--client-cert-auth).
    #[arg(long, requires_all = ["etcd_key_file", "etcd_ca_file"])]
    etcd_cert_file: Option<PathBuf>,
    #[arg(long, requires = "etcd_cert_file")]
    etcd_key_file: Option<PathBuf>,
    /// This coordinator's name in the election [default: its bind:port].
    #[arg(long)]
    name: Option<String>,
    /// Speak only mutual TLS (the nodes' `tls_cluster`): this coordinator's
    /// certificate, which must name the host nodes reach it by ...
    #[arg(long, requires_all = ["tls_key_file", "tls_ca_cert_file"])]
    tls_cert_file: Option<PathBuf>,
    /// ... its key ...
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// ... and the CA that signs the cluster's certificates.
    #[arg(long, requires = "tls_cert_file")]
    tls_ca_cert_file: Option<PathBuf>,
    /// Seconds a leader's etcd lease lasts without renewal.
    #[arg(long, default_value_t = 2)]
    leader_ttl_secs: u64,
    /// Serve Prometheus metrics at http://ADDRESS/metrics (host:port) [default: none].
    #[arg(long, value_name = "ADDRESS")]
    metrics_bind: Option<String>,
    /// A scrape must present the first line of this file as a bearer token.
    #[arg(long, requires = "metrics_bind")]
    metrics_token_file: Option<PathBuf>,
    /// Serve the web dashboard at http://ADDRESS/ (host:port) [default: none].
    #[arg(long, value_name = "ADDRESS")]
    dashboard_bind: Option<String>,
    /// The dashboard's data asks for the first line of this file as a bearer
    /// token (open the page as http://ADDRESS/#token=TOKEN).
    #[arg(long, requires = "dashboard_bind")]
    dashboard_token_file: Option<PathBuf>,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand)]
enum BenchAction {
    /// Print reports (--json files) side by side, with ratios to the first.
    Compare {
        #[arg(required = true)]
        reports: Vec<PathBuf>,
        /// Also overlay their throughput and latency CDFs as SVG files here.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

#[derive(Args)]
struct SimArgs {
    /// chain, chain-craq, primary-backup, multi-master or quorum; or, across
    /// datacenters, eventual, cops, gentle-rain or causal-spartan.
    #[arg(long)]
    protocol: String,
    /// Across datacenters: how many, and partitions in each (--clients
    /// sessions in each).
    #[arg(long, default_value_t = 2)]
    datacenters: usize,
    #[arg(long, default_value_t = 3)]
    partitions: usize,
    /// Across datacenters: the chains of keys (a post, a comment and a
    /// reply each) sessions write, and the share of puts whose value has a
    /// time to live (each datacenter's expiry sweep retires it).
    #[arg(long, default_value_t = 3)]
    chains: usize,
    #[arg(long, default_value_t = 0.3)]
    expiring: f64,
    /// Across datacenters: measure how long a write takes to be seen in the
    /// other datacenters, at each clock skew of --skews (ms, half the nodes
    /// that far ahead) with a fixed one-way --delay-ms between datacenters
    /// and no other fault, over --seeds seeds each.
    #[arg(long)]
    visibility: bool,
    #[arg(long, default_value = "0,2,5,10")]
    skews: String,
    #[arg(long, default_value_t = 50)]
    delay_ms: u64,
    /// Switch each run to this protocol at a random time while it serves
    /// (an online transition), checked under both protocols' guarantees.
    #[arg(long)]
    transition_to: Option<String>,
    /// How many seeds to run, from --first-seed on.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    #[arg(long, default_value_t = 0)]
    first_seed: u64,
    /// Run exactly this seed (a failing seed replays exactly) and print its history.
    #[arg(long)]
    seed: Option<u64>,
    /// Faults seeds may draw from: all, none, or a list of delay, reorder, drop,
    /// partition, crash, skew, suspicion (with --groups: the first five).
    #[arg(long, default_value = "all")]
    faults: String,
    /// registers (contended keys, checked for linearizability), appends
    /// (every write a fresh key: counts lost acknowledged writes exactly) or
    /// batches (writes to every key of a group as one unit, each group
    /// checked as one register) or collections (paged collections and the
    /// expiry sweep deleting their orphaned pages; quorum protocols).
    #[arg(long, default_value = "registers")]
    workload: String,
    #[arg(long, default_value_t = 3)]
    replicas: u32,
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Virtual milliseconds of traffic with faults, then after healing
    /// [default: 3000 and 2000; with --groups, 4000 and 3000].
    #[arg(long)]
    safety_ms: Option<u64>,
    #[arg(long)]
    liveness_ms: Option<u64>,
    /// Run this many groups on --nodes nodes, the clients' keys' slots moving
    /// between them while faults strike (any protocol; registers under a
    /// strong one, appends under an eventual one).
    #[arg(long, default_value_t = 1)]
    groups: usize,
    #[arg(long, default_value_t = 4)]
    nodes: u32,
}

#[derive(Subcommand)]
enum TableCommand {
    /// Create a table owning a key prefix, on an engine.
    Create {
        name: String,
        #[arg(long)]
        prefix: String,
        /// memory, ordered, log, lsm, hybrid or redis.
        #[arg(long)]
        engine: String,
        /// Engine options as NAME=VALUE (e.g. fsync=always, addr=127.0.0.1:6379).
        #[arg(long = "option", value_name = "NAME=VALUE")]
        options: Vec<String>,
    },
    /// Drop a table and its data.
    Drop { name: String },
    /// List table names.
    List,
    /// Show a table's definition and size.
    Info { name: String },
}

#[derive(Args)]
struct ConnectionArgs {
    /// Address of a node (client commands) [default: 127.0.0.1:7379, where
    /// `serve` listens, or if nothing answers there 127.0.0.1:7001, the first
    /// node of `cluster up`].
    #[arg(long = "addr", global = true, env = "TESSERA_ADDR")]
    given_addr: Option<String>,
    #[arg(skip)]
    default_addr: std::sync::OnceLock<String>,
    /// Password, if the node requires one (client commands), as redis-cli's -a.
    #[arg(long = "auth", short = 'a', global = true, env = "TESSERA_AUTH")]
    password: Option<String>,
}

impl ConnectionArgs {
    /// The node client commands go to: the one named, else a local node,
    /// else a local cluster's first node.
    fn addr(&self) -> &str {
        if let Some(given) = &self.given_addr {
            return given;
        }
        self.default_addr.get_or_init(|| {
            let answers = |address: &str| {
                address.parse().is_ok_and(|socket| {
                    std::net::TcpStream::connect_timeout(&socket, Duration::from_millis(300)).is_ok()
                })
            };
            let (node, cluster) = ("127.0.0.1:7379", "127.0.0.1:7001");
            if !answers(node) && answers(cluster) { cluster } else { node }.to_string()
        })
    }
}

/// Flags override the config file, which overrides the defaults.
#[derive(Args)]
struct ServeArgs {
    /// TOML config file; every key is optional (see docs/OPERATIONS.md).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    bind: Option<String>,
    /// TCP port [default: 7379].
    #[arg(long, short = 'p')]
    port: Option<u16>,
    /// Data directory: table catalog and persistent engines' files [default: ./tessera-data].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Engine of the default table: memory, ordered, log, lsm, hybrid or redis [default: memory].
    #[arg(long)]
    engine: Option<String>,
    /// Option of the default table's engine, NAME=VALUE (repeatable), e.g. fsync=always.
    #[arg(long = "engine-option", value_name = "NAME=VALUE")]
    engine_options: Vec<String>,
    /// Require clients to AUTH with this password.
    #[arg(long, env = "TESSERA_PASSWORD")]
    password: Option<String>,
    /// Worker threads; 0 = one per core [default: 0].
    #[arg(long)]
    threads: Option<usize>,
    /// Most simultaneous client connections [default: 10000].
    #[arg(long)]
    max_clients: Option<usize>,
    /// Largest bulk string (argument) a client may send, in bytes [default: 536870912].
    #[arg(long)]
    bulk_bytes_max: Option<usize>,
    /// Most arguments in one command [default: 1048576].
    #[arg(long)]
    args_max: Option<usize>,
    /// Longest inline command, in bytes [default: 65536].
    #[arg(long)]
    inline_bytes_max: Option<usize>,
    /// Unparsed input a connection may hold before it is closed, in bytes [default: 1073741824].
    #[arg(long)]
    query_buffer_bytes_max: Option<usize>,
    /// Unparsed input all clients together may hold; past it, a client whose
    /// buffer grows beyond 1 MiB is closed, in bytes [default: 2147483648; 0: none].
    #[arg(long)]
    query_buffer_budget: Option<usize>,
    /// Replies a client may leave unread before it is disconnected, in bytes
    /// (Redis's client-output-buffer-limit hard limit for normal clients) [default: 0, none].
    #[arg(long)]
    client_output_buffer_limit: Option<usize>,
    /// Close a client idle for this many seconds (Redis's timeout) [default: 0, never].
    #[arg(long)]
    timeout: Option<u64>,
    /// A second client port speaking TLS (Redis's tls-port) [default: 0, none].
    #[arg(long)]
    tls_port: Option<u16>,
    /// The node's certificate chain, PEM.
    #[arg(long)]
    tls_cert_file: Option<PathBuf>,
    /// The node's private key, PEM.
    #[arg(long)]
    tls_key_file: Option<PathBuf>,
    /// The CA whose client certificates the TLS port accepts, PEM.
    #[arg(long)]
    tls_ca_cert_file: Option<PathBuf>,
    /// Whether TLS clients must present a certificate: yes, optional or no [default: yes].
    #[arg(long, value_parser = parse_auth_clients)]
    tls_auth_clients: Option<AuthClients>,
    /// Run the peer links and the coordinator session in mutual TLS with the
    /// same certificate, key and CA (Redis's tls-cluster); every node of the
    /// cluster, and its coordinator, must.
    #[arg(long)]
    tls_cluster: bool,
    /// Serve Prometheus metrics at http://ADDRESS/metrics (host:port) [default: none].
    #[arg(long, value_name = "ADDRESS")]
    metrics_bind: Option<String>,
    /// A scrape must present the first line of this file as a bearer token.
    #[arg(long, requires = "metrics_bind")]
    metrics_token_file: Option<PathBuf>,
    /// Memory the node may use, in bytes or with a unit (100mb, 2gb), as
    /// Redis's maxmemory; past it, writes evict keys or are refused [default: 0, none].
    #[arg(long, value_parser = parse_maxmemory)]
    maxmemory: Option<u64>,
    /// What a write does past maxmemory: noeviction (refused with -OOM),
    /// allkeys-lru, allkeys-random, volatile-lru, volatile-random or volatile-ttl [default: noeviction].
    #[arg(long, value_parser = parse_eviction_policy)]
    maxmemory_policy: Option<EvictionPolicy>,
    /// Keys sampled per eviction [default: 5].
    #[arg(long)]
    maxmemory_samples: Option<usize>,
    /// How long shutdown waits for in-flight requests, in ms [default: 5000].
    #[arg(long)]
    shutdown_timeout_ms: Option<u64>,
    /// How long a script runs before other commands answer BUSY and SCRIPT
    /// KILL may stop it, in ms [default: 5000].
    #[arg(long)]
    busy_reply_threshold_ms: Option<u64>,
    /// Reads of the disk that commands would wait for, made ahead of them
    /// off the serving threads, at most this many at once; 0: commands read
    /// the disk where they run [default: 64].
    #[arg(long)]
    disk_reads_in_flight: Option<usize>,
    /// How often expired keys are swept, in ms [default: 100].
    #[arg(long)]
    expiry_sweep_interval_ms: Option<u64>,
    /// Entries each sweep reads per table [default: 256].
    #[arg(long)]
    expiry_sweep_entries: Option<usize>,
    /// Join this cluster (with --node-id, --coordinator and
    /// --cluster-secret-file); peers reach the node on its port + 10000.
    #[arg(long, requires_all = ["node_id", "coordinator", "cluster_secret_file"])]
    cluster_id: Option<String>,
    /// This node's id in the cluster map.
    #[arg(long)]
    node_id: Option<u32>,
    /// The cluster coordinator's host:port.
    #[arg(long)]
    coordinator: Option<String>,
    /// The cluster's secret, shared by its nodes and coordinators (mode 0600;
    /// `cluster up` writes one).
    #[arg(long)]
    cluster_secret_file: Option<PathBuf>,
    /// A test and benchmark option: hold messages from peers in other
    /// datacenters this long before handling them (WAN latency on one machine).
    #[arg(long)]
    datacenter_delay_ms: Option<u64>,
    /// The most bytes per second one snapshot stream (a joining replica's,
    /// a migration's, a backup's) reads and sends (bytes, or a number with
    /// kb, mb, gb; 0 for no limit) [default: 128mb].
    #[arg(long, value_parser = parse_maxmemory)]
    snapshot_rate: Option<u64>,
    /// A test and benchmark option: run this node's clock this many
    /// milliseconds ahead of the wall clock (clock skew on one machine).
    #[arg(long)]
    clock_ahead_ms: Option<u64>,
    /// host:port of Redis servers a table on the redis engine may be created
    /// over (the default table's own server is always allowed).
    #[arg(long, value_delimiter = ',')]
    redis_engine_allow: Vec<String>,
    #[command(flatten)]
    log: LogArgs,
}

/// How a long-running process (a node, a coordinator) logs, to stderr.
#[derive(clap::Args, Clone, Debug)]
struct LogArgs {
    /// Log filter: a level, and levels per module, e.g.
    /// `info,tessera_cluster=debug,tessera_protocol::quorum=trace`.
    #[arg(long, env = "TESSERA_LOG", default_value = "info")]
    log: String,
    /// `text` for people, `json` (one object per line) for log collectors.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log to this file (stdout and stderr too) rather than stderr, rotated
    /// by size: PATH.1 is the newest earlier file.
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
    /// Rotate the log file past this size (bytes, or with kb, mb, gb).
    #[arg(long, value_parser = parse_maxmemory, default_value = "64mb")]
    log_file_max_bytes: u64,
    /// Earlier log files kept.
    #[arg(long, default_value_t = 5)]
    log_files_kept: usize,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

fn parse_pairs(pairs: &[String]) -> Result<BTreeMap<String, String>, String> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(name, value)| (name.trim().to_string(), value.to_string()))
                .ok_or_else(|| format!("expected NAME=VALUE, got {pair:?}"))
        })
        .collect()
}

impl ServeArgs {
    fn config(&self) -> Result<Config, String> {
        let mut config = match &self.config {
            Some(path) => Config::from_file(path).map_err(|error| error.to_string())?,
            None => Config::default(),
        };
        macro_rules! override_with {
            ($($field:ident),*) => { $( if let Some(value) = &self.$field { config.$field = value.clone(); } )* };
        }
        override_with!(
            bind,
            port,
            dir,
            engine,
            threads,
            max_clients,
            bulk_bytes_max,
            args_max,
            inline_bytes_max,
            query_buffer_bytes_max,
            query_buffer_budget,
            client_output_buffer_limit,
            timeout,
            tls_port,
            tls_auth_clients,
            maxmemory,
            maxmemory_policy,
            maxmemory_samples,
            shutdown_timeout_ms,
            busy_reply_threshold_ms,
            disk_reads_in_flight
        );
        if self.password.is_some() {
            config.password = self.password.clone();
        }
        config.tls_cluster |= self.tls_cluster;
        if self.metrics_bind.is_some() {
            config.metrics_bind.clone_from(&self.metrics_bind);
        }
        for (file, setting) in [
            (&self.tls_cert_file, &mut config.tls_cert_file),
            (&self.tls_key_file, &mut config.tls_key_file),
            (&self.tls_ca_cert_file, &mut config.tls_ca_cert_file),
            (&self.metrics_token_file, &mut config.metrics_token_file),
        ] {
            if file.is_some() {
                setting.clone_from(file);
            }
        }
        config.redis_engine_allow.extend(self.redis_engine_allow.iter().cloned());
        config.engine_options.extend(parse_pairs(&self.engine_options)?);
        if let (Some(id), Some(node), Some(coordinator), Some(secret)) =
            (&self.cluster_id, self.node_id, &self.coordinator, &self.cluster_secret_file)
        {
            let mut cluster = config
                .cluster
                .take()
                .unwrap_or_else(|| tessera_node::config::ClusterConfig::new(id, node, coordinator, secret));
            (cluster.id, cluster.node, cluster.coordinator, cluster.secret_file) =
                (id.clone(), node, coordinator.clone(), secret.clone());
            if let Some(delay) = self.datacenter_delay_ms {
                cluster.datacenter_delay_ms = delay;
            }
            if let Some(rate) = self.snapshot_rate {
                cluster.snapshot_bytes_per_sec = rate;
            }
            if let Some(ahead) = self.clock_ahead_ms {
                cluster.clock_ahead_ms = ahead;
            }
            config.cluster = Some(cluster);
        }
        config.validate().map_err(|error| error.to_string())?;
        Ok(config)
    }
}

fn coordinator(args: CoordinatorArgs) -> Result<(), String> {
    use tessera_cluster::{ClusterMap, CoordinatorServer, FileStore, Timing, GROUPS_PER_NODE_DEFAULT};
    init_logging(&args.log)?;
    if args.failure_timeout_ms <= args.lease_ms {
        return Err("--failure-timeout-ms must be longer than --lease-ms".into());
    }
    let initial = match (&args.cluster_id, args.nodes.is_empty()) {
        (Some(id), false) if let Some(datacenters) = args.datacenters => {
            let mode = tessera_protocol::Mode::causal(&args.consistency)?;
            Some(
                ClusterMap::place_datacenters(id, mode, &args.nodes, datacenters)
                    .map_err(|error| error.to_string())?,
            )
        }
        (Some(id), false) => {
            let mode = tessera_protocol::Mode::for_table(&args.topology, &args.consistency)?;
            let members = args.members.unwrap_or(args.nodes.len());
            let groups =
                args.groups.unwrap_or((members * GROUPS_PER_NODE_DEFAULT).min(tessera_wire::slot::SLOTS));
            Some(
                ClusterMap::place_groups(id, mode, args.replicas, &args.nodes, members, groups)
                    .map_err(|error| error.to_string())?,
            )
        }
        (None, true) => None,
        _ => return Err("a new cluster needs both --cluster-id and --nodes".into()),
    };
    let listen: std::net::SocketAddr =
        format!("{}:{}", args.bind, args.port).parse().map_err(|error| format!("--bind/--port: {error}"))?;
    let timing = Timing { lease_ms: args.lease_ms, failure_timeout_ms: args.failure_timeout_ms };
    let secret = tessera_cluster::auth::ClusterSecret::load(&args.cluster_secret_file)
        .map_err(|error| error.to_string())?;
    let tls = match (&args.tls_cert_file, &args.tls_key_file, &args.tls_ca_cert_file) {
        (Some(cert), Some(key), Some(ca)) => Some(
            tessera_cluster::tls::PeerTls::from_files(cert, key, ca).map_err(|error| error.to_string())?,
        ),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|error| error.to_string())?;
    let observer = tessera_cluster::CoordinatorObserver::default();
    // The HTTP endpoints serve until the process exits.
    let (_http_stop, http_stopping) = tokio::sync::watch::channel(false);
    let serve_http =
        |flag: &str, address: &str, endpoint: std::sync::Arc<dyn tessera_cluster::http::HttpEndpoint>| {
            let listener = runtime
                .block_on(tokio::net::TcpListener::bind(address))
                .map_err(|error| format!("{flag} {address}: {error}"))?;
            runtime.spawn(tessera_cluster::http::serve(listener, endpoint, http_stopping.clone()));
            Ok::<_, String>(())
        };
    let token = |file: &Option<PathBuf>| file.as_deref().map(tessera_cluster::http::load_token).transpose();
    if let Some(address) = &args.metrics_bind {
        let endpoint = tessera_cluster::metrics::MetricsEndpoint::new(
            observer.clone(),
            token(&args.metrics_token_file)?,
        );
        serve_http("--metrics-bind", address, std::sync::Arc::new(endpoint))?;
    }
    if let Some(address) = &args.dashboard_bind {
        let endpoint = tessera_cluster::dashboard::DashboardEndpoint::new(
            observer.clone(),
            token(&args.dashboard_token_file)?,
        );
        serve_http("--dashboard-bind", address, std::sync::Arc::new(endpoint))?;
    }
    // Whichever store keeps the map, the server starts the same way.
    let start = move |store: Box<dyn tessera_cluster::MetadataStore>| async move {
        let server = CoordinatorServer::start(listen, store, initial, timing, secret, tls).await?;
        observer.lead(&server);
        Ok(server)
    };
    if let Some(endpoints) = &args.etcd {
        let cluster_id =
            args.cluster_id.clone().ok_or("--etcd needs --cluster-id (the key prefix in etcd)")?;
        let name = args.name.clone().unwrap_or_else(|| listen.to_string());
        let mut etcd = tessera_cluster::Etcd::new(endpoints)?;
        if let Some(ca_file) = &args.etcd_ca_file {
            let identity = args.etcd_cert_file.as_deref().zip(args.etcd_key_file.as_deref());
            etcd = etcd.with_tls(ca_file, identity).map_err(|error| error.to_string())?;
        }
        return runtime.block_on(coordinate_with_etcd(etcd, &cluster_id, &name, args.leader_ttl_secs, start));
    }
    runtime.block_on(async {
        let server = start(Box::new(FileStore::new(&args.dir))).await.map_err(|error| error.to_string())?;
        let map = server.map();
        tracing::info!(
            address = %server.local_addr(),
            cluster = %map.cluster_id,
            epoch = map.epoch,
            nodes = map.nodes.len(),
            shards = map.shards.len(),
            "coordinator ready"
        );
        shutdown_signal().await;
        Ok(())
    })
}

/// Waits to lead (an etcd lease on the leader key), then coordinates until
/// the lease cannot be renewed or a signal arrives. A coordinator that loses
/// the lease exits: its map writes would be refused anyway, and its
/// supervisor (or `tessera cluster`) starts it again to stand by.
async fn coordinate_with_etcd<Started>(
    etcd: tessera_cluster::Etcd,
    cluster_id: &str,
    name: &str,
    ttl_secs: u64,
    start: impl FnOnce(Box<dyn tessera_cluster::MetadataStore>) -> Started,
) -> Result<(), String>
where
    Started:
        std::future::Future<Output = Result<tessera_cluster::CoordinatorServer, tessera_cluster::StartError>>,
{
    use tessera_cluster::EtcdStore;
    let store = || EtcdStore::new(etcd.clone(), cluster_id).fenced_by(name);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut announced = false;
    let lease = loop {
        let campaign = tokio::task::spawn_blocking({
            let candidate = store();
            let name = name.to_string();
            move || candidate.campaign(&name, ttl_secs).map(|lease| (lease, candidate.leader()))
        });
        match campaign.await.map_err(|error| error.to_string())? {
            Ok((Some(lease), _)) => break lease,
            Ok((None, leader)) if !announced => {
                let leader = leader.ok().flatten().unwrap_or_default();
                tracing::info!(%name, %leader, "standing by: another coordinator leads");
                announced = true;
            }
            Ok((None, _)) => {}
            Err(error) => tracing::warn!(%error, "cannot reach etcd"),
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(300)) => {}
            _ = &mut shutdown => return Ok(()),
        }
    };
    let lease = std::sync::Arc::new(lease);
    tracing::info!(%name, "leading the cluster");
    let server = match start(Box::new(store())).await {
        Ok(server) => server,
        Err(error) => {
            lease.revoke();
            return Err(error.to_string());
        }
    };
    tracing::info!(address = %server.local_addr(), cluster = %cluster_id, epoch = server.map().epoch, "coordinator ready");
    let renew_every = std::time::Duration::from_millis(ttl_secs * 1000 / 3);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(renew_every) => {}
            _ = &mut shutdown => {
                lease.revoke();
                return Ok(());
            }
        }
        let renewing = lease.clone();
        let renewed = tokio::task::spawn_blocking(move || renewing.keep_alive()).await;
        match renewed {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(format!("lost the leadership: {error}")),
            Err(error) => return Err(error.to_string()),
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    init_logging(&args.log)?;
    let config = args.config()?;
    // Signals are awaited on this thread; the server has threads of its own.
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| error.to_string())?;
    let server = Server::start(config).map_err(|error| error.to_string())?;
    let address = server.local_addr();
    tracing::info!(%address, "tessera node ready; try: redis-cli -p {} ping", address.port());
    signals.block_on(shutdown_signal());
    server.shutdown();
    Ok(())
}

/// Logs to stderr at the level a `--log` filter gives (`info`, `tessera=debug`, ...).
fn check_history(file: &std::path::Path) -> Result<(), String> {
    use tessera_sim::linearizability::{check, Verdict};
    let text = std::fs::read_to_string(file).map_err(|error| format!("{}: {error}", file.display()))?;
    let history = tessera_sim::history::from_json_lines(&text)?;
    let keys: std::collections::HashSet<_> =
        history.operations.iter().map(|operation| &operation.key).collect();
    let summary = format!("{} operations on {} keys", history.operations.len(), keys.len());
    match check(&history) {
        Verdict::Linearizable => {
            println!("linearizable: {summary}");
            Ok(())
        }
        Verdict::Violation { key, detail } => {
            Err(format!("NOT linearizable ({summary}): key {:?}: {detail}", String::from_utf8_lossy(&key)))
        }
        Verdict::Inconclusive { key } => Err(format!(
            "inconclusive ({summary}): the search for key {:?} gave up",
            String::from_utf8_lossy(&key)
        )),
    }
}

fn check_causal(file: &std::path::Path, datacenters: bool) -> Result<(), String> {
    use tessera_sim::checks::causal::{check_in, from_json_lines, CausalCall, Scope};
    let text = std::fs::read_to_string(file).map_err(|error| format!("{}: {error}", file.display()))?;
    let operations = from_json_lines(&text)?;
    let puts = operations.iter().filter(|operation| matches!(operation.call, CausalCall::Put { .. })).count();
    let summary = format!("{} operations, {puts} puts", operations.len());
    let scope = if datacenters { Scope::SessionsAndDatacenters } else { Scope::Sessions };
    match check_in(&operations, scope).as_slice() {
        [] => {
            println!("causal: {summary}");
            Ok(())
        }
        violations => Err(format!("NOT causal ({summary}):\n  {}", violations.join("\n  "))),
    }
}

fn init_logging(args: &LogArgs) -> Result<(), String> {
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .map_err(|error| format!("--log {:?}: {error}", args.log))?;
    let writer = match &args.log_file {
        Some(path) => {
            let file = log_file::LogFile::open(path, args.log_file_max_bytes, args.log_files_kept)
                .map_err(|error| format!("--log-file {}: {error}", path.display()))?;
            BoxMakeWriter::new(file)
        }
        None => BoxMakeWriter::new(std::io::stderr),
    };
    // Colours only for a person at a terminal, not in files.
    let colours = args.log_file.is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).with_ansi(colours);
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(false).init(),
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut terminate), Ok(mut interrupt)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        // Without signal handlers, run until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = interrupt.recv() => tracing::info!("SIGINT received"),
    }
}

fn connect(args: &ConnectionArgs) -> Result<Client, String> {
    connect_to(args, args.addr())
}

/// A client of `addr` (a node of the cluster at `args.addr()`: they share its
/// password), logged in.
fn connect_to(args: &ConnectionArgs, addr: &str) -> Result<Client, String> {
    let mut client = Client::connect(addr, Duration::from_secs(10))
        .map_err(|error| format!("cannot connect to {addr}: {error}"))?;
    if let Some(password) = &args.password {
        expect_ok(client.command(&["AUTH", password.as_str()]).map_err(|error| error.to_string())?)?;
    }
    Ok(client)
}

fn expect_ok(value: Value) -> Result<Value, String> {
    match value {
        Value::Error(message) => Err(message),
        value => Ok(value),
    }
}

/// The client commands' connection: tessera-client's, on a runtime of its
/// own. A read is asked again if its answer is lost; a write is not.
struct CommandClient {
    runtime: tokio::runtime::Runtime,
    client: tessera_client::Client,
}

impl CommandClient {
    fn new(connection: &ConnectionArgs) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|error| error.to_string())?;
        let options = tessera_client::Options {
            connections_per_server: 1,
            auth: connection.password.clone().map(|password| (None, password)),
            ..tessera_client::Options::default()
        };
        Ok(Self { runtime, client: tessera_client::Client::new(connection.addr(), options) })
    }

    fn request(&self, args: &[&str], read: bool) -> Result<Value, String> {
        let command = args[1..].iter().fold(tessera_client::cmd(args[0]), |command, arg| command.arg(arg));
        let command = if read { command.idempotent() } else { command };
        self.runtime.block_on(self.client.request(&command)).map_err(|error| match error {
            tessera_client::Error::NotSent(why) => format!("cannot connect to {why}"),
            error => error.to_string(),
        })
    }
}

fn run_command(connection: &ConnectionArgs, args: &[&str]) -> Result<Value, String> {
    let read = matches!(args[0], "GET" | "TABLE.LIST" | "TABLE.INFO");
    CommandClient::new(connection)?.request(args, read)
}

fn client_command(connection: &ConnectionArgs, command: Command) -> Result<(), String> {
    match command {
        Command::Serve(_)
        | Command::Sim(_)
        | Command::Bench(_)
        | Command::Coordinator(_)
        | Command::Cluster(_)
        | Command::Repair { .. }
        | Command::TlsCerts { .. }
        | Command::CheckHistory { .. }
        | Command::ImportRdb { .. }
        | Command::Backup { .. }
        | Command::Restore { .. }
        | Command::CheckCausal { .. } => {
            unreachable!("handled by main")
        }
        Command::Get { key } => match run_command(connection, &["GET", &key])? {
            Value::Null => Err(format!("no such key: {key}")),
            value => {
                println!("{}", String::from_utf8_lossy(value.as_bytes().unwrap_or_default()));
                Ok(())
            }
        },
        Command::Set { key, value, ex } => {
            let seconds = ex.map(|seconds| seconds.to_string());
            let mut args = vec!["SET", &key, &value];
            if let Some(seconds) = &seconds {
                args.extend(["EX", seconds]);
            }
            println!("{}", run_command(connection, &args)?.render());
            Ok(())
        }
        Command::Del { keys } => {
            let mut args = vec!["DEL"];
            args.extend(keys.iter().map(String::as_str));
            println!("{}", run_command(connection, &args)?.render());
            Ok(())
        }
        Command::Scan { pattern, count } => {
            let client = CommandClient::new(connection)?;
            let mut cursor = "0".to_string();
            let count = count.to_string();
            loop {
                let mut args = vec!["SCAN", &cursor, "COUNT", &count];
                if let Some(pattern) = &pattern {
                    args.extend(["MATCH", pattern]);
                }
                let reply = client.request(&args, true)?;
                let mut parts = reply.into_items().ok_or("malformed SCAN reply")?.into_iter();
                let next = parts
                    .next()
                    .and_then(|next| next.as_bytes().map(|b| String::from_utf8_lossy(b).into_owned()));
                for key in parts.next().and_then(Value::into_items).unwrap_or_default() {
                    println!("{}", String::from_utf8_lossy(key.as_bytes().unwrap_or_default()));
                }
                match next {
                    Some(next) if next != "0" => cursor = next,
                    _ => return Ok(()),
                }
            }
        }
        Command::Table { command } => {
            let reply = match &command {
                TableCommand::Create { name, prefix, engine, options } => {
                    let options = parse_pairs(options)?;
                    let mut args = vec!["TABLE.CREATE", name, "PREFIX", prefix, "ENGINE", engine];
                    for (option, value) in &options {
                        args.extend([option.as_str(), value.as_str()]);
                    }
                    run_command(connection, &args)?
                }
                TableCommand::Drop { name } => run_command(connection, &["TABLE.DROP", name])?,
                TableCommand::List => run_command(connection, &["TABLE.LIST"])?,
                TableCommand::Info { name } => run_command(connection, &["TABLE.INFO", name])?,
            };
            println!("{}", reply.render());
            Ok(())
        }
    }
}

fn bench(args: BenchArgs, password: Option<String>) -> Result<(), String> {
    use tessera_bench::{driver, generator::Distribution, workload::Mix, workload::Workload};
    if let Some(BenchAction::Compare { reports, plot }) = &args.action {
        let mut loaded = Vec::new();
        for path in reports {
            let text =
                std::fs::read_to_string(path).map_err(|error| format!("{}: {error}", path.display()))?;
            let report: tessera_bench::report::Report = serde_json::from_str(&text)
                .map_err(|error| format!("{}: not a bench report: {error}", path.display()))?;
            let name = path
                .file_stem()
                .map_or_else(|| path.display().to_string(), |stem| stem.to_string_lossy().into());
            loaded.push((name, report));
        }
        print!("{}", tessera_bench::report::compare(&loaded));
        if let Some(dir) = plot {
            let named: Vec<_> = loaded.iter().map(|(name, report)| (name.clone(), report)).collect();
            for path in tessera_bench::plot::write_plots_of(&named, dir)? {
                println!("plot: {}", path.display());
            }
        }
        return Ok(());
    }
    if args.target.is_empty() {
        return Err("--target is required (host:port[,host:port...])".into());
    }
    let mut workload = Workload::named(&args.workload)?;
    if let Some(mix) = &args.mix {
        workload.mix = Mix::parse(mix)?;
        workload.name = format!("{} mix {mix}", workload.name);
    }
    if let Some(distribution) = &args.distribution {
        workload.distribution = distribution.parse::<Distribution>()?;
    }
    let (do_load, do_run) = match args.phase.as_str() {
        "load" => (true, false),
        "run" => (false, true),
        "both" => (true, true),
        other => return Err(format!("unknown phase {other:?}; choose load, run or both")),
    };
    let config = driver::DriverConfig {
        targets: args.target,
        cluster: args.cluster,
        connections: args.connections,
        pipeline: args.pipeline,
        records: args.records,
        operations: args.operations,
        record_kind: args.record.parse()?,
        fields: args.fields,
        field_bytes: args.field_bytes.parse().map_err(|error| format!("--field-bytes: {error}"))?,
        key_bytes: args
            .key_bytes
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|error| format!("--key-bytes: {error}"))?,
        amplify: args.amplify,
        strong_reads: args.strong_reads,
        causal: args.causal,
        seed: args.seed,
        password,
        connect_timeout: Duration::from_secs(5),
        progress: !args.quiet,
        target_rate: args.rate,
        duration: args
            .duration
            .map(|seconds| {
                (seconds > 0.0 && seconds.is_finite())
                    .then(|| Duration::from_secs_f64(seconds))
                    .ok_or("--duration must be a positive number of seconds")
            })
            .transpose()?,
    };
    config.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|error| error.to_string())?;
    runtime.block_on(async {
        let mut last = None;
        if do_load {
            let report = driver::load(&config, &workload).await?;
            print!("{}", report.render());
            last = Some(report);
        }
        if do_run {
            let report = driver::run(&config, &workload).await?;
            print!("{}", report.render());
            last = Some(report);
        }
        if let Some(report) = last {
            if let Some(path) = &args.json {
                let json = serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?;
                std::fs::write(path, json).map_err(|error| format!("{}: {error}", path.display()))?;
            }
            if let Some(path) = &args.csv {
                std::fs::write(path, report.csv()).map_err(|error| format!("{}: {error}", path.display()))?;
            }
            if let Some(dir) = &args.plot {
                for path in tessera_bench::plot::write_plots(&report, dir)? {
                    println!("plot: {}", path.display());
                }
            }
        }
        Ok(())
    })
}

/// A protocol of the registry, by name.
fn sim_protocol(name: &str) -> Result<tessera_protocol::Mode, String> {
    tessera_protocol::Mode::named(name).ok_or_else(|| {
        let names: Vec<&str> = tessera_protocol::Mode::all().map(|mode| mode.name).collect();
        format!("unknown protocol {name:?}; choose one of {}", names.join(", "))
    })
}

fn simulate(args: SimArgs) -> Result<(), String> {
    let protocol = sim_protocol(&args.protocol)?;
    if protocol.geo {
        return simulate_geo(&args, protocol);
    }
    if args.groups > 1 {
        return simulate_groups(&args, protocol);
    }
    let workload: tessera_sim::Workload = args.workload.parse()?;
    let transition_to = args.transition_to.as_deref().map(sim_protocol).transpose()?;
    if workload == tessera_sim::Workload::Collections && (!protocol.quorum || transition_to.is_some()) {
        return Err("--workload collections runs on a quorum protocol, without --transition-to: its \
                    sweep deletes through conditional batches"
            .into());
    }
    let default = tessera_sim::RunTiming::for_run(workload, protocol, transition_to);
    let config = tessera_sim::SimConfig {
        faults: tessera_sim::FaultKind::parse_list(&args.faults)?,
        workload,
        replicas: args.replicas,
        clients: args.clients,
        timing: tessera_sim::RunTiming {
            safety_ms: args.safety_ms.unwrap_or(default.safety_ms),
            liveness_ms: args.liveness_ms.unwrap_or(default.liveness_ms),
            ..default
        },
        transition_to,
        ..tessera_sim::SimConfig::new(protocol)
    };
    let name = match config.transition_to {
        Some(target) => format!("{protocol} --transition-to {target}"),
        None => protocol.to_string(),
    };
    if args.replicas == 0 || args.clients == 0 {
        return Err("--replicas and --clients must be at least 1".into());
    }
    let (mut view_changes, mut primary_changes) = (0u64, 0u64);
    let mut transition_ms: Vec<u64> = Vec::new();
    let mut strong_reads: std::collections::BTreeMap<u32, u64> = Default::default();
    let totals = run_seeds(
        &args,
        &name,
        |seed| tessera_sim::run(seed, &config),
        |report| {
            view_changes += report.view_changes;
            primary_changes += report.primary_changes;
            if let (Some(started), Some(completed)) =
                (report.transition_started_at, report.transition_completed_at)
            {
                // One that completed before it started is a violation, reported.
                transition_ms.extend(completed.checked_sub(started));
            }
            for (replica, count) in &report.strong_reads_by_replica {
                *strong_reads.entry(*replica).or_default() += count;
            }
        },
    );
    if !transition_ms.is_empty() {
        transition_ms.sort_unstable();
        println!(
            "  transitions completed {} of {}: median {} ms, slowest {} ms (virtual)",
            transition_ms.len(),
            totals.runs,
            transition_ms[transition_ms.len() / 2],
            transition_ms.last().expect("not empty")
        );
    }
    println!(
        "  operations completed {}, unknown outcome {}, view changes {view_changes} \
         ({primary_changes} replaced the head or primary)",
        totals.completed, totals.unknown
    );
    println!(
        "  acknowledged writes {}, lost {} ({:.1} per head or primary change)",
        totals.acknowledged,
        totals.lost,
        totals.lost as f64 / primary_changes.max(1) as f64
    );
    let reads: Vec<String> =
        strong_reads.iter().map(|(replica, count)| format!("n{replica}={count}")).collect();
    println!("  strong reads received per replica: {}", reads.join(" "));
    totals.passed()
}

/// What a simulation's seeds add up to, whichever simulation ran them.
#[derive(Default)]
struct SeedTotals {
    runs: u64,
    failed: u64,
    completed: u64,
    unknown: u64,
    acknowledged: u64,
    lost: u64,
}

impl SeedTotals {
    fn add(&mut self, report: &tessera_sim::Report) {
        self.runs += 1;
        self.failed += u64::from(!report.violations.is_empty());
        self.completed += report.completed;
        self.unknown += report.unknown;
        self.acknowledged += report.acknowledged_writes;
        self.lost += report.lost_acknowledged_writes;
    }

    fn passed(&self) -> Result<(), String> {
        match self.failed {
            0 => Ok(()),
            failed => Err(format!("{failed} of {} seeds violated a checked property", self.runs)),
        }
    }
}

/// Runs `run` for every seed `args` names and hands each report to `tally`:
/// prints a seed's whole trace when one seed is asked for, and every
/// violation with the command that replays it; then a summary line. Returns
/// what the seeds add up to.
fn run_seeds(
    args: &SimArgs,
    name: &str,
    run: impl Fn(u64) -> tessera_sim::Report,
    mut tally: impl FnMut(&tessera_sim::Report),
) -> SeedTotals {
    let seeds = match args.seed {
        Some(seed) => seed..seed + 1,
        None => args.first_seed..args.first_seed + args.seeds,
    };
    let started = std::time::Instant::now();
    let progress = args.seed.is_none().then(|| Progress::new(name, Some(seeds.end - seeds.start)));
    let (mut totals, mut inconclusive) = (SeedTotals::default(), 0u64);
    for seed in seeds {
        let report = run(seed);
        totals.add(&report);
        inconclusive += u64::from(report.inconclusive);
        tally(&report);
        if let Some(progress) = &progress {
            progress.advance(1, &format!("{} failed", totals.failed));
        }
        if args.seed.is_some() {
            println!("seed {seed}: faults {}", report.faults.describe());
            for line in &report.log {
                println!("  {line}");
            }
            if std::env::var_os("TESSERA_SIM_HISTORY").is_some() {
                for operation in &report.history.operations {
                    println!("  {operation:?}");
                }
            }
        }
        if !report.violations.is_empty() {
            print_failure(progress.as_ref(), seed, &report.faults.describe(), &report.violations, name);
        }
    }
    if let Some(progress) = progress {
        progress.finish();
    }
    println!(
        "{name}: {} seeds in {:.1}s, {} failed, {inconclusive} inconclusive",
        totals.runs,
        started.elapsed().as_secs_f64(),
        totals.failed
    );
    totals
}

/// A failed seed: its faults, its violations and the command that replays
/// it, on stdout (above the progress bar, if there is one).
fn print_failure(
    progress: Option<&Progress>,
    seed: u64,
    faults: &str,
    violations: &[String],
    protocol: &str,
) {
    let mut lines = vec![format!("FAIL seed {seed} faults {faults}")];
    lines.extend(violations.iter().map(|violation| format!("  {violation}")));
    lines.push(format!("  replay: tessera sim --protocol {protocol} --seed {seed}"));
    let text = lines.join("\n");
    match progress {
        Some(progress) => progress.println(&text),
        None => println!("{text}"),
    }
}

/// `tessera sim --protocol cops` (or another causal protocol): datacenters
/// of partitions under faults, the history checked for causal consistency
/// (docs/PROTOCOLS.md, "Causal consistency across datacenters").
fn simulate_geo(args: &SimArgs, mode: tessera_protocol::Mode) -> Result<(), String> {
    let scope = tessera_sim::geo::scope_of(mode);
    if args.datacenters < 2 || args.partitions == 0 || args.clients == 0 {
        return Err("--datacenters must be at least 2, --partitions and --clients at least 1".into());
    }
    if args.chains == 0 || !(0.0..=1.0).contains(&args.expiring) {
        return Err("--chains must be at least 1 and --expiring between 0 and 1".into());
    }
    if args.visibility {
        return measure_visibility(args, mode);
    }
    let seeds = match args.seed {
        Some(seed) => seed..seed + 1,
        None => args.first_seed..args.first_seed + args.seeds,
    };
    let started = std::time::Instant::now();
    let progress = args.seed.is_none().then(|| Progress::new(&args.protocol, Some(seeds.end - seeds.start)));
    let (mut runs, mut failed, mut operations, mut writes) = (0u64, 0u64, 0usize, 0usize);
    for seed in seeds {
        let defaults = tessera_sim::geo::GeoConfig::new(seed, mode);
        let config = tessera_sim::geo::GeoConfig {
            datacenters: args.datacenters,
            partitions: args.partitions,
            sessions_per_datacenter: args.clients,
            run_ms: args.safety_ms.unwrap_or(defaults.run_ms),
            quiet_ms: args.liveness_ms.unwrap_or(defaults.quiet_ms),
            check_causal: scope,
            chains: args.chains,
            expiring: args.expiring,
            ..defaults
        };
        let report = tessera_sim::geo::run(config);
        runs += 1;
        operations += report.operations;
        writes += report.writes;
        if args.seed.is_some() {
            println!("seed {seed}: faults {}", report.faults.join("; "));
        }
        if !report.violations.is_empty() {
            failed += 1;
            print_failure(
                progress.as_ref(),
                seed,
                &report.faults.join("; "),
                &report.violations,
                &args.protocol,
            );
        }
        if let Some(progress) = &progress {
            progress.advance(1, &format!("{failed} failed"));
        }
    }
    if let Some(progress) = progress {
        progress.finish();
    }
    println!(
        "{}: {runs} seeds in {:.1}s, {failed} failed; operations completed {operations}, writes {writes}",
        args.protocol,
        started.elapsed().as_secs_f64()
    );
    match failed {
        0 => Ok(()),
        failed => Err(format!("{failed} of {runs} seeds violated a checked property")),
    }
}

/// `tessera sim --protocol P --visibility`: the virtual milliseconds from a
/// write's acknowledgement to its sight in the other datacenters, by skew.
fn measure_visibility(args: &SimArgs, mode: tessera_protocol::Mode) -> Result<(), String> {
    let scope = tessera_sim::geo::scope_of(mode);
    let skews: Vec<u64> = args
        .skews
        .split(',')
        .map(|skew| skew.trim().parse().map_err(|_| format!("--skews: {skew:?} is not a number of ms")))
        .collect::<Result<_, _>>()?;
    println!("{}: one-way delay {} ms, {} seeds per skew", args.protocol, args.delay_ms, args.seeds);
    for skew_ms in skews {
        let mut samples = Vec::new();
        let (mut operations, mut writes, mut shipped) = (0, 0, 0);
        for seed in args.first_seed..args.first_seed + args.seeds {
            let defaults = tessera_sim::geo::GeoConfig::new(seed, mode);
            let config = tessera_sim::geo::GeoConfig {
                datacenters: args.datacenters,
                partitions: args.partitions,
                sessions_per_datacenter: args.clients,
                chains: 100,
                check_causal: scope,
                measure: Some(tessera_sim::geo::Measure { skew_ms, delay_ms: args.delay_ms }),
                expiring: 0.0,
                ..defaults
            };
            let report = tessera_sim::geo::run(config);
            if !report.violations.is_empty() {
                return Err(format!("seed {seed} at skew {skew_ms} ms: {:?}", report.violations));
            }
            operations += report.operations;
            writes += report.writes;
            shipped += report.writes_shipped;
            samples.extend(report.visibility_ms);
        }
        samples.sort_unstable();
        let at = |fraction: f64| samples.get(((samples.len() as f64 - 1.0) * fraction) as usize).copied();
        match (at(0.5), at(0.9), at(0.99)) {
            (Some(median), Some(p90), Some(p99)) => println!(
                "  skew {skew_ms:>3} ms: visible after median {median} ms, p90 {p90}, p99 {p99} ({} writes seen, {operations} operations; each write sent {:.2} times to each other datacenter)",
                samples.len(),
                shipped as f64 / (writes * (args.datacenters - 1)).max(1) as f64
            ),
            _ => println!("  skew {skew_ms:>3} ms: no write seen"),
        }
    }
    Ok(())
}

/// `tessera sim --groups G`: slot migrations between groups under faults
/// (docs/PROTOCOLS.md, "Slot migration").
fn simulate_groups(args: &SimArgs, protocol: tessera_protocol::Mode) -> Result<(), String> {
    if args.transition_to.is_some() || args.workload != "registers" {
        return Err("--groups chooses its workload by the mode (registers when strong, appends when \
                    eventual) and runs without --transition-to"
            .into());
    }
    if args.replicas as u64 > u64::from(args.nodes) || args.clients == 0 || args.replicas == 0 {
        return Err("--groups needs --replicas between 1 and --nodes, and a client".into());
    }
    let default = tessera_sim::groups::GroupsConfig::new(protocol);
    let config = tessera_sim::groups::GroupsConfig {
        nodes: args.nodes,
        groups: args.groups,
        replicas: args.replicas as usize,
        clients: args.clients,
        // Of those asked for, the faults this simulation injects.
        faults: tessera_sim::FaultKind::parse_list(&args.faults)?
            .intersection(&default.faults)
            .copied()
            .collect(),
        timing: tessera_sim::RunTiming {
            safety_ms: args.safety_ms.unwrap_or(default.timing.safety_ms),
            liveness_ms: args.liveness_ms.unwrap_or(default.timing.liveness_ms),
            ..default.timing
        },
        ..default
    };
    let name = format!("{protocol} --groups {} --nodes {}", args.groups, args.nodes);
    let mut migrations = 0;
    let totals = run_seeds(
        args,
        &name,
        |seed| tessera_sim::groups::run(seed, &config),
        |report| migrations += report.migrations_completed,
    );
    println!(
        "  migrations completed {migrations}, operations completed {}, unknown outcome {}",
        totals.completed, totals.unknown
    );
    println!("  acknowledged writes {}, lost {}", totals.acknowledged, totals.lost);
    totals.passed()
}

/// Repairs every log under `dir` (a node keeps one per table and per shard).
fn repair(dir: &Path) -> Result<(), String> {
    fn logs_under(dir: &Path, found: &mut Vec<PathBuf>) -> Result<(), String> {
        let entries = std::fs::read_dir(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
        let mut holds_segments = false;
        for entry in entries {
            let path = entry.map_err(|error| error.to_string())?.path();
            if path.is_dir() {
                logs_under(&path, found)?;
            } else if path.extension().is_some_and(|extension| extension == "seg") {
                holds_segments = true;
            }
        }
        if holds_segments {
            found.push(dir.to_path_buf());
        }
        Ok(())
    }
    let mut logs = Vec::new();
    logs_under(dir, &mut logs)?;
    if logs.is_empty() {
        return Err(format!("no log engine data under {}", dir.display()));
    }
    for log in logs {
        let repairs =
            tessera_engine::repair_log(&log).map_err(|error| format!("{}: {error}", log.display()))?;
        if repairs.is_empty() {
            println!("{}: no damage", log.display());
        }
        for repair in repairs {
            let dropped: u64 = repair.damaged.iter().map(|(_, bytes)| bytes).sum();
            let stretches: Vec<String> =
                repair.damaged.iter().map(|(at, bytes)| format!("{bytes} bytes at offset {at}")).collect();
            println!(
                "{}: kept {} records, dropped {dropped} damaged bytes ({})",
                repair.file.display(),
                repair.records_kept,
                stretches.join(", ")
            );
        }
    }
    Ok(())
}

/// Counts what the node allocates: `used_memory`, which `maxmemory` bounds.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn parse_maxmemory(text: &str) -> Result<u64, String> {
    parse_size(text).ok_or_else(|| format!("not a size: {text} (bytes, or a number with kb, mb, gb)"))
}

fn parse_auth_clients(text: &str) -> Result<AuthClients, String> {
    AuthClients::parse(text).ok_or_else(|| format!("{text}: one of yes, optional, no"))
}

fn parse_eviction_policy(text: &str) -> Result<EvictionPolicy, String> {
    EvictionPolicy::parse(text).ok_or_else(|| {
        let names: Vec<&str> = EvictionPolicy::ALL.iter().map(|policy| policy.name()).collect();
        format!("unknown policy {text}; one of {}", names.join(", "))
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Sim(args) => simulate(args),
        Command::Coordinator(args) => coordinator(*args),
        Command::Cluster(command) => cluster::run(command),
        Command::CheckHistory { file } => check_history(&file),
        Command::CheckCausal { file, datacenters } => check_causal(&file, datacenters),
        Command::Repair { dir } => repair(&dir),
        Command::TlsCerts { dir, hosts } => tessera_cluster::tls::write_certificates(&dir, &hosts),
        Command::Bench(args) => bench(*args, cli.connection.password.clone()),
        Command::ImportRdb { file, db, replace } => connect(&cli.connection).and_then(|mut client| {
            import_rdb::run(&file, &mut client, &import_rdb::ImportOptions { db, replace })
        }),
        Command::Backup { to } => backup::backup(&cli.connection, &to),
        Command::Restore { from, replace } => backup::restore(&cli.connection, &from, replace),
        command => client_command(&cli.connection, command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tessera: {message}");
            ExitCode::FAILURE
        }
    }
}
