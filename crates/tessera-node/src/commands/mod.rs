//! The command table. Each shard of commands lives in its own file and lists
//! its commands in a `COMMANDS` table; adding a command is a handler and a row.

pub mod acl;
mod bitfield;
pub mod cluster;
mod command_info;
pub mod connection;
pub mod consistency;
mod docs;
mod docs_table;
mod dump;
mod hashes;
mod introspection;
pub mod keys;
pub mod lists;
mod persistence;
pub mod pubsub;
#[cfg(test)]
mod reference;
pub mod scripting;
mod server;
mod sets;
mod sort;
mod sorted_sets;
mod strings;
pub mod tables;
pub mod transactions;

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use hashbrown::HashMap;
use parking_lot::MutexGuard;
use tessera_engine::{reserved, Engine};
use tessera_wire::{ReplyWriter, Request};

use crate::acl::User;
use crate::error::{CommandError, CommandResult};
use crate::membership::Membership;
use crate::node_state::{NodeState, WorkerStats};
use crate::tables::{Table, TableSet};
use crate::typed::parse_i64;

/// Per-connection state the commands read and change.
#[derive(Debug, Default)]
pub struct Session {
    pub id: u64,
    /// The command that ran last on this connection ([`command_index`]):
    /// the connection times it. (A transaction's commands run before EXEC
    /// ends, and EXEC is the one left here.)
    pub executed: Option<usize>,
    pub name: Option<Bytes>,
    pub authenticated: bool,
    /// The user the connection acts as (`default` until AUTH names another).
    pub user: String,
    /// That user's permissions as last looked up, and the ACL generation
    /// they are from.
    pub permissions: Option<Permissions>,
    /// AUTH attempts that failed on this connection: each costs a growing
    /// pause before the connection's next command.
    pub failed_auths: u32,
    /// Set by QUIT: close after the reply is written.
    pub closing: bool,
    pub library_name: Option<Bytes>,
    pub library_version: Option<Bytes>,
    /// Speaks Redis Cluster (sent a CLUSTER command, READONLY, READWRITE or
    /// ASKING): told MOVED where a plain client's request is forwarded.
    pub cluster_client: bool,
    /// READONLY or CONSISTENCY EVENTUAL: reads are served by any replica,
    /// eventually consistent.
    pub readonly: bool,
    /// Another node's forwarding link, logged in with the cluster secret
    /// (RELAY.HELLO, RELAY.AUTH): it acts for the cluster, unrestricted;
    /// what this node does not serve is answered MOVED, never forwarded again.
    pub relay: bool,
    /// A relay login under way.
    pub relay_challenge: Option<tessera_cluster::auth::Transcript>,
    /// Came in over TLS: cluster replies and redirections name the nodes'
    /// TLS ports.
    pub tls: bool,
    /// A blocking command (BLPOP …) that found nothing: the connection waits
    /// and runs it again.
    pub blocked: Option<crate::blocking::Blocked>,
    /// Since MULTI: the commands EXEC will run.
    pub transaction: Option<transactions::Transaction>,
    /// Since WATCH: the keys whose change makes EXEC abort.
    pub watched: Option<transactions::Watched>,
    /// Since SUBSCRIBE and its kin: the channels and the messages to write.
    pub subscription: Option<crate::pubsub::Subscription>,
    /// The connection's entry among the node's clients.
    pub client: Option<Arc<crate::clients::ClientEntry>>,
    /// CLIENT REPLY OFF: no replies until CLIENT REPLY ON.
    pub replies_off: bool,
    /// CLIENT REPLY SKIP: the replies to drop, this command's included.
    pub replies_to_skip: u8,
    /// CLIENT NO-EVICT ON (kept for CLIENT LIST; Tessera never evicts clients).
    pub no_evict: bool,
    /// A script running on a script thread: the connection waits for its reply.
    pub script: Option<tokio::sync::oneshot::Receiver<scripting::ScriptOutcome>>,
    /// In a cluster: where the connection's last write to each shard stands
    /// (WAIT waits for replicas to hold them).
    pub written: Vec<(u32, tessera_protocol::WritePosition)>,
    /// EXEC is running the connection's commands: none may block (WAIT
    /// answers at once).
    pub deny_blocking: bool,
    /// Since CONSISTENCY CAUSAL or CAUSAL.TOKEN SET, on a cluster across
    /// datacenters: what the session has done and seen, which its commands
    /// carry and their replies bring back.
    pub causal: Option<tessera_protocol::CausalContext>,
}

