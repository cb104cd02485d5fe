//! Clients: each runs one operation at a time, chosen by the workload, sent
//! where a client that read the shard's map would send it, and recorded in
//! the history with its outcome. On a quorum protocol half the writes go the
//! way a node runs a command there: fetch the key's record, then write only
//! if it is still the one fetched. In the batches workload a write covers
//! every key of a group, and the history names the group.

use bytes::Bytes;
use tessera_protocol::registry::StrongReads;
use tessera_protocol::{
    ClientReply, ClientRequest, Consistency, NodeId, Operation as ProtocolOperation, Record, RequestId,
    Version, Write,
};

/// Keys of each group in the batches workload.
pub(crate) const GROUP_KEYS: usize = 3;

/// The keys of group `group` (`g1`: `g1.0`, `g1.1`, ...).
pub(crate) fn group_members(group: &[u8]) -> impl Iterator<Item = Bytes> + '_ {
    (0..GROUP_KEYS).map(move |index| Bytes::from([group, b".", index.to_string().as_bytes()].concat()))
}

/// The key the history records an operation on `key` under: its group for a
/// group's key, else the key itself.
pub(crate) fn history_key(key: &Bytes) -> Bytes {
    match key.iter().position(|byte| *byte == b'.') {
        Some(dot) => key.slice(..dot),
        None => key.clone(),
    }
}

use crate::collections::{is_header, page_keys, CollectionRead};
use crate::config::{RunTiming, Workload};
use crate::history::{Call, Operation, Outcome};
use crate::network::{Address, Message};
use crate::rng::Rng;
use crate::sim::{key_name, Event, Report, Simulation};

pub(crate) struct Pending {
    pub request: RequestId,
    pub key: Bytes,
    pub call: Call,
    pub strong: bool,
    pub invoked_at: u64,
    pub deadline: u64,
    /// The request in flight fetches a record for a conditional write of
    /// `call`, which follows once every key it writes is fetched: the
    /// records fetched so far (`None`: not conditional, or fetched).
    pub fetching: Option<Vec<Option<(Version, NodeId)>>>,
    /// The request in flight is a step of a whole collection's read.
    pub reading: Option<CollectionRead>,
}

/// The keys `call` writes under `workload`: the key, each key of its
/// group, or a collection's header and its new pages.
fn written_keys(workload: Workload, key: &Bytes, call: &Call) -> Vec<Bytes> {
    match (workload, call) {
        (Workload::Batches, _) => group_members(key).collect(),
        (Workload::Collections, Call::Put(id)) => {
            [key.clone()].into_iter().chain(page_keys(key, id)).collect()
        }
        _ => vec![key.clone()],
    }
}

pub(crate) struct Client {
    pub rng: Rng,
    pub next_request: u64,
    pub pending: Option<Pending>,
    /// Keys still to read back in the liveness phase.
    pub final_reads: Vec<Bytes>,
}

impl Client {
    pub fn new(rng: Rng) -> Self {
        Self { rng, next_request: 1, pending: None, final_reads: Vec::new() }
    }

    /// The client a request id belongs to: ids carry it in their high half.
    pub fn of(request: RequestId) -> usize {
        (request.0 >> 32) as usize
    }

    /// A new request id for client number `client`.
    pub fn next_id(&mut self, client: usize) -> RequestId {
        let id = RequestId(((client as u64) << 32) | self.next_request);
        self.next_request += 1;
        id
    }

    /// At a wake-up, whether to issue the next operation. A request past its
    /// deadline gets an unknown outcome; a wake-up before the deadline is
    /// stale (the deadline's is queued); and the last stretch of the run is
    /// left to final reads, so that propagation can finish before the
    /// convergence check.
    pub fn wake(&mut self, client: usize, now: u64, timing: &RunTiming, report: &mut Report) -> bool {
        if let Some(pending) = &self.pending {
            if now < pending.deadline {
                return false;
            }
            let pending = self.pending.take().expect("checked above");
            record_unknown(report, client, pending);
        }
        let end = timing.safety_ms + timing.liveness_ms;
        now + timing.client_timeout_ms + 200 <= end || !self.final_reads.is_empty()
    }

    /// A register workload's next operation on one of `keys` keys: a read
    /// (45%), a write of a value no one else writes (45%) or a delete.
    pub fn register_operation(&mut self, client: usize, keys: usize) -> (Bytes, Call) {
        let key = key_name("k", self.rng.below(keys as u64) as usize);
        let roll = self.rng.below(100);
        let call = if roll < 45 {
            Call::Get
        } else if roll < 90 {
            Call::Put(Bytes::from(format!("c{client}-{}", self.next_request)))
        } else {
            Call::Delete
        };
        (key, call)
    }

    /// The request `request` answers, unless the client gave up on it.
    pub fn answered(&mut self, request: RequestId) -> Option<Pending> {
        self.pending.take_if(|pending| pending.request == request)
    }

