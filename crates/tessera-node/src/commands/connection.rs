//! Connection commands: PING, ECHO, HELLO, AUTH, SELECT, QUIT, CLIENT.

use bytes::Bytes;
use tessera_wire::{Protocol, Request};

use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::acl::DEFAULT_USER;
use crate::error::{CommandError, CommandResult};
use crate::REDIS_COMPATIBLE_VERSION;

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "ping", arity: -1, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: ping },
    CommandSpec { name: "echo", arity: 2, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: echo },
    CommandSpec { name: "hello", arity: -1, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: hello },
    CommandSpec { name: "auth", arity: -2, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: auth },
    CommandSpec { name: "select", arity: 2, flags: &["fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: select },
    CommandSpec { name: "quit", arity: -1, flags: &["noauth", "fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: quit },
    CommandSpec { name: "client", arity: -2, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: client },
];

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
    out.bulk(b"standalone");
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
        let text = format!(
            "id={} name={} lib-name={} lib-ver={} resp={}\n",
            context.session.id,
            String::from_utf8_lossy(context.session.name.as_deref().unwrap_or_default()),
            String::from_utf8_lossy(context.session.library_name.as_deref().unwrap_or_default()),
            String::from_utf8_lossy(context.session.library_version.as_deref().unwrap_or_default()),
            if context.out.protocol() == Protocol::Resp3 { 3 } else { 2 },
        );
        context.out.verbatim(&text);
    } else if is(subcommand, "help") {
        let lines = [
            "CLIENT <subcommand>",
            "ID",
            "GETNAME",
            "SETNAME <name>",
            "SETINFO <LIB-NAME|LIB-VER> <value>",
            "INFO",
        ];
        context.out.array(lines.len());
        for line in lines {
            context.out.simple(line);
        }
    } else {
        return Err(arity_error());
    }
    Ok(())
}
