//! COPS (Lloyd, Freedman, Kaminsky and Andersen, SOSP 2011): causal+
//! consistency from explicit dependencies, following the paper's section 5
//! (the client library's context and the `put_after` replication; no
//! transactions and no garbage collection of dependencies, as DKVF builds
//! it).
//!
//! - The session's context is its nearest dependencies: each version it
//!   read, and after a put only that put (which depends on them).
//! - A put is stamped by a Lamport clock (a hybrid logical clock here) past
//!   every dependency, stored, answered at once, and shipped to the other
//!   datacenters with its dependencies.
//! - There, the partition asks each dependency's owner in its own
//!   datacenter (`dep_check`: [`GeoMessage::CheckDependency`]) whether the
//!   write it names is committed there; the owner answers once it is. The
//!   write becomes visible when every dependency is met.
//!
//! The paper's owner answers once it holds the version *or a newer one*.
//! Under last-writer-wins a newer version can be a concurrent write, and
//! then the dependency's own past may still be missing: the simulator's
//! causal checker found a session that read a write, then an older value of
//! a key in that write's past. Here a dependency is met once the write
//! itself is committed at the owner: taken there, or arrived from its
//! datacenter (the stream from there has delivered past its version) and
//! no longer waiting on dependencies of its own, whether it then won or was
//! superseded. A dependency therefore names the node that took the write.
//!
//! A write waiting on its dependencies does not hold up the others.
//! Checks are resent until answered.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::Engine;

use super::{
    call_of, read, reply_for, store, Call, Dependency, GeoMessage, Partition, Replicated, Stored, RESEND_MS,
};
use crate::{
    CausalContext, ClientReply, ClientRequest, Effects, NodeId, OperationError, PeerMessage, Progress,
    Protocol, ShardView, Time, Version,
};

/// This protocol's message family.
pub const FAMILY: u8 = 23;

/// Checks from siblings this partition keeps waiting for a version it does
/// not hold yet; past it, a check is dropped and answered when resent.
const WAITING_CHECKS_MAX: usize = 100_000;

/// A write from elsewhere waiting for its dependencies.
struct Waiting {
    write: Replicated,
    /// Dependencies on keys of this partition, not yet committed.
    local: Vec<Dependency>,
    /// Checks sent to other partitions, not yet answered.
    checks: usize,
}

/// A check sent for a waiting write, kept until answered.
struct Check {
    waiting: u64,
    owner: NodeId,
    dependency: Dependency,
}

pub struct Cops {
    partition: Partition,
    waiting: BTreeMap<u64, Waiting>,
    /// The writes `waiting` holds, by origin and version.
    uncommitted: HashSet<(NodeId, Version)>,
    checks: BTreeMap<u64, Check>,
    next_id: u64,
    /// Checks from siblings for writes not committed yet: who asked, its
    /// check, the write.
    asked: Vec<(NodeId, u64, Dependency)>,
    last_resend: Time,
    /// A deliberately broken variant for the checker's tests: writes from
    /// elsewhere are visible without their dependency checks.
    #[cfg(feature = "broken")]
    broken_skip_dependency_checks: bool,
}

