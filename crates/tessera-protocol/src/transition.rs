//! Online transitions between protocols (docs/PROTOCOLS.md, "Online
//! transitions"): a shard switches from one protocol to another over the same
//! engine while it serves.
//!
//! The coordinator marks a view *draining*. In it, a replica starts no new
//! operation of the old protocol: writes and strong reads wait here (eventual
//! reads are answered from the local copy), and the old protocol finishes what
//! it has in flight. Once it has nothing in flight ([`Protocol::quiescent`]),
//! the replica tells every member it is *quiet*. Once it has heard every
//! member quiet, nothing is in flight anywhere: it ignores the old protocol's
//! late messages, its records change only by the merge below, and it answers a member's request with its records (or with
//! *in sync* when both hold the same: digests of 64 buckets of keys tell which
//! buckets need to travel). Each member merges every
//! other member's records, keeping per key the record of highest (version,
//! origin), so all end with the same records: the newest each key had at any
//! member. A replica that has merged every member reports itself *drained*;
//! once all have, in the same view, the coordinator installs the next view
//! with the new mode, the driver swaps the protocol in ([`Switchable::replace`])
//! and the waiting requests run on it.
//!
//! A member that fails during the drain is removed by the coordinator as
//! usual; the new (still draining) view starts the exchange over.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::Engine;

use crate::codec::{put_chunk, put_entries, put_u64s, CodecError, Family, Message, Reader};
use crate::multi_master::{hash, leaf_of, record_hash};
use crate::{
    for_each_entry, read_visible, Arrival, Chunk, ClientReply, ClientRequest, Consistency, Effects, NodeId,
    Operation, OperationError, PeerMessage, Progress, Protocol, Record, ShardView, SnapshotPace,
    SnapshotReceiver, SnapshotStream, StreamNumbers, Time,
};

/// How often a draining replica repeats its announcements and requests (the
/// channel may drop them).
const RESEND_MS: u64 = 20;

/// Keys are summed up in this many buckets (by the multi-master tree's leaf
/// of the key): replicas that differ on a few keys exchange those buckets.
pub const DIGEST_BUCKETS: usize = 64;

fn bucket_of(key: &[u8]) -> usize {
    leaf_of(key) % DIGEST_BUCKETS
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransitionMessage {
    /// The sender has nothing of the old protocol in flight and starts nothing.
    Quiet { view: u64 },
    /// Asks for the receiver's records; `digests` summarise the sender's,
    /// one per bucket of keys ([`DIGEST_BUCKETS`]), so that only buckets that
    /// differ travel.
    RecordsRequest { view: u64, digests: Vec<u64> },
    /// The receiver's records equal the requester's.
    InSync { view: u64 },
    /// A chunk of the receiver's records in the buckets that differ, read as
    /// the stream goes.
    Records { view: u64, chunk: Chunk, entries: Vec<(Bytes, Bytes)> },
    /// The requester merged every chunk of `stream` through `index`.
    RecordsAck { view: u64, stream: u64, index: u32 },
}

impl TransitionMessage {
    pub fn view(&self) -> u64 {
        match self {
            TransitionMessage::Quiet { view }
            | TransitionMessage::RecordsRequest { view, .. }
            | TransitionMessage::InSync { view }
            | TransitionMessage::Records { view, .. }
            | TransitionMessage::RecordsAck { view, .. } => *view,
        }
    }
}

const QUIET: u8 = 1;
const RECORDS_REQUEST: u8 = 2;
const IN_SYNC: u8 = 3;
const RECORDS: u8 = 4;
const RECORDS_ACK: u8 = 5;

/// The framework's own family: transitions run between any two protocols.
impl Message for TransitionMessage {
    const FAMILY: Family = Family(16);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            TransitionMessage::Quiet { view } => {
                out.put_u8(QUIET);
                out.put_u64_le(*view);
            }
            TransitionMessage::RecordsRequest { view, digests } => {
                out.put_u8(RECORDS_REQUEST);
                out.put_u64_le(*view);
                put_u64s(out, digests);
            }
            TransitionMessage::InSync { view } => {
                out.put_u8(IN_SYNC);
                out.put_u64_le(*view);
            }
            TransitionMessage::Records { view, chunk, entries } => {
                out.put_u8(RECORDS);
                out.put_u64_le(*view);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            TransitionMessage::RecordsAck { view, stream, index } => {
                out.put_u8(RECORDS_ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*stream);
                out.put_u32_le(*index);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            QUIET => TransitionMessage::Quiet { view: reader.u64()? },
            RECORDS_REQUEST => {
                TransitionMessage::RecordsRequest { view: reader.u64()?, digests: reader.u64s()? }
            }
            IN_SYNC => TransitionMessage::InSync { view: reader.u64()? },
            RECORDS => TransitionMessage::Records {
                view: reader.u64()?,
                chunk: reader.chunk()?,
                entries: reader.entries()?,
            },
            RECORDS_ACK => TransitionMessage::RecordsAck {
                view: reader.u64()?,
                stream: reader.u64()?,
                index: reader.u32()?,
            },
            _ => return Err(CodecError("unknown transition message")),
        })
    }
}

