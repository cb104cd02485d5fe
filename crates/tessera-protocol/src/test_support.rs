//! Helpers shared by the protocols' unit tests.

use bytes::Bytes;

use crate::{ClientRequest, NodeId, Operation, RequestId, ShardView, Write};

/// A view of `replicas` in order, with a lease until time 1,000.
pub(crate) fn view(number: u64, replicas: &[u32]) -> ShardView {
    ShardView {
        number,
        replicas: replicas.iter().map(|id| NodeId(*id)).collect(),
        learners: Vec::new(),
        lease_until: 1_000,
        draining: false,
        geo: None,
    }
}

/// A batch that puts `value` at every key of `keys`.
pub(crate) fn batch(id: u64, keys: &[&str], value: &str) -> ClientRequest {
    let write = Write::Put(Bytes::from(value.to_string()));
    let writes = keys.iter().map(|key| (Bytes::from(key.to_string()), write.clone())).collect();
    ClientRequest { id: RequestId(id), operation: Operation::Batch { writes } }
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
