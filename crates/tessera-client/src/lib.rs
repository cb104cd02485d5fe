//! An async client for Tessera, and for any Redis or Redis Cluster server.
//!
//! - [`Client`] talks to one server over a few pipelined [`Connection`]s:
//!   any number of tasks may have requests in flight on it at once.
//! - [`ClusterClient`] routes each command by its key's slot (CLUSTER SLOTS),
//!   follows MOVED (and learns from it) and ASK, waits out TRYAGAIN and
//!   CLUSTERDOWN, and reads the map again when a node stops answering.
//! - A request's outcome is known or it is not: [`Error::NotSent`] and server
//!   refusals before execution are retried; after [`Error::Unknown`] (a
//!   connection lost or a timeout once the command was written) only a
//!   command marked [`Command::idempotent`] is sent again, never a write
//!   that could take effect twice.
//! - [`Level`] and `read_at` ask Tessera for one read's consistency
//!   (CONSISTENCY.READ) and return the level it was served at.

pub mod cluster;
pub mod connection;
pub mod slots;

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
pub use cluster::ClusterClient;
pub use connection::{Connection, Options};
use tessera_wire::slot::key_slot;
pub use tessera_wire::Value;

/// Why a request has no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// It was not sent (no connection), so it did not take effect.
    NotSent(String),
    /// It was sent and no answer came: it may or may not have taken effect.
    Unknown(String),
    /// The server refused it or failed it.
    Server(String),
    /// The server's answer is not what the command answers.
    Protocol(String),
}

impl fmt::Display for Error {
    fn fmt(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Error::NotSent(why) => write!(formatter, "not sent: {why}"),
            Error::Unknown(why) => write!(formatter, "outcome unknown: {why}"),
            Error::Server(message) => write!(formatter, "{message}"),
            Error::Protocol(why) => write!(formatter, "unexpected answer: {why}"),
        }
    }
}

impl std::error::Error for Error {}

/// A command: its arguments, which of them routes it, and whether it may be
/// sent again when its outcome is unknown.
#[derive(Clone, Debug)]
pub struct Command {
    args: Vec<Bytes>,
    key: Option<usize>,
    idempotent: bool,
}

/// A command named `name`, to which arguments and keys are added.
pub fn cmd(name: &str) -> Command {
    Command { args: vec![Bytes::copy_from_slice(name.as_bytes())], key: None, idempotent: false }
}

impl Command {
    pub fn arg(mut self, arg: impl AsRef<[u8]>) -> Self {
        self.args.push(Bytes::copy_from_slice(arg.as_ref()));
        self
    }

    /// An argument that is a key: the first one routes the command.
    pub fn key(mut self, key: impl AsRef<[u8]>) -> Self {
        self.key.get_or_insert(self.args.len());
        self.arg(key)
    }

    /// Safe to send twice: sent again after a lost answer. Reads are; a
    /// write is not, even SET (sent again, it could undo another client's
    /// write made in between).
    pub fn idempotent(mut self) -> Self {
        self.idempotent = true;
        self
    }

    pub fn args(&self) -> &[Bytes] {
        &self.args
    }

    pub fn is_idempotent(&self) -> bool {
        self.idempotent
    }

    /// The slot of the key that routes it, if it has one.
    pub fn slot(&self) -> Option<usize> {
        self.key.map(|index| key_slot(&self.args[index]))
    }

    /// The command as Tessera's CONSISTENCY.READ at `level`: routed by the
    /// same key, and a read, so it may be sent again.
    pub fn at_level(self, level: Level) -> Command {
        let mut args =
            vec![Bytes::from_static(b"CONSISTENCY.READ"), Bytes::from_static(level.name().as_bytes())];
        args.extend(self.args);
        Command { args, key: self.key.map(|index| index + 2), idempotent: true }
    }
}

/// What a read asks Tessera for (CONSISTENCY.READ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Strong,
    Eventual,
    Causal,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Strong => "strong",
            Level::Eventual => "eventual",
            Level::Causal => "causal",
        }
    }

    fn parse(name: &[u8]) -> Option<Self> {
        [Level::Strong, Level::Eventual, Level::Causal]
            .into_iter()
            .find(|level| level.name().as_bytes() == name)
    }
}

