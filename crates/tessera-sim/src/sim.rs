//! One simulated cluster run: a shard's replicas running a real protocol over
//! real engines, a coordinator, clients, and a network that delays, reorders,
//! drops and partitions — all in one thread, in virtual time, every choice drawn
//! from one seed. The same seed replays the same run.
//!
//! A run has a safety phase (traffic and faults) and a liveness phase (faults
//! healed, traffic goes on, then every key is read back). The report carries the
//! history and what the checkers found.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::{Engine, MemoryEngine};
use tessera_protocol::{
    engine_entries, ChainOptions, ChainReplication, ClientReply, ClientRequest, Consistency, Effect, Effects,
    MultiMaster, MultiMasterOptions, NodeId, Operation as ProtocolOperation, PeerMessage, PrimaryBackup,
    PrimaryBackupOptions, Progress, Protocol, QuorumOptions, QuorumRegister, Record, RequestId, ShardView,
    Switchable,
};

use tessera_protocol::coordinator::{Admission, CoordinatorConfig, ShardCoordinator};

use crate::history::{Call, History, Operation, Outcome};
use crate::linearizability::{self, Verdict};
use crate::rng::Rng;

/// The protocols the simulator can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolKind {
    /// MS+SC, strong reads at the tail.
    Chain,
    /// MS+SC with CRAQ reads: any replica answers a strong read of a clean key.
    ChainCraq,
    /// MS+EC.
    PrimaryBackup,
    /// AA+EC: every replica accepts writes, last writer wins.
    MultiMaster,
    /// AA+SC: every replica proposes; CASPaxos per key.
    Quorum,
    /// Chain replication whose head answers before the tail has the write.
    #[cfg(any(test, feature = "broken"))]
    BrokenChainEarlyAck,
    /// Multi-master without anti-entropy.
    #[cfg(any(test, feature = "broken"))]
    BrokenMultiMasterNoRepair,
    /// Quorum proposers that count their own answer as a majority.
    #[cfg(any(test, feature = "broken"))]
    BrokenQuorumOfOne,
}

impl ProtocolKind {
    pub const ALL: &'static [ProtocolKind] = &[
        ProtocolKind::Chain,
        ProtocolKind::ChainCraq,
        ProtocolKind::PrimaryBackup,
        ProtocolKind::MultiMaster,
        ProtocolKind::Quorum,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ProtocolKind::Chain => "chain",
            ProtocolKind::ChainCraq => "chain-craq",
            ProtocolKind::PrimaryBackup => "primary-backup",
            ProtocolKind::MultiMaster => "multi-master",
            ProtocolKind::Quorum => "quorum",
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenChainEarlyAck => "broken-chain-early-ack",
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenMultiMasterNoRepair => "broken-multi-master-no-repair",
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenQuorumOfOne => "broken-quorum-of-one",
        }
    }

    pub fn strong(self) -> bool {
        !matches!(self, ProtocolKind::PrimaryBackup | ProtocolKind::MultiMaster) && !self.broken_eventual()
    }

    #[cfg(any(test, feature = "broken"))]
    fn broken_eventual(self) -> bool {
        self == ProtocolKind::BrokenMultiMasterNoRepair
    }

    #[cfg(not(any(test, feature = "broken")))]
    fn broken_eventual(self) -> bool {
        false
    }

    /// Members that must stay healthy for the shard to keep every
    /// acknowledged write: one copy, or a majority for a quorum protocol.
    fn copies_needed(self, replicas: u32) -> usize {
        if self.quorum() {
            replicas as usize / 2 + 1
        } else {
            1
        }
    }

    fn quorum(self) -> bool {
        match self {
            ProtocolKind::Quorum => true,
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenQuorumOfOne => true,
            _ => false,
        }
    }

    /// Whether every replica accepts writes (else the first of the view does).
    pub fn active_active(self) -> bool {
        match self {
            ProtocolKind::MultiMaster | ProtocolKind::Quorum => true,
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenMultiMasterNoRepair | ProtocolKind::BrokenQuorumOfOne => true,
            _ => false,
        }
    }

    /// How a node outside the view joins it under this protocol.
    fn admission(self, replicas: u32) -> Admission {
        if self.quorum() {
            Admission::Quorum { min_members: self.copies_needed(replicas) }
        } else if self == ProtocolKind::PrimaryBackup || self.active_active() {
            Admission::Backup
        } else {
            Admission::Learner
        }
    }

    /// An instance that takes over records another protocol left (the end of
    /// a transition), or starts empty.
    fn instance(self, me: NodeId, engine: Arc<dyn Engine>) -> Box<dyn Protocol> {
        match self {
            ProtocolKind::Chain => Box::new(ChainReplication::new(me, engine, ChainOptions::default())),
            ProtocolKind::ChainCraq => Box::new(ChainReplication::new(
                me,
                engine,
                ChainOptions { craq_reads: true, ..ChainOptions::default() },
            )),
            ProtocolKind::PrimaryBackup => {
                Box::new(PrimaryBackup::new(me, engine, PrimaryBackupOptions::default()))
            }
            // Rounds and collection at the pace of a 5-second run: tombstones
            // outlive any partition the run draws, as the grace must.
            ProtocolKind::MultiMaster => Box::new(MultiMaster::new(
                me,
                engine,
                MultiMasterOptions {
                    anti_entropy_ms: Some(200),
                    tombstone_grace_ms: 1_500,
                    ..MultiMasterOptions::default()
                },
            )),
            ProtocolKind::Quorum => {
                Box::new(QuorumRegister::switched_in(me, engine, QuorumOptions::default()))
            }
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenQuorumOfOne => Box::new(QuorumRegister::new(
                me,
                engine,
                QuorumOptions { broken_quorum_of_one: true, ..QuorumOptions::default() },
            )),
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenMultiMasterNoRepair => Box::new(MultiMaster::new(
                me,
                engine,
                MultiMasterOptions { anti_entropy_ms: None, ..MultiMasterOptions::default() },
            )),
            #[cfg(any(test, feature = "broken"))]
            ProtocolKind::BrokenChainEarlyAck => Box::new(ChainReplication::new(
                me,
                engine,
                ChainOptions { broken_early_ack: true, ..ChainOptions::default() },
            )),
        }
    }
}