/// A draining view's progress on this replica.
struct Drain {
    view: u64,
    quiet: bool,
    quiet_peers: BTreeSet<NodeId>,
    merged_from: BTreeSet<NodeId>,
    /// Where this replica is in each peer's stream of records.
    receivers: BTreeMap<NodeId, SnapshotReceiver>,
    /// The records streaming to each peer that asked (kept once finished:
    /// one exchange per peer and drain).
    streams: BTreeMap<NodeId, SnapshotStream>,
    next_resend_at: Time,
    /// The buckets' digests, once the records changed only by merging
    /// (cleared by a merge).
    digests: Option<Vec<u64>>,
}

/// A shard's protocol on one replica, replaceable by another while it serves.
pub struct Switchable {
    me: NodeId,
    engine: Arc<dyn Engine>,
    protocol: Box<dyn Protocol>,
    /// The newest view's number and members.
    view_number: u64,
    members: Vec<NodeId>,
    drain: Option<Drain>,
    /// Requests that arrived while draining, for the next protocol.
    held: Vec<ClientRequest>,
    /// How records stream to a peer in a drain.
    pace: SnapshotPace,
    /// Numbers the streams of records this replica starts.
    stream_numbers: StreamNumbers,
    /// For tests of the checkers: every member answers *in sync*, so that
    /// nothing is merged.
    #[cfg(feature = "broken")]
    broken_without_merge: bool,
}

