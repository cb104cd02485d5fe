//! The cluster's coordinator, sans-IO: joins and heartbeats in, grants out, and
//! a map that changes with every view change. One `ShardCoordinator` per shard
//! makes the decisions (the same code the simulator checks); this layer routes
//! heartbeats to them, brings standby nodes into shards that lost a member, and
//! keeps the map (views, incarnations, epoch) in step for the store.

use std::collections::BTreeMap;

use tessera_engine::EngineKind;
use tessera_protocol::coordinator::{CoordinatorConfig, ShardCoordinator, HEAD_HANDED_OVER};
use tessera_protocol::{Mode, NodeId, Progress, ShardView};

use tessera_protocol::migration::MigrationReport;
use tessera_wire::slot::SLOTS;

use crate::map::{
    ClusterMap, ClusterTable, MapError, Migration, MigrationPhase, NodeInfo, NodeRole, OpenSlot, ReplicaMove,
    Shard, DEFAULT_TABLE,
};

/// How long a migration's cut may hold its source's writes before it is
/// given up (the copy goes on, and the cut is tried again later).
pub const CUT_TIMEOUT_MS: u64 = 3_000;

/// How long after a cut was given up the next one may start.
const CUT_RETRY_AFTER_MS: u64 = 1_000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JoinError {
    #[error("this node belongs to cluster '{got}', the coordinator serves cluster '{expected}'")]
    WrongCluster { expected: String, got: String },
    #[error("node {0} is not in the cluster map")]
    UnknownNode(u32),
}

/// Heartbeat and lease timing, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub lease_ms: u64,
    pub failure_timeout_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Self { lease_ms: 1_000, failure_timeout_ms: 1_500 }
    }
}

/// The answer to a heartbeat: the map's epoch (a node that has an older one
/// fetches the map) and a lease on each shard the node serves or joins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grants {
    pub epoch: u64,
    /// Each shard's view and the mode it runs in that view.
    pub shards: Vec<(u32, ShardView, Mode)>,
}

/// How a shard in `mode` is coordinated: the timing, and how nodes join it.
fn shard_config(timing: Timing, mode: Mode, replicas: usize) -> CoordinatorConfig {
    CoordinatorConfig {
        lease_ms: timing.lease_ms,
        failure_timeout_ms: timing.failure_timeout_ms,
        admission: mode.admission(replicas),
    }
}

/// What CLUSTER SETSLOT (or MIGRATE) asks of a slot, sent to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotCommand {
    /// The node is to receive the slot from `source`.
    Importing { source: u32 },
    /// The node, heading the slot's group, is to send it to `target`.
    Migrating { target: u32 },
    /// MIGRATE to `target`: the open slot may cut over.
    Commit { target: u32 },
    /// The slot is to be `owner`'s: committed, opened first if need be.
    Node { owner: u32 },
    /// Closes the slot, cancelling a move that has not cut over.
    Stable,
}

/// A coordinator's decisions, for its metrics and its dashboard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    /// View changes, by their reason.
    pub view_changes: BTreeMap<&'static str, u64>,
    /// Shards whose head was replaced without handing over (it failed, or
    /// was cut off).
    pub failovers: u64,
    /// The latest view changes, oldest first (at most [`RECENT_DECISIONS`]).
    pub recent: std::collections::VecDeque<Decision>,
}

/// View changes a coordinator remembers for its dashboard.
pub const RECENT_DECISIONS: usize = 200;

/// One view change as the dashboard shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Decision {
    /// When it was decided, in the coordinator's milliseconds.
    pub at_ms: u64,
    pub shard: u32,
    pub view: u64,
    pub members: Vec<u32>,
    pub learners: Vec<u32>,
    pub reason: &'static str,
    pub failover: bool,
}

pub struct ClusterCoordinator {
    map: ClusterMap,
    timing: Timing,
    shards: BTreeMap<u32, ShardCoordinator>,
    /// The map changed since [`ClusterCoordinator::take_changed_map`].
    changed: bool,
    /// Per migration: what its source last reported, and when.
    migration_reports: BTreeMap<u64, (MigrationReport, u64)>,
    /// Per migration in its cut: when the cut began and the two shards'
    /// first members then (a cut is given up when either changes).
    cuts: BTreeMap<u64, (u64, Option<NodeId>, Option<NodeId>)>,
    /// Per migration whose cut was given up: when the next may begin.
    cut_not_before: BTreeMap<u64, u64>,
    /// What this coordinator decided since it started.
    decisions: Decisions,
    /// For tests of the checkers: slots move as soon as the copy caught up,
    /// with no cut, so writes still reaching the source are lost.
    #[cfg(feature = "broken")]
    broken_without_cut: bool,
    /// For tests of the checkers: a moved replica leaves as a suspected
    /// member once its lease runs out, without a drain, taking what only it
    /// held.
    #[cfg(feature = "broken")]
    broken_retire_without_drain: bool,
}

impl ClusterCoordinator {
    /// Takes over a map (new, or loaded from the store after a restart); every
    /// member counts as heard from at `now`.
    pub fn new(map: ClusterMap, timing: Timing, now: u64) -> Self {
        let shards = map
            .shards
            .iter()
            .map(|shard| {
                let incarnations = shard
                    .incarnations
                    .iter()
                    .map(|(node, incarnation)| (NodeId(*node), *incarnation))
                    .collect();
                let config = shard_config(timing, map.mode_of(shard), map.replicas);
                let mut coordinator = ShardCoordinator::new(config, shard.view(), incarnations, now);
                let cutting = map.migrations.iter().any(|migration| {
                    migration.from == shard.id && migration.phase == MigrationPhase::Cutting
                });
                if cutting {
                    // A migration's cut that a previous coordinator began.
                    coordinator.resume_cut();
                } else if let Some(head) = shard.next_head {
                    // A head handover that a previous coordinator began.
                    coordinator.resume_handover(NodeId(head));
                } else if let Some(next) = shard.next_mode {
                    // A transition that a previous coordinator started.
                    coordinator.resume_transition(shard_config(timing, next, map.replicas).admission);
                }
                (shard.id, coordinator)
            })
            .collect();
        Self {
            map,
            timing,
            shards,
            changed: false,
            migration_reports: BTreeMap::new(),
            cuts: BTreeMap::new(),
            cut_not_before: BTreeMap::new(),
            decisions: Decisions::default(),
            #[cfg(feature = "broken")]
            broken_without_cut: false,
            #[cfg(feature = "broken")]
            broken_retire_without_drain: false,
        }
    }

    /// See `broken_without_cut`.
    #[cfg(feature = "broken")]
    pub fn break_cuts(&mut self) {
        self.broken_without_cut = true;
    }

    /// See `broken_retire_without_drain`.
    #[cfg(feature = "broken")]
    pub fn break_retirements(&mut self) {
        self.broken_retire_without_drain = true;
    }

    pub fn decisions(&self) -> &Decisions {
        &self.decisions
    }

    /// The write position `node` last reported for `shard`.
    pub fn applied(&self, shard: u32, node: u32) -> Option<u64> {
        self.shards.get(&shard)?.applied(NodeId(node))
    }

    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// Checks that a node may take part: the right cluster, a known id.
    pub fn check_join(&self, cluster_id: &str, node: u32) -> Result<(), JoinError> {
        if cluster_id != self.map.cluster_id {
            return Err(JoinError::WrongCluster {
                expected: self.map.cluster_id.clone(),
                got: cluster_id.into(),
            });
        }
        self.map.node(node).map(|_| ()).ok_or(JoinError::UnknownNode(node))
    }

    /// The TLS client address a joining node announces (its TLS port, on the
    /// host of its address; 0: none), if it is not the one the map holds.
    pub fn tls_address_change(&self, node: u32, tls_port: u16) -> Option<Option<String>> {
        let info = self.map.node(node)?;
        let announced = (tls_port != 0).then(|| {
            let host = info.address.rsplit_once(':').map_or(info.address.as_str(), |(host, _)| host);
            format!("{host}:{tls_port}")
        });
        (announced != info.tls_address).then_some(announced)
    }

    /// Records a node's TLS client address (see [`Self::tls_address_change`]).
    pub fn set_tls_address(&mut self, node: u32, tls_address: Option<String>) {
        if let Some(info) = self.map.nodes.iter_mut().find(|info| info.id == node) {
            info.tls_address = tls_address;
            self.map.epoch += 1;
            self.changed = true;
        }
    }

