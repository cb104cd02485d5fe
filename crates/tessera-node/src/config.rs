//! Node configuration: a TOML file, overridden by command-line flags. Every
//! limit on what clients may send is here, with a default that is safe.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tessera_wire::Limits;

use crate::memory::EvictionPolicy;

/// How far ahead `cluster.clock_ahead_ms` may set a clock: skew worth
/// studying is milliseconds; peers refuse versions from ten seconds ahead.
pub const CLOCK_AHEAD_MAX_MS: u64 = 1000;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address to listen on.
    pub bind: String,
    pub port: u16,
    /// Data directory: table catalog and persistent engines' files.
    pub dir: PathBuf,
    /// Engine of the default table (memory, ordered, log, lsm, hybrid, redis).
    pub engine: String,
    /// Options of the default table's engine (e.g. fsync = "always").
    pub engine_options: BTreeMap<String, String>,
    /// Clients must AUTH with this password; none = open.
    pub password: Option<String>,
    /// The `host:port`s a table on the `redis` engine may be created over
    /// (besides the default table's own server): none by default, so that a
    /// client cannot point the node at any server it likes.
    pub redis_engine_allow: Vec<String>,
    /// Worker threads; 0 = one per core.
    pub threads: usize,
    pub max_clients: usize,
    /// Largest bulk string a client may send (Redis's proto-max-bulk-len).
    pub bulk_bytes_max: usize,
    /// Most arguments in one command.
    pub args_max: usize,
    /// Longest inline (telnet-style) command.
    pub inline_bytes_max: usize,
    /// Unparsed input a connection may hold before it is closed.
    pub query_buffer_bytes_max: usize,
    /// Unparsed input all connections together may hold: past it, a
    /// connection whose buffer grows beyond 1 MiB is closed. 0: no budget.
    pub query_buffer_budget: usize,
    /// Replies a client may have pending before it is disconnected (Redis's
    /// client-output-buffer-limit hard limit for normal clients); 0: none.
    pub client_output_buffer_limit: usize,
    /// Seconds a client may stay idle before it is closed (Redis's
    /// timeout); 0: never.
    pub timeout: u64,
    /// Bytes of memory the node may use (Redis's maxmemory); past it, writes
    /// that may grow memory evict keys or are refused. 0: no limit.
    pub maxmemory: u64,
    pub maxmemory_policy: EvictionPolicy,
    /// Keys sampled per eviction (Redis's maxmemory-samples).
    pub maxmemory_samples: usize,
    /// How long shutdown waits for connections to finish their requests.
    pub shutdown_timeout_ms: u64,
    /// How long a script runs before other clients are answered BUSY and
    /// SCRIPT KILL may stop it (Redis's busy-reply-threshold, or
    /// lua-time-limit).
    pub busy_reply_threshold_ms: u64,
    /// Reads of the disk that commands would wait for, made ahead of them
    /// off the serving threads, at most this many at once node-wide; 0: a
    /// command reads the disk on its serving thread.
    pub disk_reads_in_flight: usize,
    /// How often expired keys are swept, and how many entries per table each sweep reads.
    pub expiry_sweep_interval_ms: u64,
    pub expiry_sweep_entries: usize,
    /// A second client port speaking TLS (Redis's tls-port); 0: none.
    pub tls_port: u16,
    /// The node's certificate chain and private key, PEM.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// The CA whose client certificates the TLS port accepts, PEM.
    pub tls_ca_cert_file: Option<PathBuf>,
    /// Whether TLS clients must present a certificate: yes, optional or no.
    pub tls_auth_clients: AuthClients,
    /// Peer links and the coordinator session in mutual TLS (Redis's
    /// tls-cluster), with the same certificate, key and CA.
    pub tls_cluster: bool,
    /// Where to serve Prometheus metrics (`host:port`, path /metrics); none:
    /// no endpoint.
    pub metrics_bind: Option<String>,
    /// A file whose first line is the bearer token a scrape must present;
    /// none: any scrape is answered (bind the endpoint to a private address).
    pub metrics_token_file: Option<PathBuf>,
    /// Set to run as a member of a cluster (docs/OPERATIONS.md, "Clusters").
    pub cluster: Option<ClusterConfig>,
}