impl Session {
    /// Notes the connection's newest write to `shard`.
    pub fn note_write(&mut self, shard: u32, position: tessera_protocol::WritePosition) {
        match self.written.iter_mut().find(|(written, _)| *written == shard) {
            Some((_, last)) => *last = position,
            None => self.written.push((shard, position)),
        }
    }

    /// Whether the connection's user may read any key (SORT's BY and GET
    /// patterns read keys no argument names).
    pub fn reads_every_key(&self) -> bool {
        self.relay || self.permissions.as_ref().is_some_and(|permissions| permissions.user.reads_every_key())
    }
}

/// A user's permissions as a connection checks them.
#[derive(Clone, Debug)]
pub struct Permissions {
    generation: u64,
    user: Arc<User>,
    /// Every command and every key: nothing to check.
    unrestricted: bool,
}

/// What a command handler works with.
pub struct Context<'a> {
    pub node: &'a Arc<NodeState>,
    pub tables: &'a Arc<TableSet>,
    pub session: &'a mut Session,
    pub out: &'a mut ReplyWriter,
    pub stats: &'a Arc<WorkerStats>,
    /// The node's place in a cluster, if it is a member of one.
    pub cluster: Option<&'a Membership>,
    /// Wall-clock milliseconds, read once per batch of commands.
    pub now_ms: u64,
    /// In a cluster: the view of the shard the command runs on, which takes
    /// the place of every table's engine.
    pub engine_override: Option<&'a dyn Engine>,
    /// In a cluster the keys' locks are taken around the whole command (and
    /// the hand-over of its writes to replication), not by the handler.
    pub locks_held: bool,
}

impl<'a> Context<'a> {
    /// This context with `view` in place of every table's engine (a shard's
    /// view in a cluster); `locks_held` when the caller holds the keys' locks.
    pub fn over<'b>(&'b mut self, view: &'b dyn Engine, locks_held: bool) -> Context<'b> {
        Context {
            node: self.node,
            tables: self.tables,
            session: &mut *self.session,
            out: &mut *self.out,
            stats: self.stats,
            cluster: self.cluster,
            now_ms: self.now_ms,
            engine_override: Some(view),
            locks_held,
        }
    }

    /// The engine that holds `key`.
    pub fn engine(&self, key: &[u8]) -> &'a dyn Engine {
        match self.engine_override {
            Some(engine) => engine,
            None => self.table(key).engine.as_ref(),
        }
    }

    /// The table that owns `key`.
    pub fn table(&self, key: &[u8]) -> &'a Table {
        self.tables.route(key)
    }

    /// Holds the write lock of one key, unless the caller already does;
    /// BUSY rather than waiting behind a script that runs too long.
    pub fn lock_key(&self, key: &[u8]) -> CommandResult<Option<MutexGuard<'a, ()>>> {
        if self.locks_held {
            return Ok(None);
        }
        self.node.lock_stripe_unless_busy(NodeState::stripe_index(key)).map(Some)
    }

    /// Holds the write locks of several keys, unless the caller already
    /// does; BUSY rather than waiting behind a script that runs too long.
    pub fn lock_keys<'k>(
        &self,
        keys: impl Iterator<Item = &'k [u8]>,
    ) -> CommandResult<Vec<MutexGuard<'a, ()>>> {
        if self.locks_held {
            return Ok(Vec::new());
        }
        self.node.lock_keys_unless_busy(keys)
    }

    pub fn bulk_bytes_max(&self) -> usize {
        self.node.config.bulk_bytes_max
    }

    pub fn count_lookup(&self, hit: bool) {
        let counter = if hit { &self.stats.keyspace_hits } else { &self.stats.keyspace_misses };
        WorkerStats::add(counter, 1);
    }
}

