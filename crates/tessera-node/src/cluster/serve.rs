//! Serving a request on a cluster node, by its command's [`Scope`]: where
//! its keys live (here, through a quorum, or at another node), over the
//! shards this node heads, or through the coordinator.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use tessera_cluster::agent::{outcome, Agent, Completion};
use tessera_cluster::capture::{CapturingView, ReadSet};
use tessera_engine::Engine;
use tessera_protocol::{
    writes_bytes, CausalContext, ClientReply, ConditionalWrites, NodeId, Operation, Record, Version, Write,
    WritePosition, UNIT_BYTES_MAX,
};
use tessera_wire::{encode_command, parse_value, ReplyWriter, Request, Value};

use super::forward::Forwarder;
use super::placement::Placement;
use super::ClusterNode;
use crate::commands::consistency::{check_level, level_got, parse_level, session_level, wrapped_read, Level};
use crate::commands::scripting::{self, is_script, Call, ScriptOutcome};
use crate::commands::transactions::{self, Transaction, Watched};
use crate::commands::{
    admit, count_rejected, dispatch, dispatch_admitted, is, lookup, refuse_if_busy, CommandSpec, Context,
    Scope,
};
use crate::error::{CommandError, CommandResult};
use crate::watch::Touching;

/// A reply (the bytes `start..end` of the connection's output) that may be
/// sent only once every one of `waits` has committed; if one fails, the
/// reply becomes its error.
pub struct Held {
    pub start: usize,
    pub end: usize,
    pub waits: Vec<Completion>,
}

/// Runs one request on a cluster node, by its command's scope: a keyed
/// command here if this node serves its keys' shard, else `MOVED` for a
/// cluster client or forwarded for a plain one. Returns the reply's hold if
/// it depends on writes not yet committed.
pub async fn serve(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    request: &Request<'_>,
    raw: &[u8],
    forwarder: &mut Forwarder,
) -> Option<Held> {
    let spec = match lookup(request.arg(0)) {
        Some(spec) if context.session.authenticated && spec.arity_ok(request.len()) => spec,
        // Unknown, unauthenticated, wrong arity: the usual error, here.
        _ => {
            dispatch(context, request);
            return None;
        }
    };
    // Checked here, before the request goes anywhere: the coordinator, the
    // shards this node heads, or another node (which runs what a relay sends).
    if let Err(error) = refuse_if_busy(context, spec).and_then(|()| admit(context, spec, request)) {
        count_rejected(context, spec);
        transactions::refuse(context);
        error.write(context.out);
        return None;
    }
    if transactions::queue(context, spec, request) {
        return None;
    }
    if spec.name == "publish" {
        dispatch_admitted(context, spec, request);
        publish_on_other_nodes(cluster, request, forwarder).await;
        return None;
    }
    if spec.name == "exec" {
        // Run where the queued commands' keys live, as one command.
        let Some(transaction) = &context.session.transaction else {
            dispatch_admitted(context, spec, request); // EXEC without MULTI
            return None;
        };
        // Keys watched through a quorum place EXEC too: its batch checks them.
        let (mut keys, write) = transaction.keys();
        if let Some(watched) = &context.session.watched {
            keys.extend(watched.records.keys().cloned());
        }
        let held = serve_keyed(cluster, context, spec, request, raw, forwarder, Some((keys, write))).await;
        // Not run (MOVED, CROSSSLOT, a shard settling): the transaction is gone.
        context.session.transaction = None;
        context.session.watched = None;
        return held;
    }
    match spec.scope {
        Scope::TableRange => serve_table_range(cluster, context, request, forwarder).await,
        Scope::Tables => serve_tables(cluster, context, request).await,
        Scope::Users => serve_users(cluster, context, spec, request).await,
        Scope::Resharding => serve_resharding(cluster, context, spec, request).await,
        Scope::NodeWide => serve_node_wide(cluster, context, spec, request),
        Scope::Flush => return serve_flush(cluster, context, request),
        Scope::Keys | Scope::WrappedRead => {
            return serve_keyed(cluster, context, spec, request, raw, forwarder, None).await
        }
    }
    None
}