/// The answer to a CONSISTENCY.READ: the level the read was served at, and its reply.
pub(crate) fn leveled(answer: Value) -> Result<(Level, Value), Error> {
    let unexpected = |answer: &Value| Error::Protocol(format!("CONSISTENCY.READ answered {answer:?}"));
    let mut parts = match answered(answer)? {
        Value::Array(parts) => parts,
        other => return Err(unexpected(&other)),
    };
    let (Some(reply), Some(level), true) = (parts.pop(), parts.pop(), parts.is_empty()) else {
        return Err(unexpected(&Value::Array(parts)));
    };
    let level = level.as_bytes().and_then(Level::parse).ok_or_else(|| unexpected(&level))?;
    match reply {
        Value::Error(message) => Err(Error::Server(message)),
        reply => Ok((level, reply)),
    }
}

/// A server's error answer as an [`Error`]; any other answer as it is.
pub(crate) fn answered(answer: Value) -> Result<Value, Error> {
    match answer {
        Value::Error(message) => Err(Error::Server(message)),
        value => Ok(value),
    }
}

/// The connections to one server, taken in turn, each opened again when it
/// broke.
pub(crate) struct Server {
    address: String,
    options: Options,
    connections: Vec<tokio::sync::Mutex<Option<Connection>>>,
    turn: AtomicUsize,
}

impl Server {
    pub(crate) fn new(address: String, options: Options) -> Self {
        let connections = (0..options.connections_per_server.max(1)).map(|_| Default::default()).collect();
        Self { address, options, connections, turn: AtomicUsize::new(0) }
    }

    pub(crate) async fn connection(&self) -> Result<Connection, Error> {
        let turn = self.turn.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let mut slot = self.connections[turn].lock().await;
        match &*slot {
            Some(connection) if !connection.is_closed() => Ok(connection.clone()),
            _ => {
                let connection = Connection::open(&self.address, &self.options).await?;
                *slot = Some(connection.clone());
                Ok(connection)
            }
        }
    }
}

/// A client of one server (a Tessera node, which forwards what it does not
/// hold, or a Redis server). Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct Client {
    server: Arc<Server>,
}

impl Client {
    /// A client of `address`; connections open when first used.
    pub fn new(address: &str, options: Options) -> Self {
        Self { server: Arc::new(Server::new(address.to_string(), options)) }
    }

    /// The command's answer; sent again after a lost answer only if it is
    /// idempotent, and then once.
    pub async fn request(&self, command: &Command) -> Result<Value, Error> {
        let send = || async { self.server.connection().await?.request(&command.args).await };
        match send().await {
            Err(Error::NotSent(_)) => answered(send().await?),
            Err(Error::Unknown(_)) if command.idempotent => answered(send().await?),
            answer => answered(answer?),
        }
    }

    /// Commands written together on one connection, answered in order.
    pub async fn pipeline(&self, commands: &[Command]) -> Result<Vec<Result<Value, Error>>, Error> {
        let args: Vec<&[Bytes]> = commands.iter().map(|command| command.args.as_slice()).collect();
        let answers = self.server.connection().await?.pipeline(&args).await;
        Ok(answers.into_iter().map(|answer| answered(answer?)).collect())
    }

    /// One read at `level`, and the level it was served at.
    pub async fn read_at(&self, level: Level, command: Command) -> Result<(Level, Value), Error> {
        leveled(self.request(&command.at_level(level)).await?)
    }

    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Bytes>, Error> {
        bulk_or_nil(self.request(&cmd("GET").key(key).idempotent()).await?)
    }

    pub async fn set(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        self.request(&cmd("SET").key(key).arg(value)).await.map(drop)
    }
}

pub(crate) fn bulk_or_nil(answer: Value) -> Result<Option<Bytes>, Error> {
    match answer {
        Value::Bulk(bytes) => Ok(Some(bytes)),
        Value::Null => Ok(None),
        other => Err(Error::Protocol(format!("expected a string or nil, got {other:?}"))),
    }
}
