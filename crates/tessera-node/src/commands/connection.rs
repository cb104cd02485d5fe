//! Connection commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, CLIENT.

use std::sync::Arc;

use bytes::Bytes;
use tessera_wire::{Protocol, Request};

use super::{integer_arg, is, CommandSpec, Context, Scope, Session};
use crate::acl::DEFAULT_USER;
use crate::clients::{ClientEntry, ClientState};
use crate::error::{CommandError, CommandResult};
use crate::typed::parse_i64;
use crate::REDIS_COMPATIBLE_VERSION;

/// CLIENT's subcommands and their arities.
pub const CLIENT_SUBCOMMANDS: &[(&str, i32)] = &[
    ("id", 2),
    ("info", 2),
    ("list", -2),
    ("kill", -3),
    ("getname", 2),
    ("setname", 3),
    ("setinfo", 4),
    ("reply", 3),
    ("no-evict", 3),
    ("pause", -3),
    ("unpause", 2),
    ("help", 2),
];

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "ping", arity: -1, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: ping },
    CommandSpec { name: "echo", arity: 2, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: echo },
    CommandSpec { name: "hello", arity: -1, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: hello },
    CommandSpec { name: "auth", arity: -2, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: auth },
    CommandSpec { name: "select", arity: 2, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: select },
    CommandSpec { name: "quit", arity: -1, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: quit },
    CommandSpec { name: "client", arity: -2, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: client },
    CommandSpec { name: "reset", arity: 1, flags: &["noauth", "fast", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: reset },
];

/// RESET: the connection as a new one (what connection pools send before
/// handing a connection on): out of MULTI, nothing watched or subscribed,
/// replies on, read-write, RESP2, no name, logged in as `default` if that
/// user needs no password.
fn reset(context: &mut Context, _request: &Request) -> CommandResult {
    let session = &mut *context.session;
    (session.transaction, session.watched, session.subscription) = (None, None, None);
    (session.readonly, session.replies_off, session.replies_to_skip, session.no_evict) =
        (false, false, 0, false);
    (session.name, session.relay, session.relay_challenge) = (None, false, None);
    session.user = DEFAULT_USER.to_string();
    session.permissions = None;
    session.authenticated = context.node.acl.user(DEFAULT_USER).is_some_and(|user| user.is_open());
    context.out.set_protocol(Protocol::Resp2);
    context.out.simple("RESET");
    Ok(())
}

fn ping(context: &mut Context, request: &Request) -> CommandResult {
    if request.len() > 2 {
        return Err(CommandError::WrongArity("ping".into()));
    }
    if super::pubsub::in_subscribed_mode(context) {
        // A subscribed RESP2 connection reads only arrays: Redis answers so.
        context.out.array(2);
        context.out.bulk(b"pong");
        context.out.bulk(if request.len() == 2 { request.arg(1) } else { b"" });
    } else if request.len() == 2 {
        context.out.bulk(request.arg(1));
    } else {
        context.out.simple("PONG");
    }
    Ok(())
}

fn echo(context: &mut Context, request: &Request) -> CommandResult {
    context.out.bulk(request.arg(1));
    Ok(())
}

fn check_password(context: &mut Context, user: &[u8], password: &[u8]) -> CommandResult {
    let name = String::from_utf8_lossy(user);
    let user = context.node.acl.user(&name);
    // Hashing the offered password whether or not the user exists keeps the
    // time of a failure the same for both.
    match user.filter(|user| user.opens_with(password)) {
        Some(user) => {
            context.session.authenticated = true;
            context.session.user = user.name.clone();
            context.session.permissions = None;
            Ok(())
        }
        None => {
            context.session.failed_auths += 1;
            Err(CommandError::WrongPass)
        }
    }
}

fn auth(context: &mut Context, request: &Request) -> CommandResult {
    match request.len() {
        2 if context.node.acl.user(DEFAULT_USER).is_some_and(|user| user.is_open()) => {
            return Err(CommandError::Other(
                "AUTH <password> called without any password configured for the default user. \
                 Are you sure your configuration is correct?"
                    .into(),
            ))
        }
        2 => check_password(context, DEFAULT_USER.as_bytes(), request.arg(1))?,
        3 => check_password(context, request.arg(1), request.arg(2))?,
        _ => return Err(CommandError::Syntax),
    }
    context.out.ok();
    Ok(())
}

