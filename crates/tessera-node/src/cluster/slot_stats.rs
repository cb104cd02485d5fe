//! CLUSTER SLOT-STATS, as Redis 8 and Valkey answer it: per slot of the
//! groups this node heads, its keys, the bytes they take, and the request
//! and reply bytes this node has served for it since it started. What
//! `tessera cluster rebalance --by keys|bytes|load` weighs slots by.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tessera_cluster::capture::CapturingView;
use tessera_engine::{reserved, Engine, KeyRange, ScanCursor};
use tessera_wire::slot::{key_slot, SLOTS};
use tessera_wire::{ReplyWriter, Request};

use super::reshard::{integer, valid_slot};
use super::ClusterNode;
use crate::commands::is;
use crate::commands::keys::live_kind;
use crate::error::{CommandError, CommandResult};

/// The metrics each slot reports, in reply order.
const METRICS: [&str; 4] = ["key-count", "memory-bytes", "network-bytes-in", "network-bytes-out"];

/// Request and reply bytes served per slot on this node.
pub struct SlotTraffic {
    bytes_in: Box<[AtomicU64]>,
    bytes_out: Box<[AtomicU64]>,
}

impl Default for SlotTraffic {
    fn default() -> Self {
        let counters = || (0..SLOTS).map(|_| AtomicU64::new(0)).collect();
        Self { bytes_in: counters(), bytes_out: counters() }
    }
}

impl SlotTraffic {
    /// A request of `bytes_in` bytes on a key of `key`'s slot, answered
    /// with `bytes_out`.
    pub fn record(&self, key: &[u8], bytes_in: usize, bytes_out: usize) {
        let slot = key_slot(key);
        self.bytes_in[slot].fetch_add(bytes_in as u64, Ordering::Relaxed);
        self.bytes_out[slot].fetch_add(bytes_out as u64, Ordering::Relaxed);
    }
}

/// One slot's figures, in the order of [`METRICS`].
#[derive(Clone, Copy, Default)]
struct SlotFigures([u64; 4]);

/// What a SLOT-STATS request asks for.
enum Selection {
    Range { first: u16, last: u16 },
    Order { metric: usize, limit: usize, descending: bool },
}

fn parse(request: &Request<'_>) -> CommandResult<Selection> {
    let number = |index: usize| integer(request.arg(index));
    let syntax = || CommandError::Syntax;
    if request.len() < 3 {
        return Err(CommandError::WrongArity("cluster|slot-stats".into()));
    }
    if is(request.arg(2), "slotsrange") {
        if request.len() != 5 {
            return Err(syntax());
        }
        let slot = |index| {
            valid_slot(number(index)?)
                .ok_or_else(|| CommandError::Other("Invalid or out of range slot.".into()))
        };
        let (first, last) = (slot(3)?, slot(4)?);
        if first > last {
            return Err(CommandError::Other("Start slot number is greater than end slot number.".into()));
        }
        return Ok(Selection::Range { first, last });
    }
    if !is(request.arg(2), "orderby") || request.len() < 4 {
        return Err(syntax());
    }
    let metric = METRICS
        .iter()
        .position(|name| is(request.arg(3), name))
        .ok_or_else(|| CommandError::Other("Unrecognized sort metric for ORDERBY.".into()))?;
    let (mut limit, mut descending, mut index) = (16, true, 4);
    while index < request.len() {
        match request.arg(index) {
            arg if is(arg, "limit") && index + 1 < request.len() => {
                limit = usize::try_from(number(index + 1)?)
                    .ok()
                    .filter(|limit| (1..=SLOTS).contains(limit))
                    .ok_or_else(|| CommandError::Other("Limit has to lie in between 1 and 16384.".into()))?;
                index += 2;
            }
            arg if is(arg, "asc") => (descending, index) = (false, index + 1),
            arg if is(arg, "desc") => (descending, index) = (true, index + 1),
            _ => return Err(syntax()),
        }
    }
    Ok(Selection::Order { metric, limit, descending })
}

