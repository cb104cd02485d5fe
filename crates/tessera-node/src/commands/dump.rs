//! DUMP, RESTORE and a node's own MIGRATE in Redis's serialization format
//! ([`crate::rdb`]), so that values move between Tessera and Redis both
//! ways (`redis-cli --cluster import`, MIGRATE from either side).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use bytes::Bytes;
use tessera_wire::{encode_command, Request};

use super::scripting::{spawn, ScriptOutcome};
use super::{answer, integer_arg, is, Context};
use crate::error::{CommandError, CommandResult};
use crate::hashed::{self, Layout};
use crate::list::{End, List};
use crate::rdb::{self, Value};
use crate::typed::{read_live, set_deadline, write, Kind};
use crate::zset::SortedSet;

/// The value at `key` as the format carries it, and its deadline.
pub fn read_value(context: &Context, key: &[u8]) -> CommandResult<Option<(Value, Option<u64>)>> {
    crate::backup::read_value_in(context.engine(key), key, context.now_ms)
}

/// Writes `value` at `key` in place of whatever was there. The caller holds
/// the key's lock.
pub fn store_value(context: &Context, key: &[u8], value: Value, expires_at_ms: Option<u64>) -> CommandResult {
    let engine = context.engine(key);
    let reserved = &context.table(key).reserved;
    let now = context.now_ms;
    if let Value::String(bytes) = &value {
        return Ok(write(engine, key, Kind::String, expires_at_ms, bytes, usize::MAX)?);
    }
    // A collection is built anew: a value left at the key would be opened.
    engine.delete(key)?;
    match value {
        Value::String(_) => unreachable!("written above"),
        Value::List(elements) => {
            let mut list = List::open_or_new(engine, key, now)?;
            for element in elements {
                list.push(End::Back, element)?;
            }
            list.commit(reserved)?;
        }
        Value::Set(members) => {
            let entries = members.into_iter().map(|member| (member, Bytes::new()));
            hashed::store(Layout::Set, engine, key, entries, None, now, reserved)?;
        }
        Value::Hash(entries) => {
            hashed::store(Layout::Hash, engine, key, entries, None, now, reserved)?;
        }
        Value::SortedSet(entries) => {
            let mut set = SortedSet::open_or_new(engine, key, now)?;
            for (score, member) in &entries {
                set.insert(member, *score)?;
            }
            set.commit(reserved)?;
        }
    }
    // A collection's deadline is in the value at its key, as EXPIRE sets it.
    if expires_at_ms.is_some() {
        set_deadline(engine, key, expires_at_ms)?;
    }
    context.node.waiters.signal(key);
    Ok(())
}

pub fn dump(context: &mut Context, request: &Request) -> CommandResult {
    match read_value(context, request.arg(1))? {
        Some((value, _)) => context.out.bulk(&rdb::dump(&value)),
        None => context.out.null(),
    }
    Ok(())
}

