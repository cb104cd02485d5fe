//! Deterministic simulation of Tessera's replication protocols.
//!
//! [`sim`] runs a shard's replicas, a coordinator and clients in one thread in
//! virtual time, injecting the faults a seed draws; [`linearizability`] checks
//! the recorded history. A failing seed replays exactly.

pub mod history;
pub mod linearizability;
pub mod rng;
pub mod sim;

#[cfg(test)]
mod seed_tests;

pub use sim::{run, FaultKind, ProtocolKind, Report, SimConfig, Workload};
