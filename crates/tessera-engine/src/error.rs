use std::io;

/// Why an engine operation failed. A failed operation leaves the engine as it was.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("corrupt data: {0}")]
    Corrupt(String),
    #[error("LSM engine: {0}")]
    Lsm(String),
    #[error("remote engine: {0}")]
    Remote(String),
    #[error("invalid engine option: {0}")]
    InvalidOption(String),
    #[error("invalid scan cursor")]
    InvalidCursor,
    #[error("value of {0} bytes exceeds the engine's limit of {1} bytes")]
    TooLarge(usize, usize),
    #[error("{0}")]
    Unsupported(&'static str),
    /// Emptying data the engine only borrows (a remote database the table
    /// was not created to own).
    #[error("{0} is not this table's to empty (a table created with owns-database yes may)")]
    NotOwned(String),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
