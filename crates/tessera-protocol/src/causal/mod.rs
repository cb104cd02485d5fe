//! Causal consistency across datacenters (docs/PROTOCOLS.md, "Causal
//! consistency across datacenters"): the layout, the session's causal
//! context, and what the four protocols share — the message they exchange,
//! a reliable FIFO stream between a partition's copies, and how a version
//! is stored.
//!
//! A table replicated across R datacenters keeps a whole copy in each,
//! partitioned over that datacenter's nodes (DKVF's replicas × partitions,
//! Roohitavaf and Kulkarni, ASE 2018). An instance serves one partition in
//! one datacenter: it replicates to the same partition in the other
//! datacenters ([`GeoPlace::replicas`]) and talks to the other partitions of
//! its own datacenter ([`GeoPlace::siblings`]) to stabilize (GentleRain,
//! CausalSpartan) or to check dependencies (COPS). Each protocol is one file:
//! [`eventual`], [`cops`], [`gentle_rain`], [`spartan`].

pub mod cops;
pub mod eventual;
pub mod gentle_rain;
pub mod spartan;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::{Engine, KeyRange, ScanCursor};
use tessera_wire::slot::{key_slot, SLOTS};

use crate::codec::{put_bytes, put_optional, put_u64s, CodecError, Family, Message, Reader};
pub use crate::record::Dependency;
use crate::record::{CausalMetadata, VERSION_AHEAD_MAX_MS};
use crate::{
    BatchBytes, ClientReply, ClientRequest, Consistency, Effects, Hlc, NodeId, Operation, OperationError,
    PeerMessage, Record, ShardView, Time, Version, Write,
};

/// Where a causal instance stands: its datacenter and partition, and the
/// nodes it talks to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GeoPlace {
    pub datacenter: usize,
    pub partition: usize,
    /// This partition's copy in each datacenter, by datacenter (this node
    /// at `datacenter`).
    pub replicas: Vec<NodeId>,
    /// Every partition of this datacenter, by partition (this node at
    /// `partition`).
    pub siblings: Vec<NodeId>,
    /// The shard each partition is, by partition: a message to a sibling
    /// goes to its shard, not this one.
    pub shards: Vec<u32>,
}

impl GeoPlace {
    pub fn datacenters(&self) -> usize {
        self.replicas.len()
    }

    pub fn partitions(&self) -> usize {
        self.siblings.len()
    }

    /// The partition that holds `key`: partitions split the slots evenly, in
    /// order, partition `p` from slot `SLOTS * p / partitions` (rounded
    /// down) on, as a cluster's shards split them.
    pub fn partition_of(&self, key: &[u8]) -> usize {
        ((key_slot(key) + 1) * self.partitions() - 1) / SLOTS
    }

    /// The same node at its own place in both lists, and no node twice.
    pub fn is_well_formed(&self) -> bool {
        let me = self.replicas.get(self.datacenter);
        let mut nodes: Vec<NodeId> = self.replicas.iter().chain(&self.siblings).copied().collect();
        nodes.sort_unstable();
        nodes.dedup();
        me.is_some()
            && me == self.siblings.get(self.partition)
            && self.shards.len() == self.siblings.len()
            && nodes.len() == self.replicas.len() + self.siblings.len() - 1
    }

    fn datacenter_of(&self, node: NodeId) -> Option<usize> {
        self.replicas.iter().position(|replica| *replica == node).filter(|&at| at != self.datacenter)
    }

    fn partition_of_node(&self, node: NodeId) -> Option<usize> {
        self.siblings.iter().position(|sibling| *sibling == node).filter(|&at| at != self.partition)
    }
}

/// What a causal session has done and seen, kept by the node per
/// connection and passed with each of its operations; the reply carries it
/// back, merged. Each protocol keeps its own kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CausalContext {
    /// A session that has done nothing yet, or runs under `eventual`.
    #[default]
    Empty,
    /// COPS: the nearest dependencies: each write read since the last put, or that put.
    Dependencies(Vec<Dependency>),
    /// GentleRain: the newest version the session depends on, and the
    /// newest global stable time it has seen.
    Time { dependency: Version, stable: Version },
    /// CausalSpartan: per datacenter, the newest version the session
    /// depends on, and the newest stable time it has seen.
    Vector { dependency: Vec<Version>, stable: Vec<Version> },
}

/// How long COPS waits for the answer to a check within its datacenter
/// before it asks again, and a stream for an acknowledgement before it has
/// measured a round trip (then [`ResendTimer`] follows the round trip).
pub(crate) const RESEND_MS: Time = 250;
/// The bounds of a stream's resend interval: above a tick and a busy
/// moment of a loopback round trip; below what leaves a lost write
/// unnoticed for long.
const RESEND_MIN_MS: Time = 50;
const RESEND_MAX_MS: Time = 5_000;
/// Records a stream keeps unacknowledged for one datacenter before the
/// partition refuses writes (the copy there is cut off or far behind).
const OUTBOX_MAX: usize = 100_000;
/// Records a stream holds that arrived ahead of one it still waits for.
const EARLY_MAX: usize = 4096;
/// How far into its unacknowledged writes a stream looks for one due to be
/// resent.
const RESEND_SCAN: usize = 4096;
/// The most dependency checks, or answers, one COPS message carries.
pub(crate) const CHECKS_PER_MESSAGE: usize = 4096;
/// The most writes one resent message carries (well inside what a
/// receiver keeps of writes that arrive early).
const RESEND_COUNT_MAX: usize = 1024;
/// Stable times are gossiped to the partition's siblings this often.
const STABILIZE_MS: Time = 10;

/// A write as a partition ships it to its copies in the other datacenters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replicated {
    pub key: Bytes,
    pub version: Version,
    /// The node that took the write.
    pub origin: NodeId,
    /// `None`: a delete.
    pub value: Option<Bytes>,
    /// CausalSpartan: the write's dependency vector.
    pub vector: Vec<Version>,
    /// COPS: the write's nearest dependencies.
    pub dependencies: Vec<Dependency>,
}

/// Every causal protocol's messages; each protocol sends them under its own
/// family ([`Tagged`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GeoMessage {
    /// Writes `first..` of the sender's stream `epoch` to this partition;
    /// the stream holds every write from `oldest` on that is not yet
    /// acknowledged. `sent_at` is the sender's time, echoed back.
    Writes {
        epoch: Version,
        oldest: u64,
        first: u64,
        sent_at: Time,
        writes: Vec<Replicated>,
    },
    /// The copy that started at `copy` (its own epoch) has delivered
    /// stream `epoch` through `delivered` (send no more of those) and
    /// stored it through `stored` (drop those): a write delivered and not
    /// yet visible is held in memory, and is resent if the copy starts
    /// again before it stores it. `echo` is the `sent_at` of the message
    /// this acknowledgement answers at once (0: none, a later one).
    Ack {
        epoch: Version,
        copy: Version,
        delivered: u64,
        stored: u64,
        echo: Time,
    },
    /// The sender will stamp no write at or below `clock`, and sent its
    /// stream `epoch` through `through` before it said so; the stream
    /// holds every write from `oldest` on that is not yet acknowledged.
    Heartbeat {
        epoch: Version,
        oldest: u64,
        clock: Version,
        through: u64,
    },
    /// A sibling's newest time received from each datacenter.
    Stable {
        received: Vec<Version>,
    },
    /// COPS: answer each check with [`GeoMessage::DependenciesMet`] once
    /// the write its dependency names is committed at the receiving
    /// partition (at most [`CHECKS_PER_MESSAGE`]). `asker` is the asking
    /// partition's epoch: a restarted partition numbers its checks afresh,
    /// and an answer to a check of its previous life must not meet the
    /// check of this one that has the same number.
    CheckDependencies {
        asker: Version,
        checks: Vec<(u64, Dependency)>,
    },
    DependenciesMet {
        asker: Version,
        checks: Vec<u64>,
    },
    /// COPS: the sending copy of this partition has committed every write
    /// from the other datacenters stamped at or below `through`.
    Committed {
        through: Version,
    },
}

const WRITES: u8 = 1;
const ACK: u8 = 2;
const HEARTBEAT: u8 = 3;
const STABLE: u8 = 4;
const CHECK_DEPENDENCIES: u8 = 5;
const DEPENDENCIES_MET: u8 = 6;
const COMMITTED: u8 = 7;

fn put_dependency(out: &mut Vec<u8>, dependency: &Dependency) {
    put_bytes(out, &dependency.key);
    out.put_u64_le(dependency.version.0);
    out.put_u32_le(dependency.origin.0);
}

fn dependency(reader: &mut Reader) -> Result<Dependency, CodecError> {
    Ok(Dependency { key: reader.bytes()?, version: Version(reader.u64()?), origin: reader.node()? })
}

fn put_dependencies(out: &mut Vec<u8>, dependencies: &[Dependency]) {
    out.put_u32_le(dependencies.len() as u32);
    dependencies.iter().for_each(|each| put_dependency(out, each));
}

fn dependencies(reader: &mut Reader) -> Result<Vec<Dependency>, CodecError> {
    let count = reader.count(4 + 8 + 4)?;
    if count > CONTEXT_DEPENDENCIES_MAX {
        return Err(CodecError("more dependencies than a context holds"));
    }
    (0..count).map(|_| dependency(reader)).collect()
}

fn put_versions(out: &mut Vec<u8>, versions: &[Version]) {
    put_u64s(out, &versions.iter().map(|version| version.0).collect::<Vec<_>>());
}

fn versions(reader: &mut Reader) -> Result<Vec<Version>, CodecError> {
    Ok(reader.u64s()?.into_iter().map(Version).collect())
}