/// PUBLISH reaches the subscribers of every node: the others are sent it as
/// RELAY.PUBLISH, which delivers only where it arrives. One node at a time,
/// over this connection's forwarding links; a node that cannot be reached
/// misses the message (pub/sub promises no delivery, in Redis either).
async fn publish_on_other_nodes(cluster: &ClusterNode, request: &Request<'_>, forwarder: &mut Forwarder) {
    let Some(routing) = cluster.agent.routing() else { return };
    let mut relayed = Vec::new();
    encode_command(&[&b"RELAY.PUBLISH"[..], request.arg(1), request.arg(2)], &mut relayed);
    for node in routing.map.nodes.iter().filter(|node| node.id != cluster.agent.node_id()) {
        if let Err(error) = forwarder.forward(&cluster.agent, node.address.clone(), &relayed).await {
            tracing::debug!(node = node.id, %error, "a published message did not reach a node");
        }
    }
}

async fn serve_table_range(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    request: &Request<'_>,
    forwarder: &mut Forwarder,
) {
    match cluster.table_range(request, context.session.relay, context.now_ms, forwarder).await {
        Ok(keys) => {
            context.out.array(keys.len());
            for key in keys {
                context.out.bulk(&key);
            }
        }
        Err(error) => error.write(context.out),
    }
}

async fn serve_tables(cluster: &ClusterNode, context: &mut Context<'_>, request: &Request<'_>) {
    let mark = context.out.len();
    if let Err(error) = cluster.table_command(request, context.out).await {
        context.out.truncate(mark);
        error.write(context.out);
    }
}

/// ACL SETUSER and DELUSER through the coordinator; the rest of ACL here.
async fn serve_users(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    spec: &CommandSpec,
    request: &Request<'_>,
) {
    let subcommand = request.arg(1);
    if request.len() < 3 || !(is(subcommand, "setuser") || is(subcommand, "deluser")) {
        dispatch_admitted(context, spec, request);
        return;
    }
    let mark = context.out.len();
    if let Err(error) = cluster.change_users(context.node, request, context.out).await {
        context.out.truncate(mark);
        error.write(context.out);
    }
}

/// MIGRATE and CLUSTER's resharding subcommands through the coordinator,
/// SLOT-STATS over the groups this node heads; the rest of CLUSTER from this
/// node's map.
async fn serve_resharding(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    spec: &CommandSpec,
    request: &Request<'_>,
) {
    let resharding = is(request.arg(0), "migrate")
        || ["setslot", "getkeysinslot", "countkeysinslot"].iter().any(|name| is(request.arg(1), name));
    let slot_stats = !resharding && is(request.arg(1), "slot-stats");
    if !resharding && !slot_stats {
        dispatch_admitted(context, spec, request);
        return;
    }
    let mark = context.out.len();
    let served = if slot_stats {
        cluster.slot_stats(request, context.now_ms, context.out).await
    } else {
        cluster.resharding_command(request, context.now_ms, context.session.tls, context.out).await
    };
    if let Err(error) = served {
        context.out.truncate(mark);
        error.write(context.out);
    }
}

/// SCAN, KEYS, DBSIZE over the shards this node heads.
fn serve_node_wide(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    spec: &CommandSpec,
    request: &Request<'_>,
) {
    match cluster.headed_tables() {
        Ok(headed) => {
            let mut on_headed = Context {
                tables: &Arc::new(headed),
                session: &mut *context.session,
                out: &mut *context.out,
                ..*context
            };
            dispatch_admitted(&mut on_headed, spec, request);
        }
        Err(error) => error.write(context.out),
    }
}

/// FLUSHDB / FLUSHALL: deletes what this node heads, through replication.
fn serve_flush(cluster: &ClusterNode, context: &mut Context<'_>, request: &Request<'_>) -> Option<Held> {
    let mode = (request.len() == 2).then(|| request.arg(1));
    if request.len() > 2 || mode.is_some_and(|mode| !is(mode, "sync") && !is(mode, "async")) {
        CommandError::Syntax.write(context.out);
        return None;
    }
    let start = context.out.len();
    match cluster.flush_headed(context.node) {
        Ok(mut completions) => {
            context.out.ok();
            completions.retain(|completion| !completion.succeeded());
            (!completions.is_empty()).then(|| Held { start, end: context.out.len(), waits: completions })
        }
        Err(error) => {
            error.write(context.out);
            None
        }
    }
}