pub type Handler = fn(&mut Context, &Request) -> CommandResult;

/// How a cluster node serves a command (a single node runs every command on
/// its own tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Where its keys live (a command without keys: on this node).
    Keys,
    /// Over the shards this node heads, so that across the nodes every key
    /// counts once (SCAN, KEYS, DBSIZE).
    NodeWide,
    /// Deletes the keys of the shards this node heads, through replication.
    Flush,
    /// The cluster's tables, changed through the coordinator.
    Tables,
    /// Walks a range-partitioned table's shards in key order.
    TableRange,
    /// A read at a named consistency, placed as the read it wraps.
    WrappedRead,
    /// ACL: the cluster's users, changed through the coordinator and read
    /// from this node's copy.
    Users,
    /// Redis Cluster's resharding (MIGRATE, CLUSTER SETSLOT and the key
    /// counts by slot) through the coordinator; the rest of CLUSTER from
    /// this node's map.
    Resharding,
}

/// One command: how it is called and where its keys are (for COMMAND, which
/// cluster clients read to route requests).
#[derive(Clone, Copy)]
pub struct CommandSpec {
    pub name: &'static str,
    /// Redis's convention: `n` means exactly n arguments (with the name), `-n`
    /// at least n.
    pub arity: i32,
    pub flags: &'static [&'static str],
    pub first_key: i32,
    pub last_key: i32,
    pub step: i32,
    pub scope: Scope,
    pub handler: Handler,
}

impl CommandSpec {
    pub fn arity_ok(&self, count: usize) -> bool {
        let count = count as i32;
        if self.arity >= 0 {
            count == self.arity
        } else {
            count >= -self.arity
        }
    }

    /// Where the keys are in a call with `count` arguments (the name
    /// included), `arg` reading them: the range that `first_key`,
    /// `last_key` and `step` give, then those an argument counts. A
    /// CONSISTENCY.READ has the keys of the read it wraps, so that clients
    /// route it (COMMAND GETKEYS) and access is checked on them.
    pub fn key_positions<'r>(
        &self,
        count: usize,
        arg: impl Fn(usize) -> &'r [u8],
    ) -> impl Iterator<Item = usize> {
        let wrapped = match self.scope {
            Scope::WrappedRead if count > 2 => {
                // Only a read of the right arity: its key positions then exist.
                lookup(arg(2)).filter(|inner| inner.scope != Scope::WrappedRead && inner.arity_ok(count - 2))
            }
            _ => None,
        };
        let (spec, skip) = wrapped.map_or((self, 0), |inner| (inner, 2));
        let count = count - skip;
        let arg = |index| arg(index + skip);
        let kind = spec.movable_keys();
        let movable = kind.and_then(|kind| movable_keys(kind, count, &arg));
        // MIGRATE's KEYS form names its keys there, and "" where the key stands.
        let fixed_stand = !(kind == Some(MovableKeys::MigrateList) && movable.is_some());
        let last = if spec.last_key < 0 { count as i32 + spec.last_key } else { spec.last_key };
        let first = if spec.first_key > 0 && fixed_stand { spec.first_key } else { last + 1 };
        let fixed = (first..=last).step_by(spec.step.max(1) as usize).map(|index| index as usize);
        let movable = movable.unwrap_or(0..0);
        fixed.chain(movable).map(move |index| index + skip)
    }

    /// Where the command's keys may stand beyond its fixed ones, known once
    /// per command rather than by its name on every call.
    fn movable_keys(&self) -> Option<MovableKeys> {
        command_index(self).map_or_else(|| MovableKeys::of(self.name), |index| catalog().movable_keys[index])
    }

    /// Whether the command may run before AUTH.
    fn allowed_unauthenticated(&self) -> bool {
        matches!(self.name, "auth" | "hello" | "quit" | "reset" | "relay.hello" | "relay.auth")
    }
}

