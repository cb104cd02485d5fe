//! `redis`: an existing Redis server as the engine (the tRedis of BespoKV,
//! Anwar et al., SC 2018: a store Tessera uses but did not write).
//!
//! Calls go over a pool of blocking connections; batches (`get_many`,
//! `put_many`, scans) go out as one pipelined round trip. The remote database
//! should belong to one Tessera table; `clear` empties it with FLUSHDB only
//! if the table was created to own it (`owns-database yes`): a dropped or
//! flushed table otherwise leaves the remote data alone.
//! Durability is whatever the remote server is configured for.

use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_wire::{Client, Value};

use crate::{Capabilities, Engine, EngineError, KeyRange, Result, ScanCursor, ScanPage};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisOptions {
    /// `host:port` of the Redis server.
    pub address: String,
    /// The database number (SELECT) the table lives in.
    pub database: u32,
    pub password: Option<String>,
    /// Idle connections kept for reuse.
    pub pool_size: usize,
    pub timeout: Duration,
    /// Tessera may empty the database (FLUSHDB on FLUSHALL or TABLE.DROP).
    pub owns_database: bool,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            address: "127.0.0.1:6379".into(),
            database: 0,
            password: None,
            pool_size: 16,
            timeout: Duration::from_secs(5),
            owns_database: false,
        }
    }
}

pub struct RedisEngine {
    options: RedisOptions,
    idle: Mutex<Vec<Client>>,
}

fn remote_error(error: impl std::fmt::Display) -> EngineError {
    EngineError::Remote(error.to_string())
}

/// Turns a server error reply into an engine error.
fn check(value: Value) -> Result<Value> {
    match value {
        Value::Error(message) => Err(EngineError::Remote(message)),
        value => Ok(value),
    }
}

fn bulk_or_nil(value: Value) -> Result<Option<Bytes>> {
    match check(value)? {
        Value::Bulk(bytes) => Ok(Some(bytes)),
        Value::Null => Ok(None),
        other => Err(remote_error(format!("unexpected reply {other:?}"))),
    }
}

impl RedisEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: false, persistent: true, reads_may_wait: false, prefetches: false };

    /// Connects once to check that the server is there and the options work.
    pub fn open(options: RedisOptions) -> Result<Self> {
        let engine = Self { options, idle: Mutex::new(Vec::new()) };
        let client = engine.connect()?;
        engine.idle.lock().push(client);
        Ok(engine)
    }

    fn connect(&self) -> Result<Client> {
        let mut client = Client::connect(self.options.address.as_str(), self.options.timeout)
            .map_err(|error| remote_error(format!("connecting to {}: {error}", self.options.address)))?;
        if let Some(password) = &self.options.password {
            check(client.command(&["AUTH", password.as_str()]).map_err(remote_error)?)?;
        }
        if self.options.database != 0 {
            let database = self.options.database.to_string();
            check(client.command(&["SELECT", database.as_str()]).map_err(remote_error)?)?;
        }
        Ok(client)
    }

    /// Runs `call` on a pooled connection. A connection that failed is dropped;
    /// a stale pooled one gets one retry on a fresh connection.
    fn with_client<T>(
        &self,
        call: impl Fn(&mut Client) -> Result<T, tessera_wire::ClientError>,
    ) -> Result<T> {
        let pooled = self.idle.lock().pop();
        let was_pooled = pooled.is_some();
        let mut client = match pooled {
            Some(client) => client,
            None => self.connect()?,
        };
        let result = match call(&mut client) {
            Err(_) if was_pooled => {
                client = self.connect()?;
                call(&mut client)
            }
            result => result,
        };
        match result {
            Ok(value) => {
                let mut idle = self.idle.lock();
                if idle.len() < self.options.pool_size {
                    idle.push(client);
                }
                Ok(value)
            }
            Err(error) => Err(remote_error(format!("{}: {error}", self.options.address))),
        }
    }
}

impl Engine for RedisEngine {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        bulk_or_nil(self.with_client(|client| client.command(&[b"GET", key]))?)
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        check(self.with_client(|client| client.command(&[b"SET", key, &value]))?).map(drop)
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        Ok(check(self.with_client(|client| client.command(&[b"DEL", key]))?)?.as_integer() == Some(1))
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let remote_cursor = if cursor.is_start() { Bytes::from_static(b"0") } else { cursor.0.clone() };
        if !remote_cursor.iter().all(u8::is_ascii_digit) {
            return Err(EngineError::InvalidCursor);
        }
        let count = limit.max(1).to_string();
        let reply = check(self.with_client(|client| {
            client.command(&[b"SCAN".as_ref(), &remote_cursor, b"COUNT", count.as_bytes()])
        })?)?;
        let mut parts =
            reply.into_items().ok_or_else(|| remote_error("SCAN reply is not an array"))?.into_iter();
        let (Some(next), Some(keys)) = (parts.next(), parts.next()) else {
            return Err(remote_error("SCAN reply has no cursor and keys"));
        };
        let next =
            next.as_bytes().map(Bytes::copy_from_slice).ok_or_else(|| remote_error("bad SCAN cursor"))?;
        let keys: Vec<Bytes> = keys
            .into_items()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|key| key.as_bytes().map(Bytes::copy_from_slice))
            .filter(|key| range.contains(key))
            .collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(|key| key.as_ref()).collect();
        let values = self.get_many(&key_refs)?;
        let entries =
            keys.into_iter().zip(values).filter_map(|(key, value)| value.map(|value| (key, value))).collect();
        let next = (next.as_ref() != b"0").then_some(ScanCursor(next));
        Ok(ScanPage { entries, next })
    }

    fn len(&self) -> Result<u64> {
        let reply = check(self.with_client(|client| client.command(&["DBSIZE"]))?)?;
        reply.as_integer().map(|count| count as u64).ok_or_else(|| remote_error("bad DBSIZE reply"))
    }

    fn clear(&self) -> Result<()> {
        if !self.options.owns_database {
            return Err(EngineError::NotOwned(format!(
                "redis database {} db {}",
                self.options.address, self.options.database
            )));
        }
        check(self.with_client(|client| client.command(&["FLUSHDB"]))?).map(drop)
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn get_many(&self, keys: &[&[u8]]) -> Result<Vec<Option<Bytes>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut command: Vec<&[u8]> = Vec::with_capacity(keys.len() + 1);
        command.push(b"MGET");
        command.extend_from_slice(keys);
        let reply = check(self.with_client(|client| client.command(&command))?)?;
        let values = reply.into_items().ok_or_else(|| remote_error("MGET reply is not an array"))?;
        if values.len() != keys.len() {
            return Err(remote_error("MGET reply has the wrong length"));
        }
        values.into_iter().map(bulk_or_nil).collect()
    }

    fn put_many(&self, entries: &[(&[u8], Bytes)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut command: Vec<&[u8]> = Vec::with_capacity(2 * entries.len() + 1);
        command.push(b"MSET");
        for (key, value) in entries {
            command.push(key);
            command.push(value);
        }
        check(self.with_client(|client| client.command(&command))?).map(drop)
    }
}
