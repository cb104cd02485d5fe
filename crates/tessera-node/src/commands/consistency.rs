//! Per-request consistency: CONSISTENCY sets what a connection's reads ask
//! for; CONSISTENCY.READ runs one read at a level and answers with the level
//! it got. Replies of ordinary commands are unchanged, so every Redis client
//! keeps working.
//!
//! What a read gets: on a single node, always strong (there is one copy); in a
//! cluster, what it asked for, except that an active–active eventual shard has
//! no strong reads to give and says eventual. On a cluster across datacenters
//! (docs/PROTOCOLS.md, "Causal consistency across datacenters") a connection
//! asks for causal consistency: the node keeps its causal context, and
//! CAUSAL.TOKEN hands it out sealed, for another connection or node of the
//! same datacenter to take up.

use bytes::Bytes;
use tessera_protocol::CausalContext;
use tessera_wire::Request;

use super::{dispatch, is, lookup, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::membership::Membership;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "consistency", arity: -1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: consistency },
    CommandSpec { name: "consistency.read", arity: -3, flags: &["readonly", "noscript", "movablekeys"], first_key: 0, last_key: 0, step: 0, scope: Scope::WrappedRead, handler: read_at },
    CommandSpec { name: "causal.token", arity: -1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: causal_token },
];

const STRONG: &str = "strong";
const EVENTUAL: &str = "eventual";
const CAUSAL: &str = "causal";

/// What a connection or a request asks its reads for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Strong,
    Eventual,
    Causal,
}

pub fn parse_level(level: &[u8]) -> CommandResult<Level> {
    if is(level, STRONG) {
        Ok(Level::Strong)
    } else if is(level, EVENTUAL) {
        Ok(Level::Eventual)
    } else if is(level, CAUSAL) {
        Ok(Level::Causal)
    } else {
        Err(CommandError::Other("consistency is strong, eventual or causal".into()))
    }
}

/// Why a causal level is refused where nothing is replicated causally.
fn not_causal() -> CommandError {
    CommandError::Other(
        "causal consistency needs a cluster across datacenters running a causal protocol (tessera cluster up --datacenters 2 --consistency cops)"
            .into(),
    )
}

/// Refuses the causal level outside a cluster across datacenters.
pub fn check_level(cluster: Option<&Membership>, level: Level) -> CommandResult<()> {
    match level {
        Level::Causal if cluster.and_then(Membership::causal).is_none() => Err(not_causal()),
        _ => Ok(()),
    }
}

/// The read a CONSISTENCY.READ wraps: a known read-only command of keys.
pub fn wrapped_read<'a>(request: &Request<'a>) -> CommandResult<(&'static CommandSpec, Request<'a>)> {
    let inner = request.tail(2);
    match lookup(inner.arg(0)) {
        Some(spec) if spec.flags.contains(&"readonly") && spec.first_key > 0 => {
            if !spec.arity_ok(inner.len()) {
                return Err(CommandError::WrongArity(spec.name.into()));
            }
            Ok((spec, inner))
        }
        Some(spec) => Err(CommandError::Other(format!(
            "CONSISTENCY.READ runs reads of keys; '{}' is not one",
            spec.name
        ))),
        None => Err(CommandError::Other(format!(
            "CONSISTENCY.READ: unknown command '{}'",
            String::from_utf8_lossy(inner.arg(0))
        ))),
    }
}

/// The level a read asking for `level` gets on a single node (`None`) or on
/// a cluster node; across datacenters, causal unless the protocol is the
/// eventual baseline.
pub fn level_got(cluster: Option<&Membership>, level: Level) -> &'static str {
    match (cluster, level) {
        (None, _) => STRONG,
        (Some(node), Level::Causal) => match node.causal() {
            Some((mode, _)) if mode.is_causal() => CAUSAL,
            _ => EVENTUAL,
        },
        (Some(node), Level::Strong) if node.strong_reads() => STRONG,
        (Some(_), _) => EVENTUAL,
    }
}

/// The level the connection's reads ask for.
pub fn session_level(context: &Context) -> Level {
    match (&context.session.causal, context.session.readonly) {
        (Some(_), _) => Level::Causal,
        (None, true) => Level::Eventual,
        (None, false) => Level::Strong,
    }
}

/// CONSISTENCY [STRONG|EVENTUAL]: with a level, this connection's reads ask
/// for it (READONLY is EVENTUAL, READWRITE STRONG); without, the level asked
/// and the level reads get.
fn consistency(context: &mut Context, request: &Request) -> CommandResult {
    match request.len() {
        1 => {
            let asked = session_level(context);
            let got = level_got(context.cluster, asked);
            context.out.array(2);
            context.out.bulk(
                match asked {
                    Level::Strong => STRONG,
                    Level::Eventual => EVENTUAL,
                    Level::Causal => CAUSAL,
                }
                .as_bytes(),
            );
            context.out.bulk(got.as_bytes());
        }
        2 => {
            let level = parse_level(request.arg(1))?;
            check_level(context.cluster, level)?;
            context.session.readonly = level != Level::Strong;
            match level {
                Level::Causal => _ = context.session.causal.get_or_insert_with(CausalContext::default),
                _ => context.session.causal = None,
            }
            context.out.ok();
        }
        _ => return Err(CommandError::Syntax),
    }
    Ok(())
}

/// CONSISTENCY.READ level command [arg ...]: the command's reply, preceded by
/// the level it was served at. On a cluster node this runs in the
/// connection's cluster path; here, on a single node, every read is strong.
fn read_at(context: &mut Context, request: &Request) -> CommandResult {
    let level = parse_level(request.arg(1))?;
    check_level(context.cluster, level)?;
    let (_, inner) = wrapped_read(request)?;
    let got = level_got(context.cluster, level);
    context.out.array(2);
    context.out.bulk(got.as_bytes());
    dispatch(context, &inner);
    Ok(())
}

/// CAUSAL.TOKEN: the connection's causal context, sealed for its
/// datacenter. CAUSAL.TOKEN SET token: takes up a token's context, merged
/// with the connection's own, and makes the connection causal.
fn causal_token(context: &mut Context, request: &Request) -> CommandResult {
    let cluster = context.cluster.ok_or_else(not_causal)?;
    let (_, datacenter) = cluster.causal().ok_or_else(not_causal)?;
    let secret = &cluster.agent.config().secret;
    match request.len() {
        1 => {
            let held = context.session.causal.clone().unwrap_or_default();
            context.out.bulk(secret.seal_token(datacenter, &held.encode()).as_bytes());
        }
        3 if is(request.arg(1), "set") => {
            let refused = |why: String| CommandError::Other(format!("CAUSAL.TOKEN SET: {why}"));
            let sealed =
                secret.open_token(datacenter, request.arg(2)).map_err(|error| refused(error.to_string()))?;
            let taken =
                CausalContext::decode(Bytes::from(sealed)).map_err(|error| refused(error.to_string()))?;
            let held = context.session.causal.take().unwrap_or_default();
            let merged = held.clone().merged(taken).map_err(|why| {
                context.session.causal = Some(held);
                refused(why.to_string())
            })?;
            context.session.causal = Some(merged);
            context.session.readonly = true;
            context.out.ok();
        }
        _ => return Err(CommandError::Syntax),
    }
    Ok(())
}
