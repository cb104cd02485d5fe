//! Every replication protocol, one row each. The coordinator, the nodes and
//! the simulator know a protocol only through its row: its name, what it
//! guarantees, where clients send it requests, how a node joins a shard that
//! runs it, how to make an instance, and the family of its messages (which
//! its own file encodes). Adding a protocol is its file and a row here
//! (docs/PROTOCOLS.md, "Adding a protocol").

use std::sync::Arc;

use tessera_engine::Engine;

use crate::causal::cops::{self, Cops};
use crate::causal::eventual::{self, Eventual};
use crate::causal::gentle_rain::{self, GentleRain};
use crate::causal::spartan::{self, CausalSpartan};
use crate::codec::{Family, Message};
use crate::coordinator::Admission;
use crate::{
    chain, multi_master, primary_backup, quorum, ChainOptions, ChainReplication, MultiMaster,
    MultiMasterOptions, NodeId, PrimaryBackup, PrimaryBackupOptions, Protocol, QuorumOptions, QuorumRegister,
    SnapshotPace,
};

/// How an instance begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// On the shard's records as this replica left them (empty, or after a
    /// restart).
    Open,
    /// Taking over the records another protocol left at the end of a
    /// transition.
    SwitchedIn,
}

/// Protocol timers a deployment sets. The defaults suit a cluster; a
/// simulated run of a few seconds needs them at the pace of its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// How often an active–active replica starts an anti-entropy round
    /// (`None`: never).
    pub anti_entropy_ms: Option<u64>,
    /// How long an active–active tombstone outlives its acknowledgement.
    pub tombstone_grace_ms: u64,
    /// How replicas stream snapshots to each other.
    pub snapshot: SnapshotPace,
}

/// What a snapshot stream may send per second unless configured otherwise.
pub const SNAPSHOT_BYTES_PER_SEC_DEFAULT: u64 = 128 << 20;

impl Default for Tuning {
    fn default() -> Self {
        let defaults = MultiMasterOptions::default();
        Self {
            anti_entropy_ms: defaults.anti_entropy_ms,
            tombstone_grace_ms: defaults.tombstone_grace_ms,
            snapshot: SnapshotPace {
                bytes_per_sec: Some(SNAPSHOT_BYTES_PER_SEC_DEFAULT),
                ..SnapshotPace::default()
            },
        }
    }
}

/// Which member answers a client's strong get through the protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrongReads {
    /// The first member (head or primary).
    First,
    /// The last member (the chain's tail).
    Last,
    /// Any member.
    Any,
}

/// One protocol as the rest of Tessera sees it.
pub struct ProtocolSpec {
    /// What operators and the simulator call it (`chain`, `quorum`, ...).
    pub name: &'static str,
    /// Gets, puts, deletes and read-modify-writes are linearizable.
    pub strong: bool,
    /// Every member accepts writes (else only the first does).
    pub active_active: bool,
    /// Strong operations run through the protocol at any member, as quorum
    /// rounds, and it takes conditional writes (`Fetch`, `WriteIf`); else a
    /// node serves them from the first member's copy.
    pub quorum: bool,
    /// A table can be given this mode (`TABLE.ALTER`, `cluster up`); the
    /// other rows are variants for the simulator, or causal.
    pub offered: bool,
    /// Replicates across datacenters, a copy of each shard in each: its
    /// instances need their place ([`crate::ShardView::geo`]), which only a
    /// cluster laid out in datacenters gives (`cluster up --datacenters`).
    pub geo: bool,
    pub strong_reads: StrongReads,
    /// The family its messages carry; unique per protocol.
    pub family: Family,
    admission: fn(replicas: usize) -> Admission,
    build: Constructor,
}

/// Makes an instance for replica `me` over its shard's engine.
type Constructor =
    fn(me: NodeId, engine: Arc<dyn Engine>, start: Start, tuning: &Tuning) -> Box<dyn Protocol>;

impl ProtocolSpec {
    /// Every member of one datacenter's group accepts writes and keeps the
    /// newest by version (AA+EC): a conditional delete there retires the
    /// record it names (docs/PROTOCOLS.md, "AA+EC").
    pub fn last_writer_wins(&self) -> bool {
        self.active_active && !self.quorum && !self.geo
    }

    /// How a node outside the view joins a shard of `replicas` replicas.
    pub fn admission(&self, replicas: usize) -> Admission {
        (self.admission)(replicas)
    }