/// A command served where its keys live. CONSISTENCY.READ level read is
/// placed and run as the read it wraps, its reply preceded by the level it
/// got. EXEC comes with its transaction's keys and whether it writes.
async fn serve_keyed(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    spec: &'static CommandSpec,
    request: &Request<'_>,
    raw: &[u8],
    forwarder: &mut Forwarder,
    transaction: Option<(Vec<Bytes>, bool)>,
) -> Option<Held> {
    let wrapped = if spec.scope == Scope::WrappedRead {
        let parsed = parse_level(request.arg(1))
            .and_then(|level| check_level(Some(&cluster.membership), level).map(|()| level))
            .and_then(|level| Ok((level, wrapped_read(request)?)));
        match parsed {
            Ok((level, (inner_spec, inner))) => Some((level, inner_spec, inner)),
            Err(error) => {
                error.write(context.out);
                return None;
            }
        }
    } else {
        None
    };
    let (spec, request, write, level) = match &wrapped {
        Some((level, inner_spec, inner)) => {
            if let Err(error) = admit(context, inner_spec, inner) {
                error.write(context.out);
                return None;
            }
            (*inner_spec, inner, false, *level)
        }
        None => {
            let write = transaction.as_ref().map_or(spec.flags.contains(&"write"), |(_, write)| *write);
            let level = match session_level(context) {
                Level::Eventual if write => Level::Strong,
                level => level,
            };
            (spec, request, write, level)
        }
    };
    let (strong, causal) = (level == Level::Strong, level == Level::Causal);
    let level_header = |out: &mut ReplyWriter| {
        if wrapped.is_some() {
            out.array(2);
            out.bulk(level_got(Some(&cluster.membership), level).as_bytes());
        }
    };
    if causal && (transaction.is_some() || is_script(spec) || spec.flags.contains(&"blocking")) {
        CommandError::Other(
            "a causal session runs single commands: no transactions, scripts or blocking commands".into(),
        )
        .write(context.out);
        return None;
    }
    let named: Vec<&[u8]> = match &transaction {
        Some((keys, _)) => keys.iter().map(|key| &key[..]).collect(),
        None => spec
            .key_positions(request.len(), |index| request.arg(index))
            .map(|index| request.arg(index))
            .collect(),
    };
    let keys = || named.iter().copied();
    let placement = cluster.place_when_settled(keys, write, strong).await;
    // A causal session's context lives on this connection: its commands run
    // here or are forwarded with it, never redirected.
    let placement = match placement {
        Placement::Shard { shard, engine, .. } if causal => {
            let start = context.out.len();
            level_header(context.out);
            let keys: Vec<Bytes> = keys().map(Bytes::copy_from_slice).collect();
            if let Err(error) = run_on_causal(cluster, context, (spec, request), &keys, shard, engine).await {
                context.out.truncate(start);
                error.write(context.out);
            }
            return None;
        }
        Placement::Elsewhere { head, .. } if causal => {
            if let Err(error) = forward_causal(cluster, context, forwarder, head.address, raw).await {
                error.write(context.out);
            }
            return None;
        }
        placement => placement,
    };
    if matches!(placement, Placement::Shard { .. } | Placement::Quorum { .. })
        && spec.flags.contains(&"denyoom")
    {
        if let Err(error) = cluster.make_room(context.node) {
            error.write(context.out);
            return None;
        }
    }
    match placement {
        Placement::Local => {
            context.node.disk_reads.prepare_in_tables(context.tables, keys()).await;
            level_header(context.out);
            dispatch_admitted(context, spec, request);
            None
        }
        // A shard still settling after the wait: its error is the client's.
        Placement::Refused(error) | Placement::Settling(error) => {
            error.write(context.out);
            None
        }
        Placement::Draining { .. } => {
            CommandError::TryAgain("the keys' shard is still switching modes".into()).write(context.out);
            None
        }
        // A node taken out of the cluster redirects every client, plain
        // ones too: it is about to stop, and its clients must learn where
        // their slots went rather than keep coming back.
        Placement::Elsewhere { slot, head, forward_only }
            if context.session.relay
                || (context.session.cluster_client && !forward_only)
                || cluster.agent.retired() =>
        {
            let address = head.client_address(context.session.tls).to_string();
            CommandError::Moved { slot, address }.write(context.out);
            None
        }
        Placement::Elsewhere { head, .. } if is_script(spec) => {
            // The other node may not have the script: send its body.
            let as_eval = evalsha_as_eval(context, request);
            match forwarder.forward(&cluster.agent, head.address, as_eval.as_deref().unwrap_or(raw)).await {
                Ok(reply) => context.out.raw(&reply),
                Err(error) => error.write(context.out),
            }
            None
        }
        Placement::Elsewhere { .. } if transaction.is_some() => {
            CommandError::Other(
                "this transaction's keys are served by another node: run it there, or with a cluster client"
                    .into(),
            )
            .write(context.out);
            None
        }
        Placement::Elsewhere { head, .. } => {
            match forwarder.forward(&cluster.agent, head.address, raw).await {
                Ok(reply) => context.out.raw(&reply),
                Err(error) => error.write(context.out),
            }
            None
        }
        Placement::Quorum { shard, engine } if is_script(spec) => {
            let by_sha = spec.name.starts_with("evalsha");
            match Call::parse(context, request, by_sha, spec.name.ends_with("_ro")) {
                Ok(call) => {
                    let keys: Vec<Bytes> = keys().map(Bytes::copy_from_slice).collect();
                    let work = QuorumWork::Script(Arc::new(call));
                    run_on_quorum(cluster, context, (work, write), &keys, shard, &engine).await;
                }
                Err(error) => error.write(context.out),
            }
            None
        }
        // Versions of this node's, which writes through the quorum do not move.
        Placement::Quorum { .. }
            if transaction.is_some()
                && context.session.watched.as_ref().is_some_and(Watched::has_versions) =>
        {
            context.session.transaction = None;
            context.session.watched = None;
            CommandError::Other(
                "this transaction watched keys of a table that is not active-active strong; on such a table, watch only the keys of the transaction's slot"
                    .into(),
            )
            .write(context.out);
            None
        }
        Placement::Quorum { shard, .. } if spec.name == "watch" && context.session.transaction.is_none() => {
            match fetch_records(cluster, shard, keys().map(Bytes::copy_from_slice).collect()).await {
                Ok(records) => transactions::watch_records(context, records),
                Err(error) => error.write(context.out),
            }
            None
        }
        Placement::Quorum { shard, engine } => {
            let start = context.out.len();
            level_header(context.out);
            let keys: Vec<Bytes> = keys().map(Bytes::copy_from_slice).collect();
            run_on_quorum(
                cluster,
                context,
                (QuorumWork::Command(spec, request), write),
                &keys,
                shard,
                &engine,
            )
            .await;
            cluster.traffic.record(&keys[0], raw.len(), context.out.len() - start);
            None
        }
        Placement::Shard { shard, engine, barrier } if is_script(spec) => {
            if write {
                cluster.agent.wait_for_room().await;
            }
            let keys: Vec<Bytes> = keys().map(Bytes::copy_from_slice).collect();
            if let Err(error) =
                run_script_on_shard(context, request, spec, ShardRun { shard, engine, barrier, keys })
            {
                error.write(context.out);
            }
            None
        }
        Placement::Shard { shard, engine, barrier } => {
            if write {
                cluster.agent.wait_for_room().await;
            }
            context.node.disk_reads.prepare(keys().map(|key| (&engine, key))).await;
            let start = context.out.len();
            level_header(context.out);
            let mut waits: Vec<Completion> = barrier.into_iter().collect();
            let touching = Touching::new(Arc::new(CapturingView::new(engine)), context.node.versions.clone());
            let view = touching.inner();
            {
                // A strong request sees the keys' newest writes, so it must
                // wait for those still in flight; its own writes are handed to
                // replication before the locks go, so they are ordered as run.
                let _locks = match strong.then(|| context.node.lock_keys_unless_busy(keys())) {
                    Some(Err(error)) => {
                        context.out.truncate(start);
                        error.write(context.out);
                        return None;
                    }
                    locks => locks,
                };
                if strong {
                    waits.extend(cluster.agent.in_flight(shard, keys()));
                }
                dispatch_admitted(&mut context.over(&touching, strong), spec, request);
                let writes = view.take();
                if write && !writes.is_empty() {
                    match replicate(&cluster.agent, shard, keys(), writes) {
                        Ok((completion, position)) => {
                            waits.push(completion);
                            if let Some(position) = position {
                                context.session.note_write(shard, position);
                            }
                        }
                        Err(error) => {
                            context.out.truncate(start);
                            error.write(context.out);
                        }
                    }
                } else if !writes.is_empty() {
                    tracing::error!(
                        command = spec.name,
                        "a read-only command wrote; its writes were dropped"
                    );
                }
            }
            if let Some(key) = keys().next() {
                cluster.traffic.record(key, raw.len(), context.out.len() - start);
            }
            waits.retain(|wait| !wait.succeeded());
            (!waits.is_empty()).then(|| Held { start, end: context.out.len(), waits })
        }
    }
}