    /// Switches every shard of a table to `mode` while it serves: each shard's
    /// view drains, and the shard runs the new mode once every member holds
    /// the same records. Refused while a shard of the table is still
    /// switching. Returns how many shards switch (none already in `mode`).
    pub fn alter_table(&mut self, name: &str, mode: Mode, now: u64) -> Result<usize, MapError> {
        if name != DEFAULT_TABLE && self.map.table(name).is_none() {
            return Err(MapError::Invalid(format!("no such table '{name}'")));
        }
        let current: Vec<(u32, Mode)> = self
            .map
            .shards
            .iter()
            .filter(|shard| shard.table == name)
            .map(|shard| (shard.id, self.map.mode_of(shard)))
            .collect();
        if current.iter().any(|(id, _)| self.map.migration_of(*id).is_some()) {
            return Err(MapError::Invalid(format!(
                "table {name} has slots migrating; switch modes once they have moved (or cancel the migration)"
            )));
        }
        if current.iter().any(|(id, _)| !self.shards[id].may_begin_transition()) {
            return Err(MapError::Invalid(format!("table {name} is already switching modes; wait for it")));
        }
        let admission = shard_config(self.timing, mode, self.map.replicas).admission;
        let switching: Vec<u32> =
            current.into_iter().filter(|(_, current)| *current != mode).map(|(id, _)| id).collect();
        for shard in self.map.shards.iter_mut().filter(|shard| switching.contains(&shard.id)) {
            shard.next_mode = Some(mode);
            self.shards.get_mut(&shard.id).expect("a coordinator per shard").begin_transition(now, admission);
        }
        self.sync(&[]);
        Ok(switching.len())
    }

    /// A heartbeat from `node` with the progress of each shard it runs.
    pub fn heartbeat(
        &mut self,
        now: u64,
        node: u32,
        incarnation: u64,
        progress: &BTreeMap<u32, Progress>,
    ) -> Result<Grants, JoinError> {
        self.map.node(node).ok_or(JoinError::UnknownNode(node))?;
        let mut shards: Vec<u32> = self.map.shards_of(node).map(|shard| shard.id).collect();
        // A node a replica moves to is offered to that shard.
        let arriving: Vec<u32> = self
            .map
            .replica_moves
            .iter()
            .filter(|replica_move| replica_move.to == node && !shards.contains(&replica_move.shard))
            .map(|replica_move| replica_move.shard)
            .collect();
        shards.extend(arriving);
        if shards.len() < self.fair_share() {
            // A node with room (a standby, or one that came back after losing
            // its place) is offered to one shard short of replicas.
            shards.extend(self.shard_needing_a_replica(node));
        }
        let mut grants = Vec::new();
        let mut learnt = Vec::new();
        for shard in shards {
            let coordinator = self.shards.get_mut(&shard).expect("a coordinator per shard");
            let report = progress.get(&shard).cloned().unwrap_or_default();
            let unknown = coordinator.incarnation(NodeId(node)).is_none();
            if let Some(view) = coordinator.on_heartbeat(now, NodeId(node), incarnation, &report) {
                grants.push((shard, view));
            }
            if unknown && coordinator.incarnation(NodeId(node)).is_some() {
                learnt.push(shard);
            }
        }
        self.note_migrations(now, node, progress);
        self.advance_replica_moves(now);
        self.sync(&learnt);
        // The mode as of the views granted (a view that ended a transition
        // reached the map in sync above).
        let shards = grants
            .into_iter()
            .map(|(shard, view)| {
                let mode = self.map.shard(shard).map_or(self.map.mode, |entry| self.map.mode_of(entry));
                (shard, view, mode)
            })
            .collect();
        Ok(Grants { epoch: self.map.epoch, shards })
    }

    /// How many shards a node serves when replicas are spread evenly.
    fn fair_share(&self) -> usize {
        (self.map.shards.len() * self.map.replicas).div_ceil(self.map.nodes.len().max(1))
    }

    /// The shard with the fewest members below the replication factor that has
    /// no learner yet and does not have `node`.
    fn shard_needing_a_replica(&self, node: u32) -> Option<u32> {
        self.map
            .shards
            .iter()
            .filter(|shard| {
                shard.members.len() < self.map.replicas
                    && shard.learners.is_empty()
                    && !shard.members.contains(&node)
            })
            .min_by_key(|shard| (shard.members.len(), shard.id))
            .map(|shard| shard.id)
    }

    /// Removes failed replicas whose leases have run out.
    pub fn tick(&mut self, now: u64) {
        for coordinator in self.shards.values_mut() {
            coordinator.on_tick(now);
        }
        self.advance_migrations(now);
        self.advance_replica_moves(now);
        self.sync(&[]);
    }

    /// Starts moving shard `shard`'s replica on node `from` to node `to`:
    /// `to` joins as the shard's protocol admits a node (a learner that
    /// catches up, or a backup), then `from` is retired through a drain, so
    /// that it leaves nothing behind that only it held.
    pub fn start_replica_move(&mut self, shard: u32, from: u32, to: u32) -> Result<(), MapError> {
        let entry = self.map.shard(shard).ok_or_else(|| MapError::Invalid(format!("no shard {shard}")))?;
        if !entry.members.contains(&from) {
            return Err(MapError::Invalid(format!("node {from} holds no replica of shard {shard}")));
        }
        if entry.members.contains(&to) || entry.learners.contains(&to) {
            return Err(MapError::Invalid(format!("node {to} already holds a replica of shard {shard}")));
        }
        if !self.shards[&shard].may_begin_transition() {
            return Err(MapError::Invalid(format!(
                "shard {shard} is draining; move its replicas once it is done"
            )));
        }
        self.change_validated(|map| map.replica_moves.push(ReplicaMove { shard, from, to }))
    }

    /// Retires the old replica of each move whose new one is a member (once
    /// its group neither drains nor migrates), and forgets the moves that
    /// are done.
    fn advance_replica_moves(&mut self, now: u64) {
        let before = self.map.replica_moves.len();
        #[cfg(feature = "broken")]
        let broken = self.broken_retire_without_drain;
        let (shards, migrations) = (&mut self.shards, &self.map.migrations);
        self.map.replica_moves.retain(|replica_move| {
            let Some(coordinator) = shards.get_mut(&replica_move.shard) else { return false };
            let view = coordinator.view();
            let (arrived, left) = (
                view.position(NodeId(replica_move.to)).is_some(),
                view.position(NodeId(replica_move.from)).is_none(),
            );
            let migrating = migrations
                .iter()
                .any(|migration| migration.from == replica_move.shard || migration.to == replica_move.shard);
            #[cfg(feature = "broken")]
            if broken && arrived && !left {
                coordinator.suspect(NodeId(replica_move.from));
                return true;
            }
            if arrived && !left && !migrating && coordinator.begin_retire(now, NodeId(replica_move.from)) {
                tracing::info!(
                    shard = replica_move.shard,
                    from = replica_move.from,
                    to = replica_move.to,
                    "replica arrived; retiring the one it replaces"
                );
            }
            !(arrived && left)
        });
        if self.map.replica_moves.len() != before {
            self.map.epoch += 1;
            self.changed = true;
        }
    }

    /// Starts handing shard `shard`'s first place (head, primary) to its
    /// member `node` (docs/PROTOCOLS.md, "Head handovers"): the shard drains
    /// to the mode it runs, and the view that ends the drain puts `node`
    /// first. Writes wait for the drain; none fails.
    pub fn start_handover(&mut self, shard: u32, node: u32, now: u64) -> Result<(), MapError> {
        let entry = self.map.shard(shard).ok_or_else(|| MapError::Invalid(format!("no shard {shard}")))?;
        match entry.members.iter().position(|member| *member == node) {
            None => return Err(MapError::Invalid(format!("node {node} is not a member of shard {shard}"))),
            Some(0) => return Err(MapError::Invalid(format!("node {node} already heads shard {shard}"))),
            Some(_) => {}
        }
        if self.map.migration_of(shard).is_some() {
            return Err(MapError::Invalid(format!(
                "shard {shard} has slots migrating; hand its head over once they have moved"
            )));
        }
        if self.map.replica_moves.iter().any(|replica_move| replica_move.shard == shard) {
            return Err(MapError::Invalid(format!("a replica of shard {shard} is moving; wait for it")));
        }
        let mode = self.map.mode_of(entry);
        let coordinator = self.shards.get_mut(&shard).expect("a coordinator per shard");
        if !coordinator.begin_handover(now, NodeId(node)) {
            return Err(MapError::Invalid(format!("shard {shard} is draining; wait for it")));
        }
        tracing::info!(shard, node, "handing the head over");
        let entry = self.map.shards.iter_mut().find(|entry| entry.id == shard).expect("checked above");
        entry.next_mode = Some(mode); // draining, to the mode it runs
        entry.next_head = Some(node);
        self.sync(&[]);
        Ok(())
    }

    /// Takes a node that serves nothing out of the map.
    pub fn remove_node(&mut self, node: u32) -> Result<(), MapError> {
        self.map.node(node).ok_or_else(|| MapError::Invalid(format!("no node {node}")))?;
        if let Some(shard) = self.map.shards_of(node).next() {
            return Err(MapError::Invalid(format!(
                "node {node} still holds a replica of shard {}; move it first",
                shard.id
            )));
        }
        if self.map.replica_moves.iter().any(|replica_move| replica_move.to == node) {
            return Err(MapError::Invalid(format!("a replica is moving to node {node}")));
        }
        self.map.nodes.retain(|info| info.id != node);
        self.map.epoch += 1;
        self.changed = true;
        Ok(())
    }

