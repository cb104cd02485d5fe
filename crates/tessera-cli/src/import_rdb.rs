//! `tessera import-rdb`: loads a Redis dump (the RDB file `SAVE` or `BGSAVE`
//! writes) into a running node or cluster, key by key with RESTORE, as
//! `redis-cli --cluster import` moves keys (docs/OPERATIONS.md, "Loading a
//! Redis dump").
//!
//! The whole file is read and checked first (its format, its checksum, that
//! every value is of a type Tessera keeps), so that a file it cannot load
//! writes nothing. Keys then go in pipelined batches; a key that exists is
//! left alone unless `--replace`, and every key not loaded is reported.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use tessera_bench::progress::Progress;
use tessera_node::rdb::{dump, FileReader, RdbError, Value as RdbValue};
use tessera_wire::{Client, Value};

/// The most a value may decode to (Redis's proto-max-bulk-len default).
const VALUE_BYTES_MAX: usize = 512 * 1024 * 1024;
/// Commands per pipelined batch, and bytes: a batch waits for its replies.
const BATCH_COMMANDS: usize = 256;
const BATCH_BYTES: usize = 8 * 1024 * 1024;
/// Keys not loaded named in the report; the rest are counted.
const NAMED_MAX: usize = 10;

pub struct ImportOptions {
    /// The database of the file to load (Tessera has one keyspace).
    pub db: u64,
    /// Overwrite keys that exist (RESTORE ... REPLACE).
    pub replace: bool,
}

fn type_name(value: &RdbValue) -> &'static str {
    match value {
        RdbValue::String(_) => "string",
        RdbValue::List(_) => "list",
        RdbValue::Set(_) => "set",
        RdbValue::Hash(_) => "hash",
        RdbValue::SortedSet(_) => "zset",
    }
}

/// What the file holds, found by reading it whole.
#[derive(Default)]
struct Contents {
    /// Keys of the chosen database, by type.
    by_type: BTreeMap<&'static str, u64>,
    /// Keys of other databases, by database.
    other_dbs: BTreeMap<u64, u64>,
    functions: u64,
}

impl Contents {
    fn keys(&self) -> u64 {
        self.by_type.values().sum()
    }
}

fn file_error(path: &Path, reader: &FileReader, error: RdbError) -> String {
    format!("{} at byte {}: {}; nothing was loaded", path.display(), reader.offset(), error.detail())
}

/// Reads the whole file: whether it can be loaded, and what it holds.
fn survey(path: &Path, bytes: &[u8], db: u64) -> Result<Contents, String> {
    let mut reader = FileReader::new(bytes, VALUE_BYTES_MAX)
        .map_err(|error| format!("{}: {}", path.display(), error.detail()))?;
    let mut contents = Contents::default();
    loop {
        match reader.next_entry() {
            Ok(Some(entry)) if entry.db == db => {
                *contents.by_type.entry(type_name(&entry.value)).or_default() += 1
            }
            Ok(Some(entry)) => *contents.other_dbs.entry(entry.db).or_default() += 1,
            Ok(None) => break,
            Err(error) => return Err(file_error(path, &reader, error)),
        }
    }
    contents.functions = reader.functions();
    Ok(contents)
}

/// Keys that were not loaded, with why.
#[derive(Default)]
struct NotLoaded {
    count: u64,
    named: Vec<String>,
}

impl NotLoaded {
    fn add(&mut self, key: &[u8], why: &str) {
        self.count += 1;
        if self.named.len() < NAMED_MAX {
            self.named.push(format!("{} ({why})", String::from_utf8_lossy(key)));
        }
    }
}

pub fn run(path: &Path, client: &mut Client, options: &ImportOptions) -> Result<(), String> {
    let file = File::open(path).map_err(|error| format!("{}: {error}", path.display()))?;
    // SAFETY: the map is only read. A file changed by another process while
    // it is mapped could change what is read (the checksum is checked over
    // what the survey read), but not the memory safety of reading it.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|error| format!("{}: {error}", path.display()))?;
    let contents = survey(path, &map, options.db)?;
    let types: Vec<String> = contents.by_type.iter().map(|(kind, count)| format!("{count} {kind}")).collect();
    println!(
        "{}: {} keys in db {} ({})",
        path.display(),
        contents.keys(),
        options.db,
        if types.is_empty() { "none".to_string() } else { types.join(", ") }
    );
    for (db, count) in &contents.other_dbs {
        println!("  {count} keys in db {db} are not loaded (Tessera has one keyspace: --db chooses which)");
    }
    if contents.functions > 0 {
        println!(
            "  {} function libraries are not loaded (Tessera runs EVAL scripts, not functions)",
            contents.functions
        );
    }

    let progress = Progress::new("keys", Some(contents.keys()));
    let now_ms = tessera_node::clock::now_ms();
    let mut reader = FileReader::new(&map, VALUE_BYTES_MAX).map_err(|error| error.to_string())?;
    let (mut loaded, mut expired) = (0u64, 0u64);
    let mut existing = NotLoaded::default();
    let mut failed = NotLoaded::default();
    let mut batch: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut batch_bytes = 0;
    loop {
        let entry = reader.next_entry().map_err(|error| file_error(path, &reader, error))?;
        let end = entry.is_none();
        if let Some(entry) = entry.filter(|entry| entry.db == options.db) {
            match entry.expires_at_ms {
                Some(at) if at <= now_ms => expired += 1,
                _ => {
                    let mut command = vec![
                        b"RESTORE".to_vec(),
                        entry.key.to_vec(),
                        entry.expires_at_ms.unwrap_or(0).to_string().into_bytes(),
                        dump(&entry.value),
                    ];
                    if options.replace {
                        command.push(b"REPLACE".to_vec());
                    }
                    if entry.expires_at_ms.is_some() {
                        command.push(b"ABSTTL".to_vec());
                    }
                    batch_bytes += command.iter().map(Vec::len).sum::<usize>();
                    batch.push(command);
                }
            }
        }
        if batch.len() >= BATCH_COMMANDS || batch_bytes >= BATCH_BYTES || (end && !batch.is_empty()) {
            let replies = client.pipeline(&batch).map_err(|error| {
                format!("the server stopped answering after {loaded} keys were loaded: {error}")
            })?;
            for (command, reply) in batch.iter().zip(replies) {
                let key = &command[1];
                match reply {
                    Value::Error(message) if message.starts_with("BUSYKEY") => existing.add(key, "exists"),
                    Value::Error(message) => failed.add(key, &message),
                    _ => loaded += 1,
                }
            }
            progress.advance(batch.len() as u64, "");
            batch.clear();
            batch_bytes = 0;
        }
        if end {
            break;
        }
    }
    progress.finish();
    println!("loaded {loaded} keys; {expired} had expired already");
    if existing.count > 0 {
        println!(
            "{} keys exist already and were left as they are (--replace overwrites them): {}",
            existing.count,
            existing.named.join(", ")
        );
    }
    if failed.count > 0 {
        return Err(format!("{} keys were not loaded: {}", failed.count, failed.named.join(", ")));
    }
    if existing.count > 0 {
        return Err(format!("{} keys were not loaded because they exist", existing.count));
    }
    Ok(())
}
