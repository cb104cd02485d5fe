//! MULTI / EXEC / DISCARD / WATCH / UNWATCH, as Redis has them.
//!
//! Between MULTI and EXEC a connection's commands are queued ([`queue`]), not
//! run; a command refused on the way in (unknown, wrong arity, no
//! permission) makes EXEC abort. EXEC takes the locks of every key of every
//! queued command at once (every key's, if one of them flushes) and runs
//! them back to back, so no other client's command comes between them.
//! WATCH notes a version per key, and EXEC answers nil without running
//! anything if one moved. Every write that reaches a table's engine moves
//! its key's version ([`crate::watch::Touching`]), while the writer holds the key's lock, so an EXEC that holds the
//! locks and finds the versions unmoved knows no write came between. As in
//! Redis, a command that changes nothing (HDEL of a missing field) moves
//! nothing. Versions are kept per stripe of keys, so a write to another key
//! of the same stripe (one in 65,536) aborts an EXEC that need not have.
//! On a shard running a quorum protocol WATCH notes each key's record
//! instead, and EXEC's conditional batch checks them (`cluster::serve`).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use tessera_protocol::Record;
use tessera_wire::Request;

use super::{execute, CommandSpec, Context, Scope, Session};
use crate::error::{CommandError, CommandResult};
use crate::watch::{KeyVersions, Watching};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "multi", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: multi },
    CommandSpec { name: "exec", arity: 1, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: exec },
    CommandSpec { name: "discard", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: discard },
    CommandSpec { name: "watch", arity: -2, flags: &["fast", "noscript"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: watch },
    CommandSpec { name: "unwatch", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: unwatch },
];

/// Commands queued since MULTI, each with its own copy of its arguments.
#[derive(Clone, Debug, Default)]
pub struct Transaction {
    queued: Vec<Queued>,
    /// A command was refused while queueing: EXEC aborts.
    refused: bool,
}

#[derive(Clone)]
struct Queued {
    spec: &'static CommandSpec,
    bytes: Vec<u8>,
    ranges: Vec<Range<usize>>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Queued").field("command", &self.spec.name).finish()
    }
}

impl Queued {
    fn new(spec: &'static CommandSpec, request: &Request) -> Self {
        let mut bytes = Vec::new();
        let mut ranges = Vec::with_capacity(request.len());
        for arg in request.args() {
            ranges.push(bytes.len()..bytes.len() + arg.len());
            bytes.extend_from_slice(arg);
        }
        Self { spec, bytes, ranges }
    }

    fn request(&self) -> Request<'_> {
        Request::new(&self.bytes, &self.ranges)
    }
}

/// The versions of the keys WATCH named, as they were then.
#[derive(Debug)]
pub struct Watched {
    /// Counts the session among those whose keys writes must move.
    _watching: Watching,
    versions: Vec<(usize, u64)>,
    flushes: u64,
    /// Keys of a shard running a quorum protocol (AA+SC), which this node's
    /// versions do not follow, with the record each had, fetched through
    /// the quorum; EXEC checks them there (`cluster::serve`).
    pub records: HashMap<Bytes, Option<Record>>,
}

impl Watched {
    /// Whether WATCH noted keys by this node's versions.
    pub fn has_versions(&self) -> bool {
        !self.versions.is_empty()
    }
}

/// The session's watched keys, started if none were.
fn watched<'s>(session: &'s mut Session, versions: &Arc<KeyVersions>) -> &'s mut Watched {
    session.watched.get_or_insert_with(|| Watched {
        _watching: Watching::new(versions),
        versions: Vec::new(),
        flushes: versions.flushes(),
        records: HashMap::new(),
    })
}

/// WATCH of keys on a shard running a quorum protocol: their records, as
/// fetched through it.
pub fn watch_records(context: &mut Context, records: HashMap<Bytes, Option<Record>>) {
    watched(context.session, &context.node.versions).records.extend(records);
    context.out.ok();
}

/// The commands a connection in MULTI runs at once rather than queueing.
fn runs_in_multi(name: &str) -> bool {
    matches!(name, "exec" | "discard" | "multi" | "watch" | "quit" | "reset")
}