/// HELLO [protover [AUTH username password] [SETNAME clientname]]
fn hello(context: &mut Context, request: &Request) -> CommandResult {
    let mut protocol = context.out.protocol();
    if request.len() >= 2 {
        protocol = match integer_arg(request, 1) {
            Ok(2) => Protocol::Resp2,
            Ok(3) => Protocol::Resp3,
            Ok(_) => return Err(CommandError::NoProto),
            Err(_) => {
                return Err(CommandError::Other("Protocol version is not an integer or out of range".into()))
            }
        };
    }
    let mut index = 2;
    while index < request.len() {
        if is(request.arg(index), "auth") && index + 2 < request.len() {
            check_password(context, request.arg(index + 1), request.arg(index + 2))?;
            index += 3;
        } else if is(request.arg(index), "setname") && index + 1 < request.len() {
            context.session.name = Some(valid_client_name(request.arg(index + 1))?);
            index += 2;
        } else {
            return Err(CommandError::Syntax);
        }
    }
    if !context.session.authenticated {
        return Err(CommandError::NoAuth);
    }
    context.out.set_protocol(protocol);
    let out = &mut *context.out;
    out.map(7);
    out.bulk(b"server");
    out.bulk(b"tessera");
    out.bulk(b"version");
    out.bulk(REDIS_COMPATIBLE_VERSION.as_bytes());
    out.bulk(b"proto");
    out.integer(if protocol == Protocol::Resp3 { 3 } else { 2 });
    out.bulk(b"id");
    out.integer(context.session.id as i64);
    out.bulk(b"mode");
    out.bulk(if context.cluster.is_some() { b"cluster" } else { b"standalone" });
    out.bulk(b"role");
    out.bulk(b"master");
    out.bulk(b"modules");
    out.array(0);
    Ok(())
}

fn select(context: &mut Context, request: &Request) -> CommandResult {
    match integer_arg(request, 1) {
        Ok(0) => {
            context.out.ok();
            Ok(())
        }
        Ok(_) => {
            Err(CommandError::Other("DB index is out of range (Tessera has one database; use tables)".into()))
        }
        Err(_) => Err(CommandError::NotInteger),
    }
}

fn quit(context: &mut Context, _request: &Request) -> CommandResult {
    context.session.closing = true;
    context.out.ok();
    Ok(())
}

/// Client names may not contain spaces or newlines (they appear in CLIENT LIST).
fn valid_client_name(name: &[u8]) -> CommandResult<Bytes> {
    if name.iter().any(|&byte| byte <= b' ' || byte > b'~') {
        return Err(CommandError::Other(
            "Client names cannot contain spaces, newlines or special characters.".into(),
        ));
    }
    Ok(Bytes::copy_from_slice(name))
}

