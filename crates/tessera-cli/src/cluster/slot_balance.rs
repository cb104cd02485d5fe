//! `tessera cluster rebalance --by keys|bytes|load`: moves slots between
//! groups until each holds (or serves) about as much as the others. The
//! weights come from CLUSTER SLOT-STATS on every node (each answers for the
//! groups it heads); the moves are migrations, one per pair of groups, run
//! one after another with their progress shown.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use clap::ValueEnum;
use tessera_cluster::ClusterMap;
use tessera_wire::slot::SLOTS;
use tessera_wire::{Client, Value};

use super::{fetch_map, follow_migration, migrations, start_migration, AdminSession, Layout};

/// What a slot weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Weight {
    /// Its live keys.
    Keys,
    /// The bytes its keys and values take.
    Bytes,
    /// The request and reply bytes served for it over the window.
    Load,
}

impl Weight {
    fn label(self) -> &'static str {
        match self {
            Weight::Keys => "keys",
            Weight::Bytes => "bytes",
            Weight::Load => "bytes of traffic",
        }
    }
}

/// How long one node may take to answer SLOT-STATS (it counts its keys).
const STATS_TIMEOUT: Duration = Duration::from_secs(60);

/// At most this many rounds of planning: each moves slots from the
/// heaviest group to the lightest.
const MAX_ROUNDS: usize = 256;

pub fn rebalance_slots(dir: &Path, weight: Weight, window: u64, threshold: u64) -> Result<(), String> {
    let layout = Layout::load(dir)?;
    let mut session = AdminSession::open(dir, &layout)?;
    // A move an interrupted run left finishes first.
    for migration in migrations(&mut session)? {
        println!(
            "following migration {} under way from group {} to group {}",
            migration.id, migration.from, migration.to
        );
        follow_migration(&mut session, &layout, migration.id, migration.to)?;
    }
    let weights = slot_weights(&layout, weight, window)?;
    let map = fetch_map(dir, &layout)?;
    let before = group_totals(&map, &weights);
    let plan = plan_slot_moves(&map, &weights, threshold);
    if plan.is_empty() {
        println!("balanced: {} per group {before:?}", weight.label());
        return Ok(());
    }
    for (index, (from, to, slots)) in plan.iter().enumerate() {
        let moved: u64 = slots.iter().map(|slot| weights[usize::from(*slot)]).sum();
        println!(
            "[{}/{}] moving {} slots ({moved} {}) from group {from} to group {to}",
            index + 1,
            plan.len(),
            slots.len(),
            weight.label()
        );
        let ranges: Vec<String> = ranges(slots)
            .into_iter()
            .map(|(first, last)| if first == last { first.to_string() } else { format!("{first}-{last}") })
            .collect();
        let id = start_migration(&mut session, *from, *to, &ranges)?;
        follow_migration(&mut session, &layout, id, *to)?;
    }
    let after = group_totals(&fetch_map(dir, &layout)?, &weights);
    println!("balanced: {} per group {before:?} before, {after:?} now", weight.label());
    Ok(())
}

/// Each slot's weight, summed over what every node reports for the groups
/// it heads; for load, the traffic during `window` seconds.
pub(super) fn slot_weights(layout: &Layout, weight: Weight, window: u64) -> Result<Vec<u64>, String> {
    let sample = |metrics: &[&str]| -> Result<Vec<u64>, String> {
        let mut weights = vec![0u64; SLOTS];
        for (node, port) in &layout.nodes {
            let address = layout.node_address(*port);
            let mut client = Client::connect(&address, STATS_TIMEOUT)
                .map_err(|error| format!("node {node} at {address}: {error}"))?;
            let reply = client
                .command(&["CLUSTER", "SLOT-STATS", "SLOTSRANGE", "0", "16383"])
                .map_err(|error| format!("node {node}: {error}"))?;
            for (slot, value) in
                parse_slot_stats(reply, metrics).map_err(|error| format!("node {node}: {error}"))?
            {
                weights[usize::from(slot)] += value;
            }
        }
        Ok(weights)
    };
    match weight {
        Weight::Keys => sample(&["key-count"]),
        Weight::Bytes => sample(&["memory-bytes"]),
        Weight::Load => {
            let traffic = ["network-bytes-in", "network-bytes-out"];
            let first = sample(&traffic)?;
            println!("measuring each slot's traffic for {window} s");
            std::thread::sleep(Duration::from_secs(window));
            let second = sample(&traffic)?;
            Ok(second.iter().zip(&first).map(|(after, before)| after.saturating_sub(*before)).collect())
        }
    }
}

