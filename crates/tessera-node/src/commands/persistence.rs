//! SAVE, BGSAVE and LASTSAVE as Redis answers them, over Tessera's backups
//! ([`crate::backup`]), and the BACKUP commands `tessera backup` fetches a
//! group's file with.

use std::io::{Read, Seek, SeekFrom};
use std::sync::atomic::Ordering;

use tessera_wire::Request;

use super::{integer_arg, is, CommandSpec, Context, Scope};
use crate::backup::{self, Backups, Body, Job, Target};
use crate::error::{CommandError, CommandResult};

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "save", arity: 1, flags: &["admin", "noscript", "no_multi"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: save },
    CommandSpec { name: "bgsave", arity: -1, flags: &["admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: bgsave },
    CommandSpec { name: "lastsave", arity: 1, flags: &["admin", "fast", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: lastsave },
    CommandSpec { name: "backup.start", arity: -1, flags: &["admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: backup_start },
    CommandSpec { name: "backup.status", arity: 2, flags: &["admin", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: backup_status },
    CommandSpec { name: "backup.read", arity: 3, flags: &["admin", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: backup_read },
    CommandSpec { name: "backup.drop", arity: 2, flags: &["admin", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: backup_drop },
];

/// The most bytes one BACKUP.READ answers.
pub const READ_BYTES_MAX: usize = 1 << 20;

/// How often a waiting SAVE looks whether its job finished.
const SAVE_RECHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// What a job of this node writes: a cluster node's shards (those named,
/// or all it runs), or a node's tables under its write locks.
fn body(context: &Context, shards: Option<Vec<u32>>) -> Body {
    let node = context.node.clone();
    match context.cluster {
        Some(cluster) => {
            let agent = cluster.agent.clone();
            Box::new(move |job: &Job, out: &mut backup::RdbOut| {
                backup::write_shards(&node.backups, &agent, shards, job, out)
            })
        }
        None => Box::new(move |job: &Job, out: &mut backup::RdbOut| {
            let _writes_wait = node.lock_all();
            backup::write_tables(&node.tables(), job, out)
        }),
    }
}

fn start(context: &Context, target: Target, shards: Option<Vec<u32>>) -> CommandResult<std::sync::Arc<Job>> {
    let writes = context.node.worker_total(|worker| &worker.writes);
    Backups::start(&context.node.backups, target, writes, body(context, shards))
        .map_err(|error| CommandError::Other(error.to_string()))
}

/// SAVE: writes dump.rdb and answers once it is written. The connection
/// waits, not the node: other clients go on.
fn save(context: &mut Context, _request: &Request) -> CommandResult {
    if context.session.blocked.is_none() {
        if context.session.deny_blocking {
            return Err(CommandError::Other("SAVE cannot wait inside a transaction or a script".into()));
        }
        start(context, Target::Dump, None)?;
    }
    let stopped_waiting = context.session.blocked.as_ref().is_some_and(|blocked| blocked.timed_out);
    match context.node.backups.running() {
        // Only a connection that stops waiting (none has a deadline here)
        // answers before the job ends.
        Some(_) if stopped_waiting => {
            context.session.blocked = None;
            return Err(CommandError::Other(
                "SAVE stopped waiting; the save goes on, and LASTSAVE tells when it is done".into(),
            ));
        }
        Some(_) => {
            context.session.blocked = Some(crate::blocking::Blocked {
                keys: Vec::new(),
                deadline: None,
                timed_out: false,
                recheck: Some(SAVE_RECHECK),
            });
        }
        None => {
            context.session.blocked = None;
            let (_, last_failed, _) = context.node.backups.status();
            if last_failed {
                return Err(CommandError::Other("the save failed; the node's log says why".into()));
            }
            context.out.ok();
        }
    }
    Ok(())
}

/// BGSAVE [SCHEDULE]: starts writing dump.rdb. With no AOF rewrite to wait
/// for, SCHEDULE starts it as plain BGSAVE does.
fn bgsave(context: &mut Context, request: &Request) -> CommandResult {
    match request.len() {
        1 => {}
        2 if is(request.arg(1), "schedule") => {}
        _ => return Err(CommandError::Syntax),
    }
    start(context, Target::Dump, None)?;
    context.out.simple("Background saving started");
    Ok(())
}

fn lastsave(context: &mut Context, _request: &Request) -> CommandResult {
    context.out.integer(context.node.backups.last_success_unix() as i64);
    Ok(())
}

/// BACKUP.START [SHARD id ...]: starts writing a file of this node's keys
/// (the shards named, in a cluster) to be fetched with BACKUP.READ;
/// answers the job's id.
fn backup_start(context: &mut Context, request: &Request) -> CommandResult {
    let shards = match request.len() {
        1 => None,
        count if count >= 3 && is(request.arg(1), "shard") => {
            if context.cluster.is_none() {
                return Err(CommandError::Other(
                    "SHARD names a cluster's shards; this node is not in one".into(),
                ));
            }
            let shards = (2..count)
                .map(|index| integer_arg(request, index).and_then(shard_id))
                .collect::<CommandResult<Vec<u32>>>()?;
            Some(shards)
        }
        _ => return Err(CommandError::Syntax),
    };
    let job = start(context, Target::Spool, shards)?;
    context.out.integer(job.id as i64);
    Ok(())
}

fn shard_id(value: i64) -> CommandResult<u32> {
    u32::try_from(value).map_err(|_| CommandError::Other("a shard id is a non-negative integer".into()))
}

fn job(context: &Context, request: &Request) -> CommandResult<std::sync::Arc<Job>> {
    let id = integer_arg(request, 1)?;
    u64::try_from(id)
        .ok()
        .and_then(|id| context.node.backups.job(id))
        .ok_or_else(|| CommandError::Other(format!("no backup {id} on this node")))
}

/// BACKUP.STATUS id: the job's state (running, done or failed), its
/// progress, and, once done, the file's size and each shard's position.
fn backup_status(context: &mut Context, request: &Request) -> CommandResult {
    let job = job(context, request)?;
    let outcome = job.outcome();
    let state = match &outcome {
        None => "running",
        Some(Ok(_)) => "done",
        Some(Err(_)) => "failed",
    };
    let out = &mut *context.out;
    out.map(8);
    out.bulk(b"state");
    out.bulk(state.as_bytes());
    out.bulk(b"shards");
    out.integer(job.shards_total.load(Ordering::Relaxed) as i64);
    out.bulk(b"shards-done");
    out.integer(job.shards_done.load(Ordering::Relaxed) as i64);
    out.bulk(b"records-received");
    out.integer(job.received.load(Ordering::Relaxed) as i64);
    out.bulk(b"keys");
    out.integer(job.keys.load(Ordering::Relaxed) as i64);
    out.bulk(b"file-bytes");
    out.integer(
        outcome.as_ref().and_then(|outcome| outcome.as_ref().ok()).map_or(0, |done| done.file_bytes) as i64
    );
    out.bulk(b"positions");
    let positions = outcome.as_ref().and_then(|outcome| outcome.as_ref().ok()).map(|done| &done.positions);
    out.array(positions.map_or(0, |positions| positions.len()));
    for (shard, position) in positions.into_iter().flatten() {
        out.array(2);
        out.integer(i64::from(*shard));
        out.integer(*position as i64);
    }
    out.bulk(b"error");
    match &outcome {
        Some(Err(error)) => out.bulk(error.as_bytes()),
        _ => out.null(),
    }
    Ok(())
}

/// BACKUP.READ id offset: up to [`READ_BYTES_MAX`] bytes of a finished
/// job's file from `offset`; an empty string past its end.
fn backup_read(context: &mut Context, request: &Request) -> CommandResult {
    let job = job(context, request)?;
    match job.outcome() {
        Some(Ok(_)) => {}
        None => return Err(CommandError::Other("the backup is still running".into())),
        Some(Err(error)) => return Err(CommandError::Other(format!("the backup failed: {error}"))),
    }
    let offset = u64::try_from(integer_arg(request, 2)?)
        .map_err(|_| CommandError::Other("the offset is a non-negative integer".into()))?;
    let read = || -> std::io::Result<Vec<u8>> {
        let mut file = std::fs::File::open(&job.path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::with_capacity(READ_BYTES_MAX);
        file.take(READ_BYTES_MAX as u64).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    let bytes = read().map_err(|error| CommandError::Other(format!("{}: {error}", job.path.display())))?;
    context.out.bulk(&bytes);
    Ok(())
}

/// BACKUP.DROP id: forgets a finished job and deletes its file.
fn backup_drop(context: &mut Context, request: &Request) -> CommandResult {
    let job = job(context, request)?;
    if !context.node.backups.drop_job(job.id) {
        return Err(CommandError::Other("the backup is still running".into()));
    }
    context.out.ok();
    Ok(())
}