    /// Starts moving `slots` (inclusive ranges) from shard `from` to shard
    /// `to` of the same table; returns the migration's id. Refused while
    /// either shard switches modes or takes part in another migration.
    pub fn start_migration(&mut self, from: u32, to: u32, slots: Vec<(u16, u16)>) -> Result<u64, MapError> {
        let open = self
            .map
            .open_slots
            .iter()
            .find(|open| slots.iter().any(|(first, last)| (*first..=*last).contains(&open.slot)));
        if let Some(open) = open {
            return Err(MapError::Invalid(format!(
                "slot {} is open for CLUSTER SETSLOT; close it with CLUSTER SETSLOT {} STABLE first",
                open.slot, open.slot
            )));
        }
        self.begin_migration(from, to, slots)
    }

    fn begin_migration(&mut self, from: u32, to: u32, slots: Vec<(u16, u16)>) -> Result<u64, MapError> {
        for shard in [from, to] {
            if self.shards.get(&shard).is_some_and(ShardCoordinator::transitioning) {
                return Err(MapError::Invalid(format!(
                    "shard {shard} is draining (switching modes or handing its head over); move slots once it is done"
                )));
            }
            if let Some(other) = self.map.migration_of(shard) {
                return Err(MapError::Invalid(format!(
                    "shard {shard} already takes part in migration {}",
                    other.id
                )));
            }
        }
        let id = self.map.next_migration;
        self.change_validated(|map| {
            map.next_migration += 1;
            let slots = normalize(&slots);
            map.migrations.push(Migration { id, from, to, slots, phase: MigrationPhase::Copying });
        })?;
        Ok(id)
    }

    /// Cancels a migration that has not moved its slots: its source serves
    /// on (its cut, if one is under way, ends), and the target drops what
    /// it received once the map no longer names the migration.
    pub fn cancel_migration(&mut self, id: u64, now: u64) -> Result<(), MapError> {
        let migration = self.map.migrations.iter().find(|migration| migration.id == id).cloned();
        let migration = migration.ok_or_else(|| MapError::Invalid(format!("no migration {id} under way")))?;
        self.end_cut(&migration, now, "migration cancelled");
        self.map.migrations.retain(|other| other.id != id);
        self.map.open_slots.retain(|open| open.migration != Some(id));
        self.forget_migration(id);
        self.map.epoch += 1;
        self.changed = true;
        self.sync(&[]);
        Ok(())
    }

    /// What the source of each migration under way last reported, and when.
    pub fn migration_reports(&self) -> &BTreeMap<u64, (MigrationReport, u64)> {
        &self.migration_reports
    }

    /// Keeps what a source's first member reports of its migration.
    fn note_migrations(&mut self, now: u64, node: u32, progress: &BTreeMap<u32, Progress>) {
        for migration in &self.map.migrations {
            let first = self.shards[&migration.from].view().replicas.first().copied();
            if first != Some(NodeId(node)) {
                continue;
            }
            let report = progress.get(&migration.from).and_then(|progress| progress.migration);
            if let Some(report) = report.filter(|report| report.id == migration.id) {
                self.migration_reports.insert(migration.id, (report, now));
            }
        }
        self.advance_migrations(now);
    }

    /// Begins the cut of a migration whose copy caught up; completes a cut
    /// whose source drained and forwarded everything; gives up a cut that
    /// lost a first member or took too long.
    fn advance_migrations(&mut self, now: u64) {
        self.start_open_slots();
        for migration in self.map.migrations.clone() {
            let report = self.migration_reports.get(&migration.id).map(|(report, _)| *report);
            let source = &self.shards[&migration.from];
            let firsts = (
                source.view().replicas.first().copied(),
                self.shards[&migration.to].view().replicas.first().copied(),
            );
            let uncommitted = self
                .map
                .open_slots
                .iter()
                .any(|open| open.migration == Some(migration.id) && !open.committed);
            match migration.phase {
                MigrationPhase::Copying if uncommitted => {}
                MigrationPhase::Copying => {
                    #[cfg(feature = "broken")]
                    if self.broken_without_cut && report.is_some_and(|report| report.caught_up) {
                        self.complete_migration(&migration, now);
                        continue;
                    }
                    let due = self.cut_not_before.get(&migration.id).is_none_or(|at| now >= *at);
                    if due && report.is_some_and(|report| report.caught_up) && !source.transitioning() {
                        self.begin_cut(&migration, now, firsts);
                    }
                }
                MigrationPhase::Cutting => {
                    let (began, first_from, first_to) =
                        *self.cuts.entry(migration.id).or_insert((now, firsts.0, firsts.1));
                    let forwarded = report.and_then(|report| report.forwarded_in);
                    if (first_from, first_to) != firsts || now.saturating_sub(began) > CUT_TIMEOUT_MS {
                        tracing::warn!(
                            migration = migration.id,
                            "a migration's cut is given up; the copy goes on"
                        );
                        self.end_cut(&migration, now, "migration cut given up");
                        self.set_phase(migration.id, MigrationPhase::Copying);
                        self.cut_not_before.insert(migration.id, now + CUT_RETRY_AFTER_MS);
                    } else if source.cut_drained() && forwarded == Some(source.view().number) {
                        self.complete_migration(&migration, now);
                    }
                }
            }
        }
    }

    fn begin_cut(&mut self, migration: &Migration, now: u64, firsts: (Option<NodeId>, Option<NodeId>)) {
        let coordinator = self.shards.get_mut(&migration.from).expect("a coordinator per shard");
        if !coordinator.begin_cut(now) {
            return;
        }
        tracing::info!(
            migration = migration.id,
            from = migration.from,
            to = migration.to,
            "migration caught up; cutting over"
        );
        let mode = self.map.shard(migration.from).map(|shard| self.map.mode_of(shard));
        if let Some(shard) = self.map.shards.iter_mut().find(|shard| shard.id == migration.from) {
            shard.next_mode = mode; // draining, to the mode it runs
        }
        self.set_phase(migration.id, MigrationPhase::Cutting);
        self.cuts.insert(migration.id, (now, firsts.0, firsts.1));
        self.migration_reports.remove(&migration.id); // a forwarded view is reported anew
    }

    fn end_cut(&mut self, migration: &Migration, now: u64, reason: &'static str) {
        if let Some(coordinator) = self.shards.get_mut(&migration.from) {
            coordinator.end_cut(now, reason);
        }
        self.cuts.remove(&migration.id);
    }

    /// The slots become the target's, in the same map as the view that ends
    /// the source's cut.
    fn complete_migration(&mut self, migration: &Migration, now: u64) {
        tracing::info!(
            migration = migration.id,
            from = migration.from,
            to = migration.to,
            slots = migration.slot_count(),
            "migration complete: the slots moved"
        );
        self.end_cut(migration, now, "migration complete");
        for shard in &mut self.map.shards {
            let mut owned = vec![false; SLOTS];
            for (first, last) in &shard.slots {
                owned[*first as usize..=*last as usize].fill(true);
            }
            if shard.id == migration.from || shard.id == migration.to {
                for (first, last) in &migration.slots {
                    owned[*first as usize..=*last as usize].fill(shard.id == migration.to);
                }
                shard.slots = ranges_of(&owned);
            }
        }
        self.map.migrations.retain(|other| other.id != migration.id);
        self.map.open_slots.retain(|open| open.migration != Some(migration.id));
        self.forget_migration(migration.id);
        self.map.epoch += 1;
        self.changed = true;
    }

