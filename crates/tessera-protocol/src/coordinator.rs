//! The coordinator's decisions for one shard, sans-IO: heartbeats in, leases
//! and view changes out. The simulator and the cluster runtime both drive it,
//! so what the simulator checks under faults is what runs on sockets.
//!
//! Rules (docs/PROTOCOLS.md, "Membership"):
//! - A heartbeat from a member with the incarnation the coordinator knows gets
//!   the current view and a lease until `now + lease_ms`.
//! - A member heard from with another incarnation restarted with nothing: it is
//!   suspected and never granted a lease as the member it was.
//! - A member silent for `failure_timeout_ms`, or suspected, is removed once
//!   every lease granted to it has run out, the longest silent first, never the
//!   last member (for quorum protocols, never below `min_members`). Removing
//!   the first member of a primary–backup view promotes the backup that has
//!   applied the most.
//! - A live node outside the view is admitted: as a learner behind the tail for
//!   chain replication (one at a time, promoted when the tail reports it caught
//!   up in the current view), straight in as a backup for primary–backup and
//!   multi-master, as a learner that reports itself ready for quorums. A
//!   quorum learner joins with the view that ends a drain of the members
//!   (`begin_promotion`): it merged what they held when it asked, and a
//!   write chosen meanwhile by a majority it was not in would otherwise sit
//!   at too few members of the larger view for a later removal to keep
//!   majorities intersecting.
//! - A transition to another protocol (`begin_transition`) makes the view
//!   draining and drops its learner; nobody is admitted while it drains. Once
//!   every member has reported itself drained in the current view, the next
//!   view ends the transition and admission follows the new protocol's rule.
//! - A head handover (`begin_handover`) is a transition to the same protocol
//!   whose completion view puts the chosen member first: once every member
//!   has drained, all hold the same records, so any of them may lead.
//! - Retiring a member (`begin_retire`, the old replica of a replica move) is
//!   a transition to the same protocol whose completion view drops it: it
//!   leaves holding nothing the others lack, in every mode (an eventual
//!   mode's member may hold writes it acknowledged and has not yet passed
//!   on), and no one waits for its lease.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use crate::{NodeId, Progress, ShardView};

/// How a node outside the view joins it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Behind the tail as a learner, promoted once caught up (chain replication).
    Learner,
    /// Straight in as a backup; its position report gets it a snapshot (primary–backup).
    Backup,
    /// As a learner that merges every member's records and reports itself
    /// ready (quorum protocols); members are removed only while `min_members`
    /// remain, so that consecutive views' majorities keep intersecting.
    Quorum { min_members: usize },
    /// No one: each member is its place's only copy (a causal partition's
    /// copy in its datacenter), never removed or replaced; one that fails
    /// is waited for.
    Fixed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    pub lease_ms: u64,
    pub failure_timeout_ms: u64,
    pub admission: Admission,
}

/// The reason of the view that ends a transition to another protocol: the
/// view from which the shard runs it (the simulator switches there).
pub const TRANSITION_COMPLETE: &str = "transition complete";

/// The reason of the view in which a head handed over on purpose: its
/// primary changed, and nothing failed.
pub const HEAD_HANDED_OVER: &str = "head handed over";

/// A new view and why it was made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ViewChange {
    pub at_ms: u64,
    pub view: ShardView,
    pub reason: &'static str,
    /// The first member (head or primary) changed.
    pub primary_changed: bool,
}

#[derive(Clone, Debug)]
pub struct ShardCoordinator {
    config: CoordinatorConfig,
    view: ShardView,
    incarnations: HashMap<NodeId, u64>,
    last_heard: HashMap<NodeId, u64>,
    granted_until: HashMap<NodeId, u64>,
    progress: HashMap<NodeId, u64>,
    suspected: BTreeSet<NodeId>,
    /// Members that came back with another incarnation: what they held is
    /// gone, so keeping them in the view keeps nothing.
    restarted: BTreeSet<NodeId>,
    changes: Vec<ViewChange>,
    /// During a transition: the admission rule after it, and the members that
    /// reported themselves drained in the current view.
    transition: Option<(Admission, BTreeSet<NodeId>)>,
    /// The drain under way is a slot migration's cut: it ends by
    /// [`Self::end_cut`], not when the members have drained.
    cut: bool,
    /// What the view that ends the drain under way does besides serving.
    drain_end: Option<DrainEnd>,
}

