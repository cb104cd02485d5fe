//! A sorted set held in the engine's memory, on an engine that keeps native
//! values ([`tessera_engine::Native`]): a map of members to scores beside
//! the (score, member) order, kept as sorted chunks of up to [`CHUNK_MAX`]
//! entries found by a binary search over the chunks. ZADD is a map probe
//! and an insert into one chunk, ZPOPMIN the first chunk's first entry, a
//! range a walk from one chunk; each in one engine lookup, where the paged
//! form ([`crate::zset`]) reads the header, the directory, a page and the
//! member's entry.

use std::cmp::Ordering;
use std::collections::HashMap;

use tessera_engine::Native;

/// Entries a chunk holds before it splits in two.
const CHUNK_MAX: usize = 64;

type Entry = (f64, Box<[u8]>);

/// Orders (score, member) pairs as Redis does: by score, then by member bytes.
fn compare(a: (f64, &[u8]), b: (f64, &[u8])) -> Ordering {
    a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1))
}

fn key(entry: &Entry) -> (f64, &[u8]) {
    (entry.0, &entry.1)
}

#[derive(Default)]
pub struct NativeSortedSet {
    scores: HashMap<Box<[u8]>, f64, foldhash::fast::RandomState>,
    /// Sorted, none empty.
    chunks: Vec<Vec<Entry>>,
}

impl Native for NativeSortedSet {}

impl NativeSortedSet {
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    pub fn score(&self, member: &[u8]) -> Option<f64> {
        self.scores.get(member).copied()
    }

    /// The chunk that holds (or would hold) `at`: the first whose last
    /// entry is not before it, or the last chunk.
    fn chunk_for(&self, at: (f64, &[u8])) -> usize {
        let index =
            self.chunks.partition_point(|chunk| compare(key(chunk.last().expect("not empty")), at).is_lt());
        index.min(self.chunks.len().saturating_sub(1))
    }

    /// Sets a member's score: its previous score.
    pub fn insert(&mut self, member: &[u8], score: f64) -> Option<f64> {
        let previous = self.score(member);
        if previous == Some(score) {
            return previous;
        }
        if let Some(old) = previous {
            self.remove_entry(old, member);
        }
        self.scores.insert(member.into(), score);
        if self.chunks.is_empty() {
            self.chunks.push(vec![(score, member.into())]);
            return previous;
        }
        let index = self.chunk_for((score, member));
        let chunk = &mut self.chunks[index];
        let at = chunk.partition_point(|entry| compare(key(entry), (score, member)).is_lt());
        chunk.insert(at, (score, member.into()));
        if chunk.len() > CHUNK_MAX {
            let upper = chunk.split_off(chunk.len() / 2);
            self.chunks.insert(index + 1, upper);
        }
        previous
    }

    /// Removes a member: its score, if it was there.
    pub fn remove(&mut self, member: &[u8]) -> Option<f64> {
        let score = self.scores.remove(member)?;
        self.remove_entry(score, member);
        Some(score)
    }

    fn remove_entry(&mut self, score: f64, member: &[u8]) {
        let index = self.chunk_for((score, member));
        let chunk = &mut self.chunks[index];
        let at =
            chunk.binary_search_by(|entry| compare(key(entry), (score, member))).expect("a member's entry");
        chunk.remove(at);
        if chunk.is_empty() {
            self.chunks.remove(index);
        }
    }

    /// Removes the first entry (or the last when `max`).
    pub fn pop(&mut self, max: bool) -> Option<(f64, Box<[u8]>)> {
        let index = if max { self.chunks.len().checked_sub(1)? } else { 0 };
        let chunk = self.chunks.get_mut(index)?;
        let entry = if max { chunk.pop()? } else { chunk.remove(0) };
        if chunk.is_empty() {
            self.chunks.remove(index);
        }
        self.scores.remove(&entry.1);
        Some(entry)
    }

    /// Entries in order from the first one at or after `from`, calling
    /// `visit` until it returns false.
    pub fn walk_forward(&self, from: Option<(f64, &[u8])>, mut visit: impl FnMut(f64, &[u8]) -> bool) {
        let start = from.map_or(0, |from| self.chunk_for(from));
        for chunk in self.chunks.iter().skip(start) {
            let skip =
                from.map_or(0, |from| chunk.partition_point(|entry| compare(key(entry), from).is_lt()));
            for (score, member) in &chunk[skip..] {
                if !visit(*score, member) {
                    return;
                }
            }
        }
    }

    /// Entries in descending order from the last one `admits` (a prefix
    /// of the order: scores up to a bound), calling `visit` until it
    /// returns false.
    pub fn walk_backward(&self, admits: impl Fn(f64) -> bool, mut visit: impl FnMut(f64, &[u8]) -> bool) {
        let end = self.chunks.partition_point(|chunk| admits(chunk[0].0));
        for chunk in self.chunks[..end].iter().rev() {
            let kept = chunk.partition_point(|entry| admits(entry.0));
            for (score, member) in chunk[..kept].iter().rev() {
                if !visit(*score, member) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rand::{Rng, SeedableRng};

    use super::*;

    fn ordered(model: &BTreeMap<Vec<u8>, f64>) -> Vec<(f64, Vec<u8>)> {
        let mut entries: Vec<(f64, Vec<u8>)> =
            model.iter().map(|(member, score)| (*score, member.clone())).collect();
        entries.sort_by(|a, b| compare((a.0, &a.1), (b.0, &b.1)));
        entries
    }

    /// Random additions, score changes, removals and pops held to a map,
    /// with walks from random points both ways.
    #[test]
    fn answers_as_a_sorted_map() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut set = NativeSortedSet::default();
        let mut model = BTreeMap::new();
        for step in 0..20_000 {
            let member = format!("m{}", rng.gen_range(0..2000)).into_bytes();
            let score = f64::from(rng.gen_range(-50..50));
            match rng.gen_range(0..10) {
                0..=5 => assert_eq!(set.insert(&member, score), model.insert(member, score), "step {step}"),
                6..=7 => assert_eq!(set.remove(&member), model.remove(&member), "step {step}"),
                _ => {
                    let max = rng.gen_bool(0.5);
                    let expected = ordered(&model);
                    let expected = if max { expected.last() } else { expected.first() }.cloned();
                    let popped = set.pop(max).map(|(score, member)| (score, member.to_vec()));
                    assert_eq!(popped, expected, "step {step}");
                    if let Some((_, member)) = popped {
                        model.remove(&member);
                    }
                }
            }
            assert_eq!(set.len(), model.len());
            if step % 500 == 0 {
                let all = ordered(&model);
                let from =
                    (f64::from(rng.gen_range(-60..60)), format!("m{}", rng.gen_range(0..2000)).into_bytes());
                let mut walked = Vec::new();
                set.walk_forward(Some((from.0, &from.1)), |score, member| {
                    walked.push((score, member.to_vec()));
                    true
                });
                let expected: Vec<_> = all
                    .iter()
                    .filter(|(score, member)| compare((*score, member), (from.0, &from.1)).is_ge())
                    .cloned()
                    .collect();
                assert_eq!(walked, expected);
                let bound = f64::from(rng.gen_range(-60..60));
                let mut walked = Vec::new();
                set.walk_backward(
                    |score| score <= bound,
                    |score, member| {
                        walked.push((score, member.to_vec()));
                        walked.len() < 300
                    },
                );
                let expected: Vec<_> =
                    all.iter().rev().filter(|(score, _)| *score <= bound).take(300).cloned().collect();
                assert_eq!(walked, expected);
            }
        }
    }
}