    /// CLUSTER SETSLOT, and MIGRATE's commit, sent to `node`
    /// (docs/ARCHITECTURE.md, "Redis Cluster's interface"). Refusals are
    /// [`MapError::Slot`]s in Redis Cluster's words.
    pub fn set_slot(&mut self, node: u32, slot: u16, command: SlotCommand, now: u64) -> Result<(), MapError> {
        let refuse = |message: String| Err(MapError::Slot(message));
        if usize::from(slot) >= SLOTS {
            return refuse("Invalid or out of range slot".into());
        }
        let owning = self.map.shard_for_slot(slot).expect("a valid map owns every slot");
        let (owner, mine) = (owning.id, owning.is_headed_by(node));
        let named = match command {
            SlotCommand::Importing { source: other }
            | SlotCommand::Migrating { target: other }
            | SlotCommand::Node { owner: other }
            | SlotCommand::Commit { target: other } => Some(other),
            SlotCommand::Stable => None,
        };
        if let Some(other) = named.filter(|other| self.map.node(*other).is_none()) {
            return refuse(format!("I don't know about node {other}"));
        }
        let open = self.map.open_slot(slot).cloned();
        // The node that is to receive the slot, and the marks set.
        let (receiver, importing, migrating, committed) = match command {
            SlotCommand::Importing { .. } if mine => {
                return refuse(format!("I'm already the owner of hash slot {slot}"))
            }
            SlotCommand::Importing { .. } => (node, true, false, false),
            SlotCommand::Migrating { .. } if !mine => {
                return refuse(format!("I'm not the owner of hash slot {slot}"))
            }
            SlotCommand::Migrating { target } => (target, false, true, false),
            SlotCommand::Node { owner: new_owner } => (new_owner, true, true, true),
            SlotCommand::Commit { target } => match &open {
                Some(open) if open.importing && open.migrating && self.map.stands_for(target, open.to) => {
                    (target, true, true, true)
                }
                _ => {
                    return refuse(format!(
                        "hash slot {slot} is not open from this node to node {target}: \
                         CLUSTER SETSLOT {slot} IMPORTING on it and MIGRATING here first"
                    ))
                }
            },
            SlotCommand::Stable => return self.close_slot(slot, now),
        };
        // An open slot towards the receiver's group first: its head may have
        // been replaced by a failover, leaving the receiver a member of the
        // slot's present group as well.
        let assigning = matches!(command, SlotCommand::Node { .. });
        let to = match open.as_ref().filter(|open| self.map.stands_for(receiver, open.to)) {
            Some(open) => open.to,
            None if assigning && self.map.stands_for(receiver, owner) => return self.close_slot(slot, now),
            None => self.receiving_group(receiver, slot).ok_or_else(|| {
                MapError::Slot(match command {
                    SlotCommand::Importing { .. } => {
                        format!("I'm not a master: this node heads no replica group to import hash slot {slot} into")
                    }
                    _ => "Target node is not a master".into(),
                })
            })?,
        };
        let opened = OpenSlot { slot, from: owner, to, importing, migrating, migration: None, committed };
        // The same move keeps its marks and its migration; another replaces it.
        let opened = match open.filter(|open| open.to == opened.to) {
            Some(same) => OpenSlot {
                importing: opened.importing || same.importing,
                migrating: opened.migrating || same.migrating,
                committed: opened.committed || same.committed,
                migration: same.migration,
                ..opened
            },
            None => {
                self.close_slot(slot, now)?;
                opened
            }
        };
        self.change_validated(|map| {
            map.open_slots.retain(|other| other.slot != slot);
            map.open_slots.push(opened);
        })?;
        self.advance_migrations(now);
        Ok(())
    }

    /// The group of `node`'s that is to receive `slot`: one that owns a
    /// neighbouring slot (a range grows rather than splits), else the one
    /// with the fewest slots.
    fn receiving_group(&self, node: u32, slot: u16) -> Option<u32> {
        let headed: Vec<&Shard> = self.map.headed_by(node).collect();
        let neighbour = headed.iter().find(|shard| {
            slot.checked_sub(1).is_some_and(|below| shard.owns(below)) || shard.owns(slot.saturating_add(1))
        });
        let slot_count = |shard: &Shard| {
            shard.slots.iter().map(|(first, last)| usize::from(last - first) + 1).sum::<usize>()
        };
        neighbour
            .or_else(|| headed.iter().min_by_key(|shard| (slot_count(shard), shard.id)))
            .map(|shard| shard.id)
    }

    /// Closes an open slot, cancelling its migration if it has one.
    fn close_slot(&mut self, slot: u16, now: u64) -> Result<(), MapError> {
        let Some(open) = self.map.open_slot(slot).cloned() else {
            return Ok(());
        };
        match open.migration {
            Some(id) => self.cancel_migration(id, now),
            None => self.change_validated(|map| map.open_slots.retain(|other| other.slot != slot)),
        }
    }

    /// Starts the migration of every slot opened at both ends, as soon as
    /// neither group takes part in another.
    fn start_open_slots(&mut self) {
        let ready: Vec<OpenSlot> = self
            .map
            .open_slots
            .iter()
            .filter(|open| open.importing && open.migrating && open.migration.is_none())
            .cloned()
            .collect();
        for open in ready {
            if let Ok(id) = self.begin_migration(open.from, open.to, vec![(open.slot, open.slot)]) {
                tracing::info!(
                    slot = open.slot,
                    from = open.from,
                    to = open.to,
                    migration = id,
                    "an open slot starts moving"
                );
                if let Some(entry) = self.map.open_slots.iter_mut().find(|entry| entry.slot == open.slot) {
                    entry.migration = Some(id);
                }
            }
        }
    }

    fn set_phase(&mut self, id: u64, phase: MigrationPhase) {
        if let Some(migration) = self.map.migrations.iter_mut().find(|migration| migration.id == id) {
            migration.phase = phase;
            self.map.epoch += 1;
            self.changed = true;
        }
    }

    fn forget_migration(&mut self, id: u64) {
        self.migration_reports.remove(&id);
        self.cuts.remove(&id);
        self.cut_not_before.remove(&id);
    }

    /// Copies view changes, and the incarnations of a new cluster's members as
    /// they are first heard (`learnt`: a restarted coordinator must know them),
    /// into the map, and raises its epoch.
    fn sync(&mut self, learnt: &[u32]) {
        let mut changed = false;
        for (id, coordinator) in &mut self.shards {
            let changes = coordinator.take_changes();
            for change in &changes {
                let members: Vec<u32> = change.view.replicas.iter().map(|node| node.0).collect();
                let learners: Vec<u32> = change.view.learners.iter().map(|node| node.0).collect();
                tracing::info!(
                    shard = id,
                    view = change.view.number,
                    ?members,
                    ?learners,
                    draining = change.view.draining,
                    reason = change.reason,
                    "view change"
                );
                *self.decisions.view_changes.entry(change.reason).or_default() += 1;
                let failover = change.primary_changed && change.reason != HEAD_HANDED_OVER;
                self.decisions.failovers += u64::from(failover);
                if self.decisions.recent.len() == RECENT_DECISIONS {
                    self.decisions.recent.pop_front();
                }
                self.decisions.recent.push_back(Decision {
                    at_ms: change.at_ms,
                    shard: *id,
                    view: change.view.number,
                    members,
                    learners,
                    reason: change.reason,
                    failover,
                });
            }
            if changes.is_empty() && !learnt.contains(id) {
                continue;
            }
            let mode = self.map.shard(*id).map_or(self.map.mode, |shard| self.map.mode_of(shard));
            let shard = self.map.shards.iter_mut().find(|shard| shard.id == *id).expect("shard in map");
            shard.set_view(coordinator.view());
            if coordinator.view().draining {
                // A drain the shard's coordinator began itself (a quorum
                // learner's promotion, a replica's retirement) is to the mode
                // it runs; a restarted coordinator resumes it as one.
                shard.next_mode.get_or_insert(mode);
            } else {
                shard.next_head = None;
                if let Some(next) = shard.next_mode.take() {
                    shard.mode = (next != self.map.mode).then_some(next);
                }
            }
            shard.incarnations = shard
                .members
                .iter()
                .chain(&shard.learners)
                .filter_map(|node| {
                    coordinator.incarnation(NodeId(*node)).map(|incarnation| (*node, incarnation))
                })
                .collect();
            changed = true;
        }
        if !changed {
            return;
        }
        let serving: Vec<u32> = self
            .map
            .shards
            .iter()
            .flat_map(|shard| shard.members.iter().chain(&shard.learners))
            .copied()
            .collect();
        for node in &mut self.map.nodes {
            if serving.contains(&node.id) {
                node.role = NodeRole::Member;
            }
        }
        self.map.epoch += 1;
        self.changed = true;
    }

    /// Adds a standby node at `address`; it serves nothing until a shard short
    /// of replicas takes it in. Returns its id.
    pub fn add_standby(&mut self, address: &str) -> Result<u32, MapError> {
        if self.map.nodes.iter().any(|node| node.address == address) {
            return Err(MapError::Invalid(format!("a node at {address} is already in the map")));
        }
        let id = self.map.nodes.iter().map(|node| node.id + 1).max().unwrap_or(0);
        self.change_validated(|map| {
            let address = address.to_string();
            map.nodes.push(NodeInfo {
                id,
                address,
                tls_address: None,
                role: NodeRole::Standby,
                datacenter: 0,
            });
        })?;
        Ok(id)
    }