/// What the view that ends a drain changes in its members.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DrainEnd {
    /// Puts this member first (a head handover).
    HandOver(NodeId),
    /// Drops this member (a retired replica).
    Retire(NodeId),
    /// Makes this learner a member (a quorum learner that is ready).
    Promote(NodeId),
}

impl ShardCoordinator {
    /// Starts from a view whose members are known by their incarnations, all
    /// counted as heard from at `now`. A member missing from `incarnations`
    /// (a cluster that was just made) is known by the first one it reports.
    pub fn new(
        config: CoordinatorConfig,
        view: ShardView,
        incarnations: HashMap<NodeId, u64>,
        now: u64,
    ) -> Self {
        let last_heard = view.replicas.iter().chain(&view.learners).map(|node| (*node, now)).collect();
        Self {
            config,
            view,
            incarnations,
            last_heard,
            granted_until: HashMap::new(),
            progress: HashMap::new(),
            suspected: BTreeSet::new(),
            restarted: BTreeSet::new(),
            changes: Vec::new(),
            transition: None,
            cut: false,
            drain_end: None,
        }
    }

    /// Starts switching the shard to another protocol, admitted by
    /// `admission` once done. Refused while a transition is under way,
    /// unless it is a drain this coordinator began by itself (a learner's
    /// promotion, a replica's retirement): that one gives way, and starts
    /// again after.
    pub fn begin_transition(&mut self, now: u64, admission: Admission) -> bool {
        if !self.may_begin_transition() {
            return false;
        }
        self.drain_end = None;
        self.transition = Some((admission, BTreeSet::new()));
        self.change_view(
            now,
            |view| {
                view.draining = true;
                view.learners.clear();
            },
            "transition started",
        );
        true
    }

    /// Starts a slot migration's cut: the view drains as for a transition
    /// to the same protocol, and stays draining once every member has, until
    /// [`Self::end_cut`]. Refused while a transition or cut is under way.
    pub fn begin_cut(&mut self, now: u64) -> bool {
        if !self.begin_transition(now, self.config.admission) {
            return false;
        }
        self.cut = true;
        true
    }

    /// Starts handing the first place (head, primary) to member `node`: the
    /// view drains as for a transition to the same protocol, and the view
    /// that ends the drain puts `node` first. Refused while a transition or
    /// cut is under way, and for a node that is not a member or already first.
    pub fn begin_handover(&mut self, now: u64, node: NodeId) -> bool {
        if self.view.position(node).is_none_or(|position| position == 0) {
            return false;
        }
        if !self.begin_transition(now, self.config.admission) {
            return false;
        }
        self.drain_end = Some(DrainEnd::HandOver(node));
        true
    }

    /// Carries on a handover whose draining view this coordinator took over.
    pub fn resume_handover(&mut self, node: NodeId) {
        self.resume_transition(self.config.admission);
        if self.transition.is_some() && !self.cut {
            self.drain_end = Some(DrainEnd::HandOver(node));
        }
    }

    /// The member a handover under way puts first.
    pub fn handing_over_to(&self) -> Option<NodeId> {
        match self.drain_end {
            Some(DrainEnd::HandOver(node)) => Some(node),
            _ => None,
        }
    }

    /// Starts retiring member `node`: the view drains as for a transition to
    /// the same protocol, and the view that ends the drain drops `node`.
    /// Refused while a transition or cut is under way, for a node that is
    /// not a member, and for the last member.
    pub fn begin_retire(&mut self, now: u64, node: NodeId) -> bool {
        if self.view.position(node).is_none() || self.view.replicas.len() < 2 || self.transitioning() {
            return false;
        }
        if !self.begin_transition(now, self.config.admission) {
            return false;
        }
        self.drain_end = Some(DrainEnd::Retire(node));
        true
    }

    /// Carries on a cut whose draining view this coordinator took over.
    pub fn resume_cut(&mut self) {
        self.resume_transition(self.config.admission);
        self.cut = self.transition.is_some();
    }

