//! Where a request on a cluster node is served: here, through a quorum, at
//! another node, or refused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_cluster::agent::Completion;
use tessera_cluster::{NodeInfo, DEFAULT_TABLE};
use tessera_engine::Engine;
use tessera_protocol::Refusal;
use tessera_wire::slot::key_slot;

use super::{ClusterNode, TRANSITION_WAIT};
use crate::error::CommandError;

/// How long a request waits for its shard to settle on this node (a head
/// handover's or failover's grant on its way): longer than a heartbeat.
const SETTLE_WAIT: Duration = Duration::from_secs(2);
/// How often it looks again meanwhile.
const SETTLE_POLL: Duration = Duration::from_millis(5);

/// Where a request is served.
pub enum Placement {
    /// Not about keys (PING, INFO, CLUSTER ...): this node answers.
    Local,
    /// This node serves it from shard `shard`, whose engine is `engine`; a
    /// strong read's answer first waits for `barrier` (the head's first
    /// write in its view) to commit.
    Shard { shard: u32, engine: Arc<dyn Engine>, barrier: Option<Completion> },
    /// A strong request on a shard running a quorum protocol (AA+SC) this node is a member of:
    /// it runs through the protocol, not on this node's copy.
    Quorum { shard: u32, engine: Arc<dyn Engine> },
    /// Another node, `head`, is the owner; `forward_only` when a cluster
    /// client must not be told MOVED either (see [`ClusterNode::place`]).
    Elsewhere { slot: u16, head: NodeInfo, forward_only: bool },
    /// The shard is switching modes here: ask again once it has
    /// ([`Agent::wait_while_draining`](tessera_cluster::agent::Agent::wait_while_draining)).
    Draining { shard: u32 },
    /// The shard is changing hands here: the map names this node its head
    /// before the grant of that view arrived, a lease is being renewed, or a
    /// new head's first write has not committed. Ask again shortly; the
    /// error is the client's if it lasts.
    Settling(CommandError),
    /// An error for the client (keys in several slots, no map yet, ...).
    Refused(CommandError),
}

impl ClusterNode {
    /// [`Self::place`], waiting while the keys' shard switches modes (up to
    /// [`TRANSITION_WAIT`]: writes and strong reads are then placed by the
    /// new mode) or changes hands here (up to [`SETTLE_WAIT`], then its
    /// error is the client's).
    pub async fn place_when_settled<'k, I: Iterator<Item = &'k [u8]>>(
        &self,
        keys: impl Fn() -> I,
        write: bool,
        strong: bool,
    ) -> Placement {
        let waiting_since = Instant::now();
        loop {
            match self.place(keys(), write, strong) {
                Placement::Draining { shard } if waiting_since.elapsed() < TRANSITION_WAIT => {
                    self.agent.wait_while_draining(shard, TRANSITION_WAIT - waiting_since.elapsed()).await
                }
                Placement::Settling(_) if waiting_since.elapsed() < SETTLE_WAIT => {
                    tokio::time::sleep(SETTLE_POLL).await
                }
                placement => return placement,
            }
        }
    }

    /// Decides where a request with these keys is served: a write, a strong
    /// read, or (`strong` false: a READONLY connection's read) an eventual one.
    pub fn place<'k>(
        &self,
        mut keys: impl Iterator<Item = &'k [u8]>,
        write: bool,
        strong: bool,
    ) -> Placement {
        let Some(first) = keys.next() else { return Placement::Local };
        let Some(routing) = self.agent.routing() else {
            return Placement::Refused(CommandError::no_map_yet());
        };
        let slot = key_slot(first) as u16;
        let table = routing.table_of(first);
        let Some(shard) = routing.shard_of(table, first, slot) else {
            return Placement::Refused(CommandError::ClusterDown(format!("Hash slot {slot} not served")));
        };
        // A range-partitioned table's keys go together when they are in one
        // range, whatever their slots.
        let range_partitioned = routing.ranges(table).is_some();
        if keys.any(|key| {
            routing.table_of(key) != table
                || if range_partitioned {
                    routing.shard_of(table, key, slot) != Some(shard)
                } else {
                    key_slot(key) as u16 != slot
                }
        }) {
            return Placement::Refused(CommandError::CrossSlot(if range_partitioned {
                format!("Keys in request span several key ranges of table {table}")
            } else {
                "Keys in request don't hash to the same slot (or belong to different tables)".into()
            }));
        }
        let snapshot = self.agent.snapshot(shard);
        let checked = match &snapshot {
            None => Err(Refusal::NotOwner),
            Some(snapshot) if write => snapshot.write.map(|()| None),
            Some(snapshot) if strong => snapshot.strong_read.clone(),
            Some(snapshot) => snapshot.eventual_read.map(|()| None),
        };
        match (checked, snapshot) {
            (Ok(_), Some(snapshot)) if strong && snapshot.mode.quorum => {
                Placement::Quorum { shard, engine: snapshot.engine }
            }
            (Ok(barrier), Some(snapshot)) => Placement::Shard { shard, engine: snapshot.engine, barrier },
            (Ok(_), None) => unreachable!("a shard that is not here refuses"),
            (Err(Refusal::Draining), _) => Placement::Draining { shard },
            (Err(Refusal::LeaseExpired), _) => {
                Placement::Settling(CommandError::TryAgain("the shard's lease is being renewed".into()))
            }
            (Err(Refusal::Unsettled), _) => {
                Placement::Settling(CommandError::TryAgain("the shard's new head has not settled yet".into()))
            }
            (Err(Refusal::NotOwner), _) => match routing.head(shard) {
                Some(head) if head.address != self.address => {
                    // Cluster clients route by slot to the default table's
                    // head; if that is this node, another table's shard has a
                    // different head here: forward rather than MOVE the slot.
                    // A key range is not a slot at all: always forwarded.
                    let slot_head =
                        routing.shard_of(DEFAULT_TABLE, first, slot).and_then(|id| routing.head_address(id));
                    let forward_only = range_partitioned
                        || (table != DEFAULT_TABLE && slot_head == Some(self.address.as_str()));
                    Placement::Elsewhere { slot, head: head.clone(), forward_only }
                }
                _ => Placement::Settling(CommandError::TryAgain(format!("slot {slot} is changing hands"))),
            },
        }
    }
}