    /// Records an answered operation (an eventual read goes to no history
    /// check: returns false) and ticks off the final read it was.
    pub fn complete(
        &mut self,
        client: usize,
        pending: Pending,
        outcome: Outcome,
        now: u64,
        report: &mut Report,
    ) -> bool {
        report.completed += 1;
        if self.final_reads.last().map(history_key).as_ref() == Some(&pending.key) {
            self.final_reads.pop(); // final reads start only once healed
        }
        if !pending.strong && pending.call == Call::Get {
            return false;
        }
        if pending.call != Call::Get {
            report.acknowledged_writes += 1;
        }
        report.history.operations.push(Operation {
            client,
            key: pending.key,
            call: pending.call,
            outcome,
            invoked_at: pending.invoked_at,
            completed_at: Some(now),
        });
        true
    }
}

/// An operation whose outcome the client cannot know (no answer in time, or
/// an answer saying so): it may take effect at any moment after it was
/// invoked.
pub(crate) fn record_unknown(report: &mut Report, client: usize, pending: Pending) {
    if pending.fetching.is_some() {
        return; // only a fetch was sent: the write never was
    }
    if pending.reading.is_some() {
        return; // a read has no effect
    }
    report.unknown += 1;
    if pending.strong || pending.call != Call::Get {
        report.history.operations.push(Operation {
            client,
            key: pending.key,
            call: pending.call,
            outcome: Outcome::Unknown,
            invoked_at: pending.invoked_at,
            completed_at: None,
        });
    }
}

/// The record a fetch answered (or none), unless the answer has none to use.
pub(crate) fn fetched_record(reply: ClientReply) -> Option<Option<Record>> {
    match reply {
        ClientReply::Value(None) => Some(None),
        ClientReply::Value(Some(raw)) => Record::decode(raw).ok().map(Some),
        _ => None,
    }
}

impl Simulation {
    pub(crate) fn client_wake(&mut self, client: usize) {
        if self.clients[client].wake(client, self.now, &self.config.timing, &mut self.report) {
            self.issue(client);
        }
    }

    fn issue(&mut self, client: usize) {
        let mode = self.mode();
        let config = &self.config;
        let state = &mut self.clients[client];
        let (key, call, strong) = if let Some(key) = state.final_reads.last().cloned() {
            (key, Call::Get, true)
        } else if config.workload == Workload::Appends {
            let key = Bytes::from(format!("a{client}-{}", state.next_request));
            (key.clone(), Call::Put(key), true)
        } else if config.workload == Workload::Batches {
            let (group, call) = state.register_operation(client, config.keys);
            let group = Bytes::from([b"g", &group[1..]].concat());
            match call {
                Call::Get => {
                    let member = group_members(&group).nth(state.rng.below(GROUP_KEYS as u64) as usize);
                    let strong = !state.rng.chance(config.eventual_read_fraction);
                    (member.expect("a group's key"), Call::Get, strong)
                }
                write => (group, write, true),
            }
        } else if state.rng.chance(0.25) && config.counters > 0 {
            let key = key_name("c", state.rng.below(config.counters as u64) as usize);
            if state.rng.chance(0.5) {
                (key, Call::Increment(state.rng.between(1, 5) as i64), true)
            } else {
                (key, Call::Get, !state.rng.chance(config.eventual_read_fraction))
            }
        } else {
            let (key, call) = state.register_operation(client, config.keys);
            let strong = call != Call::Get || !state.rng.chance(config.eventual_read_fraction);
            (key, call, strong)
        };
        let request = state.next_id(client);
        let written = written_keys(config.workload, &key, &call);
        // Only on quorum protocols, and single deletes on last-writer-wins
        // ones (as the expiry sweep deletes there); only there does it take a
        // draw from the client's generator, so every other protocol's seeds
        // run as before.
        let conditional =
            matches!(config.workload, Workload::Registers | Workload::Batches | Workload::Collections)
                && (matches!(call, Call::Put(_) | Call::Delete) && mode.quorum
                    || call == Call::Delete && mode.last_writer_wins() && written.len() == 1)
                && state.rng.chance(0.5);
        let batch = |write: Write| ProtocolOperation::Batch {
            writes: written.iter().map(|member| (member.clone(), write.clone())).collect(),
        };
        // Final reads are single reads: a whole collection's takes four
        // round trips, longer than the liveness window allows for them all.
        let final_read = state.final_reads.last() == Some(&key);
        let whole_collection =
            config.workload == Workload::Collections && call == Call::Get && strong && is_header(&key);
        let reading = (whole_collection && !final_read).then(CollectionRead::default);
        let operation = match &call {
            _ if conditional || reading.is_some() => ProtocolOperation::Fetch { key: written[0].clone() },
            Call::Put(value) if written.len() > 1 => batch(Write::Put(value.clone())),
            Call::Delete if config.workload == Workload::Batches => batch(Write::Delete),
            Call::Get => ProtocolOperation::Get {
                key: key.clone(),
                consistency: if strong { Consistency::Strong } else { Consistency::Eventual },
            },
            Call::Put(value) => ProtocolOperation::Put { key: key.clone(), value: value.clone() },
            Call::Delete => ProtocolOperation::Delete { key: key.clone() },
            Call::Increment(delta) => ProtocolOperation::Increment { key: key.clone(), delta: *delta },
        };
        let target = self.route(client, &call, strong);
        let deadline = self.now + self.config.timing.client_timeout_ms;
        self.clients[client].pending = Some(Pending {
            request,
            key: history_key(&key),
            call,
            strong,
            invoked_at: self.now,
            deadline,
            fetching: conditional.then(Vec::new),
            reading,
        });
        self.send(
            Address::Client(client),
            Address::Replica(target),
            Message::Request(ClientRequest { id: request, operation }),
        );
        self.timeline.schedule(deadline, Event::ClientWake(client));
    }

