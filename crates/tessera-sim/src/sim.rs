//! One simulated cluster run: a shard's replicas running the same driver the
//! nodes run ([`Replica`]: protocol, mode, views, leases, barrier) over real
//! engines, the coordinator's real decisions, clients, and a network that
//! delays, reorders, drops and partitions — all in one thread, in virtual
//! time, every choice drawn from one seed. The same seed replays the same run.
//!
//! A run has a safety phase (traffic and faults) and a liveness phase (faults
//! healed, traffic goes on, then every key is read back). The report carries
//! the history and what the checkers found.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bytes::Bytes;
use tessera_engine::Engine;
use tessera_protocol::coordinator::{CoordinatorConfig, ShardCoordinator, TRANSITION_COMPLETE};
use tessera_protocol::{
    for_each_entry, Consistency, Effect, Effects, Mode, NodeId, Operation as ProtocolOperation, Progress,
    Record, Replica as Driver, RequestId, ShardView,
};

use crate::checks::convergence::{self, Contents, Majority};
use crate::checks::durability;
use crate::checks::linearizability::{self, Verdict};
use crate::clients::{group_members, Client};
use crate::collections::Sweeper;
use crate::config::{FaultKind, FaultMix, SimConfig, Workload};
use crate::history::History;
use crate::network::{schedule_faults, Address, Fault, Links, Message, Timeline};
use crate::rng::Rng;

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub faults: FaultMix,
    pub history: History,
    /// Safety and liveness violations, one line each.
    pub violations: Vec<String>,
    /// The linearizability search gave up on a key.
    pub inconclusive: bool,
    pub completed: u64,
    pub unknown: u64,
    pub retried: u64,
    pub view_changes: u64,
    /// View changes that replaced the primary (or the head).
    pub primary_changes: u64,
    pub messages: u64,
    /// Strong reads answered, per replica (CRAQ spreads them).
    pub strong_reads_by_replica: BTreeMap<u32, u64>,
    /// Acknowledged writes lost (eventual modes: the documented window).
    pub lost_acknowledged_writes: u64,
    pub acknowledged_writes: u64,
    /// Faults and view changes with their virtual times, for replaying a seed.
    pub log: Vec<String>,
    /// A transition's start and completion (virtual ms).
    pub transition_started_at: Option<u64>,
    pub transition_completed_at: Option<u64>,
    /// Slot migrations that ended (the groups simulation).
    pub migrations_completed: u64,
    /// Orphaned pages the sweep deleted (the collections workload).
    pub orphans_swept: u64,
}

impl Report {
    /// Liveness: after healing, every client read every key back.
    pub(crate) fn check_final_reads(&mut self, clients: &[Client], liveness_ms: u64) {
        for (index, client) in clients.iter().enumerate() {
            if !client.final_reads.is_empty() {
                self.violations.push(format!(
                    "liveness: client {index} could not read back {} keys within {liveness_ms} ms of healing: {:?}",
                    client.final_reads.len(),
                    client.final_reads.iter().map(|key| String::from_utf8_lossy(key)).collect::<Vec<_>>(),
                ));
            }
        }
    }

