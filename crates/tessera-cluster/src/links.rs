//! Links between nodes: one outgoing TCP connection per peer carrying
//! length-prefixed frames `(shard, message)`, written in batches; incoming
//! connections read into one channel.
//!
//! ```text
//! hello:  len u32 | cluster_id_len u32 | cluster id | node u32
//! frame:  len u32 | shard u32 | peer message (codec)
//! ```
//!
//! Delivery is best effort, which the protocols are built for: they
//! retransmit, and tolerate loss, duplication and reordering. A link that
//! cannot connect retries with backoff; while it is down or slow its queue
//! keeps at most `queue_max` frames, dropping the oldest.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tessera_protocol::{NodeId, PeerMessage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

/// The largest frame accepted (a snapshot chunk with its values).
const FRAME_BYTES_MAX: usize = 64 << 20;

#[derive(Clone, Debug)]
pub struct LinkConfig {
    pub cluster_id: String,
    pub me: NodeId,
    /// Frames kept per peer while its link is down or slow.
    pub queue_max: usize,
    pub connect_timeout: Duration,
    pub backoff_max: Duration,
}

/// A message from a peer, for one shard.
#[derive(Debug)]
pub struct Incoming {
    pub from: NodeId,
    pub shard: u32,
    pub message: PeerMessage,
}

#[derive(Default)]
struct Queue {
    frames: VecDeque<Vec<u8>>,
    dropped: u64,
}

struct Peer {
    queue: Mutex<Queue>,
    wake: Notify,
}

/// The sending side: a queue and a writer task per peer.
pub struct Links {
    config: Arc<LinkConfig>,
    peers: Mutex<HashMap<NodeId, Arc<Peer>>>,
    addresses: Arc<Mutex<HashMap<NodeId, String>>>,
}