/// In MULTI: queues the request (admitted, of the right arity) and answers
/// QUEUED; `false` when the command runs now instead.
pub fn queue(context: &mut Context, spec: &'static CommandSpec, request: &Request) -> bool {
    let Some(transaction) = context.session.transaction.as_mut() else { return false };
    if runs_in_multi(spec.name) {
        return false;
    }
    transaction.queued.push(Queued::new(spec, request));
    context.out.simple("QUEUED");
    true
}

impl Transaction {
    /// Commands queued so far.
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Every key the queued commands name, and whether any of them writes:
    /// where a cluster node runs EXEC.
    pub fn keys(&self) -> (Vec<Bytes>, bool) {
        let mut keys = Vec::new();
        for queued in &self.queued {
            let request = queued.request();
            let positions = queued.spec.key_positions(request.len(), |index| request.arg(index));
            keys.extend(positions.map(|index| Bytes::copy_from_slice(request.arg(index))));
        }
        let write = self.queued.iter().any(|queued| queued.spec.flags.contains(&"write"));
        (keys, write)
    }
}

/// In MULTI: a command was refused before it could be queued.
pub fn refuse(context: &mut Context) {
    if let Some(transaction) = context.session.transaction.as_mut() {
        transaction.refused = true;
    }
}

fn multi(context: &mut Context, _request: &Request) -> CommandResult {
    if context.session.transaction.is_some() {
        return Err(CommandError::Other("MULTI calls can not be nested".into()));
    }
    context.session.transaction = Some(Transaction::default());
    context.out.ok();
    Ok(())
}

fn discard(context: &mut Context, _request: &Request) -> CommandResult {
    if context.session.transaction.take().is_none() {
        return Err(CommandError::Other("DISCARD without MULTI".into()));
    }
    context.session.watched = None;
    context.out.ok();
    Ok(())
}

fn watch(context: &mut Context, request: &Request) -> CommandResult {
    if context.session.transaction.is_some() {
        return Err(CommandError::Other("WATCH inside MULTI is not allowed".into()));
    }
    let versions = &context.node.versions;
    watched(context.session, versions);
    for key in request.args().skip(1) {
        // Under the key's lock: a write under way finishes first (see
        // `Watching`).
        let _lock = context.lock_key(key)?;
        let stripe = KeyVersions::stripe(key);
        let version = versions.version(stripe);
        watched(context.session, versions).versions.push((stripe, version));
    }
    context.out.ok();
    Ok(())
}

fn unwatch(context: &mut Context, _request: &Request) -> CommandResult {
    context.session.watched = None;
    context.out.ok();
    Ok(())
}

fn exec(context: &mut Context, _request: &Request) -> CommandResult {
    let Some(transaction) = context.session.transaction.take() else {
        return Err(CommandError::Other("EXEC without MULTI".into()));
    };
    let watched = context.session.watched.take();
    if transaction.refused {
        return Err(CommandError::ExecAbort);
    }
    let requests: Vec<(&CommandSpec, Request)> =
        transaction.queued.iter().map(|queued| (queued.spec, queued.request())).collect();
    let node = context.node;
    let _locks = if context.locks_held {
        Vec::new()
    } else if requests.iter().any(|(spec, _)| spec.scope == Scope::Flush) {
        node.lock_all_unless_busy()?
    } else {
        node.lock_keys_unless_busy(
            requests
                .iter()
                .flat_map(|(spec, request)| {
                    spec.key_positions(request.len(), |index| request.arg(index))
                        .map(|index| request.arg(index))
                })
                .collect::<Vec<_>>()
                .into_iter(),
        )?
    };
    if let Some(watched) = watched {
        let versions = &node.versions;
        // Records of a quorum shard that runs here now: it has switched
        // modes since, and what it held then is no longer followed.
        let moved = !watched.records.is_empty()
            || watched.flushes != versions.flushes()
            || watched.versions.iter().any(|&(stripe, version)| versions.version(stripe) != version);
        if moved {
            context.out.null_array();
            return Ok(());
        }
    }
    context.out.array(requests.len());
    let locks_held = std::mem::replace(&mut context.locks_held, true);
    context.session.deny_blocking = true;
    for (spec, request) in &requests {
        super::answer(context, |context| execute(context, spec, request));
        if context.session.blocked.take().is_some() {
            // A blocking command in a transaction does not wait, as in Redis.
            context.out.null_array();
        }
    }
    context.session.deny_blocking = false;
    context.locks_held = locks_held;
    Ok(())
}
