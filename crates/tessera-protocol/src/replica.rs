//! One replica of a shard on one node, as the node's agent and the
//! simulator both drive it: the shard's protocol (in a [`Switchable`], so the
//! shard can change modes), the mode it runs, the view and lease the
//! coordinator granted, and the barrier a new head orders. The drivers only
//! deliver events and carry out the effects; the rules in between — how a
//! grant becomes a lease, when a transition's end swaps the protocol, when a
//! head may serve from its own copy — are written once, here.
//!
//! Leases (docs/PROTOCOLS.md, "Leases"): a grant answers a heartbeat sent at
//! local time `asked_at`; the replica may act alone until `asked_at +
//! lease_ms` on its own clock, while the coordinator waits `lease_ms` from
//! when it *received* that heartbeat before replacing it.
//!
//! Request ids are this replica's: [`Replica::submit`] hands them out, and
//! every `Reply` effect names one.

use std::collections::VecDeque;
use std::sync::Arc;

use tessera_engine::{reserved, Engine};

use crate::backup::{BackupStep, ShardBackup};
use crate::handoff::HandoffMessage;
use crate::migration::{
    Batches, Change, Incoming, KeyFilter, MigrationMessage, MigrationSource, MigrationTarget, ObservedEngine,
    Outgoing, Sweep,
};
use crate::registry::{Mode, Start, Tuning};
use crate::snapshot::StreamNumbers;
use crate::transition::TransitionMessage;
use crate::{
    ClientRequest, Effect, Effects, NodeId, Operation, PeerMessage, Progress, Protocol, RequestId, ShardView,
    Switchable, Time, WritePosition,
};

#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub me: NodeId,
    /// How long a grant lasts, from when the heartbeat that earned it was
    /// sent; the coordinator's lease.
    pub lease_ms: u64,
    pub tuning: Tuning,
    /// For tests of the checkers: transitions skip the merge.
    #[cfg(feature = "broken")]
    pub broken_transition_without_merge: bool,
}

impl ReplicaConfig {
    pub fn new(me: NodeId, lease_ms: u64, tuning: Tuning) -> Self {
        Self {
            me,
            lease_ms,
            tuning,
            #[cfg(feature = "broken")]
            broken_transition_without_merge: false,
        }
    }
}

/// This replica's place in its shard's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The only member: head and tail at once.
    Alone,
    Head,
    Middle,
    Tail,
    /// Receiving the shard's state; serves nothing yet.
    Learner,
}

/// Why a replica does not serve a request itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It is not the member that serves it (not the head, or not a member).
    NotOwner,
    /// It is the head but its lease has run out (a new view may be coming).
    LeaseExpired,
    /// The shard is switching modes: writes and strong reads wait until it
    /// has.
    Draining,
    /// This head's barrier failed: it is about to lose the head's role.
    Unsettled,
}

/// What a strong read at the head waits for before its answer may go out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadGate {
    /// Nothing: the head's copy holds only what is committed or in flight
    /// on the keys (which the node waits for, per key).
    Open,
    /// The barrier this new head ordered: once it commits, so has whatever
    /// the previous head left in flight.
    AfterBarrier(RequestId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BarrierState {
    Pending(RequestId),
    Committed,
    Failed,
}

/// What the agent's heartbeat loop should know after a peer message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heard {
    /// A peer is in a view this replica has not been granted: ask the
    /// coordinator now rather than at the next heartbeat.
    pub newer_view: bool,
    /// The shard has just drained here: its transition's end is one
    /// heartbeat away.
    pub drained: bool,
}

/// A group's replication lag as one replica sees it: writes it took that
/// some other member is not known to hold, and how long ago the oldest of
/// them was taken (to within a tick).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicationLag {
    pub writes: u64,
    pub oldest_ms: u64,
}

/// Most write positions remembered with their times. Past it the oldest are
/// kept, so the age reported stays that of the oldest write behind.
const WRITE_TIMES_MAX: usize = 256;

/// When this replica's write position first reached each of its recent
/// values, as seen at its ticks, until every member holds them.
#[derive(Debug, Default)]
struct WriteTimes {
    /// The protocol instance the positions are of (a mode switch starts
    /// numbering again).
    instance: u64,
    /// (position, first seen at), positions increasing.
    samples: VecDeque<(u64, Time)>,
}

impl WriteTimes {
    fn note(&mut self, instance: u64, position: u64, replicated: u64, now: Time) {
        if instance != self.instance {
            *self = Self { instance, samples: VecDeque::new() };
        }
        while self.samples.front().is_some_and(|(sampled, _)| *sampled <= replicated) {
            self.samples.pop_front();
        }
        let advanced = self.samples.back().map_or(position > replicated, |(sampled, _)| position > *sampled);
        if advanced && self.samples.len() < WRITE_TIMES_MAX {
            self.samples.push_back((position, now));
        }
    }

