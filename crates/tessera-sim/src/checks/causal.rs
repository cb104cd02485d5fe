//! Causal consistency (the causal modes, docs/PROTOCOLS.md, "Causal
//! consistency across datacenters"), checked on what sessions did and saw.
//!
//! Every put writes a value no other put writes, so a get names the write it
//! saw. A write's causal past is what its session had done and seen before
//! it: its session's earlier writes, the writes its session's gets returned,
//! and, transitively, their pasts. Two checks follow:
//! - **Per session**: a get of key `k` returns neither nothing nor a write
//!   `w` when its session's past holds a write `x` of `k` that `w` precedes
//!   (`w ≺ x`). Named read-your-writes when `x` is the session's own write,
//!   monotonic reads when the session read `x` earlier, and causal
//!   visibility otherwise (which covers monotonic writes and
//!   writes-follow-reads: a session that saw `x` depends on `x`'s past).
//! - **Per datacenter**: once a get at datacenter `d` has returned `w`, or
//!   a put at `d` has been acknowledged, `w` and its past are visible at
//!   `d`. A get at `d` begun after that must not return what they replaced,
//!   whichever session issues it.
//!
//! A get that returns a value no put wrote, or whose write follows the get in
//! causal order (a value from its own future), is reported too. Puts whose
//! outcome is unknown may be read or not; gets whose outcome is unknown are
//! left out of the history.
//!
//! A put may give its value a time to live (`expiring`): from then on a get
//! that returns nothing may have read that write, expired (or retired by a
//! datacenter's expiry sweep), and is judged as if it had returned it. Such
//! a get adds nothing to its session's past.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CausalCall {
    /// `acknowledged` is false when the client never heard back;
    /// `expiring`, when the value has a time to live.
    Put { value: Bytes, acknowledged: bool, expiring: bool },
    /// The value read (`None`: the key was absent).
    Get { read: Option<Bytes> },
}

/// One operation of a session. A session issues one at a time; a history
/// lists each session's operations in the order they were issued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CausalOperation {
    pub session: usize,
    pub datacenter: usize,
    pub key: Bytes,
    pub call: CausalCall,
    pub invoked_at: u64,
    /// For a put whose outcome is unknown, when the client gave up.
    pub completed_at: u64,
}

/// A set of writes, by index.
#[derive(Clone, Default)]
struct Writes(Vec<u64>);

impl Writes {
    fn with_room(writes: usize) -> Self {
        Self(vec![0; writes.div_ceil(64)])
    }

    fn insert(&mut self, write: usize) {
        self.0[write / 64] |= 1 << (write % 64);
    }

    fn contains(&self, write: usize) -> bool {
        self.0[write / 64] & (1 << (write % 64)) != 0
    }

    fn union(&mut self, other: &Writes) {
        self.0.iter_mut().zip(&other.0).for_each(|(word, other)| *word |= other);
    }
}

/// The most writes a history may hold: each write keeps its past as a set of
/// them, so memory grows with the square.
pub const WRITES_MAX: usize = 20_000;

/// Which of the checks apply: every causal store passes the per-session
/// ones; the per-datacenter one holds only where a write, once a
/// datacenter shows it, is visible to every partition there at once (COPS,
/// whose dependency checks make it so), not where each partition learns
/// the datacenter's stable time on its own schedule (GentleRain,
/// CausalSpartan: a session that carries the stable time it saw is never
/// shown less, but a session that saw nothing may be, for a while).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Sessions,
    SessionsAndDatacenters,
}

