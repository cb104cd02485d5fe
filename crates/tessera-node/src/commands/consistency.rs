//! Per-request consistency: CONSISTENCY sets what a connection's reads ask
//! for; CONSISTENCY.READ runs one read at a level and answers with the level
//! it got. Replies of ordinary commands are unchanged, so every Redis client
//! keeps working.
//!
//! What a read gets: on a single node, always strong (there is one copy); in a
//! cluster, what it asked for, except that an active–active eventual shard has
//! no strong reads to give and says eventual.

use tessera_wire::Request;

use super::{dispatch, is, lookup, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::membership::Membership;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "consistency", arity: -1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: consistency },
    CommandSpec { name: "consistency.read", arity: -3, flags: &["readonly", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::WrappedRead, handler: read_at },
];

const STRONG: &str = "strong";
const EVENTUAL: &str = "eventual";

/// Whether a level names strong reads.
pub fn parse_level(level: &[u8]) -> CommandResult<bool> {
    if is(level, STRONG) {
        Ok(true)
    } else if is(level, EVENTUAL) {
        Ok(false)
    } else if is(level, "causal") {
        Err(CommandError::Other("causal consistency is not available yet; choose strong or eventual".into()))
    } else {
        Err(CommandError::Other("consistency is strong or eventual".into()))
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

/// The level a read asking for `strong` gets on a single node (`None`) or on
/// a cluster node.
pub fn level_got(cluster: Option<&Membership>, strong: bool) -> &'static str {
    match cluster {
        None => STRONG,
        Some(node) if strong && node.strong_reads() => STRONG,
        Some(_) => EVENTUAL,
    }
}

/// CONSISTENCY [STRONG|EVENTUAL]: with a level, this connection's reads ask
/// for it (READONLY is EVENTUAL, READWRITE STRONG); without, the level asked
/// and the level reads get.
fn consistency(context: &mut Context, request: &Request) -> CommandResult {
    match request.len() {
        1 => {
            let asked = !context.session.readonly;
            let got = level_got(context.cluster, asked);
            context.out.array(2);
            context.out.bulk(if asked { STRONG } else { EVENTUAL }.as_bytes());
            context.out.bulk(got.as_bytes());
        }
        2 => {
            context.session.readonly = !parse_level(request.arg(1))?;
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
    let strong = parse_level(request.arg(1))?;
    let (_, inner) = wrapped_read(request)?;
    let got = level_got(context.cluster, strong);
    context.out.array(2);
    context.out.bulk(got.as_bytes());
    dispatch(context, &inner);
    Ok(())
}
