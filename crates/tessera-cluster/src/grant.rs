//! What a node does with a shard's grant, wherever it runs: the agent over
//! sockets and the simulator in virtual time both call [`apply_grant`], so the
//! simulator checks the decisions the nodes make, not a copy of them.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use tessera_engine::reserved;
use tessera_protocol::handoff::{self, Handoff, HandoffMessage};
use tessera_protocol::migration::{self, KeyFilter};
use tessera_protocol::{
    Effect, Effects, Mode, MultiMasterOptions, NodeId, PeerMessage, Replica, ShardView, Time,
};
use tessera_wire::slot::{key_slot, SLOTS};

use crate::agent::Routing;
use crate::map::ClusterMap;
use crate::DEFAULT_TABLE;

/// A node's replica of a shard and what the node remembers about it between
/// grants.
pub struct GrantedReplica {
    pub replica: Replica,
    /// The slots this node last swept the shard for (as its first member):
    /// it sweeps again when they change.
    pub swept_for: Option<Vec<(u16, u16)>>,
}

impl GrantedReplica {
    pub fn new(replica: Replica) -> Self {
        Self { replica, swept_for: None }
    }

    /// Whether the node keeps running this replica of `shard`, given
    /// whether the coordinator's latest answer granted it. A member the
    /// coordinator no longer grants (suspected, or the old replica of a
    /// replica move) keeps forwarding and acknowledging, without a lease,
    /// while `map` still shows the view it runs, so that its group does not
    /// wait on a member that stopped before the view that drops it. Once the
    /// view has moved on, an ungranted replica is left: the node may have
    /// been dropped and admitted again meanwhile, as a new member that starts
    /// empty.
    pub fn kept(&self, map: &ClusterMap, shard: u32, granted: bool) -> bool {
        let view = self.replica.view();
        granted
            || map.shard(shard).is_some_and(|entry| {
                entry.view_number == view.number && entry.members.contains(&self.replica.me().0)
            })
    }

    /// The node leaves this replica (it is not [`kept`](Self::kept)): the
    /// writes it never shipped, to go to the members of the shards that own
    /// their keys (a migration may move them meanwhile), in messages that
    /// each hold keys of one slot (or, in a range-partitioned table, of one
    /// shard in `map`).
    pub fn leave(&self, map: &ClusterMap, shard: u32) -> Option<Handoff> {
        let table = map.shard(shard).map_or(DEFAULT_TABLE, |entry| entry.table.as_str());
        let routing = Routing::new(map.clone());
        let ranged = routing.ranges(table).is_some();
        // A batch's keys share a slot, so a message splits only where
        // separate batches went different ways.
        let mut messages = Vec::new();
        for message in self.replica.unshipped() {
            let mut split: BTreeMap<u32, Vec<(Bytes, Bytes)>> = BTreeMap::new();
            for (key, raw) in message {
                let slot = key_slot(client_key(&key)) as u16;
                let group = if ranged {
                    routing.shard_of(table, client_key(&key), slot).unwrap_or(shard)
                } else {
                    slot as u32
                };
                split.entry(group).or_default().push((key, raw));
            }
            messages.extend(split.into_values());
        }
        let retransmit_after_ms = MultiMasterOptions::default().retransmit_after_ms;
        let grace_ms = self.replica.tuning().tombstone_grace_ms;
        let view = self.replica.view().number;
        // Beside the keys the shard kept, its engine may hold copies of keys
        // a migration moved away and the sweep's deletes of them: handed to
        // the keys' owner, such a delete would delete them there.
        let keeps = match kept_slots(map, shard) {
            Some(slots) => slot_keys(&slots, true),
            None => Arc::new(move |key: &[u8]| {
                owning_client_key(key).is_some_and(|owner| {
                    routing.shard_of(routing.table_of(owner), owner, key_slot(owner) as u16) == Some(shard)
                })
            }),
        };
        let held = self.replica.held_for_handoff().map(|engine| (engine, keeps));
        Handoff::new(self.replica.me(), shard, view, messages, held, retransmit_after_ms, grace_ms)
    }

    /// A grant of `view` (in which the shard runs `mode`) for the heartbeat
    /// sent at `asked_at`, under `map` (the node's newest, at least as new
    /// as the grant): the view, then the migrations the map names, then, as
    /// first member, a sweep of keys the shard no longer keeps.
    pub fn apply_grant(
        &mut self,
        map: &ClusterMap,
        shard: u32,
        asked_at: u64,
        view: ShardView,
        mode: Mode,
        fx: &mut Effects,
    ) {
        let replica = &mut self.replica;
        // A causal partition's place comes from the map, which knows the
        // datacenters and the other partitions.
        let geo = map.geo_place(shard, replica.me().0);
        replica.on_grant(asked_at, ShardView { geo, ..view }, mode, fx);
        let (outgoing, incoming) = migrations_of(map, shard);
        replica.set_migrations(outgoing, incoming, fx.now());
        let first = replica.view().position(replica.me()) == Some(0);
        let kept = first.then(|| kept_slots(map, shard)).flatten();
        if kept.is_some() && kept != self.swept_for {
            // Keys of slots that moved away, or that a cancelled migration
            // brought, are deleted through replication.
            replica.sweep(slot_keys(kept.as_deref().unwrap_or_default(), false));
        }
        self.swept_for = kept;
    }
}

/// The handoffs of the shards a node left, each until members hold every
/// record it carries or the records are past the tombstone grace.
#[derive(Debug, Default)]
pub struct Handoffs {
    under_way: Vec<Handoff>,
    /// Records given up on, over every handoff this node ran.
    abandoned: usize,
}

