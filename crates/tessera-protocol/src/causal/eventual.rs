//! Eventual consistency across datacenters, the baseline DKVF measures the
//! causal protocols against (Roohitavaf and Kulkarni, ASE 2018, section 5):
//! a put is stamped by a hybrid logical clock, stored, answered and shipped
//! to the other datacenters, which store it on arrival; the last writer
//! wins. Copies converge once writes stop and the streams drain; nothing
//! orders what a session sees across keys.

use std::sync::Arc;

use tessera_engine::Engine;

use super::{call_of, read, reply_for, Call, GeoMessage, Partition, Replicated};
use crate::{
    CausalContext, ClientReply, ClientRequest, Effects, NodeId, OperationError, PeerMessage, Progress,
    Protocol, ShardView,
};

/// This protocol's message family.
pub const FAMILY: u8 = 20;

pub struct Eventual {
    partition: Partition,
}

impl Eventual {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self { partition: Partition::new(me, engine) }
    }

    fn serve(&mut self, request: ClientRequest, fx: &mut Effects) -> Result<ClientReply, OperationError> {
        let (key, call, context) = call_of(request.operation, fx.now())?;
        let causal = context.is_some();
        match call {
            Call::Retire(expected) => self.partition.retire(&key, expected),
            Call::Get => {
                let value = read(&*self.partition.engine, &key)?.and_then(|held| held.value);
                Ok(reply_for(&call, causal, value, CausalContext::Empty))
            }
            Call::Write(ref value) => {
                if self.partition.streams.backlogged(self.partition.place.as_ref().expect("placed")) {
                    return Ok(ClientReply::Retry("the copies in other datacenters are far behind"));
                }
                let version = self.partition.clock.tick(fx.now());
                let origin = self.partition.me;
                let value = value.clone();
                let write =
                    Replicated { key, version, origin, value, vector: Vec::new(), dependencies: Vec::new() };
                self.partition.write_here::<FAMILY>(write, fx)?;
                Ok(reply_for(&call, causal, None, CausalContext::Empty))
            }
        }
    }
}

impl Protocol for Eventual {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        Partition::answer(self.partition.place.is_some(), request, fx, |request, fx| self.serve(request, fx));
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        let Some(message) = self.partition.open::<FAMILY>(from, &message) else { return };
        match message {
            GeoMessage::Writes { epoch, oldest, first, sent_at, writes } => {
                for (receipt, write) in
                    self.partition.receive::<FAMILY>(from, (epoch, oldest, first, sent_at), writes, fx)
                {
                    let _ = self.partition.clock.observe_remote(write.version, fx.now());
                    if let Err(error) = self.partition.store_delivered(receipt, &write) {
                        self.partition.engine_failed(error);
                    }
                }
            }
            GeoMessage::Ack { epoch, copy, delivered, stored, echo } => {
                let place = self.partition.place.as_ref().expect("placed");
                self.partition.streams.acknowledged(
                    place,
                    from,
                    (epoch, copy, delivered, stored, echo),
                    fx.now(),
                );
            }
            _ => {}
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        if self.partition.place.is_some() {
            self.partition.tick::<FAMILY>(fx, false);
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        self.partition.placed_by(view, fx.now());
    }

    fn progress(&self) -> Progress {
        Progress::default()
    }

    fn quiescent(&self) -> bool {
        self.partition.streams.drained()
    }
}