/// Where a script runs on the shard this node heads.
struct ShardRun {
    shard: u32,
    engine: Arc<dyn Engine>,
    barrier: Option<Completion>,
    keys: Vec<Bytes>,
}

/// Runs a script on a script thread over the shard's view, as a
/// transaction runs: its keys locked, after the writes in flight on them,
/// its writes handed to replication together. The connection waits for it
/// (`Session::script`).
fn run_script_on_shard(
    context: &mut Context<'_>,
    request: &Request<'_>,
    spec: &CommandSpec,
    run: ShardRun,
) -> Result<(), CommandError> {
    let by_sha = spec.name.starts_with("evalsha");
    let call = Call::parse(context, request, by_sha, spec.name.ends_with("_ro"))?;
    scripting::spawn(context, move |mut detached| {
        let ShardRun { shard, engine, barrier, keys } = run;
        let node = detached.node.clone();
        let agent = detached.cluster.as_ref().expect("a cluster node has its membership").agent.clone();
        let keys = || keys.iter().map(|key| &key[..]);
        let _locks = node.lock_keys(keys());
        let mut waits: Vec<Completion> = barrier.into_iter().collect();
        waits.extend(agent.in_flight(shard, keys()));
        let touching = Touching::new(Arc::new(CapturingView::new(engine)), node.versions.clone());
        let mut reply = detached.run(Some(&touching), true, |context| scripting::answer_run(context, &call));
        let writes = touching.inner().take();
        let mut written = None;
        if !writes.is_empty() {
            match replicate(&agent, shard, keys(), writes) {
                Ok((completion, position)) => {
                    waits.push(completion);
                    written = position.map(|position| (shard, position));
                }
                Err(error) => reply = detached.run(None, true, |context| error.write(context.out)),
            }
        }
        waits.retain(|wait| !wait.succeeded());
        ScriptOutcome { reply, waits, written }
    });
    Ok(())
}