/// A node's place in a cluster. The node serves clients on its port and
/// peers on that port + 10000, as Redis Cluster does.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Must match the coordinator's: a node of another cluster is refused.
    pub id: String,
    /// This node's id in the cluster map.
    pub node: u32,
    /// The coordinator's `host:port`.
    pub coordinator: String,
    /// The cluster secret every node and coordinator of the cluster shares
    /// (`cluster up` writes one; mode 0600).
    pub secret_file: PathBuf,
    #[serde(default = "ClusterConfig::default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    #[serde(default = "ClusterConfig::default_tick_ms")]
    pub tick_ms: u64,
    /// Writes waiting to commit on this node beyond which new writes wait.
    #[serde(default = "ClusterConfig::default_max_uncommitted_writes")]
    pub max_uncommitted_writes: usize,
    /// The most bytes per second this node sends one snapshot stream to a
    /// joining replica; 0: as fast as the receiver takes them.
    #[serde(default = "ClusterConfig::default_snapshot_bytes_per_sec")]
    pub snapshot_bytes_per_sec: u64,
    /// A test and benchmark option: messages from peers in other
    /// datacenters are held this long before they are handled, so that WAN
    /// latency can be studied on one machine (0: none).
    #[serde(default)]
    pub datacenter_delay_ms: u64,
    /// A test and benchmark option: this node's clock runs this far ahead of
    /// the wall clock, so that clock skew can be studied on one machine.
    #[serde(default)]
    pub clock_ahead_ms: u64,
}

impl ClusterConfig {
    pub fn new(id: &str, node: u32, coordinator: &str, secret_file: &Path) -> Self {
        Self {
            id: id.to_string(),
            node,
            coordinator: coordinator.to_string(),
            secret_file: secret_file.to_path_buf(),
            heartbeat_ms: Self::default_heartbeat_ms(),
            tick_ms: Self::default_tick_ms(),
            max_uncommitted_writes: Self::default_max_uncommitted_writes(),
            snapshot_bytes_per_sec: Self::default_snapshot_bytes_per_sec(),
            datacenter_delay_ms: 0,
            clock_ahead_ms: 0,
        }
    }

    fn default_heartbeat_ms() -> u64 {
        100
    }

    fn default_tick_ms() -> u64 {
        10
    }

    fn default_max_uncommitted_writes() -> usize {
        16_384
    }

    fn default_snapshot_bytes_per_sec() -> u64 {
        tessera_protocol::registry::SNAPSHOT_BYTES_PER_SEC_DEFAULT
    }
}

