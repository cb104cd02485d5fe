//! What a simulated run is made of: the protocol, the workload, the faults it
//! may draw and the timing.

use std::collections::BTreeSet;
use std::sync::Arc;

use tessera_engine::OrderedEngine;
use tessera_protocol::{Mode, NodeId, Replica, ReplicaConfig, SnapshotPace, Tuning};

use crate::rng::Rng;

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
    /// Batches that write one value to every key of a group (or delete them
    /// all), and reads of single keys: a group is checked as one register,
    /// so a replica that shows part of a batch fails the checks.
    Batches,
    /// Paged collections on a quorum protocol: a header whose value names
    /// its pages, written with them in one batch, and the expiry sweep at
    /// the shard's head deleting the pages no header names, as a node's
    /// sweep does; reads of a whole collection check that no page its
    /// header names is ever missing.
    Collections,
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "registers" => Ok(Workload::Registers),
            "appends" => Ok(Workload::Appends),
            "batches" => Ok(Workload::Batches),
            "collections" => Ok(Workload::Collections),
            _ => Err(format!("unknown workload {name:?}; choose registers, appends, batches or collections")),
        }
    }
}

/// How long a run's phases last, and the pace of its timers.
#[derive(Clone, Copy, Debug)]
pub struct RunTiming {
    /// Traffic with faults, then traffic healed (virtual milliseconds).
    pub safety_ms: u64,
    pub liveness_ms: u64,
    pub tick_ms: u64,
    pub lease_ms: u64,
    pub failure_timeout_ms: u64,
    pub client_timeout_ms: u64,
    /// Protocol timers at the pace of a five-second run: tombstones outlive
    /// any partition the run draws, as the grace must.
    pub tuning: Tuning,
}

impl Default for RunTiming {
    fn default() -> Self {
        Self {
            safety_ms: 3_000,
            liveness_ms: 2_000,
            tick_ms: 10,
            lease_ms: 200,
            failure_timeout_ms: 150,
            client_timeout_ms: 400,
            tuning: Tuning {
                anti_entropy_ms: Some(200),
                tombstone_grace_ms: 1_500,
                // A few records per chunk, so that the simulated shards'
                // snapshots stream in several chunks.
                snapshot: SnapshotPace { bytes_per_sec: None, chunk_bytes: 128 },
            },
        }
    }
}

impl RunTiming {
    /// The timing of a run of `workload` on `protocol` (switching to
    /// `transition_to`): the batches and collections workloads on a quorum
    /// read back keys that batches still write, each through a quorum's
    /// round trips, which under the runs' message delays takes twice the
    /// window.
    pub fn for_run(workload: Workload, protocol: Mode, transition_to: Option<Mode>) -> Self {
        let quorum = protocol.quorum || transition_to.is_some_and(|target| target.quorum);
        let mut timing = Self::default();
        if matches!(workload, Workload::Batches | Workload::Collections) && quorum {
            timing.liveness_ms *= 2;
        }
        timing
    }
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub protocol: Mode,
    pub workload: Workload,
    pub replicas: u32,
    pub clients: usize,
    /// Keys for puts, deletes and gets (groups, for batches); counters for
    /// increments.
    pub keys: usize,
    pub counters: usize,
    /// Faults a run may draw; each seed enables a random subset (swarm testing).
    pub faults: BTreeSet<FaultKind>,
    pub timing: RunTiming,
    /// The share of reads that ask for eventual consistency.
    pub eventual_read_fraction: f64,
    /// Switch the shard to this protocol at a random time of the safety phase.
    pub transition_to: Option<Mode>,
    /// Transitions that skip the merge of the members' records.
    #[cfg(any(test, feature = "broken"))]
    pub broken_transition_without_merge: bool,
    /// A collections sweep whose delete of a page is conditional on the
    /// page alone, not on the header that made it an orphan.
    #[cfg(any(test, feature = "broken"))]
    pub broken_sweep_ignores_header: bool,
}

impl SimConfig {
    pub fn new(protocol: Mode) -> Self {
        Self {
            protocol,
            workload: Workload::Registers,
            replicas: 3,
            clients: 4,
            keys: 4,
            counters: 2,
            faults: FaultKind::ALL.iter().copied().collect(),
            timing: RunTiming::default(),
            eventual_read_fraction: 0.2,
            transition_to: None,
            #[cfg(any(test, feature = "broken"))]
            broken_transition_without_merge: false,
            #[cfg(any(test, feature = "broken"))]
            broken_sweep_ignores_header: false,
        }
    }

    /// A replica's driver, running `mode` over an empty engine: an ordered
    /// one, whose scans (snapshots, migrations) go in the same order in
    /// every process, so that a seed replays exactly.
    pub(crate) fn replica(&self, id: u32, mode: Mode) -> Replica {
        #[allow(unused_mut)]
        let mut config = ReplicaConfig::new(NodeId(id), self.timing.lease_ms, self.timing.tuning);
        #[cfg(any(test, feature = "broken"))]
        {
            config.broken_transition_without_merge = self.broken_transition_without_merge;
        }
        Replica::new(config, Arc::new(OrderedEngine::new()), mode)
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
    pub(crate) fn draw(rng: &mut Rng, allowed: &BTreeSet<FaultKind>) -> Self {
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
