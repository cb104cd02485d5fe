//! `tessera backup` and `tessera restore` (docs/OPERATIONS.md, "Backup and
//! restore").
//!
//! A backup of a cluster asks each group's head for its group (BACKUP.START
//! SHARD n), each at one write position while it serves, and fetches each
//! file a piece at a time (BACKUP.READ): one RDB file per group, which Redis
//! loads too, and a manifest with the tables and each group's position,
//! written last, so that a directory without one is not a backup. A node
//! outside a cluster gives one file of all its tables.
//!
//! A restore creates the manifest's tables and loads every file through the
//! node it is given, as `import-rdb` does: into an empty node or cluster of
//! any size, since each key finds its own group.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_bench::progress::Progress;
use tessera_wire::{Client, Value};

use crate::import_rdb::{self, ImportOptions};
use crate::{connect, connect_to, ConnectionArgs};

pub const MANIFEST_FILE: &str = "manifest.json";
/// How often a running job's status is asked.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// What a backup directory holds besides its files.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: u32,
    pub taken_at_unix_ms: u64,
    pub source: String,
    pub cluster: bool,
    pub tables: Vec<TableEntry>,
    /// ACL LIST's lines (passwords as their SHA-256 hashes).
    #[serde(default)]
    pub users: Vec<String>,
    pub files: Vec<FileEntry>,
}

/// A table as TABLE.INFO describes it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct TableEntry {
    pub name: String,
    /// As TABLE.INFO shows it: `\xNN` escapes for bytes that are not printable.
    pub prefix: String,
    pub engine: String,
    pub options: BTreeMap<String, String>,
    /// `ms+sc`, `aa+ec`, …; `None` outside a cluster.
    pub mode: Option<String>,
    pub partition: Option<String>,
}

/// One group's file.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub file: String,
    /// The group (none for a node outside a cluster) and the node it was read on.
    pub shard: Option<u32>,
    pub node: String,
    /// The write position the group's keys are at.
    pub position: Option<u64>,
    pub keys: u64,
    pub bytes: u64,
}

fn command(client: &mut Client, args: &[&str]) -> Result<Value, String> {
    match client.command(args).map_err(|error| error.to_string())? {
        Value::Error(message) => Err(format!("{}: {message}", args.join(" "))),
        value => Ok(value),
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::Bulk(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::Simple(text) => text.clone(),
        Value::Integer(number) => number.to_string(),
        other => format!("{other:?}"),
    }
}

fn integer(value: &Value) -> Result<i64, String> {
    match value {
        Value::Integer(number) => Ok(*number),
        other => Err(format!("expected an integer, got {other:?}")),
    }
}

/// A reply of name–value pairs (a RESP2 array or a RESP3 map) by name.
fn fields(value: Value) -> Result<BTreeMap<String, Value>, String> {
    let items = match value {
        Value::Array(items) => items,
        Value::Map(pairs) => pairs.into_iter().flat_map(|(name, value)| [name, value]).collect(),
        other => return Err(format!("expected fields, got {other:?}")),
    };
    let mut fields = BTreeMap::new();
    let mut items = items.into_iter();
    while let (Some(name), Some(value)) = (items.next(), items.next()) {
        fields.insert(text(&name), value);
    }
    Ok(fields)
}

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
}

fn tables(client: &mut Client, cluster: bool) -> Result<(Vec<TableEntry>, BTreeSet<u32>), String> {
    let Value::Array(names) = command(client, &["TABLE.LIST"])? else {
        return Err("TABLE.LIST answered something else than a list".into());
    };
    let (mut tables, mut shards) = (Vec::new(), BTreeSet::new());
    for name in names.iter().map(text) {
        let info = fields(command(client, &["TABLE.INFO", &name])?)?;
        let field = |name: &str| info.get(name).map(text).unwrap_or_default();
        let options = field("options")
            .split_whitespace()
            .filter_map(|pair| pair.split_once('='))
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        if let Some(Value::Array(listed)) = info.get("shards") {
            shards.extend(
                listed.iter().filter_map(|line| text(line).split_whitespace().next()?.parse::<u32>().ok()),
            );
        }
        tables.push(TableEntry {
            name: name.clone(),
            prefix: field("prefix"),
            engine: field("engine"),
            options,
            mode: cluster.then(|| field("mode")),
            partition: cluster.then(|| field("partition")),
        });
    }
    Ok((tables, shards))
}