/// Where a command's keys may stand beyond its fixed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MovableKeys {
    /// After an argument that counts them, which stands here.
    Counted(usize),
    /// SORT's STORE destination.
    SortStore,
    /// MEMORY USAGE's key.
    MemoryUsage,
    /// MIGRATE's KEYS list.
    MigrateList,
}

impl MovableKeys {
    fn of(name: &str) -> Option<Self> {
        match name {
            "sort" => Some(MovableKeys::SortStore),
            "memory" => Some(MovableKeys::MemoryUsage),
            "migrate" => Some(MovableKeys::MigrateList),
            _ => counted_keys_at(name).map(MovableKeys::Counted),
        }
    }
}

/// Where the movable keys of a call with `count` arguments are.
fn movable_keys<'r>(
    kind: MovableKeys,
    count: usize,
    arg: &impl Fn(usize) -> &'r [u8],
) -> Option<Range<usize>> {
    let counted_at = match kind {
        MovableKeys::SortStore => return sort::store_key_position(count, arg).map(|at| at..at + 1),
        MovableKeys::MemoryUsage => return (count >= 3 && is(arg(1), "usage")).then_some(2..3),
        MovableKeys::MigrateList => return dump::migrate_keys_at(count, arg).map(|at| at..count),
        MovableKeys::Counted(at) => at,
    };
    (counted_at < count).then(|| {
        let keys = parse_i64(arg(counted_at)).unwrap_or(0).clamp(0, (count - counted_at - 1) as i64) as usize;
        counted_at + 1..counted_at + 1 + keys
    })
}

/// Where the argument that counts a command's keys stands, for the commands
/// whose keys follow such a count.
pub fn counted_keys_at(name: &str) -> Option<usize> {
    match name {
        "lmpop" | "sintercard" | "zmpop" | "zunion" | "zinter" | "zdiff" | "zintercard" => Some(1),
        "blmpop" | "bzmpop" | "zunionstore" | "zinterstore" | "zdiffstore" => Some(2),
        "eval" | "evalsha" | "eval_ro" | "evalsha_ro" => Some(2),
        _ => None,
    }
}

/// Every command, in one place: a command is known by where its spec stands
/// here ([`command_index`]), which per-command counters go by.
struct Catalog {
    specs: Vec<CommandSpec>,
    families: Vec<&'static str>,
    by_name: HashMap<&'static [u8], usize>,
    /// By index: where the command's keys may stand beyond its fixed ones.
    movable_keys: Vec<Option<MovableKeys>>,
}

fn catalog() -> &'static Catalog {
    static CATALOG: OnceLock<Catalog> = OnceLock::new();
    CATALOG.get_or_init(|| {
        let (families, specs): (Vec<&'static str>, Vec<CommandSpec>) = FAMILIES
            .into_iter()
            .flat_map(|(family, commands)| commands.iter().map(move |spec| (family, *spec)))
            .unzip();
        let by_name = specs.iter().enumerate().map(|(index, spec)| (spec.name.as_bytes(), index)).collect();
        let movable_keys = specs.iter().map(|spec| MovableKeys::of(spec.name)).collect();
        Catalog { specs, families, by_name, movable_keys }
    })
}

/// How many commands there are: [`command_index`] is below it.
pub fn command_count() -> usize {
    catalog().specs.len()
}