    /// Members that must stay healthy for a shard of `replicas` to keep every
    /// acknowledged write: one copy, or a majority for a quorum.
    pub fn copies_needed(&self, replicas: usize) -> usize {
        match self.admission(replicas) {
            Admission::Quorum { min_members } => min_members,
            Admission::Learner | Admission::Backup | Admission::Fixed => 1,
        }
    }

    /// An instance for replica `me` over its shard's engine.
    pub fn instance(
        &self,
        me: NodeId,
        engine: Arc<dyn Engine>,
        start: Start,
        tuning: &Tuning,
    ) -> Box<dyn Protocol> {
        (self.build)(me, engine, start, tuning)
    }

    /// Whether a causal session on it gets causal consistency: every row
    /// across datacenters but their eventual baseline.
    pub fn is_causal(&self) -> bool {
        self.geo && self.family != GEO_EVENTUAL.family
    }

    /// Master–slave or active–active, strong or eventual, as operators read
    /// it: `ms+sc`, `aa+ec`, ...; a causal protocol by its name.
    pub fn label(&self) -> &'static str {
        if self.geo {
            return self.name;
        }
        match (self.active_active, self.strong) {
            (false, true) => "ms+sc",
            (false, false) => "ms+ec",
            (true, false) => "aa+ec",
            (true, true) => "aa+sc",
        }
    }
}

/// A protocol of the registry: a row, copied freely, compared by name.
#[derive(Clone, Copy)]
pub struct Mode(&'static ProtocolSpec);

impl std::ops::Deref for Mode {
    type Target = ProtocolSpec;

    fn deref(&self) -> &ProtocolSpec {
        self.0
    }
}

impl PartialEq for Mode {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for Mode {}

impl std::hash::Hash for Mode {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.name.hash(state)
    }
}

impl std::fmt::Debug for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

/// Stored by name; read back from a name, a label or a former name.
impl serde::Serialize for Mode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name)
    }
}

impl<'de> serde::Deserialize<'de> for Mode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Mode::named(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown replication mode {name:?}")))
    }
}

/// Names the cluster map used before modes were registry rows.
const FORMER_NAMES: &[(&str, &str)] = &[
    ("ms-strong", "chain"),
    ("ms-eventual", "primary-backup"),
    ("aa-eventual", "multi-master"),
    ("aa-strong", "quorum"),
];

impl Mode {
    /// Every protocol a table or the simulator may run.
    pub fn all() -> impl Iterator<Item = Mode> {
        PROTOCOLS.iter().map(Mode)
    }

    /// A protocol by its name (`chain`), or an offered mode by its label
    /// (`ms+sc`) or its former name in stored maps (`ms-strong`), in any case.
    pub fn named(name: &str) -> Option<Mode> {
        let name = FORMER_NAMES
            .iter()
            .find(|(former, _)| former.eq_ignore_ascii_case(name))
            .map_or(name, |(_, current)| current);
        Self::all().chain(Self::broken()).find(|mode| {
            mode.name.eq_ignore_ascii_case(name) || (mode.offered && mode.label().eq_ignore_ascii_case(name))
        })
    }

    /// The offered mode for a topology (`ms`, `aa`) and a consistency
    /// (`strong`, `eventual`), as TABLE.ALTER and `cluster up` name them.
    pub fn for_table(topology: &str, consistency: &str) -> Result<Mode, String> {
        let active_active = match topology.to_ascii_lowercase().as_str() {
            "ms" => false,
            "aa" => true,
            other => return Err(format!("unknown topology {other:?}; choose ms or aa")),
        };
        let strong = match consistency.to_ascii_lowercase().as_str() {
            "strong" => true,
            "eventual" => false,
            other => return Err(format!("unknown consistency {other:?}; choose strong or eventual")),
        };
        Ok(Self::all()
            .find(|mode| mode.offered && mode.active_active == active_active && mode.strong == strong)
            .expect("every topology and consistency has an offered mode"))
    }

    /// A causal protocol by its name, as a layout across datacenters takes
    /// it (`cluster up --datacenters 2 --consistency cops`).
    pub fn causal(name: &str) -> Result<Mode, String> {
        Self::all().find(|mode| mode.geo && mode.name.eq_ignore_ascii_case(name)).ok_or_else(|| {
            let names: Vec<&str> = Self::all().filter(|mode| mode.geo).map(|mode| mode.name).collect();
            format!(
                "across datacenters, the consistency is a causal protocol: {}; not {name:?}",
                names.join(", ")
            )
        })
    }

    /// The topology and consistency, as [`Mode::for_table`] takes them.
    pub fn parts(self) -> (&'static str, &'static str) {
        (if self.active_active { "aa" } else { "ms" }, if self.strong { "strong" } else { "eventual" })
    }

