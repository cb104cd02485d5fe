//! Clusters (docs/ARCHITECTURE.md, "Clusters"): the map of nodes and shards
//! ([`map`]), the stores that keep it across coordinator restarts ([`store`]),
//! and the coordinator's logic ([`coordinator`]).

pub mod agent;
pub mod auth;
pub mod capture;
pub mod coordinator;
pub mod dashboard;
pub mod etcd;
pub mod grant;
pub mod http;
pub mod links;
pub mod map;
pub mod metrics;
pub mod server;
pub mod session;
pub mod store;
pub mod tls;

pub use coordinator::{ClusterCoordinator, Grants, JoinError, Timing};
pub use etcd::{Etcd, EtcdStore};
pub use map::{
    ClusterMap, ClusterTable, MapError, NodeInfo, NodeRole, Shard, DEFAULT_TABLE, GROUPS_PER_NODE_DEFAULT,
};
pub use server::{CoordinatorObserver, CoordinatorServer, StartError};
pub use store::{FileStore, MetadataStore, StoreError, Versioned};