    fn oldest(&self) -> Option<Time> {
        self.samples.front().map(|(_, at)| *at)
    }
}

pub struct Replica {
    config: ReplicaConfig,
    /// The engine the protocol writes through: it logs changes while a
    /// migration or a backup reads them.
    observed: Arc<ObservedEngine>,
    engine: Arc<dyn Engine>,
    mode: Mode,
    protocol: Switchable,
    /// The newest view granted, its lease (the latest any grant gave) folded in.
    view: ShardView,
    /// None until this replica heads a view of a master–slave shard.
    barrier: Option<BarrierState>,
    next_request: u64,
    /// While this replica is its shard's first member: the migrations of
    /// its keys out, and of another shard's keys in (docs/PROTOCOLS.md,
    /// "Slot migration").
    migration_out: Option<MigrationSource>,
    migration_in: Option<MigrationTarget>,
    migration_streams: StreamNumbers,
    sweep: Option<Sweep>,
    /// A backup of this replica's records under way (docs/ARCHITECTURE.md,
    /// "Backups").
    backup: Option<ShardBackup>,
    /// Counts the protocol instances this replica has run (one per mode
    /// switch), so that a write position is read only by the instance that
    /// gave it.
    instance: u64,
    write_times: WriteTimes,
}

impl Replica {
    /// A replica of a shard in `mode` over its engine, as it opens (empty, or
    /// with records it kept across a restart). It serves nothing until a
    /// grant names its view.
    pub fn new(config: ReplicaConfig, engine: Arc<dyn Engine>, mode: Mode) -> Self {
        let observed = Arc::new(ObservedEngine::new(engine));
        let engine: Arc<dyn Engine> = observed.clone();
        let instance = mode.instance(config.me, engine.clone(), Start::Open, &config.tuning);
        let protocol = Switchable::new(config.me, engine.clone(), instance, config.tuning.snapshot);
        #[cfg(feature = "broken")]
        let protocol =
            if config.broken_transition_without_merge { protocol.broken_without_merge() } else { protocol };
        let view = ShardView {
            number: 0,
            replicas: Vec::new(),
            learners: Vec::new(),
            lease_until: 0,
            draining: false,
            geo: None,
        };
        Self {
            config,
            observed,
            engine,
            mode,
            protocol,
            view,
            barrier: None,
            next_request: 1,
            migration_out: None,
            migration_in: None,
            migration_streams: StreamNumbers::default(),
            sweep: None,
            backup: None,
            instance: 0,
            write_times: WriteTimes::default(),
        }
    }

    /// The node this replica runs on.
    pub fn me(&self) -> NodeId {
        self.config.me
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn view(&self) -> &ShardView {
        &self.view
    }

    pub fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }

    pub fn lease_until(&self) -> Time {
        self.view.lease_until
    }

    pub fn progress(&self) -> Progress {
        let migration = self
            .migration_out
            .as_ref()
            .map(|source| source.report(self.drained(), self.protocol.peers_in_step()));
        Progress { migration, ..self.protocol.progress() }
    }

    /// This replica's outgoing migration has forwarded everything so far.
    #[cfg(test)]
    pub(crate) fn migration_forwarded(&self) -> bool {
        self.migration_out.as_ref().is_some_and(MigrationSource::forwarded)
    }

    /// The group's replication lag from this replica; `None` where it does
    /// not know it (see [`Protocol::replicated_through`]).
    pub fn replication_lag(&self, now: Time) -> Option<ReplicationLag> {
        let replicated = self.protocol.replicated_through()?;
        let writes = self.protocol.write_position().saturating_sub(replicated);
        let oldest_ms = match self.write_times.oldest() {
            Some(at) if writes > 0 => now.saturating_sub(at),
            _ => 0,
        };
        Some(ReplicationLag { writes, oldest_ms })
    }

    /// The keys the engine holds that are live: its count less tombstones.
    pub fn live_keys(&self) -> u64 {
        self.engine().len().unwrap_or(0).saturating_sub(self.protocol.tombstones())
    }

    /// Whether the shard is switching modes here.
    pub fn draining(&self) -> bool {
        self.protocol.draining()
    }

    /// The draining view in which this replica holds every member's records.
    pub fn drained(&self) -> Option<u64> {
        self.protocol.drained()
    }

    pub fn role(&self) -> Option<Role> {
        let me = self.config.me;
        if self.view.learners.contains(&me) {
            return Some(Role::Learner);
        }
        let position = self.view.position(me)?;
        Some(match (position == 0, position + 1 == self.view.replicas.len()) {
            (true, true) => Role::Alone,
            (true, false) => Role::Head,
            (false, true) => Role::Tail,
            (false, false) => Role::Middle,
        })
    }