impl std::str::FromStr for ProtocolKind {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        ProtocolKind::ALL.iter().copied().find(|kind| kind.name() == name).ok_or_else(|| {
            let names: Vec<_> = ProtocolKind::ALL.iter().map(|kind| kind.name()).collect();
            format!("unknown protocol {name:?}; choose one of {}", names.join(", "))
        })
    }
}

/// The kinds of fault a run may draw from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// Random delays; with `Reorder` off, each channel stays FIFO.
    Delay,
    /// Channels are not FIFO.
    Reorder,
    Drop,
    /// Symmetric and one-way partitions among replicas and the coordinator.
    Partition,
    /// A replica crashes (losing everything, memory engine) and later restarts empty.
    Crash,
    /// Replicas' clocks are offset from each other.
    ClockSkew,
    /// The coordinator wrongly declares a live replica failed and removes it.
    FalseSuspicion,
}

impl FaultKind {
    pub const ALL: &'static [FaultKind] = &[
        FaultKind::Delay,
        FaultKind::Reorder,
        FaultKind::Drop,
        FaultKind::Partition,
        FaultKind::Crash,
        FaultKind::ClockSkew,
        FaultKind::FalseSuspicion,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Delay => "delay",
            FaultKind::Reorder => "reorder",
            FaultKind::Drop => "drop",
            FaultKind::Partition => "partition",
            FaultKind::Crash => "crash",
            FaultKind::ClockSkew => "skew",
            FaultKind::FalseSuspicion => "suspicion",
        }
    }

    pub fn parse_list(text: &str) -> Result<BTreeSet<FaultKind>, String> {
        if text == "all" {
            return Ok(FaultKind::ALL.iter().copied().collect());
        }
        if text == "none" || text.is_empty() {
            return Ok(BTreeSet::new());
        }
        text.split(',')
            .map(|name| {
                FaultKind::ALL.iter().copied().find(|kind| kind.name() == name.trim()).ok_or_else(|| {
                    let names: Vec<_> = FaultKind::ALL.iter().map(|kind| kind.name()).collect();
                    format!("unknown fault {name:?}; choose from {} (or all, none)", names.join(", "))
                })
            })
            .collect()
    }
}

/// What clients do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Gets, puts, deletes and increments on a few keys: contention, for the
    /// history checkers.
    Registers,
    /// Every write to a fresh key: an acknowledged key missing at the end was
    /// lost, so loss is counted exactly (the eventual modes' window).
    Appends,
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "registers" => Ok(Workload::Registers),
            "appends" => Ok(Workload::Appends),
            _ => Err(format!("unknown workload {name:?}; choose registers or appends")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub protocol: ProtocolKind,
    pub workload: Workload,
    pub replicas: u32,
    pub clients: usize,
    /// Keys for puts, deletes and gets; counters for increments.
    pub keys: usize,
    pub counters: usize,
    /// Faults a run may draw; each seed enables a random subset (swarm testing).
    pub faults: BTreeSet<FaultKind>,
    pub safety_ms: u64,
    pub liveness_ms: u64,
    pub tick_ms: u64,
    pub lease_ms: u64,
    pub failure_timeout_ms: u64,
    pub client_timeout_ms: u64,
    /// The share of reads that ask for eventual consistency.
    pub eventual_read_fraction: f64,
    /// Switch the shard to this protocol at a random time of the safety phase.
    pub transition_to: Option<ProtocolKind>,
    /// Transitions that skip the merge of the members' records.
    #[cfg(any(test, feature = "broken"))]
    pub broken_transition_without_merge: bool,
}

