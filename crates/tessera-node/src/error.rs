//! Errors a command can answer with. Each maps to the Redis error line a client
//! expects (its first word is the error code).

use tessera_cluster::agent::{AgentError, ShardError};
use tessera_engine::EngineError;
use tessera_wire::{ProtocolError, ReplyWriter};

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("ERR unknown command '{0}', with args beginning with: {1}")]
    UnknownCommand(String, String),
    #[error("ERR unknown subcommand '{0}'. Try {1} HELP.")]
    UnknownSubcommand(String, String),
    /// Redis's answer when a subcommand is unknown or has the wrong number
    /// of arguments: the subcommand, then the command.
    #[error("ERR unknown subcommand or wrong number of arguments for '{0}'. Try {1} HELP.")]
    SubcommandSyntax(String, &'static str),
    #[error("ERR wrong number of arguments for '{0}' command")]
    WrongArity(String),
    #[error("WRONGTYPE Operation against a key holding the wrong kind of value")]
    WrongType,
    #[error("ERR value is not an integer or out of range")]
    NotInteger,
    #[error("ERR hash value is not an integer")]
    HashValueNotInteger,
    #[error("ERR increment or decrement would overflow")]
    Overflow,
    #[error("ERR syntax error")]
    Syntax,
    #[error("BUSYKEY Target key name already exists.")]
    BusyKey,
    #[error("EXECABORT Transaction discarded because of previous errors.")]
    ExecAbort,
    #[error("ERR invalid expire time in '{0}' command")]
    InvalidExpire(String),
    #[error("ERR string exceeds maximum allowed size (proto-max-bulk-len)")]
    TooLarge,
    #[error("ERR invalid cursor")]
    InvalidCursor,
    #[error("NOAUTH Authentication required.")]
    NoAuth,
    #[error("NOPROTO unsupported protocol version")]
    NoProto,
    #[error("WRONGPASS invalid username-password pair or user is disabled.")]
    WrongPass,
    #[error(
        "ERR key '{0}' is in the reserved key space (keys starting with bytes FF FF 23 belong to Tessera)"
    )]
    ReservedKey(String),
    #[error("NOPERM {0}")]
    NoPermission(String),
    #[error("OOM command not allowed when used memory > 'maxmemory'.")]
    OutOfMemory,
    #[error("ERR {0}")]
    Other(String),
    #[error("NOSCRIPT No matching script. Please use EVAL.")]
    NoScript,
    /// A script has run past the busy threshold (Redis's words).
    #[error("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.")]
    Busy,
    /// The connection's input is not RESP: answered, then the connection closes.
    #[error("ERR {0}")]
    Protocol(#[from] ProtocolError),
    #[error("ERR query buffer limit exceeded, closing the connection")]
    QueryBufferFull,
    #[error("ERR the node's query buffers are over query_buffer_budget, closing the connection")]
    QueryBudgetFull,
    /// The cluster cannot serve the keys at all now (no map yet, a slot
    /// nobody serves).
    #[error("CLUSTERDOWN {0}")]
    ClusterDown(String),
    /// No effect; the client may simply try again (Redis clients do).
    #[error("TRYAGAIN {0}")]
    TryAgain(String),
    /// A cluster client is told where the keys' slot is served.
    #[error("MOVED {slot} {address}")]
    Moved { slot: u16, address: String },
    #[error("CROSSSLOT {0}")]
    CrossSlot(String),
    /// MIGRATE's keys did not reach their target in time.
    #[error("IOERR {0}")]
    Timeout(String),
    /// The coordinator could not be asked.
    #[error("TRYAGAIN {0}")]
    Coordinator(#[from] AgentError),
    /// An error line another process answered (the coordinator, the node a
    /// request was forwarded to), passed on as it came.
    #[error("{0}")]
    Relayed(String),
    #[error("ERR engine error: {0}")]
    Engine(#[from] EngineError),
    /// A shard's answer (a cluster node).
    #[error(transparent)]
    Shard(#[from] ShardError),
}

pub type CommandResult<T = ()> = Result<T, CommandError>;

impl From<tessera_data::DataError> for CommandError {
    fn from(error: tessera_data::DataError) -> Self {
        use tessera_data::DataError;
        match error {
            DataError::WrongType => CommandError::WrongType,
            DataError::NotInteger => CommandError::NotInteger,
            DataError::TooLarge => CommandError::TooLarge,
            DataError::Overflow => CommandError::Overflow,
            DataError::Invalid(message) => CommandError::Other(message),
            DataError::Engine(error) => CommandError::Engine(error),
        }
    }
}

impl CommandError {
    /// What the node has not got before the coordinator gives it a map.
    pub fn no_map_yet() -> Self {
        CommandError::ClusterDown("this node has not received the cluster map yet".into())
    }

    /// The error as the one RESP error line a client is told.
    pub fn write(&self, out: &mut ReplyWriter) {
        out.error(&self.to_string());
    }
}