/// Each node's address and the groups it heads, from CLUSTER NODES and
/// each node's INFO replication (`groupN:...,role=head,...`).
fn heads(connection: &ConnectionArgs, client: &mut Client) -> Result<BTreeMap<u32, String>, String> {
    let nodes = text(&command(client, &["CLUSTER", "NODES"])?);
    let mut heads = BTreeMap::new();
    for line in nodes.lines() {
        let Some(address) = line.split_whitespace().nth(1) else { continue };
        let address = address.split('@').next().unwrap_or(address).to_string();
        if line.contains("fail") && !line.contains("fail?") {
            continue;
        }
        let Ok(mut node) = connect_to(connection, &address) else { continue };
        let info = text(&command(&mut node, &["INFO", "replication"])?);
        for line in info.lines() {
            let Some((group, details)) = line.strip_prefix("group").and_then(|rest| rest.split_once(':'))
            else {
                continue;
            };
            if details.split(',').any(|field| field == "role=head") {
                if let Ok(shard) = group.parse() {
                    heads.insert(shard, address.clone());
                }
            }
        }
    }
    Ok(heads)
}

/// A job started on a node, and where its file goes.
struct Pending {
    node: String,
    shard: Option<u32>,
    file: String,
    job: String,
}

pub fn backup(connection: &ConnectionArgs, to: &Path) -> Result<(), String> {
    if to.join(MANIFEST_FILE).exists() {
        return Err(format!("{} holds a backup already; choose another directory", to.display()));
    }
    fs::create_dir_all(to).map_err(|error| format!("{}: {error}", to.display()))?;
    let mut client = connect(connection)?;
    let info = text(&command(&mut client, &["INFO", "cluster"])?);
    let cluster = info_field(&info, "cluster_enabled") == Some("1");
    let (tables, shards) = tables(&mut client, cluster)?;
    let Value::Array(users) = command(&mut client, &["ACL", "LIST"])? else {
        return Err("ACL LIST answered something else than a list".into());
    };
    let users: Vec<String> = users.iter().map(text).collect();
    // Each node runs one backup at a time: its groups go one after another,
    // the nodes side by side.
    let mut queues: BTreeMap<String, Vec<Option<u32>>> = BTreeMap::new();
    if cluster {
        let heads = heads(connection, &mut client)?;
        for shard in &shards {
            let head = heads.get(shard).ok_or_else(|| {
                format!("group {shard} has no head now (a failover under way?); try again in a moment")
            })?;
            queues.entry(head.clone()).or_default().push(Some(*shard));
        }
    } else {
        queues.insert(connection.addr().to_string(), vec![None]);
    }
    let groups = queues.values().map(Vec::len).sum::<usize>() as u64;
    println!("backing up {groups} group(s) from {} node(s) to {}", queues.len(), to.display());
    let progress = Progress::new("groups", Some(groups));
    let mut clients: BTreeMap<String, Client> = BTreeMap::new();
    for node in queues.keys() {
        clients.insert(node.clone(), connect_to(connection, node)?);
    }
    let mut running: BTreeMap<String, Pending> = BTreeMap::new();
    let mut files = Vec::new();
    loop {
        for (node, queue) in &mut queues {
            if running.contains_key(node) || queue.is_empty() {
                continue;
            }
            let shard = queue.remove(0);
            let node_client = clients.get_mut(node).expect("connected above");
            let job = match shard {
                Some(shard) => command(node_client, &["BACKUP.START", "SHARD", &shard.to_string()])?,
                None => command(node_client, &["BACKUP.START"])?,
            };
            let file = shard.map_or_else(|| "node.rdb".to_string(), |shard| format!("group-{shard}.rdb"));
            let job = integer(&job)?.to_string();
            running.insert(node.clone(), Pending { node: node.clone(), shard, file, job });
        }
        if running.is_empty() {
            break;
        }
        std::thread::sleep(POLL_EVERY);
        let mut finished = Vec::new();
        for (node, pending) in &running {
            let node_client = clients.get_mut(node).expect("connected above");
            let status = fields(command(node_client, &["BACKUP.STATUS", &pending.job])?)?;
            match status.get("state").map(text).as_deref() {
                Some("running") => {}
                Some("done") => finished.push((node.clone(), status)),
                _ => {
                    let error = status.get("error").map(text).unwrap_or_default();
                    return Err(format!("the backup on {node} failed: {error}"));
                }
            }
        }
        for (node, status) in finished {
            let pending = running.remove(&node).expect("finished is running");
            let node_client = clients.get_mut(&node).expect("connected above");
            let entry = fetch(node_client, &pending, &status, to)?;
            progress.advance(1, &format!("{} ({} keys)", entry.file, entry.keys));
            files.push(entry);
        }
    }
    progress.finish();
    files.sort_by_key(|entry| entry.shard);
    let taken_at_unix_ms = tessera_node::clock::now_ms();
    let manifest = Manifest {
        format: 1,
        taken_at_unix_ms,
        source: connection.addr().to_string(),
        cluster,
        tables,
        users,
        files,
    };
    let keys: u64 = manifest.files.iter().map(|entry| entry.keys).sum();
    let json = serde_json::to_string_pretty(&manifest).map_err(|error| error.to_string())?;
    write_synced(&to.join(MANIFEST_FILE), json.as_bytes())?;
    println!("backed up {keys} keys in {} file(s) to {}", manifest.files.len(), to.display());
    Ok(())
}