/// A SLOT-STATS reply as (slot, the sum of `metrics`) pairs.
fn parse_slot_stats(reply: Value, metrics: &[&str]) -> Result<Vec<(u16, u64)>, String> {
    let odd = || "CLUSTER SLOT-STATS answered with something else".to_string();
    let entries = match reply {
        Value::Array(entries) => entries,
        Value::Error(message) => return Err(message),
        _ => return Err(odd()),
    };
    entries
        .into_iter()
        .map(|entry| {
            let Value::Array(pair) = entry else { return Err(odd()) };
            let [slot, Value::Array(fields)] = <[Value; 2]>::try_from(pair).map_err(|_| odd())? else {
                return Err(odd());
            };
            let slot = slot.as_integer().and_then(|slot| u16::try_from(slot).ok()).ok_or_else(odd)?;
            let mut sum = 0;
            for field in fields.chunks(2) {
                let [Value::Bulk(name), value] = field else { return Err(odd()) };
                if metrics.iter().any(|metric| name.as_ref() == metric.as_bytes()) {
                    sum += value.as_integer().and_then(|value| u64::try_from(value).ok()).ok_or_else(odd)?;
                }
            }
            Ok((slot, sum))
        })
        .collect()
}

/// Each slot-owning group's total weight.
fn group_totals(map: &ClusterMap, weights: &[u64]) -> BTreeMap<u32, u64> {
    map.slot_shards()
        .map(|shard| {
            let total = shard
                .slots
                .iter()
                .flat_map(|(first, last)| *first..=*last)
                .map(|slot| weights[usize::from(slot)])
                .sum();
            (shard.id, total)
        })
        .collect()
}

/// Slot moves `(from, to, slots)`, one per pair of groups, that bring the
/// heaviest and the lightest group within `threshold` percent of the mean.
/// Each round of planning moves from the heaviest group's highest slots
/// that weigh something (skipping one too heavy to move alone) as much as
/// takes neither group past the mean, so no slot has to come back; a slot
/// planned to move twice moves once, from its owner to where it ends. Every
/// group keeps at least one slot.
fn plan_slot_moves(map: &ClusterMap, weights: &[u64], threshold: u64) -> Vec<(u32, u32, Vec<u16>)> {
    let original: BTreeMap<u16, u32> = map
        .slot_shards()
        .flat_map(|shard| {
            shard.slots.iter().flat_map(|(first, last)| *first..=*last).map(|slot| (slot, shard.id))
        })
        .collect();
    let mut owned: BTreeMap<u32, Vec<u16>> = map.slot_shards().map(|shard| (shard.id, Vec::new())).collect();
    for (slot, group) in &original {
        owned.get_mut(group).expect("a group of the map").push(*slot);
    }
    let weight_of = |slots: &[u16]| slots.iter().map(|slot| weights[usize::from(*slot)]).sum::<u64>();
    let mut totals: BTreeMap<u32, u64> =
        owned.iter().map(|(group, slots)| (*group, weight_of(slots))).collect();
    if totals.len() < 2 {
        return Vec::new();
    }
    let mean = totals.values().sum::<u64>() / totals.len() as u64;
    let tolerance = (mean * threshold / 100).max(1);
    for _ in 0..MAX_ROUNDS {
        let heaviest = totals.iter().max_by_key(|(group, total)| (**total, std::cmp::Reverse(**group)));
        let lightest = totals.iter().min_by_key(|(group, total)| (**total, **group));
        let ((&heaviest, &high), (&lightest, &low)) =
            (heaviest.expect("two groups"), lightest.expect("two groups"));
        if high - low <= tolerance {
            break;
        }
        let wanted = (high - mean).min(mean - low);
        let slots = owned.get_mut(&heaviest).expect("a group of the map");
        let mut taken = Vec::new();
        let mut weight = 0;
        for index in (1..slots.len()).rev() {
            let slot_weight = weights[usize::from(slots[index])];
            if slot_weight == 0 || slot_weight > wanted {
                continue; // moving it gains nothing, or overshoots on its own
            }
            if weight + slot_weight > wanted {
                break;
            }
            weight += slot_weight;
            taken.push(slots.remove(index));
        }
        if weight == 0 {
            break; // nothing the heaviest group holds helps
        }
        *totals.get_mut(&heaviest).expect("a total per group") -= weight;
        *totals.get_mut(&lightest).expect("a total per group") += weight;
        let receiver = owned.get_mut(&lightest).expect("a group of the map");
        receiver.extend(taken);
        receiver.sort_unstable();
    }
    let mut moves: BTreeMap<(u32, u32), Vec<u16>> = BTreeMap::new();
    for (group, slots) in &owned {
        for slot in slots {
            let from = original[slot];
            if from != *group {
                moves.entry((from, *group)).or_default().push(*slot);
            }
        }
    }
    moves.into_iter().map(|((from, to), slots)| (from, to, slots)).collect()
}

