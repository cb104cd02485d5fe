//! Where keys live: client-side sharding over a list of endpoints, or a Redis
//! Cluster's slot map (tessera-client's, from CLUSTER SLOTS, corrected by
//! MOVED replies).

pub use tessera_client::slots::{Redirect, SlotMap};

/// FNV-1a over bytes: client-side sharding, as proxies such as twemproxy do.
pub fn shard_hash(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, &byte| (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3))
}
