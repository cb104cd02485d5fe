//! COPS (Lloyd, Freedman, Kaminsky and Andersen, SOSP 2011): causal+
//! consistency from explicit dependencies, following the paper's section 5
//! (the client library's context and the `put_after` replication, without
//! transactions) and its garbage collection of client metadata (which
//! DKVF's build leaves out).
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
//! Checks are resent until answered. A dependency several waiting writes
//! share is checked once, one answered is remembered until the checkpoint
//! passes it, and the checks of one arrival go to each owner in one
//! message, as do the answers an owner gives at once: a read-heavy session
//! ships many dependencies with each put. Checks are numbered per life of
//! the asking partition and carry its epoch, as answers do: a partition
//! that restarted numbers its checks afresh, and an answer to a check of
//! its earlier life must not meet the check of this one with that number
//! (the simulator found a write visible before its past that way). An
//! owner forgets a sibling's checks of one life once a later life asks.
//!
//! Sessions' contexts are kept small by the paper's garbage collection of
//! client metadata, on its global checkpoint time: each copy of a partition
//! tells the others how far it has committed the writes from elsewhere
//! ([`GeoMessage::Committed`]), the partitions of a datacenter take the
//! minimum over every copy of every partition ([`super::Stabilizer`]), and a
//! dependency stamped at or below it is met in every datacenter, so it is
//! dropped from contexts and from the writes shipped. Copies send
//! heartbeats, as GentleRain's do, so that an idle datacenter does not hold
//! the checkpoint back. While another datacenter is cut off the checkpoint
//! stops, and a session whose reads would take its context past
//! [`CONTEXT_DEPENDENCIES_MAX`] is asked to retry (a put resets it).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::Engine;

use super::{
    call_of, read, reply_for, Call, Dependency, GeoMessage, GeoPlace, Partition, Receipt, Replicated,
    Stabilizer, CHECKS_PER_MESSAGE, CONTEXT_DEPENDENCIES_MAX, RESEND_MS, STABILIZE_MS,
};
use crate::{
    CausalContext, ClientReply, ClientRequest, Effects, NodeId, OperationError, PeerMessage, Progress,
    Protocol, ShardView, Time, Version,
};

/// A sibling partition that asked for checks, in one life: its node and
/// that life's epoch.
type Asker = (NodeId, Version);

/// This protocol's message family.
pub const FAMILY: u8 = 23;

/// Checks from siblings this partition keeps waiting for a version it does
/// not hold yet; past it, a check is dropped and answered when resent.
const WAITING_CHECKS_MAX: usize = 100_000;
/// Dependencies answered that a partition remembers until the checkpoint
/// passes them; past it, a dependency is checked again.
const MET_MAX: usize = 100_000;

/// Why a read is asked to retry.
const CONTEXT_FULL: &str =
    "the session depends on more writes than a context holds until the other datacenters confirm them";

/// A write from elsewhere waiting for its dependencies.
struct Waiting {
    write: Replicated,
    receipt: Receipt,
    /// Dependencies on writes to keys of this partition not yet committed.
    local: usize,
    /// Checks sent to other partitions, not yet answered.
    checks: usize,
}

/// A check sent for the waiting writes that share a dependency, kept
/// until answered.
struct Check {
    waiters: Vec<u64>,
    owner: NodeId,
    dependency: Dependency,
}