/// Where a command stands among all commands, for a spec found through
/// [`lookup`] or [`all_commands`] (every spec is the catalogue's).
pub fn command_index(spec: &CommandSpec) -> Option<usize> {
    let specs = &catalog().specs;
    let offset = (spec as *const CommandSpec as usize).checked_sub(specs.as_ptr() as usize)?;
    let index = offset / std::mem::size_of::<CommandSpec>();
    (index < specs.len() && std::ptr::eq(&specs[index], spec)).then_some(index)
}

/// The commands, by family: the family is a command's ACL category beside
/// those its flags give (`@string`, `@hash`, … as Redis names them).
const FAMILIES: [(&str, &[CommandSpec]); 17] = [
    ("connection", connection::COMMANDS),
    ("tessera", consistency::COMMANDS),
    ("cluster", cluster::COMMANDS),
    ("string", strings::COMMANDS),
    ("keyspace", keys::COMMANDS),
    ("hash", hashes::COMMANDS),
    ("list", lists::COMMANDS),
    ("set", sets::COMMANDS),
    ("sortedset", sorted_sets::COMMANDS),
    ("server", server::COMMANDS),
    ("server", introspection::COMMANDS),
    ("server", persistence::COMMANDS),
    ("transaction", transactions::COMMANDS),
    ("pubsub", pubsub::COMMANDS),
    ("scripting", scripting::COMMANDS),
    ("tessera", tables::COMMANDS),
    ("admin", acl::COMMANDS),
];

pub fn all_commands() -> impl Iterator<Item = &'static CommandSpec> {
    catalog().specs.iter()
}

/// Every command with its family.
pub fn commands_by_family() -> impl Iterator<Item = (&'static str, &'static CommandSpec)> {
    let catalog = catalog();
    catalog.families.iter().copied().zip(catalog.specs.iter())
}

/// Finds a command by name, in any letter case.
pub fn lookup(name: &[u8]) -> Option<&'static CommandSpec> {
    let mut lower = [0u8; 32];
    let lower = lower.get_mut(..name.len())?;
    for (target, byte) in lower.iter_mut().zip(name) {
        *target = byte.to_ascii_lowercase();
    }
    let catalog = catalog();
    catalog.by_name.get(&*lower).map(|index| &catalog.specs[*index])
}

/// Runs one request and writes its reply (or error) to `context.out`.
pub fn dispatch(context: &mut Context, request: &Request) {
    answer(context, |context| run(context, request));
}

/// Runs a request of `spec` that [`admit`] let through (a cluster node looks
/// it up and checks it before it places it) and writes its reply.
pub fn dispatch_admitted(context: &mut Context, spec: &CommandSpec, request: &Request) {
    answer(context, |context| execute(context, spec, request));
}

fn answer(context: &mut Context, run: impl FnOnce(&mut Context) -> CommandResult) {
    WorkerStats::add(&context.stats.commands, 1);
    let mark = context.out.len();
    if let Err(error) = run(context) {
        // A handler that failed half-way may have written part of a reply.
        context.out.truncate(mark);
        error.write(context.out);
    }
}

fn run(context: &mut Context, request: &Request) -> CommandResult {
    let spec = match check(context, request) {
        Ok(spec) => spec,
        Err(error) => {
            transactions::refuse(context);
            return Err(error);
        }
    };
    if transactions::queue(context, spec, request) {
        return Ok(());
    }
    execute(context, spec, request)
}

/// Looks a request's command up and checks that the connection may run it:
/// logged in, the right arity, [`admit`]ted.
fn check(context: &mut Context, request: &Request) -> CommandResult<&'static CommandSpec> {
    let name = request.arg(0);
    let Some(spec) = lookup(name) else {
        let arguments: Vec<String> =
            request.args().skip(1).take(8).map(|arg| format!("'{}'", String::from_utf8_lossy(arg))).collect();
        return Err(CommandError::UnknownCommand(
            String::from_utf8_lossy(&name[..name.len().min(128)]).into_owned(),
            arguments.join(" "),
        ));
    };
    let checked = if !context.session.authenticated && !spec.allowed_unauthenticated() {
        Err(CommandError::NoAuth)
    } else if !spec.arity_ok(request.len()) {
        Err(CommandError::WrongArity(spec.name.into()))
    } else {
        refuse_if_busy(context, spec).and_then(|()| admit(context, spec, request))
    };
    if checked.is_err() {
        count_rejected(context, spec);
    }
    checked.map(|()| spec)
}