    /// Safety under a strong protocol: the checked history was linearizable.
    pub(crate) fn note_linearizability(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Linearizable => {}
            Verdict::Violation { key, detail } => self
                .violations
                .push(format!("linearizability: key {:?}: {detail}", String::from_utf8_lossy(&key))),
            Verdict::Inconclusive { .. } => self.inconclusive = true,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Event {
    Deliver {
        from: Address,
        to: Address,
        message: Message,
    },
    ReplicaTick(u32),
    CoordinatorTick,
    BeginTransition,
    ClientWake(usize),
    /// The collections workload's sweep at the shard's head.
    Sweep,
    Fault(Fault),
}

struct SimReplica {
    alive: bool,
    /// Bumped at every restart: a restarted replica has lost its state and must
    /// not be taken for the member it was.
    incarnation: u64,
    driver: Driver,
    /// The driver's id of each request a client sent here, and the client's.
    requests: HashMap<RequestId, RequestId>,
    /// Added to virtual time to give this replica's clock.
    clock_offset_ms: u64,
    next_heartbeat: u64,
    /// Local send time of each unanswered heartbeat.
    heartbeats: BTreeMap<u64, u64>,
}

pub struct Simulation {
    pub(crate) config: SimConfig,
    pub(crate) rng: Rng,
    pub(crate) now: u64,
    pub(crate) timeline: Timeline<Event>,
    replicas: Vec<SimReplica>,
    pub(crate) coordinator: ShardCoordinator,
    pub(crate) clients: Vec<Client>,
    pub(crate) links: Links,
    pub(crate) healed: bool,
    pub(crate) report: Report,
    pub(crate) eventual_reads: u64,
    /// The view that completed the transition, from which the target runs.
    switched_in_view: Option<u64>,
    /// Every key's value when the transition completed (the members' common
    /// records), where a strong target's guarantee starts.
    switched_state: Vec<(Bytes, Option<Bytes>)>,
    /// The collections workload's sweep.
    pub(crate) sweeper: Sweeper,
}

pub(crate) fn key_name(prefix: &str, index: usize) -> Bytes {
    Bytes::from(format!("{prefix}{index}"))
}

impl Simulation {
    pub fn new(seed: u64, config: SimConfig) -> Self {
        let mut rng = Rng::new(seed);
        let faults = FaultMix::draw(&mut rng, &config.faults);
        let replicas = (0..config.replicas)
            .map(|id| {
                let clock_offset_ms = if faults.skew_max_ms > 0 { rng.below(faults.skew_max_ms) } else { 0 };
                SimReplica {
                    alive: true,
                    incarnation: 0,
                    driver: config.replica(id, config.protocol),
                    requests: HashMap::new(),
                    clock_offset_ms,
                    next_heartbeat: 1,
                    heartbeats: BTreeMap::new(),
                }
            })
            .collect();
        let clients = (0..config.clients).map(|_| Client::new(rng.fork())).collect();
        let coordinator = ShardCoordinator::new(
            CoordinatorConfig {
                lease_ms: config.timing.lease_ms,
                failure_timeout_ms: config.timing.failure_timeout_ms,
                admission: config.protocol.admission(config.replicas as usize),
            },
            ShardView {
                number: 1,
                replicas: (0..config.replicas).map(NodeId).collect(),
                learners: Vec::new(),
                lease_until: 0,
                draining: false,
                geo: None,
            },
            (0..config.replicas).map(|id| (NodeId(id), 0)).collect(),
            0,
        );
        let mut simulation = Self {
            rng,
            now: 0,
            timeline: Timeline::new(),
            replicas,
            coordinator,
            clients,
            links: Links::default(),
            healed: false,
            report: Report { seed, faults, ..Report::default() },
            eventual_reads: 0,
            switched_in_view: None,
            switched_state: Vec::new(),
            sweeper: Sweeper::default(),
            config,
        };
        simulation.schedule_start();
        simulation
    }

    fn schedule_start(&mut self) {
        for id in 0..self.config.replicas {
            let first = self.rng.below(self.config.timing.tick_ms);
            self.timeline.schedule(first, Event::ReplicaTick(id));
        }
        self.timeline.schedule(0, Event::CoordinatorTick);
        for client in 0..self.config.clients {
            // Clients start once replicas have had a first lease.
            let start = 50 + self.rng.below(20);
            self.timeline.schedule(start, Event::ClientWake(client));
        }
        if self.config.workload == Workload::Collections {
            self.schedule_sweeps();
        }
        if self.config.transition_to.is_some() {
            let at = self.rng.between(300, self.config.timing.safety_ms * 2 / 3);
            self.timeline.schedule(at, Event::BeginTransition);
        }
        let kinds = [FaultKind::Partition, FaultKind::Crash, FaultKind::FalseSuspicion];
        let (replicas, safety_ms) = (self.config.replicas, self.config.timing.safety_ms);
        for (at, fault) in
            schedule_faults(&mut self.rng, &self.report.faults.enabled, &kinds, replicas, safety_ms)
        {
            self.timeline.schedule(at, Event::Fault(fault));
        }
    }

    fn local_time(&self, replica: u32) -> u64 {
        self.now + self.replicas[replica as usize].clock_offset_ms
    }

    /// Runs the whole scenario and checks it.
    pub fn run(mut self) -> Report {
        let end = self.config.timing.safety_ms + self.config.timing.liveness_ms;
        while let Some((at, event)) = self.timeline.next_until(end) {
            self.now = at;
            if !self.healed && self.now >= self.config.timing.safety_ms {
                self.heal_for_liveness();
            }
            self.handle(event);
        }
        self.finish()
    }

    fn heal_for_liveness(&mut self) {
        self.report.log.push(format!("{}ms healed for liveness", self.now));
        self.healed = true;
        self.links.blocked.clear();
        if self.config.workload == Workload::Appends {
            return; // liveness shows in writes completing; nothing to read back
        }
        let final_reads: Vec<Bytes> = if self.config.workload == Workload::Batches {
            self.groups().flat_map(|group| group_members(&group).collect::<Vec<_>>()).collect()
        } else {
            (0..self.config.keys)
                .map(|index| key_name("k", index))
                .chain((0..self.config.counters).map(|index| key_name("c", index)))
                .collect()
        };
        for client in &mut self.clients {
            client.final_reads = final_reads.clone();
        }
    }

    /// The groups of the batches workload.
    fn groups(&self) -> impl Iterator<Item = Bytes> {
        (0..self.config.keys).map(|index| key_name("g", index))
    }

    /// A state by group, as the history names them: each group's first
    /// key's record (the checks of the batches workload see to it that the
    /// others agree).
    fn group_state(&self, state: &[(Bytes, Record)]) -> Vec<(Bytes, Record)> {
        self.groups()
            .filter_map(|group| {
                let first = group_members(&group).next().expect("a group has keys");
                state.iter().find(|(key, _)| *key == first).map(|(_, record)| (group, record.clone()))
            })
            .collect()
    }

    /// Atomicity (the batches workload): every member holds every group's
    /// keys with one value, as the last batch to reach it wrote them. Under
    /// a quorum protocol a member's own records are not what a reader sees,
    /// and a batch's keys hold its intents until they are rolled forward:
    /// there the state the majority holds is checked, each intent taken as
    /// its primary decided (a group with a key no majority agrees on is the
    /// convergence check's to report).
    fn check_groups_whole(&mut self, contents: &[(u32, Contents)], majority: Option<&Majority>) {
        let mut undecided = BTreeSet::new();
        let checked: Vec<(String, Values)> = match majority {
            Some(majority) if self.mode().quorum => {
                undecided = majority.undecided.iter().collect();
                vec![("a majority".into(), as_read(&majority.state))]
            }
            _ => contents
                .iter()
                .map(|(id, entries)| {
                    let values = entries.iter().map(|(key, record)| (key.clone(), record.visible().cloned()));
                    (format!("n{id}"), values.collect())
                })
                .collect(),
        };
        for (holder, entries) in checked {
            for group in
                self.groups().filter(|group| group_members(group).all(|member| !undecided.contains(&member)))
            {
                let values: Vec<Option<&Bytes>> = group_members(&group)
                    .map(|member| {
                        entries.iter().find(|(key, _)| *key == member).and_then(|(_, value)| value.as_ref())
                    })
                    .collect();
                if values.iter().any(|value| *value != values[0]) {
                    self.report.violations.push(format!(
                        "atomicity: {holder} holds part of a batch in group {}: {values:?}",
                        String::from_utf8_lossy(&group)
                    ));
                }
            }
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Deliver { from, to, message } => self.deliver(from, to, message),
            Event::ReplicaTick(id) => {
                if self.replicas[id as usize].alive {
                    self.replica_tick(id);
                }
                self.timeline.schedule(self.now + self.config.timing.tick_ms, Event::ReplicaTick(id));
            }
            Event::CoordinatorTick => {
                self.coordinator_tick();
                self.timeline.schedule(self.now + self.config.timing.tick_ms, Event::CoordinatorTick);
            }
            Event::BeginTransition => {
                let target = self.config.transition_to.expect("scheduled only with a target");
                if self
                    .coordinator
                    .begin_transition(self.now, target.admission(self.config.replicas as usize))
                {
                    self.report.transition_started_at = Some(self.now);
                    self.log_view_changes();
                }
            }
            Event::ClientWake(client) => self.client_wake(client),
            Event::Sweep => self.sweep(),
            Event::Fault(Fault::Crash(id)) => {
                // At most f failures: the last live member of the view holds the
                // only copy, and losing it loses the data in any system.
                let needed = self.copies_needed();
                let live_others = self.healthy_members_except(id);
                let replica = &mut self.replicas[id as usize];
                if replica.alive && live_others >= needed && !self.healed {
                    replica.alive = false;
                    self.report.log.push(format!("{}ms crash n{id}", self.now));
                }
            }
            Event::Fault(Fault::Restart(id)) => {
                let driver = self.config.replica(id, self.mode());
                let replica = &mut self.replicas[id as usize];
                if !replica.alive {
                    // A crash loses everything in memory, engine included.
                    replica.driver = driver;
                    replica.requests.clear();
                    replica.heartbeats.clear();
                    replica.incarnation += 1;
                    replica.alive = true;
                    self.report.log.push(format!("{}ms restart n{id} (empty)", self.now));
                }
            }
            Event::Fault(Fault::Partition(cut)) => {
                if !self.healed {
                    self.report.log.push(format!("{}ms partition {cut:?}", self.now));
                    self.links.blocked.extend(cut);
                }
            }
            Event::Fault(Fault::Heal) => {
                self.report.log.push(format!("{}ms heal", self.now));
                self.links.blocked.clear();
            }
            Event::Fault(Fault::Suspect(id)) => {
                if self.healthy_members_except(id) >= self.copies_needed()
                    && !self.healed
                    && self.coordinator.suspect(NodeId(id))
                {
                    self.report.log.push(format!("{}ms coordinator suspects n{id}", self.now));
                }
            }
        }
    }

    /// Every key's value at a member that reported itself drained (they all
    /// hold the same records then), including keys it does not hold.
    fn drained_state(&self, view: &ShardView) -> Vec<(Bytes, Option<Bytes>)> {
        let drained = view.replicas.iter().find(|node| {
            let replica = &self.replicas[node.0 as usize];
            replica.alive && self.coordinator.incarnation(**node) == Some(replica.incarnation)
        });
        let Some(member) = drained else { return Vec::new() };
        let held: BTreeMap<Bytes, Option<Bytes>> =
            Self::engine_contents(self.replicas[member.0 as usize].driver.engine().as_ref())
                .into_iter()
                .map(|(key, record)| (key, record.visible().cloned()))
                .collect();
        if self.config.workload == Workload::Batches {
            let first = |group: &Bytes| group_members(group).next().expect("a group has keys");
            return self
                .groups()
                .map(|group| (group.clone(), held.get(&first(&group)).cloned().flatten()))
                .collect();
        }
        let keys = (0..self.config.keys).map(|index| key_name("k", index));
        let counters = (0..self.config.counters).map(|index| key_name("c", index));
        keys.chain(counters).map(|key| (key.clone(), held.get(&key).cloned().flatten())).collect()
    }

    /// The mode of the current view: the target's once a transition
    /// completed.
    pub(crate) fn mode(&self) -> Mode {
        self.mode_of_view(u64::MAX)
    }

    /// The mode a shard runs in view `number`, as the coordinator's grants
    /// say: the target from the view that completed the transition on.
    fn mode_of_view(&self, number: u64) -> Mode {
        match (self.switched_in_view, self.config.transition_to) {
            (Some(first), Some(target)) if number >= first => target,
            _ => self.config.protocol,
        }
    }

    /// Copies that must stay healthy: during a transition, what either
    /// protocol needs.
    fn copies_needed(&self) -> usize {
        let replicas = self.config.replicas as usize;
        let target = self.config.transition_to.unwrap_or(self.config.protocol);
        self.config.protocol.copies_needed(replicas).max(target.copies_needed(replicas))
    }

    /// Members of the view, other than `id`, that are alive and not about to be
    /// removed: the copies that survive if `id` is lost.
    pub(crate) fn healthy_members_except(&self, id: u32) -> usize {
        let coordinator = &self.coordinator;
        coordinator
            .view()
            .replicas
            .iter()
            .filter(|node| {
                let replica = &self.replicas[node.0 as usize];
                node.0 != id
                    && replica.alive
                    && coordinator.in_good_standing(
                        **node,
                        replica.incarnation,
                        self.now,
                        self.config.timing.failure_timeout_ms / 2,
                    )
            })
            .count()
    }

    fn run_effects(&mut self, id: u32, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Send { to, message } => {
                    self.send(Address::Replica(id), Address::Replica(to.0), Message::Peer(message))
                }
                Effect::SendToShard { .. } => {
                    unreachable!(
                        "a simulated shard is given no migrations, so it sends nothing to other shards"
                    )
                }
                Effect::Reply { request, reply } => {
                    // Answers to requests of the driver's own (a new head's
                    // barrier, a migration's writes) go to no client.
                    let Some(request) = self.replicas[id as usize].requests.remove(&request) else {
                        continue;
                    };
                    let client = Client::of(request);
                    self.send(
                        Address::Replica(id),
                        Address::Client(client),
                        Message::Response { request, reply },
                    );
                }
            }
        }
    }