impl SimConfig {
    pub fn new(protocol: ProtocolKind) -> Self {
        Self {
            protocol,
            workload: Workload::Registers,
            replicas: 3,
            clients: 4,
            keys: 4,
            counters: 2,
            faults: FaultKind::ALL.iter().copied().collect(),
            safety_ms: 3_000,
            liveness_ms: 2_000,
            tick_ms: 10,
            lease_ms: 200,
            failure_timeout_ms: 150,
            client_timeout_ms: 400,
            eventual_read_fraction: 0.2,
            transition_to: None,
            #[cfg(any(test, feature = "broken"))]
            broken_transition_without_merge: false,
        }
    }

    /// A replica's protocol, `kind`, over `engine`, ready to switch to another.
    fn switchable(&self, me: NodeId, engine: Arc<dyn Engine>, kind: ProtocolKind) -> Switchable {
        let switchable = Switchable::new(me, engine.clone(), kind.instance(me, engine));
        #[cfg(any(test, feature = "broken"))]
        if self.broken_transition_without_merge {
            return switchable.broken_without_merge();
        }
        switchable
    }
}

/// The faults one seed drew, and their intensities.
#[derive(Clone, Debug, Default)]
pub struct FaultMix {
    pub enabled: BTreeSet<FaultKind>,
    pub drop_probability: f64,
    pub delay_max_ms: u64,
    pub skew_max_ms: u64,
}

impl FaultMix {
    fn draw(rng: &mut Rng, allowed: &BTreeSet<FaultKind>) -> Self {
        let enabled: BTreeSet<FaultKind> = allowed.iter().copied().filter(|_| rng.chance(0.6)).collect();
        Self {
            drop_probability: if enabled.contains(&FaultKind::Drop) {
                rng.between(1, 50) as f64 / 1000.0
            } else {
                0.0
            },
            delay_max_ms: if enabled.contains(&FaultKind::Delay) { rng.between(2, 40) } else { 1 },
            skew_max_ms: if enabled.contains(&FaultKind::ClockSkew) { rng.between(10, 500) } else { 0 },
            enabled,
        }
    }

    pub fn describe(&self) -> String {
        let names: Vec<_> = self.enabled.iter().map(|kind| kind.name()).collect();
        format!(
            "[{}] drop={:.3} delay<={}ms skew<={}ms",
            names.join(","),
            self.drop_probability,
            self.delay_max_ms,
            self.skew_max_ms
        )
    }
}

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
}

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Address {
    Replica(u32),
    Coordinator,
    Client(usize),
}

#[derive(Clone, Debug)]
enum Message {
    Peer(PeerMessage),
    /// Replica → coordinator: alive, with progress; asks for a lease. The
    /// incarnation changes at every restart.
    Heartbeat {
        seq: u64,
        progress: Progress,
        incarnation: u64,
    },
    /// Coordinator → replica: the current view, granting a lease for heartbeat `seq`.
    Grant {
        seq: u64,
        view: ShardView,
    },
    Request(ClientRequest),
    Response {
        request: RequestId,
        reply: ClientReply,
    },
}

#[derive(Clone, Debug)]
enum Event {
    Deliver { from: Address, to: Address, message: Message },
    ReplicaTick(u32),
    CoordinatorTick,
    BeginTransition,
    ClientWake(usize),
    Crash(u32),
    Restart(u32),
    Partition(Vec<(Address, Address)>),
    Heal,
    Suspect(u32),
}

struct Replica {
    alive: bool,
    /// Bumped at every restart: a restarted replica has lost its state and must
    /// not be taken for the member it was.
    incarnation: u64,
    protocol: Switchable,
    /// The protocol the instance runs.
    kind: ProtocolKind,
    engine: Arc<dyn Engine>,
    /// Added to virtual time to give this replica's clock.
    clock_offset_ms: u64,
    next_heartbeat: u64,
    /// Local send time of each unanswered heartbeat.
    heartbeats: BTreeMap<u64, u64>,
    lease_until: u64,
}

struct Pending {
    request: RequestId,
    key: Bytes,
    call: Call,
    strong: bool,
    invoked_at: u64,
    deadline: u64,
}

struct Client {
    rng: Rng,
    next_request: u64,
    pending: Option<Pending>,
    /// Keys still to read back in the liveness phase.
    final_reads: Vec<Bytes>,
}

pub struct Simulation {
    config: SimConfig,
    rng: Rng,
    now: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Event>,
    next_event: u64,
    replicas: Vec<Replica>,
    coordinator: ShardCoordinator,
    clients: Vec<Client>,
    blocked: BTreeSet<(Address, Address)>,
    /// Per channel, the last scheduled delivery time (for FIFO channels).
    channel_clock: HashMap<(Address, Address), u64>,
    healed: bool,
    report: Report,
    eventual_reads: u64,
    /// The view that completed the transition, from which the target runs.
    switched_in_view: Option<u64>,
    /// Every key's value when the transition completed (the members' common
    /// records), where a strong target's guarantee starts.
    switched_state: Vec<(Bytes, Option<Bytes>)>,
}

fn key_name(prefix: &str, index: usize) -> Bytes {
    Bytes::from(format!("{prefix}{index}"))
}