    /// Deliberately broken variants, which the simulator's checkers must
    /// catch.
    #[cfg(feature = "broken")]
    pub fn broken() -> impl Iterator<Item = Mode> {
        BROKEN.iter().map(Mode)
    }

    #[cfg(not(feature = "broken"))]
    pub fn broken() -> impl Iterator<Item = Mode> {
        std::iter::empty()
    }
}

fn learner(_replicas: usize) -> Admission {
    Admission::Learner
}

fn backup(_replicas: usize) -> Admission {
    Admission::Backup
}

fn fixed(_replicas: usize) -> Admission {
    Admission::Fixed
}

fn majority(replicas: usize) -> Admission {
    Admission::Quorum { min_members: replicas / 2 + 1 }
}

fn chain_options(tuning: &Tuning) -> ChainOptions {
    ChainOptions { snapshot: tuning.snapshot, ..ChainOptions::default() }
}

fn primary_backup_options(tuning: &Tuning) -> PrimaryBackupOptions {
    PrimaryBackupOptions { snapshot: tuning.snapshot, ..PrimaryBackupOptions::default() }
}

fn quorum_options(tuning: &Tuning) -> QuorumOptions {
    QuorumOptions { snapshot: tuning.snapshot, ..QuorumOptions::default() }
}

fn multi_master_options(tuning: &Tuning) -> MultiMasterOptions {
    MultiMasterOptions {
        anti_entropy_ms: tuning.anti_entropy_ms,
        tombstone_grace_ms: tuning.tombstone_grace_ms,
        ..MultiMasterOptions::default()
    }
}

fn quorum_register(
    me: NodeId,
    engine: Arc<dyn Engine>,
    start: Start,
    options: QuorumOptions,
) -> Box<dyn Protocol> {
    match start {
        Start::Open => Box::new(QuorumRegister::new(me, engine, options)),
        Start::SwitchedIn => Box::new(QuorumRegister::switched_in(me, engine, options)),
    }
}

/// The registry. The four offered rows give the four table modes; the last
/// four replicate across datacenters.
static PROTOCOLS: &[ProtocolSpec] = &[
    CHAIN,
    CHAIN_CRAQ,
    PRIMARY_BACKUP,
    MULTI_MASTER,
    QUORUM,
    GEO_EVENTUAL,
    COPS,
    GENTLE_RAIN,
    CAUSAL_SPARTAN,
];

/// MS+SC (BespoKV, Anwar et al., SC 2018, IV-A): chain replication, strong
/// reads at the tail.
const CHAIN: ProtocolSpec = ProtocolSpec {
    name: "chain",
    strong: true,
    active_active: false,
    quorum: false,
    offered: true,
    geo: false,
    strong_reads: StrongReads::Last,
    family: chain::ChainMessage::FAMILY,
    admission: learner,
    build: |me, engine, _, tuning| Box::new(ChainReplication::new(me, engine, chain_options(tuning))),
};

/// Chain replication whose replicas answer strong reads of clean keys (CRAQ,
/// Terrace and Freedman, USENIX ATC 2009).
const CHAIN_CRAQ: ProtocolSpec = ProtocolSpec {
    name: "chain-craq",
    strong: true,
    active_active: false,
    quorum: false,
    offered: false,
    geo: false,
    strong_reads: StrongReads::Any,
    family: chain::ChainMessage::FAMILY,
    admission: learner,
    build: |me, engine, _, tuning| {
        Box::new(ChainReplication::new(
            me,
            engine,
            ChainOptions { craq_reads: true, ..chain_options(tuning) },
        ))
    },
};

/// MS+EC: primary–backup with asynchronous propagation.
const PRIMARY_BACKUP: ProtocolSpec = ProtocolSpec {
    name: "primary-backup",
    strong: false,
    active_active: false,
    quorum: false,
    offered: true,
    geo: false,
    strong_reads: StrongReads::First,
    family: primary_backup::BackupMessage::FAMILY,
    admission: backup,
    build: |me, engine, _, tuning| Box::new(PrimaryBackup::new(me, engine, primary_backup_options(tuning))),
};

/// AA+EC: every member accepts writes, last writer wins, anti-entropy.
const MULTI_MASTER: ProtocolSpec = ProtocolSpec {
    name: "multi-master",
    strong: false,
    active_active: true,
    quorum: false,
    offered: true,
    geo: false,
    strong_reads: StrongReads::Any,
    family: multi_master::MultiMessage::FAMILY,
    admission: backup,
    build: |me, engine, _, tuning| Box::new(MultiMaster::new(me, engine, multi_master_options(tuning))),
};