/// `RESTORE key ttl payload [REPLACE] [ABSTTL] [IDLETIME s] [FREQ f]`, checked
/// in Redis's order: options, then the key's absence, the TTL, the payload.
pub fn restore(context: &mut Context, request: &Request) -> CommandResult {
    let (mut replace, mut absolute, mut idle_seconds, mut frequency_given) = (false, false, None, false);
    let mut at = 4;
    while at < request.len() {
        let (option, more) = (request.arg(at), at + 1 < request.len());
        if is(option, "replace") {
            replace = true;
        } else if is(option, "absttl") {
            absolute = true;
        } else if is(option, "idletime") && more && !frequency_given {
            let idle = integer_arg(request, at + 1)?;
            if idle < 0 {
                return Err(CommandError::Other("Invalid IDLETIME value, must be >= 0".into()));
            }
            idle_seconds = Some(idle as u64);
            at += 1;
        } else if is(option, "freq") && more && idle_seconds.is_none() {
            // Kept by Redis under an LFU policy only, which Tessera has not.
            let count = integer_arg(request, at + 1)?;
            if !(0..=255).contains(&count) {
                return Err(CommandError::Other("Invalid FREQ value, must be >= 0 and <= 255".into()));
            }
            frequency_given = true;
            at += 1;
        } else {
            return Err(CommandError::Syntax);
        }
        at += 1;
    }
    let key = request.arg(1);
    let _lock = context.lock_key(key)?;
    let exists = read_live(context.engine(key), key, context.now_ms)?.is_some();
    if exists && !replace {
        return Err(CommandError::BusyKey);
    }
    let ttl = integer_arg(request, 2)?;
    if ttl < 0 {
        return Err(CommandError::Other("Invalid TTL value, must be >= 0".into()));
    }
    let value = rdb::restore(request.arg(3), context.bulk_bytes_max()).map_err(|error| {
        tracing::debug!(%error, ?error, "RESTORE refused a payload");
        CommandError::Other(error.to_string())
    })?;
    let deadline = match ttl {
        0 => None,
        ttl if absolute => Some(ttl as u64),
        ttl => Some(context.now_ms.saturating_add(ttl as u64)),
    };
    if deadline.is_some_and(|deadline| deadline <= context.now_ms) {
        // Already past: as in Redis, the key is replaced by nothing.
        if exists {
            context.engine(key).delete(key)?;
        }
    } else {
        store_value(context, key, value, deadline)?;
        if let Some(idle) = idle_seconds {
            context.node.access.touch(key, context.now_ms.saturating_sub(idle.saturating_mul(1000)));
        }
    }
    context.out.ok();
    Ok(())
}

/// What MIGRATE was asked to do.
struct Migration {
    address: String,
    database: i64,
    timeout: Duration,
    copy: bool,
    replace: bool,
    /// `(user, password)`; the user is absent for AUTH's one-argument form.
    login: Option<(Option<Bytes>, Bytes)>,
    keys: Vec<Bytes>,
}

impl Migration {
    /// Parses as Redis does: options in any order, KEYS last.
    fn parse(request: &Request) -> CommandResult<Self> {
        let (mut copy, mut replace, mut login, mut keys) = (false, false, None, None);
        let mut at = 6;
        while at < request.len() {
            let (option, more) = (request.arg(at), request.len() - at - 1);
            if is(option, "copy") {
                copy = true;
            } else if is(option, "replace") {
                replace = true;
            } else if is(option, "auth") && more >= 1 {
                login = Some((None, Bytes::copy_from_slice(request.arg(at + 1))));
                at += 1;
            } else if is(option, "auth2") && more >= 2 {
                let user = Bytes::copy_from_slice(request.arg(at + 1));
                login = Some((Some(user), Bytes::copy_from_slice(request.arg(at + 2))));
                at += 2;
            } else if is(option, "keys") {
                debug_assert_eq!(migrate_keys_at(request.len(), |index| request.arg(index)), Some(at + 1));
                if !request.arg(3).is_empty() {
                    return Err(CommandError::Other(
                        "When using MIGRATE KEYS option, the key argument must be set to the empty string"
                            .into(),
                    ));
                }
                keys = Some(request.args().skip(at + 1).map(Bytes::copy_from_slice).collect());
                break;
            } else {
                return Err(CommandError::Syntax);
            }
            at += 1;
        }
        let timeout = integer_arg(request, 5)?;
        let database = integer_arg(request, 4)?;
        let timeout = Duration::from_millis(if timeout <= 0 { 1000 } else { timeout as u64 });
        let host = String::from_utf8_lossy(request.arg(1));
        let port = std::str::from_utf8(request.arg(2)).ok().and_then(|port| port.parse::<u16>().ok());
        let port = port.ok_or_else(|| CommandError::Other("Invalid port".into()))?;
        let address = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        let keys = keys.unwrap_or_else(|| vec![Bytes::copy_from_slice(request.arg(3))]);
        Ok(Self { address, database, timeout, copy, replace, login, keys })
    }
}

/// Where MIGRATE's KEYS list starts, if it has one (AUTH's and AUTH2's
/// arguments are stepped over, as Redis does).
pub fn migrate_keys_at<'r>(count: usize, arg: impl Fn(usize) -> &'r [u8]) -> Option<usize> {
    let mut at = 6;
    while at < count {
        let option = arg(at);
        if is(option, "keys") {
            return Some(at + 1);
        }
        at += if is(option, "auth2") {
            3
        } else if is(option, "auth") {
            2
        } else {
            1
        };
    }
    None
}

