//! The collections workload: paged collections on a quorum protocol, and the
//! expiry sweep that deletes their orphaned pages, as a node runs them
//! (docs/PROTOCOLS.md, "AA+SC").
//!
//! A collection is a header key (a register key, `k0`, ...) whose value is an id, and [`PAGES`] page
//! keys named after the header and the id, each holding the id. Writing a
//! collection anew writes the header and fresh pages in one batch and
//! leaves the old pages behind; deleting it deletes the header alone. The
//! sweep runs at the shard's head over that member's own copy, which may
//! lag the quorum's: a page whose header there names another id (or none)
//! is judged an orphan and deleted by a conditional batch that also names
//! the header's record as the head saw it, so a header written since makes
//! the delete answer that it changed.
//!
//! The check: a client reads a whole collection (the header's record, each
//! page, the header's record again); if the header kept one record
//! throughout, every page it names must have been there with its id. At the
//! end, every header the majority holds must find its pages there too.

use std::collections::BTreeMap;

use bytes::Bytes;
use tessera_protocol::{
    for_each_entry, ClientReply, Operation as ProtocolOperation, Record, RequestId, Write,
};

use crate::checks::convergence::Majority;
use crate::clients::{fetched_record, Pending};
use crate::history::Outcome;
use crate::sim::{as_read, Event, Simulation};

/// Pages of every collection.
pub(crate) const PAGES: usize = 2;

/// How often the head sweeps (virtual ms), and the most collections one
/// sweep deletes pages of.
const SWEEP_EVERY_MS: u64 = 50;
const SWEEP_DELETES_MAX: usize = 8;

/// The page keys of collection `header` when its id is `id`.
pub(crate) fn page_keys(header: &Bytes, id: &Bytes) -> Vec<Bytes> {
    (0..PAGES)
        .map(|page| Bytes::from([&header[..], b"#", id, b"#", page.to_string().as_bytes()].concat()))
        .collect()
}

/// Whether `key` is a collection's header: the register keys are (the
/// counters are not).
pub(crate) fn is_header(key: &[u8]) -> bool {
    key.starts_with(b"k") && !key.contains(&b'#')
}

/// A page key's header and id (`None`: not a page key).
fn page_owner(key: &Bytes) -> Option<(Bytes, Bytes)> {
    let first = key.iter().position(|byte| *byte == b'#')?;
    let second = first + 1 + key[first + 1..].iter().position(|byte| *byte == b'#')?;
    Some((key.slice(..first), key.slice(first + 1..second)))
}

/// The sweep's deletes in flight: a header with one is not swept again
/// until it is answered (or its answer is given up on, as a client gives
/// up), so deletes of one collection's pages do not pile up and contend
/// with each other and with the header's writers.
#[derive(Debug, Default)]
pub(crate) struct Sweeper {
    sent: u64,
    in_flight: BTreeMap<RequestId, InFlight>,
}

#[derive(Debug)]
struct InFlight {
    header: Bytes,
    pages: u64,
    sent_at: u64,
}

impl Sweeper {
    fn deleting(&self, header: &Bytes) -> bool {
        self.in_flight.values().any(|delete| delete.header == *header)
    }
}

/// A read of a whole collection under way: the header's record as first
/// fetched, then each page's value as fetched.
#[derive(Debug, Default)]
pub(crate) struct CollectionRead {
    header: Option<Option<Record>>,
    pages: Vec<Option<Bytes>>,
}

impl Simulation {
    /// The client id the sweep's requests carry: one past the clients'.
    pub(crate) fn sweeper(&self) -> usize {
        self.clients.len()
    }

    pub(crate) fn schedule_sweeps(&mut self) {
        self.timeline.schedule(SWEEP_EVERY_MS, Event::Sweep);
    }

