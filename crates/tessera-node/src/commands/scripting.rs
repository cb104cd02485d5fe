//! EVAL, EVALSHA, their read-only forms and SCRIPT: Lua 5.1 scripts with
//! Redis's API, run atomically (docs/ARCHITECTURE.md, "Scripts").
//!
//! A script runs on a script thread ([`crate::scripts`]) while its
//! connection waits, or in place where the caller already holds the keys'
//! locks (inside EXEC). Each thread has its own Lua state: the sandbox and
//! `redis` API built once, the functions compiled from script bodies kept
//! by SHA-1 until SCRIPT FLUSH. A script's commands run through the same
//! handlers as a client's, on a reply writer of their own whose replies
//! are read back into Lua values.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use mlua::{Function, HookTriggers, Lua, LuaOptions, MultiValue, StdLib, Table, Value, VmState};
use parking_lot::MutexGuard;
use tessera_cluster::agent::Completion;
use tessera_engine::Engine;
use tessera_wire::slot::key_slot;
use tessera_wire::{parse_value, Protocol, ReplyWriter, Request, Value as Reply};
use tokio::sync::oneshot;

use super::{admit, answer, execute, lookup, CommandSpec, Context, Scope, Session};
use crate::error::{CommandError, CommandResult};
use crate::lua_libs;
use crate::membership::Membership;
use crate::node_state::{NodeState, WorkerStats};
use crate::scripts::{Kill, Running, Script};
use crate::tables::TableSet;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "eval", arity: -3, flags: &["write", "noscript", "stale", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: eval },
    CommandSpec { name: "evalsha", arity: -3, flags: &["write", "noscript", "stale", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: evalsha },
    CommandSpec { name: "eval_ro", arity: -3, flags: &["readonly", "noscript", "stale", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: eval_ro },
    CommandSpec { name: "evalsha_ro", arity: -3, flags: &["readonly", "noscript", "stale", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: evalsha_ro },
    CommandSpec { name: "script", arity: -2, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: script },
];

/// SCRIPT's subcommands and their arities (Redis's convention), checked
/// before the command runs or is queued, as Redis checks them.
pub const SUBCOMMANDS: &[(&str, i32)] =
    &[("load", 3), ("exists", -3), ("flush", -2), ("kill", 2), ("help", 2)];

/// Instructions between two looks at whether the script was killed.
const KILL_CHECK_INSTRUCTIONS: u32 = 10_000;
/// How long a script waits for the lock of a key it did not declare, when
/// taking it in order is impossible (it holds a later stripe already).
const UNDECLARED_KEY_PATIENCE: Duration = Duration::from_millis(500);
/// Memory one thread's Lua state may use.
const LUA_MEMORY_MAX: usize = 1 << 30;
/// Nesting a script's reply may have (Redis stops at Lua's stack limit).
const REPLY_DEPTH_MAX: usize = 1000;

/// A script's reply, written for its client, and the writes it waits for
/// (in a cluster, those it handed to replication).
#[derive(Debug)]
pub struct ScriptOutcome {
    pub reply: Vec<u8>,
    pub waits: Vec<Completion>,
    /// In a cluster: the shard the script wrote and where its writes stand.
    pub written: Option<(u32, tessera_protocol::WritePosition)>,
}

/// Whether a command is one of the scripting commands (a cluster node runs
/// them on a script thread).
pub fn is_script(spec: &CommandSpec) -> bool {
    matches!(spec.name, "eval" | "evalsha" | "eval_ro" | "evalsha_ro")
}

fn eval(context: &mut Context, request: &Request) -> CommandResult {
    start(context, request, false, false)
}

fn evalsha(context: &mut Context, request: &Request) -> CommandResult {
    start(context, request, true, false)
}

fn eval_ro(context: &mut Context, request: &Request) -> CommandResult {
    start(context, request, false, true)
}

fn evalsha_ro(context: &mut Context, request: &Request) -> CommandResult {
    start(context, request, true, true)
}

/// A script call, parsed: everything a script thread needs.
pub struct Call {
    pub script: Arc<Script>,
    pub keys: Vec<Bytes>,
    pub args: Vec<Bytes>,
    pub read_only: bool,
    /// Which keys its commands may name.
    rule: KeyRule,
}

impl Call {
    /// Parses EVAL's arguments and finds (EVAL: compiles and caches) the script.
    pub fn parse(context: &Context, request: &Request, by_sha: bool, read_only: bool) -> CommandResult<Self> {
        let node = context.node;
        if by_sha && request.arg(1).len() != 40 {
            return Err(CommandError::NoScript); // before the count, as in Redis
        }
        let count = super::integer_arg(request, 2)?;
        if count < 0 {
            return Err(CommandError::Other("Number of keys can't be negative".into()));
        }
        if count as usize > request.len() - 3 {
            return Err(CommandError::Other("Number of keys can't be greater than number of args".into()));
        }
        let script = if by_sha {
            node.scripts.get(request.arg(1)).ok_or(CommandError::NoScript)?
        } else {
            match node.scripts.get(crate::scripts::sha1_hex(request.arg(1)).as_bytes()) {
                Some(script) => script,
                None => load(node, request.arg(1), false)?,
            }
        };
        let args: Vec<Bytes> = request.args().skip(3).map(Bytes::copy_from_slice).collect();
        let keys = args[..count as usize].to_vec();
        let args = args[count as usize..].to_vec();
        let read_only = read_only || script.flags.no_writes;
        let cluster = context.cluster.is_some();
        if cluster && script.flags.no_cluster {
            return Err(CommandError::Other(
                "Can not run script on cluster, 'no-cluster' flag is set.".into(),
            ));
        }
        // In a cluster a script with keys runs on their slot's shard; one
        // without runs on no shard.
        let rule = match keys.first() {
            _ if !cluster => KeyRule::Any,
            Some(key) => {
                KeyRule::Slot { slot: key_slot(key), cross_slot: script.flags.allow_cross_slot_keys }
            }
            None => KeyRule::None,
        };
        Ok(Self { script, keys, args, read_only, rule })
    }
}

/// Compiles a script (on this thread's Lua state) and caches it.
fn load(node: &NodeState, body: &[u8], by_script_load: bool) -> CommandResult<Arc<Script>> {
    let (_, lua_start) = crate::scripts::ScriptFlags::parse(body)?;
    with_vm(node, |vm| compile(&vm.lua, &body[lua_start..]).map(drop))?;
    node.scripts.add(body, by_script_load)
}

/// A script body as a function, or Redis's compile error.
fn compile(lua: &Lua, lua_code: &[u8]) -> CommandResult<Function> {
    lua.load(lua_code).set_name("@user_script").into_function().map_err(|error| {
        let message = match error {
            mlua::Error::SyntaxError { message, .. } => message,
            other => other.to_string(),
        };
        CommandError::Other(format!("Error compiling script (new function): {message}"))
    })
}

fn start(context: &mut Context, request: &Request, by_sha: bool, read_only: bool) -> CommandResult {
    let call = Call::parse(context, request, by_sha, read_only)?;
    if context.locks_held || context.engine_override.is_some() {
        // Inside EXEC, or on a view only this call may use: here and now.
        return run(context, &call);
    }
    spawn(context, move |mut detached| ScriptOutcome {
        written: None,
        reply: detached.run(None, false, |context| answer_run(context, &call)),
        waits: Vec::new(),
    });
    Ok(())
}

/// Runs a script and writes its reply or its error.
pub fn answer_run(context: &mut Context, call: &Call) {
    answer(context, |context| run(context, call));
}

/// What a script thread takes of the client's context: its own copies.
pub struct Detached {
    pub node: Arc<NodeState>,
    tables: Arc<TableSet>,
    stats: Arc<WorkerStats>,
    pub cluster: Option<Membership>,
    session: Session,
    protocol: Protocol,
    now_ms: u64,
}

impl Detached {
    /// Runs `work` over a context whose engine is `engine_override` (with
    /// the keys' locks held by the caller when `locks_held`); returns the
    /// reply it wrote.
    pub fn run(
        &mut self,
        engine_override: Option<&dyn Engine>,
        locks_held: bool,
        work: impl FnOnce(&mut Context),
    ) -> Vec<u8> {
        let mut out = ReplyWriter::new(self.protocol);
        work(&mut Context {
            node: &self.node,
            tables: &self.tables,
            session: &mut self.session,
            out: &mut out,
            stats: &self.stats,
            cluster: self.cluster.as_ref(),
            now_ms: self.now_ms,
            engine_override,
            locks_held,
        });
        out.as_bytes().to_vec()
    }
}

/// Runs `job` on a script thread over a copy of the client's context; the
/// connection waits for what it answers (`Session::script`).
pub fn spawn(context: &mut Context, job: impl FnOnce(Detached) -> ScriptOutcome + Send + 'static) {
    context.session.script = Some(detach(context, job));
}

/// Runs `job` on a script thread over a copy of the client's context, for
/// a caller that awaits what it answers.
pub fn detach<T: Send + 'static>(
    context: &mut Context,
    job: impl FnOnce(Detached) -> T + Send + 'static,
) -> oneshot::Receiver<T> {
    let detached = Detached {
        node: context.node.clone(),
        tables: context.tables.clone(),
        stats: context.stats.clone(),
        cluster: context.cluster.cloned(),
        session: context.session.for_script(),
        protocol: context.out.protocol(),
        now_ms: context.now_ms,
    };
    let (sender, receiver) = oneshot::channel();
    context.node.scripts.spawn(move || {
        let _ = sender.send(job(detached));
    });
    receiver
}

/// Which keys a script's commands may name.
#[derive(Clone, Copy, Debug)]
enum KeyRule {
    /// A node by itself: any key.
    Any,
    /// A cluster node, running on the shard of the declared keys' slot.
    Slot { slot: usize, cross_slot: bool },
    /// A cluster node, the script declared no keys: none.
    None,
}

impl KeyRule {
    fn check(self, key: &[u8]) -> Result<(), String> {
        match self {
            KeyRule::Any => Ok(()),
            KeyRule::Slot { slot, cross_slot } if key_slot(key) != slot && !cross_slot => {
                Err("ERR Script attempted to access keys that do not hash to the same slot".into())
            }
            KeyRule::Slot { slot, .. } if key_slot(key) != slot => {
                Err("ERR Script attempted to access a non local key in a cluster node".into())
            }
            KeyRule::Slot { .. } => Ok(()),
            KeyRule::None => Err("ERR Script attempted to access a non local key in a cluster node".into()),
        }
    }
}

/// The key locks a running script holds: those of its declared keys from
/// the start, then each further key's as it touches it (two-phase locking).
struct ScriptLocks<'a> {
    node: &'a NodeState,
    /// By stripe; None where the caller holds the lock.
    held: BTreeMap<usize, Option<MutexGuard<'a, ()>>>,
}