/// Copies a finished job's file into `to`, then has the node delete it;
/// `status` is what BACKUP.STATUS said of it once it was done.
fn fetch(
    client: &mut Client,
    pending: &Pending,
    status: &BTreeMap<String, Value>,
    to: &Path,
) -> Result<FileEntry, String> {
    let keys = status.get("keys").map(integer).transpose()?.unwrap_or(0) as u64;
    let expected = status.get("file-bytes").map(integer).transpose()?.unwrap_or(0) as u64;
    let position = match (pending.shard, status.get("positions")) {
        (Some(shard), Some(Value::Array(positions))) => positions.iter().find_map(|pair| match pair {
            Value::Array(pair) if pair.len() == 2 && integer(&pair[0]).ok() == Some(i64::from(shard)) => {
                integer(&pair[1]).ok().map(|position| position as u64)
            }
            _ => None,
        }),
        _ => None,
    };
    let path = to.join(&pending.file);
    let partial = path.with_extension("rdb.partial");
    let mut out = File::create(&partial).map_err(|error| format!("{}: {error}", partial.display()))?;
    let mut offset = 0u64;
    loop {
        let piece = match command(client, &["BACKUP.READ", &pending.job, &offset.to_string()])? {
            Value::Bulk(bytes) => bytes,
            other => return Err(format!("BACKUP.READ answered {other:?}")),
        };
        if piece.is_empty() {
            break;
        }
        out.write_all(&piece).map_err(|error| format!("{}: {error}", partial.display()))?;
        offset += piece.len() as u64;
    }
    if offset != expected {
        return Err(format!("{}: fetched {offset} bytes of {expected} from {}", pending.file, pending.node));
    }
    out.sync_all().map_err(|error| format!("{}: {error}", partial.display()))?;
    fs::rename(&partial, &path).map_err(|error| format!("{}: {error}", path.display()))?;
    command(client, &["BACKUP.DROP", &pending.job])?;
    Ok(FileEntry {
        file: pending.file.clone(),
        shard: pending.shard,
        node: pending.node.clone(),
        position,
        keys,
        bytes: offset,
    })
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let partial = path.with_extension("partial");
    let mut file = File::create(&partial).map_err(|error| format!("{}: {error}", partial.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|error| format!("{}: {error}", partial.display()))?;
    fs::rename(&partial, path).map_err(|error| format!("{}: {error}", path.display()))
}

pub fn read_manifest(from: &Path) -> Result<Manifest, String> {
    let path = from.join(MANIFEST_FILE);
    let json = fs::read_to_string(&path).map_err(|error| {
        format!("{}: {error} (a backup directory without one is incomplete)", path.display())
    })?;
    serde_json::from_str(&json).map_err(|error| format!("{}: {error}", path.display()))
}

/// `replace`: keys that exist already are overwritten (otherwise they are
/// left, reported, and the restore fails once every file was loaded).
pub fn restore(connection: &ConnectionArgs, from: &Path, replace: bool) -> Result<(), String> {
    let manifest = read_manifest(from)?;
    let mut client = connect(connection)?;
    let info = text(&command(&mut client, &["INFO", "cluster"])?);
    let cluster = info_field(&info, "cluster_enabled") == Some("1");
    let Value::Array(existing) = command(&mut client, &["TABLE.LIST"])? else {
        return Err("TABLE.LIST answered something else than a list".into());
    };
    let existing: BTreeSet<String> = existing.iter().map(text).collect();
    for table in manifest.tables.iter().filter(|table| table.name != "default") {
        if existing.contains(&table.name) {
            println!("table {} exists; its keys load into it as it is", table.name);
            continue;
        }
        create_table(&mut client, table, cluster)?;
        println!("created table {} (prefix '{}', engine {})", table.name, table.prefix, table.engine);
    }
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in &manifest.files {
        let path = from.join(&entry.file);
        let bytes = fs::metadata(&path).map_err(|error| format!("{}: {error}", path.display()))?.len();
        if bytes != entry.bytes {
            return Err(format!("{}: {bytes} bytes where the manifest says {}", path.display(), entry.bytes));
        }
        paths.push(path);
    }
    let mut failed = Vec::new();
    for path in &paths {
        if let Err(error) = import_rdb::run(path, &mut client, &ImportOptions { db: 0, replace }) {
            failed.push(format!("{}: {error}", path.display()));
        }
    }
    // The users last: a restore that changes the password it logged in with
    // goes on, logged in, on its connection.
    for user in &manifest.users {
        let words: Vec<&str> = user.split_whitespace().collect();
        let ["user", name, rules @ ..] = words.as_slice() else {
            return Err(format!("the manifest names a user as '{user}', not as ACL LIST does"));
        };
        let mut args = vec!["ACL", "SETUSER", name, "reset"];
        args.extend(rules);
        command(&mut client, &args)?;
    }
    if !manifest.users.is_empty() {
        println!("restored {} users", manifest.users.len());
    }
    if !failed.is_empty() {
        return Err(format!(
            "{} of {} files did not load whole:\n  {}",
            failed.len(),
            paths.len(),
            failed.join("\n  ")
        ));
    }
    let keys: u64 = manifest.files.iter().map(|entry| entry.keys).sum();
    println!("restored {keys} keys from {} file(s) of {}", paths.len(), from.display());
    Ok(())
}

fn create_table(client: &mut Client, table: &TableEntry, cluster: bool) -> Result<(), String> {
    let prefix = tessera_wire::prefix::unescape_prefix(&table.prefix)
        .ok_or_else(|| format!("table {}: the prefix '{}' is not escaped text", table.name, table.prefix))?;
    let mut args: Vec<Vec<u8>> = vec![
        b"TABLE.CREATE".to_vec(),
        table.name.clone().into_bytes(),
        b"PREFIX".to_vec(),
        prefix,
        b"ENGINE".to_vec(),
        table.engine.clone().into_bytes(),
    ];
    if cluster && table.partition.as_deref() == Some("range") {
        args.extend([b"PARTITION".to_vec(), b"RANGE".to_vec()]);
    }
    for (name, value) in &table.options {
        args.extend([name.clone().into_bytes(), value.clone().into_bytes()]);
    }
    if let Value::Error(message) = client.command(&args).map_err(|error| error.to_string())? {
        return Err(format!("TABLE.CREATE {}: {message}", table.name));
    }
    let mode = table.mode.as_deref().filter(|_| cluster);
    if let Some((topology, consistency)) = mode.and_then(|mode| mode.split_once('+')) {
        if (topology, consistency) != ("ms", "sc") {
            let consistency = if consistency == "sc" { "strong" } else { "eventual" };
            command(client, &["TABLE.ALTER", &table.name, "TOPOLOGY", topology, "CONSISTENCY", consistency])?;
        }
    }
    Ok(())
}