impl Default for Config {
    fn default() -> Self {
        let limits = Limits::default();
        Self {
            bind: "127.0.0.1".into(),
            port: 7379,
            dir: PathBuf::from("./tessera-data"),
            engine: "memory".into(),
            engine_options: BTreeMap::new(),
            password: None,
            redis_engine_allow: Vec::new(),
            threads: 0,
            max_clients: 10_000,
            bulk_bytes_max: limits.bulk_bytes_max,
            args_max: limits.args_max,
            inline_bytes_max: limits.inline_bytes_max,
            query_buffer_bytes_max: 1 << 30,
            query_buffer_budget: 2 << 30,
            client_output_buffer_limit: 0,
            timeout: 0,
            maxmemory: 0,
            maxmemory_policy: EvictionPolicy::Noeviction,
            maxmemory_samples: 5,
            shutdown_timeout_ms: 5_000,
            busy_reply_threshold_ms: 5_000,
            disk_reads_in_flight: 64,
            expiry_sweep_interval_ms: 100,
            expiry_sweep_entries: 256,
            tls_port: 0,
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_cert_file: None,
            tls_auth_clients: AuthClients::Yes,
            tls_cluster: false,
            metrics_bind: None,
            metrics_token_file: None,
            cluster: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0}: {1}")]
    File(PathBuf, String),
    #[error("config: {0}")]
    Invalid(String),
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| ConfigError::File(path.into(), error.to_string()))?;
        toml::from_str(&text).map_err(|error| ConfigError::File(path.into(), error.to_string()))
    }

    /// The worker threads to run: `threads`, or one per core.
    pub fn worker_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |cores| cores.get()),
            threads => threads,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: &str| Err(ConfigError::Invalid(message.into()));
        if let Err(error) = self.engine.parse::<tessera_engine::EngineKind>() {
            return Err(ConfigError::Invalid(error.to_string()));
        }
        if self.max_clients == 0 {
            return invalid("max_clients must be at least 1");
        }
        if self.bulk_bytes_max == 0 || self.bulk_bytes_max > (u32::MAX as usize - 1) {
            return invalid("bulk_bytes_max must be between 1 and 4294967294");
        }
        if self.args_max == 0 || self.inline_bytes_max == 0 {
            return invalid("args_max and inline_bytes_max must be at least 1");
        }
        if self.query_buffer_budget != 0 && self.query_buffer_budget < self.bulk_bytes_max {
            return invalid("query_buffer_budget must be 0 (none) or at least bulk_bytes_max");
        }
        if self.maxmemory_samples == 0 {
            return invalid("maxmemory_samples must be at least 1");
        }
        if self.query_buffer_bytes_max < self.bulk_bytes_max {
            return invalid("query_buffer_bytes_max must be at least bulk_bytes_max");
        }
        if self.expiry_sweep_interval_ms == 0 || self.expiry_sweep_entries == 0 {
            return invalid("expiry_sweep_interval_ms and expiry_sweep_entries must be at least 1");
        }
        if self.metrics_token_file.is_some() && self.metrics_bind.is_none() {
            return invalid("metrics_token_file guards the metrics endpoint: set metrics_bind too");
        }
        if let Some(cluster) = &self.cluster {
            if cluster.id.is_empty() || cluster.coordinator.is_empty() {
                return invalid("cluster.id and cluster.coordinator must not be empty");
            }
            if cluster.heartbeat_ms == 0 || cluster.tick_ms == 0 {
                return invalid("cluster.heartbeat_ms and cluster.tick_ms must be at least 1");
            }
            if cluster.clock_ahead_ms > CLOCK_AHEAD_MAX_MS {
                return invalid(&format!("cluster.clock_ahead_ms is at most {CLOCK_AHEAD_MAX_MS}"));
            }
            if self.port > u16::MAX - 10_000 {
                return invalid("a cluster node's port must leave room for its peer port (port + 10000)");
            }
        }
        Ok(())
    }

    pub fn limits(&self) -> Limits {
        Limits {
            bulk_bytes_max: self.bulk_bytes_max,
            args_max: self.args_max,
            inline_bytes_max: self.inline_bytes_max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        assert!(toml::from_str::<Config>("prot = 1").is_err());
        let config: Config = toml::from_str("engine = \"nosuch\"").unwrap();
        assert!(config.validate().is_err());
        let config: Config = toml::from_str("port = 9000\n[engine_options]\nfsync = \"always\"").unwrap();
        assert_eq!(config.port, 9000);
        assert_eq!(config.engine_options["fsync"], "always");
        config.validate().unwrap();
        // A token for an endpoint that is not served would guard nothing.
        let config: Config = toml::from_str("metrics_token_file = \"/etc/tessera/metrics.token\"").unwrap();
        assert!(config.validate().unwrap_err().to_string().contains("metrics_bind"));
    }
}

/// Whether clients on the TLS port must present a certificate.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AuthClients {
    #[default]
    Yes,
    Optional,
    No,
}

impl AuthClients {
    pub fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_lowercase().as_str() {
            "yes" => Some(AuthClients::Yes),
            "optional" => Some(AuthClients::Optional),
            "no" => Some(AuthClients::No),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AuthClients::Yes => "yes",
            AuthClients::Optional => "optional",
            AuthClients::No => "no",
        }
    }
}
