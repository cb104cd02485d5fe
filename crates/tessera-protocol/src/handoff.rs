//! A member removed from its view while alive hands the writes it took and
//! never shipped to the members that remain (docs/PROTOCOLS.md, "AA+EC: a
//! member removed alive").
//!
//! An eventual active–active member acknowledges a write before any peer
//! holds it. A node paused past the failure timeout, or cut off from the
//! coordinator, is removed while it may still hold such writes, and when it
//! runs again it may take more before it learns of the removal; its peers,
//! in a later view by then, ignore what it ships. Leaving the shard there
//! would drop writes a live node acknowledged. Instead the node keeps their
//! records (a [`Handoff`], in memory: the shard itself is closed) and sends
//! them in batches to a member of the view that dropped it. That member
//! stores each record where it outranks what is held and ships it on to its
//! own peers; a record keeps its version and origin, so last writer wins
//! decides as it would have. Unacknowledged batches are resent, each time to
//! the next member, so one member down does not stop the handoff.
//!
//! The node may also be the last to hold records its peers acknowledged long
//! ago: the members that held them were removed or restarted empty since,
//! and those that replaced them were not yet repaired by anti-entropy. So
//! after what it never shipped, the handoff reads the engine the node is
//! leaving, a page at a time as the window allows, and hands over every
//! value of a key the shard kept that is still within the grace period
//! (below) as *held* records, which a member passes on only where they
//! change what it holds. (Not deletes: among them are the sweep's deletes
//! of keys a migration moved away, which would delete those keys if their
//! slot came back.)
//!
//! A record older than the tombstone grace period is given up on, and a
//! member refuses one: a delete of its key may have been collected since,
//! and the record would bring the key back.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::{Engine, KeyRange, ScanCursor};

use crate::codec::{put_entries, CodecError, Family, Message, Reader};
use crate::migration::KeyFilter;
use crate::record::Record;
use crate::snapshot::SNAPSHOT_CHUNK_BYTES;
use crate::{entries_bytes, resend_due, Effects, NodeId, PeerMessage, Time};

/// Batches sent and not yet acknowledged, at most.
const WINDOW_BATCHES: usize = 4;
/// Records read from the left engine at a time.
const HELD_PAGE: usize = 256;
/// Pages read a tick at most: most of a large engine is older than the
/// grace, and reading it whole at once would hold the node's tick up.
const HELD_PAGES_PER_TICK: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandoffMessage {
    /// Records a member of view `view` of shard `from_shard` took and had
    /// not shipped when it left: the receiver keeps those that outrank what
    /// it holds and passes them on. (The receiver's shard is the one that
    /// owns their keys now, which a migration may have changed.)
    Records { from_shard: u32, view: u64, batch: u64, records: Vec<(Bytes, Bytes)> },
    /// The receiver holds batch `batch` of that handoff.
    Acked { from_shard: u32, view: u64, batch: u64 },
    /// Records the member held when it left, shipped or not: the receiver
    /// keeps those that outrank what it holds and passes on only those.
    Held { from_shard: u32, view: u64, batch: u64, records: Vec<(Bytes, Bytes)> },
}

const RECORDS: u8 = 1;
const ACKED: u8 = 2;
const HELD: u8 = 3;

impl Message for HandoffMessage {
    const FAMILY: Family = Family(18);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            HandoffMessage::Records { from_shard, view, batch, records }
            | HandoffMessage::Held { from_shard, view, batch, records } => {
                out.put_u8(if matches!(self, HandoffMessage::Held { .. }) { HELD } else { RECORDS });
                out.put_u32_le(*from_shard);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
                put_entries(out, records);
            }
            HandoffMessage::Acked { from_shard, view, batch } => {
                out.put_u8(ACKED);
                out.put_u32_le(*from_shard);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            RECORDS => HandoffMessage::Records {
                from_shard: reader.u32()?,
                view: reader.u64()?,
                batch: reader.u64()?,
                records: reader.entries()?,
            },
            ACKED => {
                HandoffMessage::Acked { from_shard: reader.u32()?, view: reader.u64()?, batch: reader.u64()? }
            }
            HELD => HandoffMessage::Held {
                from_shard: reader.u32()?,
                view: reader.u64()?,
                batch: reader.u64()?,
                records: reader.entries()?,
            },
            _ => return Err(CodecError("unknown handoff message")),
        })
    }
}

