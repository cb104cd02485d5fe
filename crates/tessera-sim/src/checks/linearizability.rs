//! Linearizability of key-value histories: the Wing–Gong search with Lowe's
//! memoisation of (linearized set, state), as in Porcupine, run per key (a
//! key-value store is linearizable iff each key's register is).
//!
//! An operation whose outcome is unknown (the client timed out) may have taken
//! effect at any point after its invocation, or never: it is given a return time
//! after every other event, where placing it is equivalent to dropping it, and
//! an unknown read is dropped outright.

use std::collections::{BTreeMap, HashSet};

use bytes::Bytes;
use tessera_protocol::increment_value;

use crate::history::{Call, History, Operation, Outcome};

/// Searches longer than this many steps give up (an inconclusive answer, not a
/// violation).
const STEPS_MAX: u64 = 20_000_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// The key and a description of the history part that cannot be ordered.
    Violation {
        key: Bytes,
        detail: String,
    },
    Inconclusive {
        key: Bytes,
    },
}

/// The register model: one key's value.
type State = Option<Bytes>;

/// Applies an operation to the state; `None` if the recorded outcome cannot
/// follow from `state`.
fn step(state: &State, operation: &Operation) -> Option<State> {
    match (&operation.call, &operation.outcome) {
        (Call::Get, Outcome::Value(value)) => (value == state).then(|| state.clone()),
        (Call::Get, _) => Some(state.clone()),
        (Call::Put(value), _) => Some(Some(value.clone())),
        (Call::Delete, _) => Some(None),
        (Call::Increment(delta), outcome) => match increment_value(state.as_deref(), *delta) {
            Ok(updated) => match outcome {
                Outcome::Value(Some(result)) if *result != updated => None,
                _ => Some(Some(updated)),
            },
            // A failed increment is never recorded as a success; an unknown one
            // that would fail had no effect.
            Err(_) => matches!(outcome, Outcome::Unknown).then(|| state.clone()),
        },
    }
}

pub fn check(history: &History) -> Verdict {
    let mut by_key: BTreeMap<&Bytes, Vec<&Operation>> = BTreeMap::new();
    for operation in &history.operations {
        if matches!((&operation.call, &operation.outcome), (Call::Get, Outcome::Unknown)) {
            continue;
        }
        by_key.entry(&operation.key).or_default().push(operation);
    }
    for (key, operations) in by_key {
        match check_key(&operations) {
            Verdict::Linearizable => {}
            Verdict::Violation { detail, .. } => return Verdict::Violation { key: key.clone(), detail },
            Verdict::Inconclusive { .. } => return Verdict::Inconclusive { key: key.clone() },
        }
    }
    Verdict::Linearizable
}

/// One call or return event in the doubly linked list the search walks.
#[derive(Clone, Copy, Debug)]
struct Event {
    operation: usize,
    is_call: bool,
    /// For a call: the index of its return event.
    partner: usize,
}