impl Switchable {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>, protocol: Box<dyn Protocol>, pace: SnapshotPace) -> Self {
        Self {
            me,
            engine,
            protocol,
            view_number: 0,
            members: Vec::new(),
            drain: None,
            held: Vec::new(),
            pace,
            stream_numbers: StreamNumbers::default(),
            #[cfg(feature = "broken")]
            broken_without_merge: false,
        }
    }

    /// For tests of the checkers: a replica that claims to hold what every
    /// peer holds, so transitions skip the merge.
    #[cfg(feature = "broken")]
    pub fn broken_without_merge(self) -> Self {
        Self { broken_without_merge: true, ..self }
    }

    /// Installs the next mode's protocol, made by `make` over the engine:
    /// called with the view that ends a transition (or any later one), before
    /// that view is handed to [`Protocol::on_view`]. A replica outside the
    /// view's members did not take part in the drain: what it holds may be
    /// writes the shard lost under the old protocol's guarantees (an eventual
    /// primary's unshipped writes), which no version order across protocols
    /// can tell apart, so it starts empty and joins as a newcomer.
    pub fn replace(&mut self, view: &ShardView, make: impl FnOnce() -> Box<dyn Protocol>) {
        if view.position(self.me).is_none() {
            if let Err(error) = self.engine.clear() {
                tracing::error!(replica = %self.me, %error, "cannot empty a shard that missed a transition");
            }
        }
        self.protocol = make();
    }

    /// Whether a draining view is being worked through here.
    pub fn draining(&self) -> bool {
        self.drain.is_some()
    }

    /// What every handler may rely on; cheap enough for every event.
    fn check_invariants(&self) {
        assert!(self.drain.is_some() || self.held.is_empty(), "{}: requests held with no drain", self.me);
        if let Some(drain) = &self.drain {
            assert!(
                drain.view <= self.view_number,
                "{}: draining view {} ahead of view {}",
                self.me,
                drain.view,
                self.view_number
            );
        }
    }

    fn peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().copied().filter(|member| *member != self.me)
    }

    fn heard_everyone_quiet(&self, drain: &Drain) -> bool {
        drain.quiet && self.peers().all(|peer| drain.quiet_peers.contains(&peer))
    }

    /// The draining view in which this replica holds the same records as
    /// every member, once it does.
    pub fn drained(&self) -> Option<u64> {
        let drain = self.drain.as_ref()?;
        let merged = self.protocol.copies_equal_when_quiescent()
            || self.peers().all(|peer| drain.merged_from.contains(&peer));
        (self.heard_everyone_quiet(drain) && merged).then_some(drain.view)
    }

    /// An order-independent summary of each bucket's records, computed once
    /// per drain and again after a merge (a scan of the whole shard). A
    /// record counts by what the merge orders it by, not by its value: the
    /// merge keeps either of two records that agree on those, and hashing
    /// every value made the drain of a shard of 1 GB take longer than a
    /// migration's cut may.
    fn digests(&mut self) -> Result<Vec<u64>, OperationError> {
        if let Some(digests) = self.drain.as_ref().and_then(|drain| drain.digests.clone()) {
            return Ok(digests);
        }
        let mut digests = vec![0u64; DIGEST_BUCKETS];
        for_each_entry(self.engine.as_ref(), |key, raw| {
            let digest = &mut digests[bucket_of(&key)];
            let summary = match Record::decode(raw.clone()) {
                Ok(record) => record_hash(&key, &record),
                Err(_) => hash(&[&key, &raw]),
            };
            *digest = digest.wrapping_add(summary);
            Ok(())
        })?;
        if let Some(drain) = self.drain.as_mut() {
            drain.digests = Some(digests.clone());
        }
        Ok(digests)
    }

    /// Keeps, per key, the record that ranks highest ([`Record::rank`]).
    fn merge(&mut self, entries: Vec<(Bytes, Bytes)>) {
        for (key, raw) in entries {
            let Ok(incoming) = Record::decode(raw.clone()) else { continue };
            let local = match self.engine.get(&key) {
                Ok(local) => local.and_then(|raw| Record::decode(raw).ok()),
                Err(error) => {
                    tracing::error!(replica = %self.me, %error, "cannot read a record to merge");
                    continue;
                }
            };
            let newer = local.as_ref().is_none_or(|local| incoming.rank() > local.rank());
            if newer {
                match self.engine.put(&key, raw) {
                    Ok(()) => self.protocol.on_merged(&key, local.as_ref(), &incoming),
                    Err(error) => tracing::error!(replica = %self.me, %error, "cannot store a merged record"),
                }
            }
        }
    }

    fn on_transition(&mut self, from: NodeId, message: TransitionMessage, fx: &mut Effects) {
        let in_view = self.drain.as_ref().is_some_and(|drain| drain.view == message.view());
        if !in_view || !self.members.contains(&from) || from == self.me {
            return;
        }
        let view = message.view();
        let drain = self.drain.as_mut().expect("checked above");
        match message {
            TransitionMessage::Quiet { .. } => {
                let news = drain.quiet_peers.insert(from);
                let drain = self.drain.as_ref().expect("checked above");
                if news && self.heard_everyone_quiet(drain) && drain.merged_from.is_empty() {
                    // Perhaps the last one heard: ask for records now (only
                    // on news: each Quiet answered with Quiets multiplies).
                    self.drain.as_mut().expect("checked above").next_resend_at = 0;
                    self.drain_step(fx);
                }
            }
            TransitionMessage::InSync { .. } => {
                drain.merged_from.insert(from);
            }
            TransitionMessage::Records { chunk, entries, .. } => {
                let receiver = drain.receivers.entry(from).or_default();
                if let Arrival::Apply { .. } = receiver.arrive(from, chunk) {
                    self.merge(entries);
                    let drain = self.drain.as_mut().expect("checked above");
                    drain.digests = None;
                    if drain.receivers.get_mut(&from).expect("inserted above").applied(chunk) {
                        drain.merged_from.insert(from);
                    }
                }
                let drain = self.drain.as_ref().expect("checked above");
                if let Some((stream, index)) = drain.receivers.get(&from).and_then(SnapshotReceiver::ack) {
                    fx.send(from, PeerMessage::new(&TransitionMessage::RecordsAck { view, stream, index }));
                }
            }
            TransitionMessage::RecordsAck { stream, index, .. } => {
                let now = fx.now();
                if let Some(records) = drain.streams.get_mut(&from) {
                    records.on_ack(stream, index, now);
                    self.send_records(from, fx);
                }
            }
            TransitionMessage::RecordsRequest { digests, .. } => {
                // Answered only once this replica's records can no longer
                // change but by merging; the requester asks again until then.
                let under_way = drain.streams.contains_key(&from);
                if under_way || !self.heard_everyone_quiet(self.drain.as_ref().expect("checked above")) {
                    return;
                }
                #[cfg(feature = "broken")]
                if self.broken_without_merge {
                    return fx.send(from, PeerMessage::new(&TransitionMessage::InSync { view }));
                }
                let mine = match self.digests() {
                    Ok(mine) => mine,
                    Err(error) => {
                        return tracing::error!(replica = %self.me, %error, "cannot read the shard for a peer")
                    }
                };
                let differing: Vec<bool> =
                    (0..DIGEST_BUCKETS).map(|bucket| digests.get(bucket) != Some(&mine[bucket])).collect();
                if !differing.contains(&true) {
                    return fx.send(from, PeerMessage::new(&TransitionMessage::InSync { view }));
                }
                let records =
                    self.stream_numbers.start(fx.now(), self.pace).only(move |key| differing[bucket_of(key)]);
                self.drain.as_mut().expect("checked above").streams.insert(from, records);
                self.send_records(from, fx);
            }
        }
    }

    /// Sends a peer what its stream of records has due.
    fn send_records(&mut self, to: NodeId, fx: &mut Effects) {
        let Some(drain) = self.drain.as_mut() else { return };
        let view = drain.view;
        let Some(records) = drain.streams.get_mut(&to) else { return };
        match records.poll(self.engine.as_ref(), fx.now(), RESEND_MS, &mut self.stream_numbers) {
            Ok(chunks) => {
                for (chunk, entries) in chunks {
                    fx.send(to, PeerMessage::new(&TransitionMessage::Records { view, chunk, entries }));
                }
            }
            Err(error) => tracing::error!(replica = %self.me, %error, "cannot read the shard for a peer"),
        }
    }

    fn drain_step(&mut self, fx: &mut Effects) {
        let now = fx.now();
        let streaming: Vec<NodeId> = self.drain.as_ref().map_or_else(Vec::new, |drain| {
            drain.streams.iter().filter(|(_, records)| !records.finished()).map(|(peer, _)| *peer).collect()
        });
        for peer in streaming {
            self.send_records(peer, fx);
        }
        let quiescent = self.protocol.quiescent();
        let Some(drain) = self.drain.as_mut() else { return };
        drain.quiet |= quiescent;
        if !drain.quiet || now < drain.next_resend_at {
            return;
        }
        drain.next_resend_at = now + RESEND_MS;
        let drain = self.drain.as_ref().expect("checked above");
        let view = drain.view;
        let ask = self.heard_everyone_quiet(drain);
        let unmerged: Vec<NodeId> = self.peers().filter(|peer| !drain.merged_from.contains(peer)).collect();
        let peers: Vec<NodeId> = self.peers().collect();
        for peer in peers {
            fx.send(peer, PeerMessage::new(&TransitionMessage::Quiet { view }));
        }
        if ask && !unmerged.is_empty() && !self.protocol.copies_equal_when_quiescent() {
            let digests = match self.digests() {
                Ok(digests) => digests,
                Err(error) => {
                    tracing::error!(replica = %self.me, %error, "cannot read the shard to summarise it");
                    return;
                }
            };
            for peer in unmerged {
                let request = TransitionMessage::RecordsRequest { view, digests: digests.clone() };
                fx.send(peer, PeerMessage::new(&request));
            }
        }
    }
}