/// The handoff (its shard and view) and the batch `message` acknowledges,
/// if it is a handoff's acknowledgement: it goes to the node's handoff, not
/// to a replica.
pub fn acknowledgement(message: &PeerMessage) -> Option<(u32, u64, u64)> {
    match message.open::<HandoffMessage>()? {
        Ok(HandoffMessage::Acked { from_shard, view, batch }) => Some((from_shard, view, batch)),
        _ => None,
    }
}

/// A batch of the handoff that no member has acknowledged.
#[derive(Debug)]
struct Unacknowledged {
    records: Vec<(Bytes, Bytes)>,
    /// The physical time of the oldest record's version: until it is past
    /// the grace, no record is looked at for giving up.
    oldest_ms: u64,
    sent_at: Option<Time>,
    /// The members it was sent to: an acknowledgement from one of them ends it.
    sent_to: Vec<NodeId>,
    /// Records read from the left engine rather than from an outbox.
    held: bool,
}

impl Unacknowledged {
    fn new(records: Vec<(Bytes, Bytes)>, held: bool) -> Self {
        Self { oldest_ms: oldest_ms(&records), records, sent_at: None, sent_to: Vec::new(), held }
    }
}

/// The engine of the shard the node left, read for the records it holds
/// within the grace period; `None` once read to its end.
struct HeldRecords {
    engine: Arc<dyn Engine>,
    /// The keys the shard kept when the node left it: what else the engine
    /// holds is not the shard's to hand over.
    keeps: KeyFilter,
    cursor: Option<ScanCursor>,
    /// Records read and found within the grace period.
    found: usize,
}

impl std::fmt::Debug for HeldRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldRecords")
            .field("done", &self.cursor.is_none())
            .field("found", &self.found)
            .finish()
    }
}

/// The physical time of a record's version (0 for one that does not
/// decode: given up on at once).
fn version_ms(raw: &Bytes) -> u64 {
    Record::decode(raw.clone()).map_or(0, |record| record.version.physical_ms())
}

fn oldest_ms(records: &[(Bytes, Bytes)]) -> u64 {
    records.iter().map(|(_, raw)| version_ms(raw)).min().unwrap_or(u64::MAX)
}

/// Where a batch goes: the shard that owns its keys now and that shard's
/// members, by the node's newest map (`None`: nowhere yet).
pub type Route<'a> = &'a dyn Fn(&[u8]) -> Option<(u32, Vec<NodeId>)>;

/// What a node that left a shard still owes it: the records it took that no
/// peer acknowledged, until a member of the shard that owns them holds them.
#[derive(Debug)]
pub struct Handoff {
    me: NodeId,
    /// The shard the node left and the view it ran then: they name the
    /// handoff, since the node may leave the same shard again later (in a
    /// later view).
    from_shard: u32,
    view: u64,
    batches: BTreeMap<u64, Unacknowledged>,
    next_batch: u64,
    /// The left engine, still to be read.
    held: Option<HeldRecords>,
    retransmit_after_ms: u64,
    grace_ms: u64,
    /// Records given up on, past the grace period.
    abandoned: usize,
}