    /// Every member has reported itself drained in the cut's current view.
    pub fn cut_drained(&self) -> bool {
        self.cut
            && self
                .transition
                .as_ref()
                .is_some_and(|(_, drained)| self.view.replicas.iter().all(|member| drained.contains(member)))
    }

    /// Ends a cut (done, or given up): the next view serves again.
    pub fn end_cut(&mut self, now: u64, reason: &'static str) {
        if self.cut {
            self.cut = false;
            self.transition = None;
            self.change_view(now, |view| view.draining = false, reason);
        }
    }

    /// Whether a slot migration's cut is under way.
    pub fn cutting(&self) -> bool {
        self.cut
    }

    /// Carries on a transition whose draining view this coordinator took
    /// over (from a stored map, after a restart).
    pub fn resume_transition(&mut self, admission: Admission) {
        if self.view.draining && self.transition.is_none() {
            self.transition = Some((admission, BTreeSet::new()));
        }
    }

    /// Whether a transition is under way.
    pub fn transitioning(&self) -> bool {
        self.transition.is_some()
    }

    /// Whether a transition, cut or handover may begin now: nothing drains,
    /// or only a drain this coordinator began by itself.
    pub fn may_begin_transition(&self) -> bool {
        self.transition.is_none()
            || (!self.cut && matches!(self.drain_end, Some(DrainEnd::Promote(_) | DrainEnd::Retire(_))))
    }