    pub(crate) fn replica_alive(&self, id: u32) -> bool {
        self.replicas[id as usize].alive
    }

    pub(crate) fn replica_engine(&self, id: u32) -> std::sync::Arc<dyn Engine> {
        self.replicas[id as usize].driver.engine().clone()
    }

    /// Submits `operation` at replica `id` from its own node (no network
    /// between), its answer addressed to the client `request` names.
    pub(crate) fn submit_local(&mut self, id: u32, request: RequestId, operation: ProtocolOperation) {
        let mut fx = Effects::new(self.local_time(id));
        let replica = &mut self.replicas[id as usize];
        let submitted = replica.driver.submit([operation], &mut fx);
        replica.requests.insert(submitted[0], request);
        let effects = fx.take();
        self.run_effects(id, effects);
    }

    fn replica_tick(&mut self, id: u32) {
        let local = self.local_time(id);
        let replica = &mut self.replicas[id as usize];
        let mut fx = Effects::new(local);
        replica.driver.on_tick(&mut fx);
        let seq = replica.next_heartbeat;
        replica.next_heartbeat += 1;
        replica.heartbeats.insert(seq, local);
        let progress = replica.driver.progress();
        let incarnation = replica.incarnation;
        let effects = fx.take();
        self.run_effects(id, effects);
        self.send(
            Address::Replica(id),
            Address::Coordinator,
            Message::Heartbeat { seq, progress, incarnation },
        );
    }