/// AA+SC: CASPaxos per key (Rystsov 2018) at any member.
const QUORUM: ProtocolSpec = ProtocolSpec {
    name: "quorum",
    strong: true,
    active_active: true,
    quorum: true,
    offered: true,
    geo: false,
    strong_reads: StrongReads::Any,
    family: quorum::QuorumMessage::FAMILY,
    admission: majority,
    build: |me, engine, start, tuning| quorum_register(me, engine, start, quorum_options(tuning)),
};

/// The causal protocols' baseline, last writer wins across datacenters
/// (DKVF, Roohitavaf and Kulkarni, ASE 2018); what every causal row shares:
/// active–active (each datacenter takes writes), not strong, and a fixed
/// view: a copy is its datacenter's only one, so none joins or is replaced
/// (copies fed by a snapshot are not built for the causal modes).
const GEO_EVENTUAL: ProtocolSpec = ProtocolSpec {
    name: "geo-eventual",
    strong: false,
    active_active: true,
    quorum: false,
    offered: false,
    geo: true,
    strong_reads: StrongReads::Any,
    family: Family(eventual::FAMILY),
    admission: fixed,
    build: |me, engine, _, _| Box::new(Eventual::new(me, engine)),
};

/// COPS (Lloyd et al., SOSP 2011): explicit dependencies, checked before a
/// write from elsewhere becomes visible.
const COPS: ProtocolSpec = ProtocolSpec {
    name: "cops",
    family: Family(cops::FAMILY),
    build: |me, engine, _, _| Box::new(Cops::new(me, engine)),
    ..GEO_EVENTUAL
};

/// GentleRain (Du et al., SoCC 2014): a global stable time from physical
/// clocks.
const GENTLE_RAIN: ProtocolSpec = ProtocolSpec {
    name: "gentle-rain",
    family: Family(gentle_rain::FAMILY),
    build: |me, engine, _, _| Box::new(GentleRain::new(me, engine)),
    ..GEO_EVENTUAL
};

/// CausalSpartan (Roohitavaf et al., SoCC 2017): hybrid logical clocks and
/// datacenter stable vectors.
const CAUSAL_SPARTAN: ProtocolSpec = ProtocolSpec {
    name: "causal-spartan",
    family: Family(spartan::FAMILY),
    build: |me, engine, _, _| Box::new(CausalSpartan::new(me, engine)),
    ..GEO_EVENTUAL
};