impl Handoff {
    /// A handoff of `messages` from `me`, which ran `view` of `from_shard`,
    /// then of the records `held` (the engine the node leaves, and the keys
    /// of it the shard kept) keeps within the grace period; `None` if there
    /// is nothing to hand over. Each message travels whole, to the owner of
    /// its first key: the caller groups records so that one owner holds each
    /// message's keys.
    pub fn new(
        me: NodeId,
        from_shard: u32,
        view: u64,
        messages: Vec<Vec<(Bytes, Bytes)>>,
        held: Option<(Arc<dyn Engine>, KeyFilter)>,
        retransmit_after_ms: u64,
        grace_ms: u64,
    ) -> Option<Self> {
        let records: usize = messages.iter().map(Vec::len).sum();
        let batches: BTreeMap<u64, Unacknowledged> = messages
            .into_iter()
            .filter(|records| !records.is_empty())
            .zip(1..)
            .map(|(records, batch)| (batch, Unacknowledged::new(records, false)))
            .collect();
        if batches.is_empty() && held.is_none() {
            return None;
        }
        let held = held.map(|(engine, keeps)| HeldRecords {
            engine,
            keeps,
            cursor: Some(ScanCursor::start()),
            found: 0,
        });
        tracing::info!(replica = %me, shard = from_shard, view, records, "handing unshipped writes to the shard's members");
        let next_batch = batches.len() as u64 + 1;
        Some(Self {
            me,
            from_shard,
            view,
            batches,
            next_batch,
            held,
            retransmit_after_ms,
            grace_ms,
            abandoned: 0,
        })
    }

    /// Every record is held by a member or given up on.
    pub fn done(&self) -> bool {
        self.batches.is_empty() && self.held.is_none()
    }

    /// The shard this handoff left.
    pub fn from_shard(&self) -> u32 {
        self.from_shard
    }

    /// Reads no more of the left engine, which the node is about to open
    /// again (it rejoined the shard): two instances must not share its files.
    /// The records read so far are still handed over.
    pub fn stop_reading(&mut self) {
        if let Some(held) = self.held.take() {
            tracing::info!(replica = %self.me, shard = self.from_shard, view = self.view, records = held.found, "rejoined the shard before its held records were all read for the handoff");
        }
    }

    /// Reads the left engine while fewer than a window of batches wait (a
    /// few pages a tick), into batches whose keys share the shard `route`
    /// sends them to. A record past the grace period is skipped: it would
    /// be given up on.
    fn read_held(&mut self, route: Route, now: Time) {
        let grace_ms = self.grace_ms;
        for _ in 0..HELD_PAGES_PER_TICK {
            if self.batches.len() >= WINDOW_BATCHES {
                return;
            }
            let Some(held) = &mut self.held else { return };
            let Some(cursor) = held.cursor.take() else {
                tracing::info!(replica = %self.me, shard = self.from_shard, view = self.view, records = held.found, "handed over the records held within the grace period");
                self.held = None;
                return;
            };
            let page = match held.engine.scan(&KeyRange::all(), &cursor, HELD_PAGE) {
                Ok(page) => page,
                Err(error) => {
                    tracing::error!(replica = %self.me, %error, "cannot read a left shard's records to hand them over");
                    self.held = None;
                    return;
                }
            };
            held.cursor = page.next;
            // Deletes stay behind: the engine also holds the sweep's deletes
            // of keys a migration took away, and if one of their slots has
            // come back since, they would delete its keys.
            let within_grace = |raw: &Bytes| {
                Record::decode(raw.clone())
                    .is_ok_and(|record| !record.tombstone && record.version.physical_ms() + grace_ms > now)
            };
            let found: Vec<(Bytes, Bytes)> = page
                .entries
                .into_iter()
                .filter(|(key, raw)| (held.keeps)(key) && within_grace(raw))
                .collect();
            held.found += found.len();
            self.queue_held(route, found);
        }
    }