    fn deliver(&mut self, from: Address, to: Address, message: Message) {
        match to {
            Address::Replica(id) => {
                if !self.replicas[id as usize].alive {
                    return;
                }
                let mut fx = Effects::new(self.local_time(id));
                match message {
                    Message::Peer(peer) => {
                        let Address::Replica(sender) = from else { return };
                        self.replicas[id as usize].driver.on_peer(NodeId(sender), peer, &mut fx);
                    }
                    Message::Grant { seq, view } => {
                        let mode = self.mode_of_view(view.number);
                        let replica = &mut self.replicas[id as usize];
                        // The lease runs from when this replica asked for it.
                        let Some(&asked_at) = replica.heartbeats.get(&seq) else { return };
                        replica.heartbeats = replica.heartbeats.split_off(&seq);
                        let before = replica.driver.mode();
                        replica.driver.on_grant(asked_at, view, mode, &mut fx);
                        let after = replica.driver.mode();
                        if after != before {
                            let number = replica.driver.view().number;
                            self.report
                                .log
                                .push(format!("{}ms n{id} runs {after} from view {number}", self.now));
                        }
                    }
                    Message::Request(request) => {
                        if let ProtocolOperation::Get { consistency: Consistency::Strong, .. } =
                            request.operation
                        {
                            *self.report.strong_reads_by_replica.entry(id).or_default() += 1;
                        }
                        let replica = &mut self.replicas[id as usize];
                        let submitted = replica.driver.submit([request.operation], &mut fx);
                        replica.requests.insert(submitted[0], request.id);
                    }
                    _ => return,
                }
                let effects = fx.take();
                self.run_effects(id, effects);
            }
            Address::Coordinator => {
                if let (Address::Replica(id), Message::Heartbeat { seq, progress, incarnation }) =
                    (from, message)
                {
                    self.on_heartbeat(id, seq, progress, incarnation);
                }
            }
            Address::Client(client) => {
                if let Message::Response { request, reply } = message {
                    if client == self.sweeper() {
                        self.on_sweep_reply(request, reply);
                    } else {
                        self.on_response(client, request, reply);
                    }
                }
            }
        }
    }