impl GeoMessage {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            GeoMessage::Writes { epoch, oldest, first, sent_at, writes } => {
                out.put_u8(WRITES);
                out.put_u64_le(epoch.0);
                out.put_u64_le(*oldest);
                out.put_u64_le(*first);
                out.put_u64_le(*sent_at);
                out.put_u32_le(writes.len() as u32);
                for write in writes {
                    put_bytes(out, &write.key);
                    out.put_u64_le(write.version.0);
                    out.put_u32_le(write.origin.0);
                    put_optional(out, &write.value);
                    put_versions(out, &write.vector);
                    put_dependencies(out, &write.dependencies);
                }
            }
            GeoMessage::Ack { epoch, copy, delivered, stored, echo } => {
                out.put_u8(ACK);
                out.put_u64_le(epoch.0);
                out.put_u64_le(copy.0);
                out.put_u64_le(*delivered);
                out.put_u64_le(*stored);
                out.put_u64_le(*echo);
            }
            GeoMessage::Heartbeat { epoch, oldest, clock, through } => {
                out.put_u8(HEARTBEAT);
                out.put_u64_le(epoch.0);
                out.put_u64_le(*oldest);
                out.put_u64_le(clock.0);
                out.put_u64_le(*through);
            }
            GeoMessage::Stable { received } => {
                out.put_u8(STABLE);
                put_versions(out, received);
            }
            GeoMessage::CheckDependencies { asker, checks } => {
                out.put_u8(CHECK_DEPENDENCIES);
                out.put_u64_le(asker.0);
                out.put_u32_le(checks.len() as u32);
                for (check, dependency) in checks {
                    out.put_u64_le(*check);
                    put_dependency(out, dependency);
                }
            }
            GeoMessage::DependenciesMet { asker, checks } => {
                out.put_u8(DEPENDENCIES_MET);
                out.put_u64_le(asker.0);
                put_u64s(out, checks);
            }
            GeoMessage::Committed { through } => {
                out.put_u8(COMMITTED);
                out.put_u64_le(through.0);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            WRITES => {
                let (epoch, oldest, first) = (Version(reader.u64()?), reader.u64()?, reader.u64()?);
                let sent_at = reader.u64()?;
                // A key's length, version, origin, a flag, two counts.
                let count = reader.count(4 + 8 + 4 + 1 + 4 + 4)?;
                let writes = (0..count)
                    .map(|_| {
                        Ok(Replicated {
                            key: reader.bytes()?,
                            version: Version(reader.u64()?),
                            origin: reader.node()?,
                            value: reader.optional()?,
                            vector: versions(reader)?,
                            dependencies: dependencies(reader)?,
                        })
                    })
                    .collect::<Result<_, CodecError>>()?;
                GeoMessage::Writes { epoch, oldest, first, sent_at, writes }
            }
            ACK => GeoMessage::Ack {
                epoch: Version(reader.u64()?),
                copy: Version(reader.u64()?),
                delivered: reader.u64()?,
                stored: reader.u64()?,
                echo: reader.u64()?,
            },
            HEARTBEAT => GeoMessage::Heartbeat {
                epoch: Version(reader.u64()?),
                oldest: reader.u64()?,
                clock: Version(reader.u64()?),
                through: reader.u64()?,
            },
            STABLE => GeoMessage::Stable { received: versions(reader)? },
            CHECK_DEPENDENCIES => {
                let asker = Version(reader.u64()?);
                // A check's number, a key's length, a version, an origin.
                let count = reader.count(8 + 4 + 8 + 4)?;
                if count > CHECKS_PER_MESSAGE {
                    return Err(CodecError("more dependency checks than a message carries"));
                }
                let checks =
                    (0..count)
                        .map(|_| Ok((reader.u64()?, dependency(reader)?)))
                        .collect::<Result<_, CodecError>>()?;
                GeoMessage::CheckDependencies { asker, checks }
            }
            DEPENDENCIES_MET => {
                let asker = Version(reader.u64()?);
                let checks = reader.u64s()?;
                if checks.len() > CHECKS_PER_MESSAGE {
                    return Err(CodecError("more dependency checks than a message carries"));
                }
                GeoMessage::DependenciesMet { asker, checks }
            }
            COMMITTED => GeoMessage::Committed { through: Version(reader.u64()?) },
            _ => return Err(CodecError("unknown causal message")),
        })
    }
}

/// A [`GeoMessage`] under one protocol's family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tagged<const FAMILY: u8>(pub GeoMessage);

impl<const FAMILY: u8> Message for Tagged<FAMILY> {
    const FAMILY: Family = Family(FAMILY);

    fn encode(&self, out: &mut Vec<u8>) {
        self.0.encode(out);
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        GeoMessage::decode(reader).map(Tagged)
    }
}

/// How many writes a causal protocol's `message` carries (0: another
/// message, or not a causal protocol's): for measurements.
pub fn writes_carried(message: &PeerMessage) -> usize {
    fn carried<const FAMILY: u8>(message: &PeerMessage) -> Option<usize> {
        match message.open::<Tagged<FAMILY>>()? {
            Ok(Tagged(GeoMessage::Writes { writes, .. })) => Some(writes.len()),
            _ => Some(0),
        }
    }
    carried::<{ eventual::FAMILY }>(message)
        .or_else(|| carried::<{ cops::FAMILY }>(message))
        .or_else(|| carried::<{ gentle_rain::FAMILY }>(message))
        .or_else(|| carried::<{ spartan::FAMILY }>(message))
        .unwrap_or(0)
}

/// When a stream resends: once a write has waited a round trip and four
/// times its deviation without being acknowledged, both smoothed over the
/// round trips measured (RFC 6298's retransmission timer). A round trip is
/// measured from the time a message of writes carries and the copy's
/// immediate acknowledgement echoes (RFC 7323's timestamps), so that an
/// acknowledgement of a write sent twice still measures one sending.
#[derive(Debug, Default)]
struct ResendTimer {
    smoothed: Option<Time>,
    deviation: Time,
}

impl ResendTimer {
    fn measured(&mut self, round_trip: Time) {
        match self.smoothed {
            None => (self.smoothed, self.deviation) = (Some(round_trip), round_trip / 2),
            Some(smoothed) => {
                self.deviation = (3 * self.deviation + smoothed.abs_diff(round_trip)) / 4;
                self.smoothed = Some((7 * smoothed + round_trip) / 8);
            }
        }
    }

    /// How long a write waits for its acknowledgement before it is resent.
    fn interval(&self) -> Time {
        match self.smoothed {
            None => RESEND_MS,
            Some(smoothed) => smoothed.saturating_add(4 * self.deviation).clamp(RESEND_MIN_MS, RESEND_MAX_MS),
        }
    }
}

/// A write a stream holds until the copy has stored it.
#[derive(Debug)]
struct Unacked {
    write: Replicated,
    /// When it was last sent (`None`: queued, not sent yet).
    sent: Option<Time>,
}

/// The writes a partition ships to its copy in one other datacenter,
/// numbered from 1, kept until acknowledged and each resent once it has
/// waited a [`ResendTimer`] interval since it was last sent: the protocols
/// count on each copy receiving a partition's writes once and in order (DKVF's
/// communication component gives its protocols the same), on a network
/// that loses, repeats and reorders. A stream is named by its epoch, the
/// sender's clock when it began: a partition that starts again (a process
/// restarted over its data) begins a new stream, which the receiver takes
/// from its oldest unacknowledged write rather than for repeats of the old.
#[derive(Debug, Default)]
struct Outbox {
    epoch: Version,
    /// Each write not yet stored by the copy.
    unacked: VecDeque<Unacked>,
    /// The number of `unacked`'s first write.
    first: u64,
    /// The copy has delivered every write through this one: they are kept
    /// but not resent.
    delivered: u64,
    /// The copy's own epoch, as its acknowledgements name it: a newer one
    /// (it started again and lost what it held) has everything from
    /// `first` resent.
    copy: Version,
    /// The newest write pushed, or the horizon a partition that started
    /// again recovered from: writes are pushed in the order they are
    /// stamped.
    last_pushed: Version,
    timer: ResendTimer,
}

impl Outbox {
    /// The number the next write pushed will get.
    fn next(&self) -> u64 {
        self.first.max(1) + self.unacked.len() as u64
    }

    fn is_full(&self) -> bool {
        self.unacked.len() >= OUTBOX_MAX
    }

    /// Queues `write`; the message that sends it now.
    fn push(&mut self, write: Replicated, now: Time) -> GeoMessage {
        let number = self.queue(write.clone());
        self.unacked.back_mut().expect("just queued").sent = Some(now);
        GeoMessage::Writes {
            epoch: self.epoch,
            oldest: self.first,
            first: number,
            sent_at: now,
            writes: vec![write],
        }
    }

    /// Queues `write` to be sent on the next ticks; its number.
    fn queue(&mut self, write: Replicated) -> u64 {
        assert!(
            write.version > self.last_pushed,
            "a stream carries its writes in the order they were stamped"
        );
        self.first = self.first.max(1);
        let number = self.next();
        self.last_pushed = write.version;
        self.unacked.push_back(Unacked { write, sent: None });
        number
    }

    /// Every write of this partition's stamped up to the result is stored
    /// by the copy.
    fn stored_up_to(&self) -> Version {
        match self.unacked.front() {
            Some(oldest) => Version(oldest.write.version.0.saturating_sub(1)),
            None => self.last_pushed,
        }
    }

    /// The copy `copy` has delivered this stream through `delivered` and
    /// stored it through `stored`; said at once on a message sent at
    /// `echo` (0: later), it measures the round trip to `now`.
    fn acknowledged(
        &mut self,
        epoch: Version,
        copy: Version,
        (delivered, stored, echo): (u64, u64, Time),
        now: Time,
    ) {
        if epoch != self.epoch || copy < self.copy {
            return; // of an earlier stream of this partition, or of the copy before it started again
        }
        if copy > self.copy {
            // What the copy held and had not stored is lost with it.
            self.copy = copy;
            self.delivered = 0;
        }
        if echo != 0 {
            self.timer.measured(now.saturating_sub(echo));
        }
        while self.first <= stored && self.unacked.pop_front().is_some() {
            self.first += 1;
        }
        // A copy cannot have delivered what was never sent.
        self.delivered = self.delivered.max(delivered.max(stored).min(self.sent_through()));
    }

    /// The first run of writes that have waited long enough, as much of it
    /// as one message carries: called every tick, so a backlog (after a
    /// cut-off) drains a message a tick, not a message a round trip.
    /// Writes the copy has delivered are held there, not resent; while it
    /// holds them, an empty message asks every resend interval for an
    /// acknowledgement, so that a copy that started again (and lost them)
    /// says so even when nothing else is sent to it.
    fn resend(&mut self, now: Time) -> Option<GeoMessage> {
        let interval = self.timer.interval();
        let due = |sent: Option<Time>| sent.is_none_or(|sent| sent + interval <= now);
        let held_there = ((self.delivered + 1).saturating_sub(self.first) as usize).min(self.unacked.len());
        let Some(position) =
            self.unacked.iter().skip(held_there).take(RESEND_SCAN).position(|unacked| due(unacked.sent))
        else {
            let oldest = self.unacked.front_mut().filter(|_| held_there > 0)?;
            if !due(oldest.sent) {
                return None;
            }
            oldest.sent = Some(now);
            return Some(GeoMessage::Writes {
                epoch: self.epoch,
                oldest: self.first,
                first: self.next(),
                sent_at: now,
                writes: Vec::new(),
            });
        };
        let start = held_there + position;
        let mut batch = BatchBytes::default();
        let mut writes = Vec::new();
        for unacked in self.unacked.iter_mut().skip(start) {
            let bytes = unacked.write.key.len() + unacked.write.value.as_ref().map_or(0, Bytes::len);
            if !due(unacked.sent) || writes.len() == RESEND_COUNT_MAX || !batch.admits(bytes) {
                break;
            }
            unacked.sent = Some(now);
            writes.push(unacked.write.clone());
        }
        Some(GeoMessage::Writes {
            epoch: self.epoch,
            oldest: self.first,
            first: self.first + start as u64,
            sent_at: now,
            writes,
        })
    }

