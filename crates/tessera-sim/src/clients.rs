//! Clients: each runs one operation at a time, chosen by the workload, sent
//! where a client that read the shard's map would send it, and recorded in
//! the history with its outcome. On a quorum protocol half the writes go the
//! way a node runs a command there: fetch the key's record, then write only
//! if it is still the one fetched.

use bytes::Bytes;
use tessera_protocol::registry::StrongReads;
use tessera_protocol::{
    ClientReply, ClientRequest, Consistency, Operation as ProtocolOperation, Record, RequestId, Write,
};

use crate::config::Workload;
use crate::history::{Call, Operation, Outcome};
use crate::network::{Address, Message};
use crate::rng::Rng;
use crate::sim::{key_name, Event, Simulation};

pub(crate) struct Pending {
    pub request: RequestId,
    pub key: Bytes,
    pub call: Call,
    pub strong: bool,
    pub invoked_at: u64,
    pub deadline: u64,
    /// The request in flight fetches the key's record for a conditional
    /// write of `call`, which follows.
    pub fetching: bool,
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
}

impl Simulation {
    pub(crate) fn client_wake(&mut self, client: usize) {
        let now = self.now;
        if let Some(pending) = &self.clients[client].pending {
            if now < pending.deadline {
                return; // a stale wake-up; the deadline one is queued
            }
            let pending = self.clients[client].pending.take().expect("checked above");
            self.record_unknown(client, pending);
        }
        let end = self.config.timing.safety_ms + self.config.timing.liveness_ms;
        // The last stretch is quiet, so that propagation can finish before the
        // convergence check.
        if now + self.config.timing.client_timeout_ms + 200 > end
            && self.clients[client].final_reads.is_empty()
        {
            return;
        }
        self.issue(client);
    }

    /// An operation whose outcome the client cannot know (no answer in time,
    /// or an answer saying so): it may take effect at any moment after it was
    /// invoked.
    fn record_unknown(&mut self, client: usize, pending: Pending) {
        if pending.fetching {
            return; // only the fetch was sent: the write never was
        }
        self.report.unknown += 1;
        if pending.strong || pending.call != Call::Get {
            self.report.history.operations.push(Operation {
                client,
                key: pending.key,
                call: pending.call,
                outcome: Outcome::Unknown,
                invoked_at: pending.invoked_at,
                completed_at: None,
            });
        }
    }

    fn issue(&mut self, client: usize) {
        let quorum = self.mode().quorum;
        let config = &self.config;
        let state = &mut self.clients[client];
        let (key, call, strong) = if let Some(key) = state.final_reads.last().cloned() {
            (key, Call::Get, true)
        } else if config.workload == Workload::Appends {
            let key = Bytes::from(format!("a{client}-{}", state.next_request));
            (key.clone(), Call::Put(key), true)
        } else if state.rng.chance(0.25) && config.counters > 0 {
            let key = key_name("c", state.rng.below(config.counters as u64) as usize);
            if state.rng.chance(0.5) {
                (key, Call::Increment(state.rng.between(1, 5) as i64), true)
            } else {
                (key, Call::Get, !state.rng.chance(config.eventual_read_fraction))
            }
        } else {
            let key = key_name("k", state.rng.below(config.keys as u64) as usize);
            let roll = state.rng.below(100);
            let call = if roll < 45 {
                Call::Get
            } else if roll < 90 {
                Call::Put(Bytes::from(format!("c{client}-{}", state.next_request)))
            } else {
                Call::Delete
            };
            let strong = call != Call::Get || !state.rng.chance(config.eventual_read_fraction);
            (key, call, strong)
        };
        let request = RequestId(((client as u64) << 32) | state.next_request);
        state.next_request += 1;
        // Only on quorum protocols, and only there does it take a draw from
        // the client's generator, so every other protocol's seeds run as before.
        let conditional = config.workload == Workload::Registers
            && matches!(call, Call::Put(_) | Call::Delete)
            && quorum
            && state.rng.chance(0.5);
        let operation = match &call {
            _ if conditional => ProtocolOperation::Fetch { key: key.clone() },
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
            key,
            call,
            strong,
            invoked_at: self.now,
            deadline,
            fetching: conditional,
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

    /// The first half of a conditional write answered: the write follows,
    /// conditioned on the record fetched; anything else leaves the write
    /// without effect, to be tried again.
    fn on_fetched(&mut self, client: usize, pending: Pending, reply: ClientReply) {
        let fetched = match reply {
            ClientReply::Value(None) => Some(None),
            ClientReply::Value(Some(raw)) => {
                Record::decode(raw).ok().map(|record| Some((record.version, record.origin)))
            }
            _ => None,
        };
        let Some(expected) = fetched else {
            self.report.retried += 1;
            let retry_at = self.now + 5 + self.clients[client].rng.below(10);
            self.timeline.schedule(retry_at, Event::ClientWake(client));
            return;
        };
        let write = match &pending.call {
            Call::Put(value) => Write::Put(value.clone()),
            Call::Delete => Write::Delete,
            other => unreachable!("only puts and deletes are conditional: {other:?}"),
        };
        let state = &mut self.clients[client];
        let request = RequestId(((client as u64) << 32) | state.next_request);
        state.next_request += 1;
        let operation = ProtocolOperation::WriteIf { key: pending.key.clone(), expected, write };
        let target = self.route(client, &pending.call, true);
        let deadline = self.now + self.config.timing.client_timeout_ms;
        self.clients[client].pending = Some(Pending { request, deadline, fetching: false, ..pending });
        self.send(
            Address::Client(client),
            Address::Replica(target),
            Message::Request(ClientRequest { id: request, operation }),
        );
        self.timeline.schedule(deadline, Event::ClientWake(client));
    }

    pub(crate) fn on_response(&mut self, client: usize, request: RequestId, reply: ClientReply) {
        let Some(pending) = &self.clients[client].pending else { return };
        if pending.request != request {
            return; // an answer to a request the client gave up on
        }
        let pending = self.clients[client].pending.take().expect("checked above");
        if pending.fetching {
            return self.on_fetched(client, pending, reply);
        }
        let outcome = match reply {
            ClientReply::Value(value) => Outcome::Value(value),
            ClientReply::Written => Outcome::Written,
            ClientReply::Elsewhere(_)
            | ClientReply::Retry(_)
            | ClientReply::Changed
            | ClientReply::Failed(_) => {
                // No effect: try something again shortly.
                self.report.retried += 1;
                let retry_at = self.now + 5 + self.clients[client].rng.below(10);
                self.timeline.schedule(retry_at, Event::ClientWake(client));
                return;
            }
            ClientReply::Unknown(_) => {
                // As after a timeout: it may take effect at any time from now.
                self.record_unknown(client, pending);
                self.timeline.schedule(self.now + 1, Event::ClientWake(client));
                return;
            }
        };
        self.report.completed += 1;
        if pending.strong || pending.call != Call::Get {
            if pending.call != Call::Get {
                self.report.acknowledged_writes += 1;
            }
            self.report.history.operations.push(Operation {
                client,
                key: pending.key.clone(),
                call: pending.call,
                outcome,
                invoked_at: pending.invoked_at,
                completed_at: Some(self.now),
            });
        } else {
            self.eventual_reads += 1;
        }
        if self.healed && self.clients[client].final_reads.last() == Some(&pending.key) {
            self.clients[client].final_reads.pop();
        }
        let think = self.clients[client].rng.below(5);
        self.timeline.schedule(self.now + think, Event::ClientWake(client));
    }
}