    pub fn view(&self) -> &ShardView {
        &self.view
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    /// The incarnation the coordinator knows a member or learner by.
    pub fn incarnation(&self, node: NodeId) -> Option<u64> {
        self.incarnations.get(&node).copied()
    }

    /// The write position `node` last reported.
    pub fn applied(&self, node: NodeId) -> Option<u64> {
        self.progress.get(&node).copied()
    }

    /// The view changes made since the last call.
    pub fn take_changes(&mut self) -> Vec<ViewChange> {
        std::mem::take(&mut self.changes)
    }

    /// Whether `node` is a member in good standing: heard from within
    /// `within_ms` as the incarnation the coordinator knows, and not suspected.
    pub fn in_good_standing(&self, node: NodeId, incarnation: u64, now: u64, within_ms: u64) -> bool {
        self.view.position(node).is_some()
            && now.saturating_sub(self.last_heard.get(&node).copied().unwrap_or(0)) <= within_ms
            && self.incarnations.get(&node) == Some(&incarnation)
            && !self.suspected.contains(&node)
    }

    /// Marks a member for removal (a failure detector's verdict, or an
    /// operator's); it is removed once its lease has run out.
    pub fn suspect(&mut self, node: NodeId) -> bool {
        self.view.position(node).is_some() && self.suspected.insert(node)
    }

    /// A heartbeat from `node`: returns the view to grant it a lease on, if any.
    pub fn on_heartbeat(
        &mut self,
        now: u64,
        node: NodeId,
        incarnation: u64,
        progress: &Progress,
    ) -> Option<ShardView> {
        let member = self.view.position(node).is_some();
        let learner = self.view.learners.contains(&node);
        if member && !self.incarnations.contains_key(&node) {
            // A member of a new cluster, heard from for the first time.
            self.incarnations.insert(node, incarnation);
        }
        let known = self.incarnations.get(&node) == Some(&incarnation);
        if member && !known {
            // Restarted with nothing: no longer the member it was.
            self.suspected.insert(node);
            self.restarted.insert(node);
            return None;
        }
        if learner && !known {
            self.change_view(now, |view| view.learners.retain(|other| *other != node), "learner restarted");
            return None;
        }
        if !member && !learner {
            // Not while every member is silent: a newcomer has no one to
            // copy from, and as a backup it would let the last member, which
            // may hold the only copy, be removed in its favour.
            let someone_heard = self.view.replicas.iter().any(|member| !self.silent(*member, now));
            if !self.suspected.contains(&node) && self.transition.is_none() && someone_heard {
                self.admit(now, node, incarnation);
            }
            return None;
        }
        if self.suspected.contains(&node) {
            return None; // being removed: no lease
        }
        if let Some((ready, in_view)) = progress.learner_ready {
            // The tail speaks for its learner in chain replication; a quorum
            // learner for itself.
            let reporter = match self.config.admission {
                Admission::Quorum { .. } => ready,
                _ => self.view.replicas.last().copied().unwrap_or(ready),
            };
            if reporter == node && in_view == self.view.number && self.view.learners.first() == Some(&ready) {
                if let Admission::Quorum { .. } = self.config.admission {
                    self.begin_promotion(now, ready);
                } else {
                    self.change_view(
                        now,
                        |view| {
                            view.learners.clear();
                            view.replicas.push(ready);
                        },
                        "learner promoted",
                    );
                }
            }
        }
        self.last_heard.insert(node, now);
        self.granted_until.insert(node, now + self.config.lease_ms);
        self.progress.insert(node, progress.applied);
        if progress.drained == Some(self.view.number) {
            self.note_drained(now, node);
        }
        Some(ShardView { lease_until: 0, ..self.view.clone() })
    }

    /// A quorum learner joins with the view that ends a drain of the
    /// members it merged from, so that it joins members that all hold every
    /// chosen record: its merge is not atomic with the writes going on, and
    /// a write it missed would otherwise sit at too few members of the
    /// larger view once one of them left. It stays a learner meanwhile, so
    /// what the drain finishes runs on the members' majorities.
    fn begin_promotion(&mut self, now: u64, learner: NodeId) {
        if self.transition.is_some() {
            return; // one drain at a time; this one ends as it began
        }
        self.transition = Some((self.config.admission, BTreeSet::new()));
        self.drain_end = Some(DrainEnd::Promote(learner));
        self.change_view(now, |view| view.draining = true, "learner joining");
    }

    fn admit(&mut self, now: u64, node: NodeId, incarnation: u64) {
        match self.config.admission {
            Admission::Backup => {
                self.incarnations.insert(node, incarnation);
                self.last_heard.insert(node, now);
                self.change_view(now, |view| view.replicas.push(node), "backup added");
            }
            Admission::Learner | Admission::Quorum { .. } if self.view.learners.is_empty() => {
                self.incarnations.insert(node, incarnation);
                self.last_heard.insert(node, now);
                self.change_view(now, |view| view.learners.push(node), "learner added");
            }
            Admission::Learner | Admission::Quorum { .. } => {} // one learner at a time
            Admission::Fixed => {}
        }
    }

    fn silent(&self, node: NodeId, now: u64) -> bool {
        now.saturating_sub(self.last_heard.get(&node).copied().unwrap_or(0)) > self.config.failure_timeout_ms
    }

    /// Removes what failed; returns the nodes that kept only because they are
    /// the last member (their suspicion is dropped).
    pub fn on_tick(&mut self, now: u64) -> Vec<NodeId> {
        let mut kept = Vec::new();
        let silent_learners: Vec<NodeId> =
            self.view.learners.iter().copied().filter(|node| self.silent(*node, now)).collect();
        if !silent_learners.is_empty() {
            self.change_view(
                now,
                |view| view.learners.retain(|node| !silent_learners.contains(node)),
                "learner silent",
            );
        }
        if self.config.admission == Admission::Fixed {
            // Each member is its place's only copy: it stays, failed or not.
            return kept;
        }
        // The longest silent first: when several fail at once, the one heard
        // from last is the one kept.
        let mut members = self.view.replicas.clone();
        members.sort_by_key(|node| self.last_heard.get(node).copied().unwrap_or(0));
        let min_members = match self.config.admission {
            Admission::Quorum { min_members } => min_members.max(1),
            Admission::Learner | Admission::Backup | Admission::Fixed => 1,
        };
        let removable = |this: &Self, node: NodeId| {
            let failed = this.silent(node, now) || this.suspected.contains(&node);
            failed && now >= this.granted_until.get(&node).copied().unwrap_or(0)
        };
        for node in members {
            // A member that restarted with nothing holds none of what the
            // majority rule protects; only the last member always stays.
            let min_members = if self.restarted.contains(&node) { 1 } else { min_members };
            if self.view.replicas.len() <= min_members {
                // The last member holds the only copy (or, in a quorum, the
                // last majority holds every chosen record): it stays.
                if self.suspected.remove(&node) {
                    kept.push(node);
                }
                break;
            }
            if removable(self, node) {
                self.remove(now, node);
            }
        }
        kept
    }

    fn remove(&mut self, now: u64, node: NodeId) {
        self.suspected.remove(&node);
        self.restarted.remove(&node);
        let was_first = self.view.replicas.first() == Some(&node);
        // Removing a primary–backup view's primary promotes the backup that
        // has applied the most.
        let promoted =
            (was_first && self.config.admission == Admission::Backup)
                .then(|| {
                    self.view.replicas.iter().copied().filter(|other| *other != node).max_by_key(|other| {
                        (self.progress.get(other).copied().unwrap_or(0), Reverse(other.0))
                    })
                })
                .flatten();
        self.change_view(
            now,
            |view| {
                view.replicas.retain(|other| *other != node && Some(*other) != promoted);
                if let Some(best) = promoted {
                    view.replicas.insert(0, best);
                }
            },
            "replica removed",
        );
    }

    fn note_drained(&mut self, now: u64, node: NodeId) {
        let Some((_, drained)) = self.transition.as_mut() else { return };
        drained.insert(node);
        if self.cut || !self.view.replicas.iter().all(|member| drained.contains(member)) {
            return;
        }
        let (admission, _) = self.transition.take().expect("checked above");
        self.config.admission = admission;
        // Every member holds the same records now: any of them may lead, and
        // any but the last may leave. A member that left meanwhile leaves the
        // order as it is.
        let planned = self.drain_end.take();
        let end = planned.filter(|end| match end {
            DrainEnd::HandOver(node) => self.view.position(*node).is_some(),
            DrainEnd::Retire(node) => self.view.position(*node).is_some() && self.view.replicas.len() > 1,
            DrainEnd::Promote(node) => self.view.learners.contains(node),
        });
        let reason = match end {
            Some(DrainEnd::HandOver(_)) => HEAD_HANDED_OVER,
            Some(DrainEnd::Retire(_)) => "replica retired",
            Some(DrainEnd::Promote(_)) => "learner promoted",
            // A handover, retirement or promotion whose member is gone:
            // not a transition, whose end switches the protocol.
            None if planned.is_some() => "drain ended, its member gone",
            None => TRANSITION_COMPLETE,
        };
        self.change_view(
            now,
            |view| {
                view.draining = false;
                match end {
                    Some(DrainEnd::HandOver(node)) => {
                        view.replicas.retain(|other| *other != node);
                        view.replicas.insert(0, node);
                    }
                    Some(DrainEnd::Retire(node)) => view.replicas.retain(|other| *other != node),
                    Some(DrainEnd::Promote(node)) => {
                        view.learners.retain(|other| *other != node);
                        view.replicas.push(node);
                    }
                    None => {}
                }
            },
            reason,
        );
    }

    fn change_view(&mut self, now: u64, change: impl FnOnce(&mut ShardView), reason: &'static str) {
        if let Some((_, drained)) = self.transition.as_mut() {
            drained.clear(); // reports are per view
        }
        let first = self.view.replicas.first().copied();
        change(&mut self.view);
        self.view.number += 1;
        let primary_changed = self.view.replicas.first().copied() != first;
        self.changes.push(ViewChange { at_ms: now, view: self.view.clone(), reason, primary_changed });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coordinator(admission: Admission) -> ShardCoordinator {
        let view = ShardView {
            number: 1,
            replicas: vec![NodeId(0), NodeId(1), NodeId(2)],
            learners: vec![],
            lease_until: 0,
            draining: false,
            geo: None,
        };
        let config = CoordinatorConfig { lease_ms: 200, failure_timeout_ms: 150, admission };
        ShardCoordinator::new(config, view, (0..3).map(|id| (NodeId(id), 0)).collect(), 0)
    }

    fn beat(coordinator: &mut ShardCoordinator, now: u64, node: u32) -> Option<ShardView> {
        coordinator.on_heartbeat(now, NodeId(node), 0, &Progress::default())
    }

    #[test]
    fn a_silent_member_goes_only_after_its_lease() {
        let mut chain = coordinator(Admission::Learner);
        for node in 0..3 {
            assert!(beat(&mut chain, 100, node).is_some());
        }
        // Node 1 falls silent; the others keep beating.
        for now in (150..=250).step_by(50) {
            beat(&mut chain, now, 0);
            beat(&mut chain, now, 2);
            chain.on_tick(now);
        }
        assert_eq!(chain.view().replicas.len(), 3, "silent since 100, but its lease runs to 300");
        beat(&mut chain, 300, 0);
        beat(&mut chain, 300, 2);
        chain.on_tick(300);
        assert_eq!(chain.view().replicas, vec![NodeId(0), NodeId(2)]);
        let changes = chain.take_changes();
        assert_eq!(changes.len(), 1);
        assert!(!changes[0].primary_changed);
        // It comes back: a learner behind the tail, promoted when the tail says so.
        assert!(beat(&mut chain, 400, 1).is_none());
        assert_eq!(chain.view().learners, vec![NodeId(1)]);
        let number = chain.view().number;
        let ready =
            Progress { applied: 9, learner_ready: Some((NodeId(1), number)), drained: None, migration: None };
        chain.on_heartbeat(420, NodeId(2), 0, &ready);
        assert_eq!(chain.view().replicas, vec![NodeId(0), NodeId(2), NodeId(1)]);
    }

    #[test]
    fn a_restarted_member_gets_no_lease_and_is_removed() {
        let mut chain = coordinator(Admission::Learner);
        assert!(chain.on_heartbeat(10, NodeId(0), 1, &Progress::default()).is_none());
        beat(&mut chain, 10, 1);
        beat(&mut chain, 10, 2);
        chain.on_tick(10);
        assert_eq!(chain.view().replicas, vec![NodeId(1), NodeId(2)], "never granted, so removed at once");
        assert!(chain.take_changes()[0].primary_changed);
    }

    /// A causal partition's copies: one that falls silent, or comes back
    /// having lost its state, stays in the view (refused a lease in the
    /// second case), and no other node joins in its place.
    #[test]
    fn a_fixed_view_keeps_its_members_and_takes_no_one() {
        let mut copies = coordinator(Admission::Fixed);
        for node in 0..3 {
            assert!(beat(&mut copies, 100, node).is_some());
        }
        for now in (150..=1_000).step_by(50) {
            beat(&mut copies, now, 0);
            copies.on_tick(now);
        }
        assert!(copies.on_heartbeat(1_000, NodeId(2), 7, &Progress::default()).is_none(), "lost its state");
        assert!(beat(&mut copies, 1_000, 5).is_none(), "a newcomer");
        copies.on_tick(1_050);
        assert_eq!(copies.view().replicas, vec![NodeId(0), NodeId(1), NodeId(2)]);
        assert!(copies.view().learners.is_empty());
        assert!(copies.take_changes().is_empty());
        assert!(beat(&mut copies, 1_100, 1).is_some(), "a silent member that comes back serves again");
    }

    #[test]
    fn primary_backup_promotes_the_most_up_to_date_backup() {
        let mut pb = coordinator(Admission::Backup);
        let at = |applied| Progress { applied, ..Progress::default() };
        pb.on_heartbeat(0, NodeId(1), 0, &at(5));
        pb.on_heartbeat(0, NodeId(2), 0, &at(8));
        pb.suspect(NodeId(0));
        pb.on_tick(0);
        assert_eq!(pb.view().replicas, vec![NodeId(2), NodeId(1)]);
    }

    #[test]
    fn a_new_clusters_members_are_known_by_their_first_heartbeat() {
        let view = ShardView {
            number: 1,
            replicas: vec![NodeId(0), NodeId(1)],
            learners: vec![],
            lease_until: 0,
            draining: false,
            geo: None,
        };
        let config =
            CoordinatorConfig { lease_ms: 200, failure_timeout_ms: 150, admission: Admission::Learner };
        let mut fresh = ShardCoordinator::new(config, view, HashMap::new(), 0);
        assert!(fresh.on_heartbeat(1, NodeId(0), 77, &Progress::default()).is_some());
        assert_eq!(fresh.incarnation(NodeId(0)), Some(77));
        assert!(fresh.on_heartbeat(2, NodeId(0), 78, &Progress::default()).is_none(), "a restart is noticed");
    }

    #[test]
    fn the_last_member_stays() {
        let view = ShardView {
            number: 1,
            replicas: vec![NodeId(0)],
            learners: vec![],
            lease_until: 0,
            draining: false,
            geo: None,
        };
        let config =
            CoordinatorConfig { lease_ms: 200, failure_timeout_ms: 150, admission: Admission::Learner };
        let mut single = ShardCoordinator::new(config, view, HashMap::from([(NodeId(0), 0)]), 0);
        single.suspect(NodeId(0));
        assert_eq!(single.on_tick(1_000), vec![NodeId(0)]);
        assert_eq!(single.view().replicas, vec![NodeId(0)]);
    }

    /// After the coordinator lost touch with every node (its own
    /// partition), the first node back must not join as a backup while the
    /// last member is still silent: that member would then be removed in
    /// favour of an empty copy, and with it every record.
    #[test]
    fn no_one_joins_while_every_member_is_silent() {
        let mut pb = coordinator(Admission::Backup);
        for node in 0..3 {
            beat(&mut pb, 0, node);
        }
        pb.on_tick(1_000);
        assert_eq!(pb.view().replicas.len(), 1, "the coordinator heard no one: only the last member stays");
        let last = pb.view().replicas[0];
        let newcomer = (0..4).map(NodeId).find(|node| !pb.view().replicas.contains(node)).unwrap();
        assert!(beat(&mut pb, 1_001, newcomer.0).is_none());
        pb.on_tick(1_002);
        assert_eq!(pb.view().replicas, vec![last], "nobody was admitted, so the last member stays");
        beat(&mut pb, 1_003, last.0);
        beat(&mut pb, 1_004, newcomer.0);
        assert_eq!(pb.view().replicas, vec![last, newcomer], "admitted once the member is heard again");
    }

    #[test]
    fn a_handover_drains_then_puts_the_chosen_member_first() {
        let mut chain = coordinator(Admission::Learner);
        assert!(!chain.begin_handover(0, NodeId(0)), "already first");
        assert!(!chain.begin_handover(0, NodeId(7)), "not a member");
        assert!(chain.begin_handover(0, NodeId(2)));
        assert!(!chain.begin_handover(0, NodeId(1)), "one drain at a time");
        assert!(chain.view().draining);
        let draining = chain.view().number;
        let drained = Progress { drained: Some(draining), ..Progress::default() };
        for node in 0..2 {
            chain.on_heartbeat(10, NodeId(node), 0, &drained);
            assert!(chain.view().draining, "not every member has drained");
        }
        assert!(!chain.begin_transition(10, Admission::Learner));
        chain.on_heartbeat(10, NodeId(2), 0, &drained);
        assert!(!chain.view().draining);
        assert_eq!(chain.view().replicas, vec![NodeId(2), NodeId(0), NodeId(1)]);
        let changes = chain.take_changes();
        let last = changes.last().unwrap();
        assert!(last.primary_changed);
        assert_eq!(last.reason, HEAD_HANDED_OVER);
        assert!(!chain.transitioning());
        assert_eq!(chain.handing_over_to(), None);

        // A chosen member removed during the drain: the drain ends with the
        // order as it is.
        let mut pb = coordinator(Admission::Backup);
        assert!(pb.begin_handover(0, NodeId(1)));
        pb.suspect(NodeId(1));
        beat(&mut pb, 900, 0);
        beat(&mut pb, 900, 2);
        pb.on_tick(1_000);
        assert_eq!(pb.view().replicas, vec![NodeId(0), NodeId(2)]);
        let drained = Progress { drained: Some(pb.view().number), ..Progress::default() };
        for node in [0, 2] {
            pb.on_heartbeat(1_001, NodeId(node), 0, &drained);
        }
        assert!(!pb.view().draining);
        assert_eq!(pb.view().replicas, vec![NodeId(0), NodeId(2)]);
        assert_eq!(pb.take_changes().last().unwrap().reason, "drain ended, its member gone");
    }

    #[test]
    fn a_retired_member_leaves_with_the_view_that_ends_its_drain() {
        let mut pb = coordinator(Admission::Backup);
        assert!(!pb.begin_retire(0, NodeId(7)), "not a member");
        assert!(pb.begin_retire(0, NodeId(0)), "the primary too: it leaves once the others hold all it has");
        assert!(!pb.begin_retire(0, NodeId(1)), "one drain at a time");
        assert!(pb.may_begin_transition(), "an operator's transition would take the drain over");
        assert!(pb.view().draining);
        let drained = Progress { drained: Some(pb.view().number), ..Progress::default() };
        for node in 0..3 {
            assert!(pb.on_heartbeat(10, NodeId(node), 0, &drained).is_some(), "every member keeps its lease");
        }
        assert_eq!(pb.view().replicas, vec![NodeId(1), NodeId(2)]);
        assert!(!pb.view().draining && !pb.transitioning());
        assert_eq!(pb.take_changes().last().unwrap().reason, "replica retired");
    }

    #[test]
    fn a_quorum_learner_joins_with_the_view_that_ends_a_drain_of_the_members() {
        let mut quorum = coordinator(Admission::Quorum { min_members: 2 });
        assert!(beat(&mut quorum, 10, 3).is_none());
        assert_eq!(quorum.view().learners, vec![NodeId(3)]);
        let ready = |view| Progress { learner_ready: Some((NodeId(3), view)), ..Progress::default() };
        quorum.on_heartbeat(20, NodeId(3), 0, &ready(quorum.view().number));
        let draining = quorum.view().clone();
        assert!(draining.draining);
        assert_eq!(
            (draining.replicas.len(), &draining.learners[..]),
            (3, &[NodeId(3)][..]),
            "still a learner"
        );
        quorum.on_heartbeat(21, NodeId(3), 0, &ready(draining.number));
        assert_eq!(quorum.view().number, draining.number, "ready again in the draining view: no new view");
        // A member that fails meanwhile is removed as usual, down to the minimum.
        quorum.suspect(NodeId(0));
        for node in 1..4 {
            beat(&mut quorum, 999, node);
        }
        quorum.on_tick(1_000);
        assert_eq!(quorum.view().replicas, vec![NodeId(1), NodeId(2)]);
        let drained = Progress { drained: Some(quorum.view().number), ..Progress::default() };
        for node in 1..3 {
            quorum.on_heartbeat(1_001, NodeId(node), 0, &drained);
        }
        assert!(!quorum.view().draining && !quorum.transitioning());
        assert_eq!(quorum.view().replicas, vec![NodeId(1), NodeId(2), NodeId(3)]);
        assert!(quorum.view().learners.is_empty());
        assert_eq!(quorum.take_changes().last().unwrap().reason, "learner promoted");
    }

    /// The simulator switches protocols at the view that completes a
    /// transition; a learner's drain that lost its learner is not one.
    #[test]
    fn a_drain_whose_learner_fell_silent_ends_without_completing_a_transition() {
        let mut quorum = coordinator(Admission::Quorum { min_members: 2 });
        beat(&mut quorum, 10, 3);
        let ready =
            Progress { learner_ready: Some((NodeId(3), quorum.view().number)), ..Progress::default() };
        quorum.on_heartbeat(20, NodeId(3), 0, &ready);
        assert!(quorum.view().draining);
        for node in 0..3 {
            beat(&mut quorum, 999, node);
        }
        quorum.on_tick(1_000);
        assert!(quorum.view().learners.is_empty(), "the silent learner is dropped");
        let drained = Progress { drained: Some(quorum.view().number), ..Progress::default() };
        for node in 0..3 {
            quorum.on_heartbeat(1_001, NodeId(node), 0, &drained);
        }
        assert!(!quorum.view().draining && !quorum.transitioning());
        let reasons: Vec<&str> = quorum.take_changes().iter().map(|change| change.reason).collect();
        assert_eq!(reasons.last(), Some(&"drain ended, its member gone"), "{reasons:?}");
        assert!(!reasons.contains(&TRANSITION_COMPLETE), "{reasons:?}");
    }
}