impl<'a> ScriptLocks<'a> {
    fn new(node: &'a NodeState, keys: &[Bytes], caller_holds: bool) -> Self {
        let mut held = BTreeMap::new();
        let mut stripes: Vec<usize> = keys.iter().map(|key| NodeState::stripe_index(key)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        for stripe in stripes {
            held.insert(stripe, (!caller_holds).then(|| node.lock_stripe(stripe)));
        }
        Self { node, held }
    }

    /// Holds a stripe's lock: waiting for it when it comes after every one
    /// held (the order every lock taker keeps), else only trying for a while.
    fn hold(&mut self, stripe: usize) -> Result<(), String> {
        if self.held.contains_key(&stripe) {
            return Ok(());
        }
        let in_order = self.held.last_key_value().is_none_or(|(&last, _)| stripe > last);
        let guard = if in_order {
            self.node.lock_stripe(stripe)
        } else {
            self.node.try_lock_stripe(stripe, UNDECLARED_KEY_PATIENCE).ok_or_else(|| {
                "ERR Script attempted to access a key it did not declare while another client held it: \
                 pass every key the script uses in KEYS"
                    .to_string()
            })?
        };
        self.held.insert(stripe, Some(guard));
        Ok(())
    }
}

/// What `redis.call` works with while a script runs.
struct ScriptState<'c, 'a> {
    context: &'c mut Context<'a>,
    locks: ScriptLocks<'a>,
    rule: KeyRule,
    read_only: bool,
    running: Arc<Running>,
    /// RESP3 after `redis.setresp(3)`.
    resp3: bool,
}

/// Runs a script and writes its reply to `context.out`.
pub fn run(context: &mut Context, call: &Call) -> CommandResult {
    let node = context.node;
    let guard = node.scripts.start();
    let locks = ScriptLocks::new(node, &call.keys, context.locks_held);
    let running = guard.running.clone();
    let reply = with_vm(node, |vm| {
        let function = vm.function(&call.script)?;
        vm.lua.set_app_data(running.clone());
        let state = RefCell::new(ScriptState {
            context: &mut *context,
            locks,
            rule: call.rule,
            read_only: call.read_only,
            running: running.clone(),
            resp3: false,
        });
        let outcome = vm.lua.scope(|scope| {
            let redis_call = scope.create_function(|lua, args: MultiValue| {
                call_command(lua, &mut state.borrow_mut(), args)
                    .map_err(|message| mlua::Error::external(CommandFailed(message)))
            })?;
            let redis_pcall = scope.create_function(|lua, args: MultiValue| {
                match call_command(lua, &mut state.borrow_mut(), args) {
                    Ok(value) => Ok(value),
                    Err(message) => error_table(lua, &message),
                }
            })?;
            let set_resp = scope.create_function(|_, args: MultiValue| {
                let failed = |message: &str| mlua::Error::external(CommandFailed(message.into()));
                if args.len() != 1 {
                    return Err(failed("redis.setresp() requires one argument."));
                }
                match &args[0] {
                    Value::Integer(2) => state.borrow_mut().resp3 = false,
                    Value::Integer(3) => state.borrow_mut().resp3 = true,
                    Value::Number(version) if *version == 2.0 || *version == 3.0 => {
                        state.borrow_mut().resp3 = *version == 3.0
                    }
                    _ => return Err(failed("RESP version must be 2 or 3.")),
                }
                Ok(())
            })?;
            vm.redis.raw_set("call", redis_call)?;
            vm.redis.raw_set("pcall", redis_pcall)?;
            vm.redis.raw_set("setresp", set_resp)?;
            let keys = vm.lua.create_sequence_from(
                call.keys.iter().map(|key| vm.lua.create_string(key)).collect::<mlua::Result<Vec<_>>>()?,
            )?;
            let args = vm.lua.create_sequence_from(
                call.args.iter().map(|arg| vm.lua.create_string(arg)).collect::<mlua::Result<Vec<_>>>()?,
            )?;
            let (ok, value): (bool, Value) = vm.runner.call((function, keys, args))?;
            let resp3 = state.borrow().resp3;
            Ok(if ok { Ok(lua_to_reply(&value, resp3, 0)) } else { Err(value) })
        });
        vm.lua.remove_app_data::<Arc<Running>>();
        let outcome =
            outcome.map_err(|error| CommandError::Other(format!("Error running script: {error}")))?;
        match outcome {
            Ok(Some(reply)) => Ok(reply),
            Ok(None) => Err(CommandError::Other("reached lua stack limit".into())),
            Err(error) => Err(script_error(&error, &call.script.sha, &running)),
        }
    })?;
    drop(guard);
    write_value(context.out, &reply);
    Ok(())
}

/// The error a failed script answers: its message, then where it failed,
/// as Redis words it.
fn script_error(error: &Value, sha: &str, running: &Running) -> CommandError {
    let (message, source, line) = match error {
        Value::Table(table) => (
            table
                .raw_get::<Option<String>>("err")
                .ok()
                .flatten()
                .unwrap_or_else(|| "ERR unknown error".into()),
            table.raw_get::<Option<String>>("source").ok().flatten(),
            table.raw_get::<Option<i64>>("line").ok().flatten(),
        ),
        Value::String(text) => (format!("ERR {}", text.to_string_lossy()), None, None),
        other => (format!("ERR {other:?}"), None, None),
    };
    let message =
        if running.killed() { "ERR Script killed by user with SCRIPT KILL...".to_string() } else { message };
    let message = match (source, line) {
        (Some(source), Some(line)) => format!("{message} script: {sha}, on {source}:{line}."),
        _ => format!("{message} script: {sha}."),
    };
    CommandError::Relayed(message)
}

/// `{err = message}`, what `redis.call` raises and `redis.pcall` returns.
fn error_table(lua: &Lua, message: &str) -> mlua::Result<Value> {
    let table = lua.create_table()?;
    table.raw_set("err", message)?;
    Ok(Value::Table(table))
}

/// `redis.call`'s work: runs one command for the script and returns its
/// reply as a Lua value; Err is the error line (code first) it answered.
fn call_command(lua: &Lua, state: &mut ScriptState, args: MultiValue) -> Result<Value, String> {
    if args.is_empty() {
        return Err("ERR Please specify at least one argument for this redis lib call".into());
    }
    let mut bytes = Vec::new();
    let mut ranges = Vec::with_capacity(args.len());
    for arg in &args {
        let text = match arg {
            Value::String(text) => text.as_bytes().to_vec(),
            Value::Integer(_) | Value::Number(_) => match lua.coerce_string(arg.clone()) {
                Ok(Some(text)) => text.as_bytes().to_vec(),
                _ => return Err("ERR Lua redis lib command arguments must be strings or integers".into()),
            },
            _ => return Err("ERR Lua redis lib command arguments must be strings or integers".into()),
        };
        ranges.push(bytes.len()..bytes.len() + text.len());
        bytes.extend_from_slice(&text);
    }
    let request = Request::new(&bytes, &ranges);
    let Some(spec) = lookup(request.arg(0)) else {
        return Err("ERR Unknown Redis command called from script".into());
    };
    if !spec.arity_ok(request.len()) {
        return Err("ERR Wrong number of args calling Redis command from script".into());
    }
    if !allowed_in_script(spec, state.context.cluster.is_some()) {
        return Err("ERR This Redis command is not allowed from script".into());
    }
    let write = spec.flags.contains(&"write");
    if write && state.read_only {
        return Err("ERR Write commands are not allowed from read-only scripts.".into());
    }
    admit(state.context, spec, &request).map_err(|error| error.to_string())?;
    let stripes: Vec<usize> = if spec.scope == Scope::Flush {
        (0..NodeState::STRIPES).collect()
    } else {
        let mut stripes = Vec::new();
        for index in spec.key_positions(request.len(), |index| request.arg(index)) {
            state.rule.check(request.arg(index))?;
            stripes.push(NodeState::stripe_index(request.arg(index)));
        }
        stripes
    };
    for stripe in stripes {
        state.locks.hold(stripe)?;
    }
    if write {
        state.running.note_write();
    }
    let protocol = if state.resp3 { Protocol::Resp3 } else { Protocol::Resp2 };
    let mut out = ReplyWriter::new(protocol);
    {
        let context = &mut *state.context;
        let mut inner = Context {
            node: context.node,
            tables: context.tables,
            session: &mut *context.session,
            out: &mut out,
            stats: context.stats,
            cluster: context.cluster,
            now_ms: context.now_ms,
            engine_override: context.engine_override,
            locks_held: true,
        };
        answer(&mut inner, |inner| execute(inner, spec, &request));
        if inner.session.blocked.take().is_some() {
            // A blocking command in a script does not wait, as in Redis.
            inner.out.null_array();
        }
    }
    let reply = match parse_value(out.as_bytes()) {
        Ok(Some((reply, _))) => reply,
        _ => return Err("ERR the command's reply could not be read".into()),
    };
    if let Reply::Error(message) = &reply {
        return Err(message.clone());
    }
    reply_to_lua(lua, reply, state.resp3).map_err(|error| format!("ERR {error}"))
}

/// Whether a script may run a command: not one Redis forbids in scripts
/// (`noscript`), nor, on a cluster node, one that spans the cluster.
fn allowed_in_script(spec: &CommandSpec, cluster: bool) -> bool {
    if spec.flags.contains(&"noscript") || matches!(spec.name, "publish" | "spublish" | "pubsub") && cluster {
        return false;
    }
    match spec.scope {
        Scope::Keys => true,
        Scope::NodeWide | Scope::Flush => !cluster,
        _ => false,
    }
}

/// A command's reply as a script sees it (Redis's conversion, RESP2 or 3).
fn reply_to_lua(lua: &Lua, reply: Reply, resp3: bool) -> mlua::Result<Value> {
    let wrap = |field: &str, value: Value| -> mlua::Result<Value> {
        let table = lua.create_table()?;
        table.raw_set(field, value)?;
        Ok(Value::Table(table))
    };
    Ok(match reply {
        Reply::Integer(number) => Value::Number(number as f64),
        Reply::Bulk(bytes) => Value::String(lua.create_string(&bytes)?),
        Reply::Simple(text) => wrap("ok", Value::String(lua.create_string(&text)?))?,
        Reply::Error(text) => wrap("err", Value::String(lua.create_string(&text)?))?,
        Reply::Null if resp3 => Value::Nil,
        Reply::Null => Value::Boolean(false),
        Reply::Array(items) | Reply::Push(items) => {
            let table = lua.create_table_with_capacity(items.len(), 0)?;
            for (index, item) in items.into_iter().enumerate() {
                table.raw_set(index + 1, reply_to_lua(lua, item, resp3)?)?;
            }
            Value::Table(table)
        }
        Reply::Map(pairs) => {
            let map = lua.create_table()?;
            for (key, value) in pairs {
                map.raw_set(reply_to_lua(lua, key, resp3)?, reply_to_lua(lua, value, resp3)?)?;
            }
            wrap("map", Value::Table(map))?
        }
        Reply::Set(items) => {
            let set = lua.create_table()?;
            for item in items {
                set.raw_set(reply_to_lua(lua, item, resp3)?, true)?;
            }
            wrap("set", Value::Table(set))?
        }
        Reply::Double(number) => wrap("double", Value::Number(number))?,
        Reply::Boolean(flag) => Value::Boolean(flag),
        Reply::BigNumber(text) => wrap("big_number", Value::String(lua.create_string(&text)?))?,
    })
}

/// A script's result as a reply (Redis's conversion). Tables become
/// arrays up to their first nil; `err`, `ok` and, after setresp(3),
/// `map`, `set`, `double` and `big_number` tables their types. None: nested
/// deeper than a reply may be (a table that holds itself, say).
fn lua_to_reply(value: &Value, resp3: bool, depth: usize) -> Option<Reply> {
    if depth > REPLY_DEPTH_MAX {
        return None;
    }
    let nested = |value: &Value| lua_to_reply(value, resp3, depth + 1);
    Some(match value {
        Value::String(text) => Reply::Bulk(Bytes::copy_from_slice(&text.as_bytes())),
        Value::Integer(number) => Reply::Integer(*number),
        // C's conversion on x86-64: out of range (and NaN) is i64::MIN.
        Value::Number(number) if number.is_finite() && number.abs() < 9.2e18 => {
            Reply::Integer(*number as i64)
        }
        Value::Number(_) => Reply::Integer(i64::MIN),
        Value::Boolean(true) => Reply::Integer(1),
        Value::Boolean(false) if resp3 => Reply::Boolean(false),
        Value::Table(table) => {
            let field = |name: &str| table.raw_get::<Value>(name).unwrap_or(Value::Nil);
            match (
                field("err"),
                field("ok"),
                field("double"),
                field("big_number"),
                field("map"),
                field("set"),
            ) {
                (Value::String(text), ..) => Reply::Error(text.to_string_lossy()),
                (_, Value::String(text), ..) => Reply::Simple(text.to_string_lossy()),
                (_, _, Value::Number(number), ..) => Reply::Double(number),
                (_, _, Value::Integer(number), ..) => Reply::Double(number as f64),
                (_, _, _, Value::String(text), ..) => Reply::BigNumber(text.to_string_lossy()),
                (_, _, _, _, Value::Table(map), _) => Reply::Map(
                    map.pairs::<Value, Value>()
                        .filter_map(Result::ok)
                        .map(|(key, value)| Some((nested(&key)?, nested(&value)?)))
                        .collect::<Option<_>>()?,
                ),
                (_, _, _, _, _, Value::Table(set)) => Reply::Set(
                    set.pairs::<Value, Value>()
                        .filter_map(Result::ok)
                        .map(|(member, _)| nested(&member))
                        .collect::<Option<_>>()?,
                ),
                _ => {
                    let mut items = Vec::new();
                    for index in 1.. {
                        match table.raw_get::<Value>(index) {
                            Ok(Value::Nil) | Err(_) => break,
                            Ok(item) => items.push(nested(&item)?),
                        }
                    }
                    Reply::Array(items)
                }
            }
        }
        _ => Reply::Null,
    })
}

fn write_value(out: &mut ReplyWriter, reply: &Reply) {
    match reply {
        Reply::Simple(text) => out.simple(text),
        Reply::Error(text) => out.error(text),
        Reply::Integer(number) => out.integer(*number),
        Reply::Bulk(bytes) => out.bulk(bytes),
        Reply::Array(items) | Reply::Push(items) => {
            out.array(items.len());
            items.iter().for_each(|item| write_value(out, item));
        }
        Reply::Map(pairs) => {
            out.map(pairs.len());
            for (key, value) in pairs {
                write_value(out, key);
                write_value(out, value);
            }
        }
        Reply::Set(items) => {
            out.set(items.len());
            items.iter().for_each(|item| write_value(out, item));
        }
        Reply::Double(number) => out.double(*number),
        Reply::Boolean(flag) => out.boolean(*flag),
        Reply::BigNumber(text) => out.bulk(text.as_bytes()),
        Reply::Null => out.null(),
    }
}

fn script(context: &mut Context, request: &Request) -> CommandResult {
    // The subcommand and its arity were checked on the way in (SUBCOMMANDS).
    let subcommand = String::from_utf8_lossy(request.arg(1)).to_ascii_lowercase();
    let scripts = &context.node.scripts;
    match subcommand.as_str() {
        "load" => {
            let script = load(context.node, request.arg(2), true)?;
            context.out.bulk(script.sha.as_bytes());
        }
        "exists" => {
            context.out.array(request.len() - 2);
            for sha in request.args().skip(2) {
                context.out.integer(i64::from(scripts.get(sha).is_some()));
            }
        }
        "flush" => {
            if request.len() > 3
                || request.len() == 3
                    && !super::is(request.arg(2), "sync")
                    && !super::is(request.arg(2), "async")
            {
                return Err(CommandError::Other("SCRIPT FLUSH only support SYNC|ASYNC option".into()));
            }
            scripts.flush();
            context.out.ok();
        }
        "kill" => match scripts.kill() {
            Kill::Killed => context.out.ok(),
            Kill::NotBusy => {
                return Err(CommandError::Relayed("NOTBUSY No scripts in execution right now.".into()))
            }
            Kill::Unkillable => {
                return Err(CommandError::Relayed(
                    "UNKILLABLE Sorry the script already executed write commands against the dataset. \
                     You can either wait the script termination or kill the server in a hard way using \
                     the SHUTDOWN NOSAVE command."
                        .into(),
                ))
            }
        },
        _ => {
            let lines = [
                "SCRIPT <subcommand>, where <subcommand> is one of:",
                "EXISTS <sha1> [<sha1> ...] -- 1 for each script the cache holds, else 0",
                "FLUSH [ASYNC|SYNC] -- forget every cached script",
                "KILL -- stop the running scripts that have not written",
                "LOAD <script> -- compile and cache a script, answering its SHA-1",
                "HELP -- this text",
            ];
            super::write_help(context, &lines);
        }
    }
    Ok(())
}

impl Session {
    /// The session a script's commands run in: the client's identity and
    /// permissions, nothing of its transaction or subscriptions.
    pub fn for_script(&self) -> Session {
        Session {
            id: self.id,
            name: self.name.clone(),
            authenticated: self.authenticated,
            user: self.user.clone(),
            permissions: self.permissions.clone(),
            library_name: self.library_name.clone(),
            library_version: self.library_version.clone(),
            cluster_client: self.cluster_client,
            readonly: self.readonly,
            relay: self.relay,
            tls: self.tls,
            ..Session::default()
        }
    }
}

/// One thread's Lua state.
struct Vm {
    lua: Lua,
    /// The cache generation `functions` are from.
    generation: u64,
    functions: HashMap<String, Function>,
    /// The `redis` table behind the read-only one scripts see: `call`,
    /// `pcall` and `setresp` are set in it anew for each run.
    redis: Table,
    /// Runs a compiled script with its KEYS and ARGV in globals of its own:
    /// `(ok, result or error table)`.
    runner: Function,
}

thread_local! {
    static VM: RefCell<Option<Vm>> = const { RefCell::new(None) };
}

/// Runs `work` with this thread's Lua state, built on first use.
fn with_vm<T>(node: &NodeState, work: impl FnOnce(&mut Vm) -> CommandResult<T>) -> CommandResult<T> {
    VM.with(|cell| {
        let mut slot =
            cell.try_borrow_mut().map_err(|_| CommandError::Other("scripts cannot nest".into()))?;
        if slot.is_none() {
            *slot =
                Some(Vm::new().map_err(|error| CommandError::Other(format!("cannot start Lua: {error}")))?);
        }
        let vm = slot.as_mut().expect("built above");
        let generation = node.scripts.generation();
        if vm.generation != generation {
            vm.functions.clear();
            vm.generation = generation;
        }
        work(vm)
    })
}

/// The sandbox and `redis` API, in Lua: built once per state. Globals
/// scripts see are read-only and reading an unknown one is an error; each
/// run gets globals of its own (KEYS, ARGV, `_G`) that read through to the
/// libraries.
const PRELUDE: &str = r#"
local redis, handler, message_of = ...
local error, setmetatable, setfenv, getfenv, pcall, xpcall, rawset, type =
      error, setmetatable, setfenv, getfenv, pcall, xpcall, rawset, type
local loadstring = loadstring
local readonly = setmetatable({}, {__mode = 'k'})
local function refuse() error('Attempt to modify a readonly table', 2) end
local function protect(library)
  local proxy = setmetatable({}, {__index = library, __newindex = refuse, __metatable = false})
  readonly[proxy] = true
  return proxy
end
local visible = {}
for _, name in ipairs({'assert', 'collectgarbage', 'error', 'gcinfo', 'getmetatable', 'ipairs', 'next',
                       'pairs', 'rawequal', 'rawget', 'select', 'setmetatable', 'tonumber', 'tostring',
                       'type', 'unpack', 'xpcall', '_VERSION'}) do
  visible[name] = _G[name]
end
visible.rawset = function(t, k, v)
  if readonly[t] then error('Attempt to modify a readonly table', 0) end
  return rawset(t, k, v)
end
-- As Redis's: an error a command or a library raised comes back as its message.
visible.pcall = function(f, ...)
  local function relay(ok, ...)
    if ok then return true, ... end
    local failure = ...
    if type(failure) == 'table' and type(failure.err) == 'string' then return false, failure.err end
    if type(failure) == 'userdata' then return false, message_of(failure) end
    return false, ...
  end
  return relay(pcall(f, ...))
end
-- Code a script loads runs in the script's globals.
visible.loadstring = function(code, name)
  local f, message = loadstring(code, name)
  if f then setfenv(f, getfenv(2)) end
  return f, message
end
visible.load = visible.loadstring
for _, name in ipairs({'string', 'table', 'math', 'coroutine', 'cjson', 'bit'}) do
  visible[name] = protect(_G[name])
end
function redis.error_reply(message)
  if type(message) ~= 'string' then error('wrong number or type of arguments', 2) end
  if message:sub(1, 1) == '-' then message = message:sub(2) end
  return {err = message}
end
function redis.status_reply(message)
  if type(message) ~= 'string' then error('wrong number or type of arguments', 2) end
  return {ok = message}
end
function redis.set_repl() end
function redis.replicate_commands() return true end
function redis.breakpoint() return false end
function redis.debug() end
visible.redis = protect(redis)
local globals = {
  __index = function(_, name)
    local value = visible[name]
    if value == nil then
      error("Script attempted to access nonexistent global variable '" .. tostring(name) .. "'", 2)
    end
    return value
  end,
  __newindex = refuse,
  __metatable = false,
}
return function(f, keys, argv)
  local env = {KEYS = keys, ARGV = argv}
  env._G = env
  readonly[env] = true
  setmetatable(env, globals)
  setfenv(f, env)
  return xpcall(f, handler)
end
"#;

impl Vm {
    fn new() -> mlua::Result<Self> {
        let lua = Lua::new_with(StdLib::TABLE | StdLib::STRING | StdLib::MATH, LuaOptions::default())?;
        lua.set_memory_limit(LUA_MEMORY_MAX)?;
        let globals = lua.globals();
        globals.set("cjson", lua_libs::cjson(&lua)?)?;
        globals.set("bit", lua_libs::bit(&lua)?)?;
        let redis = lua.create_table()?;
        for (name, value) in
            [("LOG_DEBUG", 0), ("LOG_VERBOSE", 1), ("LOG_NOTICE", 2), ("LOG_WARNING", 3)].into_iter().chain([
                ("REPL_NONE", 0),
                ("REPL_AOF", 1),
                ("REPL_SLAVE", 2),
                ("REPL_REPLICA", 2),
                ("REPL_ALL", 3),
            ])
        {
            redis.raw_set(name, value)?;
        }
        redis.raw_set("REDIS_VERSION", crate::REDIS_COMPATIBLE_VERSION)?;
        let version_number = crate::REDIS_COMPATIBLE_VERSION
            .split('.')
            .fold(0i64, |number, part| number * 256 + part.parse::<i64>().unwrap_or(0));
        redis.raw_set("REDIS_VERSION_NUM", version_number)?;
        redis.raw_set(
            "sha1hex",
            lua.create_function(|lua, args: MultiValue| {
                if args.len() != 1 {
                    return Err(mlua::Error::runtime("wrong number of arguments"));
                }
                // What is not a string or a number hashes as "", as in Redis.
                let text = lua.coerce_string(args[0].clone()).ok().flatten();
                Ok(crate::scripts::sha1_hex(&text.map(|text| text.as_bytes().to_vec()).unwrap_or_default()))
            })?,
        )?;
        redis.raw_set("log", lua.create_function(|_, args: MultiValue| log(args))?)?;
        let handler = lua.create_function(|lua, error: Value| error_with_place(lua, error))?;
        let message_of = lua.create_function(|_, error: Value| {
            Ok(match error {
                Value::Error(error) => failure_message(&error).1,
                _ => String::new(),
            })
        })?;
        let runner: Function =
            lua.load(PRELUDE).set_name("=tessera").call((redis.clone(), handler, message_of))?;
        // Scripts that loop are stopped here once SCRIPT KILL asks.
        lua.set_hook(HookTriggers::new().every_nth_instruction(KILL_CHECK_INSTRUCTIONS), |lua, _| match lua
            .app_data_ref::<Arc<Running>>()
        {
            Some(running) if running.killed() => {
                Err(mlua::Error::runtime("Script killed by user with SCRIPT KILL..."))
            }
            _ => Ok(VmState::Continue),
        });
        Ok(Self { lua, generation: u64::MAX, functions: HashMap::new(), redis, runner })
    }