impl Simulation {
    pub fn new(seed: u64, config: SimConfig) -> Self {
        let mut rng = Rng::new(seed);
        let faults = FaultMix::draw(&mut rng, &config.faults);
        let replicas = (0..config.replicas)
            .map(|id| {
                let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
                let clock_offset_ms = if faults.skew_max_ms > 0 { rng.below(faults.skew_max_ms) } else { 0 };
                Replica {
                    alive: true,
                    incarnation: 0,
                    protocol: config.switchable(NodeId(id), engine.clone(), config.protocol),
                    kind: config.protocol,
                    engine,
                    clock_offset_ms,
                    next_heartbeat: 1,
                    heartbeats: BTreeMap::new(),
                    lease_until: 0,
                }
            })
            .collect();
        let clients = (0..config.clients)
            .map(|_| Client { rng: rng.fork(), next_request: 1, pending: None, final_reads: Vec::new() })
            .collect();
        let admission = config.protocol.admission(config.replicas);
        let coordinator = ShardCoordinator::new(
            CoordinatorConfig {
                lease_ms: config.lease_ms,
                failure_timeout_ms: config.failure_timeout_ms,
                admission,
            },
            ShardView {
                number: 1,
                replicas: (0..config.replicas).map(NodeId).collect(),
                learners: Vec::new(),
                lease_until: 0,
                draining: false,
            },
            (0..config.replicas).map(|id| (NodeId(id), 0)).collect(),
            0,
        );
        let mut simulation = Self {
            rng,
            now: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            next_event: 0,
            replicas,
            coordinator,
            clients,
            blocked: BTreeSet::new(),
            channel_clock: HashMap::new(),
            healed: false,
            report: Report { seed, faults, ..Report::default() },
            eventual_reads: 0,
            switched_in_view: None,
            switched_state: Vec::new(),
            config,
        };
        simulation.schedule_start();
        simulation
    }