/// Hands a command's writes to replication as one unit (in one view, and
/// applied whole by every replica), or refuses them all, without effect,
/// when they are more than a unit carries.
fn replicate<'k>(
    agent: &Agent,
    shard: u32,
    keys: impl Iterator<Item = &'k [u8]>,
    writes: Vec<(Bytes, Write)>,
) -> CommandResult<(Completion, Option<WritePosition>)> {
    fits_one_unit(&writes)?;
    Ok(agent.begin_batch(shard, keys, vec![replicated(writes)]))
}

/// Refuses, with nothing written, a command that writes more than one
/// replicated unit carries.
fn fits_one_unit(writes: &[(Bytes, Write)]) -> CommandResult<()> {
    let bytes = writes_bytes(writes);
    if bytes > UNIT_BYTES_MAX {
        return Err(CommandError::Other(format!(
            "the command writes {bytes} bytes, more than the {UNIT_BYTES_MAX} that replicate as one unit; nothing was written"
        )));
    }
    Ok(())
}

/// A command's captured writes as the operation replication carries: one
/// key's write, or a batch that every replica applies whole.
fn replicated(mut writes: Vec<(Bytes, Write)>) -> Operation {
    if writes.len() > 1 {
        return Operation::Batch { writes };
    }
    match writes.pop().expect("only commands that wrote are replicated") {
        (key, Write::Put(value)) => Operation::Put { key, value },
        (key, Write::Delete) => Operation::Delete { key },
    }
}

/// EVALSHA as the EVAL of the script this node knows, for a node that may
/// not know it; None for EVAL, or a script this node does not know either.
fn evalsha_as_eval(context: &Context<'_>, request: &Request<'_>) -> Option<Vec<u8>> {
    if !is(request.arg(0), "evalsha") && !is(request.arg(0), "evalsha_ro") {
        return None;
    }
    let script = context.node.scripts.get(request.arg(1))?;
    let name: &[u8] = if is(request.arg(0), "evalsha") { b"EVAL" } else { b"EVAL_RO" };
    let mut args: Vec<&[u8]> = vec![name, &script.body];
    args.extend(request.args().skip(2));
    let mut raw = Vec::new();
    encode_command(&args, &mut raw);
    Some(raw)
}

