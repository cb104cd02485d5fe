//! Tables: each owns a key prefix and an engine. A key belongs to the table with
//! the longest prefix it starts with; the `default` table (empty prefix) owns
//! the rest. Definitions live in `<dir>/tables.toml`, replaced atomically.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_engine::{Engine, EngineError, EngineKind, EngineSpec};

use crate::typed::ReservedEntries;
use crate::watch::{KeyVersions, Touching};
pub use tessera_wire::prefix::{escape_prefix, unescape_prefix, valid_table_name};

pub const DEFAULT_TABLE: &str = "default";
const CATALOG_FILE: &str = "tables.toml";

/// A table's definition, as stored in the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableDef {
    pub name: String,
    /// The key prefix, as text with `\xNN` escapes for non-printable bytes.
    pub prefix: String,
    pub engine: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Catalog {
    #[serde(default, rename = "table")]
    tables: Vec<TableDef>,
}

#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("table '{0}' already exists")]
    Exists(String),
    #[error("no such table '{0}'")]
    Unknown(String),
    #[error("prefix '{0}' is already owned by table '{1}'")]
    PrefixTaken(String, String),
    #[error("invalid table name '{0}': use 1 to 64 letters, digits, '-' or '_'")]
    InvalidName(String),
    #[error("a table needs a non-empty prefix (the default table owns the empty one)")]
    EmptyPrefix,
    #[error("the default table cannot be dropped")]
    DropDefault,
    #[error("keys with prefix '{0}' exist in table '{1}'; delete or move them before creating the table")]
    KeysInTheWay(String, String),
    #[error("redis database {0} db {1} already backs table '{2}'; give each table its own database")]
    RemoteShared(String, u32, String),
    #[error("the redis engine may connect only to the addresses in redis-engine-allow, and {0} is not one")]
    RemoteNotAllowed(String),
    #[error("{0}")]
    Engine(#[from] tessera_engine::EngineError),
    #[error("table catalog {0}: {1}")]
    Catalog(PathBuf, String),
    /// The users, kept beside the tables.
    #[error("users: {0}")]
    Users(#[from] crate::acl::AclError),
}

/// An open table.
pub struct Table {
    pub def: TableDef,
    pub prefix: Bytes,
    pub spec: EngineSpec,
    pub engine: Arc<dyn Engine>,
    /// Its entries under the reserved key space, which DBSIZE leaves out.
    pub reserved: ReservedEntries,
}

/// The tables in routing order (longest prefix first). Immutable: a change
/// builds a new set, so a connection can keep using the one it holds.
pub struct TableSet {
    tables: Vec<Arc<Table>>,
    /// Whether some table's reads may wait for the disk.
    reads_may_wait: bool,
    /// Whether some table's engine has a use for `prefetch`.
    prefetches: bool,
}

impl TableSet {
    pub fn new(mut tables: Vec<Arc<Table>>) -> Self {
        tables.sort_by(|a, b| b.prefix.len().cmp(&a.prefix.len()).then_with(|| a.def.name.cmp(&b.def.name)));
        let reads_may_wait = tables.iter().any(|table| table.engine.capabilities().reads_may_wait);
        let prefetches = tables.iter().any(|table| table.engine.capabilities().prefetches);
        Self { tables, reads_may_wait, prefetches }
    }

    pub fn reads_may_wait(&self) -> bool {
        self.reads_may_wait
    }

    pub fn prefetches(&self) -> bool {
        self.prefetches
    }

    /// Hands each engine that prefetches the keys it owns among `keys`, at
    /// once ([`tessera_engine::Engine::prefetch`]).
    pub fn prefetch(&self, keys: &[&[u8]]) {
        let mut owned: Vec<(&Arc<Table>, Vec<&[u8]>)> = Vec::new();
        for &key in keys {
            let table = self.route(key);
            if !table.engine.capabilities().prefetches {
                continue;
            }
            match owned.iter_mut().find(|(owner, _)| Arc::ptr_eq(owner, table)) {
                Some((_, keys)) => keys.push(key),
                None => owned.push((table, vec![key])),
            }
        }
        owned.iter().for_each(|(table, keys)| table.engine.prefetch(keys));
    }

    /// The table that owns `key`.
    pub fn route(&self, key: &[u8]) -> &Arc<Table> {
        // Three times a command, most often against the default table's
        // empty prefix: `same_bytes`, not `starts_with`.
        self.tables
            .iter()
            .find(|table| {
                key.get(..table.prefix.len()).is_some_and(|head| crate::same_bytes(head, &table.prefix))
            })
            .expect("the default table owns every key")
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Table>> {
        self.tables.iter().find(|table| table.def.name == name)
    }

    /// Tables in name order (the order SCAN walks them).
    pub fn by_name(&self) -> Vec<&Table> {
        let mut tables: Vec<&Table> = self.tables.iter().map(Arc::as_ref).collect();
        tables.sort_by(|a, b| a.def.name.cmp(&b.def.name));
        tables
    }
}

/// Opens tables and keeps the catalog on disk.
pub struct Catalogue {
    dir: PathBuf,
    /// Where a table on the `redis` engine may connect (`host:port`).
    remote_allowed: Vec<String>,
    /// WATCH's versions, which every table's writes move.
    versions: Arc<KeyVersions>,
}

impl Catalogue {
    pub fn new(dir: &Path, remote_allowed: Vec<String>, versions: Arc<KeyVersions>) -> Self {
        Self { dir: dir.to_path_buf(), remote_allowed, versions }
    }

    fn catalog_path(&self) -> PathBuf {
        self.dir.join(CATALOG_FILE)
    }

    pub fn table_dir(&self, name: &str) -> PathBuf {
        self.dir.join("tables").join(name)
    }

    /// Loads the catalog, or starts one whose default table uses `default_engine`.
    /// A catalog that says otherwise about the default table wins only if it
    /// agrees: silently switching engines would hide the stored data.
    pub fn load(
        &self,
        default_engine: &str,
        default_options: &BTreeMap<String, String>,
    ) -> Result<TableSet, TableError> {
        let path = self.catalog_path();
        let catalog_error = |message: String| TableError::Catalog(path.clone(), message);
        let mut catalog: Catalog = match fs::read_to_string(&path) {
            Ok(text) => toml::from_str(&text).map_err(|error| catalog_error(error.to_string()))?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Catalog::default(),
            Err(error) => return Err(catalog_error(error.to_string())),
        };
        match catalog.tables.iter().find(|def| def.name == DEFAULT_TABLE) {
            Some(def) => {
                let configured: EngineKind = default_engine.parse()?;
                let stored: EngineKind = def.engine.parse()?;
                if configured != stored {
                    return Err(catalog_error(format!(
                        "the default table was created with engine '{}', but engine '{}' is configured; \
                         use the same engine or a new data directory",
                        stored.name(),
                        configured.name()
                    )));
                }
            }
            None => {
                catalog.tables.push(TableDef {
                    name: DEFAULT_TABLE.into(),
                    prefix: String::new(),
                    engine: default_engine.into(),
                    options: default_options.clone(),
                });
                fs::create_dir_all(&self.dir).map_err(|error| catalog_error(error.to_string()))?;
                self.save(&catalog.tables)?;
            }
        }
        let mut tables = Vec::new();
        for def in catalog.tables {
            tables.push(Arc::new(self.open_table(def)?));
        }
        Ok(TableSet::new(tables))
    }

    fn open_table(&self, def: TableDef) -> Result<Table, TableError> {
        let prefix = unescape_prefix(&def.prefix).ok_or_else(|| {
            TableError::Catalog(self.catalog_path(), format!("bad prefix {:?}", def.prefix))
        })?;
        let spec = EngineSpec::new(def.engine.parse()?, def.options.clone())?;
        let engine = spec.open(&self.table_dir(&def.name))?;
        let reserved = crate::collection::recover(engine.as_ref()).map_err(|error| {
            TableError::Catalog(self.catalog_path(), format!("table '{}': {error}", def.name))
        })?;
        Ok(Table {
            prefix: Bytes::from(prefix),
            spec,
            engine: Arc::new(Touching::new(engine, self.versions.clone())),
            def,
            reserved: ReservedEntries::new(reserved),
        })
    }

    fn save(&self, defs: &[TableDef]) -> Result<(), TableError> {
        let path = self.catalog_path();
        let catalog_error = |error: std::io::Error| TableError::Catalog(path.clone(), error.to_string());
        let text = toml::to_string_pretty(&Catalog { tables: defs.to_vec() })
            .map_err(|error| TableError::Catalog(path.clone(), error.to_string()))?;
        let temporary = path.with_extension("toml.tmp");
        let mut file = fs::File::create(&temporary).map_err(catalog_error)?;
        file.write_all(text.as_bytes()).map_err(catalog_error)?;
        file.sync_all().map_err(catalog_error)?;
        fs::rename(&temporary, &path).map_err(catalog_error)?;
        fs::File::open(&self.dir).and_then(|dir| dir.sync_all()).map_err(catalog_error)?;
        Ok(())
    }

    /// Creates a table and returns the new set. Refuses a prefix under which
    /// the table that owns it now already holds keys: they would vanish from view.
    pub fn create(&self, current: &TableSet, def: TableDef) -> Result<TableSet, TableError> {
        if !valid_table_name(&def.name) {
            return Err(TableError::InvalidName(def.name));
        }
        if current.get(&def.name).is_some() {
            return Err(TableError::Exists(def.name));
        }
        let prefix = unescape_prefix(&def.prefix).ok_or(TableError::EmptyPrefix)?;
        if prefix.is_empty() {
            return Err(TableError::EmptyPrefix);
        }
        if let Some(owner) = current.tables.iter().find(|table| table.prefix.as_ref() == prefix.as_slice()) {
            return Err(TableError::PrefixTaken(def.prefix, owner.def.name.clone()));
        }
        let spec = EngineSpec::new(def.engine.parse()?, def.options.clone())?;
        if let Some((address, database)) = spec.remote_database() {
            // A client must not point the node at any server it likes.
            if !self.remote_allowed.contains(&address) {
                return Err(TableError::RemoteNotAllowed(address));
            }
            if let Some(other) = current
                .tables
                .iter()
                .find(|table| table.spec.remote_database() == Some((address.clone(), database)))
            {
                return Err(TableError::RemoteShared(address, database, other.def.name.clone()));
            }
        }
        let owner = current.route(&prefix);
        if has_keys_with_prefix(owner.engine.as_ref(), &prefix)? {
            return Err(TableError::KeysInTheWay(def.prefix, owner.def.name.clone()));
        }
        let table = Arc::new(self.open_table(def)?);
        let mut tables = current.tables.clone();
        tables.push(table);
        self.save(&tables.iter().map(|table| table.def.clone()).collect::<Vec<_>>())?;
        Ok(TableSet::new(tables))
    }

    /// Drops a table and its data; returns the new set.
    pub fn drop_table(&self, current: &TableSet, name: &str) -> Result<TableSet, TableError> {
        if name == DEFAULT_TABLE {
            return Err(TableError::DropDefault);
        }
        let table = current.get(name).ok_or_else(|| TableError::Unknown(name.into()))?.clone();
        let tables: Vec<_> = current.tables.iter().filter(|other| other.def.name != name).cloned().collect();
        self.save(&tables.iter().map(|table| table.def.clone()).collect::<Vec<_>>())?;
        match table.engine.clear() {
            Ok(()) => {}
            Err(EngineError::NotOwned(what)) => {
                tracing::info!(table = name, "dropped; {what} keeps its data")
            }
            Err(error) => return Err(error.into()),
        }
        let dir = self.table_dir(name);
        if dir.exists() {
            if let Err(error) = fs::remove_dir_all(&dir) {
                tracing::warn!(%error, dir = %dir.display(), "could not remove a dropped table's files");
            }
        }
        Ok(TableSet::new(tables))
    }
}

fn has_keys_with_prefix(engine: &dyn Engine, prefix: &[u8]) -> Result<bool, TableError> {
    let range = tessera_engine::KeyRange { start: Some(Bytes::copy_from_slice(prefix)), end: None };
    let mut cursor = tessera_engine::ScanCursor::start();
    loop {
        let page = engine.scan(&range, &cursor, 1024)?;
        if page.entries.iter().any(|(key, _)| key.starts_with(prefix)) {
            return Ok(true);
        }
        // Ordered engines return keys from the prefix on: past it, nothing can match.
        if engine.capabilities().ordered {
            return Ok(false);
        }
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(false),
        }
    }
}
