//! What clients did and saw, with virtual times: the input of the checkers.

use bytes::Bytes;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Get,
    Put(Bytes),
    Delete,
    Increment(i64),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A get's value, or an increment's new value.
    Value(Option<Bytes>),
    /// A put or delete took effect.
    Written,
    /// No answer before the client gave up: it may or may not have taken effect.
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    pub client: usize,
    pub key: Bytes,
    pub call: Call,
    pub outcome: Outcome,
    pub invoked_at: u64,
    /// `None` when the outcome is unknown.
    pub completed_at: Option<u64>,
}

impl Operation {
    pub fn is_write(&self) -> bool {
        !matches!(self.call, Call::Get)
    }
}

/// The strong operations of a run (eventual reads are not linearizable and are
/// kept apart).
#[derive(Clone, Debug, Default)]
pub struct History {
    pub operations: Vec<Operation>,
}