/// What runs on a shard running a quorum protocol: a command (EXEC with
/// its transaction) or a script, which runs on a script thread each time.
enum QuorumWork<'r> {
    Command(&'static CommandSpec, &'r Request<'r>),
    Script(Arc<Call>),
}

/// How many times a command on a shard running a quorum protocol runs before its keys are
/// declared too busy.
const QUORUM_ATTEMPTS: usize = 8;

/// How many times, within one attempt, a command runs again because it
/// touched keys it had no record of (a large collection's pages, found
/// through its header: a few levels at most).
const DISCOVERY_ROUNDS: usize = 16;

/// Counts a round of a command that touched keys it had no record of; past
/// [`DISCOVERY_ROUNDS`], its keys are declared too busy.
fn another_round(rounds: &mut usize) -> CommandResult<()> {
    *rounds += 1;
    if *rounds == DISCOVERY_ROUNDS {
        return Err(CommandError::TryAgain("the command's keys kept changing shape under it".into()));
    }
    Ok(())
}

/// A command (or a transaction's EXEC) on a shard running a quorum protocol
/// (AA+SC). It runs on the records of the keys it touches, fetched through
/// the quorum, and commits as one conditional batch (docs/PROTOCOLS.md,
/// "Batches on AA+SC") that takes effect only if none of those records
/// changed: what it wrote, and what it only read rewritten as it was, so
/// the command takes effect at one point with everything it read. A key it
/// touches without a record yet (a collection's page, found through the
/// header) is fetched and the command runs again. If a record changed, the
/// command runs again on fetched records. A write first tries this member's
/// own records (its proposals keep them current, so a key written through
/// one member commits in a prepare and an accept). A command that turns out
/// to write nothing answers once a second fetch finds every record it read
/// unchanged (so all held their values at one moment between the two),
/// unless it read a single fetched key. EXEC also checks the records WATCH
/// fetched: a watched key whose record moved makes it answer nil. A script
/// runs the same way, each run on a script thread.
async fn run_on_quorum(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    work: (QuorumWork<'_>, bool),
    keys: &[Bytes],
    shard: u32,
    engine: &Arc<dyn Engine>,
) {
    let start = context.out.len();
    // EXEC takes the transaction it runs and what was watched: each attempt
    // runs it anew, and the session is out of MULTI however EXEC ends.
    let transaction = context.session.transaction.take();
    let watched = match transaction {
        Some(_) => context.session.watched.take().map(|watched| watched.records).unwrap_or_default(),
        None => HashMap::new(),
    };
    let ran = try_on_quorum(cluster, context, work, (transaction, &watched), keys, shard, engine).await;
    let answer = match ran {
        Ok(Ran::Answered) => return,
        Ok(Ran::WatchedMoved) => None,
        Err(error) => Some(error),
    };
    context.out.truncate(start);
    match answer {
        None => context.out.null_array(),
        Some(error) => error.write(context.out),
    }
}

/// How a command on a quorum shard ended, short of an error.
enum Ran {
    /// Its reply is written.
    Answered,
    /// EXEC found a watched key's record moved: it answers nil.
    WatchedMoved,
}

/// `run_on_quorum`'s attempts, each writing its reply over the last one's.
async fn try_on_quorum(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    (work, write): (QuorumWork<'_>, bool),
    (transaction, watched): (Option<Transaction>, &HashMap<Bytes, Option<Record>>),
    keys: &[Bytes],
    shard: u32,
    engine: &Arc<dyn Engine>,
) -> CommandResult<Ran> {
    let start = context.out.len();
    let mut reads = if write {
        ReadSet { records: watched.clone(), guess_locally: true, ..ReadSet::default() }
    } else {
        ReadSet { missing: keys.iter().chain(watched.keys()).cloned().collect(), ..ReadSet::default() }
    };
    for _ in 0..QUORUM_ATTEMPTS {
        let mut rounds = 0;
        let writes = loop {
            if !reads.missing.is_empty() {
                let fetched = fetch_records(cluster, shard, std::mem::take(&mut reads.missing)).await?;
                if moved(watched, &fetched) {
                    return Ok(Ran::WatchedMoved);
                }
                reads.records.extend(fetched);
            }
            context.out.truncate(start);
            let view = Arc::new(CapturingView::over_records(engine.clone(), reads));
            match &work {
                QuorumWork::Command(spec, request) => {
                    context.session.transaction = transaction.clone();
                    dispatch_admitted(&mut context.over(view.as_ref(), false), spec, request);
                }
                QuorumWork::Script(call) => {
                    let (call, on_view) = (call.clone(), view.clone());
                    let run = scripting::detach(context, move |mut detached| {
                        detached.run(Some(on_view.as_ref()), false, |context| {
                            scripting::answer_run(context, &call)
                        })
                    });
                    let reply = run.await.map_err(|_| {
                        CommandError::Other("the script's thread ended before it answered".into())
                    })?;
                    context.out.raw(&reply);
                }
            }
            reads = view.take_reads().expect("a view over records");
            if reads.missing.is_empty() {
                break view.take();
            }
            another_round(&mut rounds)?;
        };
        if writes.is_empty() {
            if !reads.guess_locally && watched.is_empty() && reads.records.len() <= 1 {
                return Ok(Ran::Answered);
            }
            let fetched = fetch_records(cluster, shard, reads.records.keys().cloned().collect()).await?;
            if moved(watched, &fetched) {
                return Ok(Ran::WatchedMoved);
            }
            if reads.records.iter().all(|(key, record)| same_ballot(record, &fetched[key])) {
                return Ok(Ran::Answered);
            }
            reads = ReadSet { records: fetched, ..ReadSet::default() };
            continue;
        }
        // What it only read is rewritten as it was, under the same condition.
        let written: HashSet<Bytes> = writes.iter().map(|(key, _)| key.clone()).collect();
        let rewrites = reads
            .records
            .iter()
            .filter(|(key, _)| !written.contains(*key))
            .map(|(key, record)| (key.clone(), Write::restoring(record.as_ref())));
        let all: Vec<(Bytes, Write)> = writes.into_iter().chain(rewrites).collect();
        fits_one_unit(&all)?;
        // The protocol runs a batch of one key as that key's conditional write.
        let writes: ConditionalWrites = all
            .into_iter()
            .map(|(key, write)| {
                let expected = reads.records[&key].as_ref().map(Record::ballot);
                (key, expected, write)
            })
            .collect();
        match cluster.agent.submit(shard, Operation::BatchIf { writes }).await {
            ClientReply::Written | ClientReply::Value(_) => {
                if let Some(position) = cluster.agent.write_position(shard) {
                    context.session.note_write(shard, position);
                }
                return Ok(Ran::Answered);
            }
            // Nothing was written: a record changed, or another batch held
            // one. Run again on every key's newest record. Keys it meets
            // for the first time are guessed from this member's copy as on
            // the first attempt: a collection the command writes anew takes
            // a new id, and so new page keys, on every run, which fetching
            // first would chase for ever.
            ClientReply::Changed | ClientReply::Retry(_) => {
                reads = ReadSet {
                    missing: reads.records.into_keys().collect(),
                    guess_locally: true,
                    ..ReadSet::default()
                };
            }
            other => return Err(failure(&other)),
        }
    }
    Err(CommandError::TryAgain("the keys kept changing under concurrent writes".into()))
}

/// Whether two reads of a key found the same record (or none both times).
fn same_ballot(first: &Option<Record>, second: &Option<Record>) -> bool {
    first.as_ref().map(Record::ballot) == second.as_ref().map(Record::ballot)
}

/// Whether a key WATCH fetched has a record other than it had then.
fn moved(watched: &HashMap<Bytes, Option<Record>>, fetched: &HashMap<Bytes, Option<Record>>) -> bool {
    fetched.iter().any(|(key, record)| watched.get(key).is_some_and(|then| !same_ballot(then, record)))
}

/// A causal session's command on this node's copy of its keys' partition:
/// it runs over the values the protocol shows the session (each read
/// carries the session's context and brings it back), and its one write,
/// if any, goes through the protocol with the context too (docs/PROTOCOLS.md,
/// "Causal consistency across datacenters").
async fn run_on_causal(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    (spec, request): (&'static CommandSpec, &Request<'_>),
    keys: &[Bytes],
    shard: u32,
    engine: Arc<dyn Engine>,
) -> CommandResult<()> {
    let start = context.out.len();
    let mut session = context.session.causal.clone().unwrap_or_default();
    let mut reads = ReadSet { missing: keys.iter().cloned().collect(), ..ReadSet::default() };
    let mut rounds = 0;
    let mut writes = loop {
        for key in std::mem::take(&mut reads.missing) {
            let read = Operation::Causal { key: key.clone(), write: None, context: session };
            let reply = cluster.agent.submit(shard, read).await;
            let ClientReply::Causal { value, context: after } = reply else { return Err(failure(&reply)) };
            session = after;
            // The view reads records; the version is the protocol's business.
            let record = value.map(|value| Record::value(Version::default(), NodeId(0), value));
            reads.records.insert(key, record);
        }
        context.out.truncate(start);
        let view = CapturingView::over_records(engine.clone(), reads);
        dispatch_admitted(&mut context.over(&view, false), spec, request);
        reads = view.take_reads().expect("a view over records");
        if reads.missing.is_empty() {
            break view.take();
        }
        another_round(&mut rounds)?;
    };
    if writes.len() > 1 {
        return Err(CommandError::Other(
            "a causal session's command writes one key (a collection past its inline size spreads over several)"
                .into(),
        ));
    }
    if let Some((key, write)) = writes.pop() {
        fits_one_unit(&[(key.clone(), write.clone())])?;
        cluster.agent.wait_for_room().await;
        let reply = cluster
            .agent
            .submit(shard, Operation::Causal { key, write: Some(write), context: session })
            .await;
        let ClientReply::Causal { context: after, .. } = reply else { return Err(failure(&reply)) };
        session = after;
    }
    context.session.causal = Some(session);
    Ok(())
}

/// A causal session's command at `owner`, the node of this datacenter that
/// holds its keys: the session's context goes with it in a token, and comes
/// back with what the command did and saw, all in one exchange (CAUSAL.TOKEN
/// SET, the command, CAUSAL.TOKEN). A causal layout's slots never move, so
/// the owner answers rather than redirects.
async fn forward_causal(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    forwarder: &mut Forwarder,
    owner: String,
    raw: &[u8],
) -> CommandResult<()> {
    let (_, datacenter) =
        cluster.membership.causal().ok_or_else(|| CommandError::Other("not across datacenters".into()))?;
    let secret = &cluster.agent.config().secret;
    let held = context.session.causal.clone().unwrap_or_default();
    let mut requests = Vec::new();
    let token = secret.seal_token(datacenter, &held.encode());
    encode_command(&[&b"CAUSAL.TOKEN"[..], b"SET", token.as_bytes()], &mut requests);
    requests.extend_from_slice(raw);
    encode_command(&[&b"CAUSAL.TOKEN"[..]], &mut requests);
    let answers = forwarder.forward_pipelined(&cluster.agent, &owner, &requests, 3).await?;
    let [taken, reply, token] = <[Vec<u8>; 3]>::try_from(answers).expect("three answers");
    if !taken.starts_with(b"+OK") {
        return Err(CommandError::Other(format!(
            "the owner {owner} refused the session's context ({}), and ran the command without it",
            String::from_utf8_lossy(&taken).trim_end()
        )));
    }
    let Ok(Some((Value::Bulk(token), _))) = parse_value(&token) else {
        return Err(CommandError::Other(format!("the owner {owner} sent no causal token back")));
    };
    let after = secret
        .open_token(datacenter, &token)
        .ok()
        .and_then(|sealed| CausalContext::decode(Bytes::from(sealed)).ok())
        .ok_or_else(|| {
            CommandError::Other(format!("the owner {owner} sent a causal token this node cannot open"))
        })?;
    context.session.causal = Some(after);
    context.out.raw(&reply);
    Ok(())
}

/// Each key's newest record, read through the quorum.
async fn fetch_records(
    cluster: &ClusterNode,
    shard: u32,
    keys: BTreeSet<Bytes>,
) -> CommandResult<HashMap<Bytes, Option<Record>>> {
    let operations = keys.iter().map(|key| Operation::Fetch { key: key.clone() }).collect();
    let mut fetched = HashMap::new();
    for (key, pending) in keys.into_iter().zip(cluster.agent.begin_all(shard, operations)) {
        let record = match pending.answer().await {
            ClientReply::Value(None) => None,
            ClientReply::Value(Some(raw)) => Some(
                Record::decode(raw)
                    .map_err(|error| CommandError::Other(format!("a replica sent {error}")))?,
            ),
            other => return Err(failure(&other)),
        };
        fetched.insert(key, record);
    }
    Ok(fetched)
}

/// The error for an answer that is not the success expected.
fn failure(reply: &ClientReply) -> CommandError {
    outcome(reply)
        .err()
        .map_or_else(|| CommandError::Other("unexpected answer from the shard".into()), CommandError::Shard)
}