/// The longest line a MIGRATE target may answer with.
const TARGET_REPLY_MAX: u64 = 64 << 10;

/// `MIGRATE host port key|"" db timeout [COPY] [REPLACE] [AUTH …] [KEYS …]`
/// on a node outside a cluster: the keys go to another server (Redis, or
/// another Tessera node) as RESTORE commands, and leave here once the
/// target has taken them, unless COPY. Runs on a script thread, since it
/// waits on the network, holding the keys' locks as Redis holds its whole
/// server.
pub fn migrate(context: &mut Context, request: &Request) -> CommandResult {
    let migration = Migration::parse(request)?;
    spawn(context, move |mut detached| ScriptOutcome {
        written: None,
        reply: detached
            .run(None, false, |context| answer(context, |context| migrate_now(context, &migration))),
        waits: Vec::new(),
    });
    Ok(())
}

fn migrate_now(context: &mut Context, migration: &Migration) -> CommandResult {
    let _locks = context.lock_keys(migration.keys.iter().map(|key| &key[..]))?;
    let mut moving = Vec::new();
    for key in &migration.keys {
        if let Some((value, deadline)) = read_value(context, key)? {
            // A relative TTL, at least 1 ms (0 would mean none).
            let ttl = deadline.map_or(0, |deadline| deadline.saturating_sub(context.now_ms).max(1));
            moving.push((key, rdb::dump(&value), ttl));
        }
    }
    if moving.is_empty() {
        context.out.simple("NOKEY");
        return Ok(());
    }
    let mut commands = Vec::new();
    if let Some((user, password)) = &migration.login {
        let mut auth: Vec<&[u8]> = vec![b"AUTH"];
        auth.extend(user.as_deref());
        auth.push(password);
        encode_command(&auth, &mut commands);
    }
    let database = migration.database.to_string();
    encode_command(&[&b"SELECT"[..], database.as_bytes()], &mut commands);
    for (key, payload, ttl) in &moving {
        let ttl = ttl.to_string();
        let mut restore: Vec<&[u8]> = vec![b"RESTORE", key, ttl.as_bytes(), payload];
        if migration.replace {
            restore.push(b"REPLACE");
        }
        encode_command(&restore, &mut commands);
    }
    let io_error = |doing: &str| CommandError::Timeout(format!("error or timeout {doing} target instance"));
    let address = migration
        .address
        .to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .ok_or_else(|| CommandError::Timeout("error or timeout connecting to the client".into()))?;
    let mut stream = TcpStream::connect_timeout(&address, migration.timeout)
        .map_err(|_| CommandError::Timeout("error or timeout connecting to the client".into()))?;
    stream.set_read_timeout(Some(migration.timeout)).map_err(|_| io_error("reading to"))?;
    stream.set_write_timeout(Some(migration.timeout)).map_err(|_| io_error("writing to"))?;
    stream.write_all(&commands).map_err(|_| io_error("writing to"))?;
    let mut replies = BufReader::new(stream);
    let mut read_reply = || -> CommandResult<Result<(), String>> {
        let mut line = Vec::new();
        (&mut replies)
            .take(TARGET_REPLY_MAX)
            .read_until(b'\n', &mut line)
            .map_err(|_| io_error("reading to"))?;
        match line.strip_suffix(b"\r\n") {
            Some([b'+', ..]) => Ok(Ok(())),
            Some([b'-', error @ ..]) => Ok(Err(String::from_utf8_lossy(error).into_owned())),
            _ => Err(io_error("reading to")),
        }
    };
    let target_error =
        |error: String| CommandError::Other(format!("Target instance replied with error: {error}"));
    // AUTH's and SELECT's replies: an error ends the migration.
    for _ in 0..1 + usize::from(migration.login.is_some()) {
        read_reply()?.map_err(target_error)?;
    }
    let mut first_error = None;
    for (key, _, _) in &moving {
        match read_reply()? {
            Ok(()) if !migration.copy => {
                context.engine(key).delete(key)?;
            }
            Ok(()) => {}
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    match first_error {
        Some(error) => Err(target_error(error)),
        None => {
            context.out.ok();
            Ok(())
        }
    }
}