    /// The last write this stream has sent.
    fn sent_through(&self) -> u64 {
        self.next() - 1
    }
}

/// The writes a partition receives from its copy in one other datacenter,
/// handed on once each, in order, and the ones handed on that the
/// protocol has not stored yet.
#[derive(Debug, Default)]
struct Inbox {
    /// The stream it takes (a message of an earlier one is ignored).
    epoch: Version,
    delivered: u64,
    early: BTreeMap<u64, Replicated>,
    /// The numbers of the writes delivered and not yet stored (COPS stores
    /// them out of order, each once its dependencies are met).
    held: BTreeSet<u64>,
    /// What the last acknowledgement said, (delivered, stored), and when
    /// (`None`: nothing yet of this stream, acknowledged at the next tick).
    acked: Option<(u64, u64)>,
    acked_at: Time,
    /// The sender's time on the message last received, echoed by the
    /// acknowledgement that answers it at once.
    echo: Time,
}

impl Inbox {
    /// Takes writes `first..` of stream `epoch`, which holds every write
    /// from `oldest` on not yet acknowledged; the writes now deliverable, in
    /// order, or `None` for a message of an earlier stream.
    fn receive(
        &mut self,
        (epoch, oldest, first, sent_at): (Version, u64, u64, Time),
        writes: Vec<Replicated>,
    ) -> Option<Vec<(u64, Replicated)>> {
        if !self.take_up(epoch, oldest) {
            return None;
        }
        self.echo = sent_at;
        for (number, write) in (first..).zip(writes) {
            if number > self.delivered && (self.early.len() < EARLY_MAX || number == self.delivered + 1) {
                self.early.entry(number).or_insert(write);
            }
        }
        let mut ready = Vec::new();
        while let Some(write) = self.early.remove(&(self.delivered + 1)) {
            self.delivered += 1;
            self.held.insert(self.delivered);
            ready.push((self.delivered, write));
        }
        Some(ready)
    }

    /// Every write of the stream through this one is stored.
    fn stored_through(&self) -> u64 {
        self.held.first().map_or(self.delivered, |oldest_held| oldest_held - 1)
    }

    /// The acknowledgement of what this inbox has delivered and stored, on
    /// behalf of the copy that started at `copy`.
    fn acknowledge(&mut self, copy: Version, now: Time) -> GeoMessage {
        let (delivered, stored) = (self.delivered, self.stored_through());
        self.acked = Some((delivered, stored));
        self.acked_at = now;
        let echo = std::mem::take(&mut self.echo);
        GeoMessage::Ack { epoch: self.epoch, copy, delivered, stored, echo }
    }

    /// Whether to acknowledge on a tick: what the inbox has delivered or
    /// stored moved since it last said, or a while has passed (an
    /// acknowledgement lost is not resent otherwise: the sender does not
    /// resend what was delivered).
    fn acknowledgement_due(&self, now: Time) -> bool {
        self.epoch != Version::default()
            && (self.acked != Some((self.delivered, self.stored_through()))
                || now >= self.acked_at + RESEND_MS)
    }

    /// Whether a message of stream `epoch`, which holds every write from
    /// `oldest` on not yet stored here, is of the stream this inbox takes:
    /// a new stream (the sender, or this partition, started again, or
    /// nothing of it has arrived yet) is taken up from `oldest`, one of an
    /// earlier stream is not. Writes below `oldest` are in this engine
    /// already (only this copy's acknowledgements drop them, and a copy
    /// that started again has them from before), so the inbox moves past
    /// them, holding and awaiting none of them.
    fn take_up(&mut self, epoch: Version, oldest: u64) -> bool {
        if epoch > self.epoch {
            *self = Inbox { epoch, delivered: oldest.saturating_sub(1), ..Inbox::default() };
        }
        if epoch != self.epoch {
            return false;
        }
        if oldest > self.delivered + 1 {
            self.delivered = oldest - 1;
            self.early = self.early.split_off(&oldest);
        }
        self.held = self.held.split_off(&oldest);
        true
    }
}

/// Where a write delivered to a partition sits in the stream it came by:
/// handed back to [`Streams::stored`] once the write is stored, so that
/// the copy that sent it may drop it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Receipt {
    datacenter: usize,
    epoch: Version,
    number: u64,
}

/// The streams of one partition to and from its copies in the other
/// datacenters, and the newest time received from each: what GentleRain
/// calls the version vector.
#[derive(Debug, Default)]
struct Streams {
    /// This partition's start: its own streams' epoch, and the name its
    /// acknowledgements give it.
    epoch: Version,
    outboxes: Vec<Outbox>,
    inboxes: Vec<Inbox>,
    /// By datacenter: every write from there up to this version has
    /// arrived (this datacenter's entry is unused).
    received: Vec<Version>,
}

impl Streams {
    /// Streams to and from `datacenters` datacenters, this partition's own
    /// named `epoch`.
    fn new(datacenters: usize, epoch: Version) -> Self {
        Self {
            epoch,
            outboxes: (0..datacenters).map(|_| Outbox { epoch, ..Outbox::default() }).collect(),
            inboxes: (0..datacenters).map(|_| Inbox::default()).collect(),
            received: vec![Version::default(); datacenters],
        }
    }

    /// Whether a write would overflow some datacenter's outbox.
    fn backlogged(&self, place: &GeoPlace) -> bool {
        self.outboxes.iter().enumerate().any(|(at, outbox)| at != place.datacenter && outbox.is_full())
    }

    /// Ships `write` to every other datacenter.
    fn ship(&mut self, place: &GeoPlace, write: Replicated, now: Time) -> Vec<(NodeId, GeoMessage)> {
        let mut sends = Vec::new();
        for (datacenter, outbox) in self.outboxes.iter_mut().enumerate() {
            if datacenter != place.datacenter {
                sends.push((place.replicas[datacenter], outbox.push(write.clone(), now)));
            }
        }
        sends
    }

    /// Takes the writes a message from `from` carries: the writes now
    /// delivered in order, each with the receipt to hand back once it is
    /// stored, and the acknowledgement to send back.
    fn receive(
        &mut self,
        place: &GeoPlace,
        from: NodeId,
        (epoch, oldest, first, sent_at): (Version, u64, u64, Time),
        writes: Vec<Replicated>,
        now: Time,
    ) -> Option<(Vec<(Receipt, Replicated)>, GeoMessage)> {
        let datacenter = place.datacenter_of(from)?;
        let inbox = &mut self.inboxes[datacenter];
        let ready = inbox.receive((epoch, oldest, first, sent_at), writes)?;
        if let Some((_, last)) = ready.last() {
            self.received[datacenter] = self.received[datacenter].max(last.version);
        }
        let ack = inbox.acknowledge(self.epoch, now);
        let receipts =
            ready.into_iter().map(|(number, write)| (Receipt { datacenter, epoch, number }, write)).collect();
        Some((receipts, ack))
    }

    /// The write `receipt` names is stored: its sender may drop it once
    /// every earlier one is too.
    fn stored(&mut self, receipt: Receipt) {
        let inbox = &mut self.inboxes[receipt.datacenter];
        if inbox.epoch == receipt.epoch {
            inbox.held.remove(&receipt.number);
        }
    }

    fn acknowledged(
        &mut self,
        place: &GeoPlace,
        from: NodeId,
        ack: (Version, Version, u64, u64, Time),
        now: Time,
    ) {
        let (epoch, copy, delivered, stored, echo) = ack;
        if let Some(datacenter) = place.datacenter_of(from) {
            self.outboxes[datacenter].acknowledged(epoch, copy, (delivered, stored, echo), now);
        }
    }

    /// A peer's heartbeat: its clock counts as received once its stream
    /// has arrived through what it had sent by then (a stream none of whose
    /// writes has arrived yet is taken up from its oldest held, so that an
    /// idle copy does not hold the stable times back).
    fn heartbeat(
        &mut self,
        place: &GeoPlace,
        from: NodeId,
        (epoch, oldest, through): (Version, u64, u64),
        clock: Version,
    ) {
        if let Some(datacenter) = place.datacenter_of(from) {
            let inbox = &mut self.inboxes[datacenter];
            if inbox.take_up(epoch, oldest) && inbox.delivered >= through {
                self.received[datacenter] = self.received[datacenter].max(clock);
            }
        }
    }

    /// On a tick: what to resend, and, given a `clock`, a heartbeat with it
    /// for each other datacenter (sent every tick: it is what lets the
    /// stable time pass an idle partition); and what has been stored since
    /// the last acknowledgement.
    fn on_tick(&mut self, place: &GeoPlace, clock: Option<Version>, now: Time) -> Vec<(NodeId, GeoMessage)> {
        let mut sends = Vec::new();
        for (datacenter, (outbox, inbox)) in self.outboxes.iter_mut().zip(&mut self.inboxes).enumerate() {
            if datacenter == place.datacenter {
                continue;
            }
            let to = place.replicas[datacenter];
            sends.extend(outbox.resend(now).map(|message| (to, message)));
            if let Some(clock) = clock {
                let (epoch, oldest, through) = (outbox.epoch, outbox.first, outbox.sent_through());
                sends.push((to, GeoMessage::Heartbeat { epoch, oldest, clock, through }));
            }
            if inbox.acknowledgement_due(now) {
                sends.push((to, inbox.acknowledge(self.epoch, now)));
            }
        }
        sends
    }

    /// Every write this partition took stamped up to the result is stored
    /// in every other datacenter.
    fn horizon(&self, place: &GeoPlace) -> Version {
        let others = self.outboxes.iter().enumerate().filter(|(at, _)| *at != place.datacenter);
        others.map(|(_, outbox)| outbox.stored_up_to()).min().unwrap_or_default()
    }

    /// Whether every write shipped has been stored by the copies.
    fn drained(&self) -> bool {
        self.outboxes.iter().all(|outbox| outbox.unacked.is_empty())
    }
}