    /// Adds a table: for each of the default table's shards, a new replica
    /// shard for the table's keys in the same slots, on the same nodes in the
    /// same order (so a slot's head is usually the same node for every table).
    pub fn create_table(&mut self, table: ClusterTable, now: u64) -> Result<(), MapError> {
        let invalid = |message: String| MapError::Invalid(format!("table {}: {message}", table.name));
        let spec = table.engine_spec().map_err(|error| invalid(error.to_string()))?;
        if spec.kind == EngineKind::Redis {
            return Err(invalid("the redis engine cannot back a cluster's shards".into()));
        }
        let mut map = self.map.clone();
        let first_id = map.shards.iter().map(|shard| shard.id + 1).max().unwrap_or(0);
        // A hash-partitioned table gets a shard per default shard, on the same
        // slots; a range-partitioned one a shard per key range, placed like the
        // default shards in turn so that the ranges' heads are spread out.
        let default_shards: Vec<&Shard> = map.slot_shards().collect();
        let placements: Vec<(Option<usize>, &Shard)> = match &table.split_keys {
            None => default_shards.iter().map(|shard| (None, *shard)).collect(),
            Some(splits) => (0..=splits.len())
                .map(|range| (Some(range), default_shards[range % default_shards.len()]))
                .collect(),
        };
        let added: Vec<Shard> = placements
            .into_iter()
            .zip(first_id..)
            .map(|((range, shard), id)| Shard {
                id,
                table: table.name.clone(),
                slots: if range.is_some() { Vec::new() } else { shard.slots.clone() },
                range,
                view_number: 1,
                members: shard.members.clone(),
                learners: Vec::new(),
                mode: None,
                next_mode: None,
                next_head: None,
                incarnations: shard
                    .incarnations
                    .iter()
                    .filter(|(node, _)| shard.members.contains(node))
                    .map(|(node, incarnation)| (*node, *incarnation))
                    .collect(),
            })
            .collect();
        map.tables.push(table);
        map.shards.extend(added.iter().cloned());
        map.epoch += 1;
        map.validate()?;
        for shard in &added {
            let incarnations =
                shard.incarnations.iter().map(|(node, incarnation)| (NodeId(*node), *incarnation)).collect();
            let config = shard_config(self.timing, self.map.mode, self.map.replicas);
            self.shards.insert(shard.id, ShardCoordinator::new(config, shard.view(), incarnations, now));
        }
        self.map = map;
        self.changed = true;
        Ok(())
    }

    /// Removes a table and its shards; nodes drop them on their next
    /// heartbeat.
    pub fn drop_table(&mut self, name: &str) -> Result<(), MapError> {
        if name == DEFAULT_TABLE {
            return Err(MapError::Invalid("the default table cannot be dropped".into()));
        }
        if self.map.table(name).is_none() {
            return Err(MapError::Invalid(format!("no such table '{name}'")));
        }
        let migrating = self
            .map
            .shards
            .iter()
            .any(|shard| shard.table == name && self.map.migration_of(shard.id).is_some());
        if migrating {
            return Err(MapError::Invalid(format!(
                "table {name} has slots migrating; cancel the migration first"
            )));
        }
        self.map.tables.retain(|table| table.name != name);
        let dropped: Vec<u32> =
            self.map.shards.iter().filter(|shard| shard.table == name).map(|shard| shard.id).collect();
        self.map.shards.retain(|shard| shard.table != name);
        for id in dropped {
            self.shards.remove(&id);
        }
        self.map.epoch += 1;
        self.changed = true;
        Ok(())
    }

    /// Creates or changes a user, if it is still as the caller saw it
    /// (`expected`: its rules then, `None` for no user): a node computes a
    /// user's new rules from its copy of the map, and two nodes changing the
    /// same user at once must not lose one change to the other.
    pub fn set_user(&mut self, name: &str, expected: Option<&str>, rules: &str) -> Result<(), MapError> {
        let current = self.map.users.get(name).map(String::as_str);
        if current != expected {
            return Err(MapError::UserChanged(name.to_string()));
        }
        self.change_validated(|map| {
            map.users.insert(name.to_string(), rules.to_string());
        })
    }

    /// Deletes users; how many there were.
    pub fn delete_users(&mut self, names: &[String]) -> usize {
        let deleted = names.iter().filter(|name| self.map.users.remove(name.as_str()).is_some()).count();
        if deleted > 0 {
            self.map.epoch += 1;
            self.changed = true;
        }
        deleted
    }

    /// Changes a copy of the map, raises its epoch and takes it only if it
    /// is still valid.
    fn change_validated(&mut self, change: impl FnOnce(&mut ClusterMap)) -> Result<(), MapError> {
        let mut map = self.map.clone();
        change(&mut map);
        map.epoch += 1;
        map.validate()?;
        self.map = map;
        self.changed = true;
        Ok(())
    }

    /// The map, if it changed since the last call: the caller stores it.
    pub fn take_changed_map(&mut self) -> Option<ClusterMap> {
        std::mem::take(&mut self.changed).then(|| self.map.clone())
    }
}

/// Inclusive slot ranges, sorted and merged.
fn normalize(ranges: &[(u16, u16)]) -> Vec<(u16, u16)> {
    let mut slots = vec![false; SLOTS];
    for (first, last) in ranges {
        if first <= last && (*last as usize) < SLOTS {
            slots[*first as usize..=*last as usize].fill(true);
        } else {
            return ranges.to_vec(); // left for validation to refuse
        }
    }
    ranges_of(&slots)
}