    /// The compiled function of a script, compiling it on first use.
    fn function(&mut self, script: &Script) -> CommandResult<Function> {
        if let Some(function) = self.functions.get(&script.sha) {
            return Ok(function.clone());
        }
        let function = compile(&self.lua, script.lua())?;
        self.functions.insert(script.sha.clone(), function.clone());
        Ok(function)
    }
}

/// `redis.log(level, message…)`, to the node's log.
fn log(args: MultiValue) -> mlua::Result<()> {
    let mut args = args.into_iter();
    let level = match args.next() {
        Some(Value::Integer(level)) => level,
        Some(Value::Number(level)) => level as i64,
        _ => return Err(mlua::Error::runtime("First argument must be a number (log level).")),
    };
    let words: Vec<String> = args
        .map(|arg| match arg {
            Value::String(text) => text.to_string_lossy(),
            Value::Integer(number) => number.to_string(),
            Value::Number(number) => number.to_string(),
            other => other.type_name().to_string(),
        })
        .collect();
    let message = words.join(" ");
    match level {
        0 | 1 => tracing::debug!(target: "tessera::script", "{message}"),
        2 => tracing::info!(target: "tessera::script", "{message}"),
        3 => tracing::warn!(target: "tessera::script", "{message}"),
        _ => return Err(mlua::Error::runtime("Invalid debug level.")),
    }
    Ok(())
}

/// A command `redis.call` ran answered this error line: the script fails
/// with it, as Redis's does.
#[derive(Debug)]
struct CommandFailed(String);

impl std::fmt::Display for CommandFailed {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::error::Error for CommandFailed {}

/// An error raised from Rust as a script sees it: whether it is a
/// command's (its line has its code), and the message.
fn failure_message(error: &mlua::Error) -> (bool, String) {
    match error {
        mlua::Error::CallbackError { cause, .. } => failure_message(cause),
        mlua::Error::RuntimeError(message) | mlua::Error::MemoryError(message) => (false, message.clone()),
        other => match other.downcast_ref::<CommandFailed>() {
            Some(CommandFailed(line)) => (true, line.clone()),
            None => (false, other.to_string()),
        },
    }
}

/// The error handler every script runs under (Redis's): a message becomes
/// `{err = "ERR " .. message}`, and the script's line is noted. A library
/// function's error names the script's line first, as `luaL_error` does.
fn error_with_place(lua: &Lua, error: Value) -> mlua::Result<Table> {
    let line_of = |frame: Option<mlua::Debug>| {
        frame
            .filter(|frame| frame.source().source.as_deref() == Some("@user_script"))
            .map(|frame| frame.curr_line())
    };
    let message = match error {
        Value::Table(table) => Some(table),
        Value::String(text) => {
            let table = lua.create_table()?;
            table.raw_set("err", format!("ERR {}", text.to_string_lossy()))?;
            Some(table)
        }
        Value::Error(error) => {
            let (command, message) = failure_message(&error);
            let table = lua.create_table()?;
            if command {
                table.raw_set("err", message)?;
            } else {
                let place = line_of(lua.inspect_stack(2))
                    .map(|line| format!("user_script:{line}: "))
                    .unwrap_or_default();
                table.raw_set("err", format!("ERR {place}{message}"))?;
            }
            Some(table)
        }
        _ => None,
    };
    let table = match message {
        Some(table) => table,
        None => {
            let table = lua.create_table()?;
            table.raw_set("err", "ERR unknown error")?;
            table
        }
    };
    for level in 1..64 {
        let Some(frame) = lua.inspect_stack(level) else { break };
        if let Some(line) = line_of(Some(frame)) {
            table.raw_set("source", "@user_script")?;
            table.raw_set("line", line)?;
            break;
        }
    }
    Ok(table)
}
