//! Deterministic simulation of Tessera's replication protocols.
//!
//! [`sim`] runs a shard's replicas — each the driver the nodes run — a
//! coordinator and clients in one thread in virtual time, injecting the
//! faults a seed draws; [`checks`] judge the recorded history. A failing
//! seed replays exactly.

pub mod checks;
mod clients;
mod collections;
pub mod config;
pub mod geo;
pub mod groups;
pub mod history;
mod network;
pub mod rng;
pub mod sim;

#[cfg(test)]
mod seed_tests;

pub use checks::linearizability;
pub use config::{FaultKind, RunTiming, SimConfig, Workload};
pub use sim::{run, Report};