/// Variants that break a protocol's guarantee on purpose, to show that the
/// simulator's checkers catch it.
#[cfg(feature = "broken")]
static BROKEN: &[ProtocolSpec] = &[
    // The head answers before the tail has the write.
    ProtocolSpec {
        name: "broken-chain-early-ack",
        build: |me, engine, _, tuning| {
            Box::new(ChainReplication::new(
                me,
                engine,
                ChainOptions { broken_early_ack: true, ..chain_options(tuning) },
            ))
        },
        ..CHAIN
    },
    // The head files a waiting client under the wrong write number.
    ProtocolSpec {
        name: "broken-chain-waits-past-applied",
        build: |me, engine, _, tuning| {
            Box::new(ChainReplication::new(
                me,
                engine,
                ChainOptions { broken_waits_past_applied: true, ..chain_options(tuning) },
            ))
        },
        ..CHAIN
    },
    // The head gives each write of a batch a number of its own.
    ProtocolSpec {
        name: "broken-chain-split-batches",
        build: |me, engine, _, tuning| {
            Box::new(ChainReplication::new(
                me,
                engine,
                ChainOptions { broken_split_batches: true, ..chain_options(tuning) },
            ))
        },
        ..CHAIN
    },
    // Multi-master without anti-entropy: what propagation misses is never repaired.
    ProtocolSpec {
        name: "broken-multi-master-no-repair",
        build: |me, engine, _, tuning| {
            Box::new(MultiMaster::new(
                me,
                engine,
                MultiMasterOptions { anti_entropy_ms: None, ..multi_master_options(tuning) },
            ))
        },
        offered: false,
        ..MULTI_MASTER
    },
    // Proposers that count their own answer as a majority.
    ProtocolSpec {
        name: "broken-quorum-of-one",
        build: |me, engine, start, tuning| {
            quorum_register(
                me,
                engine,
                start,
                QuorumOptions { broken_quorum_of_one: true, ..quorum_options(tuning) },
            )
        },
        offered: false,
        ..QUORUM
    },
    // Batches that lock their primary together with their other keys.
    ProtocolSpec {
        name: "broken-quorum-parallel-locks",
        build: |me, engine, start, tuning| {
            quorum_register(
                me,
                engine,
                start,
                QuorumOptions { broken_parallel_locks: true, ..quorum_options(tuning) },
            )
        },
        offered: false,
        ..QUORUM
    },
    // Writes whose accept round was interrupted write again over anything.
    ProtocolSpec {
        name: "broken-quorum-rewrite-interrupted",
        build: |me, engine, start, tuning| {
            quorum_register(
                me,
                engine,
                start,
                QuorumOptions { broken_rewrite_interrupted: true, ..quorum_options(tuning) },
            )
        },
        offered: false,
        ..QUORUM
    },
    // COPS without its dependency checks: a write from elsewhere is visible
    // on arrival.
    ProtocolSpec {
        name: "broken-cops-no-dependency-checks",
        build: |me, engine, _, _| Box::new(Cops::broken_skip_dependency_checks(me, engine)),
        ..COPS
    },
    // COPS whose restarted partitions ship their writes again without
    // their dependencies: visible on arrival.
    ProtocolSpec {
        name: "broken-cops-recovers-without-dependencies",
        build: |me, engine, _, _| Box::new(Cops::broken_recover_without_dependencies(me, engine)),
        ..COPS
    },
    // COPS whose expiry sweep deletes at a fresh version, shipped to every
    // datacenter: a later write taken elsewhere meanwhile is lost.
    ProtocolSpec {
        name: "broken-cops-retires-with-a-delete",
        build: |me, engine, _, _| Box::new(Cops::broken_retires_with_a_delete(me, engine)),
        ..COPS
    },
    // GentleRain without the wait for the global stable time.
    ProtocolSpec {
        name: "broken-gentle-rain-visible-on-arrival",
        build: |me, engine, _, _| Box::new(GentleRain::broken_visible_on_arrival(me, engine)),
        ..GENTLE_RAIN
    },
    // CausalSpartan without the wait for the datacenter stable vector.
    ProtocolSpec {
        name: "broken-causal-spartan-visible-on-arrival",
        build: |me, engine, _, _| Box::new(CausalSpartan::broken_visible_on_arrival(me, engine)),
        ..CAUSAL_SPARTAN
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::HandoffMessage;
    use crate::migration::MigrationMessage;
    use crate::transition::TransitionMessage;

    #[test]
    fn names_are_unique_and_families_belong_to_one_protocol() {
        let modes: Vec<Mode> = Mode::all().chain(Mode::broken()).collect();
        for (index, mode) in modes.iter().enumerate() {
            assert_eq!(Mode::named(mode.name), Some(*mode));
            assert_ne!(mode.family, TransitionMessage::FAMILY, "{mode} uses the transitions' family");
            assert_ne!(mode.family, HandoffMessage::FAMILY, "{mode} uses the handoffs' family");
            assert_ne!(mode.family, MigrationMessage::FAMILY, "{mode} uses the migrations' family");
            for other in &modes[index + 1..] {
                assert_ne!(mode.name, other.name);
            }
        }
        // Rows that share a family run one protocol's code (the chain and its
        // CRAQ reads), so they agree on what it is.
        for mode in &modes {
            for other in modes.iter().filter(|other| other.family == mode.family) {
                assert_eq!(
                    (mode.active_active, mode.quorum),
                    (other.active_active, other.quorum),
                    "{mode} / {other}"
                );
            }
        }
    }

    #[test]
    fn every_topology_and_consistency_names_one_offered_mode() {
        for (topology, consistency, label) in [
            ("ms", "strong", "ms+sc"),
            ("ms", "eventual", "ms+ec"),
            ("aa", "eventual", "aa+ec"),
            ("AA", "Strong", "aa+sc"),
        ] {
            let mode = Mode::for_table(topology, consistency).unwrap();
            assert_eq!(mode.label(), label);
            assert_eq!(Mode::named(label), Some(mode));
            assert_eq!(Mode::for_table(mode.parts().0, mode.parts().1), Ok(mode));
        }
        assert_eq!(Mode::all().filter(|mode| mode.offered).count(), 4);
        assert!(Mode::for_table("ring", "strong").unwrap_err().contains("topology"));
        assert!(Mode::for_table("ms", "causal").unwrap_err().contains("consistency"));
        assert_eq!(
            Mode::named("ms-strong").map(|mode| mode.name),
            Some("chain"),
            "a stored map's former name"
        );
        assert_eq!(Mode::named("nosuch"), None);
    }
}