impl Protocol for Switchable {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        self.check_invariants();
        if self.drain.is_none() {
            return self.protocol.on_client(request, fx);
        }
        match &request.operation {
            Operation::Get { key, consistency: Consistency::Eventual } => {
                let reply = match read_visible(self.engine.as_ref(), key) {
                    Ok(value) => ClientReply::Value(value),
                    Err(error) => ClientReply::Failed(error),
                };
                fx.reply(request.id, reply);
            }
            _ => self.held.push(request),
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        self.check_invariants();
        match message.open::<TransitionMessage>() {
            Some(Ok(message)) => self.on_transition(from, message, fx),
            Some(Err(error)) => tracing::warn!(replica = %self.me, %from, %error, "dropped a peer message"),
            None => {
                // Once every member is quiet, an old-protocol message is late
                // (a delayed accept) and could change records that peers
                // have already been sent: dropped. Before that this replica
                // may still need it (a chain's acknowledgements).
                if self.drain.as_ref().is_some_and(|drain| self.heard_everyone_quiet(drain)) {
                    return;
                }
                self.protocol.on_peer(from, message, fx);
            }
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        self.check_invariants();
        // Once every member is quiet the old protocol has nothing left to
        // do, and its timers (resends, collection) would change records the
        // digests sum up: it sleeps until the switch.
        if !self.drain.as_ref().is_some_and(|drain| self.heard_everyone_quiet(drain)) {
            self.protocol.on_tick(fx);
        }
        self.drain_step(fx);
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        self.check_invariants();
        self.protocol.on_view(view, fx);
        if view.number < self.view_number {
            return; // a late grant of an older view
        }
        self.view_number = view.number;
        self.members = view.replicas.clone();
        if view.draining {
            if self.drain.as_ref().map(|drain| drain.view) != Some(view.number) {
                // Every view starts the exchange over: its members may differ.
                self.drain = Some(Drain {
                    view: view.number,
                    quiet: false,
                    quiet_peers: BTreeSet::new(),
                    merged_from: BTreeSet::new(),
                    receivers: BTreeMap::new(),
                    streams: BTreeMap::new(),
                    next_resend_at: 0,
                    digests: None,
                });
                self.drain_step(fx);
            }
        } else if self.drain.take().is_some() {
            for request in std::mem::take(&mut self.held) {
                self.protocol.on_client(request, fx);
            }
        }
    }

    fn progress(&self) -> Progress {
        Progress { drained: self.drained(), ..self.protocol.progress() }
    }

    fn tombstones(&self) -> u64 {
        self.protocol.tombstones()
    }

    fn quiescent(&self) -> bool {
        self.drain.is_none() && self.protocol.quiescent()
    }

    fn unshipped(&self) -> Vec<Vec<(Bytes, Bytes)>> {
        self.protocol.unshipped()
    }

    fn held_for_handoff(&self) -> Option<Arc<dyn Engine>> {
        self.protocol.held_for_handoff()
    }

    /// Not while draining: records merged beneath the old protocol now
    /// would change what the members compared; the leaving member resends.
    fn adopt(&mut self, records: Vec<(Bytes, Bytes)>, held: bool, fx: &mut Effects) -> bool {
        self.drain.is_none() && self.protocol.adopt(records, held, fx)
    }

    fn peers_in_step(&self) -> bool {
        self.protocol.peers_in_step()
    }

    fn write_position(&self) -> u64 {
        self.protocol.write_position()
    }

    fn replicas_holding(&self, position: u64) -> usize {
        self.protocol.replicas_holding(position)
    }

    fn replicated_through(&self) -> Option<u64> {
        self.protocol.replicated_through()
    }
}

#[cfg(test)]
mod tests {
    use tessera_engine::MemoryEngine;