/// Sorted slots as inclusive ranges.
fn ranges(slots: &[u16]) -> Vec<(u16, u16)> {
    let mut ranges: Vec<(u16, u16)> = Vec::new();
    for slot in slots {
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == *slot => *last = *slot,
            _ => ranges.push((*slot, *slot)),
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(groups: usize) -> ClusterMap {
        let addresses: Vec<String> = (0..3).map(|index| format!("127.0.0.1:{}", 7001 + index)).collect();
        let mode = tessera_protocol::Mode::named("ms+sc").unwrap();
        ClusterMap::place_groups("c", mode, 3, &addresses, 3, groups).unwrap()
    }

    /// Moves the plan's slots in a copy of the map.
    fn apply(map: &ClusterMap, plan: &[(u32, u32, Vec<u16>)]) -> ClusterMap {
        let mut map = map.clone();
        for (from, to, slots) in plan {
            for shard in &mut map.shards {
                let mut own: Vec<u16> = shard.slots.iter().flat_map(|(first, last)| *first..=*last).collect();
                if shard.id == *from {
                    own.retain(|slot| !slots.contains(slot));
                } else if shard.id == *to {
                    own.extend(slots);
                    own.sort_unstable();
                }
                shard.slots = ranges(&own);
            }
        }
        map
    }

    #[test]
    fn skewed_keys_are_evened_out_within_the_threshold() {
        let map = map(4);
        // Group 0's slots hold ten times as many keys as the others'.
        let first_group: Vec<u16> = map.shard(0).unwrap().slots.iter().flat_map(|(a, b)| *a..=*b).collect();
        let weights: Vec<u64> =
            (0..SLOTS as u16).map(|slot| if first_group.contains(&slot) { 10 } else { 1 }).collect();
        let plan = plan_slot_moves(&map, &weights, 5);
        let moved: Vec<u16> = plan.iter().flat_map(|(_, _, slots)| slots.clone()).collect();
        let distinct: std::collections::BTreeSet<u16> = moved.iter().copied().collect();
        assert_eq!(distinct.len(), moved.len(), "each slot moves once, from its owner to where it ends");
        assert!(plan.iter().all(|(from, to, _)| from != to && *to != 0), "nothing goes to the heavy group");
        let totals = group_totals(&apply(&map, &plan), &weights);
        let (high, low) = (totals.values().max().unwrap(), totals.values().min().unwrap());
        let mean = totals.values().sum::<u64>() / 4;
        assert!(high - low <= mean * 5 / 100, "{totals:?}");
        assert_eq!(totals.values().sum::<u64>(), weights.iter().sum::<u64>(), "no slot lost or doubled");
        assert!(plan_slot_moves(&apply(&map, &plan), &weights, 5).is_empty(), "balanced: nothing more");
    }

    #[test]
    fn a_slot_too_hot_to_move_alone_stays_and_every_group_keeps_a_slot() {
        let map = map(2);
        let mut weights = vec![0u64; SLOTS];
        let hot = map.shard(0).unwrap().slots[0].0;
        weights[usize::from(hot)] = 1_000;
        assert!(plan_slot_moves(&map, &weights, 10).is_empty(), "moving the hot slot only swaps the roles");
        let plan = plan_slot_moves(&map, &vec![0; SLOTS], 10);
        assert!(plan.is_empty(), "nothing to even out");
    }

    #[test]
    fn slot_stats_replies_are_summed_over_the_metrics_asked_for() {
        let entry = |slot: i64, keys: i64, bytes_in: i64, bytes_out: i64| {
            let field = |name: &str, value: i64| {
                [Value::Bulk(name.as_bytes().to_vec().into()), Value::Integer(value)]
            };
            let fields = [
                field("key-count", keys),
                field("network-bytes-in", bytes_in),
                field("network-bytes-out", bytes_out),
            ];
            Value::Array(vec![Value::Integer(slot), Value::Array(fields.into_iter().flatten().collect())])
        };
        let reply = Value::Array(vec![entry(3, 7, 100, 20), entry(9, 0, 5, 5)]);
        assert_eq!(parse_slot_stats(reply.clone(), &["key-count"]).unwrap(), vec![(3, 7), (9, 0)]);
        let traffic = parse_slot_stats(reply, &["network-bytes-in", "network-bytes-out"]).unwrap();
        assert_eq!(traffic, vec![(3, 120), (9, 10)]);
        assert!(parse_slot_stats(Value::Error("ERR no".into()), &["key-count"]).is_err());
        assert!(parse_slot_stats(Value::Array(vec![Value::Integer(1)]), &["key-count"]).is_err());
    }

    #[test]
    fn ranges_join_consecutive_slots() {
        assert_eq!(ranges(&[1, 2, 3, 7, 9, 10]), vec![(1, 3), (7, 7), (9, 10)]);
        assert!(ranges(&[]).is_empty());
    }
}