impl Cops {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self {
            partition: Partition::new(me, engine),
            waiting: BTreeMap::new(),
            uncommitted: HashSet::new(),
            checks: BTreeMap::new(),
            next_id: 0,
            asked: Vec::new(),
            last_resend: 0,
            #[cfg(feature = "broken")]
            broken_skip_dependency_checks: false,
        }
    }

    #[cfg(feature = "broken")]
    pub fn broken_skip_dependency_checks(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self { broken_skip_dependency_checks: true, ..Self::new(me, engine) }
    }

    fn dependencies_of(context: Option<CausalContext>) -> Result<Vec<Dependency>, OperationError> {
        match context {
            None | Some(CausalContext::Empty) => Ok(Vec::new()),
            Some(CausalContext::Dependencies(dependencies)) => Ok(dependencies),
            Some(_) => Err(OperationError::Causal(super::FOREIGN_CONTEXT)),
        }
    }

    fn serve(&mut self, request: ClientRequest, fx: &mut Effects) -> Result<ClientReply, OperationError> {
        let (key, call, context) = call_of(request.operation, fx.now())?;
        let causal = context.is_some();
        let mut dependencies = Self::dependencies_of(context)?;
        match call {
            Call::Get => {
                // get: the session now depends on the version it read.
                let held = read(&*self.partition.engine, &key)?;
                if let Some(held) = &held {
                    // Each write read stays a dependency of its own, even of
                    // a key already named: a newer version read can be a
                    // concurrent write, which does not carry the past of
                    // the one it superseded.
                    let read = Dependency { key: key.clone(), version: held.version, origin: held.origin };
                    if !dependencies.contains(&read) {
                        dependencies.push(read);
                    }
                }
                let value = held.and_then(|held| held.value);
                Ok(reply_for(&call, causal, value, CausalContext::Dependencies(dependencies)))
            }
            Call::Write(ref value) => {
                // put: stamped past its dependencies, shipped with them.
                if self.partition.streams.backlogged(self.partition.place.as_ref().expect("placed")) {
                    return Ok(ClientReply::Retry("the copies in other datacenters are far behind"));
                }
                let newest =
                    dependencies.iter().map(|dependency| dependency.version).max().unwrap_or_default();
                let version = self.partition.clock.observe(newest, fx.now());
                let write = Replicated {
                    key: key.clone(),
                    version,
                    origin: self.partition.me,
                    value: value.clone(),
                    vector: Vec::new(),
                    dependencies,
                };
                self.partition.write_here::<FAMILY>(write, fx)?;
                // The put is the session's one nearest dependency now.
                let own = Dependency { key, version, origin: self.partition.me };
                Ok(reply_for(&call, causal, None, CausalContext::Dependencies(vec![own])))
            }
        }
    }

    /// Takes a write from another datacenter: it waits, and its
    /// dependencies are checked, here and at their owners.
    fn arrived(&mut self, write: Replicated, fx: &mut Effects) {
        let place = self.partition.place.clone().expect("placed");
        let id = self.next_id;
        self.next_id += 1;
        let mut waiting = Waiting { write, local: Vec::new(), checks: 0 };
        #[cfg(feature = "broken")]
        let dependencies = match self.broken_skip_dependency_checks {
            true => Vec::new(),
            false => waiting.write.dependencies.clone(),
        };
        #[cfg(not(feature = "broken"))]
        let dependencies = waiting.write.dependencies.clone();
        for dependency in dependencies {
            let owner = place.partition_of(&dependency.key);
            if owner == place.partition {
                waiting.local.push(dependency);
            } else {
                let check = self.next_id;
                self.next_id += 1;
                let owner = place.siblings[owner];
                let message = GeoMessage::CheckDependency { check, dependency: dependency.clone() };
                self.partition.send::<FAMILY>(fx, vec![(owner, message)]);
                self.checks.insert(check, Check { waiting: id, owner, dependency });
                waiting.checks += 1;
            }
        }
        self.uncommitted.insert((waiting.write.origin, waiting.write.version));
        self.waiting.insert(id, waiting);
    }

    /// Applies every waiting write whose dependencies are all met; each
    /// applied may meet others'.
    fn apply_ready(&mut self, fx: &mut Effects) -> Result<(), OperationError> {
        let engine = self.partition.engine.clone();
        loop {
            let ready = self.waiting.iter().find_map(|(id, waiting)| {
                let met =
                    waiting.checks == 0 && waiting.local.iter().all(|dependency| self.committed(dependency));
                met.then_some(*id)
            });
            let Some(id) = ready else { return Ok(()) };
            let write = self.waiting.remove(&id).expect("found above").write;
            self.uncommitted.remove(&(write.origin, write.version));
            store(&*engine, &write.key, &Stored::of(&write))?;
            self.answer_asked(&write.key, fx)?;
        }
    }

    /// Whether the write `dependency` names is committed here: taken here,
    /// or arrived from its datacenter and no longer waiting.
    fn committed(&self, dependency: &Dependency) -> bool {
        let place = self.partition.place.as_ref().expect("placed");
        match self.partition.datacenter_of_origin(dependency.origin) {
            Some(datacenter) if datacenter == place.datacenter => true,
            Some(datacenter) => {
                self.partition.streams.received[datacenter] >= dependency.version
                    && !self.uncommitted.contains(&(dependency.origin, dependency.version))
            }
            // No copy of this partition took it: a dependency that cannot be
            // met (and a write that waits on it forever).
            None => false,
        }
    }

    /// Answers the siblings' checks of `key` that are now met.
    fn answer_asked(&mut self, key: &Bytes, fx: &mut Effects) -> Result<(), OperationError> {
        let mut index = 0;
        while index < self.asked.len() {
            let (from, check, dependency) = &self.asked[index];
            if dependency.key == *key && self.committed(dependency) {
                self.partition.send::<FAMILY>(fx, vec![(*from, GeoMessage::DependencyMet { check: *check })]);
                self.asked.swap_remove(index);
            } else {
                index += 1;
            }
        }
        Ok(())
    }
}