/// A history recorded from real clients, one JSON object a line, in each
/// session's order: `session`, `datacenter`, `key`, `call` (`put` with
/// `value` and `acknowledged`, or `get` with `read`, a string or null),
/// `invoked` and `completed` (microseconds). Gets that failed are left out.
pub fn from_json_lines(text: &str) -> Result<Vec<CausalOperation>, String> {
    let mut operations = Vec::new();
    for line in crate::history::json_lines(text) {
        let line = line?;
        let call = match line.field("call")?.as_str() {
            Some("put") => {
                let (value, acknowledged) = (line.text("value")?, line.flag("acknowledged")?);
                CausalCall::Put { value, acknowledged, expiring: false }
            }
            Some("get") => CausalCall::Get { read: line.optional_text("read")? },
            other => return Err(line.error(format!("unknown call {other:?}"))),
        };
        operations.push(CausalOperation {
            session: line.whole("session")? as usize,
            datacenter: line.whole("datacenter")? as usize,
            key: line.text("key")?,
            call,
            invoked_at: line.whole("invoked")?,
            completed_at: line.whole("completed")?,
        });
    }
    let writes =
        operations.iter().filter(|operation| matches!(operation.call, CausalCall::Put { .. })).count();
    if writes > WRITES_MAX {
        return Err(format!("{writes} writes; the checker takes at most {WRITES_MAX}"));
    }
    Ok(operations)
}

/// Violations of causal consistency in `operations`, per session and per
/// datacenter.
pub fn check(operations: &[CausalOperation]) -> Vec<String> {
    check_in(operations, Scope::SessionsAndDatacenters)
}

/// Violations of causal consistency in `operations`, in `scope`.
pub fn check_in(operations: &[CausalOperation], scope: Scope) -> Vec<String> {
    let mut violations = Vec::new();
    let mut known = Known::of(operations);
    let writes = known.writes.len();
    assert!(writes <= WRITES_MAX, "{writes} writes: the causal checker takes at most {WRITES_MAX}");
    let mut writer_of: HashMap<&Bytes, usize> = HashMap::new();
    for (write, &at) in known.writes.iter().enumerate() {
        let CausalCall::Put { value, .. } = &operations[at].call else { unreachable!("a write is a put") };
        if writer_of.insert(value, write).is_some() {
            violations.push(format!("causal: the value {value:?} was written twice; values must be unique"));
        }
    }
    let write_index: HashMap<usize, usize> =
        known.writes.iter().enumerate().map(|(write, &at)| (at, write)).collect();
    let mut sessions: HashMap<usize, Vec<usize>> = HashMap::new();
    for (at, operation) in operations.iter().enumerate() {
        sessions.entry(operation.session).or_default().push(at);
    }
    let mut sessions: Vec<(usize, Vec<usize>)> = sessions.into_iter().collect();
    sessions.sort();
    // Each session's past so far, how far it has got, and what it saw of
    // each key itself (the write, and the get that saw it).
    let mut pasts: Vec<Writes> = sessions.iter().map(|_| Writes::with_room(writes)).collect();
    let mut next = vec![0; sessions.len()];
    let mut read_before: Vec<HashMap<&Bytes, Vec<(usize, usize)>>> = vec![HashMap::new(); sessions.len()];
    // The write each get saw, and the gets found wrong, for the per-datacenter check.
    let mut seen: HashMap<usize, usize> = HashMap::new();
    let mut flagged: HashSet<usize> = HashSet::new();
    // Gets that returned nothing, with their session's past: judged once
    // every write's past is known, since one may stand for an expiring
    // write its session has not reached yet. They add nothing to the past.
    let mut nothing_read: Vec<(usize, usize, Writes)> = Vec::new();
    // Sessions advance in causal order: a get waits for the write it read.
    loop {
        let mut advanced = false;
        for (index, (session, ops)) in sessions.iter().enumerate() {
            while let Some(&at) = ops.get(next[index]) {
                let operation = &operations[at];
                match &operation.call {
                    CausalCall::Put { acknowledged, .. } => {
                        let write = write_index[&at];
                        let mut past = pasts[index].clone();
                        past.insert(write);
                        // A put the session never heard back from may have
                        // had no effect: its later operations need not see it.
                        if *acknowledged {
                            pasts[index] = past.clone();
                        }
                        known.closure[write] = Some(past);
                    }
                    CausalCall::Get { read: None } => nothing_read.push((index, at, pasts[index].clone())),
                    CausalCall::Get { read: Some(value) } => {
                        let read_write = match writer_of.get(value) {
                            None => {
                                violations.push(format!(
                                    "causal: session {session} read {value:?} from key {:?}, which no put wrote",
                                    operation.key
                                ));
                                None
                            }
                            Some(&write) if operations[known.writes[write]].key != operation.key => {
                                violations.push(format!(
                                    "causal: session {session} read {value:?} from key {:?}; it was written to key {:?}",
                                    operation.key,
                                    operations[known.writes[write]].key
                                ));
                                None
                            }
                            Some(&write) if known.closure[write].is_none() => break, // not yet written
                            Some(&write) => Some(write),
                        };
                        if let Some(shadowing) = known.shadowed(&pasts[index], at, read_write) {
                            flagged.insert(at);
                            violations.push(known.session_violation(
                                &sessions[index].1,
                                &read_before[index],
                                at,
                                shadowing,
                            ));
                        }
                        if let Some(write) = read_write {
                            let past = known.closure[write].clone().expect("a write read has its past");
                            pasts[index].union(&past);
                            read_before[index].entry(&operation.key).or_default().push((write, at));
                            seen.insert(at, write);
                        }
                    }
                }
                next[index] += 1;
                advanced = true;
            }
        }
        if !advanced {
            break;
        }
    }
    for (index, (session, ops)) in sessions.iter().enumerate() {
        if let Some(&at) = ops.get(next[index]) {
            violations.push(format!(
                "causal: session {session} read {:?} from key {:?}, a value from its own future (causality has a cycle)",
                operations[at].call, operations[at].key
            ));
        }
    }
    known.session_writes = sessions
        .iter()
        .map(|(_, ops)| ops.iter().filter_map(|at| write_index.get(at).map(|&write| (*at, write))).collect())
        .collect();
    known.session_index =
        sessions.iter().enumerate().map(|(index, (session, _))| (*session, index)).collect();
    for (index, at, past) in nothing_read {
        if let Some(shadowing) = known.shadowed(&past, at, None) {
            flagged.insert(at);
            violations.push(known.session_violation(&sessions[index].1, &read_before[index], at, shadowing));
        }
    }
    let judged = Judged { seen, flagged };
    if scope == Scope::Sessions {
        return violations;
    }
    violations.extend(check_datacenters(&known, &write_index, &judged));
    violations
}

