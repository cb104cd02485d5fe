//! A node's place in a cluster as commands see it: the agent, whose map the
//! node routes by, and the node's own address. CLUSTER SLOTS, CONSISTENCY and
//! DBSIZE need no more; the cluster wing ([`crate::cluster`]), which places
//! and serves requests, builds on it.

use std::sync::Arc;

use tessera_cluster::agent::Agent;
use tessera_cluster::ClusterMap;
use tessera_protocol::Mode;

use crate::error::{CommandError, CommandResult};

#[derive(Clone)]
pub struct Membership {
    pub agent: Arc<Agent>,
    /// This node's client address, as the map names it.
    pub address: String,
}

impl Membership {
    /// The map this node routes by.
    pub fn map(&self) -> CommandResult<Arc<ClusterMap>> {
        self.agent.routing().map(|routing| routing.map).ok_or_else(CommandError::no_map_yet)
    }

    /// The causal protocol the cluster runs across datacenters, if it is
    /// laid out across them, and this node's datacenter.
    pub fn causal(&self) -> Option<(Mode, u32)> {
        let routing = self.agent.routing()?;
        let map = &routing.map;
        let datacenter = map.node(self.agent.node_id())?.datacenter;
        map.mode.geo.then_some((map.mode, datacenter))
    }

    /// Whether a read asking for strong consistency gets it: unless some
    /// shard runs a mode without strong reads (active–active eventual).
    pub fn strong_reads(&self) -> bool {
        self.agent.routing().is_some_and(|routing| {
            let map = &routing.map;
            map.shards.iter().all(|shard| {
                let mode = map.mode_of(shard);
                mode.strong || !mode.active_active
            })
        })
    }
}

/// A node's place in a group, as INFO and the metrics name it.
pub fn role_name(role: Option<tessera_protocol::Role>) -> &'static str {
    use tessera_protocol::Role;
    match role {
        Some(Role::Head | Role::Alone) => "head",
        Some(Role::Learner) => "learner",
        Some(Role::Middle | Role::Tail) => "member",
        None => "leaving",
    }
}