    /// Queues held records in batches whose keys share the shard `route`
    /// sends them to, each of about a chunk's bytes at most. (Unlike an
    /// outbox's, held records need not travel together.)
    fn queue_held(&mut self, route: Route, records: Vec<(Bytes, Bytes)>) {
        // Per shard: its records, and their bytes.
        type Filling = (Vec<(Bytes, Bytes)>, usize);
        let mut by_shard: BTreeMap<Option<u32>, Filling> = BTreeMap::new();
        let mut batches = Vec::new();
        for (key, raw) in records {
            let (records, bytes) = by_shard.entry(route(&key).map(|(shard, _)| shard)).or_default();
            *bytes += key.len() + raw.len();
            records.push((key, raw));
            if *bytes >= SNAPSHOT_CHUNK_BYTES {
                batches.push(std::mem::take(records));
                *bytes = 0;
            }
        }
        batches.extend(by_shard.into_values().map(|(records, _)| records));
        for records in batches.into_iter().filter(|records| !records.is_empty()) {
            self.batches.insert(self.next_batch, Unacknowledged::new(records, true));
            self.next_batch += 1;
        }
    }

    /// Records given up on so far.
    pub fn abandoned(&self) -> usize {
        self.abandoned
    }

    /// Gives up on records past the grace period, then sends batches while
    /// the window allows and resends those unacknowledged for too long, each
    /// where `route` sends it now (to the next of its members each time, so
    /// that one member down does not stop the handoff).
    pub fn on_tick(&mut self, route: Route, fx: &mut Effects) {
        let now = fx.now();
        let grace_ms = self.grace_ms;
        let mut abandoned = 0;
        let past_grace = |physical_ms: u64| physical_ms + grace_ms <= now;
        self.batches.retain(|_, batch| {
            if !past_grace(batch.oldest_ms) {
                return true;
            }
            let before = batch.records.len();
            batch.records.retain(|(_, raw)| !past_grace(version_ms(raw)));
            abandoned += before - batch.records.len();
            batch.oldest_ms = oldest_ms(&batch.records);
            !batch.records.is_empty()
        });
        if abandoned > 0 {
            tracing::warn!(replica = %self.me, shard = self.from_shard, view = self.view, abandoned, "gave up handing over writes past the tombstone grace");
            self.abandoned += abandoned;
        }
        self.read_held(route, now);
        let mut in_flight = self.batches.values().filter(|batch| batch.sent_at.is_some()).count();
        let mut to_split = Vec::new();
        for (number, batch) in &mut self.batches {
            let due = match batch.sent_at {
                None => in_flight < WINDOW_BATCHES,
                Some(sent_at) => resend_due(now.saturating_sub(sent_at), self.retransmit_after_ms, || {
                    entries_bytes(&batch.records)
                }),
            };
            if !due {
                continue;
            }
            let Some((shard, members)) = route(&batch.records[0].0) else { continue };
            // Held records are independent of each other: a batch a moved
            // slot would have refused everywhere goes again in parts.
            let owner = |key: &[u8]| route(key).map(|(shard, _)| shard);
            if batch.held
                && batch.sent_at.is_some()
                && !batch.records.iter().all(|(key, _)| owner(key) == Some(shard))
            {
                to_split.push(*number);
                continue;
            }
            let members: Vec<NodeId> = members.into_iter().filter(|node| *node != self.me).collect();
            if members.is_empty() {
                continue;
            }
            in_flight += usize::from(batch.sent_at.is_none());
            batch.sent_at = Some(now);
            // Each send of a batch goes to the next member, and batches start
            // at different members.
            let to = members[(*number as usize + batch.sent_to.len()) % members.len()];
            batch.sent_to.push(to);
            let (from_shard, view, batch_number, records) =
                (self.from_shard, self.view, *number, batch.records.clone());
            let message = if batch.held {
                HandoffMessage::Held { from_shard, view, batch: batch_number, records }
            } else {
                HandoffMessage::Records { from_shard, view, batch: batch_number, records }
            };
            fx.send_to_shard(shard, to, PeerMessage::new(&message));
        }
        for number in to_split {
            if let Some(batch) = self.batches.remove(&number) {
                self.queue_held(route, batch.records);
            }
        }
    }