    /// One sweep at the head of the current view, over its own records.
    pub(crate) fn sweep(&mut self) {
        // The sweep stops when clients stop writing, so that the run ends
        // quiet for the convergence check.
        let timing = &self.config.timing;
        if self.now + timing.client_timeout_ms + 200 > timing.safety_ms + timing.liveness_ms {
            return;
        }
        self.timeline.schedule(self.now + SWEEP_EVERY_MS, Event::Sweep);
        let head = self.coordinator.view().replicas[0].0;
        if !self.replica_alive(head) {
            return;
        }
        let given_up_before = self.now.saturating_sub(self.config.timing.client_timeout_ms);
        self.sweeper.in_flight.retain(|_, delete| delete.sent_at >= given_up_before);
        let mut records = BTreeMap::new();
        for_each_entry(self.replica_engine(head).as_ref(), |key, raw| {
            if let Ok(record) = Record::decode(raw) {
                records.insert(key, record);
            }
            Ok(())
        })
        .expect("memory engines do not fail");
        // Each header's orphaned pages, deleted in one batch with it: a
        // batch per page would lock the header once per page, the batches
        // refusing one another and each abort restamping the header that
        // the others expect.
        let mut orphans: BTreeMap<Bytes, Vec<(Bytes, Record)>> = BTreeMap::new();
        for (key, page) in &records {
            let Some((header, id)) = page_owner(key) else { continue };
            let header_held = records.get(&header).and_then(Record::visible);
            if page.tombstone || header_held == Some(&id) || self.sweeper.deleting(&header) {
                continue;
            }
            if orphans.len() == SWEEP_DELETES_MAX && !orphans.contains_key(&header) {
                break;
            }
            orphans.entry(header).or_default().push((key.clone(), page.clone()));
        }
        let sweeper = self.sweeper();
        for (header, pages) in orphans {
            let held = records.get(&header);
            let count = pages.len() as u64;
            let mut writes: Vec<_> =
                pages.into_iter().map(|(key, page)| (key, Some(page.ballot()), Write::Delete)).collect();
            #[cfg(any(test, feature = "broken"))]
            let broken = self.config.broken_sweep_ignores_header;
            #[cfg(not(any(test, feature = "broken")))]
            let broken = false;
            if !broken {
                writes.push((header.clone(), held.map(Record::ballot), Write::restoring(held)));
            }
            self.sweeper.sent += 1;
            let request = RequestId(((sweeper as u64) << 32) | self.sweeper.sent);
            self.sweeper.in_flight.insert(request, InFlight { header, pages: count, sent_at: self.now });
            self.submit_local(head, request, ProtocolOperation::BatchIf { writes });
        }
    }

    /// A sweep's delete answered: nobody waits for it, the run counts it.
    pub(crate) fn on_sweep_reply(&mut self, request: RequestId, reply: ClientReply) {
        let Some(delete) = self.sweeper.in_flight.remove(&request) else { return };
        if reply == ClientReply::Written {
            self.report.orphans_swept += delete.pages;
        }
    }

    /// A step of a whole collection's read answered: the next follows, or
    /// the read completes and is checked. An answer with no record is
    /// retried later, as a fetch for a conditional write is (reads have no
    /// effect).
    pub(crate) fn on_collection_read(&mut self, client: usize, mut pending: Pending, reply: ClientReply) {
        let Some(fetched) = fetched_record(reply) else { return self.retry_later(client) };
        let mut read = pending.reading.take().expect("a collection read");
        let header = pending.key.clone();
        let Some(first) = &read.header else {
            let Some(id) = fetched.as_ref().and_then(Record::visible).cloned() else {
                return self.complete_collection_read(client, pending, None);
            };
            read.header = Some(fetched);
            let page = page_keys(&header, &id).swap_remove(0);
            pending.reading = Some(read);
            return self.resend(client, pending, ProtocolOperation::Fetch { key: page });
        };
        let id =
            first.as_ref().and_then(Record::visible).cloned().expect("pages are read under a live header");
        if read.pages.len() < PAGES {
            read.pages.push(fetched.as_ref().and_then(Record::visible).cloned());
            let next = match page_keys(&header, &id).into_iter().nth(read.pages.len()) {
                Some(page) => page,
                None => header, // then the header again
            };
            pending.reading = Some(read);
            return self.resend(client, pending, ProtocolOperation::Fetch { key: next });
        }
        // `fetched` is the header again.
        if first.as_ref().map(Record::ballot) == fetched.as_ref().map(Record::ballot) {
            self.check_pages(&header, &id, &read.pages);
        }
        self.complete_collection_read(client, pending, Some(id));
    }

    fn complete_collection_read(&mut self, client: usize, pending: Pending, value: Option<Bytes>) {
        let checked =
            self.clients[client].complete(client, pending, Outcome::Value(value), self.now, &mut self.report);
        debug_assert!(checked, "a collection read is strong");
        let think = self.clients[client].rng.below(5);
        self.timeline.schedule(self.now + think, Event::ClientWake(client));
    }

    fn check_pages(&mut self, header: &Bytes, id: &Bytes, pages: &[Option<Bytes>]) {
        for (key, value) in page_keys(header, id).iter().zip(pages) {
            if value.as_ref() != Some(id) {
                self.report.violations.push(format!(
                    "collections: at {}ms page {:?} read {:?} while its header held {:?} throughout",
                    self.now,
                    String::from_utf8_lossy(key),
                    value,
                    String::from_utf8_lossy(id),
                ));
            }
        }
    }

    /// At the end: every header the majority holds finds its pages there
    /// (each intent taken as its batch's primary decided).
    pub(crate) fn check_collections_whole(&mut self, majority: &Majority) {
        let values: BTreeMap<Bytes, Option<Bytes>> = as_read(&majority.state).into_iter().collect();
        let undecided = |key: &Bytes| majority.undecided.contains(key);
        for (key, value) in &values {
            let Some(id) = value.as_ref().filter(|_| is_header(key) && !undecided(key)) else { continue };
            for page in page_keys(key, id) {
                if !undecided(&page) && values.get(&page).cloned().flatten().as_ref() != Some(id) {
                    self.report.violations.push(format!(
                        "collections: header {:?} names {:?}, which a majority lacks at the end",
                        String::from_utf8_lossy(key),
                        String::from_utf8_lossy(&page)
                    ));
                }
            }
        }
    }
}
