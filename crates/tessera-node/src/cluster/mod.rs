//! A node as a member of a cluster (docs/ARCHITECTURE.md, "Clusters"): the
//! agent that runs its shards, where each request goes, and the writes still
//! on their way through replication.
//!
//! A request's keys name one hash slot, the slot one shard. The shard's head
//! runs writes and strong reads; a READONLY connection reads from any member.
//! Anywhere else a cluster client is told `MOVED`, and a plain client's request
//! is forwarded to the head and the answer relayed.

mod admin;
mod forward;
mod placement;
mod reshard;
mod serve;
mod slot_stats;
mod upkeep;

pub use forward::Forwarder;
pub use placement::Placement;
pub use serve::{serve, Held};

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tessera_cluster::agent::{Agent, AgentConfig, AgentError};
use tessera_cluster::auth::{ClusterSecret, SecretError};
use tessera_cluster::tls::TlsError;
use tessera_engine::{EngineError, EngineKind, EngineSpec};

use crate::config::Config;
use crate::membership::Membership;

/// Where a node keeps the incarnation of its persistent state.
const INCARNATION_FILE: &str = "cluster-incarnation";

/// Why a node could not join its cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("no [cluster] section")]
    NotConfigured,
    #[error("the redis engine cannot back a cluster's shards: they would share one database")]
    RedisEngine,
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{path}: {reason}")]
    Incarnation { path: String, reason: String },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("tls_cluster: {0}")]
    Tls(#[from] TlsError),
}

pub struct ClusterNode {
    pub membership: Membership,
    /// The engine of the default table's shards.
    engine: EngineSpec,
    /// Request and reply bytes served here, per slot (CLUSTER SLOT-STATS).
    traffic: slot_stats::SlotTraffic,
    /// The expiry sweep's deletes of orphaned entries still under way.
    orphan_deletes: upkeep::OrphanDeletes,
}

/// How long a request waits for its shard to finish switching modes.
const TRANSITION_WAIT: Duration = Duration::from_secs(10);

impl std::ops::Deref for ClusterNode {
    type Target = Membership;

    fn deref(&self) -> &Membership {
        &self.membership
    }
}

impl ClusterNode {
    /// Joins the cluster and starts the agent's loops on `runtime`: the first
    /// worker's, so that a write's way from a client to its peers and back
    /// stays on one thread when there is one worker.
    pub fn start(
        config: &Config,
        client_address: SocketAddr,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Self, JoinError> {
        let settings = config.cluster.as_ref().ok_or(JoinError::NotConfigured)?;
        let kind: EngineKind = config.engine.parse()?;
        if kind == EngineKind::Redis {
            return Err(JoinError::RedisEngine);
        }
        let engine = EngineSpec::new(kind, config.engine_options.clone())?;
        let secret = ClusterSecret::load(&settings.secret_file)?;
        let incarnation = incarnation(&config.dir, kind.capabilities().persistent)?;
        let peer_listen = SocketAddr::new(client_address.ip(), client_address.port() + 10_000);
        let tls = crate::tls::peer_tls(config)?;
        let agent_config = AgentConfig {
            cluster_id: settings.id.clone(),
            node: settings.node,
            secret,
            incarnation,
            coordinator: settings.coordinator.clone(),
            peer_listen,
            data_dir: config.dir.clone(),
            engine: engine.clone(),
            heartbeat_ms: settings.heartbeat_ms,
            tick_ms: settings.tick_ms,
            max_uncommitted_writes: settings.max_uncommitted_writes,
            snapshot_bytes_per_sec: Some(settings.snapshot_bytes_per_sec).filter(|rate| *rate > 0),
            tls,
            tls_client_port: config.tls_port,
            datacenter_delay: Some(Duration::from_millis(settings.datacenter_delay_ms))
                .filter(|delay| !delay.is_zero()),
            clock_ahead: Duration::from_millis(settings.clock_ahead_ms),
        };
        let agent = runtime.block_on(Agent::start(agent_config))?;
        let address = format!("{}:{}", config.bind, client_address.port());
        tracing::info!(node = settings.node, incarnation, %address, "joined cluster {}", settings.id);
        Ok(Self {
            membership: Membership { agent, address },
            engine,
            traffic: Default::default(),
            orphan_deletes: Default::default(),
        })
    }
}

/// The incarnation names this node's state: a memory engine starts empty every
/// time, so it takes a new one at every start; a persistent engine keeps one in
/// its data directory for as long as the data lives.
fn incarnation(dir: &Path, persistent: bool) -> Result<u64, JoinError> {
    let fresh = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |now| now.as_micros() as u64);
    if !persistent {
        return Ok(fresh);
    }
    let path = dir.join(INCARNATION_FILE);
    let failed = |reason: String| JoinError::Incarnation { path: path.display().to_string(), reason };
    match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().map_err(|_| failed("not an incarnation number".into())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let temporary = path.with_extension("tmp");
            std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&temporary, fresh.to_string()))
                .and_then(|()| std::fs::rename(&temporary, &path))
                .map_err(|error| failed(error.to_string()))?;
            Ok(fresh)
        }
        Err(error) => Err(failed(error.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnations_are_kept_only_for_persistent_state() {
        let dir = tempfile::tempdir().unwrap();
        let first = incarnation(dir.path(), true).unwrap();
        assert_eq!(incarnation(dir.path(), true).unwrap(), first, "kept with the data");
        std::thread::sleep(Duration::from_millis(2));
        assert_ne!(incarnation(dir.path(), false).unwrap(), first, "memory state is new every start");
        std::fs::write(dir.path().join(INCARNATION_FILE), "garbage").unwrap();
        assert!(incarnation(dir.path(), true).unwrap_err().to_string().contains("not an incarnation"));
    }
}