/// A container command's subcommands, each with its arity (Redis's): what
/// the check on the way in and COMMAND INFO go by.
pub fn subcommands(name: &str) -> Option<&'static [(&'static str, i32)]> {
    Some(match name {
        "script" => scripting::SUBCOMMANDS,
        "object" => keys::OBJECT_SUBCOMMANDS,
        "config" => server::CONFIG_SUBCOMMANDS,
        "command" => server::COMMAND_SUBCOMMANDS,
        "slowlog" => introspection::SLOWLOG_SUBCOMMANDS,
        "latency" => introspection::LATENCY_SUBCOMMANDS,
        "memory" => introspection::MEMORY_SUBCOMMANDS,
        "client" => connection::CLIENT_SUBCOMMANDS,
        "pubsub" => pubsub::SUBCOMMANDS,
        "acl" => acl::SUBCOMMANDS,
        "cluster" => cluster::SUBCOMMANDS,
        _ => return None,
    })
}

/// A container command's subcommand: known, and of the right arity (COMMAND
/// alone is the whole table).
fn check_subcommand(spec: &CommandSpec, request: &Request) -> CommandResult {
    let Some(subcommands) = subcommands(spec.name).filter(|_| request.len() > 1) else { return Ok(()) };
    let name = String::from_utf8_lossy(request.arg(1)).to_ascii_lowercase();
    let Some(&(_, arity)) = subcommands.iter().find(|(known, _)| *known == name) else {
        return Err(CommandError::UnknownSubcommand(
            String::from_utf8_lossy(request.arg(1)).into_owned(),
            spec.name.to_ascii_uppercase(),
        ));
    };
    let count = request.len() as i32;
    if (arity >= 0 && count != arity) || (arity < 0 && count < -arity) {
        return Err(CommandError::WrongArity(format!("{}|{name}", spec.name)));
    }
    Ok(())
}

/// While a script runs past the busy threshold, a client may only stop it,
/// log in, or leave (Redis's commands allowed when busy).
pub fn refuse_if_busy(context: &Context, spec: &CommandSpec) -> CommandResult {
    let allowed =
        || matches!(spec.name, "script" | "auth" | "hello" | "quit" | "reset" | "multi" | "discard");
    if context.node.scripts.busy() && !allowed() {
        return Err(CommandError::Busy);
    }
    Ok(())
}