impl Links {
    pub fn new(config: LinkConfig) -> Arc<Self> {
        Arc::new(Self {
            config: Arc::new(config),
            peers: Mutex::new(HashMap::new()),
            addresses: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Where each peer listens (from the cluster map); changes apply at the
    /// next connection attempt.
    pub fn set_addresses(&self, addresses: HashMap<NodeId, String>) {
        *self.addresses.lock() = addresses;
    }

    /// Queues a message for a peer; never blocks.
    pub fn send(&self, to: NodeId, shard: u32, message: &PeerMessage) {
        let mut frame = Vec::with_capacity(64);
        frame.extend_from_slice(&[0; 4]);
        frame.extend_from_slice(&shard.to_le_bytes());
        message.encode(&mut frame);
        let length = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&length.to_le_bytes());
        let peer = self.peer(to);
        {
            let mut queue = peer.queue.lock();
            if queue.frames.len() >= self.config.queue_max {
                queue.frames.pop_front();
                queue.dropped += 1;
            }
            queue.frames.push_back(frame);
        }
        peer.wake.notify_one();
    }

    /// Frames dropped for a peer because its queue was full.
    pub fn dropped(&self, peer: NodeId) -> u64 {
        self.peers.lock().get(&peer).map_or(0, |peer| peer.queue.lock().dropped)
    }

    fn peer(&self, node: NodeId) -> Arc<Peer> {
        let mut peers = self.peers.lock();
        peers
            .entry(node)
            .or_insert_with(|| {
                let peer = Arc::new(Peer { queue: Mutex::new(Queue::default()), wake: Notify::new() });
                tokio::spawn(write_loop(node, peer.clone(), self.config.clone(), self.addresses.clone()));
                peer
            })
            .clone()
    }
}

fn hello(config: &LinkConfig) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(config.cluster_id.len() as u32).to_le_bytes());
    body.extend_from_slice(config.cluster_id.as_bytes());
    body.extend_from_slice(&config.me.0.to_le_bytes());
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

async fn write_loop(
    node: NodeId,
    peer: Arc<Peer>,
    config: Arc<LinkConfig>,
    addresses: Arc<Mutex<HashMap<NodeId, String>>>,
) {
    let mut backoff = Duration::from_millis(10);
    loop {
        let address = addresses.lock().get(&node).cloned();
        let connected = match address {
            Some(address) => {
                tokio::time::timeout(config.connect_timeout, TcpStream::connect(&address)).await.ok()
            }
            None => None, // not in the map (yet)
        };
        let mut stream = match connected {
            Some(Ok(stream)) => stream,
            _ => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(config.backoff_max);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if stream.write_all(&hello(&config)).await.is_err() {
            continue;
        }
        backoff = Duration::from_millis(10);
        // Write whatever is queued, in one batch, until the connection fails.
        let mut batch = Vec::new();
        loop {
            {
                let mut queue = peer.queue.lock();
                for frame in queue.frames.drain(..) {
                    batch.extend_from_slice(&frame);
                }
            }
            if batch.is_empty() {
                peer.wake.notified().await;
                continue;
            }
            if stream.write_all(&batch).await.is_err() {
                tracing::debug!(peer = %node, "peer link lost; reconnecting");
                break;
            }
            batch.clear();
        }
    }
}

/// Accepts peer connections and delivers their frames to `incoming`. A peer of
/// another cluster, or one sending a malformed frame, is disconnected.
pub async fn serve_incoming(
    listener: TcpListener,
    cluster_id: String,
    incoming: mpsc::UnboundedSender<Incoming>,
) {
    loop {
        let Ok((stream, remote)) = listener.accept().await else { continue };
        let cluster_id = cluster_id.clone();
        let incoming = incoming.clone();
        tokio::spawn(async move {
            if let Err(error) = read_peer(stream, &cluster_id, &incoming).await {
                tracing::warn!(%remote, %error, "peer link closed");
            }
        });
    }
}

async fn read_frame(stream: &mut TcpStream, buffer: &mut BytesMut) -> Result<Option<Bytes>, String> {
    let length = match stream.read_u32_le().await {
        Ok(length) => length as usize,
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error.to_string()),
    };
    if length > FRAME_BYTES_MAX {
        return Err(format!("frame of {length} bytes is over the limit"));
    }
    buffer.resize(length, 0);
    stream.read_exact(buffer).await.map_err(|error| error.to_string())?;
    Ok(Some(buffer.split().freeze()))
}

async fn read_peer(
    mut stream: TcpStream,
    cluster_id: &str,
    incoming: &mpsc::UnboundedSender<Incoming>,
) -> Result<(), String> {
    let mut buffer = BytesMut::new();
    let Some(hello) = read_frame(&mut stream, &mut buffer).await? else { return Ok(()) };
    let id_length =
        hello.get(..4).map(|bytes| u32::from_le_bytes(bytes.try_into().expect("4 bytes")) as usize);
    let (their_cluster, from) = match id_length {
        Some(length) if hello.len() == 8 + length => {
            let node = u32::from_le_bytes(hello[4 + length..].try_into().expect("4 bytes"));
            (String::from_utf8_lossy(&hello[4..4 + length]).into_owned(), NodeId(node))
        }
        _ => return Err("malformed hello".into()),
    };
    if their_cluster != cluster_id {
        return Err(format!("a peer of cluster '{their_cluster}' is not one of ours ('{cluster_id}')"));
    }
    while let Some(frame) = read_frame(&mut stream, &mut buffer).await? {
        if frame.len() < 4 {
            return Err("frame without a shard".into());
        }
        let shard = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes"));
        let message = PeerMessage::decode(frame.slice(4..)).map_err(|error| error.to_string())?;
        if incoming.send(Incoming { from, shard, message }).is_err() {
            return Ok(()); // the node is shutting down
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protocol::chain::ChainMessage;

    fn config(me: u32, cluster: &str) -> LinkConfig {
        LinkConfig {
            cluster_id: cluster.into(),
            me: NodeId(me),
            queue_max: 1000,
            connect_timeout: Duration::from_secs(1),
            backoff_max: Duration::from_millis(100),
        }
    }

    fn ack(seq: u64) -> PeerMessage {
        PeerMessage::new(&ChainMessage::Ack { view: 1, seq })
    }

    async fn listen(
        cluster: &str,
    ) -> (String, mpsc::UnboundedReceiver<Incoming>, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (sender, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve_incoming(listener, cluster.into(), sender));
        (address, receiver, task)
    }

    #[tokio::test]
    async fn frames_arrive_in_order_and_links_come_back() {
        let (address, mut received, server) = listen("c1").await;
        let links = Links::new(config(7, "c1"));
        links.set_addresses(HashMap::from([(NodeId(1), address.clone())]));
        for seq in 0..500 {
            links.send(NodeId(1), 3, &ack(seq));
        }
        for seq in 0..500 {
            let incoming = received.recv().await.unwrap();
            assert_eq!((incoming.from, incoming.shard), (NodeId(7), 3));
            assert_eq!(incoming.message, ack(seq));
        }
        // The peer goes away and comes back on the same port.
        server.abort();
        drop(received);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let listener = loop {
            match TcpListener::bind(&address).await {
                Ok(listener) => break listener,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let (sender, mut received) = mpsc::unbounded_channel();
        tokio::spawn(serve_incoming(listener, "c1".into(), sender));
        // Frames sent into the dead connection may be lost; later ones arrive.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut seq = 1000;
        loop {
            links.send(NodeId(1), 3, &ack(seq));
            seq += 1;
            if let Ok(Some(incoming)) = tokio::time::timeout(Duration::from_millis(50), received.recv()).await
            {
                assert_eq!(incoming.from, NodeId(7));
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the link never came back");
        }
    }

    #[tokio::test]
    async fn a_full_queue_drops_the_oldest_and_another_cluster_is_refused() {
        let links = Links::new(LinkConfig { queue_max: 10, ..config(1, "c1") });
        // No address known yet: everything queues.
        for seq in 0..25 {
            links.send(NodeId(2), 0, &ack(seq));
        }
        assert_eq!(links.dropped(NodeId(2)), 15);
        let (address, mut received, _server) = listen("c1").await;
        links.set_addresses(HashMap::from([(NodeId(2), address)]));
        let first = tokio::time::timeout(Duration::from_secs(5), received.recv()).await.unwrap().unwrap();
        assert_eq!(first.message, ack(15), "the oldest were dropped");

        let (stranger_address, mut stranger_received, _stranger) = listen("c2").await;
        links.set_addresses(HashMap::from([(NodeId(3), stranger_address)]));
        links.send(NodeId(3), 0, &ack(1));
        let nothing = tokio::time::timeout(Duration::from_millis(300), stranger_received.recv()).await;
        assert!(nothing.is_err(), "a node of another cluster delivers nothing");
    }
}