    /// The barrier this head ordered, while it has not committed.
    pub fn barrier_pending(&self) -> Option<RequestId> {
        match self.barrier {
            Some(BarrierState::Pending(request)) => Some(request),
            _ => None,
        }
    }

    /// Whether this replica may order writes now: the first member, or in
    /// an active–active mode any member; not while the shard drains.
    pub fn check_write(&self) -> Result<(), Refusal> {
        let position = self.view.position(self.config.me).ok_or(Refusal::NotOwner)?;
        if self.draining() {
            return Err(Refusal::Draining);
        }
        match position {
            0 => Ok(()),
            _ if self.mode.active_active => Ok(()),
            _ => Err(Refusal::NotOwner),
        }
    }

    /// Whether this replica may answer a read from its own copy at `now`. An
    /// eventual read needs only membership; a strong one the head's role,
    /// its lease and its barrier — or, in an active–active mode, only
    /// membership (a shard running a quorum protocol runs it through the protocol).
    pub fn check_read(&self, strong: bool, now: Time) -> Result<ReadGate, Refusal> {
        let position = self.view.position(self.config.me).ok_or(Refusal::NotOwner)?;
        if !strong {
            return Ok(ReadGate::Open);
        }
        if self.draining() {
            return Err(Refusal::Draining);
        }
        if self.mode.active_active {
            return Ok(ReadGate::Open);
        }
        if position != 0 {
            return Err(Refusal::NotOwner);
        }
        if self.view.lease_until <= now {
            return Err(Refusal::LeaseExpired);
        }
        match self.barrier {
            Some(BarrierState::Pending(request)) => Ok(ReadGate::AfterBarrier(request)),
            Some(BarrierState::Failed) => Err(Refusal::Unsettled),
            Some(BarrierState::Committed) | None => Ok(ReadGate::Open),
        }
    }

    /// Hands operations to the protocol in one step, so that no view change
    /// falls between them: all in one view, or none. Returns their ids, in
    /// order; the answers come as `Reply` effects, now or later.
    pub fn submit(
        &mut self,
        operations: impl IntoIterator<Item = Operation>,
        fx: &mut Effects,
    ) -> Vec<RequestId> {
        let mark = fx.as_slice().len();
        let ids: Vec<RequestId> = operations
            .into_iter()
            .map(|operation| {
                let id = self.next_id();
                self.protocol.on_client(ClientRequest { id, operation }, fx);
                id
            })
            .collect();
        self.after_event(mark, fx);
        ids
    }

    fn next_id(&mut self) -> RequestId {
        next_id(&mut self.next_request)
    }

    /// Where the newest write this replica took stands, for WAIT.
    pub fn write_position(&self) -> WritePosition {
        WritePosition { instance: self.instance, position: self.protocol.write_position() }
    }

    /// How many other members are known to hold every write this replica
    /// took through `written`: none once it is no member; every one if the
    /// shard switched modes since (a switch ends only once every member
    /// holds the same records).
    pub fn replicas_holding(&self, written: WritePosition) -> usize {
        if self.view.position(self.config.me).is_none() {
            return 0;
        }
        let others = self.view.replicas.len() - 1;
        if written.instance != self.instance {
            return others;
        }
        self.protocol.replicas_holding(written.position).min(others)
    }

    /// Deletes, through the protocol, the live keys `strays` picks (keys of
    /// slots the shard no longer owns); only the first member sweeps. A
    /// sweep under way starts over with the new filter.
    pub fn sweep(&mut self, strays: KeyFilter) {
        if self.view.position(self.config.me) == Some(0) {
            self.sweep = Some(Sweep::new(strays));
        }
    }

    /// A grant of `view`, in which the shard runs `mode`, for the heartbeat
    /// this replica sent at `asked_at` (its own clock). A grant of an older
    /// view than one already granted (a late answer) renews the lease but
    /// never takes the shard back.
    pub fn on_grant(&mut self, asked_at: Time, view: ShardView, mode: Mode, fx: &mut Effects) {
        assert!(asked_at <= fx.now(), "a lease asked for at {asked_at} granted at {}", fx.now());
        assert!(view.is_well_formed(), "a malformed view reached the driver: {view:?}");
        let lease_until = self.view.lease_until.max(asked_at + self.config.lease_ms);
        let view = ShardView { lease_until, ..view };
        let newer = view.number > self.view.number;
        if newer && mode != self.mode && !view.draining {
            // The view that ends a transition: the new mode's protocol takes
            // over the records, and the held requests run on it.
            tracing::info!(replica = %self.config.me, from = %self.mode, to = %mode, view = view.number, "shard switched modes");
            let instance =
                mode.instance(self.config.me, self.engine.clone(), Start::SwitchedIn, &self.config.tuning);
            self.protocol.replace(&view, || instance);
            self.mode = mode;
            self.instance += 1;
        }
        let mark = fx.as_slice().len();
        let heads_anew = newer && view.position(self.config.me) == Some(0) && !self.mode.active_active;
        self.protocol.on_view(&view, fx);
        // A late grant of an older view renews the lease, never the view:
        // view numbers only grow.
        if newer {
            self.view = view;
        } else {
            self.view.lease_until = lease_until;
        }
        if heads_anew {
            // A head that has just taken over may hold writes its predecessor
            // ordered but never saw committed; once this write commits, so
            // have they.
            let id = self.next_id();
            self.barrier = Some(BarrierState::Pending(id));
            let barrier = Operation::Delete { key: bytes::Bytes::from_static(reserved::BARRIER) };
            self.protocol.on_client(ClientRequest { id, operation: barrier }, fx);
        }
        if self.view.position(self.config.me) != Some(0) {
            // Migrations and sweeps are the first member's work.
            self.set_migrations(None, None, fx.now());
            self.sweep = None;
        }
        self.after_event(mark, fx);
        assert!(self.view.lease_until <= fx.now() + self.config.lease_ms, "a lease past what was granted");
    }

