//! The simulated network: what travels between replicas, the coordinator and
//! clients, and the faults it suffers (delay, reordering, drops, partitions).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use tessera_protocol::{ClientReply, ClientRequest, PeerMessage, Progress, RequestId, ShardView};

use crate::config::{FaultKind, FaultMix};
use crate::rng::Rng;
use crate::sim::{Event, Simulation};

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Address {
    Replica(u32),
    Coordinator,
    Client(usize),
}

#[derive(Clone, Debug)]
pub(crate) enum Message {
    Peer(PeerMessage),
    /// Replica → coordinator: alive, with progress; asks for a lease. The
    /// incarnation changes at every restart.
    Heartbeat {
        seq: u64,
        progress: Progress,
        incarnation: u64,
    },
    /// Coordinator → replica: the current view, granting a lease for
    /// heartbeat `seq`.
    Grant {
        seq: u64,
        view: ShardView,
    },
    Request(ClientRequest),
    Response {
        request: RequestId,
        reply: ClientReply,
    },
}

impl Simulation {
    /// Sends a message through the links' faults.
    pub(crate) fn send(&mut self, from: Address, to: Address, message: Message) {
        self.report.messages += 1;
        let faulty = !self.healed;
        if let Some(at) = self.links.arrival(&mut self.rng, &self.report.faults, faulty, self.now, from, to) {
            self.timeline.schedule(at, Event::Deliver { from, to, message });
        }
    }
}

/// Events in virtual time; those due at the same time run in the order they
/// were scheduled.
pub(crate) struct Timeline<E> {
    due: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, E>,
    next_id: u64,
}

impl<E> Timeline<E> {
    pub fn new() -> Self {
        Self { due: BinaryHeap::new(), events: HashMap::new(), next_id: 0 }
    }

    pub fn schedule(&mut self, at: u64, event: E) {
        let id = self.next_id;
        self.next_id += 1;
        self.events.insert(id, event);
        self.due.push(Reverse((at, id)));
    }

    /// The next event and its time, unless none is due by `end`.
    pub fn next_until(&mut self, end: u64) -> Option<(u64, E)> {
        let Reverse((at, id)) = self.due.pop().filter(|Reverse((at, _))| *at <= end)?;
        Some((at, self.events.remove(&id).expect("every queued event is stored")))
    }
}

/// The links between a run's servers and clients.
#[derive(Default)]
pub(crate) struct Links {
    /// Links a partition cuts, one way each.
    pub blocked: BTreeSet<(Address, Address)>,
    /// Per channel, the last scheduled delivery time (for FIFO channels).
    channel_clock: HashMap<(Address, Address), u64>,
}

impl Links {
    /// When a message sent at `now` arrives, or `None` if it is lost: while
    /// `faulty`, blocked by a partition, dropped, delayed, and reordered
    /// unless the seed keeps channels FIFO; otherwise only delayed.
    pub fn arrival(
        &mut self,
        rng: &mut Rng,
        faults: &FaultMix,
        faulty: bool,
        now: u64,
        from: Address,
        to: Address,
    ) -> Option<u64> {
        if faulty && (self.blocked.contains(&(from, to)) || rng.chance(faults.drop_probability)) {
            return None;
        }
        let mut at = now + 1 + rng.below(faults.delay_max_ms.max(1));
        if !faults.enabled.contains(&FaultKind::Reorder) || !faulty {
            let clock = self.channel_clock.entry((from, to)).or_insert(0);
            at = at.max(*clock);
            *clock = at;
        }
        Some(at)
    }
}

/// A fault of the safety phase, in either simulation.
#[derive(Clone, Debug)]
pub(crate) enum Fault {
    Crash(u32),
    /// The server comes back with nothing it held in memory.
    Restart(u32),
    Partition(Vec<(Address, Address)>),
    Heal,
    /// The coordinator suspects a server that may well be alive.
    Suspect(u32),
}

/// The safety phase's faults: from 200 ms, every 150–700 ms, one of `kinds`
/// if it is enabled, on a random one of `servers`. A partition heals within
/// 600 ms (by the end of the phase), a crashed server restarts within 800 ms.
pub(crate) fn schedule_faults(
    rng: &mut Rng,
    enabled: &BTreeSet<FaultKind>,
    kinds: &[FaultKind],
    servers: u32,
    safety_ms: u64,
) -> Vec<(u64, Fault)> {
    let mut faults = Vec::new();
    let mut at = 200;
    while at < safety_ms {
        let kind = *rng.pick(kinds);
        if enabled.contains(&kind) {
            let server = rng.below(u64::from(servers)) as u32;
            match kind {
                FaultKind::Partition => {
                    let cut = draw_partition(rng, servers);
                    let heal_at = at + rng.between(50, 600);
                    faults.push((at, Fault::Partition(cut)));
                    faults.push((heal_at.min(safety_ms), Fault::Heal));
                }
                FaultKind::Crash => {
                    faults.push((at, Fault::Crash(server)));
                    faults.push((at + rng.between(100, 800), Fault::Restart(server)));
                }
                FaultKind::FalseSuspicion => faults.push((at, Fault::Suspect(server))),
                other => unreachable!("{other:?} is not scheduled; the links inject it"),
            }
        }
        at += rng.between(150, 700);
    }
    faults
}

/// A random cut among `servers` replicas and the coordinator: some links
/// blocked one way or both.
fn draw_partition(rng: &mut Rng, servers: u32) -> Vec<(Address, Address)> {
    let mut servers: Vec<Address> = (0..servers).map(Address::Replica).collect();
    servers.push(Address::Coordinator);
    let side: Vec<bool> = servers.iter().map(|_| rng.chance(0.5)).collect();
    let one_way = rng.chance(0.3);
    let mut cut = Vec::new();
    for (a, a_side) in servers.iter().zip(&side) {
        for (b, b_side) in servers.iter().zip(&side) {
            if a_side != b_side && (!one_way || *a_side) {
                cut.push((*a, *b));
            }
        }
    }
    cut
}
