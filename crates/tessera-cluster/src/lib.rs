//! Cluster metadata (docs/ARCHITECTURE.md, "Clusters"): the map of nodes and
//! shards ([`map`]) and the stores that keep it across coordinator restarts
//! ([`store`]).

pub mod map;
pub mod store;

pub use map::{ClusterMap, MapError, NodeInfo, NodeRole, ReplicationMode, Shard};
pub use store::{FileStore, MetadataStore, StoreError, Versioned};