fn client(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    let arity_error =
        || CommandError::SubcommandSyntax(String::from_utf8_lossy(subcommand).into_owned(), "CLIENT");
    if is(subcommand, "setname") {
        if request.len() != 3 {
            return Err(arity_error());
        }
        let name = request.arg(2);
        context.session.name = if name.is_empty() { None } else { Some(valid_client_name(name)?) };
        context.out.ok();
    } else if is(subcommand, "getname") {
        context.out.bulk_or_null(context.session.name.as_deref());
    } else if is(subcommand, "id") {
        context.out.integer(context.session.id as i64);
    } else if is(subcommand, "setinfo") {
        if request.len() != 4 {
            return Err(arity_error());
        }
        let value = valid_client_name(request.arg(3)).ok();
        if is(request.arg(2), "lib-name") {
            context.session.library_name = value;
        } else if is(request.arg(2), "lib-ver") {
            context.session.library_version = value;
        } else {
            return Err(CommandError::Other(format!(
                "Unrecognized option '{}'",
                String::from_utf8_lossy(request.arg(2))
            )));
        }
        context.out.ok();
    } else if is(subcommand, "info") {
        let line = match refresh_own_entry(context, "client|info") {
            Some(entry) => entry.line(context.now_ms),
            None => format!("id={}\n", context.session.id),
        };
        context.out.verbatim(&line);
    } else if is(subcommand, "list") {
        let text = client_list(context, request)?;
        context.out.verbatim(&text);
    } else if is(subcommand, "kill") {
        client_kill(context, request)?;
    } else if is(subcommand, "reply") && request.len() == 3 {
        let mode = request.arg(2);
        if is(mode, "on") {
            (context.session.replies_off, context.session.replies_to_skip) = (false, 0);
            context.out.ok();
        } else if is(mode, "off") {
            context.session.replies_off = true;
        } else if is(mode, "skip") {
            context.session.replies_to_skip = 2; // this command's reply and the next one's
        } else {
            return Err(CommandError::Syntax);
        }
    } else if is(subcommand, "no-evict") && request.len() == 3 {
        context.session.no_evict = on_or_off(request.arg(2))?;
        context.out.ok();
    } else if is(subcommand, "pause") && (3..=4).contains(&request.len()) {
        let timeout = parse_i64(request.arg(2))
            .ok()
            .filter(|timeout| *timeout >= 0)
            .ok_or_else(|| CommandError::Other("timeout is not an integer or out of range".into()))?;
        let every_command = match request.len() {
            4 if is(request.arg(3), "write") => false,
            4 if is(request.arg(3), "all") => true,
            4 => return Err(CommandError::Other("CLIENT PAUSE mode must be WRITE or ALL".into())),
            _ => true,
        };
        let until = context.now_ms.saturating_add(timeout as u64);
        context.node.pause.pause(until, every_command, context.now_ms);
        context.out.ok();
    } else if is(subcommand, "unpause") && request.len() == 2 {
        context.node.pause.unpause();
        context.out.ok();
    } else if is(subcommand, "help") {
        let lines = [
            "CLIENT <subcommand>",
            "ID",
            "GETNAME",
            "SETNAME <name>",
            "SETINFO <LIB-NAME|LIB-VER> <value>",
            "INFO",
            "LIST [TYPE NORMAL|PUBSUB] [ID <id> ...]",
            "KILL <ip:port> | KILL [ID <id>] [ADDR <ip:port>] [LADDR <ip:port>] [USER <name>] [TYPE NORMAL|PUBSUB] [SKIPME YES|NO]",
            "REPLY ON|OFF|SKIP",
            "NO-EVICT ON|OFF",
            "PAUSE <timeout> [WRITE|ALL]",
            "UNPAUSE",
        ];
        super::write_help(context, &lines);
    } else {
        return Err(arity_error());
    }
    Ok(())
}

/// Brings the connection's own entry up to date (it is otherwise refreshed
/// after its batch), so that it shows the command running now.
fn refresh_own_entry(context: &Context, command: &str) -> Option<Arc<ClientEntry>> {
    let entry = context.session.client.clone()?;
    refresh_client_state(
        &mut entry.state.lock(),
        context.session,
        context.out.protocol(),
        command,
        context.now_ms,
    );
    Some(entry)
}

/// Copies what CLIENT LIST shows of a connection from its session.
pub fn refresh_client_state(
    state: &mut ClientState,
    session: &Session,
    protocol: Protocol,
    command: &str,
    now_ms: u64,
) {
    fn copy(target: &mut String, source: Option<&[u8]>) {
        let source = source.unwrap_or_default();
        // Once a batch, and most often two empty names.
        if !crate::same_bytes(target.as_bytes(), source) {
            *target = String::from_utf8_lossy(source).into_owned();
        }
    }
    copy(&mut state.name, session.name.as_deref());
    copy(&mut state.library_name, session.library_name.as_deref());
    copy(&mut state.library_version, session.library_version.as_deref());
    copy(&mut state.user, Some(session.user.as_bytes()));
    copy(&mut state.last_command, Some(command.as_bytes()));
    state.resp = if protocol == Protocol::Resp3 { 3 } else { 2 };
    state.last_active_ms = now_ms;
    let (channels, patterns, shard_channels) =
        session.subscription.as_ref().map_or((0, 0, 0), |subscription| subscription.counts());
    (state.channels, state.patterns, state.shard_channels) = (channels, patterns, shard_channels);
    state.multi = session.transaction.as_ref().map_or(-1, |transaction| transaction.len() as i64);
    state.flags.clear();
    if channels + patterns + shard_channels > 0 {
        state.flags.push('P');
    }
    if session.transaction.is_some() {
        state.flags.push('x');
    }
    if session.blocked.is_some() {
        state.flags.push('b');
    }
    if session.no_evict {
        state.flags.push('e');
    }
}

/// Whether a client is of a TYPE filter's kind (one checked known). No
/// client is a master or a replica: replication runs over peer links.
fn client_type_matches(entry: &ClientEntry, kind: &[u8]) -> bool {
    let subscriber = entry.state.lock().flags.contains('P');
    (is(kind, "pubsub") && subscriber) || (is(kind, "normal") && !subscriber)
}