/// Runs an admitted request: room for what it may write, then its handler.
fn execute(context: &mut Context, spec: &CommandSpec, request: &Request) -> CommandResult {
    // A cluster node makes room where it places the command, in the shards
    // it may write ([`crate::cluster`]).
    if spec.flags.contains(&"denyoom") && context.cluster.is_none() {
        let tables = context.tables;
        context.node.make_room(|| tables.by_name(), 0)?;
    }
    // Every access is timed (OBJECT IDLETIME, LRU eviction) but OBJECT's own.
    if spec.name != "object" {
        for index in spec.key_positions(request.len(), |index| request.arg(index)) {
            context.node.access.touch(request.arg(index), context.now_ms);
        }
    }
    // A read of several keys sees all of a transaction's or a script's
    // writes or none of them, as in Redis: it holds the keys' locks, which a
    // writer holds while it writes. (A write locks what it writes itself, and
    // a script, which runs on a thread of its own, what it reads.)
    // The flags first: a write, the common case, counts no keys here.
    let keys =
        || spec.key_positions(request.len(), |index| request.arg(index)).map(|index| request.arg(index));
    let may_lock = spec.flags.contains(&"readonly") && !context.locks_held && !scripting::is_script(spec);
    let answer = if may_lock && keys().nth(1).is_some() {
        let _locks = context.node.lock_keys_unless_busy(keys())?;
        context.locks_held = true;
        let answer = (spec.handler)(context, request);
        context.locks_held = false;
        answer
    } else {
        (spec.handler)(context, request)
    };
    if answer.is_ok() && spec.flags.contains(&"write") {
        WorkerStats::add(&context.stats.writes, 1);
    }
    if let Some(index) = command_index(spec) {
        context.session.executed = Some(index);
        if let Some(counters) = context.stats.command(index) {
            WorkerStats::add(&counters.calls, 1);
            WorkerStats::add(&counters.failed, u64::from(answer.is_err()));
        }
    }
    if let Some(first) = keys().next() {
        let (stats, failed) = (context.stats, answer.is_err());
        let counted = context.cluster.and_then(|membership| {
            membership.agent.with_routing(|routing| stats.count_table(routing.table_of(first), failed))
        });
        if counted.is_none() {
            stats.count_table(&context.tables.route(first).def.name, failed);
        }
    }
    answer
}

/// A command of `spec` was refused before it ran.
pub fn count_rejected(context: &Context, spec: &CommandSpec) {
    if let Some(counters) = command_index(spec).and_then(|index| context.stats.command(index)) {
        WorkerStats::add(&counters.rejected, 1);
    }
}

/// Whether the connection may run a command of the right arity (which the
/// key positions rely on): its user's permissions, and no reserved keys. A
/// cluster node asks before it sends a request anywhere.
pub fn admit(context: &mut Context, spec: &CommandSpec, request: &Request) -> CommandResult {
    check_subcommand(spec, request)?;
    if pubsub::in_subscribed_mode(context) && !pubsub::allowed_while_subscribed(spec.name) {
        return Err(CommandError::Other(format!(
            "Can't execute '{}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context",
            spec.name
        )));
    }
    if !spec.allowed_unauthenticated() {
        check_permissions(context, spec, request)?;
    }
    match spec
        .key_positions(request.len(), |index| request.arg(index))
        .map(|index| request.arg(index))
        .find(|key| reserved::is_reserved(key))
    {
        Some(key) => {
            Err(CommandError::ReservedKey(String::from_utf8_lossy(&key[..key.len().min(64)]).into_owned()))
        }
        None => Ok(()),
    }
}

/// Whether the connection's user may run the command on its keys. The
/// user is looked up again after any ACL change. As in Redis, a user switched
/// off keeps the connections it has; a deleted user's are closed.
fn check_permissions(context: &mut Context, spec: &CommandSpec, request: &Request) -> CommandResult {
    if context.session.relay {
        return Ok(()); // its client was checked where it connected
    }
    let acl = &context.node.acl;
    let generation = acl.generation();
    let session = &mut *context.session;
    if session.permissions.as_ref().is_none_or(|permissions| permissions.generation != generation) {
        let Some(user) = acl.user(&session.user) else {
            session.authenticated = false;
            session.permissions = None;
            session.closing = true;
            return Err(CommandError::NoAuth);
        };
        let unrestricted = user.unrestricted(acl.catalog());
        session.permissions = Some(Permissions { generation, user, unrestricted });
    }
    let permissions = session.permissions.as_ref().expect("looked up above");
    if permissions.unrestricted {
        return Ok(());
    }
    if !permissions.user.may_run(spec.name) {
        return Err(CommandError::NoPermission(format!(
            "this user has no permissions to run the '{}' command",
            spec.name
        )));
    }
    let write = spec.flags.contains(&"write");
    if spec
        .key_positions(request.len(), |index| request.arg(index))
        .any(|index| !permissions.user.may_access(request.arg(index), write))
    {
        return Err(CommandError::NoPermission(
            "this user has no permissions to access one of the keys used as arguments".into(),
        ));
    }
    Ok(())
}