pub struct Cops {
    partition: Partition,
    waiting: BTreeMap<u64, Waiting>,
    /// The writes `waiting` holds, by origin and version.
    uncommitted: BTreeSet<(NodeId, Version)>,
    /// The waiting writes each write of this partition not committed yet
    /// holds up, by its origin and version.
    blocked: HashMap<(NodeId, Version), Vec<u64>>,
    /// Waiting writes whose dependencies are all met, to apply.
    ready: Vec<u64>,
    checks: BTreeMap<u64, Check>,
    /// The check under way for each dependency.
    checking: HashMap<Dependency, u64>,
    /// Dependencies on other partitions answered since the checkpoint last
    /// passed them.
    met: HashSet<Dependency>,
    next_id: u64,
    /// Checks from siblings for writes not committed yet, by the key they
    /// name: who asked, its check, the write.
    asked: HashMap<Bytes, Vec<(Asker, u64, Dependency)>>,
    asked_count: usize,
    /// Each sibling's newest epoch heard: checks of an earlier one are
    /// never answered (nobody waits for them).
    askers: HashMap<NodeId, Version>,
    last_resend: Time,
    /// By datacenter, how far that copy of this partition (this one's own
    /// entry included) has committed the writes of the others: every write
    /// stamped at or below it.
    committed_through: Vec<Version>,
    /// The minimum of `committed_through` over every partition of this
    /// datacenter, by datacenter.
    stabilizer: Stabilizer,
    /// The global checkpoint: every write stamped at or below it is
    /// committed in every datacenter.
    checkpoint: Version,
    last_told: Time,
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
            uncommitted: BTreeSet::new(),
            blocked: HashMap::new(),
            ready: Vec::new(),
            checks: BTreeMap::new(),
            checking: HashMap::new(),
            met: HashSet::new(),
            next_id: 0,
            asked: HashMap::new(),
            asked_count: 0,
            askers: HashMap::new(),
            last_resend: 0,
            committed_through: Vec::new(),
            stabilizer: Stabilizer::default(),
            checkpoint: Version::default(),
            last_told: 0,
            #[cfg(feature = "broken")]
            broken_skip_dependency_checks: false,
        }
    }

    #[cfg(feature = "broken")]
    pub fn broken_skip_dependency_checks(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        Self { broken_skip_dependency_checks: true, ..Self::new(me, engine) }
    }

    #[cfg(feature = "broken")]
    pub fn broken_recover_without_dependencies(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        let mut cops = Self::new(me, engine);
        cops.partition.broken_recover_without_dependencies = true;
        cops
    }

    #[cfg(feature = "broken")]
    pub fn broken_retires_with_a_delete(me: NodeId, engine: Arc<dyn Engine>) -> Self {
        let mut cops = Self::new(me, engine);
        cops.partition.broken_retires_with_a_delete = true;
        cops
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
        #[cfg(feature = "broken")]
        let call = self.partition.broken_retire_as_delete(&key, call)?;
        let causal = context.is_some();
        let mut dependencies = Self::dependencies_of(context)?;
        // Met everywhere: nothing to check, nothing to carry.
        dependencies.retain(|dependency| dependency.version > self.checkpoint);
        match call {
            Call::Retire(expected) => self.partition.retire(&key, expected),
            Call::Get => {
                // get: the session now depends on the version it read.
                let held = read(&*self.partition.engine, &key)?;
                if let Some(held) = held.as_ref().filter(|held| held.version > self.checkpoint) {
                    // Each write read stays a dependency of its own, even of
                    // a key already named: a newer version read can be a
                    // concurrent write, which does not carry the past of
                    // the one it superseded.
                    let read = Dependency { key: key.clone(), version: held.version, origin: held.origin };
                    if !dependencies.contains(&read) {
                        if dependencies.len() == CONTEXT_DEPENDENCIES_MAX {
                            return Ok(ClientReply::Retry(CONTEXT_FULL));
                        }
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

    /// Takes writes delivered from another datacenter: each waits, and its
    /// dependencies are checked, here and at their owners. All of them
    /// count as uncommitted before any is looked at: the stream counts them
    /// all received at once, and a write received and not waiting counts
    /// as committed.
    fn arrived(&mut self, writes: Vec<(Receipt, Replicated)>, fx: &mut Effects) {
        for (_, write) in &writes {
            self.uncommitted.insert((write.origin, write.version));
        }
        let mut to_check = BTreeMap::new();
        for (receipt, write) in writes {
            self.wait(receipt, write, &mut to_check);
        }
        self.send_checks(to_check, fx);
    }

    /// Sends each owner its checks, as few messages as they fit in.
    fn send_checks(&self, to_check: BTreeMap<NodeId, Vec<(u64, Dependency)>>, fx: &mut Effects) {
        let asker = self.partition.streams.epoch;
        let sends = in_messages(to_check, |checks| GeoMessage::CheckDependencies { asker, checks });
        self.partition.send::<FAMILY>(fx, sends);
    }

    /// Takes a delivered write in to wait: its dependencies on this
    /// partition are looked at here, those on others are added to
    /// `to_check` by owner (unless already under way or answered).
    fn wait(
        &mut self,
        receipt: Receipt,
        write: Replicated,
        to_check: &mut BTreeMap<NodeId, Vec<(u64, Dependency)>>,
    ) {
        let place = self.partition.place.clone().expect("placed");
        let id = self.next_id;
        self.next_id += 1;
        let mut waiting = Waiting { write, receipt, local: 0, checks: 0 };
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
                if !self.committed(&dependency) {
                    self.blocked.entry((dependency.origin, dependency.version)).or_default().push(id);
                    waiting.local += 1;
                }
                continue;
            }
            // Committed everywhere, or answered already.
            if dependency.version <= self.checkpoint || self.met.contains(&dependency) {
                continue;
            }
            let check = match self.checking.get(&dependency) {
                Some(&check) => check,
                None => {
                    let check = self.next_id;
                    self.next_id += 1;
                    let owner = place.siblings[owner];
                    to_check.entry(owner).or_default().push((check, dependency.clone()));
                    self.checking.insert(dependency.clone(), check);
                    self.checks.insert(check, Check { waiters: Vec::new(), owner, dependency });
                    check
                }
            };
            self.checks.get_mut(&check).expect("under way").waiters.push(id);
            waiting.checks += 1;
        }
        if waiting.local == 0 && waiting.checks == 0 {
            self.ready.push(id);
        }
        self.waiting.insert(id, waiting);
    }

    /// Applies every waiting write whose dependencies are all met; each
    /// applied may meet others'.
    fn apply_ready(&mut self, fx: &mut Effects) -> Result<(), OperationError> {
        while let Some(id) = self.ready.pop() {
            let Waiting { write, receipt, .. } = self.waiting.remove(&id).expect("a ready write waits");
            self.uncommitted.remove(&(write.origin, write.version));
            self.partition.store_delivered(receipt, &write)?;
            self.unblock((write.origin, write.version));
            self.answer_asked(&write.key, fx);
        }
        Ok(())
    }

    /// The waiting writes the committed write `(origin, version)` of this
    /// partition held up have one local dependency fewer.
    fn unblock(&mut self, write: (NodeId, Version)) {
        for held_up in self.blocked.remove(&write).unwrap_or_default() {
            self.local_met(held_up);
        }
    }

    /// Waiting write `id` has one local dependency fewer; ready once it
    /// has none and no check is unanswered.
    fn local_met(&mut self, id: u64) {
        let waiting = self.waiting.get_mut(&id).expect("a write met waits");
        waiting.local -= 1;
        if waiting.local == 0 && waiting.checks == 0 {
            self.ready.push(id);
        }
    }

    /// Whether the write `dependency` names is committed here: taken here,
    /// or arrived from its datacenter and no longer waiting.
    fn committed(&self, dependency: &Dependency) -> bool {
        self.committed_write(dependency.origin, dependency.version)
    }

    /// Whether the write `origin` stamped `version` is committed here (see
    /// [`Self::committed`]).
    fn committed_write(&self, origin: NodeId, version: Version) -> bool {
        let place = self.partition.place.as_ref().expect("placed");
        match self.partition.datacenter_of_origin(origin) {
            Some(datacenter) if datacenter == place.datacenter => true,
            Some(datacenter) => {
                self.partition.streams.received[datacenter] >= version
                    && !self.uncommitted.contains(&(origin, version))
            }
            // No copy of this partition took it: a dependency that cannot be
            // met (and a write that waits on it forever).
            None => false,
        }
    }

    /// Every write from another datacenter stamped at or below the result
    /// is committed here: arrived (the stream has delivered past it, or a
    /// heartbeat says none is left below it) and not waiting.
    fn committed_here(&self, place: &GeoPlace) -> Version {
        let received = &self.partition.streams.received;
        (0..place.datacenters())
            .filter(|&datacenter| datacenter != place.datacenter)
            .map(|datacenter| {
                let origin = place.replicas[datacenter];
                let oldest_waiting = self
                    .uncommitted
                    .range((origin, Version(0))..=(origin, Version(u64::MAX)))
                    .map(|(_, version)| *version)
                    .next();
                match oldest_waiting {
                    Some(version) => received[datacenter].min(Version(version.0.saturating_sub(1))),
                    None => received[datacenter],
                }
            })
            .min()
            .unwrap_or(Version(u64::MAX))
    }

    /// On a tick: this copy's committed time to the others, the
    /// datacenter's to the siblings, and the checkpoint raised to the
    /// minimum over all.
    fn collect_garbage(&mut self, place: &GeoPlace, fx: &mut Effects) {
        self.committed_through[place.datacenter] = self.committed_here(place);
        if fx.now() >= self.last_told + STABILIZE_MS {
            self.last_told = fx.now();
            let told = GeoMessage::Committed { through: self.committed_through[place.datacenter] };
            let sends = (0..place.datacenters())
                .filter(|&datacenter| datacenter != place.datacenter)
                .map(|datacenter| (place.replicas[datacenter], told.clone()))
                .collect();
            self.partition.send::<FAMILY>(fx, sends);
        }
        let stable = self.partition.stabilize::<FAMILY>(&mut self.stabilizer, &self.committed_through, fx);
        // Writes held up by one of this partition's that is committed now
        // without arriving again: stored before this partition restarted
        // (its stream dropped it), and counted once received past it.
        let committed: Vec<(NodeId, Version)> = self
            .blocked
            .keys()
            .filter(|(origin, version)| self.committed_write(*origin, *version))
            .copied()
            .collect();
        for write in committed {
            self.unblock(write);
        }
        let checkpoint = stable.into_iter().min().unwrap_or_default();
        if checkpoint > self.checkpoint {
            self.checkpoint = checkpoint;
            self.met.retain(|dependency| dependency.version > checkpoint);
        }
    }

    /// Answers the siblings' checks of `key` that are now met.
    fn answer_asked(&mut self, key: &Bytes, fx: &mut Effects) {
        let Some(asked) = self.asked.remove(key) else { return };
        let (met, unmet): (Vec<_>, Vec<_>) =
            asked.into_iter().partition(|(_, _, dependency)| self.committed(dependency));
        self.asked_count -= met.len();
        let mut answers: BTreeMap<Asker, Vec<u64>> = BTreeMap::new();
        for (asker, check, _) in met {
            answers.entry(asker).or_default().push(check);
        }
        self.answer(answers, fx);
        if !unmet.is_empty() {
            self.asked.insert(key.clone(), unmet);
        }
    }

    /// Tells each sibling which of its checks are met.
    fn answer(&self, answers: BTreeMap<Asker, Vec<u64>>, fx: &mut Effects) {
        for ((to, asker), checks) in answers {
            let sends = in_messages(BTreeMap::from([(to, checks)]), |checks| GeoMessage::DependenciesMet {
                asker,
                checks,
            });
            self.partition.send::<FAMILY>(fx, sends);
        }
    }

    /// A sibling's checks: each met is answered now, the others once met.
    fn checked(
        &mut self,
        place: &GeoPlace,
        (from, epoch): Asker,
        checks: Vec<(u64, Dependency)>,
        fx: &mut Effects,
    ) {
        if !place.siblings.contains(&from) {
            return;
        }
        let newest = self.askers.entry(from).or_default();
        if epoch < *newest {
            return;
        }
        if epoch > *newest {
            // The sibling restarted: its earlier life's checks are void.
            *newest = epoch;
            let mut dropped = 0;
            self.asked.retain(|_, asked| {
                let before = asked.len();
                asked.retain(|((asker, asked_epoch), _, _)| *asker != from || *asked_epoch == epoch);
                dropped += before - asked.len();
                !asked.is_empty()
            });
            self.asked_count -= dropped;
        }
        let mut met = Vec::new();
        for (check, dependency) in checks {
            if place.partition_of(&dependency.key) != place.partition {
                continue;
            }
            if self.committed(&dependency) {
                met.push(check);
                continue;
            }
            let known = self.asked.get(&dependency.key).is_some_and(|asked| {
                asked.iter().any(|(asker, asked, _)| *asker == (from, epoch) && *asked == check)
            });
            if !known && self.asked_count < WAITING_CHECKS_MAX {
                self.asked.entry(dependency.key.clone()).or_default().push((
                    (from, epoch),
                    check,
                    dependency,
                ));
                self.asked_count += 1;
            }
        }
        if !met.is_empty() {
            self.answer(BTreeMap::from([((from, epoch), met)]), fx);
        }
    }

    /// A sibling's answers to this partition's checks: the writes waiting
    /// on them have one check fewer each.
    fn met(&mut self, from: NodeId, asker: Version, checks: Vec<u64>) {
        if asker != self.partition.streams.epoch {
            return; // answers to the checks of this partition's earlier life
        }
        for check in checks {
            if self.checks.get(&check).is_none_or(|sent| sent.owner != from) {
                continue;
            }
            let Check { waiters, dependency, .. } = self.checks.remove(&check).expect("found above");
            self.checking.remove(&dependency);
            if self.met.len() < MET_MAX {
                self.met.insert(dependency);
            }
            for id in waiters {
                if let Some(waiting) = self.waiting.get_mut(&id) {
                    waiting.checks -= 1;
                    if waiting.checks == 0 && waiting.local == 0 {
                        self.ready.push(id);
                    }
                }
            }
        }
    }
}

/// Each node's checks (or answers), `message` of at most
/// [`CHECKS_PER_MESSAGE`] at a time.
fn in_messages<T>(
    by_node: BTreeMap<NodeId, Vec<T>>,
    message: impl Fn(Vec<T>) -> GeoMessage,
) -> Vec<(NodeId, GeoMessage)> {
    let mut sends = Vec::new();
    for (to, items) in by_node {
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            sends.push((to, message(items.by_ref().take(CHECKS_PER_MESSAGE).collect())));
        }
    }
    sends
}

impl Protocol for Cops {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        Partition::answer(self.partition.place.is_some(), request, fx, |request, fx| self.serve(request, fx));
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        let Some(message) = self.partition.open::<FAMILY>(from, &message) else { return };
        let place = self.partition.place.clone().expect("placed");
        let outcome = match message {
            GeoMessage::Writes { epoch, oldest, first, sent_at, writes } => {
                let writes =
                    self.partition.receive::<FAMILY>(from, (epoch, oldest, first, sent_at), writes, fx);
                for (_, write) in &writes {
                    let _ = self.partition.clock.observe_remote(write.version, fx.now());
                }
                self.arrived(writes, fx);
                self.apply_ready(fx)
            }
            GeoMessage::Ack { epoch, copy, delivered, stored, echo } => {
                self.partition.streams.acknowledged(
                    &place,
                    from,
                    (epoch, copy, delivered, stored, echo),
                    fx.now(),
                );
                Ok(())
            }
            GeoMessage::CheckDependencies { asker, checks } => {
                // dep_check: answer now if committed, else once it is.
                self.checked(&place, (from, asker), checks, fx);
                Ok(())
            }
            GeoMessage::DependenciesMet { asker, checks } => {
                self.met(from, asker, checks);
                self.apply_ready(fx)
            }
            GeoMessage::Heartbeat { epoch, oldest, clock, through } => {
                self.partition.streams.heartbeat(&place, from, (epoch, oldest, through), clock);
                Ok(())
            }
            GeoMessage::Committed { through } => {
                if let Some(datacenter) = place.datacenter_of(from) {
                    let known = &mut self.committed_through[datacenter];
                    *known = (*known).max(through);
                }
                Ok(())
            }
            GeoMessage::Stable { received } => {
                self.stabilizer.heard(&place, from, received);
                Ok(())
            }
        };
        if let Err(error) = outcome {
            self.partition.engine_failed(error);
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        let Some(place) = self.partition.place.clone() else { return };
        self.partition.tick::<FAMILY>(fx, true);
        self.collect_garbage(&place, fx);
        if let Err(error) = self.apply_ready(fx) {
            self.partition.engine_failed(error);
        }
        if fx.now() >= self.last_resend + RESEND_MS {
            self.last_resend = fx.now();
            let mut to_check: BTreeMap<NodeId, Vec<(u64, Dependency)>> = BTreeMap::new();
            for (check, sent) in &self.checks {
                to_check.entry(sent.owner).or_default().push((*check, sent.dependency.clone()));
            }
            self.send_checks(to_check, fx);
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        if self.partition.placed_by(view, fx.now()) {
            let place = self.partition.place.as_ref().expect("placed");
            self.stabilizer = Stabilizer::new(place);
            self.committed_through = vec![Version::default(); place.datacenters()];
        }
    }

    fn progress(&self) -> Progress {
        Progress::default()
    }

    fn quiescent(&self) -> bool {
        self.waiting.is_empty() && self.partition.streams.drained()
    }
}

#[cfg(test)]
mod tests {
    use tessera_engine::OrderedEngine;

    use super::*;
    use crate::{ClientRequest, Effect, Operation, RequestId, Write};

    /// Two datacenters of two partitions: node `2 * datacenter + partition`.
    struct Network {
        nodes: Vec<Cops>,
        now: Time,
        /// Messages to datacenter 1 are lost while it is cut off.
        cut_off: bool,
        /// Every message delivered: from, to, what.
        delivered: Vec<(usize, usize, GeoMessage)>,
        /// Messages from one node to another are held back, not delivered.
        holding: Option<(usize, usize)>,
        held: Vec<(usize, usize, PeerMessage)>,
    }

    impl Network {
        fn new() -> Self {
            let mut nodes: Vec<Cops> =
                (0..4).map(|node| Cops::new(NodeId(node), Arc::new(OrderedEngine::new()))).collect();
            for (node, partition) in nodes.iter_mut().enumerate() {
                let (datacenter, at) = (node / 2, node % 2);
                let place = GeoPlace {
                    datacenter,
                    partition: at,
                    replicas: (0..2).map(|dc| NodeId((2 * dc + at) as u32)).collect(),
                    siblings: (0..2).map(|p| NodeId((2 * datacenter + p) as u32)).collect(),
                    shards: vec![0, 1],
                };
                partition.on_view(&ShardView::of_partition(place), &mut Effects::new(0));
            }
            Self { nodes, now: 1, cut_off: false, delivered: Vec::new(), holding: None, held: Vec::new() }
        }

        /// Runs `handler` on `node` and delivers what it sends, and what
        /// that sends, at once; the reply to a client, if any.
        fn handle(
            &mut self,
            node: usize,
            handler: impl FnOnce(&mut Cops, &mut Effects),
        ) -> Option<ClientReply> {
            let mut fx = Effects::new(self.now);
            handler(&mut self.nodes[node], &mut fx);
            let mut reply = None;
            let mut queue: Vec<(usize, Effect)> =
                fx.take().into_iter().map(|effect| (node, effect)).collect();
            while let Some((from, effect)) = queue.pop() {
                let (to, message) = match effect {
                    Effect::Reply { reply: answer, .. } => {
                        reply = Some(answer);
                        continue;
                    }
                    Effect::Send { to, message } | Effect::SendToShard { to, message, .. } => (to, message),
                };
                if self.cut_off && (to.0 >= 2) != (from >= 2) {
                    continue;
                }
                if self.holding == Some((from, to.0 as usize)) {
                    self.held.push((from, to.0 as usize, message));
                    continue;
                }
                let opened =
                    message.open::<super::super::Tagged<FAMILY>>().expect("COPS's").expect("well formed");
                self.delivered.push((from, to.0 as usize, opened.0));
                let mut fx = Effects::new(self.now);
                self.nodes[to.0 as usize].on_peer(NodeId(from as u32), message, &mut fx);
                queue.extend(fx.take().into_iter().map(|effect| (to.0 as usize, effect)));
            }
            reply
        }

        /// Every node ticks, `times` times, 5 ms apart.
        fn tick(&mut self, times: usize) {
            for _ in 0..times {
                self.now += 5;
                for node in 0..4 {
                    self.handle(node, |cops, fx| cops.on_tick(fx));
                }
            }
        }

        /// A session's operation at the node of `key`'s partition in `datacenter`.
        fn ask(
            &mut self,
            datacenter: usize,
            key: &str,
            write: Option<&str>,
            context: CausalContext,
        ) -> ClientReply {
            let key = Bytes::copy_from_slice(key.as_bytes());
            let partition = self.nodes[0].partition.place.as_ref().expect("placed").partition_of(&key);
            let write = write.map(|value| Write::Put(Bytes::copy_from_slice(value.as_bytes())));
            let request =
                ClientRequest { id: RequestId(1), operation: Operation::Causal { key, write, context } };
            self.handle(2 * datacenter + partition, |cops, fx| cops.on_client(request, fx)).expect("a reply")
        }
    }

    /// A restarted partition numbers its checks afresh: an answer to a
    /// check of its earlier life (its epoch in the answer) meets none of
    /// this life's, and the owner forgets the checks of a life once it
    /// hears from a later one. Without it a write became visible before a
    /// write in its past (the simulator found it, 4 seeds in 300 with many
    /// keys and restarts).
    #[test]
    fn answers_to_the_checks_of_an_earlier_life_meet_none() {
        let mut network = Network::new();
        let place = network.nodes[0].partition.place.clone().expect("placed");
        let key_of = |partition: usize| {
            (0..)
                .map(|n| format!("k{n}"))
                .find(|key| place.partition_of(key.as_bytes()) == partition)
                .unwrap()
        };
        let (post, comment) = (key_of(1), key_of(0));
        // The post does not reach datacenter 1 yet; the comment, which
        // follows it, does, and waits there on a check of the post.
        network.holding = Some((1, 3));
        let context =
            CausalContext::Dependencies(dependencies(network.ask(0, &post, Some("p"), CausalContext::Empty)));
        network.ask(0, &comment, Some("c"), context);
        let shown = |network: &mut Network, key: &str| match network.ask(1, key, None, CausalContext::Empty) {
            ClientReply::Causal { value, .. } => value,
            other => panic!("{other:?}"),
        };
        assert_eq!(shown(&mut network, &comment), None);
        let epoch = network.nodes[2].partition.streams.epoch;
        let check = *network.nodes[2].checks.keys().next().expect("the post's check");
        let answer = |asker: Version| {
            let met = GeoMessage::DependenciesMet { asker, checks: vec![check] };
            PeerMessage::new(&super::super::Tagged::<FAMILY>(met))
        };
        // An answer to a check of that number from another life of node 2.
        let mut fx = Effects::new(network.now);
        network.nodes[2].on_peer(NodeId(3), answer(Version(epoch.0 - 1)), &mut fx);
        assert_eq!(shown(&mut network, &comment), None, "an earlier life's answer met this life's check");
        // The owner forgets node 2's checks once a later life of it asks.
        assert_eq!(network.nodes[3].asked_count, 1);
        let later = GeoMessage::CheckDependencies { asker: Version(epoch.0 + 1), checks: Vec::new() };
        network.nodes[3].on_peer(
            NodeId(2),
            PeerMessage::new(&super::super::Tagged::<FAMILY>(later)),
            &mut fx,
        );
        assert_eq!(network.nodes[3].asked_count, 0);
        // This life's own answer meets it.
        network.nodes[2].on_peer(NodeId(3), answer(epoch), &mut fx);
        assert_eq!(shown(&mut network, &comment), Some(Bytes::from_static(b"c")));
    }

    fn dependencies(reply: ClientReply) -> Vec<Dependency> {
        match reply {
            ClientReply::Causal { context: CausalContext::Dependencies(dependencies), .. } => dependencies,
            other => panic!("not a COPS session's reply: {other:?}"),
        }
    }

    #[test]
    fn dependencies_committed_in_every_datacenter_leave_contexts_and_no_sooner() {
        let mut network = Network::new();
        network.cut_off = true;
        let written = dependencies(network.ask(0, "post", Some("hello"), CausalContext::Empty));
        assert_eq!(written.len(), 1);
        // Datacenter 1 has not got the write: the session keeps depending on it.
        network.tick(40);
        let context = CausalContext::Dependencies(written.clone());
        let read = dependencies(network.ask(0, "comment", None, context.clone()));
        assert_eq!(read, written, "a dependency datacenter 1 has not committed is kept");
        assert_eq!(dependencies(network.ask(0, "post", None, context.clone())), written);

        // Once it has, every partition drops it, and a read of it adds none.
        network.cut_off = false;
        network.tick(80);
        assert!(network.nodes.iter().all(|cops| cops.checkpoint >= written[0].version));
        assert_eq!(dependencies(network.ask(0, "comment", None, context.clone())), Vec::new());
        assert_eq!(dependencies(network.ask(0, "post", None, context)), Vec::new());
        assert_eq!(dependencies(network.ask(1, "post", None, CausalContext::Empty)), Vec::new());
    }

    /// A put that depends on many writes to another partition has them
    /// checked in one message, and the answers come in one; a dependency
    /// answered is not checked again.
    #[test]
    fn checks_past_a_message_go_in_more_and_each_once() {
        let answers =
            BTreeMap::from([(NodeId(1), (0..CHECKS_PER_MESSAGE as u64 + 1).collect()), (NodeId(2), vec![7])]);
        let asker = Version::default();
        let sends = in_messages(answers, |checks| GeoMessage::DependenciesMet { asker, checks });
        let shape: Vec<(NodeId, usize, Option<u64>)> = sends
            .iter()
            .map(|(to, message)| match message {
                GeoMessage::DependenciesMet { checks, .. } => (*to, checks.len(), checks.first().copied()),
                other => panic!("{other:?}"),
            })
            .collect();
        let last = CHECKS_PER_MESSAGE as u64;
        assert_eq!(
            shape,
            vec![
                (NodeId(1), CHECKS_PER_MESSAGE, Some(0)),
                (NodeId(1), 1, Some(last)),
                (NodeId(2), 1, Some(7))
            ]
        );
    }

    #[test]
    fn dependencies_are_checked_in_one_message_and_once() {
        let mut network = Network::new();
        let place = network.nodes[0].partition.place.clone().expect("placed");
        let keys_of = |partition: usize, count: usize| -> Vec<String> {
            let keys = (0..).map(|n| format!("k{n}"));
            keys.filter(|key| place.partition_of(key.as_bytes()) == partition).take(count).collect()
        };
        // Written in datacenter 1 and read in datacenter 0 (no tick moves
        // the checkpoint past them).
        let read_keys = keys_of(1, 20);
        for key in &read_keys {
            network.ask(1, key, Some("v"), CausalContext::Empty);
        }
        let mut context = CausalContext::Empty;
        for key in &read_keys {
            context = CausalContext::Dependencies(dependencies(network.ask(0, key, None, context)));
        }
        let CausalContext::Dependencies(read) = &context else { unreachable!() };
        assert_eq!(read.len(), 20);
        network.delivered.clear();
        for key in keys_of(0, 2) {
            network.ask(0, &key, Some("after"), context.clone());
        }
        let checks: Vec<usize> = network
            .delivered
            .iter()
            .filter_map(|(from, to, message)| match message {
                GeoMessage::CheckDependencies { checks, .. } if (*from, *to) == (2, 3) => Some(checks.len()),
                _ => None,
            })
            .collect();
        assert_eq!(checks, vec![20], "two puts' twenty shared dependencies, checked once in one message");
        let answers = network.delivered.iter().filter(|(from, to, message)| {
            (*from, *to) == (3, 2)
                && matches!(message, GeoMessage::DependenciesMet { checks, .. } if checks.len() == 20)
        });
        assert_eq!(answers.count(), 1);
        assert_eq!(network.nodes[2].met.len(), 20);
        assert!(network.nodes[2].waiting.is_empty(), "both puts visible");
    }

    /// The horizon is kept as a record (the node's views of the table read
    /// every value as one), and a partition that starts again over the
    /// engine reads it back.
    #[test]
    fn the_horizon_is_kept_as_a_record_and_read_back() {
        let mut network = Network::new();
        let written = dependencies(network.ask(0, "post", Some("hello"), CausalContext::Empty));
        network.tick(250);
        let place = network.nodes[0].partition.place.clone().expect("placed");
        let node = &network.nodes[place.partition_of(b"post")];
        let raw = node.partition.engine.get(&super::super::horizon_key()).unwrap().expect("kept");
        let kept = crate::Record::decode(raw).expect("a record").version;
        assert!(kept >= written[0].version, "{kept:?} {written:?}");
        let mut again = Cops::new(node.partition.me, node.partition.engine.clone());
        again.on_view(
            &ShardView::of_partition(node.partition.place.clone().unwrap()),
            &mut Effects::new(2_000),
        );
        assert_eq!(again.partition.horizon_kept, kept);
    }

    #[test]
    fn a_full_context_asks_reads_to_retry_and_a_put_resets_it() {
        let mut network = Network::new();
        network.cut_off = true;
        network.ask(0, "post", Some("hello"), CausalContext::Empty);
        let full: Vec<Dependency> = (0..CONTEXT_DEPENDENCIES_MAX)
            .map(|at| Dependency {
                key: Bytes::from(format!("k{at}")),
                version: Version::new(1, 0),
                origin: NodeId(2),
            })
            .collect();
        let context = CausalContext::Dependencies(full);
        assert_eq!(network.ask(0, "post", None, context.clone()), ClientReply::Retry(CONTEXT_FULL));
        assert_eq!(
            dependencies(network.ask(0, "nothing-here", None, context.clone())).len(),
            CONTEXT_DEPENDENCIES_MAX
        );
        assert_eq!(dependencies(network.ask(0, "post", Some("again"), context)).len(), 1);
    }
}
