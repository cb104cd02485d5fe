//! Durability: acknowledged writes the final state lacks. For the strong
//! modes a violation ("chain replication, section 3: a write acknowledged by
//! the head is stored at the tail"); for the eventual ones, the measure of
//! their documented window.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bytes::Bytes;
use tessera_protocol::Record;

use crate::history::{Call, History, Operation, Outcome};

/// Acknowledged appends whose key is missing at the end.
pub fn lost_appends(history: &History, final_state: &[(Bytes, Record)], since: u64) -> u64 {
    let present: BTreeSet<&Bytes> = final_state.iter().map(|(key, _)| key).collect();
    history
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
pub fn lost_writes(history: &History, final_state: &[(Bytes, Record)], since: u64) -> u64 {
    let final_values: HashMap<&Bytes, Option<Bytes>> =
        final_state.iter().map(|(key, record)| (key, record.visible().cloned())).collect();
    let mut by_key: BTreeMap<&Bytes, Vec<&Operation>> = BTreeMap::new();
    for operation in history.operations.iter().filter(|operation| operation.is_write()) {
        by_key.entry(&operation.key).or_default().push(operation);
    }
    let mut lost = 0;
    for (key, writes) in by_key {
        let Some(last) =
            writes.iter().filter(|write| write.completed_at.is_some()).max_by_key(|write| write.completed_at)
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