// ---- helpers shared by the command shards ----

/// The argument at `index` as an integer.
pub fn integer_arg(request: &Request, index: usize) -> CommandResult<i64> {
    Ok(parse_i64(request.arg(index))?)
}

/// Whether an argument equals an option name, ignoring case.
pub fn is(arg: &[u8], option: &str) -> bool {
    arg.eq_ignore_ascii_case(option.as_bytes())
}

/// A HELP subcommand's text, a line per simple string, as Redis sends it.
pub fn write_help(context: &mut Context, lines: &[&str]) {
    context.out.array(lines.len());
    lines.iter().for_each(|line| context.out.simple(line));
}

/// A wrong-arity error for the command being run.
pub fn wrong_arity(request: &Request) -> CommandError {
    CommandError::WrongArity(String::from_utf8_lossy(request.arg(0)).to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_flagged_with_movable_keys_have_them_looked_for() {
        // SORT_RO never stores; CONSISTENCY.READ takes the keys of the read it wraps.
        let beside_flags = ["sort_ro", "consistency.read"];
        for spec in all_commands().filter(|spec| spec.flags.contains(&"movablekeys")) {
            assert!(spec.movable_keys().is_some() || beside_flags.contains(&spec.name), "{}", spec.name);
        }
        let memory = lookup(b"memory").unwrap();
        let usage: [&[u8]; 3] = [b"memory", b"usage", b"k"];
        assert_eq!(memory.key_positions(3, |index| usage[index]).collect::<Vec<_>>(), vec![2]);
        assert_eq!(lookup(b"get").unwrap().movable_keys(), None);
    }

    #[test]
    fn every_command_is_registered_once_in_lower_case() {
        let mut names: Vec<_> = all_commands().map(|spec| spec.name).collect();
        assert!(names.iter().all(|name| *name == name.to_ascii_lowercase()));
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count, "a command is registered twice");
        assert_eq!(catalog().by_name.len(), count);
        for (index, spec) in all_commands().enumerate() {
            assert_eq!(command_index(spec), Some(index), "{}", spec.name);
            assert_eq!(lookup(spec.name.as_bytes()).and_then(command_index), Some(index));
        }
        let copy = *lookup(b"get").expect("served");
        assert_eq!(command_index(&copy), None, "a spec from outside the catalogue has no index");
    }

    #[test]
    fn lookup_ignores_case_and_rejects_long_names() {
        assert_eq!(lookup(b"GeT").map(|spec| spec.name), Some("get"));
        assert!(lookup(&[b'a'; 100]).is_none());
    }

    #[test]
    fn a_consistency_read_has_the_keys_of_the_read_it_wraps() {
        let keys = |args: &[&[u8]]| -> Vec<usize> {
            lookup(args[0]).expect("served").key_positions(args.len(), |index| args[index]).collect()
        };
        assert_eq!(keys(&[b"consistency.read", b"eventual", b"get", b"k"]), [3]);
        assert_eq!(keys(&[b"CONSISTENCY.READ", b"strong", b"MGET", b"a", b"b"]), [3, 4]);
        assert_eq!(keys(&[b"consistency.read", b"strong", b"zunion", b"2", b"a", b"b"]), [4, 5]);
        assert!(
            keys(&[b"consistency.read", b"strong", b"consistency.read", b"strong", b"get", b"k"]).is_empty()
        );
        assert!(keys(&[b"consistency.read", b"strong", b"nothing", b"k"]).is_empty());
        assert!(keys(&[b"consistency.read", b"strong"]).is_empty());
        assert!(keys(&[b"consistency.read", b"strong", b"get"]).is_empty(), "a read short of its key");
        assert!(keys(&[b"consistency.read", b"strong", b"hget", b"h"]).is_empty());
    }
}