    /// `from` acknowledged `batch` of the handoff from `view` of `from_shard`.
    pub fn on_acked(&mut self, from: NodeId, (from_shard, view, batch): (u32, u64, u64)) {
        if (from_shard, view) != (self.from_shard, self.view) {
            return;
        }
        if self.batches.get(&batch).is_some_and(|unacknowledged| unacknowledged.sent_to.contains(&from)) {
            self.batches.remove(&batch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::check_codec;
    use crate::record::Version;
    use crate::Effect;
    use proptest::prelude::*;

    fn record(ms: u64, value: &str) -> Bytes {
        Record::value(Version::new(ms, 0), NodeId(1), Bytes::from(value.to_string())).encode()
    }

    fn sent(fx: &mut Effects) -> Vec<(u32, NodeId, u64)> {
        fx.take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::SendToShard { shard, to, message } => match message.open::<HandoffMessage>() {
                    Some(Ok(HandoffMessage::Records { batch, .. })) => Some((shard, to, batch)),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    /// Keys starting with "a" belong to shard 5 on nodes 1–3, the others to
    /// shard 6 on node 4.
    fn route(key: &[u8]) -> Option<(u32, Vec<NodeId>)> {
        if key.starts_with(b"a") {
            Some((5, vec![NodeId(1), NodeId(2), NodeId(3)]))
        } else {
            Some((6, vec![NodeId(4)]))
        }
    }

    #[test]
    fn batches_go_to_their_owner_and_are_resent_to_the_next_member_until_one_acknowledges() {
        let messages =
            vec![vec![(Bytes::from("a1"), record(100, "1"))], vec![(Bytes::from("b1"), record(100, "2"))]];
        let mut handoff = Handoff::new(NodeId(1), 0, 7, messages, None, 50, 1_000).unwrap();
        let mut fx = Effects::new(100);
        handoff.on_tick(&route, &mut fx);
        assert_eq!(sent(&mut fx), vec![(5, NodeId(3), 1), (6, NodeId(4), 2)], "never to itself");
        handoff.on_acked(NodeId(4), (0, 7, 2));
        handoff.on_acked(NodeId(3), (0, 6, 1));
        handoff.on_acked(NodeId(3), (1, 7, 1));
        handoff.on_acked(NodeId(2), (0, 7, 1));
        let mut fx = Effects::new(120);
        handoff.on_tick(&route, &mut fx);
        assert!(sent(&mut fx).is_empty(), "not yet due");
        let mut fx = Effects::new(150);
        handoff.on_tick(&route, &mut fx);
        assert_eq!(
            sent(&mut fx),
            vec![(5, NodeId(2), 1)],
            "another handoff's acknowledgement, or one from a node not sent the batch, counts for nothing"
        );
        handoff.on_acked(NodeId(2), (0, 7, 1));
        assert!(handoff.done());
        assert_eq!(handoff.abandoned(), 0);
    }

    #[test]
    fn records_past_the_grace_are_given_up() {
        let messages =
            vec![vec![(Bytes::from("old"), record(100, "1")), (Bytes::from("new"), record(900, "2"))]];
        let mut handoff = Handoff::new(NodeId(1), 0, 3, messages, None, 50, 1_000).unwrap();
        let mut fx = Effects::new(1_500);
        handoff.on_tick(&route, &mut fx);
        assert_eq!(handoff.abandoned(), 1);
        let mut fx = Effects::new(2_000);
        handoff.on_tick(&route, &mut fx);
        assert!(handoff.done(), "every record is past the grace");
        assert_eq!(handoff.abandoned(), 2);
    }

    fn every_key() -> KeyFilter {
        Arc::new(|_| true)
    }

    fn held_sent(fx: &mut Effects) -> Vec<(u32, Vec<Bytes>)> {
        fx.take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::SendToShard { shard, message, .. } => match message.open::<HandoffMessage>() {
                    Some(Ok(HandoffMessage::Held { records, .. })) => {
                        Some((shard, records.into_iter().map(|(key, _)| key).collect()))
                    }
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_left_engine_is_read_for_records_within_the_grace_and_sent_by_owner() {
        let engine = Arc::new(tessera_engine::MemoryEngine::new());
        for (key, ms) in [("a-old", 100), ("a1", 900), ("a2", 950), ("b1", 990), ("b-old", 50)] {
            engine.put(key.as_bytes(), record(ms, key)).unwrap();
        }
        engine.put(b"not-a-record", Bytes::from_static(b"\xff")).unwrap();
        let mut handoff =
            Handoff::new(NodeId(1), 0, 3, Vec::new(), Some((engine, every_key())), 50, 1_000).unwrap();
        let mut fx = Effects::new(1_200);
        handoff.on_tick(&route, &mut fx);
        let mut sent = held_sent(&mut fx);
        sent.iter_mut().for_each(|(_, keys)| keys.sort());
        sent.sort();
        assert_eq!(
            sent,
            vec![(5, vec![Bytes::from("a1"), Bytes::from("a2")]), (6, vec![Bytes::from("b1")])],
            "records past the grace (or not records) stay behind; each batch goes to its keys' shard"
        );
        assert!(!handoff.done());
        let (first, second) = (handoff.batches.keys().copied().min(), handoff.batches.keys().copied().max());
        let acked_by = |batch: u64| handoff.batches[&batch].sent_to[0];
        let acks: Vec<(NodeId, u64)> =
            [first, second].into_iter().flatten().map(|b| (acked_by(b), b)).collect();
        for (node, batch) in acks {
            handoff.on_acked(node, (0, 3, batch));
        }
        handoff.on_tick(&route, &mut Effects::new(1_250));
        assert!(handoff.done(), "every held record is with a member, and the engine read to its end");
    }

    #[test]
    fn a_rejoining_node_stops_reading_its_old_engine() {
        let engine = Arc::new(tessera_engine::MemoryEngine::new());
        engine.put(b"a1", record(900, "1")).unwrap();
        let mut handoff =
            Handoff::new(NodeId(1), 0, 3, Vec::new(), Some((engine.clone(), every_key())), 50, 1_000)
                .unwrap();
        handoff.stop_reading();
        assert!(handoff.done());
        assert_eq!(Arc::strong_count(&engine), 1, "the old instance is let go");
    }

    #[test]
    fn a_held_batch_a_moved_slot_splits_goes_again_in_parts() {
        let engine = Arc::new(tessera_engine::MemoryEngine::new());
        engine.put(b"a1", record(900, "1")).unwrap();
        engine.put(b"a2", record(900, "2")).unwrap();
        let mut handoff =
            Handoff::new(NodeId(1), 0, 3, Vec::new(), Some((engine, every_key())), 50, 1_000).unwrap();
        let mut fx = Effects::new(950);
        handoff.on_tick(&route, &mut fx);
        assert_eq!(held_sent(&mut fx).len(), 1);
        // "a2" moves to shard 6.
        let moved = |key: &[u8]| if key == b"a2" { Some((6, vec![NodeId(4)])) } else { route(key) };
        let mut fx = Effects::new(1_010);
        handoff.on_tick(&moved, &mut fx);
        assert!(held_sent(&mut fx).is_empty(), "split, not sent whole");
        let mut fx = Effects::new(1_020);
        handoff.on_tick(&moved, &mut fx);
        let mut sent = held_sent(&mut fx);
        sent.sort();
        assert_eq!(sent, vec![(5, vec![Bytes::from("a1")]), (6, vec![Bytes::from("a2")])]);
    }

    #[test]
    fn nothing_to_hand_over_is_no_handoff() {
        assert!(Handoff::new(NodeId(1), 0, 3, vec![Vec::new()], None, 50, 1_000).is_none());
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(
            from_shard in any::<u32>(),
            view in any::<u64>(),
            batch in any::<u64>(),
            records in crate::codec::strategies::entries(),
            cut in any::<usize>(),
        ) {
            check_codec(&HandoffMessage::Records { from_shard, view, batch, records: records.clone() }, cut);
            check_codec(&HandoffMessage::Held { from_shard, view, batch, records }, cut);
            check_codec(&HandoffMessage::Acked { from_shard, view, batch }, cut);
        }
    }
}