/// The inclusive ranges of the slots marked.
fn ranges_of(slots: &[bool]) -> Vec<(u16, u16)> {
    let mut ranges: Vec<(u16, u16)> = Vec::new();
    for (slot, _) in slots.iter().enumerate().filter(|(_, owned)| **owned) {
        let slot = slot as u16;
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == slot => *last = slot,
            _ => ranges.push((slot, slot)),
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{FileStore, MetadataStore};

    fn labelled(label: &str) -> Mode {
        Mode::named(label).unwrap()
    }

    fn cluster(nodes: usize, members: usize) -> ClusterCoordinator {
        let addresses: Vec<String> = (0..nodes).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        let map = ClusterMap::place("c1", labelled("ms+sc"), 3, &addresses, members).unwrap();
        ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 0)
    }

    fn beat(coordinator: &mut ClusterCoordinator, now: u64, node: u32) -> Grants {
        coordinator.heartbeat(now, node, 1, &BTreeMap::new()).unwrap()
    }

    #[test]
    fn members_get_a_lease_on_each_of_their_shards() {
        let mut coordinator = cluster(4, 3);
        let grants = beat(&mut coordinator, 10, 0);
        assert_eq!(grants.shards.len(), 3, "with 3 members and 3 replicas, every node is in every shard");
        assert!(coordinator.take_changed_map().is_some(), "its incarnation is news to keep");
        beat(&mut coordinator, 20, 0);
        assert!(coordinator.take_changed_map().is_none());
        assert!(beat(&mut coordinator, 10, 3).shards.is_empty(), "a standby with nothing to join");
        assert_eq!(
            coordinator.check_join("other", 0),
            Err(JoinError::WrongCluster { expected: "c1".into(), got: "other".into() })
        );
        assert_eq!(coordinator.check_join("c1", 9), Err(JoinError::UnknownNode(9)));
    }

    #[test]
    fn a_dead_member_is_replaced_by_a_standby_that_joins_as_a_learner() {
        let mut coordinator = cluster(4, 3);
        for now in (0..=400).step_by(50) {
            beat(&mut coordinator, now, 0);
            beat(&mut coordinator, now, 1);
            beat(&mut coordinator, now, 3);
            coordinator.tick(now);
        }
        let map = coordinator.take_changed_map().expect("node 2 was removed");
        assert!(map.epoch > 1);
        assert!(map.shards.iter().all(|shard| !shard.members.contains(&2)));
        // The standby was offered, one heartbeat at a time, to every shard short
        // of a replica (its fair share is 3 of the 9 replicas), as their learner.
        let joining: Vec<_> = map.shards.iter().filter(|shard| shard.learners.contains(&3)).collect();
        assert_eq!(joining.len(), 3);
        assert_eq!(map.node(3).unwrap().role, NodeRole::Member);
        // The tail reports the learner caught up: it becomes the tail.
        let shard = joining[0].id;
        let tail = *joining[0].members.last().unwrap();
        let number = joining[0].view_number;
        let ready = BTreeMap::from([(
            shard,
            Progress { applied: 5, learner_ready: Some((NodeId(3), number)), drained: None, migration: None },
        )]);
        coordinator.heartbeat(450, tail, 1, &ready).unwrap();
        let map = coordinator.take_changed_map().unwrap();
        assert_eq!(map.shard(shard).unwrap().members.last(), Some(&3));
        assert_eq!(map.shard(shard).unwrap().incarnations.get(&3), Some(&1));
    }

    #[test]
    fn standbys_are_added_with_new_ids_and_checked_addresses() {
        let mut coordinator = cluster(3, 3);
        let epoch = coordinator.map().epoch;
        assert_eq!(coordinator.add_standby("127.0.0.1:7010").unwrap(), 3);
        assert_eq!(coordinator.map().epoch, epoch + 1);
        assert!(coordinator.take_changed_map().is_some(), "the new node is stored");
        assert!(coordinator.add_standby("127.0.0.1:7010").is_err(), "one node per address");
        assert!(coordinator.add_standby("no port").is_err());
        assert_eq!(coordinator.map().nodes.len(), 4, "a refused node leaves the map as it was");
        assert_eq!(coordinator.map().node(3).unwrap().role, NodeRole::Standby);
    }

    #[test]
    fn tables_get_replica_groups_on_the_default_tables_nodes_and_leave_with_them() {
        let mut coordinator = cluster(4, 3);
        let table = |name: &str, prefix: &str, engine: &str| ClusterTable {
            name: name.into(),
            prefix: prefix.into(),
            engine: engine.into(),
            options: BTreeMap::new(),
            split_keys: None,
        };
        coordinator.create_table(table("events", "ev:", "lsm"), 0).unwrap();
        let map = coordinator.take_changed_map().expect("stored");
        let events: Vec<&Shard> = map.shards.iter().filter(|shard| shard.table == "events").collect();
        assert_eq!(events.len(), 3);
        for (event_shard, slot_shard) in events.iter().zip(map.slot_shards()) {
            assert_eq!((&event_shard.slots, &event_shard.members), (&slot_shard.slots, &slot_shard.members));
            assert_ne!(event_shard.id, slot_shard.id);
        }
        // Heartbeats now grant the table's shards too.
        assert_eq!(beat(&mut coordinator, 10, 0).shards.len(), 6);
        for (bad, why) in [
            (table("events", "other:", "lsm"), "twice"),
            (table("more", "ev:", "lsm"), "shared prefix"),
            (table("bad", "b:", "nosuch"), "nosuch"),
            (table("remote", "r:", "redis"), "redis engine"),
            (table("no space", "n:", "memory"), "invalid table name"),
        ] {
            let error = coordinator.create_table(bad, 0).unwrap_err().to_string();
            assert!(error.contains(why), "{error}");
        }
        assert_eq!(coordinator.map().tables.len(), 1, "refused tables change nothing");
        coordinator.drop_table("events").unwrap();
        assert!(coordinator.map().shards.iter().all(|shard| shard.table == DEFAULT_TABLE));
        assert_eq!(beat(&mut coordinator, 20, 0).shards.len(), 3);
        assert!(coordinator.drop_table("events").is_err());
        assert!(coordinator.drop_table(DEFAULT_TABLE).is_err());
    }

    #[test]
    fn a_range_partitioned_table_gets_a_group_per_range_with_heads_spread() {
        let mut coordinator = cluster(4, 3);
        let splits = ["ix:d", "ix:h", "ix:m", "ix:s"].map(String::from).to_vec();
        let table = ClusterTable {
            name: "index".into(),
            prefix: "ix:".into(),
            engine: "ordered".into(),
            options: BTreeMap::new(),
            split_keys: Some(splits),
        };
        coordinator.create_table(table.clone(), 0).unwrap();
        let map = coordinator.map().clone();
        let ranges: Vec<&Shard> = map.shards.iter().filter(|shard| shard.table == "index").collect();
        assert_eq!(
            ranges.iter().map(|shard| shard.range).collect::<Vec<_>>(),
            (0..5).map(Some).collect::<Vec<_>>()
        );
        let heads: std::collections::BTreeSet<u32> = ranges.iter().map(|shard| shard.members[0]).collect();
        assert_eq!(heads.len(), 3, "every serving node heads some range");
        assert!(ranges.iter().all(|shard| shard.slots.is_empty() && shard.members.len() == 3));
        let unordered = ClusterTable {
            name: "bad".into(),
            prefix: "b:".into(),
            split_keys: Some(vec!["b:z".into(), "b:a".into()]),
            ..table
        };
        assert!(coordinator.create_table(unordered, 0).unwrap_err().to_string().contains("split keys"));
    }

    #[test]
    fn a_restarted_coordinator_still_knows_who_lost_their_state() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        let mut coordinator = cluster(3, 3);
        for node in 0..3 {
            beat(&mut coordinator, 0, node);
        }
        // The incarnations first heard are in the map to store.
        let map = coordinator.take_changed_map().unwrap();
        assert!(map.shards.iter().all(|shard| shard.incarnations.len() == 3));
        let version = store.store(None, &map).unwrap();
        let stored = store.load().unwrap().unwrap();
        assert_eq!(stored.version, version);
        let mut restarted =
            ClusterCoordinator::new(stored.map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 500);
        assert!(!restarted.heartbeat(500, 0, 1, &BTreeMap::new()).unwrap().shards.is_empty());
        // Node 1 restarted with nothing while the coordinator was down.
        assert!(restarted.heartbeat(500, 1, 2, &BTreeMap::new()).unwrap().shards.is_empty());
    }

    #[test]
    fn a_table_switches_modes_alone_once_every_member_has_drained() {
        let mut coordinator = cluster(3, 3);
        let events = ClusterTable {
            name: "events".into(),
            prefix: "ev:".into(),
            engine: "memory".into(),
            options: BTreeMap::new(),
            split_keys: None,
        };
        coordinator.create_table(events, 0).unwrap();
        for node in 0..3 {
            beat(&mut coordinator, 5, node);
        }
        assert_eq!(coordinator.alter_table("events", labelled("aa+sc"), 10), Ok(3));
        let switching: Vec<u32> = coordinator
            .map()
            .shards
            .iter()
            .filter(|shard| shard.table == "events")
            .map(|shard| shard.id)
            .collect();
        let err = coordinator.alter_table("events", labelled("ms+ec"), 11).unwrap_err();
        assert!(err.to_string().contains("already switching"), "{err}");
        assert!(coordinator.alter_table("nosuch", labelled("ms+ec"), 11).is_err());
        // Draining views, still in the old mode; the default table untouched.
        let grants = beat(&mut coordinator, 20, 0);
        for (shard, view, mode) in &grants.shards {
            assert_eq!(view.draining, switching.contains(shard), "shard {shard}");
            assert_eq!(*mode, labelled("ms+sc"));
        }
        // Reports of drained views: the shard ends its transition only once
        // all three members have drained in its current view.
        let drained = |coordinator: &ClusterCoordinator| -> BTreeMap<u32, Progress> {
            switching
                .iter()
                .map(|id| {
                    let view = coordinator.map().shard(*id).unwrap().view_number;
                    (*id, Progress { drained: Some(view), ..Progress::default() })
                })
                .collect()
        };
        for node in 0..2 {
            let report = drained(&coordinator);
            coordinator.heartbeat(30, node, 1, &report).unwrap();
        }
        assert!(coordinator
            .map()
            .shards
            .iter()
            .all(|shard| shard.table != "events" || shard.next_mode.is_some()));
        let report = drained(&coordinator);
        let grants = coordinator.heartbeat(30, 2, 1, &report).unwrap();
        for (shard, view, mode) in &grants.shards {
            assert!(!view.draining);
            let expected = if switching.contains(shard) { labelled("aa+sc") } else { labelled("ms+sc") };
            assert_eq!(*mode, expected, "shard {shard}");
        }
        let map = coordinator.take_changed_map().expect("stored");
        for shard in &map.shards {
            assert_eq!(shard.next_mode, None);
            assert_eq!(
                map.mode_of(shard),
                if switching.contains(&shard.id) { labelled("aa+sc") } else { labelled("ms+sc") }
            );
        }
        // A coordinator restarted from the stored map keeps the mode.
        let restarted = ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 40);
        assert_eq!(restarted.map().mode_of(restarted.map().shard(switching[0]).unwrap()), labelled("aa+sc"));
    }

    #[test]
    fn a_transition_carries_on_under_a_restarted_coordinator() {
        let mut coordinator = cluster(3, 3);
        for node in 0..3 {
            beat(&mut coordinator, 5, node);
        }
        assert_eq!(coordinator.alter_table(DEFAULT_TABLE, labelled("ms+ec"), 10), Ok(3));
        let map = coordinator.take_changed_map().expect("stored");
        let mut restarted =
            ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 20);
        let report: BTreeMap<u32, Progress> = restarted
            .map()
            .shards
            .iter()
            .map(|shard| (shard.id, Progress { drained: Some(shard.view_number), ..Progress::default() }))
            .collect();
        for node in 0..3 {
            restarted.heartbeat(30, node, 1, &report).unwrap();
        }
        let map = restarted.map();
        assert!(map
            .shards
            .iter()
            .all(|shard| shard.next_mode.is_none() && map.mode_of(shard) == labelled("ms+ec")));
    }

    #[test]
    fn a_head_is_handed_over_after_a_drain_even_across_a_coordinator_restart() {
        let mut coordinator = cluster(3, 3);
        for node in 0..3 {
            beat(&mut coordinator, 5, node);
        }
        let shard = coordinator.map().shards[0].clone();
        let (head, next) = (shard.members[0], shard.members[2]);
        let refused = |result: Result<(), MapError>| result.unwrap_err().to_string();
        assert!(refused(coordinator.start_handover(shard.id, head, 10)).contains("already heads"));
        assert!(refused(coordinator.start_handover(shard.id, 9, 10)).contains("not a member"));
        coordinator.start_handover(shard.id, next, 10).unwrap();
        assert!(refused(coordinator.start_handover(shard.id, shard.members[1], 10)).contains("draining"));
        let other = coordinator.map().shards[1].id;
        let migrating = coordinator.start_migration(shard.id, other, shard.slots.clone()).map(drop);
        assert!(refused(migrating).contains("draining"));
        let draining = coordinator.map().shard(shard.id).unwrap().clone();
        assert!(draining.view().draining);
        assert_eq!(draining.next_head, Some(next));
        assert_eq!(coordinator.map().mode_label(&draining), format!("ms+sc (handing the head to n{next})"));
        // Grants keep the mode: the shard drains to the mode it runs.
        for (_, _, mode) in beat(&mut coordinator, 20, 0).shards {
            assert_eq!(mode, labelled("ms+sc"));
        }

        let map = coordinator.take_changed_map().expect("stored");
        let mut restarted =
            ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 30);
        let drained = |coordinator: &ClusterCoordinator| {
            let view = coordinator.map().shard(shard.id).unwrap().view_number;
            BTreeMap::from([(shard.id, Progress { drained: Some(view), ..Progress::default() })])
        };
        for node in 0..3 {
            let report = drained(&restarted);
            restarted.heartbeat(40, node, 1, &report).unwrap();
        }
        let done = restarted.map().shard(shard.id).unwrap();
        assert!(!done.view().draining);
        assert_eq!(done.members[0], next);
        assert_eq!(done.members.len(), 3);
        assert_eq!(
            (done.next_head, done.next_mode, restarted.map().mode_of(done)),
            (None, None, labelled("ms+sc"))
        );
    }

    #[test]
    fn a_user_changes_only_from_the_rules_the_changer_saw() {
        let mut coordinator = cluster(3, 3);
        coordinator.set_user("alice", None, "on #aa ~* +get").unwrap();
        let epoch = coordinator.map().epoch;
        // Two nodes computed changes from the same rules: the second is refused.
        coordinator.set_user("alice", Some("on #aa ~* +get"), "on #aa ~* +get +set").unwrap();
        let late = coordinator.set_user("alice", Some("on #aa ~* +get"), "on #aa ~* +get +del");
        assert!(matches!(late, Err(MapError::UserChanged(_))), "{late:?}");
        assert!(matches!(coordinator.set_user("alice", None, "off"), Err(MapError::UserChanged(_))));
        assert_eq!(coordinator.map().users["alice"], "on #aa ~* +get +set");
        assert_eq!(coordinator.map().epoch, epoch + 1);
        assert!(coordinator.set_user("bad name", None, "on").is_err(), "names have no spaces");
        assert_eq!(coordinator.delete_users(&["alice".into(), "nobody".into()]), 1);
        assert!(coordinator.map().users.is_empty() && coordinator.take_changed_map().is_some());
        assert_eq!(coordinator.delete_users(&["alice".into()]), 0);
        assert!(coordinator.take_changed_map().is_none(), "nothing deleted, nothing to store");
    }
}