    pub fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) -> Heard {
        let migration = message.family() == <MigrationMessage as crate::Message>::FAMILY;
        // A migration's two groups may both be headed by this node; within
        // one group a message from this replica is a false claim (the
        // sender's id is the peer's own: nothing to assert on).
        if from == self.config.me && !migration {
            tracing::warn!(replica = %self.config.me, "dropped a peer message claiming to come from this replica");
            return Heard::default();
        }
        let transition_view = (message.family() == <TransitionMessage as crate::Message>::FAMILY)
            .then(|| message.open::<TransitionMessage>().and_then(Result::ok).map(|message| message.view()))
            .flatten();
        let was_drained = transition_view.is_some() && self.drained().is_some();
        let mark = fx.as_slice().len();
        if message.family() == <HandoffMessage as crate::Message>::FAMILY {
            let handed = match message.open::<HandoffMessage>() {
                Some(Ok(HandoffMessage::Records { from_shard, view, batch, records })) => {
                    Some((from_shard, view, batch, records, false))
                }
                Some(Ok(HandoffMessage::Held { from_shard, view, batch, records })) => {
                    Some((from_shard, view, batch, records, true))
                }
                // Acknowledgements go to the node's handoff, not to a replica.
                Some(Ok(HandoffMessage::Acked { .. })) => None,
                _ => {
                    tracing::warn!(replica = %self.config.me, %from, "dropped a malformed handoff message");
                    None
                }
            };
            if let Some((from_shard, view, batch, records, held)) = handed {
                if self.protocol.adopt(records, held, fx) {
                    fx.send(from, PeerMessage::new(&HandoffMessage::Acked { from_shard, view, batch }));
                }
            }
            self.after_event(mark, fx);
            return Heard::default();
        }
        if migration {
            match message.open::<MigrationMessage>() {
                Some(Ok(message)) => self.on_migration_message(from, message, fx),
                _ => {
                    tracing::warn!(replica = %self.config.me, %from, "dropped a malformed migration message")
                }
            }
            self.after_event(mark, fx);
            return Heard::default();
        }
        self.protocol.on_peer(from, message, fx);
        self.after_event(mark, fx);
        match transition_view {
            None => Heard::default(),
            Some(view) => Heard {
                newer_view: view > self.view.number,
                drained: !was_drained && self.drained().is_some(),
            },
        }
    }

    /// What this replica took and never shipped, as messages that keep each
    /// batch whole: the node hands it over when it leaves the shard alive
    /// ([`Handoff`](crate::handoff::Handoff)).
    pub fn unshipped(&self) -> Vec<Vec<(bytes::Bytes, bytes::Bytes)>> {
        self.protocol.unshipped()
    }

    /// See [`crate::Protocol::held_for_handoff`].
    pub fn held_for_handoff(&self) -> Option<Arc<dyn Engine>> {
        self.protocol.held_for_handoff()
    }

    pub fn tuning(&self) -> &Tuning {
        &self.config.tuning
    }

    pub fn on_tick(&mut self, fx: &mut Effects) {
        let mark = fx.as_slice().len();
        self.protocol.on_tick(fx);
        if let Some(replicated) = self.protocol.replicated_through() {
            self.write_times.note(self.instance, self.protocol.write_position(), replicated, fx.now());
        }
        if let Some(source) = &mut self.migration_out {
            source.poll(self.engine.as_ref(), &mut self.migration_streams, fx);
        }
        self.after_event(mark, fx);
    }

    /// The migrations the map names for this shard, given to every replica
    /// of it; only the first member runs them. A migration whose other end
    /// moved to another node starts over (a new stream).
    pub fn set_migrations(&mut self, outgoing: Option<Outgoing>, incoming: Option<Incoming>, now: Time) {
        let first = self.view.position(self.config.me) == Some(0);
        let outgoing = outgoing.filter(|_| first);
        let incoming = incoming.filter(|_| first);
        let same_out = |source: &MigrationSource, new: &Outgoing| {
            (source.outgoing().id, source.outgoing().to) == (new.id, new.to)
        };
        match (&self.migration_out, outgoing) {
            (Some(source), Some(new)) if same_out(source, &new) => {}
            (_, Some(new)) => {
                tracing::info!(replica = %self.config.me, migration = new.id, to_shard = new.to_shard, to = %new.to, "streaming migrating keys");
                self.start_source(new, now);
            }
            (_, None) => self.migration_out = None,
        }
        self.watch_changes();
        let same_in = |target: &MigrationTarget, new: &Incoming| {
            (target.incoming().id, target.incoming().from) == (new.id, new.from)
        };
        match (&self.migration_in, incoming) {
            (Some(target), Some(new)) if same_in(target, &new) => {}
            (_, new) => self.migration_in = new.map(MigrationTarget::new),
        }
    }

    /// The engine logs its changes while a migration or a backup follows
    /// them (and drops its log when neither does).
    fn watch_changes(&self) {
        self.observed.watch(self.migration_out.is_some() || self.backup.is_some());
    }

    /// Starts a backup of this replica's records; false while one is under
    /// way already.
    pub fn start_backup(&mut self, now: Time) -> bool {
        if self.backup.is_some() {
            return false;
        }
        self.backup = Some(ShardBackup::new(&mut self.migration_streams, now, self.config.tuning.snapshot));
        self.watch_changes();
        true
    }

    /// What the backup under way has next; `None` when there is none. Once
    /// it says `Done`, the receiver holds the records as they are here at
    /// this write position, and the backup is over.
    pub fn poll_backup(&mut self, now: Time) -> Option<Result<BackupStep, crate::OperationError>> {
        let backup = self.backup.as_mut()?;
        let step = backup.poll(self.engine.as_ref(), now, &mut self.migration_streams);
        if matches!(step, Ok(BackupStep::Done(_))) {
            self.end_backup();
        }
        Some(step)
    }

    /// Abandons the backup under way, if any.
    pub fn end_backup(&mut self) {
        self.backup = None;
        self.watch_changes();
    }

    /// Streams `outgoing`'s keys under a new stream number.
    fn start_source(&mut self, outgoing: Outgoing, now: Time) {
        let pace = self.config.tuning.snapshot;
        self.migration_out = Some(MigrationSource::new(outgoing, &mut self.migration_streams, now, pace));
    }

    fn on_migration_message(&mut self, from: NodeId, message: MigrationMessage, fx: &mut Effects) {
        match message {
            MigrationMessage::Items { migration, chunk, entries } => {
                let Some(target) = self.migration_in.as_mut() else { return };
                let incoming = target.incoming();
                if (incoming.id, incoming.from) != (migration, from) {
                    return;
                }
                if target.on_items(chunk, entries) {
                    Self::send_migration_ack(target, fx);
                }
            }
            MigrationMessage::Ack { migration, stream, index } => {
                let Some(source) = self.migration_out.as_mut() else { return };
                if (source.outgoing().id, source.outgoing().to) == (migration, from) {
                    source.on_ack(stream, index, fx.now());
                    source.poll(self.engine.as_ref(), &mut self.migration_streams, fx);
                }
            }
        }
    }

    fn send_migration_ack(target: &MigrationTarget, fx: &mut Effects) {
        if let Some((stream, index)) = target.ack() {
            let incoming = target.incoming();
            let ack = MigrationMessage::Ack { migration: incoming.id, stream, index };
            fx.send_to_shard(incoming.from_shard, incoming.from, PeerMessage::new(&ack));
        }
    }

    /// After every event: the replies since `mark` reach the barrier and the
    /// driver's own jobs (a migration target, a sweep), which submit what
    /// they have next, and the engine's changes reach the migration source.
    fn after_event(&mut self, mark: usize, fx: &mut Effects) {
        self.note_replies(mark, fx);
        if let Some(target) = self.migration_in.as_mut() {
            if run_batches(target, &mut self.protocol, &mut self.next_request, self.engine.as_ref(), mark, fx)
            {
                Self::send_migration_ack(target, fx);
            }
        }
        if let Some(sweep) = self.sweep.as_mut() {
            run_batches(sweep, &mut self.protocol, &mut self.next_request, self.engine.as_ref(), mark, fx);
            if sweep.done() {
                tracing::info!(replica = %self.config.me, deleted = sweep.deleted(), "deleted the keys of slots this shard no longer owns");
                self.sweep = None;
            }
        }
        for change in self.observed.take_changes() {
            let (key, stored) = match change {
                Change::Put(key, stored) => (key, Some(stored)),
                Change::Delete(key) => (key, None),
                Change::Cleared => {
                    // Whatever was sent is stale: new streams read anew.
                    if let Some(backup) = self.backup.as_mut() {
                        backup.restart(&mut self.migration_streams, fx.now());
                    }
                    if let Some(outgoing) =
                        self.migration_out.as_ref().map(|source| source.outgoing().clone())
                    {
                        self.start_source(outgoing, fx.now());
                    }
                    continue;
                }
            };
            if let Some(backup) = self.backup.as_mut() {
                backup.record_change(&key, stored.clone());
            }
            if let Some(source) = self.migration_out.as_mut() {
                source.record_change(&key, stored);
            }
        }
    }

    /// Watches the answers emitted since `mark` for this replica's barrier.
    fn note_replies(&mut self, mark: usize, fx: &Effects) {
        let Some(BarrierState::Pending(barrier)) = self.barrier else { return };
        for effect in &fx.as_slice()[mark..] {
            if let Effect::Reply { request, reply } = effect {
                if *request == barrier {
                    let committed = matches!(reply, crate::ClientReply::Written);
                    self.barrier =
                        Some(if committed { BarrierState::Committed } else { BarrierState::Failed });
                }
            }
        }
    }
}

