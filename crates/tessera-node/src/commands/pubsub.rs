//! SUBSCRIBE and PUBLISH and their kin ([`crate::pubsub`]). On a cluster
//! node PUBLISH also goes to every other node (RELAY.PUBLISH, which
//! delivers where it arrives only); shard channels are keys, served by the
//! head of their slot's group, where cluster clients send them.

use bytes::Bytes;
use tessera_wire::{Protocol, Request};

use super::{is, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::pubsub::Kind;

/// PUBSUB's subcommands and their arities.
pub const SUBCOMMANDS: &[(&str, i32)] =
    &[("channels", -2), ("numsub", -2), ("numpat", 2), ("shardchannels", -2), ("shardnumsub", -2)];

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "subscribe", arity: -2, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: subscribe },
    CommandSpec { name: "psubscribe", arity: -2, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: psubscribe },
    CommandSpec { name: "ssubscribe", arity: -2, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: ssubscribe },
    CommandSpec { name: "unsubscribe", arity: -1, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: unsubscribe },
    CommandSpec { name: "punsubscribe", arity: -1, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: punsubscribe },
    CommandSpec { name: "sunsubscribe", arity: -1, flags: &["pubsub", "noscript", "loading", "stale"], first_key: 1, last_key: -1, step: 1, scope: Scope::Keys, handler: sunsubscribe },
    CommandSpec { name: "publish", arity: 3, flags: &["pubsub", "loading", "stale", "fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: publish },
    CommandSpec { name: "spublish", arity: 3, flags: &["pubsub", "loading", "stale", "fast"], first_key: 1, last_key: 1, step: 1, scope: Scope::Keys, handler: spublish },
    CommandSpec { name: "pubsub", arity: -2, flags: &["pubsub", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: pubsub },
    CommandSpec { name: "relay.publish", arity: 3, flags: &["pubsub", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: relay_publish },
];

/// The commands a RESP2 connection may send while subscribed.
pub fn allowed_while_subscribed(name: &str) -> bool {
    matches!(
        name,
        "subscribe"
            | "psubscribe"
            | "ssubscribe"
            | "unsubscribe"
            | "punsubscribe"
            | "sunsubscribe"
            | "ping"
            | "quit"
            | "reset"
    )
}

/// Whether a connection is subscribed to anything and speaks RESP2: then
/// it may send only the commands above.
pub fn in_subscribed_mode(context: &Context) -> bool {
    context.out.protocol() == Protocol::Resp2
        && context.session.subscription.as_ref().is_some_and(|subscription| !subscription.is_empty())
}

/// The confirmation of one (un)subscription: `[kind, name, count]`.
fn confirm(context: &mut Context, event: &str, name: Option<&[u8]>, count: usize) {
    context.out.push(3);
    context.out.bulk(event.as_bytes());
    context.out.bulk_or_null(name);
    context.out.integer(count as i64);
}

fn subscribe_to(context: &mut Context, request: &Request, kind: Kind, event: &str) -> CommandResult {
    let pubsub = context.node.pubsub.clone();
    for name in request.args().skip(1) {
        let subscription = context.session.subscription.get_or_insert_with(|| pubsub.subscription());
        let count = subscription.subscribe(kind, name);
        confirm(context, event, Some(name), count);
    }
    Ok(())
}

fn subscribe(context: &mut Context, request: &Request) -> CommandResult {
    subscribe_to(context, request, Kind::Channel, "subscribe")
}

fn psubscribe(context: &mut Context, request: &Request) -> CommandResult {
    subscribe_to(context, request, Kind::Pattern, "psubscribe")
}

fn ssubscribe(context: &mut Context, request: &Request) -> CommandResult {
    subscribe_to(context, request, Kind::ShardChannel, "ssubscribe")
}

/// UNSUBSCRIBE and its kin: the names given, or every one subscribed to;
/// with none at all, one confirmation with a nil name, as in Redis.
fn unsubscribe_from(context: &mut Context, request: &Request, kind: Kind, event: &str) -> CommandResult {
    let names: Vec<Bytes> = if request.len() > 1 {
        request.args().skip(1).map(Bytes::copy_from_slice).collect()
    } else {
        context.session.subscription.as_ref().map(|subscription| subscription.names(kind)).unwrap_or_default()
    };
    if names.is_empty() {
        let count = context.session.subscription.as_ref().map_or(0, |subscription| subscription.count(kind));
        confirm(context, event, None, count);
    }
    for name in names {
        let count = match context.session.subscription.as_mut() {
            Some(subscription) => subscription.unsubscribe(kind, &name),
            None => 0,
        };
        confirm(context, event, Some(&name), count);
    }
    if context.session.subscription.as_ref().is_some_and(|subscription| subscription.is_empty()) {
        context.session.subscription = None;
    }
    Ok(())
}

fn unsubscribe(context: &mut Context, request: &Request) -> CommandResult {
    unsubscribe_from(context, request, Kind::Channel, "unsubscribe")
}

fn punsubscribe(context: &mut Context, request: &Request) -> CommandResult {
    unsubscribe_from(context, request, Kind::Pattern, "punsubscribe")
}

fn sunsubscribe(context: &mut Context, request: &Request) -> CommandResult {
    unsubscribe_from(context, request, Kind::ShardChannel, "sunsubscribe")
}

/// PUBLISH here; a cluster node then sends it to the other nodes
/// ([`crate::cluster`]) and answers the receivers it counted itself, as a
/// Redis Cluster node does.
fn publish(context: &mut Context, request: &Request) -> CommandResult {
    let received = context.node.pubsub.publish(request.arg(1), request.arg(2), false);
    context.out.integer(received as i64);
    Ok(())
}

fn spublish(context: &mut Context, request: &Request) -> CommandResult {
    let received = context.node.pubsub.publish(request.arg(1), request.arg(2), true);
    context.out.integer(received as i64);
    Ok(())
}

/// Another node's PUBLISH, for the subscribers here only.
fn relay_publish(context: &mut Context, request: &Request) -> CommandResult {
    if !context.session.relay {
        return Err(CommandError::NoPermission("RELAY.PUBLISH is for the cluster's nodes".into()));
    }
    publish(context, request)
}

fn pubsub(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    let pubsub = &context.node.pubsub;
    let out = &mut *context.out;
    let listing = |kind| -> CommandResult<Vec<Bytes>> {
        match request.len() {
            2 => Ok(pubsub.channels(kind, None)),
            3 => Ok(pubsub.channels(kind, Some(request.arg(2)))),
            _ => Err(CommandError::SubcommandSyntax(
                String::from_utf8_lossy(subcommand).into_owned(),
                "PUBSUB",
            )),
        }
    };
    if is(subcommand, "channels") || is(subcommand, "shardchannels") {
        let kind = if is(subcommand, "channels") { Kind::Channel } else { Kind::ShardChannel };
        let names = listing(kind)?;
        out.array(names.len());
        for name in &names {
            out.bulk(name);
        }
    } else if is(subcommand, "numsub") || is(subcommand, "shardnumsub") {
        let kind = if is(subcommand, "numsub") { Kind::Channel } else { Kind::ShardChannel };
        out.array(2 * (request.len() - 2));
        for channel in request.args().skip(2) {
            out.bulk(channel);
            out.integer(pubsub.subscribers(kind, channel) as i64);
        }
    } else if is(subcommand, "numpat") && request.len() == 2 {
        out.integer(pubsub.patterns() as i64);
    } else if is(subcommand, "numpat") {
        return Err(CommandError::SubcommandSyntax(
            String::from_utf8_lossy(subcommand).into_owned(),
            "PUBSUB",
        ));
    } else {
        return Err(CommandError::UnknownSubcommand(
            String::from_utf8_lossy(subcommand).into_owned(),
            "PUBSUB".into(),
        ));
    }
    Ok(())
}