/// The newest times each sibling partition has said it received from each
/// datacenter, and the minimum over them: the datacenter's stable times.
#[derive(Debug, Default)]
struct Stabilizer {
    /// By partition, by datacenter.
    siblings: Vec<Vec<Version>>,
    last_sent: Time,
}

impl Stabilizer {
    fn new(place: &GeoPlace) -> Self {
        Self {
            siblings: vec![vec![Version::default(); place.datacenters()]; place.partitions()],
            last_sent: 0,
        }
    }

    fn heard(&mut self, place: &GeoPlace, from: NodeId, received: Vec<Version>) {
        let Some(partition) = place.partition_of_node(from) else { return };
        if received.len() != place.datacenters() {
            tracing::warn!(%from, "dropped a stable-time message for another number of datacenters");
            return;
        }
        for (known, heard) in self.siblings[partition].iter_mut().zip(received) {
            *known = (*known).max(heard);
        }
    }

    /// By datacenter, the newest time every partition of this datacenter
    /// has received from there (this datacenter's entry is unused).
    fn stable(&mut self, place: &GeoPlace, own: &[Version]) -> Vec<Version> {
        self.siblings[place.partition] = own.to_vec();
        (0..place.datacenters())
            .map(|datacenter| {
                self.siblings.iter().map(|received| received[datacenter]).min().unwrap_or_default()
            })
            .collect()
    }

    /// The messages that tell the siblings this partition's received times,
    /// when it is time to.
    fn gossip(&mut self, place: &GeoPlace, own: &[Version], now: Time) -> Vec<(NodeId, GeoMessage)> {
        if now < self.last_sent + STABILIZE_MS {
            return Vec::new();
        }
        self.last_sent = now;
        let message = GeoMessage::Stable { received: own.to_vec() };
        place
            .siblings
            .iter()
            .enumerate()
            .filter(|(partition, _)| *partition != place.partition)
            .map(|(_, sibling)| (*sibling, message.clone()))
            .collect()
    }
}

/// A version as a causal partition stores it: a record of the shared codec
/// (version, origin, tombstone, CausalSpartan's dependency vector and, for
/// a write taken here, COPS's dependencies: only a partition's own writes
/// are shipped again from its engine), so that the node reads a causal
/// table's values as any other's.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stored {
    version: Version,
    origin: NodeId,
    value: Option<Bytes>,
    vector: Vec<Version>,
    dependencies: Vec<Dependency>,
}

/// The most datacenters a dependency vector names.
const DATACENTERS_MAX: usize = crate::record::VECTOR_MAX;

impl Stored {
    /// `write` as a copy stores it, without its dependencies.
    fn of(write: &Replicated) -> Self {
        Self {
            version: write.version,
            origin: write.origin,
            value: write.value.clone(),
            vector: write.vector.clone(),
            dependencies: Vec::new(),
        }
    }

    fn encode(&self) -> Bytes {
        let mut record = Record::new(self.version, self.origin, self.value.clone());
        record.causal = CausalMetadata::of(self.vector.clone(), self.dependencies.clone());
        record.encode()
    }

    fn decode(raw: Bytes) -> Result<Self, OperationError> {
        let record = Record::decode(raw)?;
        let value = record.visible().cloned();
        let CausalMetadata { vector, dependencies } = record.causal.map(|causal| *causal).unwrap_or_default();
        Ok(Self { version: record.version, origin: record.origin, value, vector, dependencies })
    }

    /// Whether this version wins over `other`: last writer wins, the
    /// origin breaking ties, and at one version and origin a tombstone
    /// over the value it retires ([`Partition::retire`]), as
    /// [`Record::rank`] ranks them.
    fn outranks(&self, other: &Stored) -> bool {
        self.rank() > other.rank()
    }

    fn rank(&self) -> (Version, NodeId, bool) {
        (self.version, self.origin, self.value.is_none())
    }
}

/// The version `key` holds, if any.
fn read(engine: &dyn Engine, key: &[u8]) -> Result<Option<Stored>, OperationError> {
    engine.get(key)?.map(Stored::decode).transpose()
}

/// The value a causal partition shows a reader of `key` (`None`: none, a
/// delete, or no causal record): for measurements.
pub fn held_value(engine: &dyn Engine, key: &[u8]) -> Option<Bytes> {
    read(engine, key).ok().flatten().and_then(|held| held.value)
}

/// Stores `version` at `key` unless what it holds outranks it; whether it
/// did.
fn store(engine: &dyn Engine, key: &Bytes, version: &Stored) -> Result<bool, OperationError> {
    store_over(engine, key, version, read(engine, key)?)
}

/// [`store`], given what `key` holds.
fn store_over(
    engine: &dyn Engine,
    key: &Bytes,
    version: &Stored,
    held: Option<Stored>,
) -> Result<bool, OperationError> {
    if held.is_some_and(|held| held.outranks(version) || held == *version) {
        return Ok(false);
    }
    engine.put(key, version.encode())?;
    Ok(true)
}

/// What a client's operation asks of a causal partition.
enum Call {
    Get,
    /// A set, or a delete (`None`).
    Write(Option<Bytes>),
    /// A delete of the version (version, origin) only, if the key still
    /// holds it: the expiry sweep's ([`Partition::retire`]).
    Retire((Version, NodeId)),
}

/// Why a partition asks a client to retry before a view has placed it.
const UNPLACED: &str = "this partition has no place yet";

/// Why a partition that started over its data asks readers to retry.
const CATCHING_UP: &str =
    "this partition restarted and is receiving again the writes from other datacenters it held unseen";

/// Why a causal partition refuses a strong read: no copy here is
/// linearizable.
const NOT_STRONG: &str = "the causal modes serve no strong reads; ask for eventual or causal ones";

/// Why a causal partition refuses the operations it does not take.
const SINGLE_KEYS_ONLY: &str =
    "the causal modes take gets, sets and deletes of one key; batches, read-modify-writes and conditional writes other than a retiring delete are not built for them";

/// Why a partition refuses a context that names a time far ahead of its
/// clock: taking it would move the partition's clock, and every version it
/// stamps, that far.
const CONTEXT_AHEAD: &str = "the causal context names a time further ahead of this clock than clocks drift";

/// The most dependencies a COPS context holds, and so a token carries: a
/// read that would take a session past it is asked to retry until the
/// other datacenters confirm enough of them to drop (only while they are
/// cut off: they are dropped within a round trip otherwise).
pub const CONTEXT_DEPENDENCIES_MAX: usize = 4096;

/// Why two COPS contexts cannot be merged.
const CONTEXTS_TOO_LARGE: &str = "the two contexts together depend on more writes than a context holds";

impl CausalContext {
    /// The context of a session that did what both did: each dependency of
    /// either, the newer of each time. Contexts of two protocols do not mix.
    pub fn merged(self, other: CausalContext) -> Result<CausalContext, &'static str> {
        use CausalContext::*;
        Ok(match (self, other) {
            (Empty, other) | (other, Empty) => other,
            (Dependencies(mut mine), Dependencies(theirs)) => {
                for dependency in theirs {
                    if !mine.contains(&dependency) {
                        mine.push(dependency);
                    }
                }
                if mine.len() > CONTEXT_DEPENDENCIES_MAX {
                    return Err(CONTEXTS_TOO_LARGE);
                }
                Dependencies(mine)
            }
            (Time { dependency, stable }, Time { dependency: other_dependency, stable: other_stable }) => {
                Time { dependency: dependency.max(other_dependency), stable: stable.max(other_stable) }
            }
            (Vector { mut dependency, mut stable }, Vector { dependency: theirs, stable: their_stable })
                if dependency.len() == theirs.len() && stable.len() == their_stable.len() =>
            {
                dependency.iter_mut().zip(theirs).for_each(|(mine, theirs)| *mine = (*mine).max(theirs));
                stable.iter_mut().zip(their_stable).for_each(|(mine, theirs)| *mine = (*mine).max(theirs));
                Vector { dependency, stable }
            }
            _ => return Err(FOREIGN_CONTEXT),
        })
    }

    /// The context as a token carries it (before the token's seal).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            CausalContext::Empty => out.put_u8(0),
            CausalContext::Dependencies(dependencies) => {
                out.put_u8(1);
                put_dependencies(&mut out, dependencies);
            }
            CausalContext::Time { dependency, stable } => {
                out.put_u8(2);
                out.put_u64_le(dependency.0);
                out.put_u64_le(stable.0);
            }
            CausalContext::Vector { dependency, stable } => {
                out.put_u8(3);
                put_versions(&mut out, dependency);
                put_versions(&mut out, stable);
            }
        }
        out
    }

    /// A context [`Self::encode`] wrote: bounded, and whole.
    pub fn decode(bytes: Bytes) -> Result<CausalContext, CodecError> {
        let mut reader = Reader::new(bytes);
        let context = match reader.u8()? {
            0 => CausalContext::Empty,
            1 => {
                let dependencies = dependencies(&mut reader)?;
                if dependencies.len() > CONTEXT_DEPENDENCIES_MAX {
                    return Err(CodecError("a causal context with too many dependencies"));
                }
                CausalContext::Dependencies(dependencies)
            }
            2 => CausalContext::Time { dependency: Version(reader.u64()?), stable: Version(reader.u64()?) },
            3 => {
                let (dependency, stable) = (versions(&mut reader)?, versions(&mut reader)?);
                if dependency.len() > DATACENTERS_MAX || stable.len() > DATACENTERS_MAX {
                    return Err(CodecError("a causal context with too many datacenters"));
                }
                CausalContext::Vector { dependency, stable }
            }
            _ => return Err(CodecError("an unknown kind of causal context")),
        };
        reader.finish()?;
        Ok(context)
    }

    /// The newest time the context names.
    fn newest(&self) -> Version {
        match self {
            CausalContext::Empty => Version::default(),
            CausalContext::Dependencies(dependencies) => {
                dependencies.iter().map(|dependency| dependency.version).max().unwrap_or_default()
            }
            CausalContext::Time { dependency, stable } => (*dependency).max(*stable),
            CausalContext::Vector { dependency, stable } => {
                dependency.iter().chain(stable).copied().max().unwrap_or_default()
            }
        }
    }
}