/// What the per-session check found of each get.
struct Judged {
    /// The write each get saw.
    seen: HashMap<usize, usize>,
    /// The gets it reported (not reported again for their datacenter).
    flagged: HashSet<usize>,
}

/// What the checks know of a history's writes.
struct Known<'h> {
    operations: &'h [CausalOperation],
    /// Each write's operation.
    writes: Vec<usize>,
    /// Each key's writes.
    of_key: HashMap<&'h Bytes, Vec<usize>>,
    /// Each write's causal past, itself included, once its session has
    /// got to it.
    closure: Vec<Option<Writes>>,
    /// Which writes gave their value a time to live.
    expiring: Vec<bool>,
    /// Once every session has advanced: each session's writes (operation,
    /// write), by the sessions' index.
    session_writes: Vec<Vec<(usize, usize)>>,
    session_index: HashMap<usize, usize>,
}

impl<'h> Known<'h> {
    fn of(operations: &'h [CausalOperation]) -> Self {
        let writes: Vec<usize> = (0..operations.len())
            .filter(|&at| matches!(operations[at].call, CausalCall::Put { .. }))
            .collect();
        let mut of_key: HashMap<&Bytes, Vec<usize>> = HashMap::new();
        for (write, &at) in writes.iter().enumerate() {
            of_key.entry(&operations[at].key).or_default().push(write);
        }
        let expiring = writes
            .iter()
            .map(|&at| matches!(operations[at].call, CausalCall::Put { expiring: true, .. }))
            .collect();
        let closure = vec![None; writes.len()];
        Self {
            operations,
            writes,
            of_key,
            closure,
            expiring,
            session_writes: Vec::new(),
            session_index: HashMap::new(),
        }
    }