    fn schedule(&mut self, at: u64, event: Event) {
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, event);
        self.queue.push(Reverse((at, id)));
    }

    fn schedule_start(&mut self) {
        for id in 0..self.config.replicas {
            let first = self.rng.below(self.config.tick_ms);
            self.schedule(first, Event::ReplicaTick(id));
        }
        self.schedule(0, Event::CoordinatorTick);
        for client in 0..self.config.clients {
            // Clients start once replicas have had a first lease.
            let start = 50 + self.rng.below(20);
            self.schedule(start, Event::ClientWake(client));
        }
        if self.config.transition_to.is_some() {
            let at = self.rng.between(300, self.config.safety_ms * 2 / 3);
            self.schedule(at, Event::BeginTransition);
        }
        let enabled = self.report.faults.enabled.clone();
        let mut at = 200;
        while at < self.config.safety_ms {
            let fault = *self.rng.pick(&[FaultKind::Partition, FaultKind::Crash, FaultKind::FalseSuspicion]);
            if enabled.contains(&fault) {
                let replica = self.rng.below(self.config.replicas as u64) as u32;
                match fault {
                    FaultKind::Partition => {
                        let cut = self.draw_partition();
                        let heal_at = at + self.rng.between(50, 600);
                        self.schedule(at, Event::Partition(cut));
                        self.schedule(heal_at.min(self.config.safety_ms), Event::Heal);
                    }
                    FaultKind::Crash => {
                        self.schedule(at, Event::Crash(replica));
                        let restart_at = at + self.rng.between(100, 800);
                        self.schedule(restart_at, Event::Restart(replica));
                    }
                    _ => self.schedule(at, Event::Suspect(replica)),
                }
            }
            at += self.rng.between(150, 700);
        }
    }

    /// A random cut among replicas and the coordinator: some links blocked one
    /// way or both.
    fn draw_partition(&mut self) -> Vec<(Address, Address)> {
        let mut servers: Vec<Address> = (0..self.config.replicas).map(Address::Replica).collect();
        servers.push(Address::Coordinator);
        let side: Vec<bool> = servers.iter().map(|_| self.rng.chance(0.5)).collect();
        let one_way = self.rng.chance(0.3);
        let mut cut = Vec::new();
        for (a, a_side) in servers.iter().zip(&side) {
            for (b, b_side) in servers.iter().zip(&side) {
                if a_side != b_side && (!one_way || *a_side) {
                    cut.push((*a, *b));
                }
            }
        }
        cut
    }

    fn local_time(&self, replica: u32) -> u64 {
        self.now + self.replicas[replica as usize].clock_offset_ms
    }

    fn send(&mut self, from: Address, to: Address, message: Message) {
        self.report.messages += 1;
        let faults_on = !self.healed;
        if faults_on && self.blocked.contains(&(from, to)) {
            return;
        }
        if faults_on && self.rng.chance(self.report.faults.drop_probability) {
            return;
        }
        let delay = 1 + self.rng.below(self.report.faults.delay_max_ms.max(1));
        let mut at = self.now + delay;
        let fifo = !self.report.faults.enabled.contains(&FaultKind::Reorder) || !faults_on;
        if fifo {
            let clock = self.channel_clock.entry((from, to)).or_insert(0);
            at = at.max(*clock);
            *clock = at;
        }
        self.schedule(at, Event::Deliver { from, to, message });
    }

    /// Runs the whole scenario and checks it.
    pub fn run(mut self) -> Report {
        let end = self.config.safety_ms + self.config.liveness_ms;
        while let Some(Reverse((at, id))) = self.queue.pop() {
            if at > end {
                break;
            }
            self.now = at;
            if !self.healed && self.now >= self.config.safety_ms {
                self.heal_for_liveness();
            }
            let event = self.events.remove(&id).expect("every queued event is stored");
            self.handle(event);
        }
        self.finish()
    }

    fn heal_for_liveness(&mut self) {
        self.report.log.push(format!("{}ms healed for liveness", self.now));
        self.healed = true;
        self.blocked.clear();
        if self.config.workload == Workload::Appends {
            return; // liveness shows in writes completing; nothing to read back
        }
        for client in &mut self.clients {
            client.final_reads = (0..self.config.keys)
                .map(|index| key_name("k", index))
                .chain((0..self.config.counters).map(|index| key_name("c", index)))
                .collect();
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Deliver { from, to, message } => self.deliver(from, to, message),
            Event::ReplicaTick(id) => {
                if self.replicas[id as usize].alive {
                    self.replica_tick(id);
                }
                self.schedule(self.now + self.config.tick_ms, Event::ReplicaTick(id));
            }
            Event::CoordinatorTick => {
                self.coordinator_tick();
                self.schedule(self.now + self.config.tick_ms, Event::CoordinatorTick);
            }
            Event::BeginTransition => {
                let target = self.config.transition_to.expect("scheduled only with a target");
                if self.coordinator.begin_transition(self.now, target.admission(self.config.replicas)) {
                    self.report.transition_started_at = Some(self.now);
                    self.log_view_changes();
                }
            }
            Event::ClientWake(client) => self.client_wake(client),
            Event::Crash(id) => {
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
            Event::Restart(id) => {
                let kind = self.kind();
                let replica = &mut self.replicas[id as usize];
                if !replica.alive {
                    // A crash loses everything in memory, engine included.
                    replica.engine = Arc::new(MemoryEngine::new());
                    replica.protocol = self.config.switchable(NodeId(id), replica.engine.clone(), kind);
                    replica.kind = kind;
                    replica.heartbeats.clear();
                    replica.lease_until = 0;
                    replica.incarnation += 1;
                    replica.alive = true;
                    self.report.log.push(format!("{}ms restart n{id} (empty)", self.now));
                }
            }
            Event::Partition(cut) => {
                if !self.healed {
                    self.report.log.push(format!("{}ms partition {cut:?}", self.now));
                    self.blocked.extend(cut);
                }
            }
            Event::Heal => {
                self.report.log.push(format!("{}ms heal", self.now));
                self.blocked.clear();
            }
            Event::Suspect(id) => {
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
            Self::engine_contents(self.replicas[member.0 as usize].engine.as_ref())
                .into_iter()
                .map(|(key, record)| (key, record.visible().cloned()))
                .collect();
        let keys = (0..self.config.keys).map(|index| key_name("k", index));
        let counters = (0..self.config.counters).map(|index| key_name("c", index));
        keys.chain(counters).map(|key| (key.clone(), held.get(&key).cloned().flatten())).collect()
    }

    /// The protocol of the current view: the target's once a transition
    /// completed.
    fn kind(&self) -> ProtocolKind {
        match (self.switched_in_view, self.config.transition_to) {
            (Some(_), Some(target)) => target,
            _ => self.config.protocol,
        }
    }

    /// Copies that must stay healthy: during a transition, what either
    /// protocol needs.
    fn copies_needed(&self) -> usize {
        let target = self.config.transition_to.unwrap_or(self.config.protocol);
        self.config
            .protocol
            .copies_needed(self.config.replicas)
            .max(target.copies_needed(self.config.replicas))
    }

    /// Members of the view, other than `id`, that are alive and not about to be
    /// removed: the copies that survive if `id` is lost.
    fn healthy_members_except(&self, id: u32) -> usize {
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
                        self.config.failure_timeout_ms / 2,
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
                Effect::Reply { request, reply } => {
                    // Request ids carry their client in the high half.
                    let client = (request.0 >> 32) as usize;
                    self.send(
                        Address::Replica(id),
                        Address::Client(client),
                        Message::Response { request, reply },
                    );
                }
            }
        }
    }

    fn replica_tick(&mut self, id: u32) {
        let local = self.local_time(id);
        let replica = &mut self.replicas[id as usize];
        let mut fx = Effects::new(local);
        replica.protocol.on_tick(&mut fx);
        let seq = replica.next_heartbeat;
        replica.next_heartbeat += 1;
        replica.heartbeats.insert(seq, local);
        let progress = replica.protocol.progress();
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
                let local = self.local_time(id);
                let mut fx = Effects::new(local);
                let replica = &mut self.replicas[id as usize];
                match message {
                    Message::Peer(peer) => {
                        let Address::Replica(sender) = from else { return };
                        replica.protocol.on_peer(NodeId(sender), peer, &mut fx);
                    }
                    Message::Grant { seq, view } => {
                        // The lease runs from when this replica asked for it, on its own clock.
                        let Some(&asked_at) = replica.heartbeats.get(&seq) else { return };
                        replica.heartbeats = replica.heartbeats.split_off(&seq);
                        replica.lease_until = replica.lease_until.max(asked_at + self.config.lease_ms);
                        let view = ShardView { lease_until: replica.lease_until, ..view };
                        // The view that completes a transition, and any after
                        // it, run the target protocol (a late grant of an
                        // older view changes nothing).
                        let switched = match (self.switched_in_view, self.config.transition_to) {
                            (Some(first), Some(target)) if view.number >= first => Some(target),
                            _ => None,
                        };
                        if let Some(kind) = switched.filter(|kind| *kind != replica.kind) {
                            let engine = replica.engine.clone();
                            replica.protocol.replace(&view, || kind.instance(NodeId(id), engine));
                            replica.kind = kind;
                            self.report.log.push(format!(
                                "{}ms n{id} runs {} from view {}",
                                self.now,
                                kind.name(),
                                view.number
                            ));
                        }
                        replica.protocol.on_view(&view, &mut fx);
                    }
                    Message::Request(request) => {
                        if let ProtocolOperation::Get { consistency: Consistency::Strong, .. } =
                            request.operation
                        {
                            *self.report.strong_reads_by_replica.entry(id).or_default() += 1;
                        }
                        replica.protocol.on_client(request, &mut fx);
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
                    self.on_response(client, request, reply);
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
            if change.reason == "transition complete" {
                self.switched_in_view = Some(change.view.number);
                self.report.transition_completed_at = Some(change.at_ms);
                self.switched_state = self.drained_state(&change.view);
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

    fn client_wake(&mut self, client: usize) {
        let now = self.now;
        if let Some(pending) = &self.clients[client].pending {
            if now < pending.deadline {
                return; // a stale wake-up; the deadline one is queued
            }
            let pending = self.clients[client].pending.take().expect("checked above");
            self.record_unknown(client, pending);
        }
        let end = self.config.safety_ms + self.config.liveness_ms;
        // The last stretch is quiet, so that propagation can finish before the
        // convergence check.
        if now + self.config.client_timeout_ms + 200 > end && self.clients[client].final_reads.is_empty() {
            return;
        }
        self.issue(client);
    }

    /// An operation whose outcome the client cannot know (no answer in time,
    /// or an answer saying so): it may take effect at any moment after it was
    /// invoked.
    fn record_unknown(&mut self, client: usize, pending: Pending) {
        self.report.unknown += 1;
        if pending.strong || pending.call != Call::Get {
            self.report.history.operations.push(Operation {
                client,
                key: pending.key,
                call: pending.call,
                outcome: Outcome::Unknown,
                invoked_at: pending.invoked_at,
                completed_at: None,
            });
        }
    }

    fn issue(&mut self, client: usize) {
        let config = &self.config;
        let state = &mut self.clients[client];
        let (key, call, strong) = if let Some(key) = state.final_reads.last().cloned() {
            (key, Call::Get, true)
        } else if config.workload == Workload::Appends {
            let key = Bytes::from(format!("a{client}-{}", state.next_request));
            (key.clone(), Call::Put(key), true)
        } else if state.rng.chance(0.25) && config.counters > 0 {
            let key = key_name("c", state.rng.below(config.counters as u64) as usize);
            if state.rng.chance(0.5) {
                (key, Call::Increment(state.rng.between(1, 5) as i64), true)
            } else {
                (key, Call::Get, !state.rng.chance(config.eventual_read_fraction))
            }
        } else {
            let key = key_name("k", state.rng.below(config.keys as u64) as usize);
            let roll = state.rng.below(100);
            let call = if roll < 45 {
                Call::Get
            } else if roll < 90 {
                Call::Put(Bytes::from(format!("c{client}-{}", state.next_request)))
            } else {
                Call::Delete
            };
            let strong = call != Call::Get || !state.rng.chance(config.eventual_read_fraction);
            (key, call, strong)
        };
        let request = RequestId(((client as u64) << 32) | state.next_request);
        state.next_request += 1;
        let operation = match &call {
            Call::Get => ProtocolOperation::Get {
                key: key.clone(),
                consistency: if strong { Consistency::Strong } else { Consistency::Eventual },
            },
            Call::Put(value) => ProtocolOperation::Put { key: key.clone(), value: value.clone() },
            Call::Delete => ProtocolOperation::Delete { key: key.clone() },
            Call::Increment(delta) => ProtocolOperation::Increment { key: key.clone(), delta: *delta },
        };
        let target = self.route(client, &call, strong);
        let deadline = self.now + self.config.client_timeout_ms;
        self.clients[client].pending =
            Some(Pending { request, key, call, strong, invoked_at: self.now, deadline });
        self.send(
            Address::Client(client),
            Address::Replica(target),
            Message::Request(ClientRequest { id: request, operation }),
        );
        self.schedule(deadline, Event::ClientWake(client));
    }

    /// Where a client sends a request, from the coordinator's current view (what
    /// a client learns from the shard map).
    fn route(&mut self, client: usize, call: &Call, strong: bool) -> u32 {
        let kind = self.kind();
        let replicas = &self.coordinator.view().replicas;
        let rng = &mut self.clients[client].rng;
        let target = if kind.active_active() {
            *rng.pick(replicas)
        } else if *call != Call::Get {
            replicas[0]
        } else if !strong || kind == ProtocolKind::ChainCraq {
            *rng.pick(replicas)
        } else if kind == ProtocolKind::PrimaryBackup {
            replicas[0]
        } else {
            *replicas.last().expect("a view keeps at least one replica")
        };
        target.0
    }

    fn on_response(&mut self, client: usize, request: RequestId, reply: ClientReply) {
        let Some(pending) = &self.clients[client].pending else { return };
        if pending.request != request {
            return; // an answer to a request the client gave up on
        }
        let pending = self.clients[client].pending.take().expect("checked above");
        let outcome = match reply {
            ClientReply::Value(value) => Outcome::Value(value),
            ClientReply::Written => Outcome::Written,
            ClientReply::Retry(_) | ClientReply::Failed(_) => {
                // No effect: try something again shortly.
                self.report.retried += 1;
                let retry_at = self.now + 5 + self.clients[client].rng.below(10);
                self.schedule(retry_at, Event::ClientWake(client));
                return;
            }
            ClientReply::Unknown(_) => {
                // As after a timeout: it may take effect at any time from now.
                self.record_unknown(client, pending);
                self.schedule(self.now + 1, Event::ClientWake(client));
                return;
            }
        };
        self.report.completed += 1;
        if pending.strong || pending.call != Call::Get {
            if pending.call != Call::Get {
                self.report.acknowledged_writes += 1;
            }
            self.report.history.operations.push(Operation {
                client,
                key: pending.key.clone(),
                call: pending.call,
                outcome,
                invoked_at: pending.invoked_at,
                completed_at: Some(self.now),
            });
        } else {
            self.eventual_reads += 1;
        }
        if self.healed && self.clients[client].final_reads.last() == Some(&pending.key) {
            self.clients[client].final_reads.pop();
        }
        let think = self.clients[client].rng.below(5);
        self.schedule(self.now + think, Event::ClientWake(client));
    }

    /// A replica's live records, by key (tombstones are bookkeeping: when
    /// each replica collects one is its own business).
    fn engine_contents(engine: &dyn Engine) -> Vec<(Bytes, Record)> {
        let mut entries: Vec<(Bytes, Record)> = engine_entries(engine)
            .expect("memory engines do not fail")
            .into_iter()
            .filter_map(|(key, raw)| Some((key, Record::decode(raw).ok()?)))
            .filter(|(_, record)| !record.tombstone)
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    fn finish(mut self) -> Report {
        // Liveness: after healing, every client read every key back.
        for (index, client) in self.clients.iter().enumerate() {
            if !client.final_reads.is_empty() {
                self.report.violations.push(format!(
                    "liveness: client {index} could not read back {} keys within {} ms of healing",
                    client.final_reads.len(),
                    self.config.liveness_ms
                ));
            }
        }
        // Convergence: the live members of the final view hold the same data.
        let members: Vec<u32> = self
            .coordinator
            .view()
            .replicas
            .iter()
            .map(|node| node.0)
            .filter(|id| self.replicas[*id as usize].alive)
            .collect();
        let contents: Vec<_> = members
            .iter()
            .map(|id| (id, Self::engine_contents(self.replicas[*id as usize].engine.as_ref())))
            .collect();
        // A quorum protocol promises what a majority holds: a write that
        // reached only a minority (its client was told the outcome is unknown)
        // may stay there until the key's next operation settles it.
        if let (Some(target), None) = (self.config.transition_to, self.report.transition_completed_at) {
            self.report
                .violations
                .push(format!("liveness: the transition to {} never completed", target.name()));
        }
        let final_state = if self.kind().copies_needed(self.config.replicas) > 1 {
            self.majority_state(&contents)
        } else {
            self.check_identical(&contents);
            contents.first().map(|(_, contents)| contents.clone())
        };
        let final_state = final_state.as_deref();
        self.report.lost_acknowledged_writes = self.count_lost(final_state, 0);
        if self.config.workload == Workload::Appends {
            let writes_after_healing =
                self.report.history.operations.iter().any(|operation| {
                    operation.completed_at.is_some_and(|done| done >= self.config.safety_ms)
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
            None => (original.strong().then(|| self.report.history.clone()), original.strong().then_some(0)),
            Some(target) => {
                let started = self.report.transition_started_at;
                let completed = self.report.transition_completed_at;
                if original.strong() && target.strong() {
                    (Some(self.report.history.clone()), Some(0))
                } else if let (true, Some(completed)) = (target.strong(), completed) {
                    (Some(self.report.history.after(completed, &self.switched_state)), Some(completed))
                } else if let (true, Some(started)) = (original.strong(), started) {
                    (Some(self.report.history.before(started)), None)
                } else {
                    (None, None)
                }
            }
        };
        if let Some(history) = checked {
            match linearizability::check(&history) {
                Verdict::Linearizable => {}
                Verdict::Violation { key, detail } => self
                    .report
                    .violations
                    .push(format!("linearizability: key {:?}: {detail}", String::from_utf8_lossy(&key))),
                Verdict::Inconclusive { .. } => self.report.inconclusive = true,
            }
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
        match self.config.workload {
            Workload::Registers => self.count_lost_writes(final_state, since),
            Workload::Appends => self.count_lost_appends(final_state, since),
        }
    }

    /// Convergence: every live member of the final view holds the same data.
    fn check_identical(&mut self, contents: &[(&u32, Vec<(Bytes, Record)>)]) {
        if let Some((first_id, first)) = contents.first() {
            for (id, other) in &contents[1..] {
                if other != first {
                    let difference = first
                        .iter()
                        .zip(other.iter())
                        .find(|(a, b)| a != b)
                        .map(|(a, b)| format!("first difference {a:?} / {b:?}"))
                        .unwrap_or_else(|| format!("{} / {} keys", first.len(), other.len()));
                    self.report.violations.push(format!(
                        "convergence: replicas n{first_id} and n{id} differ after {} quiet ms: {difference}",
                        self.config.client_timeout_ms + 200
                    ));
                }
            }
        }
    }

    /// Per key, the record a majority of the live members hold (absence
    /// counts as a record); a key without one is a violation.
    fn majority_state(&mut self, contents: &[(&u32, Vec<(Bytes, Record)>)]) -> Option<Vec<(Bytes, Record)>> {
        let majority = contents.len() / 2 + 1;
        let keys: BTreeSet<&Bytes> =
            contents.iter().flat_map(|(_, entries)| entries.iter().map(|(key, _)| key)).collect();
        let mut state = Vec::new();
        for key in keys {
            let mut counts: Vec<(Option<&Record>, usize)> = Vec::new();
            for (_, entries) in contents {
                let record = entries.iter().find(|(other, _)| other == key).map(|(_, record)| record);
                match counts.iter_mut().find(|(seen, _)| *seen == record) {
                    Some((_, count)) => *count += 1,
                    None => counts.push((record, 1)),
                }
            }
            match counts.into_iter().find(|(_, count)| *count >= majority) {
                Some((Some(record), _)) => state.push((key.clone(), record.clone())),
                Some((None, _)) => {}
                None => self.report.violations.push(format!(
                    "convergence: no majority of the {} live members holds one record of key {:?}",
                    contents.len(),
                    String::from_utf8_lossy(key)
                )),
            }
        }
        Some(state)
    }

    /// Acknowledged appends whose key is missing at the end.
    fn count_lost_appends(&self, final_state: Option<&[(Bytes, Record)]>, since: u64) -> u64 {
        let present: BTreeSet<&Bytes> = final_state.unwrap_or_default().iter().map(|(key, _)| key).collect();
        self.report
            .history
            .operations
            .iter()
            .filter(|operation| {
                operation.outcome == Outcome::Written
                    && operation.invoked_at >= since
                    && !present.contains(&operation.key)
            })
            .count() as u64
    }

    /// For each key, the last acknowledged write (by completion time) whose
    /// value is absent from the final state although no later write to the key
    /// was even invoked: a lost acknowledged write. A lower bound (earlier lost
    /// writes of a key may be hidden by later ones).
    fn count_lost_writes(&self, final_state: Option<&[(Bytes, Record)]>, since: u64) -> u64 {
        let Some(final_state) = final_state else { return 0 };
        let final_values: HashMap<&Bytes, Option<Bytes>> =
            final_state.iter().map(|(key, record)| (key, record.visible().cloned())).collect();
        let mut by_key: BTreeMap<&Bytes, Vec<&Operation>> = BTreeMap::new();
        for operation in self.report.history.operations.iter().filter(|operation| operation.is_write()) {
            by_key.entry(&operation.key).or_default().push(operation);
        }
        let mut lost = 0;
        for (key, writes) in by_key {
            let Some(last) = writes
                .iter()
                .filter(|write| write.completed_at.is_some())
                .max_by_key(|write| write.completed_at)
            else {
                continue;
            };
            // Any other write not over before this one began may come after it.
            let may_follow = |write: &&&Operation| {
                !std::ptr::eq(**write, *last) && write.completed_at.is_none_or(|done| done > last.invoked_at)
            };
            if last.invoked_at < since || writes.iter().any(|write| may_follow(&write)) {
                continue;
            }
            let expected = match (&last.call, &last.outcome) {
                (Call::Put(value), _) => Some(value.clone()),
                (Call::Delete, _) => None,
                (Call::Increment(_), Outcome::Value(value)) => value.clone(),
                _ => continue,
            };
            let actual = final_values.get(key).cloned().flatten();
            if actual != expected {
                lost += 1;
            }
        }
        lost
    }
}

/// Runs one seed.
pub fn run(seed: u64, config: &SimConfig) -> Report {
    Simulation::new(seed, config.clone()).run()
}
