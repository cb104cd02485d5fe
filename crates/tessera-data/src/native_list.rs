//! A large list held as a deque in the engine's memory, on an engine that
//! keeps native values ([`tessera_engine::Native`]): a push or a pop at
//! either end is one engine lookup and a change of the deque where the
//! paged form reads and rewrites the header and an end page; LINDEX and
//! LSET reach any element at once. Its order and answers are the paged
//! form's ([`crate::list`]).

use std::collections::VecDeque;

use bytes::Bytes;
use tessera_engine::Native;

use crate::list::End;

#[derive(Default)]
pub struct NativeList {
    elements: VecDeque<Box<[u8]>>,
}

impl Native for NativeList {}

impl NativeList {
    pub fn from_elements(elements: impl IntoIterator<Item = Bytes>) -> Self {
        Self { elements: elements.into_iter().map(|element| Box::from(element.as_ref())).collect() }
    }

    pub fn len(&self) -> usize {
        self.elements.len()
    }

    pub fn is_empty(&self) -> bool {
        self.elements.is_empty()
    }

    pub fn push(&mut self, end: End, element: &[u8]) {
        match end {
            End::Front => self.elements.push_front(element.into()),
            End::Back => self.elements.push_back(element.into()),
        }
    }

    pub fn pop(&mut self, end: End) -> Option<Bytes> {
        let element = match end {
            End::Front => self.elements.pop_front(),
            End::Back => self.elements.pop_back(),
        };
        element.map(Bytes::from)
    }

    pub fn get(&self, index: u64) -> Option<Bytes> {
        let index = usize::try_from(index).ok()?;
        self.elements.get(index).map(|element| Bytes::copy_from_slice(element))
    }

    /// Replaces element `index`; false when there is none.
    pub fn set(&mut self, index: u64, element: &[u8]) -> bool {
        match usize::try_from(index).ok().and_then(|index| self.elements.get_mut(index)) {
            Some(stored) => {
                *stored = element.into();
                true
            }
            None => false,
        }
    }

    /// Elements `start..=end`, front to back (an end past the last element
    /// stops at it).
    pub fn range(&self, start: u64, end: u64) -> Vec<Bytes> {
        let mut elements = Vec::new();
        self.visit_range(start, end, |element| elements.push(Bytes::copy_from_slice(element)));
        elements
    }

    /// Calls `visit` with elements `start..=end` where they lie, front to
    /// back: how many it visited.
    pub fn visit_range(&self, start: u64, end: u64, mut visit: impl FnMut(&[u8])) -> usize {
        if start > end || start >= self.elements.len() as u64 {
            return 0;
        }
        let end = end.min(self.elements.len() as u64 - 1);
        let range = self.elements.range(start as usize..=end as usize);
        let count = range.len();
        range.for_each(|element| visit(element));
        count
    }

    /// Calls `visit` with each element's index and value from `from`'s end
    /// inward, until it returns false.
    pub fn walk(&self, from: End, mut visit: impl FnMut(u64, &Bytes) -> bool) {
        let last = self.elements.len() as u64;
        let indexes: Box<dyn Iterator<Item = u64>> = match from {
            End::Front => Box::new(0..last),
            End::Back => Box::new((0..last).rev()),
        };
        for index in indexes {
            if !visit(index, &Bytes::copy_from_slice(&self.elements[index as usize])) {
                return;
            }
        }
    }

    /// Removes up to `limit` elements equal to `element` (0: all), from
    /// `from`'s end inward: how many it removed.
    pub fn remove(&mut self, element: &[u8], limit: u64, from: End) -> u64 {
        let mut matching: Vec<usize> = self
            .elements
            .iter()
            .enumerate()
            .filter(|(_, held)| held.as_ref() == element)
            .map(|(at, _)| at)
            .collect();
        if from == End::Back {
            matching.reverse();
        }
        if limit > 0 {
            matching.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        }
        let removed = matching.len() as u64;
        matching.sort_unstable();
        let mut next = matching.into_iter().peekable();
        let mut at = 0;
        self.elements.retain(|_| {
            let keep = next.peek() != Some(&at);
            if !keep {
                next.next();
            }
            at += 1;
            keep
        });
        removed
    }

    /// Inserts `element` before or after the first `pivot` from the front:
    /// false when there is no pivot.
    pub fn insert(&mut self, pivot: &[u8], element: &[u8], after: bool) -> bool {
        match self.elements.iter().position(|held| held.as_ref() == pivot) {
            Some(at) => {
                self.elements.insert(at + usize::from(after), element.into());
                true
            }
            None => false,
        }
    }

    /// Keeps elements `start..=end` only (indexes below the length, `start
    /// <= end`).
    pub fn trim(&mut self, start: u64, end: u64) {
        self.elements.truncate(end as usize + 1);
        self.elements.drain(..start as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(elements: &[&str]) -> NativeList {
        NativeList::from_elements(elements.iter().map(|element| Bytes::copy_from_slice(element.as_bytes())))
    }

    fn all(list: &NativeList) -> Vec<Bytes> {
        list.range(0, u64::MAX)
    }

    #[test]
    fn removals_count_from_the_end_asked_and_keep_the_order() {
        for (limit, from, kept) in [
            (0, End::Front, vec!["b", "c"]),
            (2, End::Front, vec!["b", "c", "a"]),
            (2, End::Back, vec!["a", "b", "c"]),
            (1, End::Back, vec!["a", "b", "a", "c"]),
        ] {
            let mut elements = list(&["a", "b", "a", "c", "a"]);
            let removed = elements.remove(b"a", limit, from);
            assert_eq!(all(&elements), kept, "limit {limit} from {from:?}");
            assert_eq!(removed, 5 - kept.len() as u64);
        }
    }

    #[test]
    fn ends_indexes_inserts_and_trims() {
        let mut elements = list(&["b", "c"]);
        elements.push(End::Front, b"a");
        elements.push(End::Back, b"d");
        assert_eq!(all(&elements), ["a", "b", "c", "d"]);
        assert_eq!(elements.get(3).as_deref(), Some(&b"d"[..]));
        assert_eq!(elements.get(4), None);
        assert!(elements.set(1, b"B") && !elements.set(9, b"x"));
        assert!(elements.insert(b"c", b"c2", true) && elements.insert(b"a", b"a0", false));
        assert!(!elements.insert(b"zz", b"x", true));
        assert_eq!(all(&elements), ["a0", "a", "B", "c", "c2", "d"]);
        let mut walked = Vec::new();
        elements.walk(End::Back, |index, element| {
            walked.push((index, element.clone()));
            walked.len() < 2
        });
        assert_eq!(walked, [(5, Bytes::from("d")), (4, Bytes::from("c2"))]);
        elements.trim(1, 3);
        assert_eq!(all(&elements), ["a", "B", "c"]);
        assert_eq!(elements.range(1, 1), ["B"]);
        assert_eq!(elements.pop(End::Back).as_deref(), Some(&b"c"[..]));
        assert_eq!(elements.pop(End::Front).as_deref(), Some(&b"a"[..]));
        assert_eq!(elements.len(), 1);
    }
}
