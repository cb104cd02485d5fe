//! GentleRain (Du, Iorgulescu, Roy and Zwaenepoel, SoCC 2014): causal
//! consistency from physical clocks and one scalar of metadata. The server
//! side follows the paper's Algorithm 2 (section 4); the client's side, its
//! Algorithm 1, runs here too, on the context the session hands in.
//!
//! - A put waits until this partition's physical clock passes the session's
//!   dependency time, then stamps the write with the clock, so that a write
//!   is stamped after everything it depends on.
//! - A partition keeps, per datacenter, the newest time it has received
//!   from there ([`super::Streams`]; its copy there sends heartbeats when
//!   idle). The global stable time (GST) is the minimum of those over every
//!   partition of the datacenter ([`super::Stabilizer`], gossiped where the
//!   paper uses a tree).
//! - A write from another datacenter becomes visible once its time is at
//!   most the GST: every partition here has by then received everything it
//!   can depend on. Local writes are visible at once. A get returns the
//!   newest visible version.
//!
//! Assumes of the network only that messages eventually arrive: the
//! streams between datacenters resend, number and reorder. Clock skew
//! delays puts (and visibility), never safety.

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_engine::Engine;

use super::{call_of, read, reply_for, Call, GeoMessage, Partition, Receipt, Replicated, Stabilizer};
use crate::{
    CausalContext, ClientReply, ClientRequest, Effects, NodeId, OperationError, PeerMessage, Progress,
    Protocol, ShardView, Version,
};

/// This protocol's message family.
pub const FAMILY: u8 = 21;

pub struct GentleRain {
    partition: Partition,
    stabilizer: Stabilizer,
    /// The global stable time: every partition of this datacenter has
    /// received every write from elsewhere stamped up to it.
    global_stable: Version,
    /// Writes from other datacenters not yet visible, by time.
    pending: BTreeMap<(Version, NodeId), (Receipt, Replicated)>,
    /// Puts waiting for the clock to pass their session's dependency time.
    waiting: Vec<ClientRequest>,
    /// A deliberately broken variant for the checker's tests: writes from
    /// elsewhere are visible on arrival.
    #[cfg(feature = "broken")]
    broken_visible_on_arrival: bool,
}

impl GentleRain {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self {
            partition: Partition::new(me, engine),
            stabilizer: Stabilizer::default(),
            global_stable: Version::default(),
            pending: BTreeMap::new(),
            waiting: Vec::new(),
            #[cfg(feature = "broken")]
            broken_visible_on_arrival: false,
        }
    }

    #[cfg(feature = "broken")]
    pub fn broken_visible_on_arrival(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self { broken_visible_on_arrival: true, ..Self::new(me, engine) }
    }

    /// The session's dependency time and the GST it has seen.
    fn context_of(context: Option<CausalContext>) -> Result<(Version, Version), OperationError> {
        match context {
            None | Some(CausalContext::Empty) => Ok((Version::default(), Version::default())),
            Some(CausalContext::Time { dependency, stable }) => Ok((dependency, stable)),
            Some(_) => Err(OperationError::Causal(super::FOREIGN_CONTEXT)),
        }
    }

    /// Serves `request`, or keeps a put for later (`false`) while the
    /// clock has not passed its session's dependency time.
    fn serve(&mut self, request: ClientRequest, fx: &mut Effects) -> bool {
        let id = request.id;
        let outcome = (|| {
            let (key, call, context) = call_of(request.operation.clone(), fx.now())?;
            let causal = context.is_some();
            let (dependency, stable) = Self::context_of(context)?;
            let engine = self.partition.engine.clone();
            match call {
                Call::Retire(expected) => self.partition.retire(&key, expected).map(Some),
                Call::Get => {
                    if !self.partition.caught_up() {
                        return Ok(Some(ClientReply::Retry(super::CATCHING_UP)));
                    }
                    // GET (Algorithm 2): adopt the client's GST, then read
                    // the newest version that is local or stable.
                    self.raise_stable(stable)?;
                    let held = read(&*engine, &key)?;
                    let dependency = held.as_ref().map_or(dependency, |held| dependency.max(held.version));
                    let context = CausalContext::Time { dependency, stable: self.global_stable };
                    Ok(Some(reply_for(&call, causal, held.and_then(|held| held.value), context)))
                }
                Call::Write(ref value) => {
                    // PUT: wait until Clock > DT, then stamp with the clock.
                    if fx.now() <= dependency.physical_ms() {
                        fx.wake_at(dependency.physical_ms() + 1);
                        return Ok(None);
                    }
                    if self.partition.streams.backlogged(self.partition.place.as_ref().expect("placed")) {
                        return Ok(Some(ClientReply::Retry(
                            "the copies in other datacenters are far behind",
                        )));
                    }
                    // The session's GST is adopted here too, before the
                    // write is visible: a session that reads the write
                    // then carries a GST that covers what it depends on.
                    self.raise_stable(stable)?;
                    let version = self.partition.clock.tick(fx.now());
                    debug_assert!(version > dependency, "a write is stamped after what it depends on");
                    let write = Replicated {
                        key,
                        version,
                        origin: self.partition.me,
                        value: value.clone(),
                        vector: Vec::new(),
                        dependencies: Vec::new(),
                    };
                    self.partition.write_here::<FAMILY>(write, fx)?;
                    let context =
                        CausalContext::Time { dependency: version, stable: stable.max(self.global_stable) };
                    Ok(Some(reply_for(&call, causal, None, context)))
                }
            }
        })();
        match outcome {
            Ok(None) => {
                self.waiting.push(request);
                false
            }
            Ok(Some(reply)) => {
                fx.reply(id, reply);
                true
            }
            Err(error) => {
                fx.reply(id, ClientReply::Failed(error));
                true
            }
        }
    }

    /// Raises the GST to `stable` and makes visible what it covers.
    fn raise_stable(&mut self, stable: Version) -> Result<(), OperationError> {
        self.global_stable = self.global_stable.max(stable);
        while let Some(entry) = self.pending.first_entry() {
            #[cfg(feature = "broken")]
            let visible = self.broken_visible_on_arrival || entry.key().0 <= self.global_stable;
            #[cfg(not(feature = "broken"))]
            let visible = entry.key().0 <= self.global_stable;
            if !visible {
                break;
            }
            let (receipt, write) = entry.remove();
            self.partition.store_delivered(receipt, &write)?;
        }
        Ok(())
    }
}

