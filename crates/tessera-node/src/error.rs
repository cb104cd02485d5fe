//! Errors a command can answer with. Each maps to the Redis error line a client
//! expects (its first word is the error code).

use tessera_cluster::agent::GroupError;
use tessera_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("ERR unknown command '{0}', with args beginning with: {1}")]
    UnknownCommand(String, String),
    #[error("ERR unknown subcommand '{0}'. Try {1} HELP.")]
    UnknownSubcommand(String, String),
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
    #[error("ERR {0}")]
    Other(String),
    /// An error whose code is not ERR (`CLUSTERDOWN ...`, `TRYAGAIN ...`).
    #[error("{0}")]
    Coded(String),
    #[error("ERR engine error: {0}")]
    Engine(#[from] EngineError),
    /// A replica group's answer (a cluster node).
    #[error(transparent)]
    Group(#[from] GroupError),
}

pub type CommandResult<T = ()> = Result<T, CommandError>;
