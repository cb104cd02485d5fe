//! Redis's data model over the engine trait: typed values with their
//! expiry ([`typed`]), and the collections, inline while small and paged
//! once large so that a one-element change costs a page whatever the size
//! ([`list`]; [`hashed`] for hashes and sets; [`zset`]; what they share in
//! [`collection`]). INCRBYFLOAT's arithmetic is [`long_double`]. The node
//! (`tessera-node`) runs the commands over these.

pub mod collection;
pub mod hashed;
pub mod list;
pub mod long_double;
pub mod native;
pub mod native_hashed;
pub mod native_list;
pub mod native_zset;
pub mod typed;
pub mod zset;

/// Why a data-model operation failed. Each renders as the Redis error line
/// a client is told for it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("WRONGTYPE Operation against a key holding the wrong kind of value")]
    WrongType,
    #[error("ERR value is not an integer or out of range")]
    NotInteger,
    #[error("ERR string exceeds maximum allowed size (proto-max-bulk-len)")]
    TooLarge,
    #[error("ERR increment or decrement would overflow")]
    Overflow,
    /// Any other refusal, in Redis's words (after `ERR `).
    #[error("ERR {0}")]
    Invalid(String),
    #[error("ERR engine error: {0}")]
    Engine(#[from] tessera_engine::EngineError),
}

pub type DataResult<T = ()> = Result<T, DataError>;