    fn on_heartbeat(&mut self, id: u32, seq: u64, progress: Progress, incarnation: u64) {
        let granted = self.coordinator.on_heartbeat(self.now, NodeId(id), incarnation, &progress);
        self.log_view_changes();
        if let Some(view) = granted {
            self.send(Address::Coordinator, Address::Replica(id), Message::Grant { seq, view });
        }
    }

    fn coordinator_tick(&mut self) {
        for node in self.coordinator.on_tick(self.now) {
            self.report.log.push(format!("{}ms coordinator keeps {node}, its last member", self.now));
        }
        self.log_view_changes();
    }

    fn log_view_changes(&mut self) {
        for change in self.coordinator.take_changes() {
            if change.reason == TRANSITION_COMPLETE {
                if self.report.transition_started_at.is_none() {
                    // The replicas would switch protocols without a drain.
                    let violation = format!("view {}: a transition completed unstarted", change.view.number);
                    self.report.violations.push(violation);
                }
                if self.switched_in_view.is_none() {
                    self.switched_in_view = Some(change.view.number);
                    self.report.transition_completed_at = Some(change.at_ms);
                    self.switched_state = self.drained_state(&change.view);
                }
            }
            self.report.view_changes += 1;
            if change.primary_changed {
                self.report.primary_changes += 1;
            }
            let replicas: Vec<String> = change.view.replicas.iter().map(|node| node.to_string()).collect();
            let learners: Vec<String> = change.view.learners.iter().map(|node| node.to_string()).collect();
            self.report.log.push(format!(
                "{}ms view {}: [{}] learners [{}] ({})",
                change.at_ms,
                change.view.number,
                replicas.join(", "),
                learners.join(", "),
                change.reason
            ));
        }
    }