fn next_id(next_request: &mut u64) -> RequestId {
    let id = RequestId(*next_request);
    *next_request += 1;
    id
}

/// The most batches a driver's job submits in one event. A batch may commit
/// at once (a primary acknowledges alone), so a job with work ready would
/// otherwise run through all of it in one event: a sweep of a million keys
/// held the shard for seconds, and its node missed its heartbeats. The rest
/// waits for the next event, a tick at the latest.
const BATCHES_PER_EVENT: usize = 8;

/// Hands a job the replies emitted since `mark`, and submits its batches
/// while it has one ready, up to [`BATCHES_PER_EVENT`] and while the
/// protocol's peers keep in step; answers whether a batch finished.
fn run_batches(
    job: &mut dyn Batches,
    protocol: &mut Switchable,
    next_request: &mut u64,
    engine: &dyn Engine,
    mut mark: usize,
    fx: &mut Effects,
) -> bool {
    let mut finished = false;
    for submitted in 0.. {
        let now = fx.now();
        for effect in &fx.as_slice()[mark..] {
            if let Effect::Reply { request, reply } = effect {
                finished |= job.on_reply(*request, reply, now);
            }
        }
        mark = fx.as_slice().len();
        if submitted == BATCHES_PER_EVENT || !protocol.peers_in_step() {
            break;
        }
        let Some(operations) = job.next_batch(engine, now) else { break };
        let ids = operations
            .into_iter()
            .map(|operation| {
                let id = next_id(next_request);
                protocol.on_client(ClientRequest { id, operation }, fx);
                id
            })
            .collect();
        job.submitted(ids);
    }
    finished
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use tessera_engine::MemoryEngine;

    use super::*;
    use crate::test_support::view;
    use crate::ClientReply;

    fn replica(me: u32, mode: &str) -> Replica {
        let config = ReplicaConfig::new(NodeId(me), 200, Tuning::default());
        Replica::new(config, Arc::new(MemoryEngine::new()), Mode::named(mode).unwrap())
    }

    fn put(key: &str) -> Operation {
        Operation::Put { key: Bytes::from(key.to_string()), value: Bytes::from_static(b"v") }
    }

    #[test]
    fn a_lease_runs_from_the_heartbeat_and_a_late_grant_never_goes_back() {
        let mut head = replica(1, "chain");
        let mut fx = Effects::new(50);
        head.on_grant(40, view(3, &[1]), Mode::named("chain").unwrap(), &mut fx);
        assert_eq!(head.lease_until(), 240);
        assert_eq!(
            head.check_read(true, 239),
            Ok(ReadGate::Open),
            "a head alone commits its barrier at once"
        );
        assert_eq!(head.check_read(true, 240), Err(Refusal::LeaseExpired));
        // A late answer to an older heartbeat, about an older view.
        head.on_grant(10, view(2, &[2, 1]), Mode::named("chain").unwrap(), &mut fx);
        assert_eq!((head.view().number, head.lease_until()), (3, 240));
        assert_eq!(head.role(), Some(Role::Alone));
    }

    #[test]
    fn a_backup_follows_the_writes_the_protocol_applies_until_it_ends() {
        let mut config = ReplicaConfig::new(NodeId(1), 200, Tuning::default());
        config.tuning.snapshot.chunk_bytes = 32;
        for mode in ["chain", "primary-backup", "multi-master"] {
            let mut head =
                Replica::new(config.clone(), Arc::new(MemoryEngine::new()), Mode::named(mode).unwrap());
            let mut fx = Effects::new(10);
            head.on_grant(10, view(2, &[1]), Mode::named(mode).unwrap(), &mut fx);
            head.submit((0..100).map(|key| put(&format!("k{key:02}"))), &mut fx);
            assert!(head.poll_backup(10).is_none(), "{mode}: no backup yet");
            assert!(head.start_backup(10));
            assert!(!head.start_backup(10), "{mode}: one backup at a time");
            let mut received = std::collections::BTreeMap::new();
            for round in 0.. {
                let overwrite = Operation::Put {
                    key: Bytes::from(format!("k{:02}", (round * 37) % 100)),
                    value: Bytes::from(format!("round {round}")),
                };
                let delete = Operation::Delete { key: Bytes::from(format!("k{:02}", (round * 11) % 100)) };
                head.submit([overwrite, delete], &mut fx);
                match head.poll_backup(10).expect("under way").unwrap() {
                    BackupStep::Entries(entries) => received.extend(entries),
                    BackupStep::Done(entries) => {
                        received.extend(entries);
                        break;
                    }
                    step => panic!("{mode}: {step:?}"),
                }
                assert!(round < 1_000, "{mode}: the backup never ends");
            }
            let page = head
                .engine()
                .scan(&tessera_engine::KeyRange::all(), &Default::default(), usize::MAX)
                .unwrap();
            let held: std::collections::BTreeMap<_, _> = page.entries.into_iter().collect();
            received.retain(|_, record| !record.is_empty());
            assert_eq!(received, held, "{mode}");
            assert!(head.poll_backup(10).is_none(), "{mode}: the backup is over");
        }
    }

    #[test]
    fn the_replication_lag_counts_writes_a_member_lacks_and_ages_the_oldest() {
        let chain = Mode::named("chain").unwrap();
        let mut head = replica(1, "chain");
        let mut fx = Effects::new(10);
        head.on_grant(10, view(2, &[1, 2]), chain, &mut fx);
        head.submit([put("a"), put("b")], &mut fx);
        head.on_tick(&mut fx);
        let written = head.progress().applied;
        assert_eq!(head.replication_lag(10), Some(ReplicationLag { writes: written, oldest_ms: 0 }));
        let mut fx = Effects::new(60);
        head.submit([put("c")], &mut fx);
        head.on_tick(&mut fx);
        assert_eq!(head.replication_lag(75), Some(ReplicationLag { writes: written + 1, oldest_ms: 65 }));
        // The tail holds the first writes: the age is the later one's.
        let ack = |seq| PeerMessage::new(&crate::chain::ChainMessage::Ack { view: 2, seq });
        head.on_peer(NodeId(2), ack(written), &mut fx);
        head.on_tick(&mut fx);
        assert_eq!(head.replication_lag(75), Some(ReplicationLag { writes: 1, oldest_ms: 15 }));
        head.on_peer(NodeId(2), ack(written + 1), &mut fx);
        head.on_tick(&mut fx);
        assert_eq!(head.replication_lag(90), Some(ReplicationLag::default()));

        // A primary's lag is that of its furthest backup; a backup reports none.
        let primary_backup = Mode::named("primary-backup").unwrap();
        let mut primary = replica(1, "primary-backup");
        let mut fx = Effects::new(10);
        primary.on_grant(10, view(2, &[1, 2, 3]), primary_backup, &mut fx);
        primary.submit((0..5).map(|key| put(&format!("k{key}"))), &mut fx);
        let applied = primary.progress().applied;
        let position = |applied| {
            PeerMessage::new(&crate::primary_backup::BackupMessage::Position { view: 2, applied, epoch: 2 })
        };
        primary.on_peer(NodeId(2), position(applied), &mut fx);
        primary.on_peer(NodeId(3), position(applied - 2), &mut fx);
        primary.on_tick(&mut fx);
        assert_eq!(primary.replication_lag(30).map(|lag| lag.writes), Some(2));
        let mut backup = replica(2, "primary-backup");
        backup.on_grant(10, view(2, &[1, 2, 3]), primary_backup, &mut fx);
        assert_eq!(backup.replication_lag(30), None);

        // An active-active member's lag is what its slowest peer has not acknowledged.
        let multi_master = Mode::named("multi-master").unwrap();
        let mut member = replica(1, "multi-master");
        let mut fx = Effects::new(10);
        member.on_grant(10, view(2, &[1, 2]), multi_master, &mut fx);
        fx.take();
        member.submit([put("a"), put("b")], &mut fx);
        member.on_tick(&mut fx);
        assert_eq!(member.replication_lag(40), Some(ReplicationLag { writes: 2, oldest_ms: 30 }));
        let batches: Vec<u64> = fx
            .take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Send { message, .. } => match message.open::<crate::multi_master::MultiMessage>() {
                    Some(Ok(crate::multi_master::MultiMessage::Records { batch, .. })) => Some(batch),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        assert!(!batches.is_empty(), "the writes went out");
        for batch in batches {
            let acked = crate::multi_master::MultiMessage::Acked { view: 2, batch };
            member.on_peer(NodeId(2), PeerMessage::new(&acked), &mut fx);
        }
        member.on_tick(&mut fx);
        assert_eq!(member.replication_lag(50), Some(ReplicationLag::default()));
    }

    #[test]
    fn a_new_head_serves_strong_reads_only_after_its_barrier_commits() {
        let mut head = replica(1, "chain");
        let mut fx = Effects::new(10);
        head.on_grant(10, view(2, &[1, 2]), Mode::named("chain").unwrap(), &mut fx);
        let ReadGate::AfterBarrier(barrier) = head.check_read(true, 20).unwrap() else { panic!() };
        assert_eq!(head.check_write(), Ok(()));
        let ids = head.submit([put("a")], &mut fx);
        assert_ne!(ids[0], barrier);
        // The tail acknowledges both writes at once.
        let ack = PeerMessage::new(&crate::chain::ChainMessage::Ack { view: 2, seq: 2 });
        fx.take();
        head.on_peer(NodeId(2), ack, &mut fx);
        let replies: Vec<RequestId> = fx
            .take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Reply { request, reply: ClientReply::Written } => Some(request),
                _ => None,
            })
            .collect();
        assert_eq!(replies, vec![barrier, ids[0]]);
        assert_eq!(head.check_read(true, 20), Ok(ReadGate::Open));
        let mut tail = replica(2, "chain");
        tail.on_grant(10, view(2, &[1, 2]), Mode::named("chain").unwrap(), &mut fx);
        assert_eq!(tail.check_write(), Err(Refusal::NotOwner));
        assert_eq!(tail.check_read(true, 20), Err(Refusal::NotOwner));
        assert_eq!(tail.check_read(false, 20), Ok(ReadGate::Open));
    }

    #[test]
    fn a_sweep_goes_a_few_batches_per_event_and_waits_for_a_backup_far_behind() {
        let primary_backup = Mode::named("primary-backup").unwrap();
        let mut primary = replica(1, "primary-backup");
        let mut fx = Effects::new(10);
        primary.on_grant(10, view(2, &[1, 2]), primary_backup, &mut fx);
        let keys = 20_000;
        primary.submit((0..keys).map(|key| put(&format!("k{key}"))), &mut fx);
        let written = primary.progress().applied; // the keys and the head's barrier
        primary.sweep(Arc::new(|key: &[u8]| key.starts_with(b"k")));
        let position = |applied: u64| {
            let report = crate::primary_backup::BackupMessage::Position { view: 2, applied, epoch: 2 };
            PeerMessage::new(&report)
        };

        // The backup has not reported in this view, then reports a position
        // more than a window behind: the sweep waits.
        primary.on_tick(&mut fx);
        primary.on_peer(NodeId(2), position(0), &mut fx);
        assert_eq!(primary.progress().applied, written);

        // In step, it deletes at most its budget per event.
        primary.on_peer(NodeId(2), position(written), &mut fx);
        // A batch is what a bounded scan finds, up to two pages' worth.
        let budget = (BATCHES_PER_EVENT * 2 * crate::migration::SWEEP_BATCH_KEYS) as u64;
        let deleted = primary.progress().applied - written;
        assert!(deleted > 0 && deleted <= budget, "{deleted} deleted in one event");
        for _ in 0..keys / deleted + 1 {
            primary.on_tick(&mut fx);
            let applied = primary.progress().applied;
            primary.on_peer(NodeId(2), position(applied), &mut fx);
        }
        assert_eq!(primary.progress().applied, written + keys, "every key deleted");
    }

    #[test]
    fn the_view_that_ends_a_transition_swaps_the_protocol_once() {
        let chain = Mode::named("chain").unwrap();
        let quorum = Mode::named("quorum").unwrap();
        let mut member = replica(1, "chain");
        let mut fx = Effects::new(10);
        member.on_grant(10, view(2, &[1, 2, 3]), chain, &mut fx);
        member.on_grant(10, ShardView { draining: true, ..view(3, &[1, 2, 3]) }, chain, &mut fx);
        assert_eq!(member.check_write(), Err(Refusal::Draining));
        member.on_grant(10, view(4, &[1, 2, 3]), quorum, &mut fx);
        assert_eq!((member.mode(), member.draining()), (quorum, false));
        assert_eq!(member.check_write(), Ok(()), "any member of an active–active shard");
        // A late grant of the draining view, in the old mode, changes nothing.
        member.on_grant(10, ShardView { draining: true, ..view(3, &[1, 2, 3]) }, chain, &mut fx);
        assert_eq!((member.mode(), member.view().number), (quorum, 4));
    }
}
