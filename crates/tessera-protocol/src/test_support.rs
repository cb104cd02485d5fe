//! Helpers shared by the protocols' unit tests.

use bytes::Bytes;

use crate::{ClientRequest, NodeId, Operation, RequestId, ShardView};

/// A view of `replicas` in order, with a lease until time 1,000.
pub(crate) fn view(number: u64, replicas: &[u32]) -> ShardView {
    ShardView {
        number,
        replicas: replicas.iter().map(|id| NodeId(*id)).collect(),
        learners: Vec::new(),
        lease_until: 1_000,
        draining: false,
    }
}

pub(crate) fn put(id: u64, key: &str, value: &str) -> ClientRequest {
    ClientRequest {
        id: RequestId(id),
        operation: Operation::Put {
            key: Bytes::from(key.to_string()),
            value: Bytes::from(value.to_string()),
        },
    }
}