    /// A replica's live records, by key (tombstones are bookkeeping: when
    /// each replica collects one is its own business), and the tombstones
    /// that carry a batch's intent.
    fn engine_contents(engine: &dyn Engine) -> Contents {
        let mut entries: Vec<(Bytes, Record)> = Vec::new();
        for_each_entry(engine, |key, raw| {
            let kept = |record: &Record| !record.tombstone || record.intent.is_some();
            if let Some(record) = Record::decode(raw).ok().filter(kept) {
                entries.push((key, record));
            }
            Ok(())
        })
        .expect("memory engines do not fail");
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    fn finish(mut self) -> Report {
        self.report.check_final_reads(&self.clients, self.config.timing.liveness_ms);
        // Convergence: the live members of the final view hold the same data.
        let members: Vec<u32> = self
            .coordinator
            .view()
            .replicas
            .iter()
            .map(|node| node.0)
            .filter(|id| self.replicas[*id as usize].alive)
            .collect();
        let contents: Vec<(u32, Contents)> = members
            .iter()
            .map(|id| (*id, Self::engine_contents(self.replicas[*id as usize].driver.engine().as_ref())))
            .collect();
        if let (Some(target), None) = (self.config.transition_to, self.report.transition_completed_at) {
            self.report.violations.push(format!("liveness: the transition to {target} never completed"));
        }
        let majority = (self.mode().copies_needed(self.config.replicas as usize) > 1).then(|| {
            let (majority, violations) = convergence::majority_state(&contents);
            self.report.violations.extend(violations);
            majority
        });
        let final_state = match &majority {
            Some(majority) => Some(&majority.state[..]),
            None => {
                let quiet_ms = self.config.timing.client_timeout_ms + 200;
                self.report.violations.extend(convergence::identical(&contents, quiet_ms));
                contents.first().map(|(_, contents)| &contents[..])
            }
        };
        if self.config.workload == Workload::Batches {
            self.check_groups_whole(&contents, majority.as_ref());
        }
        if let (Workload::Collections, Some(majority)) = (self.config.workload, &majority) {
            self.check_collections_whole(majority);
        }
        self.report.lost_acknowledged_writes = self.count_lost(final_state, 0);
        if self.config.workload == Workload::Appends {
            let writes_after_healing = self.report.history.operations.iter().any(|operation| {
                operation.completed_at.is_some_and(|done| done >= self.config.timing.safety_ms)
            });
            if !writes_after_healing {
                self.report.violations.push("liveness: no write completed after healing".into());
            }
        }
        // What must be linearizable and durable: the whole run under a strong
        // protocol; with a transition, strong throughout if both protocols
        // are, else the part under the strong one (from the completion view
        // on, or up to the draining view).
        let original = self.config.protocol;
        let (checked, durable_since) = match self.config.transition_to {
            None => (original.strong.then(|| self.report.history.clone()), original.strong.then_some(0)),
            Some(target) => {
                let started = self.report.transition_started_at;
                let completed = self.report.transition_completed_at;
                if original.strong && target.strong {
                    (Some(self.report.history.clone()), Some(0))
                } else if let (true, Some(completed)) = (target.strong, completed) {
                    (Some(self.report.history.after(completed, &self.switched_state)), Some(completed))
                } else if let (true, Some(started)) = (original.strong, started) {
                    (Some(self.report.history.before(started)), None)
                } else {
                    (None, None)
                }
            }
        };
        if let Some(history) = checked {
            self.report.note_linearizability(linearizability::check(&history));
        }
        if let Some(since) = durable_since {
            let lost = self.count_lost(final_state, since);
            if lost > 0 {
                self.report.violations.push(format!("durability: {lost} acknowledged writes lost"));
            }
        }
        self.report
    }

    /// Acknowledged writes invoked at `since` or later that the final state
    /// lacks.
    fn count_lost(&self, final_state: Option<&[(Bytes, Record)]>, since: u64) -> u64 {
        let history = &self.report.history;
        match (self.config.workload, final_state) {
            (Workload::Registers | Workload::Collections, Some(state)) => {
                durability::lost_writes(history, state, since)
            }
            (Workload::Batches, Some(state)) => {
                durability::lost_writes(history, &self.group_state(state), since)
            }
            (Workload::Registers | Workload::Batches | Workload::Collections, None) => 0,
            (Workload::Appends, state) => durability::lost_appends(history, state.unwrap_or_default(), since),
        }
    }
}

/// Runs one seed. A broken assertion in a protocol or the driver fails the
/// run loudly as a violation that names the seed, like any checker's.
pub fn run(seed: u64, config: &SimConfig) -> Report {
    catching_panics(seed, || Simulation::new(seed, config.clone()).run())
}

/// A run's report, or a violation naming the seed if the run panicked.
pub(crate) fn catching_panics(seed: u64, run: impl FnOnce() -> Report) -> Report {
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    run.unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a panic without a message");
        Report { seed, violations: vec![format!("assertion: {message} (seed {seed})")], ..Report::default() }
    })
}

/// Each key's value, as some holder shows it.
pub(crate) type Values = Vec<(Bytes, Option<Bytes>)>;

/// Each key's value as a quorum reader sees it: an intent's value once the
/// batch's primary shows it committed, the committed value otherwise.
pub(crate) fn as_read(state: &[(Bytes, Record)]) -> Values {
    let record_of = |key: &[u8]| state.iter().find(|(other, _)| other == key).map(|(_, record)| record);
    state
        .iter()
        .map(|(key, record)| {
            let value = match record.intent.as_deref() {
                Some(intent)
                    if record_of(&intent.primary)
                        .is_some_and(|primary| primary.markers.contains(&intent.batch)) =>
                {
                    intent.value.clone()
                }
                _ => record.visible().cloned(),
            };
            (key.clone(), value)
        })
        .collect()
}