/// An operation's key, what it asks, and its session's context (`None`
/// outside a causal session: it runs with an empty context and gets a
/// plain reply), checked against the partition's clock at `now`.
fn call_of(operation: Operation, now: Time) -> Result<(Bytes, Call, Option<CausalContext>), OperationError> {
    match operation {
        Operation::Causal { context, .. } if context.newest().physical_ms() > now + VERSION_AHEAD_MAX_MS => {
            Err(OperationError::Causal(CONTEXT_AHEAD))
        }
        Operation::Causal { key, write, context } => {
            let call = match write {
                None => Call::Get,
                Some(Write::Put(value)) => Call::Write(Some(value)),
                Some(Write::Delete) => Call::Write(None),
            };
            Ok((key, call, Some(context)))
        }
        Operation::Get { key, consistency: Consistency::Eventual } => Ok((key, Call::Get, None)),
        Operation::Get { consistency: Consistency::Strong, .. } => Err(OperationError::Causal(NOT_STRONG)),
        Operation::Put { key, value } => Ok((key, Call::Write(Some(value)), None)),
        Operation::Delete { key } => Ok((key, Call::Write(None), None)),
        Operation::WriteIf { key, expected: Some(expected), write: Write::Delete } => {
            Ok((key, Call::Retire(expected), None))
        }
        _ => Err(OperationError::Causal(SINGLE_KEYS_ONLY)),
    }
}

/// A causal session gets its context back with the value; others get the
/// plain reply.
fn reply_for(call: &Call, causal: bool, value: Option<Bytes>, context: CausalContext) -> ClientReply {
    match (causal, call) {
        (true, _) => ClientReply::Causal { value, context },
        (false, Call::Get) => ClientReply::Value(value),
        (false, Call::Write(_) | Call::Retire(_)) => ClientReply::Written,
    }
}

/// Why a partition refuses a context of another protocol's kind (a token
/// made under another mode).
const FOREIGN_CONTEXT: &str = "the causal context was made by another causal mode";

/// What every causal partition keeps: who it is, its engine, its place once
/// a view gave it, its streams to the other datacenters and its clock.
struct Partition {
    me: NodeId,
    engine: Arc<dyn Engine>,
    place: Option<GeoPlace>,
    streams: Streams,
    clock: Hlc,
    /// The horizon last kept in the engine ([`horizon_key`]), and when.
    horizon_kept: Version,
    horizon_kept_at: Time,
    /// Set when the partition started over data: the writes from elsewhere
    /// it held unstored were lost with the process, so until every other
    /// datacenter's stream has been received up to this time (the senders
    /// resend them first), it serves no reads that count on a stable time.
    catching_up_from: Option<Version>,
    /// Writes this partition took and then overwrote before every copy
    /// had stored them, kept in the engine (under [`superseded_key`]) until
    /// the horizon passes them, by version: a restart ships them again
    /// too, so that the stream it rebuilds skips none of its writes.
    superseded: BTreeMap<Version, Bytes>,
    /// A deliberately broken variant for the checker's tests: the writes a
    /// restart ships again lose their COPS dependencies.
    #[cfg(feature = "broken")]
    broken_recover_without_dependencies: bool,
    /// A deliberately broken variant for the checker's tests: the expiry
    /// sweep's retire is a delete stamped now, and shipped.
    #[cfg(feature = "broken")]
    broken_retires_with_a_delete: bool,
}

/// Where a partition keeps its horizon: every write it took stamped up to
/// it is stored in every other datacenter, so a partition that starts
/// again over its data ships again only what it took after. It is kept as
/// a record of that version (an empty value), as every value of the
/// engine is, so that the node's views of the table read it as one.
fn horizon_key() -> Bytes {
    tessera_engine::reserved::named("causal-horizon")
}

/// Where a partition keeps the version `version` of `key` it overwrote
/// before every copy had stored it.
fn superseded_key(key: &[u8], version: Version) -> Vec<u8> {
    let mut suffix = SUPERSEDED_TAG.to_vec();
    suffix.extend_from_slice(&version.0.to_be_bytes());
    tessera_engine::reserved::owned(key, &suffix)
}

const SUPERSEDED_TAG: &[u8] = b"causal-superseded:";

/// The key and version a [`superseded_key`] names.
fn parse_superseded_key(key: &[u8]) -> Option<(&[u8], Version)> {
    let (owner, suffix) = tessera_engine::reserved::owner(key)?;
    let version = suffix.strip_prefix(SUPERSEDED_TAG)?;
    Some((owner, Version(u64::from_be_bytes(version.try_into().ok()?))))
}

/// How often a partition keeps its horizon, when it has moved.
const HORIZON_KEEP_MS: Time = 1_000;
/// Records a recovering partition reads from its engine at a time.
const RECOVERY_PAGE: usize = 1024;

impl Partition {
    fn new(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self {
            me,
            engine,
            place: None,
            streams: Streams::default(),
            clock: Hlc::default(),
            horizon_kept: Version::default(),
            horizon_kept_at: 0,
            catching_up_from: None,
            superseded: BTreeMap::new(),
            #[cfg(feature = "broken")]
            broken_recover_without_dependencies: false,
            #[cfg(feature = "broken")]
            broken_retires_with_a_delete: false,
        }
    }

    /// Takes the place a view gives, the first time: whether it was new.
    /// A partition does not move (a layout change is not built). A
    /// partition that starts over its data queues for every other
    /// datacenter the writes it took past its horizon, oldest first, before
    /// it serves: its outboxes died with the process that held them.
    fn placed_by(&mut self, view: &ShardView, now: Time) -> bool {
        let Some(place) = view.geo.as_ref() else { return false };
        if !place.is_well_formed()
            || place.siblings[place.partition] != self.me
            || place.datacenters() > DATACENTERS_MAX
        {
            tracing::warn!(replica = %self.me, "ignored a causal place that does not name this node once");
            return false;
        }
        match &self.place {
            Some(held) if held != place => {
                tracing::warn!(replica = %self.me, "ignored a new causal place: partitions do not move");
                false
            }
            Some(_) => false,
            None => {
                let (horizon, recovered, held_data) = match self.recover(place, now) {
                    Ok(recovered) => recovered,
                    Err(error) => {
                        tracing::error!(replica = %self.me, %error, "a causal partition could not read back the writes it took; it stays unplaced");
                        return false;
                    }
                };
                let epoch = self.clock.tick(now);
                self.streams = Streams::new(place.datacenters(), epoch);
                self.catching_up_from = held_data.then_some(epoch);
                for (datacenter, outbox) in self.streams.outboxes.iter_mut().enumerate() {
                    if datacenter != place.datacenter {
                        outbox.last_pushed = horizon;
                        for write in &recovered {
                            outbox.queue(write.clone());
                        }
                    }
                }
                if !recovered.is_empty() {
                    tracing::info!(replica = %self.me, writes = recovered.len(), "a causal partition ships again the writes it took past its horizon");
                }
                (self.horizon_kept, self.horizon_kept_at) = (horizon, now);
                self.place = Some(place.clone());
                true
            }
        }
    }

