//! CausalSpartan (Roohitavaf, Demirbas and Kulkarni, SoCC 2017): GentleRain
//! with two changes, following the paper's Algorithms 2 and 3 (section 4).
//!
//! - Writes are stamped by a hybrid logical clock, moved past the session's
//!   dependencies, so a put never waits for clock skew (GentleRain's waits
//!   until the physical clock passes them).
//! - Dependencies are a vector with an entry per datacenter, and the single
//!   global stable time becomes a datacenter stable vector (DSV): entry `i`
//!   is the newest time every partition here has received from datacenter
//!   `i`. A write from elsewhere, which carries its session's dependency
//!   vector, becomes visible once each of its entries for another
//!   datacenter is at most the DSV's: a write waits only for the
//!   datacenters it depends on.
//!
//! A get returns the newest visible version and adds it, and the vector it
//! was written with, to the session's dependencies. Same assumptions of the
//! network as [`super::gentle_rain`].

use std::sync::Arc;

use tessera_engine::Engine;

use super::{call_of, read, reply_for, Call, GeoMessage, Partition, Receipt, Replicated, Stabilizer};
use crate::{
    CausalContext, ClientReply, ClientRequest, Effects, NodeId, OperationError, PeerMessage, Progress,
    Protocol, ShardView, Version,
};

/// This protocol's message family.
pub const FAMILY: u8 = 22;

pub struct CausalSpartan {
    partition: Partition,
    stabilizer: Stabilizer,
    /// The datacenter stable vector.
    stable: Vec<Version>,
    /// Writes from other datacenters not yet visible, in arrival order.
    pending: Vec<(Receipt, Replicated)>,
    /// A deliberately broken variant for the checker's tests: writes from
    /// elsewhere are visible without the DSV check.
    #[cfg(feature = "broken")]
    broken_visible_on_arrival: bool,
}

/// The entry-wise maximum of two vectors into `into`.
fn merge(into: &mut [Version], from: &[Version]) {
    into.iter_mut().zip(from).for_each(|(into, from)| *into = (*into).max(*from));
}