    /// A write of the key the get at `get` read in `past` that `read` (a
    /// write, or `None` for nothing) precedes: what a get that saw `past`
    /// must not have read past. A get that returned nothing passes when
    /// nothing would, or when some expiring write of the key would that was
    /// made before the get ended and does not follow it.
    fn shadowed(&self, past: &Writes, get: usize, read: Option<usize>) -> Option<usize> {
        let key = &self.operations[get].key;
        let read_past = |read: Option<usize>| {
            self.of_key.get(key)?.iter().copied().find(|&write| {
                past.contains(write)
                    && Some(write) != read
                    && read.is_none_or(|read| {
                        self.closure[write].as_ref().is_some_and(|closure| closure.contains(read))
                    })
            })
        };
        let shadowing = read_past(read)?;
        if read.is_some() || !matches!(self.operations[get].call, CausalCall::Get { read: None }) {
            return Some(shadowing);
        }
        let expired = self.of_key[key].iter().any(|&write| {
            self.expiring[write] && self.made_before(write, get) && read_past(Some(write)).is_none()
        });
        match expired {
            true => None,
            // Name the newest write read past: the one that tells why.
            false => self.of_key[key].iter().rev().copied().find(|&write| past.contains(write)),
        }
    }

    /// Whether `write` was made before the get at `get` ended and does not
    /// causally follow it (its past holds no later write of the get's
    /// session).
    fn made_before(&self, write: usize, get: usize) -> bool {
        let Some(past) = &self.closure[write] else { return false };
        let session = self.session_index[&self.operations[get].session];
        self.operations[self.writes[write]].invoked_at <= self.operations[get].completed_at
            && !self.session_writes[session].iter().any(|&(at, later)| at > get && past.contains(later))
    }

    /// The violation of the get at `get`, which read past `shadowing`,
    /// named by how its session came to see `shadowing`.
    fn session_violation(
        &self,
        session_ops: &[usize],
        read_before: &HashMap<&Bytes, Vec<(usize, usize)>>,
        get: usize,
        shadowing: usize,
    ) -> String {
        let operation = &self.operations[get];
        let kind = if session_ops.contains(&self.writes[shadowing]) {
            "read-your-writes"
        } else if read_before
            .get(&operation.key)
            .is_some_and(|seen| seen.iter().any(|&(write, at)| write == shadowing && at < get))
        {
            "monotonic reads"
        } else {
            "causal visibility"
        };
        let CausalCall::Get { read } = &operation.call else { unreachable!("a get") };
        format!(
            "causal: {kind}: session {} at datacenter {} read {read:?} from key {:?}, \
             though it had seen the later write {:?}",
            operation.session,
            operation.datacenter,
            operation.key,
            self.written_value(shadowing)
        )
    }

    fn written_value(&self, write: usize) -> Bytes {
        match &self.operations[self.writes[write]].call {
            CausalCall::Put { value, .. } => value.clone(),
            CausalCall::Get { .. } => unreachable!("a write is a put"),
        }
    }
}

