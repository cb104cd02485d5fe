//! The simulated network: what travels between replicas, the coordinator and
//! clients, and the faults it suffers (delay, reordering, drops, partitions).

use tessera_protocol::{ClientReply, ClientRequest, PeerMessage, Progress, RequestId, ShardView};

use crate::config::FaultKind;
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
    /// Sends a message through the faults of the safety phase: blocked by a
    /// partition, dropped, delayed, and reordered unless channels are FIFO.
    pub(crate) fn send(&mut self, from: Address, to: Address, message: Message) {
        self.report.messages += 1;
        let faults_on = !self.healed;
        if faults_on && self.blocked.contains(&(from, to)) {
            return;
        }
        if faults_on && self.rng.chance(self.report.faults.drop_probability) {
            return;
        }
        let delay = 1 + self.rng.below(self.report.faults.delay_max_ms.max(1));
        let mut at = self.now + delay;
        let fifo = !self.report.faults.enabled.contains(&FaultKind::Reorder) || !faults_on;
        if fifo {
            let clock = self.channel_clock.entry((from, to)).or_insert(0);
            at = at.max(*clock);
            *clock = at;
        }
        self.schedule(at, Event::Deliver { from, to, message });
    }
}

/// A random cut among `servers` replicas and the coordinator: some links
/// blocked one way or both.
pub(crate) fn draw_partition(rng: &mut Rng, servers: u32) -> Vec<(Address, Address)> {
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