impl Protocol for GentleRain {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        if self.partition.place.is_none() {
            return fx.reply(request.id, ClientReply::Retry(super::UNPLACED));
        }
        if self.waiting.is_empty() || !request.operation.is_write() {
            self.serve(request, fx);
        } else {
            // Puts keep their order behind one that waits.
            self.waiting.push(request);
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        let Some(message) = self.partition.open::<FAMILY>(from, &message) else { return };
        let place = self.partition.place.as_ref().expect("placed");
        match message {
            GeoMessage::Writes { epoch, oldest, first, sent_at, writes } => {
                // REPLICATE: keep the write; it becomes visible once stable.
                for (receipt, write) in
                    self.partition.receive::<FAMILY>(from, (epoch, oldest, first, sent_at), writes, fx)
                {
                    self.pending.insert((write.version, write.origin), (receipt, write));
                }
                if let Err(error) = self.raise_stable(self.global_stable) {
                    self.partition.engine_failed(error);
                }
            }
            GeoMessage::Ack { epoch, copy, delivered, stored, echo } => self.partition.streams.acknowledged(
                place,
                from,
                (epoch, copy, delivered, stored, echo),
                fx.now(),
            ),
            GeoMessage::Heartbeat { epoch, oldest, clock, through } => {
                self.partition.streams.heartbeat(place, from, (epoch, oldest, through), clock)
            }
            GeoMessage::Stable { received } => self.stabilizer.heard(place, from, received),
            GeoMessage::CheckDependencies { .. }
            | GeoMessage::DependenciesMet { .. }
            | GeoMessage::Committed { .. } => {}
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        let Some(place) = self.partition.place.clone() else { return };
        // Puts whose clock has come, in order.
        let waiting = std::mem::take(&mut self.waiting);
        let mut waiting = waiting.into_iter();
        for request in waiting.by_ref() {
            if !self.serve(request, fx) {
                break;
            }
        }
        self.waiting.extend(waiting);
        // HEARTBEAT, and the GST: the minimum over partitions and other
        // datacenters.
        self.partition.tick::<FAMILY>(fx, true);
        let stable =
            self.partition.stabilize::<FAMILY>(&mut self.stabilizer, &self.partition.streams.received, fx);
        let global = (0..place.datacenters()).filter(|&at| at != place.datacenter).map(|at| stable[at]).min();
        if let Err(error) = self.raise_stable(global.unwrap_or(self.global_stable)) {
            self.partition.engine_failed(error);
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        if self.partition.placed_by(view, fx.now()) {
            self.stabilizer = Stabilizer::new(self.partition.place.as_ref().expect("placed"));
        }
    }

    fn progress(&self) -> Progress {
        Progress::default()
    }

    fn quiescent(&self) -> bool {
        self.waiting.is_empty() && self.pending.is_empty() && self.partition.streams.drained()
    }
}
