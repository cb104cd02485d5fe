//! Convergence (every mode, once faults heal and writes stop): the live
//! members of the final view hold the same records — or, for a quorum
//! protocol, a majority of them holds each key's record (a write that reached
//! only a minority, whose client was told the outcome is unknown, may stay
//! there until the key's next operation settles it).

use std::collections::BTreeSet;

use bytes::Bytes;
use tessera_protocol::Record;

/// One member's live records, by key.
pub type Contents = Vec<(Bytes, Record)>;

/// Violations: members whose records differ from the first's.
pub fn identical(contents: &[(u32, Contents)], quiet_ms: u64) -> Vec<String> {
    let mut violations = Vec::new();
    let Some((first_id, first)) = contents.first() else { return violations };
    for (id, other) in &contents[1..] {
        if other != first {
            let difference = first
                .iter()
                .zip(other.iter())
                .find(|(a, b)| a != b)
                .map(|(a, b)| format!("first difference {a:?} / {b:?}"))
                .unwrap_or_else(|| format!("{} / {} keys", first.len(), other.len()));
            violations.push(format!(
                "convergence: replicas n{first_id} and n{id} differ after {quiet_ms} quiet ms: {difference}"
            ));
        }
    }
    violations
}

/// What a majority of the members hold.
pub struct Majority {
    /// Per key, the record a majority holds (absence counts as a record).
    pub state: Contents,
    /// The keys no majority agrees on.
    pub undecided: Vec<Bytes>,
}

/// What a majority of the members hold, and a violation for each key
/// without one.
pub fn majority_state(contents: &[(u32, Contents)]) -> (Majority, Vec<String>) {
    let majority = contents.len() / 2 + 1;
    let keys: BTreeSet<&Bytes> =
        contents.iter().flat_map(|(_, entries)| entries.iter().map(|(key, _)| key)).collect();
    let mut state = Vec::new();
    let mut undecided = Vec::new();
    let mut violations = Vec::new();
    for key in keys {
        let mut counts: Vec<(Option<&Record>, usize)> = Vec::new();
        for (_, entries) in contents {
            let record = entries.iter().find(|(other, _)| other == key).map(|(_, record)| record);
            match counts.iter_mut().find(|(seen, _)| *seen == record) {
                Some((_, count)) => *count += 1,
                None => counts.push((record, 1)),
            }
        }
        match counts.into_iter().find(|(_, count)| *count >= majority) {
            Some((Some(record), _)) => state.push((key.clone(), record.clone())),
            Some((None, _)) => {}
            None => {
                undecided.push(key.clone());
                violations.push(format!(
                    "convergence: no majority of the {} live members holds one record of key {:?}: {:?}",
                    contents.len(),
                    String::from_utf8_lossy(key),
                    contents
                        .iter()
                        .map(|(_, entries)| entries
                            .iter()
                            .find(|(other, _)| other == key)
                            .map(|(_, record)| record))
                        .collect::<Vec<_>>()
                ))
            }
        }
    }
    (Majority { state, undecided }, violations)
}