fn check_key(operations: &[&Operation]) -> Verdict {
    let count = operations.len();
    // (time, is_return, operation): calls before returns at equal times, so
    // operations that touch in time count as concurrent.
    let mut timeline: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * count);
    for (index, operation) in operations.iter().enumerate() {
        timeline.push((operation.invoked_at, false, index));
        timeline.push((operation.completed_at.unwrap_or(u64::MAX), true, index));
    }
    timeline.sort();
    let mut events: Vec<Event> = Vec::with_capacity(timeline.len());
    let mut call_event = vec![usize::MAX; count];
    for (position, (_, is_return, operation)) in timeline.iter().enumerate() {
        events.push(Event { operation: *operation, is_call: !is_return, partner: usize::MAX });
        if *is_return {
            let call = call_event[*operation];
            events[call].partner = position;
        } else {
            call_event[*operation] = position;
        }
    }
    // Linked list over event indices; index `head` is a sentinel.
    let head = events.len();
    let mut next: Vec<usize> = (1..=events.len()).chain([0]).collect();
    let mut previous: Vec<usize> = std::iter::once(head).chain(0..events.len()).collect();
    next[head] = if events.is_empty() { head } else { 0 };
    if let Some(last) = events.len().checked_sub(1) {
        next[last] = head;
        previous[head] = last;
    }
    let lift = |next: &mut Vec<usize>, previous: &mut Vec<usize>, event: usize| {
        for index in [event, events[event].partner] {
            let (before, after) = (previous[index], next[index]);
            next[before] = after;
            previous[after] = before;
        }
    };
    let unlift = |next: &mut Vec<usize>, previous: &mut Vec<usize>, event: usize| {
        for index in [events[event].partner, event] {
            let (before, after) = (previous[index], next[index]);
            next[before] = index;
            previous[after] = index;
        }
    };

    let words = count.div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut state: State = None;
    let mut stack: Vec<(usize, State)> = Vec::new();
    let mut seen: HashSet<(Vec<u64>, State)> = HashSet::new();
    let mut entry = next[head];
    let mut steps = 0u64;
    while next[head] != head {
        steps += 1;
        if steps > STEPS_MAX {
            return Verdict::Inconclusive { key: Bytes::new() };
        }
        let event = events[entry];
        if event.is_call {
            let operation = event.operation;
            if let Some(new_state) = step(&state, operations[operation]) {
                let mut candidate = linearized.clone();
                candidate[operation / 64] |= 1 << (operation % 64);
                if seen.insert((candidate.clone(), new_state.clone())) {
                    stack.push((entry, std::mem::replace(&mut state, new_state)));
                    linearized = candidate;
                    lift(&mut next, &mut previous, entry);
                    entry = next[head];
                    continue;
                }
            }
            entry = next[entry];
        } else {
            // A return whose call could not be placed before it: undo the last choice.
            let Some((call, old_state)) = stack.pop() else {
                let operation = operations[event.operation];
                return Verdict::Violation {
                    key: operation.key.clone(),
                    detail: format!("no order explains {operation:?}"),
                };
            };
            state = old_state;
            let operation = events[call].operation;
            linearized[operation / 64] &= !(1 << (operation % 64));
            unlift(&mut next, &mut previous, call);
            entry = next[call];
        }
    }
    Verdict::Linearizable
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(call: Call, outcome: Outcome, invoked_at: u64, completed_at: Option<u64>) -> Operation {
        Operation { client: 0, key: Bytes::from_static(b"k"), call, outcome, invoked_at, completed_at }
    }

    fn put(value: &'static str, from: u64, to: u64) -> Operation {
        op(Call::Put(Bytes::from_static(value.as_bytes())), Outcome::Written, from, Some(to))
    }

    fn get(value: Option<&'static str>, from: u64, to: u64) -> Operation {
        op(Call::Get, Outcome::Value(value.map(|v| Bytes::from_static(v.as_bytes()))), from, Some(to))
    }

    fn history(operations: Vec<Operation>) -> History {
        History { operations }
    }

    #[test]
    fn sequential_and_concurrent_histories_that_are_linearizable() {
        assert_eq!(check(&history(vec![put("a", 0, 1), get(Some("a"), 2, 3)])), Verdict::Linearizable);
        // A read overlapping a write may see either value.
        assert_eq!(
            check(&history(vec![put("a", 0, 1), put("b", 2, 6), get(Some("a"), 3, 4)])),
            Verdict::Linearizable
        );
        assert_eq!(
            check(&history(vec![put("a", 0, 1), put("b", 2, 6), get(Some("b"), 3, 4)])),
            Verdict::Linearizable
        );
        assert_eq!(check(&history(vec![get(None, 0, 1)])), Verdict::Linearizable);
    }

    #[test]
    fn stale_reads_and_lost_writes_are_violations() {
        // A read after a completed write must see it.
        assert!(matches!(check(&history(vec![put("a", 0, 1), get(None, 2, 3)])), Verdict::Violation { .. }));
        // Two reads in order cannot see b then a.
        let flip = vec![put("a", 0, 1), put("b", 2, 10), get(Some("b"), 3, 4), get(Some("a"), 5, 6)];
        assert!(matches!(check(&history(flip)), Verdict::Violation { .. }));
    }

    #[test]
    fn pending_operations_may_or_may_not_take_effect() {
        // A timed-out write may show up later ...
        let shows = vec![
            put("a", 0, 1),
            op(Call::Put(Bytes::from_static(b"b")), Outcome::Unknown, 2, None),
            get(Some("b"), 5, 6),
        ];
        assert_eq!(check(&history(shows)), Verdict::Linearizable);
        // ... or never.
        let never = vec![
            put("a", 0, 1),
            op(Call::Put(Bytes::from_static(b"b")), Outcome::Unknown, 2, None),
            get(Some("a"), 5, 6),
        ];
        assert_eq!(check(&history(never)), Verdict::Linearizable);
        // But not before it was invoked.
        let early = vec![
            put("a", 0, 1),
            get(Some("b"), 2, 3),
            op(Call::Put(Bytes::from_static(b"b")), Outcome::Unknown, 4, None),
        ];
        assert!(matches!(check(&history(early)), Verdict::Violation { .. }));
    }

    #[test]
    fn increments_are_read_modify_writes() {
        let ok = vec![
            op(Call::Increment(1), Outcome::Value(Some(Bytes::from_static(b"1"))), 0, Some(5)),
            op(Call::Increment(1), Outcome::Value(Some(Bytes::from_static(b"2"))), 1, Some(4)),
        ];
        assert_eq!(check(&history(ok)), Verdict::Linearizable);
        let lost_update = vec![
            op(Call::Increment(1), Outcome::Value(Some(Bytes::from_static(b"1"))), 0, Some(5)),
            op(Call::Increment(1), Outcome::Value(Some(Bytes::from_static(b"1"))), 1, Some(4)),
        ];
        assert!(matches!(check(&history(lost_update)), Verdict::Violation { .. }));
    }
}