fn client_list(context: &mut Context, request: &Request) -> CommandResult<String> {
    let (mut kind, mut ids) = (None, Vec::new());
    let mut index = 2;
    while index < request.len() {
        if is(request.arg(index), "type") && index + 1 < request.len() {
            kind = Some(request.arg(index + 1));
            index += 2;
        } else if is(request.arg(index), "id") && index + 1 < request.len() && kind.is_none() {
            index += 1;
            while index < request.len() {
                match parse_i64(request.arg(index)) {
                    Ok(id) if id > 0 => ids.push(id as u64),
                    _ => return Err(CommandError::Other("Invalid client ID".into())),
                }
                index += 1;
            }
        } else {
            return Err(CommandError::Syntax);
        }
    }
    if let Some(kind) = kind {
        client_type_matches_known(kind)?;
    }
    refresh_own_entry(context, "client|list");
    let mut text = String::new();
    for entry in context.node.clients.all() {
        if (!ids.is_empty() && !ids.contains(&entry.id))
            || kind.is_some_and(|kind| !client_type_matches(&entry, kind))
        {
            continue;
        }
        text.push_str(&entry.line(context.now_ms));
    }
    Ok(text)
}

/// A TYPE filter's name is one Redis knows.
fn client_type_matches_known(kind: &[u8]) -> CommandResult {
    let known = ["normal", "pubsub", "master", "replica", "slave"];
    if known.iter().any(|name| is(kind, name)) {
        Ok(())
    } else {
        Err(CommandError::Other(format!("Unknown client type '{}'", String::from_utf8_lossy(kind))))
    }
}

/// CLIENT KILL, the old form (an address: OK or an error) and the new
/// (filters: the number of clients closed).
fn client_kill(context: &mut Context, request: &Request) -> CommandResult {
    let own_id = context.session.id;
    if request.len() == 3 {
        let address = request.arg(2);
        let Some(entry) =
            context.node.clients.all().into_iter().find(|entry| entry.address.as_bytes() == address)
        else {
            return Err(CommandError::Other("No such client".into()));
        };
        entry.kill();
        context.out.ok();
        return Ok(());
    }
    if !request.len().is_multiple_of(2) {
        return Err(CommandError::Syntax);
    }
    let (mut id, mut address, mut local, mut user, mut kind, mut skip_me) =
        (None, None, None, None, None, true);
    for pair in (2..request.len()).step_by(2) {
        let (option, value) = (request.arg(pair), request.arg(pair + 1));
        if is(option, "id") {
            id = Some(
                parse_i64(value)
                    .ok()
                    .filter(|id| *id > 0)
                    .ok_or_else(|| CommandError::Other("client-id should be greater than 0".into()))?
                    as u64,
            );
        } else if is(option, "addr") {
            address = Some(value);
        } else if is(option, "laddr") {
            local = Some(value);
        } else if is(option, "user") {
            if context.node.acl.user(&String::from_utf8_lossy(value)).is_none() {
                return Err(CommandError::Other(format!(
                    "No such user '{}'",
                    String::from_utf8_lossy(value)
                )));
            }
            user = Some(value);
        } else if is(option, "type") {
            client_type_matches_known(value)?;
            kind = Some(value);
        } else if is(option, "skipme") {
            skip_me = if is(value, "yes") {
                true
            } else if is(value, "no") {
                false
            } else {
                return Err(CommandError::Syntax);
            };
        } else {
            return Err(CommandError::Syntax);
        }
    }
    let mut killed = 0;
    for entry in context.node.clients.all() {
        let matches = id.is_none_or(|id| entry.id == id)
            && address.is_none_or(|address| entry.address.as_bytes() == address)
            && local.is_none_or(|local| entry.local_address.as_bytes() == local)
            && user.is_none_or(|user| entry.state.lock().user.as_bytes() == user)
            && kind.is_none_or(|kind| client_type_matches(&entry, kind))
            && !(skip_me && entry.id == own_id);
        if matches {
            entry.kill();
            killed += 1;
        }
    }
    context.out.integer(killed);
    Ok(())
}

/// An ON or OFF argument.
fn on_or_off(arg: &[u8]) -> CommandResult<bool> {
    if is(arg, "on") {
        Ok(true)
    } else if is(arg, "off") {
        Ok(false)
    } else {
        Err(CommandError::Syntax)
    }
}