impl CausalSpartan {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self {
            partition: Partition::new(me, engine),
            stabilizer: Stabilizer::default(),
            stable: Vec::new(),
            pending: Vec::new(),
            #[cfg(feature = "broken")]
            broken_visible_on_arrival: false,
        }
    }

    #[cfg(feature = "broken")]
    pub fn broken_visible_on_arrival(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self { broken_visible_on_arrival: true, ..Self::new(me, engine) }
    }

    /// The session's dependency vector and the DSV it has seen, an entry per
    /// datacenter.
    fn context_of(
        &self,
        context: Option<CausalContext>,
    ) -> Result<(Vec<Version>, Vec<Version>), OperationError> {
        let datacenters = self.stable.len();
        match context {
            None | Some(CausalContext::Empty) => {
                Ok((vec![Version::default(); datacenters], vec![Version::default(); datacenters]))
            }
            Some(CausalContext::Vector { dependency, stable })
                if dependency.len() == datacenters && stable.len() == datacenters =>
            {
                Ok((dependency, stable))
            }
            Some(_) => Err(OperationError::Causal(super::FOREIGN_CONTEXT)),
        }
    }

    fn serve(&mut self, request: ClientRequest, fx: &mut Effects) -> Result<ClientReply, OperationError> {
        let (key, call, context) = call_of(request.operation, fx.now())?;
        let causal = context.is_some();
        let (mut dependency, stable) = self.context_of(context)?;
        let here = self.partition.place.as_ref().expect("placed").datacenter;
        match call {
            Call::Retire(expected) => self.partition.retire(&key, expected),
            Call::Get => {
                if !self.partition.caught_up() {
                    return Ok(ClientReply::Retry(super::CATCHING_UP));
                }
                // GET: adopt the client's DSV, then read the newest visible
                // version; the session now depends on it and on its past.
                merge(&mut self.stable, &stable);
                self.make_visible()?;
                let held = read(&*self.partition.engine, &key)?;
                if let Some(held) = &held {
                    if let Some(origin) = self.partition.datacenter_of_origin(held.origin) {
                        dependency[origin] = dependency[origin].max(held.version);
                    }
                    merge(&mut dependency, &held.vector);
                }
                let context = CausalContext::Vector { dependency, stable: self.stable.clone() };
                Ok(reply_for(&call, causal, held.and_then(|held| held.value), context))
            }
            Call::Write(ref value) => {
                // PUT: the clock moves past every dependency, no waiting.
                if self.partition.streams.backlogged(self.partition.place.as_ref().expect("placed")) {
                    return Ok(ClientReply::Retry("the copies in other datacenters are far behind"));
                }
                // The session's DSV is adopted before the write is visible,
                // as for a get (see gentle_rain).
                merge(&mut self.stable, &stable);
                self.make_visible()?;
                let newest = dependency.iter().copied().max().unwrap_or_default();
                let version = self.partition.clock.observe(newest, fx.now());
                let write = Replicated {
                    key,
                    version,
                    origin: self.partition.me,
                    value: value.clone(),
                    vector: dependency.clone(),
                    dependencies: Vec::new(),
                };
                self.partition.write_here::<FAMILY>(write, fx)?;
                dependency[here] = version;
                Ok(reply_for(
                    &call,
                    causal,
                    None,
                    CausalContext::Vector { dependency, stable: self.stable.clone() },
                ))
            }
        }
    }

    /// Whether a write from elsewhere is visible: every datacenter it
    /// depends on, but this one, is stable up to its entry.
    fn visible(&self, write: &Replicated, here: usize) -> bool {
        #[cfg(feature = "broken")]
        if self.broken_visible_on_arrival {
            return true;
        }
        write.vector.iter().enumerate().all(|(at, entry)| at == here || *entry <= self.stable[at])
    }

    fn make_visible(&mut self) -> Result<(), OperationError> {
        let here = self.partition.place.as_ref().expect("placed").datacenter;
        let mut index = 0;
        while index < self.pending.len() {
            if self.visible(&self.pending[index].1, here) {
                let (receipt, write) = self.pending.remove(index);
                self.partition.store_delivered(receipt, &write)?;
            } else {
                index += 1;
            }
        }
        Ok(())
    }
}

impl Protocol for CausalSpartan {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        Partition::answer(self.partition.place.is_some(), request, fx, |request, fx| self.serve(request, fx));
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        let Some(message) = self.partition.open::<FAMILY>(from, &message) else { return };
        let place = self.partition.place.as_ref().expect("placed");
        match message {
            GeoMessage::Writes { epoch, oldest, first, sent_at, writes } => {
                let datacenters = place.datacenters();
                for (receipt, write) in
                    self.partition.receive::<FAMILY>(from, (epoch, oldest, first, sent_at), writes, fx)
                {
                    if write.vector.len() != datacenters {
                        tracing::warn!(%from, "dropped a causal write whose vector names another number of datacenters");
                        // Sent again it would be dropped again.
                        self.partition.streams.stored(receipt);
                        continue;
                    }
                    // The clock keeps up with the writes it sees, unless one
                    // comes from a clock far ahead.
                    let _ = self.partition.clock.observe_remote(write.version, fx.now());
                    self.pending.push((receipt, write));
                }
                if let Err(error) = self.make_visible() {
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
        if self.partition.place.is_none() {
            return;
        }
        self.partition.tick::<FAMILY>(fx, true);
        let stable =
            self.partition.stabilize::<FAMILY>(&mut self.stabilizer, &self.partition.streams.received, fx);
        merge(&mut self.stable, &stable);
        if let Err(error) = self.make_visible() {
            self.partition.engine_failed(error);
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        if self.partition.placed_by(view, fx.now()) {
            let place = self.partition.place.as_ref().expect("placed");
            self.stabilizer = Stabilizer::new(place);
            self.stable = vec![Version::default(); place.datacenters()];
        }
    }

    fn progress(&self) -> Progress {
        Progress::default()
    }

    fn quiescent(&self) -> bool {
        self.pending.is_empty() && self.partition.streams.drained()
    }
}
