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

/// Whether `a` and `b` hold the same bytes, for the per-command paths where
/// both are most often empty. Empty slices are not handed to `memcmp`: an
/// empty slice's address is dangling, and glibc's `memcmp` makes a masked
/// load from it, a fault-suppressed load from an unmapped page, which AMD's
/// processors serve with a microcode assist of hundreds of cycles.
pub fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
}

#[cfg(test)]
mod tests {
    use super::same_bytes;

    #[test]
    fn same_bytes_is_equality() {
        for (a, b) in
            [(&b""[..], &b""[..]), (b"", b"a"), (b"a", b""), (b"ab", b"ab"), (b"ab", b"ac"), (b"ab", b"a")]
        {
            assert_eq!(same_bytes(a, b), a == b, "{a:?} {b:?}");
        }
    }
}
