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
    /// Records a member of view `view` took and had not shipped when it
    /// left: the receiver keeps those that outrank what it holds and passes
    /// them on.
    Records { view: u64, batch: u64, records: Vec<(Bytes, Bytes)> },
    /// The receiver holds batch `batch` of the handoff from view `view`.
    Acked { view: u64, batch: u64 },
}

const RECORDS: u8 = 1;
const ACKED: u8 = 2;

impl Message for HandoffMessage {
    const FAMILY: Family = Family(18);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            HandoffMessage::Records { view, batch, records } => {
                out.put_u8(RECORDS);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
                put_entries(out, records);
            }
            HandoffMessage::Acked { view, batch } => {
                out.put_u8(ACKED);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            RECORDS => HandoffMessage::Records {
                view: reader.u64()?,
                batch: reader.u64()?,
                records: reader.entries()?,
            },
            ACKED => HandoffMessage::Acked { view: reader.u64()?, batch: reader.u64()? },
            _ => return Err(CodecError("unknown handoff message")),
        })
    }
}

/// A batch of the handoff that no member has acknowledged.
#[derive(Debug)]
struct Unacknowledged {
    records: Vec<(Bytes, Bytes)>,
    sent_at: Option<Time>,
}

/// What a node that left a shard still owes it: the records it took that no
/// peer acknowledged, until a member of the later view holds them.
#[derive(Debug)]
pub struct Handoff {
    me: NodeId,
    /// The view the node ran when it left; it names the handoff, since the
    /// node may leave the same shard again later.
    view: u64,
    /// The members of the view that dropped the node.
    to: Vec<NodeId>,
    /// Which member the next send goes to.
    turn: usize,
    batches: BTreeMap<u64, Unacknowledged>,
    retransmit_after_ms: u64,
    grace_ms: u64,
    /// Records given up on, past the grace period.
    abandoned: usize,
}

impl Handoff {
    /// A handoff of `messages` (each a batch that must travel whole) from the
    /// member of `view` `me` to the members `to`, or `None` if there is
    /// nothing to hand over or no one to hand it to.
    pub fn new(
        me: NodeId,
        view: u64,
        messages: Vec<Vec<(Bytes, Bytes)>>,
        to: Vec<NodeId>,
        retransmit_after_ms: u64,
        grace_ms: u64,
    ) -> Option<Self> {
        let to: Vec<NodeId> = to.into_iter().filter(|node| *node != me).collect();
        let records: usize = messages.iter().map(Vec::len).sum();
        if to.is_empty() {
            if records > 0 {
                tracing::warn!(replica = %me, records, "left a shard with no member to hand its unshipped writes to");
            }
            return None;
        }
        let batches: BTreeMap<u64, Unacknowledged> = messages
            .into_iter()
            .filter(|records| !records.is_empty())
            .zip(1..)
            .map(|(records, batch)| (batch, Unacknowledged { records, sent_at: None }))
            .collect();
        if batches.is_empty() {
            return None;
        }
        tracing::info!(replica = %me, view, records, "handing unshipped writes to the shard's members");
        Some(Self { me, view, to, turn: 0, batches, retransmit_after_ms, grace_ms, abandoned: 0 })
    }

    /// The view the node ran when it left.
    pub fn view(&self) -> u64 {
        self.view
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
    /// the window allows and resends those unacknowledged for too long.
    pub fn on_tick(&mut self, fx: &mut Effects) {
        let now = fx.now();
        let grace_ms = self.grace_ms;
        let mut abandoned = 0;
        self.batches.retain(|_, batch| {
            batch.records.retain(|(_, raw)| {
                let kept = Record::decode(raw.clone())
                    .is_ok_and(|record| record.version.physical_ms() + grace_ms > now);
                abandoned += usize::from(!kept);
                kept
            });
            !batch.records.is_empty()
        });
        if abandoned > 0 {
            tracing::warn!(replica = %self.me, view = self.view, abandoned, "gave up handing over writes past the tombstone grace");
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
            in_flight += usize::from(batch.sent_at.is_none());
            batch.sent_at = Some(now);
            let to = self.to[self.turn % self.to.len()];
            self.turn += 1;
            let message =
                HandoffMessage::Records { view: self.view, batch: *number, records: batch.records.clone() };
            fx.send(to, PeerMessage::new(&message));
        }
    }

    /// A member acknowledged `batch` of the handoff from `view`.
    pub fn on_acked(&mut self, from: NodeId, view: u64, batch: u64) {
        if view == self.view && self.to.contains(&from) {
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

    fn sent(fx: &mut Effects) -> Vec<(NodeId, u64)> {
        fx.take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Send { to, message } => match message.open::<HandoffMessage>() {
                    Some(Ok(HandoffMessage::Records { batch, .. })) => Some((to, batch)),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    #[test]
    fn batches_are_resent_to_the_next_member_until_one_acknowledges() {
        let messages =
            vec![vec![(Bytes::from("a"), record(100, "1"))], vec![(Bytes::from("b"), record(100, "2"))]];
        let mut handoff =
            Handoff::new(NodeId(1), 7, messages, vec![NodeId(1), NodeId(2), NodeId(3)], 50, 1_000).unwrap();
        let mut fx = Effects::new(100);
        handoff.on_tick(&mut fx);
        assert_eq!(sent(&mut fx), vec![(NodeId(2), 1), (NodeId(3), 2)], "never to itself");
        handoff.on_acked(NodeId(3), 7, 2);
        handoff.on_acked(NodeId(2), 6, 1);
        let mut fx = Effects::new(120);
        handoff.on_tick(&mut fx);
        assert!(sent(&mut fx).is_empty(), "not yet due");
        let mut fx = Effects::new(150);
        handoff.on_tick(&mut fx);
        assert_eq!(
            sent(&mut fx),
            vec![(NodeId(2), 1)],
            "an acknowledgement of another view's handoff counts for nothing"
        );
        handoff.on_acked(NodeId(2), 7, 1);
        assert!(handoff.done());
        assert_eq!(handoff.abandoned(), 0);
    }

    #[test]
    fn records_past_the_grace_are_given_up() {
        let messages =
            vec![vec![(Bytes::from("old"), record(100, "1")), (Bytes::from("new"), record(900, "2"))]];
        let mut handoff = Handoff::new(NodeId(1), 3, messages, vec![NodeId(2)], 50, 1_000).unwrap();
        let mut fx = Effects::new(1_500);
        handoff.on_tick(&mut fx);
        assert_eq!(handoff.abandoned(), 1);
        let mut fx = Effects::new(2_000);
        handoff.on_tick(&mut fx);
        assert!(handoff.done(), "every record is past the grace");
        assert_eq!(handoff.abandoned(), 2);
    }

    #[test]
    fn nothing_to_hand_over_or_no_one_to_take_it_is_no_handoff() {
        let messages = vec![vec![(Bytes::from("a"), record(100, "1"))]];
        assert!(Handoff::new(NodeId(1), 3, messages.clone(), vec![NodeId(1)], 50, 1_000).is_none());
        assert!(Handoff::new(NodeId(1), 3, vec![Vec::new()], vec![NodeId(2)], 50, 1_000).is_none());
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(
            view in any::<u64>(),
            batch in any::<u64>(),
            records in crate::codec::strategies::entries(),
            cut in any::<usize>(),
        ) {
            check_codec(&HandoffMessage::Records { view, batch, records }, cut);
            check_codec(&HandoffMessage::Acked { view, batch }, cut);
        }
    }
}