    /// Where a client sends a request, from the coordinator's current view (what
    /// a client learns from the shard map).
    fn route(&mut self, client: usize, call: &Call, strong: bool) -> u32 {
        let mode = self.mode();
        let replicas = &self.coordinator.view().replicas;
        let rng = &mut self.clients[client].rng;
        let target = if mode.active_active || (*call == Call::Get && !strong) {
            *rng.pick(replicas)
        } else if *call != Call::Get {
            replicas[0]
        } else {
            match mode.strong_reads {
                StrongReads::First => replicas[0],
                StrongReads::Last => *replicas.last().expect("a view keeps at least one replica"),
                StrongReads::Any => *rng.pick(replicas),
            }
        };
        target.0
    }

    /// A fetch for a conditional write answered: the next key's fetch
    /// follows, or, once every key the write names is fetched, the write,
    /// conditioned on the records fetched (a batch's on each of its keys');
    /// anything else leaves the write without effect, to be tried again.
    fn on_fetched(&mut self, client: usize, mut pending: Pending, reply: ClientReply) {
        let Some(fetched) = fetched_record(reply) else { return self.retry_later(client) };
        let expected = fetched.as_ref().map(Record::ballot);
        let write = match &pending.call {
            Call::Put(value) => Write::Put(value.clone()),
            Call::Delete => Write::Delete,
            other => unreachable!("only puts and deletes are conditional: {other:?}"),
        };
        let keys = written_keys(self.config.workload, &pending.key, &pending.call);
        let mut fetched = pending.fetching.take().expect("fetching");
        fetched.push(expected);
        let operation = if fetched.len() < keys.len() {
            let next = ProtocolOperation::Fetch { key: keys[fetched.len()].clone() };
            pending.fetching = Some(fetched);
            next
        } else if keys.len() == 1 {
            ProtocolOperation::WriteIf { key: keys[0].clone(), expected: fetched[0], write }
        } else {
            let writes = keys.into_iter().zip(fetched).map(|(key, expected)| (key, expected, write.clone()));
            ProtocolOperation::BatchIf { writes: writes.collect() }
        };
        self.resend(client, pending, operation);
    }

    /// After an answer that had no effect: the client tries something
    /// again shortly.
    pub(crate) fn retry_later(&mut self, client: usize) {
        self.report.retried += 1;
        let retry_at = self.now + 5 + self.clients[client].rng.below(10);
        self.timeline.schedule(retry_at, Event::ClientWake(client));
    }

    /// The next request of a multi-step operation (a conditional write's,
    /// a whole collection's read), with a new id and deadline.
    pub(crate) fn resend(&mut self, client: usize, pending: Pending, operation: ProtocolOperation) {
        let request = self.clients[client].next_id(client);
        let target = self.route(client, &pending.call, true);
        let deadline = self.now + self.config.timing.client_timeout_ms;
        self.clients[client].pending = Some(Pending { request, deadline, ..pending });
        self.send(
            Address::Client(client),
            Address::Replica(target),
            Message::Request(ClientRequest { id: request, operation }),
        );
        self.timeline.schedule(deadline, Event::ClientWake(client));
    }

    pub(crate) fn on_response(&mut self, client: usize, request: RequestId, reply: ClientReply) {
        let Some(pending) = self.clients[client].answered(request) else { return };
        if pending.fetching.is_some() {
            return self.on_fetched(client, pending, reply);
        }
        if pending.reading.is_some() {
            return self.on_collection_read(client, pending, reply);
        }
        let outcome = match reply {
            ClientReply::Value(value) => Outcome::Value(value),
            ClientReply::Written => Outcome::Written,
            ClientReply::Causal { .. } => unreachable!("these runs make no causal requests"),
            ClientReply::Elsewhere(_)
            | ClientReply::Retry(_)
            | ClientReply::Changed
            | ClientReply::Failed(_) => return self.retry_later(client),
            ClientReply::Unknown(_) => {
                // As after a timeout: it may take effect at any time from now.
                record_unknown(&mut self.report, client, pending);
                self.timeline.schedule(self.now + 1, Event::ClientWake(client));
                return;
            }
        };
        if !self.clients[client].complete(client, pending, outcome, self.now, &mut self.report) {
            self.eventual_reads += 1;
        }
        let think = self.clients[client].rng.below(5);
        self.timeline.schedule(self.now + think, Event::ClientWake(client));
    }
}