#[cfg(test)]
mod migration_tests {
    use super::*;

    fn cluster() -> ClusterCoordinator {
        let addresses: Vec<String> = (0..3).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        let map = ClusterMap::place_groups("c1", Mode::named("ms+sc").unwrap(), 3, &addresses, 3, 6).unwrap();
        let mut coordinator =
            ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 0);
        for node in 0..3 {
            coordinator.heartbeat(1, node, 1, &BTreeMap::new()).unwrap();
        }
        coordinator
    }

    fn first_member(coordinator: &ClusterCoordinator, shard: u32) -> u32 {
        coordinator.map().shard(shard).unwrap().members[0]
    }

    /// Every node's heartbeat: drained in the shard's view if `drained`, and
    /// the source's first member reporting `report` for the migration.
    fn beat_all(
        coordinator: &mut ClusterCoordinator,
        now: u64,
        shard: u32,
        drained: bool,
        report: MigrationReport,
    ) {
        for node in 0..3 {
            let view = coordinator.map().shard(shard).unwrap().view_number;
            let migration = (first_member(coordinator, shard) == node).then_some(report);
            let progress = Progress { drained: drained.then_some(view), migration, ..Progress::default() };
            coordinator.heartbeat(now, node, 1, &BTreeMap::from([(shard, progress)])).unwrap();
        }
    }

    #[test]
    fn slots_move_once_the_source_has_drained_and_forwarded_everything() {
        let mut coordinator = cluster();
        let (from, to) = (0, 3);
        let err = coordinator.start_migration(from, to, vec![(5000, 5001)]).unwrap_err();
        assert!(err.to_string().contains("does not own"), "{err}");
        let id = coordinator.start_migration(from, to, vec![(10, 19), (0, 9)]).unwrap();
        assert_eq!(coordinator.map().migrations[0].slots, vec![(0, 19)], "ranges merged");
        let err = coordinator.start_migration(1, to, vec![(3000, 3000)]).unwrap_err();
        assert!(err.to_string().contains("already takes part"), "{err}");
        let err = coordinator.alter_table(DEFAULT_TABLE, Mode::named("aa+ec").unwrap(), 2).unwrap_err();
        assert!(err.to_string().contains("migrating"), "{err}");

        let copying = MigrationReport { id, entries: 10, bytes: 100, ..MigrationReport::default() };
        beat_all(&mut coordinator, 10, from, false, copying);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Copying);
        let caught_up = MigrationReport { caught_up: true, ..copying };
        beat_all(&mut coordinator, 20, from, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Cutting);
        let cut_view = coordinator.map().shard(from).unwrap().view();
        assert!(cut_view.draining, "the source drains");

        // Drained everywhere, but the forwarded view is not reported yet:
        // the slots stay.
        beat_all(&mut coordinator, 30, from, true, caught_up);
        assert!(coordinator.map().shard(from).unwrap().owns(0));
        assert!(coordinator.map().shard(from).unwrap().view().draining, "a cut does not end on its own");
        let forwarded = MigrationReport { forwarded_in: Some(cut_view.number), ..caught_up };
        let epoch = coordinator.map().epoch;
        beat_all(&mut coordinator, 40, from, true, forwarded);
        let map = coordinator.map();
        assert!(map.epoch > epoch);
        assert!(map.migrations.is_empty());
        assert!(!map.shard(from).unwrap().owns(0) && !map.shard(from).unwrap().owns(19));
        assert!(map.shard(from).unwrap().owns(20));
        assert!(map.shard(to).unwrap().owns(0) && map.shard(to).unwrap().owns(19));
        assert!(!map.shard(from).unwrap().view().draining, "the source serves its other slots again");
        assert_eq!(map.shard(to).unwrap().slots.len(), 2, "the target's own range and the moved one");
        map.validate().unwrap();
    }

    #[test]
    fn a_cut_that_takes_too_long_is_given_up_and_tried_again() {
        let mut coordinator = cluster();
        let id = coordinator.start_migration(0, 3, vec![(0, 9)]).unwrap();
        let caught_up = MigrationReport { id, caught_up: true, ..MigrationReport::default() };
        beat_all(&mut coordinator, 10, 0, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Cutting);
        coordinator.tick(10 + CUT_TIMEOUT_MS + 1);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Copying);
        assert!(!coordinator.map().shard(0).unwrap().view().draining, "writes flow again");
        assert!(coordinator.map().shard(0).unwrap().owns(0), "nothing moved");
        let later = 10 + CUT_TIMEOUT_MS + 1 + CUT_RETRY_AFTER_MS;
        beat_all(&mut coordinator, later - 100, 0, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Copying, "not yet");
        beat_all(&mut coordinator, later, 0, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Cutting);
    }

    #[test]
    fn a_restarted_coordinator_carries_on_a_cut_and_cancelling_ends_it() {
        let mut coordinator = cluster();
        let id = coordinator.start_migration(0, 3, vec![(0, 9)]).unwrap();
        let caught_up = MigrationReport { id, caught_up: true, ..MigrationReport::default() };
        beat_all(&mut coordinator, 10, 0, false, caught_up);
        let map = coordinator.take_changed_map().unwrap();
        let mut restarted =
            ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 20);
        beat_all(&mut restarted, 30, 0, true, caught_up);
        assert!(restarted.map().shard(0).unwrap().view().draining, "still cutting: drained is not enough");
        restarted.cancel_migration(id, 40).unwrap();
        let map = restarted.map();
        assert!(map.migrations.is_empty() && !map.shard(0).unwrap().view().draining);
        assert!(map.shard(0).unwrap().owns(0));
        assert!(restarted.cancel_migration(id, 50).is_err(), "no such migration any more");
        assert_eq!(restarted.start_migration(0, 3, vec![(0, 9)]).unwrap(), id + 1, "ids are never reused");
    }

    /// Moves migration `id` (of shard `from`) through its cut.
    fn cut_over(coordinator: &mut ClusterCoordinator, now: u64, from: u32, id: u64) {
        let caught_up = MigrationReport { id, caught_up: true, ..MigrationReport::default() };
        beat_all(coordinator, now, from, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Cutting);
        let view = coordinator.map().shard(from).unwrap().view_number;
        let forwarded = MigrationReport { forwarded_in: Some(view), ..caught_up };
        beat_all(coordinator, now + 10, from, true, forwarded);
    }

    #[test]
    fn redis_resharding_opens_a_slot_copies_it_and_cuts_over_only_once_committed() {
        let mut coordinator = cluster();
        // Six groups on three nodes: node 0 heads shards 0 and 3, node 1
        // shards 1 and 4. Slot 0 is shard 0's.
        let refused = |coordinator: &mut ClusterCoordinator, node, slot, command| {
            coordinator.set_slot(node, slot, command, 1).unwrap_err().to_string()
        };
        assert_eq!(
            refused(&mut coordinator, 1, 0, SlotCommand::Migrating { target: 0 }),
            "I'm not the owner of hash slot 0"
        );
        assert_eq!(
            refused(&mut coordinator, 0, 0, SlotCommand::Importing { source: 1 }),
            "I'm already the owner of hash slot 0"
        );
        assert_eq!(
            refused(&mut coordinator, 0, 0, SlotCommand::Migrating { target: 9 }),
            "I don't know about node 9"
        );
        assert_eq!(refused(&mut coordinator, 0, 16384, SlotCommand::Stable), "Invalid or out of range slot");
        assert!(refused(&mut coordinator, 0, 0, SlotCommand::Commit { target: 1 }).contains("not open"));

        coordinator.set_slot(1, 0, SlotCommand::Importing { source: 0 }, 1).unwrap();
        let open = coordinator.map().open_slot(0).cloned().unwrap();
        assert_eq!(
            (open.from, open.to, open.importing, open.migrating),
            (0, 1, true, false),
            "the target's group with the fewest slots"
        );
        assert!(coordinator.map().migrations.is_empty(), "one mark moves nothing");
        let err = coordinator.start_migration(0, 3, vec![(0, 9)]).unwrap_err();
        assert!(err.to_string().contains("STABLE"), "{err}");

        coordinator.set_slot(0, 0, SlotCommand::Migrating { target: 1 }, 2).unwrap();
        let id = coordinator.map().open_slot(0).unwrap().migration.expect("both marks start the copy");
        assert_eq!(coordinator.map().migrations[0].slots, vec![(0, 0)]);
        let caught_up = MigrationReport { id, caught_up: true, ..MigrationReport::default() };
        beat_all(&mut coordinator, 10, 0, false, caught_up);
        assert_eq!(coordinator.map().migrations[0].phase, MigrationPhase::Copying, "no cut before a commit");

        // A restarted coordinator keeps the open slot; MIGRATE commits it.
        let map = coordinator.take_changed_map().unwrap();
        let mut coordinator =
            ClusterCoordinator::new(map, Timing { lease_ms: 200, failure_timeout_ms: 150 }, 20);
        coordinator.set_slot(0, 0, SlotCommand::Commit { target: 1 }, 20).unwrap();
        cut_over(&mut coordinator, 30, 0, id);
        let map = coordinator.map();
        assert!(map.shard(1).unwrap().owns(0) && !map.shard(0).unwrap().owns(0));
        assert!(map.open_slots.is_empty() && map.migrations.is_empty(), "moving closes the slot");
        coordinator.set_slot(2, 0, SlotCommand::Node { owner: 1 }, 50).unwrap();
        assert!(coordinator.map().migrations.is_empty(), "already node 1's: nothing to do");

        // The next slot joins the range it borders, not the smaller group.
        coordinator.set_slot(1, 1, SlotCommand::Importing { source: 0 }, 60).unwrap();
        assert_eq!(coordinator.map().open_slot(1).unwrap().to, 1);
        coordinator.set_slot(0, 1, SlotCommand::Migrating { target: 1 }, 60).unwrap();
        assert_eq!(coordinator.map().migrations.len(), 1);
        coordinator.set_slot(1, 1, SlotCommand::Stable, 70).unwrap();
        assert!(
            coordinator.map().open_slots.is_empty() && coordinator.map().migrations.is_empty(),
            "STABLE cancels"
        );
        assert!(coordinator.map().shard(0).unwrap().owns(1));

        // SETSLOT NODE alone opens, commits and moves the slot.
        coordinator.set_slot(2, 5, SlotCommand::Node { owner: 1 }, 80).unwrap();
        let id = coordinator.map().open_slot(5).unwrap().migration.unwrap();
        cut_over(&mut coordinator, 90, 0, id);
        assert!(coordinator.map().shard(4).unwrap().owns(5), "node 1's group with the fewest slots now");
        coordinator.map().validate().unwrap();
    }

    #[test]
    fn a_slot_still_moves_when_its_target_head_was_replaced_meanwhile() {
        let mut coordinator = cluster();
        coordinator.set_slot(1, 0, SlotCommand::Importing { source: 0 }, 1).unwrap();
        coordinator.set_slot(0, 0, SlotCommand::Migrating { target: 1 }, 1).unwrap();
        // Node 1 falls behind in both groups it headed (as after a failover
        // and its return): it heads none, and is a member of every group.
        for shard in coordinator.map.shards.iter_mut().filter(|shard| shard.members[0] == 1) {
            shard.members.rotate_left(1);
        }
        assert_eq!(coordinator.map.headed_by(1).count(), 0);
        coordinator.set_slot(2, 0, SlotCommand::Node { owner: 1 }, 2).unwrap();
        let open = coordinator.map().open_slot(0).cloned().unwrap();
        assert!(open.committed && open.migration.is_some(), "committed, not closed: {open:?}");
        cut_over(&mut coordinator, 10, 0, open.migration.unwrap());
        assert!(coordinator.map().shard(1).unwrap().owns(0));
        coordinator.set_slot(0, 0, SlotCommand::Node { owner: 1 }, 30).unwrap();
        assert!(coordinator.map().migrations.is_empty(), "the slot is its group's: nothing more moves");
    }
}