impl Protocol for Cops {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        Partition::answer(self.partition.place.is_some(), request, fx, |request, fx| self.serve(request, fx));
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        let Some(message) = self.partition.open::<FAMILY>(from, &message) else { return };
        let place = self.partition.place.clone().expect("placed");
        let outcome = match message {
            GeoMessage::Writes { epoch, oldest, first, writes } => {
                // Every write delivered waits before any is applied: the
                // stream counts them all received at once, and a write
                // received and not waiting counts as committed.
                for write in self.partition.receive::<FAMILY>(from, (epoch, oldest, first), writes, fx) {
                    let _ = self.partition.clock.observe_remote(write.version, fx.now());
                    self.arrived(write, fx);
                }
                self.apply_ready(fx)
            }
            GeoMessage::Ack { epoch, through } => {
                self.partition.streams.acknowledged(&place, from, epoch, through);
                Ok(())
            }
            GeoMessage::CheckDependency { check, dependency } => {
                // dep_check: answer now if committed, else once it is.
                if !place.siblings.contains(&from) || place.partition_of(&dependency.key) != place.partition {
                    return;
                }
                if self.committed(&dependency) {
                    self.partition.send::<FAMILY>(fx, vec![(from, GeoMessage::DependencyMet { check })]);
                } else {
                    let known = self.asked.iter().any(|(asker, asked, _)| *asker == from && *asked == check);
                    if !known && self.asked.len() < WAITING_CHECKS_MAX {
                        self.asked.push((from, check, dependency));
                    }
                }
                Ok(())
            }
            GeoMessage::DependencyMet { check } => match self.checks.get(&check) {
                Some(sent) if sent.owner == from => {
                    let sent = self.checks.remove(&check).expect("found above");
                    if let Some(waiting) = self.waiting.get_mut(&sent.waiting) {
                        waiting.checks -= 1;
                    }
                    self.apply_ready(fx)
                }
                _ => Ok(()),
            },
            GeoMessage::Heartbeat { .. } | GeoMessage::Stable { .. } => Ok(()),
        };
        if let Err(error) = outcome {
            self.partition.engine_failed(error);
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        let Some(place) = self.partition.place.clone() else { return };
        let sends = self.partition.streams.on_tick(&place, None, fx.now());
        self.partition.send::<FAMILY>(fx, sends);
        if fx.now() >= self.last_resend + RESEND_MS {
            self.last_resend = fx.now();
            for (check, sent) in &self.checks {
                let message =
                    GeoMessage::CheckDependency { check: *check, dependency: sent.dependency.clone() };
                self.partition.send::<FAMILY>(fx, vec![(sent.owner, message)]);
            }
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        self.partition.placed_by(view, fx.now());
    }

    fn progress(&self) -> Progress {
        Progress::default()
    }

    fn quiescent(&self) -> bool {
        self.waiting.is_empty() && self.partition.streams.drained()
    }
}
