//! Where the coordinator keeps the cluster map. Writes are compare-and-set on a
//! version, so a coordinator that lost its leadership (or raced another) cannot
//! overwrite a newer map with an older one.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::map::{ClusterMap, MapError};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the stored map changed (version {found:?}, expected {expected:?}); reload it")]
    Conflict { expected: Option<u64>, found: Option<u64> },
    /// `location` is a file, or an etcd endpoint and key.
    #[error("{location}: {message}")]
    Io { location: String, message: String },
    #[error("{location}: {source}")]
    Corrupt { location: String, source: MapError },
    /// This coordinator is no longer the leader: it must not decide.
    #[error("leadership lost: {0}")]
    NotLeader(String),
}

/// A map and the version the store gave it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versioned {
    pub version: u64,
    pub map: ClusterMap,
}

pub trait MetadataStore: Send + Sync {
    /// The stored map, if there is one.
    fn load(&self) -> Result<Option<Versioned>, StoreError>;

    /// Stores `map` if the stored version is still `expected` (`None`: nothing
    /// stored yet); returns the new version.
    fn store(&self, expected: Option<u64>, map: &ClusterMap) -> Result<u64, StoreError>;
}

/// The map in one file, replaced atomically (write, fsync, rename, fsync the
/// directory): after a crash the file holds the old map or the new one. For a
/// single coordinator; several coordinators share an etcd store instead.
pub struct FileStore {
    path: PathBuf,
    /// Serialises compare-and-set within the process.
    writing: Mutex<()>,
}

impl FileStore {
    pub fn new(dir: &Path) -> Self {
        Self { path: dir.join("cluster.json"), writing: Mutex::new(()) }
    }

    fn io_error(&self, error: impl std::fmt::Display) -> StoreError {
        StoreError::Io { location: self.path.display().to_string(), message: error.to_string() }
    }
}

impl MetadataStore for FileStore {
    fn load(&self) -> Result<Option<Versioned>, StoreError> {
        let text = match fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(self.io_error(error)),
        };
        let corrupt = |source| StoreError::Corrupt { location: self.path.display().to_string(), source };
        let stored: Versioned =
            serde_json::from_str(&text).map_err(|error| corrupt(MapError::Invalid(error.to_string())))?;
        stored.map.validate().map_err(corrupt)?;
        Ok(Some(stored))
    }

    fn store(&self, expected: Option<u64>, map: &ClusterMap) -> Result<u64, StoreError> {
        map.validate()
            .map_err(|source| StoreError::Corrupt { location: self.path.display().to_string(), source })?;
        let _writing = self.writing.lock();
        let found = self.load()?.map(|stored| stored.version);
        if found != expected {
            return Err(StoreError::Conflict { expected, found });
        }
        let version = found.map_or(1, |version| version + 1);
        let text = serde_json::to_string_pretty(&Versioned { version, map: map.clone() })
            .map_err(|error| self.io_error(error))?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir).map_err(|error| self.io_error(error))?;
        let temporary = self.path.with_extension("json.tmp");
        let mut file = fs::File::create(&temporary).map_err(|error| self.io_error(error))?;
        file.write_all(text.as_bytes()).map_err(|error| self.io_error(error))?;
        file.sync_all().map_err(|error| self.io_error(error))?;
        fs::rename(&temporary, &self.path).map_err(|error| self.io_error(error))?;
        fs::File::open(dir).and_then(|dir| dir.sync_all()).map_err(|error| self.io_error(error))?;
        Ok(version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protocol::Mode;

    fn map() -> ClusterMap {
        let addresses: Vec<String> = (0..3).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        ClusterMap::place("c1", Mode::named("chain").unwrap(), 3, &addresses, 3).unwrap()
    }

    #[test]
    fn versions_guard_every_write_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        assert_eq!(store.load().unwrap(), None);
        let mut map = map();
        assert_eq!(store.store(None, &map).unwrap(), 1);
        assert!(matches!(store.store(None, &map), Err(StoreError::Conflict { found: Some(1), .. })));
        map.epoch += 1;
        assert_eq!(store.store(Some(1), &map).unwrap(), 2);
        assert!(matches!(store.store(Some(1), &map), Err(StoreError::Conflict { .. })));
        let reopened = FileStore::new(dir.path()).load().unwrap().unwrap();
        assert_eq!(reopened, Versioned { version: 2, map });
    }

    #[test]
    fn a_damaged_file_is_a_clear_error_and_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        fs::write(dir.path().join("cluster.json"), "{\"version\": 3, \"map\": {\"cluster_id\": \"\"}}")
            .unwrap();
        let error = store.load().unwrap_err().to_string();
        assert!(error.contains("cluster.json"), "{error}");
        assert!(store.store(Some(3), &map()).is_err());
        let mut invalid = map();
        invalid.shards.pop();
        let fresh = FileStore::new(tempfile::tempdir().unwrap().path());
        assert!(matches!(fresh.store(None, &invalid), Err(StoreError::Corrupt { .. })));
    }
}