impl ClusterNode {
    /// `CLUSTER SLOT-STATS SLOTSRANGE first last | ORDERBY metric [LIMIT n]
    /// [ASC|DESC]` over the slots of the groups this node heads. Counting
    /// keys reads the groups' engines through, off the serving thread.
    pub async fn slot_stats(
        &self,
        request: &Request<'_>,
        now_ms: u64,
        out: &mut ReplyWriter,
    ) -> CommandResult {
        let selection = parse(request)?;
        let map = self.map()?;
        let me = self.agent.node_id();
        // Each slot's shard, where this node heads it.
        let mut shard_of_slot = vec![None; SLOTS];
        let mut engines = Vec::new();
        for shard in map.slot_shards().filter(|shard| shard.is_headed_by(me)) {
            for (first, last) in &shard.slots {
                shard_of_slot[usize::from(*first)..=usize::from(*last)].fill(Some(shard.id));
            }
            engines.extend(self.agent.engine(shard.id).map(|engine| (shard.id, engine)));
        }
        let shard_of_slot = Arc::new(shard_of_slot);
        let counted = shard_of_slot.clone();
        let scanned = tokio::task::spawn_blocking(move || count_keys(&engines, &counted, now_ms))
            .await
            .map_err(|error| CommandError::Other(format!("counting keys failed: {error}")))??;
        let mut slots: Vec<(u16, SlotFigures)> = (0..SLOTS)
            .filter(|slot| shard_of_slot[*slot].is_some())
            .map(|slot| {
                let mut figures = scanned[slot];
                figures.0[2] = self.traffic.bytes_in[slot].load(Ordering::Relaxed);
                figures.0[3] = self.traffic.bytes_out[slot].load(Ordering::Relaxed);
                (slot as u16, figures)
            })
            .collect();
        match selection {
            Selection::Range { first, last } => slots.retain(|(slot, _)| (first..=last).contains(slot)),
            Selection::Order { metric, limit, descending } => {
                // Ties go to the lower slot either way, as in Redis.
                slots.sort_by(|(slot_a, a), (slot_b, b)| {
                    let by_metric = a.0[metric].cmp(&b.0[metric]);
                    (if descending { by_metric.reverse() } else { by_metric }).then(slot_a.cmp(slot_b))
                });
                slots.truncate(limit);
            }
        }
        out.array(slots.len());
        for (slot, figures) in slots {
            out.array(2);
            out.integer(i64::from(slot));
            out.map(METRICS.len());
            for (name, value) in METRICS.iter().zip(figures.0) {
                out.bulk(name.as_bytes());
                out.integer(i64::try_from(value).unwrap_or(i64::MAX));
            }
        }
        Ok(())
    }
}

/// Live keys and the bytes they take (an internal key's in its owner's
/// slot) per slot, over each shard's engine. A shard's keys count only in
/// its own slots (`shard_of_slot`): a shard that gave a slot away may still
/// hold its keys until they are swept.
fn count_keys(
    engines: &[(u32, Arc<dyn Engine>)],
    shard_of_slot: &[Option<u32>],
    now_ms: u64,
) -> CommandResult<Vec<SlotFigures>> {
    let mut figures = vec![SlotFigures::default(); SLOTS];
    for (shard, engine) in engines {
        let view = CapturingView::new(engine.clone());
        let mut cursor = ScanCursor::start();
        loop {
            let page = view.scan(&KeyRange::all(), &cursor, 1024)?;
            for (key, raw) in page.entries {
                let owner = match reserved::owner(&key) {
                    Some((owner, _)) => owner,
                    None if reserved::is_reserved(&key) => continue,
                    None => &key,
                };
                let slot = key_slot(owner);
                if shard_of_slot[slot] != Some(*shard) {
                    continue;
                }
                let slot = &mut figures[slot].0;
                slot[1] += (key.len() + raw.len()) as u64;
                if live_kind(&key, raw, now_ms).is_some() {
                    slot[0] += 1;
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
    }
    Ok(figures)
}
