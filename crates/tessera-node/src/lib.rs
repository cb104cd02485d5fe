//! The Tessera node: a RESP server in front of tables, each table an engine.
//!
//! Layers, top to bottom: [`server`] accepts connections and drives
//! [`connection`]s, which parse requests and run [`commands`] against the
//! [`node_state`]: tables routed by key prefix, typed values ([`typed`]) kept inside
//! the engines' opaque values, sorted sets spread over entries of their own
//! ([`zset`]).

pub mod acl;
pub mod backup;
pub mod blocking;
pub mod clients;
pub mod clock;
pub mod cluster;
pub mod commands;
pub mod config;
pub mod connection;
pub mod diagnostics;
pub mod disk_reads;
pub mod error;
pub mod gauges;
pub mod glob;
pub mod lua_libs;
pub mod membership;
pub mod memory;
pub mod metrics;
pub mod node_state;
pub mod pubsub;
pub mod rdb;
pub mod scripts;
pub mod server;
pub mod tables;
pub mod tls;
pub mod watch;

pub use tessera_data::{collection, hashed, list, long_double, typed, zset};

pub use config::Config;
pub use server::Server;

/// The Redis version Tessera reports, for clients that check features by it.
pub const REDIS_COMPATIBLE_VERSION: &str = "7.2.0";