impl Handoffs {
    pub fn start(&mut self, handoff: Option<Handoff>) {
        self.under_way.extend(handoff);
    }

    pub fn is_empty(&self) -> bool {
        self.under_way.is_empty()
    }

    /// The node opens `shard`'s engine again: handoffs that left it stop
    /// reading the old instance of it.
    pub fn rejoin(&mut self, shard: u32) {
        for handoff in self.under_way.iter_mut().filter(|handoff| handoff.from_shard() == shard) {
            handoff.stop_reading();
        }
    }

    /// Records given up on so far, over every handoff.
    pub fn abandoned(&self) -> usize {
        self.abandoned
    }

    /// Ticks every handoff, each batch sent to the shard that owns its keys
    /// by `routing`, the node's newest; returns the messages to send and
    /// forgets the handoffs that are done.
    pub fn on_tick(&mut self, routing: &Routing, now: Time) -> Vec<Effect> {
        let map = &routing.map;
        let route = |key: &[u8]| {
            let key = client_key(key);
            // Tables are routed by key prefix: the key names its table.
            let table = routing.table_of(key);
            let shard = routing.shard_of(table, key, key_slot(key) as u16)?;
            Some((shard, map.shard(shard)?.members.iter().map(|node| NodeId(*node)).collect()))
        };
        let mut fx = Effects::new(now);
        for handoff in &mut self.under_way {
            handoff.on_tick(&route, &mut fx);
        }
        let abandoned = &mut self.abandoned;
        self.under_way.retain(|handoff| {
            if handoff.done() {
                *abandoned += handoff.abandoned();
            }
            !handoff.done()
        });
        fx.take()
    }

    /// Whether `message`, from `from`, acknowledges a handoff (it is then
    /// taken here, whichever handoff it names).
    pub fn on_peer(&mut self, from: NodeId, message: &PeerMessage) -> bool {
        let Some(acknowledged) = handoff::acknowledgement(message) else { return false };
        for handoff in &mut self.under_way {
            handoff.on_acked(from, acknowledged);
        }
        true
    }
}

/// Whether `message` hands `shard` records of keys it does not keep by
/// `routing` (its own slots and those migrating in, not those migrating
/// out): the node that sent it routed by an older map, or sent it while the
/// keys' slot moves, and sends it again by a newer one. (Taken by a shard
/// that is giving the slot away, a record could arrive after the migration
/// copied the slot and stay behind its sweep.)
pub fn misrouted_handoff(routing: &Routing, shard: u32, message: &PeerMessage) -> bool {
    let Some(Ok(HandoffMessage::Records { records, .. } | HandoffMessage::Held { records, .. })) =
        message.open::<HandoffMessage>()
    else {
        return false;
    };
    let migration = routing.map.migration_of(shard);
    let moving = |slot: u16, to_here: bool| {
        migration.is_some_and(|migration| (migration.to == shard) == to_here && migration.moves(slot))
    };
    !records.iter().all(|(key, _)| {
        let key = client_key(key);
        let slot = key_slot(key) as u16;
        (routing.shard_of(routing.table_of(key), key, slot) == Some(shard) && !moving(slot, false))
            || moving(slot, true)
    })
}

/// The client key an engine key belongs to: itself, or the key that owns an
/// internal key.
fn client_key(key: &[u8]) -> &[u8] {
    reserved::owner(key).map_or(key, |(owner, _)| owner)
}

/// The migrations the map names for a shard, as its driver takes them.
fn migrations_of(map: &ClusterMap, shard: u32) -> (Option<migration::Outgoing>, Option<migration::Incoming>) {
    let Some(migration) = map.migration_of(shard) else { return (None, None) };
    let first = |shard| map.shard(shard)?.members.first().map(|node| NodeId(*node));
    let keys = slot_keys(&migration.slots, true);
    let id = migration.id;
    if migration.from == shard {
        (first(migration.to).map(|to| migration::Outgoing { id, to_shard: migration.to, to, keys }), None)
    } else {
        let from = first(migration.from);
        (None, from.map(|from| migration::Incoming { id, from_shard: migration.from, from, keys }))
    }
}

/// The slots a shard keeps: its own and those migrating into it (`None`
/// for a range-partitioned table's shard, which holds no slots).
fn kept_slots(map: &ClusterMap, shard: u32) -> Option<Vec<(u16, u16)>> {
    let entry = map.shard(shard)?;
    if entry.range.is_some() {
        return None;
    }
    let incoming = map.migration_of(shard).filter(|migration| migration.to == shard);
    Some(
        entry
            .slots
            .iter()
            .chain(incoming.into_iter().flat_map(|migration| &migration.slots))
            .copied()
            .collect(),
    )
}

/// The keys in some slots (`inside`) or outside them: client keys by their
/// slot, internal keys by the slot of the client key that owns them, and
/// never a named internal key.
fn slot_keys(slots: &[(u16, u16)], inside: bool) -> KeyFilter {
    let mut listed = vec![false; SLOTS];
    for (first, last) in slots {
        listed[*first as usize..=*last as usize].fill(true);
    }
    Arc::new(move |key: &[u8]| {
        owning_client_key(key).is_some_and(|client_key| listed[key_slot(client_key)] == inside)
    })
}

/// The client key `key` is or belongs to; `None` for a named internal key,
/// which no client key owns.
fn owning_client_key(key: &[u8]) -> Option<&[u8]> {
    match reserved::owner(key) {
        Some((owner, _)) => Some(owner),
        None if reserved::is_reserved(key) => None,
        None => Some(key),
    }
}