#[cfg(test)]
mod replica_move_tests {
    use super::*;

    #[test]
    fn a_replica_moves_to_a_new_node_and_the_old_one_is_retired_through_a_drain() {
        let addresses: Vec<String> = (0..4).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        let map = ClusterMap::place("c1", Mode::named("ms+sc").unwrap(), 3, &addresses, 3).unwrap();
        let timing = Timing { lease_ms: 200, failure_timeout_ms: 150 };
        let mut coordinator = ClusterCoordinator::new(map, timing, 0);
        let beat = |coordinator: &mut ClusterCoordinator, now, node, progress: BTreeMap<u32, Progress>| {
            coordinator.heartbeat(now, node, 1, &progress).unwrap()
        };
        for node in 0..4 {
            beat(&mut coordinator, 1, node, BTreeMap::new());
        }
        assert!(coordinator.start_replica_move(0, 3, 0).is_err(), "node 3 holds no replica of shard 0");
        assert!(coordinator.start_replica_move(0, 1, 2).is_err(), "node 2 already holds one");
        coordinator.start_replica_move(0, 1, 3).unwrap();
        assert!(coordinator.remove_node(3).is_err(), "a replica moves to it");
        // The new node joins shard 0 as a learner behind the tail.
        beat(&mut coordinator, 10, 3, BTreeMap::new());
        assert_eq!(coordinator.map().shard(0).unwrap().learners, vec![3]);
        // The tail reports it caught up: promoted, and the shard drains to
        // retire the old replica, which keeps its lease meanwhile.
        let view = coordinator.map().shard(0).unwrap().view_number;
        let ready = Progress { learner_ready: Some((NodeId(3), view)), ..Progress::default() };
        beat(&mut coordinator, 20, 2, BTreeMap::from([(0, ready)]));
        let shard = coordinator.map().shard(0).unwrap().clone();
        assert_eq!(shard.members, vec![0, 1, 2, 3]);
        assert_eq!(shard.next_mode, Some(Mode::named("ms+sc").unwrap()), "draining to retire node 1");
        assert_eq!(coordinator.map().mode_label(&shard), "ms+sc (draining)");
        let grants = beat(&mut coordinator, 30, 1, BTreeMap::new());
        assert!(grants.shards.iter().any(|(shard, _, _)| *shard == 0), "the retiring replica serves on");
        // A coordinator that restarts meanwhile finishes the drain, then
        // retires the replica through another.
        let mut coordinator = ClusterCoordinator::new(coordinator.map().clone(), timing, 40);
        let drained = |view| BTreeMap::from([(0, Progress { drained: Some(view), ..Progress::default() })]);
        for round in 0..2 {
            let view = coordinator.map().shard(0).unwrap().view_number;
            for node in 0..4 {
                beat(&mut coordinator, 50 + round, node, drained(view));
            }
        }
        let shard = coordinator.map().shard(0).unwrap();
        assert_eq!(shard.members, vec![0, 2, 3]);
        assert_eq!(shard.next_mode, None, "serving again");
        assert!(coordinator.map().replica_moves.is_empty(), "the move is done");
        // A node that serves nothing can be taken out of the map.
        assert!(coordinator.remove_node(1).is_err(), "node 1 still serves shards 1 and 2");
    }
}