    use super::*;
    use crate::registry::{Mode, Start, Tuning};
    use crate::test_support::{put, view};
    use crate::Effect;

    /// Two members of `mode`, the first written to, drained in view 2; answers
    /// whether both reported drained and whether records were asked for.
    fn drain_two(mode: &str) -> (bool, bool) {
        let mode = Mode::named(mode).unwrap();
        let mut members: Vec<Switchable> = [1, 2]
            .into_iter()
            .map(|me| {
                let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
                let protocol = mode.instance(NodeId(me), engine.clone(), Start::Open, &Tuning::default());
                Switchable::new(NodeId(me), engine, protocol, SnapshotPace::default())
            })
            .collect();
        let mut fx = Effects::new(10);
        let mut asked = false;
        let mut deliver = |members: &mut Vec<Switchable>, fx: &mut Effects, from: usize| {
            let mut queue: Vec<(usize, Effect)> =
                fx.take().into_iter().map(|effect| (from, effect)).collect();
            while let Some((sender, effect)) = queue.pop() {
                let Effect::Send { to, message } = effect else { continue };
                asked |= matches!(
                    message.open::<TransitionMessage>(),
                    Some(Ok(TransitionMessage::RecordsRequest { .. }))
                );
                let receiver = members.iter().position(|member| member.me == to).unwrap();
                members[receiver].on_peer(NodeId(sender as u32 + 1), message, fx);
                queue.extend(fx.take().into_iter().map(|effect| (receiver, effect)));
            }
        };
        for index in 0..2 {
            members[index].on_view(&view(1, &[1, 2]), &mut fx);
            deliver(&mut members, &mut fx, index);
        }
        members[0].on_client(put(1, "k", "v"), &mut fx);
        deliver(&mut members, &mut fx, 0);
        let draining = ShardView { draining: true, ..view(2, &[1, 2]) };
        for round in 0..20 {
            let mut fx = Effects::new(20 + round * RESEND_MS);
            for index in 0..2 {
                if round == 0 {
                    members[index].on_view(&draining, &mut fx);
                }
                members[index].on_tick(&mut fx);
                deliver(&mut members, &mut fx, index);
            }
        }
        (members.iter().all(|member| member.drained() == Some(2)), asked)
    }

    #[test]
    fn a_drain_of_equal_copies_skips_the_merge_and_one_of_diverging_copies_merges() {
        assert_eq!(drain_two("chain"), (true, false), "chain copies are equal once quiet");
        assert_eq!(drain_two("primary-backup"), (true, false));
        assert_eq!(drain_two("multi-master"), (true, true), "multi-master members exchange digests");
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::{chunk, entries};

    fn message() -> impl Strategy<Value = TransitionMessage> {
        prop_oneof![
            any::<u64>().prop_map(|view| TransitionMessage::Quiet { view }),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..70))
                .prop_map(|(view, digests)| TransitionMessage::RecordsRequest { view, digests }),
            any::<u64>().prop_map(|view| TransitionMessage::InSync { view }),
            (any::<u64>(), chunk(), entries())
                .prop_map(|(view, chunk, entries)| TransitionMessage::Records { view, chunk, entries }),
            (any::<u64>(), any::<u64>(), any::<u32>())
                .prop_map(|(view, stream, index)| TransitionMessage::RecordsAck { view, stream, index }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