/// The per-datacenter check: what a datacenter has shown (a get's answer) or
/// acknowledged (a put), with its past, stays visible there to every get
/// begun after.
fn check_datacenters(known: &Known, write_index: &HashMap<usize, usize>, judged: &Judged) -> Vec<String> {
    let operations = known.operations;
    let seen = &judged.seen;
    let mut violations = Vec::new();
    let datacenters = operations.iter().map(|operation| operation.datacenter).max().map_or(0, |max| max + 1);
    for datacenter in 0..datacenters {
        // What became visible at the datacenter, by when.
        let mut shown: Vec<(u64, usize)> = Vec::new();
        let mut gets: Vec<usize> = Vec::new();
        for (at, operation) in
            operations.iter().enumerate().filter(|(_, operation)| operation.datacenter == datacenter)
        {
            match &operation.call {
                CausalCall::Put { acknowledged: true, .. } => {
                    shown.push((operation.completed_at, write_index[&at]))
                }
                CausalCall::Put { acknowledged: false, .. } => {}
                CausalCall::Get { .. } => {
                    if let Some(&write) = seen.get(&at) {
                        shown.push((operation.completed_at, write));
                    }
                    gets.push(at);
                }
            }
        }
        shown.sort_unstable();
        gets.sort_by_key(|&at| operations[at].invoked_at);
        let mut visible = Writes::with_room(known.writes.len());
        let mut shown = shown.into_iter().peekable();
        for at in gets {
            let operation = &operations[at];
            while let Some((_, write)) = shown.next_if(|(when, _)| *when < operation.invoked_at) {
                if let Some(past) = &known.closure[write] {
                    visible.union(past);
                }
            }
            let CausalCall::Get { read } = &operation.call else { unreachable!("gets only") };
            if (read.is_some() && !seen.contains_key(&at)) || judged.flagged.contains(&at) {
                continue; // reported already
            }
            if let Some(shadowing) = known.shadowed(&visible, at, seen.get(&at).copied()) {
                violations.push(format!(
                    "causal: visibility at datacenter {datacenter}: session {} read {read:?} from key {:?} \
                     after the datacenter had shown the later write {:?}",
                    operation.session,
                    operation.key,
                    known.written_value(shadowing)
                ));
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `step`th operation of a test history: each takes one time unit,
    /// and the next begins a unit after.
    fn operation(
        step: u64,
        session: usize,
        datacenter: usize,
        key: &str,
        call: CausalCall,
    ) -> CausalOperation {
        let key = Bytes::from(key.to_owned());
        CausalOperation { session, datacenter, key, call, invoked_at: 2 * step, completed_at: 2 * step + 1 }
    }

    /// A history from a compact script: `(session, datacenter, "k=v")` puts,
    /// `"k~v"` puts with a time to live, and `(session, datacenter, "k?v")`
    /// gets (`k?` reads nothing), one time unit apart in the order given.
    fn history(script: &[(usize, usize, &str)]) -> Vec<CausalOperation> {
        script
            .iter()
            .enumerate()
            .map(|(time, &(session, datacenter, step))| {
                let put = step.split_once('=').map(|put| (put, false));
                let (key, call) = match put.or_else(|| step.split_once('~').map(|put| (put, true))) {
                    Some(((key, value), expiring)) => {
                        let value = Bytes::from(value.to_owned());
                        (key, CausalCall::Put { value, acknowledged: true, expiring })
                    }
                    None => {
                        let (key, value) = step.split_once('?').expect("k=v or k?v");
                        let read = (!value.is_empty()).then(|| Bytes::from(value.to_owned()));
                        (key, CausalCall::Get { read })
                    }
                };
                operation(time as u64, session, datacenter, key, call)
            })
            .collect()
    }

    /// A post, and a comment on it by a session that read it, at datacenter 0.
    const POST_AND_COMMENT: [(usize, usize, &str); 3] =
        [(0, 0, "post=p1"), (1, 0, "post?p1"), (1, 0, "comment=c1")];

    /// `POST_AND_COMMENT`, then `after`.
    fn after_post_and_comment(after: &[(usize, usize, &str)]) -> Vec<CausalOperation> {
        history(&[POST_AND_COMMENT.as_slice(), after].concat())
    }

    fn kinds(violations: &[String]) -> Vec<&str> {
        violations.iter().map(|violation| violation.split(':').nth(1).unwrap_or("").trim()).collect()
    }

    #[test]
    fn histories_a_causal_store_may_give_pass() {
        // A post, a comment that read it, and a reader in the other
        // datacenter that sees the comment and then the post; concurrent
        // writes of one key read in either order by different sessions.
        let good = after_post_and_comment(&[
            (2, 1, "comment?c1"),
            (2, 1, "post?p1"),
            (3, 0, "x=a"),
            (4, 1, "x=b"),
            (5, 0, "x?b"),
            (6, 1, "x?a"),
            (7, 1, "never?"),
        ]);
        assert_eq!(check(&good), Vec::<String>::new());
    }

    #[test]
    fn a_session_that_reads_past_its_own_write_breaks_read_your_writes() {
        let violations = check(&history(&[(0, 0, "k=v1"), (1, 1, "k?v1"), (1, 1, "k=v2"), (1, 1, "k?v1")]));
        assert_eq!(kinds(&violations), ["read-your-writes"], "{violations:?}");
        let violations = check(&history(&[(0, 0, "k=v1"), (0, 0, "k?")]));
        assert_eq!(kinds(&violations), ["read-your-writes"], "{violations:?}");
    }

    #[test]
    fn a_session_that_reads_an_older_value_after_a_newer_one_breaks_monotonic_reads() {
        let violations = check(&history(&[(0, 0, "k=v1"), (0, 0, "k=v2"), (1, 1, "k?v2"), (1, 1, "k?v1")]));
        assert_eq!(kinds(&violations), ["monotonic reads"], "{violations:?}");
    }

    #[test]
    fn a_comment_seen_before_its_post_is_visible_breaks_causal_visibility() {
        // The reader sees the comment, whose writer had read the post, and
        // then finds no post.
        let violations = check(&after_post_and_comment(&[(2, 1, "comment?c1"), (2, 1, "post?")]));
        assert_eq!(kinds(&violations), ["causal visibility"], "{violations:?}");
        // Writes-follow-reads through an older version: the post was edited
        // before the comment's writer read it.
        let violations = check(&history(&[
            (0, 0, "post=p1"),
            (0, 0, "post=p2"),
            (1, 0, "post?p2"),
            (1, 0, "comment=c1"),
            (2, 1, "comment?c1"),
            (2, 1, "post?p1"),
        ]));
        assert_eq!(kinds(&violations), ["causal visibility"], "{violations:?}");
    }

    #[test]
    fn another_session_at_the_datacenter_must_not_see_what_the_datacenter_showed_undone() {
        // Session 2 saw the comment at datacenter 1; session 3, later and at
        // the same datacenter, finds no post, which the comment depends on.
        let violations = check(&after_post_and_comment(&[(2, 1, "comment?c1"), (3, 1, "post?")]));
        assert_eq!(kinds(&violations), ["visibility at datacenter 1"], "{violations:?}");
        // At the other datacenter nothing was shown yet: no violation there.
        assert_eq!(check(&after_post_and_comment(&[(3, 1, "post?")])), Vec::<String>::new());
    }

    #[test]
    fn values_from_nowhere_or_from_the_future_are_reported() {
        let violations = check(&history(&[(0, 0, "k?ghost")]));
        assert!(violations[0].contains("which no put wrote"), "{violations:?}");
        let violations = check(&history(&[(0, 0, "a=v"), (1, 0, "b?v")]));
        assert!(violations[0].contains("it was written to key"), "{violations:?}");
        // Each session reads the other's write before making its own.
        let violations = check(&history(&[(0, 0, "b?b1"), (0, 0, "a=a1"), (1, 1, "a?a1"), (1, 1, "b=b1")]));
        assert_eq!(
            violations.iter().filter(|violation| violation.contains("own future")).count(),
            2,
            "{violations:?}"
        );
    }

    #[test]
    fn nothing_may_be_read_for_an_expiring_write_the_session_has_not_read_past() {
        // Its own expiring write, or one another session made, may read as
        // nothing, at its datacenter or at the other.
        let expired = history(&[(0, 0, "k~v1"), (0, 0, "k?"), (1, 1, "k?v1"), (1, 1, "k?"), (2, 1, "k?")]);
        assert_eq!(check(&expired), Vec::<String>::new());
        // Not once the session wrote, or read, a later value that lives on.
        let violations = check(&history(&[(0, 0, "k~v1"), (0, 0, "k=v2"), (0, 0, "k?")]));
        assert_eq!(kinds(&violations), ["read-your-writes"], "{violations:?}");
        let violations = check(&history(&[(0, 0, "k~v1"), (0, 0, "k=v2"), (1, 1, "k?v2"), (1, 1, "k?")]));
        assert_eq!(kinds(&violations), ["monotonic reads"], "{violations:?}");
        // Nor at a datacenter that has shown the later value, to any session.
        let violations = check(&history(&[(0, 0, "k~v1"), (0, 0, "k=v2"), (1, 1, "k?v2"), (2, 1, "k?")]));
        assert_eq!(kinds(&violations), ["visibility at datacenter 1"], "{violations:?}");
        // A later write that expires too may itself read as nothing.
        assert_eq!(check(&history(&[(0, 0, "k~v1"), (0, 0, "k~v2"), (0, 0, "k?")])), Vec::<String>::new());
    }

    /// A history from a small store of two datacenters: each applies its
    /// own writes at once and ships them to the other, which applies what
    /// arrives in order (causal, with sessions that keep to one
    /// datacenter), or, when `broken`, in any order.
    fn two_datacenter_store(seed: u64, broken: bool) -> Vec<CausalOperation> {
        let mut rng = crate::rng::Rng::new(seed);
        let keys = ["post", "comment", "reply"];
        let mut stores: [HashMap<&str, Bytes>; 2] = [HashMap::new(), HashMap::new()];
        // Writes in flight to each datacenter: (key, value).
        let mut in_flight: [Vec<(&str, Bytes)>; 2] = [Vec::new(), Vec::new()];
        let mut operations = Vec::new();
        for time in 0..400u64 {
            for datacenter in 0..2 {
                if !in_flight[datacenter].is_empty() && rng.chance(0.3) {
                    let next =
                        if broken { rng.below(in_flight[datacenter].len() as u64) as usize } else { 0 };
                    let (key, value) = in_flight[datacenter].remove(next);
                    stores[datacenter].insert(key, value);
                }
            }
            let session = rng.below(6) as usize;
            let datacenter = session % 2;
            let key = *rng.pick(&keys);
            let call = if rng.chance(0.4) {
                let value = Bytes::from(format!("{key}-{time}"));
                stores[datacenter].insert(key, value.clone());
                in_flight[1 - datacenter].push((key, value.clone()));
                CausalCall::Put { value, acknowledged: true, expiring: false }
            } else {
                CausalCall::Get { read: stores[datacenter].get(key).cloned() }
            };
            operations.push(operation(time, session, datacenter, key, call));
        }
        operations
    }

    #[test]
    fn a_store_that_applies_remote_writes_in_order_passes_and_one_that_does_not_is_caught() {
        for seed in 0..200 {
            let violations = check(&two_datacenter_store(seed, false));
            assert!(violations.is_empty(), "seed {seed}: {violations:?}");
        }
        let caught = (0..200).filter(|&seed| !check(&two_datacenter_store(seed, true)).is_empty()).count();
        assert!(caught > 100, "the checker caught the broken store in only {caught} of 200 runs");
    }

    #[test]
    fn unacknowledged_puts_may_be_read_or_not() {
        let mut operations = history(&[(0, 0, "k=v1"), (1, 0, "k?"), (2, 1, "k?v1")]);
        operations[0].call =
            CausalCall::Put { value: Bytes::from_static(b"v1"), acknowledged: false, expiring: false };
        assert_eq!(check(&operations), Vec::<String>::new());
    }

    /// A session that never heard back from a put (its node restarted)
    /// goes on; its later gets may miss that put, not one acknowledged.
    #[test]
    fn a_session_goes_on_past_a_put_it_never_heard_back_from() {
        let mut operations = history(&[(0, 0, "k=v0"), (0, 0, "k=v1"), (0, 0, "k?v0")]);
        assert_eq!(kinds(&check(&operations)), ["read-your-writes"]);
        operations[1].call =
            CausalCall::Put { value: Bytes::from_static(b"v1"), acknowledged: false, expiring: false };
        assert_eq!(check(&operations), Vec::<String>::new());
    }
}