    /// The horizon kept in the engine, the writes of this partition's
    /// engine that this node took past it, oldest first, and whether the
    /// engine held any write of this partition; the clock moves past every
    /// version read, so that no later write is stamped below one already
    /// stored.
    fn recover(
        &mut self,
        place: &GeoPlace,
        now: Time,
    ) -> Result<(Version, Vec<Replicated>, bool), OperationError> {
        // A horizon that does not read as one ships everything again.
        let horizon = self
            .engine
            .get(&horizon_key())?
            .and_then(|raw| Record::decode(raw).ok())
            .map_or(Version::default(), |record| record.version);
        self.clock.observe(horizon, now);
        let mut recovered = Vec::new();
        let mut held_data = false;
        let mut passed = Vec::new();
        let mut cursor = ScanCursor::start();
        loop {
            let page = self.engine.scan(&KeyRange::all(), &cursor, RECOVERY_PAGE)?;
            for (key, raw) in page.entries {
                // A client key's record, or one this partition overwrote
                // before it was shipped everywhere.
                let (owner, superseded) = match parse_superseded_key(&key) {
                    Some((owner, _)) => (Bytes::copy_from_slice(owner), true),
                    None if tessera_engine::reserved::is_reserved(&key) => continue,
                    None => (key.clone(), false),
                };
                if place.partition_of(&owner) != place.partition {
                    continue;
                }
                let Ok(stored) = Stored::decode(raw) else { continue };
                held_data = true;
                self.clock.observe(stored.version, now);
                if stored.origin != self.me || stored.version <= horizon {
                    if superseded {
                        passed.push(key);
                    }
                    continue;
                }
                if superseded {
                    self.superseded.insert(stored.version, key);
                }
                #[cfg(feature = "broken")]
                let stored = match self.broken_recover_without_dependencies {
                    true => Stored { dependencies: Vec::new(), ..stored },
                    false => stored,
                };
                recovered.push(Replicated {
                    key: owner,
                    version: stored.version,
                    origin: stored.origin,
                    value: stored.value,
                    vector: stored.vector,
                    dependencies: stored.dependencies,
                });
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        for key in passed {
            self.engine.delete(&key)?;
        }
        recovered.sort_by_key(|write| write.version);
        Ok((horizon, recovered, held_data))
    }

    /// Whether the partition may serve reads that count on a stable time:
    /// it did not start over data, or it has since received every other
    /// datacenter's stream up to when it started.
    fn caught_up(&mut self) -> bool {
        let Some(from) = self.catching_up_from else { return true };
        let place = self.place.as_ref().expect("placed");
        let received = &self.streams.received;
        if (0..place.datacenters()).any(|at| at != place.datacenter && received[at] < from) {
            return false;
        }
        self.catching_up_from = None;
        true
    }

    /// Keeps the horizon in the engine when it has moved and it is time.
    fn keep_horizon(&mut self, now: Time) {
        let place = self.place.as_ref().expect("placed");
        let horizon = self.streams.horizon(place);
        if horizon <= self.horizon_kept || now < self.horizon_kept_at + HORIZON_KEEP_MS {
            return;
        }
        if let Err(error) =
            self.engine.put(&horizon_key(), Record::value(horizon, self.me, Bytes::new()).encode())
        {
            return self.engine_failed(error.into());
        }
        (self.horizon_kept, self.horizon_kept_at) = (horizon, now);
        // Overwritten writes the horizon has passed are stored everywhere.
        while let Some(entry) = self.superseded.first_entry().filter(|entry| *entry.key() <= horizon) {
            if let Err(error) = self.engine.delete(entry.get()) {
                return self.engine_failed(error.into());
            }
            entry.remove();
        }
    }

    /// Sends each message: to a copy in another datacenter as a message of
    /// this shard, to a sibling as one of the sibling's shard.
    fn send<const FAMILY: u8>(&self, fx: &mut Effects, sends: Vec<(NodeId, GeoMessage)>) {
        let place = self.place.as_ref().expect("placed");
        for (to, message) in sends {
            let message = PeerMessage::new(&Tagged::<FAMILY>(message));
            match place.partition_of_node(to) {
                Some(partition) => fx.send_to_shard(place.shards[partition], to, message),
                None => fx.send(to, message),
            }
        }
    }

    /// The message `from` sent, if this partition has its place and the
    /// message is this protocol's and well formed.
    fn open<const FAMILY: u8>(&self, from: NodeId, message: &PeerMessage) -> Option<GeoMessage> {
        self.place.as_ref()?;
        crate::open::<Tagged<FAMILY>>(self.me, from, message).map(|tagged| tagged.0)
    }

    /// Answers a client: `serve`'s reply or failure, once this partition
    /// has its place.
    fn answer(
        placed: bool,
        request: ClientRequest,
        fx: &mut Effects,
        serve: impl FnOnce(ClientRequest, &mut Effects) -> Result<ClientReply, OperationError>,
    ) {
        let id = request.id;
        let reply = match placed {
            false => ClientReply::Retry(UNPLACED),
            true => serve(request, fx).unwrap_or_else(ClientReply::Failed),
        };
        fx.reply(id, reply);
    }

    /// On a tick: resends, acknowledgements, the horizon kept, and, if
    /// `heartbeats`, heartbeats with a fresh clock (no later write is
    /// stamped at or below it).
    fn tick<const FAMILY: u8>(&mut self, fx: &mut Effects, heartbeats: bool) {
        let place = self.place.as_ref().expect("placed");
        let clock = heartbeats.then(|| self.clock.tick(fx.now()));
        let sends = self.streams.on_tick(place, clock, fx.now());
        self.send::<FAMILY>(fx, sends);
        self.keep_horizon(fx.now());
    }

    /// On a tick: gossips this partition's times `own` (by datacenter) to
    /// its siblings when due; returns their minimum over the datacenter's
    /// partitions, by datacenter.
    fn stabilize<const FAMILY: u8>(
        &self,
        stabilizer: &mut Stabilizer,
        own: &[Version],
        fx: &mut Effects,
    ) -> Vec<Version> {
        let place = self.place.as_ref().expect("placed");
        let sends = stabilizer.gossip(place, own, fx.now());
        self.send::<FAMILY>(fx, sends);
        stabilizer.stable(place, own)
    }

    fn engine_failed(&self, error: OperationError) {
        tracing::error!(replica = %self.me, %error, "a causal partition could not store a write");
    }

    /// Stores a write taken here and ships it to the other datacenters.
    fn write_here<const FAMILY: u8>(
        &mut self,
        write: Replicated,
        fx: &mut Effects,
    ) -> Result<(), OperationError> {
        let place = self.place.as_ref().expect("placed");
        // The version this write replaces may not have reached every copy:
        // kept until the horizon passes it, a restart ships it too.
        let held = read(&*self.engine, &write.key)?;
        if let Some(held) =
            held.as_ref().filter(|held| held.origin == self.me && held.version > self.horizon_kept)
        {
            let key = superseded_key(&write.key, held.version);
            self.engine.put(&key, held.encode())?;
            self.superseded.insert(held.version, Bytes::from(key));
        }
        let stored = Stored { dependencies: write.dependencies.clone(), ..Stored::of(&write) };
        store_over(&*self.engine, &write.key, &stored, held)?;
        let sends = self.streams.ship(place, write, fx.now());
        self.send::<FAMILY>(fx, sends);
        Ok(())
    }

    /// Takes a message of writes from another datacenter (its stream's
    /// epoch, oldest write held, first write sent and sending time):
    /// acknowledges it and
    /// returns the writes now delivered in order, each with the receipt
    /// to hand to [`Partition::store_delivered`] once it is stored.
    fn receive<const FAMILY: u8>(
        &mut self,
        from: NodeId,
        stream: (Version, u64, u64, Time),
        writes: Vec<Replicated>,
        fx: &mut Effects,
    ) -> Vec<(Receipt, Replicated)> {
        let place = self.place.as_ref().expect("placed");
        let Some((ready, ack)) = self.streams.receive(place, from, stream, writes, fx.now()) else {
            return Vec::new();
        };
        self.send::<FAMILY>(fx, vec![(from, ack)]);
        ready
    }

    /// Retires the version `expected` of `key` in this copy alone, if the
    /// key still holds it: stores a tombstone at that version and origin,
    /// which outranks it and loses to every later write of the key, taken
    /// here or arriving from elsewhere. The expiry sweep judges a record
    /// from what it holds (its expiry time, or for a collection's page the
    /// owner key that replaced it), so every datacenter's sweep retires the
    /// same record and the copies converge without shipping the tombstone;
    /// a delete stamped now would instead outrank a write another
    /// datacenter took meanwhile and lose it everywhere. After a restart a
    /// tombstone of this partition's own write is shipped again in its
    /// place, at its place in the stream: harmless, as every copy retires
    /// that record.
    fn retire(&mut self, key: &Bytes, expected: (Version, NodeId)) -> Result<ClientReply, OperationError> {
        let Some(held) = read(&*self.engine, key)? else { return Ok(ClientReply::Written) };
        if (held.version, held.origin) != expected {
            return Ok(ClientReply::Changed);
        }
        if held.value.is_some() {
            let tombstone = Stored { value: None, ..held.clone() };
            store_over(&*self.engine, key, &tombstone, Some(held))?;
        }
        Ok(ClientReply::Written)
    }

    /// The broken variant's call for a retire of the version the key still
    /// holds: a delete stamped now, as any client's, so that it outranks a
    /// write another datacenter took meanwhile.
    #[cfg(feature = "broken")]
    fn broken_retire_as_delete(&self, key: &Bytes, call: Call) -> Result<Call, OperationError> {
        Ok(match call {
            Call::Retire(expected) if self.broken_retires_with_a_delete => {
                let held = read(&*self.engine, key)?;
                match held.is_some_and(|held| (held.version, held.origin) == expected) {
                    true => Call::Write(None),
                    false => Call::Retire(expected),
                }
            }
            call => call,
        })
    }

    /// Stores a write delivered from another datacenter (if it outranks
    /// what the key holds) and tells its stream.
    fn store_delivered(&mut self, receipt: Receipt, write: &Replicated) -> Result<(), OperationError> {
        store(&*self.engine, &write.key, &Stored::of(write))?;
        self.streams.stored(receipt);
        Ok(())
    }

    /// The datacenter whose copy of this partition took `origin`'s writes.
    fn datacenter_of_origin(&self, origin: NodeId) -> Option<usize> {
        self.place.as_ref()?.replicas.iter().position(|replica| *replica == origin)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::{check_codec, strategies};

    fn version() -> impl Strategy<Value = Version> {
        any::<u64>().prop_map(Version)
    }

    fn dependency() -> impl Strategy<Value = Dependency> {
        (strategies::bytes(), version(), any::<u32>()).prop_map(|(key, version, origin)| Dependency {
            key,
            version,
            origin: NodeId(origin),
        })
    }

    fn replicated() -> impl Strategy<Value = Replicated> {
        (
            strategies::bytes(),
            version(),
            any::<u32>(),
            proptest::option::of(strategies::bytes()),
            proptest::collection::vec(version(), 0..4),
            proptest::collection::vec(dependency(), 0..4),
        )
            .prop_map(|(key, version, origin, value, vector, dependencies)| Replicated {
                key,
                version,
                origin: NodeId(origin),
                value,
                vector,
                dependencies,
            })
    }

    fn message() -> impl Strategy<Value = GeoMessage> {
        prop_oneof![
            (
                version(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(replicated(), 0..4)
            )
                .prop_map(|(epoch, oldest, first, sent_at, writes)| GeoMessage::Writes {
                    epoch,
                    oldest,
                    first,
                    sent_at,
                    writes
                }),
            (version(), version(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
                |(epoch, copy, delivered, stored, echo)| GeoMessage::Ack {
                    epoch,
                    copy,
                    delivered,
                    stored,
                    echo
                }
            ),
            (version(), any::<u64>(), version(), any::<u64>()).prop_map(|(epoch, oldest, clock, through)| {
                GeoMessage::Heartbeat { epoch, oldest, clock, through }
            }),
            proptest::collection::vec(version(), 0..4).prop_map(|received| GeoMessage::Stable { received }),
            (version(), proptest::collection::vec((any::<u64>(), dependency()), 0..4))
                .prop_map(|(asker, checks)| GeoMessage::CheckDependencies { asker, checks }),
            (version(), proptest::collection::vec(any::<u64>(), 0..4))
                .prop_map(|(asker, checks)| GeoMessage::DependenciesMet { asker, checks }),
            version().prop_map(|through| GeoMessage::Committed { through }),
        ]
    }

    proptest! {
        #[test]
        fn messages_survive_the_wire(message in message(), cut in any::<usize>()) {
            check_codec(&Tagged::<20>(message), cut);
        }

        #[test]
        fn stored_versions_survive_the_engine(
            version in version(),
            origin in any::<u32>(),
            value in proptest::option::of(strategies::bytes()),
            vector in proptest::collection::vec(version(), 0..4),
            dependencies in proptest::collection::vec(dependency(), 0..4),
        ) {
            let stored = Stored { version, origin: NodeId(origin), value, vector, dependencies };
            prop_assert_eq!(Stored::decode(stored.encode()).unwrap(), stored);
        }

        #[test]
        fn contexts_survive_a_token_and_merge_with_their_own_kind(
            dependencies in proptest::collection::vec(dependency(), 0..4),
            more in proptest::collection::vec(dependency(), 0..4),
            times in proptest::collection::vec(version(), 4),
            cut in any::<usize>(),
        ) {
            let contexts = [
                CausalContext::Empty,
                CausalContext::Dependencies(dependencies.clone()),
                CausalContext::Time { dependency: times[0], stable: times[1] },
                CausalContext::Vector { dependency: times[..2].to_vec(), stable: times[2..].to_vec() },
            ];
            for context in &contexts {
                let encoded = Bytes::from(context.encode());
                prop_assert_eq!(&CausalContext::decode(encoded.clone()).unwrap(), context);
                let cut = cut % encoded.len();
                prop_assert!(CausalContext::decode(encoded.slice(..cut)).is_err(), "cut at {}", cut);
                prop_assert_eq!(&context.clone().merged(CausalContext::Empty).unwrap(), context);
            }
            let merged = contexts[1].clone().merged(CausalContext::Dependencies(more.clone())).unwrap();
            let CausalContext::Dependencies(merged) = merged else { unreachable!() };
            prop_assert!(dependencies.iter().chain(&more).all(|dependency| merged.contains(dependency)));
            let later = CausalContext::Time { dependency: times[2], stable: times[3] };
            prop_assert_eq!(
                contexts[2].clone().merged(later).unwrap(),
                CausalContext::Time { dependency: times[0].max(times[2]), stable: times[1].max(times[3]) }
            );
            prop_assert!(contexts[1].clone().merged(contexts[2].clone()).is_err());
        }

        /// Whatever order and repetition the network gives, a stream hands
        /// each write on once, in order.
        #[test]
        fn a_stream_delivers_each_write_once_in_order(deliveries in proptest::collection::vec((1u64..40, 1usize..4), 1..200)) {
            let mut inbox = Inbox::default();
            let mut delivered = Vec::new();
            for (first, count) in deliveries {
                let writes = (first..first + count as u64).map(numbered).collect();
                let ready = inbox.receive((Version(1), 1, first, 0), writes).expect("one stream");
                for (number, write) in ready {
                    prop_assert_eq!(number, write.version.0);
                    delivered.push(number);
                }
            }
            let expected: Vec<u64> = (1..=delivered.len() as u64).collect();
            prop_assert_eq!(delivered, expected);
        }

        /// Whatever acknowledgements a peer sends (late, repeated, forged),
        /// an outbox keeps its writes in order, resends within its bounds
        /// and drops only what the copy says it stored.
        #[test]
        fn an_outbox_survives_any_acknowledgement(
            steps in proptest::collection::vec((0u8..3, any::<u64>(), any::<u64>(), 0u64..3, 0u64..400), 1..200),
        ) {
            let mut outbox = Outbox::default();
            let (mut now, mut pushed) = (0, 0);
            for (step, delivered, stored, copy, elapsed) in steps {
                now += elapsed;
                match step {
                    0 => {
                        pushed += 1;
                        outbox.push(numbered(pushed), now);
                    }
                    1 => {
                        // Mostly numbers near the stream's, sometimes anything.
                        let near = |number: u64| if number.is_multiple_of(4) { number } else { number % (pushed + 2) };
                        let echo = now.saturating_sub(delivered % 500);
                        outbox.acknowledged(Version::default(), Version(copy), (near(delivered), near(stored), echo), now);
                    }
                    _ => {
                        outbox.resend(now);
                    }
                }
                prop_assert!((RESEND_MIN_MS..=RESEND_MAX_MS).contains(&outbox.timer.interval()));
                prop_assert!(outbox.delivered <= outbox.sent_through());
                let held: Vec<u64> = outbox.unacked.iter().map(|unacked| unacked.write.version.0).collect();
                let expected: Vec<u64> = (outbox.first.max(1)..=pushed).collect();
                prop_assert_eq!(held, expected);
            }
        }
    }

    /// Write number `number` of a stream, as its version too.
    fn numbered(number: u64) -> Replicated {
        Replicated {
            key: Bytes::from(number.to_string()),
            version: Version(number),
            origin: NodeId(1),
            value: None,
            vector: Vec::new(),
            dependencies: Vec::new(),
        }
    }

    /// A partition that starts again over its data begins a new stream: its
    /// copies take it from its first write rather than for repeats, and
    /// drop what is left of the old one. A copy that starts again takes its
    /// peer's stream from the oldest write not yet acknowledged.
    #[test]
    fn streams_that_start_again_are_taken_from_their_oldest_numbered() {
        let numbers = |ready: Option<Vec<(u64, Replicated)>>| -> Option<Vec<u64>> {
            ready.map(|ready| ready.iter().map(|(_, write)| write.version.0).collect())
        };
        let mut inbox = Inbox::default();
        assert_eq!(
            numbers(inbox.receive((Version(10), 1, 1, 0), vec![numbered(1), numbered(2)])),
            Some(vec![1, 2])
        );
        // The sender restarted: its new stream numbers from 1 again.
        assert_eq!(numbers(inbox.receive((Version(20), 1, 1, 0), vec![numbered(7)])), Some(vec![7]));
        assert_eq!(
            numbers(inbox.receive((Version(10), 1, 3, 0), vec![numbered(3)])),
            None,
            "the old stream is over"
        );
        // This copy restarted: the sender's stream is far along.
        let mut fresh = Inbox::default();
        assert_eq!(numbers(fresh.receive((Version(20), 40, 42, 0), vec![numbered(42)])), Some(vec![]));
        assert_eq!(
            numbers(fresh.receive((Version(20), 40, 40, 0), vec![numbered(40), numbered(41)])),
            Some(vec![40, 41, 42])
        );
    }

    /// A key's partition is the one whose slots a cluster's evenly split
    /// shards give it, whatever the number of partitions.
    #[test]
    fn partitions_split_the_slots_as_a_clusters_shards_do() {
        let mut key_of_slot = vec![None; SLOTS];
        let mut found = 0;
        for n in 0u32.. {
            let key = n.to_string();
            let slot = &mut key_of_slot[key_slot(key.as_bytes())];
            if slot.is_none() {
                *slot = Some(key);
                found += 1;
                if found == SLOTS {
                    break;
                }
            }
        }
        for partitions in [1usize, 2, 3, 5, 7, 1000] {
            let place = GeoPlace {
                siblings: (0..partitions as u32).map(NodeId).collect(),
                shards: (0..partitions as u32).collect(),
                ..GeoPlace::default()
            };
            for partition in 0..partitions {
                let (first, last) =
                    (SLOTS * partition / partitions, SLOTS * (partition + 1) / partitions - 1);
                for slot in [first, last] {
                    let key = key_of_slot[slot].as_ref().expect("every slot has a key");
                    assert_eq!(place.partition_of(key.as_bytes()), partition, "slot {slot} of {partitions}");
                }
            }
        }
    }

    /// One partition alone in one datacenter, placed.
    fn placed(protocol: &mut dyn crate::Protocol) {
        let place = GeoPlace {
            datacenter: 0,
            partition: 0,
            replicas: vec![NodeId(0)],
            siblings: vec![NodeId(0)],
            shards: vec![0],
        };
        protocol.on_view(&ShardView::of_partition(place), &mut Effects::new(0));
    }

    fn ask(protocol: &mut dyn crate::Protocol, operation: Operation) -> ClientReply {
        let mut fx = Effects::new(100);
        protocol.on_client(crate::ClientRequest { id: crate::RequestId(1), operation }, &mut fx);
        match fx.take().pop() {
            Some(crate::Effect::Reply { reply, .. }) => reply,
            other => panic!("no reply: {other:?}"),
        }
    }

    #[test]
    fn a_causal_partition_serves_single_keys_and_refuses_the_rest_with_reasons() {
        let engine: Arc<dyn Engine> = Arc::new(tessera_engine::OrderedEngine::new());
        let mut partition = gentle_rain::GentleRain::new(NodeId(0), engine);
        let key = Bytes::from_static(b"k");
        let get = |consistency| Operation::Get { key: key.clone(), consistency };
        assert_eq!(ask(&mut partition, get(Consistency::Eventual)), ClientReply::Retry(UNPLACED));
        placed(&mut partition);
        let put = Operation::Put { key: key.clone(), value: Bytes::from_static(b"v") };
        assert_eq!(ask(&mut partition, put), ClientReply::Written);
        assert_eq!(
            ask(&mut partition, get(Consistency::Eventual)),
            ClientReply::Value(Some(Bytes::from_static(b"v")))
        );
        let causal = Operation::Causal { key: key.clone(), write: None, context: CausalContext::Empty };
        assert!(matches!(
            ask(&mut partition, causal),
            ClientReply::Causal { value: Some(_), context: CausalContext::Time { .. } }
        ));
        let refused = [
            (get(Consistency::Strong), NOT_STRONG),
            (Operation::Increment { key: key.clone(), delta: 1 }, SINGLE_KEYS_ONLY),
            (Operation::Batch { writes: Vec::new() }, SINGLE_KEYS_ONLY),
            (
                Operation::Causal {
                    key: key.clone(),
                    write: None,
                    context: CausalContext::Dependencies(Vec::new()),
                },
                FOREIGN_CONTEXT,
            ),
        ];
        let ahead = CausalContext::Time {
            dependency: Version::new(100 + VERSION_AHEAD_MAX_MS + 1, 0),
            stable: Version::default(),
        };
        let refused = refused
            .into_iter()
            .chain([(Operation::Causal { key: key.clone(), write: None, context: ahead }, CONTEXT_AHEAD)]);
        for (operation, reason) in refused {
            assert_eq!(ask(&mut partition, operation), ClientReply::Failed(OperationError::Causal(reason)));
        }
    }

    #[test]
    fn a_gentle_rain_put_waiting_for_its_clock_asks_to_be_woken_when_it_passes() {
        let engine: Arc<dyn Engine> = Arc::new(tessera_engine::OrderedEngine::new());
        let mut partition = gentle_rain::GentleRain::new(NodeId(0), engine);
        placed(&mut partition);
        let context = CausalContext::Time { dependency: Version::new(100, 3), stable: Version::default() };
        let write = Some(crate::Write::Put(Bytes::from_static(b"v")));
        let put = Operation::Causal { key: Bytes::from_static(b"k"), write, context };
        let mut fx = Effects::new(100);
        crate::Protocol::on_client(
            &mut partition,
            crate::ClientRequest { id: crate::RequestId(1), operation: put },
            &mut fx,
        );
        assert!(fx.take().is_empty(), "the put waits while the clock is at its dependency's millisecond");
        assert_eq!(fx.wake_time(), Some(101));
        let mut fx = Effects::new(101);
        crate::Protocol::on_tick(&mut partition, &mut fx);
        assert!(fx
            .take()
            .iter()
            .any(|effect| matches!(effect, crate::Effect::Reply { reply: ClientReply::Causal { .. }, .. })));
    }

    #[test]
    fn a_retired_version_stays_retired_and_loses_to_every_later_write() {
        type Constructor = fn(NodeId, Arc<dyn Engine>) -> Box<dyn crate::Protocol>;
        let constructors: [Constructor; 4] = [
            |me, engine| Box::new(eventual::Eventual::new(me, engine)),
            |me, engine| Box::new(cops::Cops::new(me, engine)),
            |me, engine| Box::new(gentle_rain::GentleRain::new(me, engine)),
            |me, engine| Box::new(spartan::CausalSpartan::new(me, engine)),
        ];
        for new in constructors {
            let engine: Arc<dyn Engine> = Arc::new(tessera_engine::OrderedEngine::new());
            let mut partition = new(NodeId(0), engine.clone());
            placed(&mut *partition);
            let key = Bytes::from_static(b"k");
            let put = Operation::Put { key: key.clone(), value: Bytes::from_static(b"v") };
            assert_eq!(ask(&mut *partition, put), ClientReply::Written);
            let held = read(&*engine, &key).unwrap().expect("stored");
            let retire = |expected| Operation::WriteIf {
                key: key.clone(),
                expected: Some(expected),
                write: Write::Delete,
            };
            let other = (held.version, NodeId(7));
            assert_eq!(ask(&mut *partition, retire(other)), ClientReply::Changed);
            assert_eq!(read(&*engine, &key).unwrap().as_ref(), Some(&held), "another version is not retired");
            assert_eq!(ask(&mut *partition, retire((held.version, held.origin))), ClientReply::Written);
            let tombstone = read(&*engine, &key).unwrap().expect("a tombstone");
            assert_eq!(
                (tombstone.version, tombstone.origin, tombstone.value),
                (held.version, held.origin, None)
            );
            // The retired version delivered again (a stream resends after a
            // restart) stays retired; a later write wins.
            assert!(!store(&*engine, &key, &held).unwrap());
            let later = Stored { version: Version(held.version.0 + 1), ..held.clone() };
            assert!(store(&*engine, &key, &later).unwrap());
            assert_eq!(held_value(&*engine, &key), Some(Bytes::from_static(b"v")));
        }
    }

    #[test]
    fn a_protocol_that_is_not_causal_refuses_causal_sessions() {
        let engine: Arc<dyn Engine> = Arc::new(tessera_engine::OrderedEngine::new());
        let mut chain = crate::ChainReplication::new(NodeId(0), engine, crate::ChainOptions::default());
        let view = crate::test_support::view(1, &[0]);
        crate::Protocol::on_view(&mut chain, &view, &mut Effects::new(0));
        let causal =
            Operation::Causal { key: Bytes::from_static(b"k"), write: None, context: CausalContext::Empty };
        assert_eq!(ask(&mut chain, causal), ClientReply::Failed(OperationError::Causal(crate::CAUSAL_ONLY)));
    }

    #[test]
    fn an_outbox_resends_until_acknowledged() {
        let mut outbox = Outbox::default();
        assert!(matches!(outbox.push(numbered(1), 0), GeoMessage::Writes { first: 1, .. }));
        assert!(matches!(outbox.push(numbered(2), 10), GeoMessage::Writes { first: 2, .. }));
        assert!(matches!(outbox.push(numbered(3), 20), GeoMessage::Writes { first: 3, .. }));
        assert_eq!(outbox.resend(RESEND_MS - 1), None);
        // The first has waited long enough; the others not yet.
        let resent = outbox.resend(RESEND_MS);
        assert!(matches!(resent, Some(GeoMessage::Writes { first: 1, ref writes, .. }) if writes.len() == 1));
        let resent = outbox.resend(RESEND_MS + 20);
        assert!(matches!(resent, Some(GeoMessage::Writes { first: 2, ref writes, .. }) if writes.len() == 2));
        let copy = Version(5);
        outbox.acknowledged(Version(7), copy, (3, 3, 0), 0);
        assert_eq!(outbox.unacked.len(), 3, "an earlier stream's acknowledgement counts nothing");
        outbox.acknowledged(Version::default(), copy, (2, 2, 0), 0);
        assert_eq!(outbox.resend(2 * RESEND_MS + 19), None, "the third was resent since");
        let resent = outbox.resend(2 * RESEND_MS + 20);
        assert!(matches!(resent, Some(GeoMessage::Writes { first: 3, ref writes, .. }) if writes.len() == 1));
        outbox.acknowledged(Version::default(), copy, (3, 3, 0), 0);
        assert_eq!(outbox.resend(100 * RESEND_MS), None);
        assert_eq!(outbox.sent_through(), 3);
    }

    /// The resend interval follows the round trips the acknowledgements'
    /// echoes measure, within its bounds.
    #[test]
    fn an_outbox_resends_after_the_round_trip_it_measures() {
        let copy = Version(5);
        let mut outbox = Outbox::default();
        assert_eq!(outbox.timer.interval(), RESEND_MS, "nothing measured yet");
        outbox.push(numbered(1), 1_000);
        outbox.acknowledged(Version::default(), copy, (1, 0, 1_000), 1_300);
        assert_eq!(outbox.timer.interval(), 300 + 4 * 150);
        outbox.acknowledged(Version::default(), copy, (1, 0, 0), 1_900);
        assert_eq!(outbox.timer.interval(), 300 + 4 * 150, "a later acknowledgement measures nothing");
        // Round trips of 300 ms again and again: the deviation dies down.
        for (number, now) in (2..=40).zip((2..).map(|at| 1_000 * at)) {
            outbox.push(numbered(number), now);
            outbox.acknowledged(Version::default(), copy, (number, 0, now), now + 300);
        }
        let interval = outbox.timer.interval();
        assert!((300..=340).contains(&interval), "{interval}");
        // A round trip longer than the interval: the write is resent before
        // its acknowledgement comes, and the echo of the resend measures it.
        let resent_at = 100_000 + interval;
        outbox.push(numbered(41), 100_000);
        let Some(GeoMessage::Writes { sent_at, .. }) = outbox.resend(resent_at) else { panic!("due") };
        assert_eq!(sent_at, resent_at);
        outbox.acknowledged(Version::default(), copy, (41, 41, sent_at), resent_at + 900);
        assert!(outbox.timer.interval() > interval + 100, "900 ms measured");
        // A loopback round trip is held at the lower bound, a cut-off at the upper.
        let mut timer = ResendTimer::default();
        timer.measured(0);
        assert_eq!(timer.interval(), RESEND_MIN_MS);
        timer.measured(60_000);
        assert_eq!(timer.interval(), RESEND_MAX_MS);
    }

    /// A write the copy has delivered but not stored (held until it is
    /// visible) is kept and not resent; once stored it is dropped; if the
    /// copy starts again before storing it, it is sent again.
    #[test]
    fn an_outbox_keeps_what_a_copy_holds_until_it_is_stored() {
        let (stream, before, after) = (Version(3), Version(10), Version(20));
        let mut outbox = Outbox { epoch: stream, ..Outbox::default() };
        for number in 1..=4 {
            outbox.push(numbered(number), 0);
        }
        outbox.acknowledged(stream, before, (4, 1, 0), 0);
        assert_eq!((outbox.first, outbox.stored_up_to()), (2, Version(1)), "the stored one is dropped");
        // Delivered ones wait where they are held: an empty message asks,
        // once a while, whether the copy still holds them.
        let probe = GeoMessage::Writes {
            epoch: stream,
            oldest: 2,
            first: 5,
            sent_at: 10 * RESEND_MS,
            writes: Vec::new(),
        };
        assert_eq!(outbox.resend(10 * RESEND_MS), Some(probe));
        assert_eq!(outbox.resend(11 * RESEND_MS - 1), None);
        outbox.acknowledged(stream, before, (4, 2, 0), 0);
        assert_eq!(outbox.first, 3);
        // An acknowledgement from the copy before it started again, late.
        outbox.acknowledged(stream, Version(9), (1, 1, 0), 0);
        assert_eq!(outbox.first, 3);
        // The copy starts again: what it held is gone, so it is resent.
        outbox.acknowledged(stream, after, (2, 2, 0), 0);
        let resent = outbox.resend(12 * RESEND_MS);
        assert!(
            matches!(resent, Some(GeoMessage::Writes { oldest: 3, first: 3, ref writes, .. }) if writes.len() == 2)
        );
        outbox.acknowledged(stream, after, (4, 4, 0), 0);
        assert!(outbox.unacked.is_empty());
        assert_eq!(outbox.stored_up_to(), Version(4), "every write pushed is stored");
    }

    /// A copy that started again takes a stream up past what its sender no
    /// longer holds (the copy stored it before it stopped), and what it held
    /// below that is not waited for.
    #[test]
    fn an_inbox_moves_past_what_its_sender_has_dropped() {
        let mut inbox = Inbox::default();
        let ready = inbox.receive((Version(5), 1, 1, 0), (1..=3).map(numbered).collect()).expect("delivered");
        assert_eq!(ready.len(), 3);
        assert_eq!(inbox.stored_through(), 0);
        // The sender dropped 1..=6 (stored here, by this copy before).
        let ready = inbox.receive((Version(5), 7, 8, 0), vec![numbered(8)]).expect("one stream");
        assert!(ready.is_empty(), "7 is still to come");
        assert_eq!((inbox.delivered, inbox.stored_through()), (6, 6));
        let ready = inbox.receive((Version(5), 7, 7, 0), vec![numbered(7)]).expect("one stream");
        assert_eq!(ready.iter().map(|(number, _)| *number).collect::<Vec<_>>(), vec![7, 8]);
    }

    /// COPS stores writes out of order: an inbox acknowledges as stored the
    /// run below the oldest it still holds, says so on a tick once that
    /// moves, and again after a while in case it was lost.
    #[test]
    fn an_inbox_acknowledges_the_run_it_has_stored() {
        let place = GeoPlace {
            datacenter: 0,
            partition: 0,
            replicas: vec![NodeId(0), NodeId(1)],
            siblings: vec![NodeId(0)],
            shards: vec![0],
        };
        let (copy, stream) = (Version(1), Version(2));
        let mut streams = Streams::new(2, copy);
        let writes = (1..=3).map(numbered).collect();
        let (ready, ack) =
            streams.receive(&place, NodeId(1), (stream, 1, 1, 7), writes, 0).expect("delivered");
        assert_eq!(ack, GeoMessage::Ack { epoch: stream, copy, delivered: 3, stored: 0, echo: 7 });
        let acks = |streams: &mut Streams, now| -> Vec<GeoMessage> {
            let sends = streams.on_tick(&place, None, now);
            sends
                .into_iter()
                .map(|(_, message)| message)
                .filter(|message| matches!(message, GeoMessage::Ack { .. }))
                .collect()
        };
        assert_eq!(acks(&mut streams, 1), vec![], "nothing new to say");
        streams.stored(ready[1].0);
        streams.stored(Receipt { epoch: Version(1), ..ready[0].0 }); // of an earlier stream
        assert_eq!(acks(&mut streams, 2), vec![], "the first is still held");
        streams.stored(ready[0].0);
        assert_eq!(
            acks(&mut streams, 3),
            vec![GeoMessage::Ack { epoch: stream, copy, delivered: 3, stored: 2, echo: 0 }]
        );
        streams.stored(ready[2].0);
        assert_eq!(
            acks(&mut streams, 4),
            vec![GeoMessage::Ack { epoch: stream, copy, delivered: 3, stored: 3, echo: 0 }]
        );
        assert_eq!(acks(&mut streams, 4 + RESEND_MS - 1), vec![]);
        assert_eq!(acks(&mut streams, 4 + RESEND_MS).len(), 1, "said again in case it was lost");
    }
}
