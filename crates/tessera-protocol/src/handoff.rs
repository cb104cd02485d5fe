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
//! A record older than the tombstone grace period is given up on, and a
//! member refuses one: a delete of its key may have been collected since,
//! and the record would bring the key back.

use std::collections::BTreeMap;

use bytes::{BufMut, Bytes};

use crate::codec::{put_entries, CodecError, Family, Message, Reader};
use crate::record::Record;
use crate::{entries_bytes, resend_due, Effects, NodeId, PeerMessage, Time};

/// Batches sent and not yet acknowledged, at most.
const WINDOW_BATCHES: usize = 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandoffMessage {
    /// Records a member of view `view` of shard `from_shard` took and had
    /// not shipped when it left: the receiver keeps those that outrank what
    /// it holds and passes them on. (The receiver's shard is the one that
    /// owns their keys now, which a migration may have changed.)
    Records { from_shard: u32, view: u64, batch: u64, records: Vec<(Bytes, Bytes)> },
    /// The receiver holds batch `batch` of that handoff.
    Acked { from_shard: u32, view: u64, batch: u64 },
}

const RECORDS: u8 = 1;
const ACKED: u8 = 2;

impl Message for HandoffMessage {
    const FAMILY: Family = Family(18);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            HandoffMessage::Records { from_shard, view, batch, records } => {
                out.put_u8(RECORDS);
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
    retransmit_after_ms: u64,
    grace_ms: u64,
    /// Records given up on, past the grace period.
    abandoned: usize,
}

impl Handoff {
    /// A handoff of `messages` from `me`, which ran `view` of `from_shard`,
    /// or `None` if there is nothing to hand over. Each message travels
    /// whole, to the owner of its first key: the caller groups records so
    /// that one owner holds each message's keys.
    pub fn new(
        me: NodeId,
        from_shard: u32,
        view: u64,
        messages: Vec<Vec<(Bytes, Bytes)>>,
        retransmit_after_ms: u64,
        grace_ms: u64,
    ) -> Option<Self> {
        let records: usize = messages.iter().map(Vec::len).sum();
        let batches: BTreeMap<u64, Unacknowledged> = messages
            .into_iter()
            .filter(|records| !records.is_empty())
            .zip(1..)
            .map(|(records, batch)| {
                let oldest_ms = oldest_ms(&records);
                (batch, Unacknowledged { records, oldest_ms, sent_at: None, sent_to: Vec::new() })
            })
            .collect();
        if batches.is_empty() {
            return None;
        }
        tracing::info!(replica = %me, shard = from_shard, view, records, "handing unshipped writes to the shard's members");
        Some(Self { me, from_shard, view, batches, retransmit_after_ms, grace_ms, abandoned: 0 })
    }

    /// Every record is held by a member or given up on.
    pub fn done(&self) -> bool {
        self.batches.is_empty()
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
        let mut in_flight = self.batches.values().filter(|batch| batch.sent_at.is_some()).count();
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
            let message = HandoffMessage::Records {
                from_shard: self.from_shard,
                view: self.view,
                batch: *number,
                records: batch.records.clone(),
            };
            fx.send_to_shard(shard, to, PeerMessage::new(&message));
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
        let mut handoff = Handoff::new(NodeId(1), 0, 7, messages, 50, 1_000).unwrap();
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
        let mut handoff = Handoff::new(NodeId(1), 0, 3, messages, 50, 1_000).unwrap();
        let mut fx = Effects::new(1_500);
        handoff.on_tick(&route, &mut fx);
        assert_eq!(handoff.abandoned(), 1);
        let mut fx = Effects::new(2_000);
        handoff.on_tick(&route, &mut fx);
        assert!(handoff.done(), "every record is past the grace");
        assert_eq!(handoff.abandoned(), 2);
    }

    #[test]
    fn nothing_to_hand_over_is_no_handoff() {
        assert!(Handoff::new(NodeId(1), 0, 3, vec![Vec::new()], 50, 1_000).is_none());
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
            check_codec(&HandoffMessage::Records { from_shard, view, batch, records }, cut);
            check_codec(&HandoffMessage::Acked { from_shard, view, batch }, cut);
        }
    }
}
