//! Links between nodes: one outgoing TCP connection per peer carrying
//! length-prefixed frames `(shard, message)`, written in batches; incoming
//! connections read into one channel, a batch of frames per read. Every link
//! opens with the cluster plane's handshake ([`crate::auth`]); the frames of
//! an incoming link are the authenticated node's.
//!
//! ```text
//! hello:      len u32 | cluster_id_len u32 | cluster id | node u32 | nonce [32]   (connecting)
//! challenge:  len u32 | node u32 | nonce [32] | proof [32]                        (accepting)
//! proof:      len u32 | proof [32]                                                (connecting)
//! whole:      len u32 | 0 u8 | shard u32 | family u8 | body
//! part:       len u32 | 1 u8 | shard u32 | family u8 | body length u64 | offset u64 | bytes
//! ```
//!
//! A message whose body is larger than [`PART_BYTES`] travels in parts, one
//! message's parts in order, and between any two parts the link sends every
//! whole frame queued meanwhile: a 200 MiB value delays the small messages
//! behind it by one part, not by the whole transfer. The receiver gathers the
//! parts (up to [`MESSAGE_BYTES_MAX`]) as they arrive.
//!
//! Delivery is best effort, which the protocols are built for: they
//! retransmit, and tolerate loss, duplication and reordering. A link that
//! cannot connect retries with backoff; while it is down or slow it keeps at
//! most `queue_bytes_max` bytes of whole frames and as many of messages
//! waiting to go in parts, dropping the oldest (a message larger than that is
//! kept alone).
//!
//! A reader's buffer grows only as bytes arrive, never to the size a frame
//! announces, so a peer that announces large frames and sends nothing costs
//! nothing; the hello is limited to a few hundred bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tessera_protocol::codec::Family;
use tessera_protocol::{NodeId, PeerMessage};

use crate::auth::{nonce, ClusterSecret, Transcript, NONCE_BYTES, PROOF_BYTES};
use crate::tls::{self, MaybeTls, PeerTls, TlsError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, Semaphore};

/// The largest body sent in one frame; larger ones go in parts of this size.
pub const PART_BYTES: usize = 256 << 10;
/// The largest frame accepted: a part with its header.
const FRAME_BYTES_MAX: usize = PART_BYTES + 64;
/// The largest message accepted in parts: a value at the client limit
/// (512 MiB) in a batch or a snapshot chunk, with room to spare.
pub const MESSAGE_BYTES_MAX: usize = 1 << 30;
const WHOLE: u8 = 0;
const PART: u8 = 1;
/// kind, shard, family
const WHOLE_HEADER: usize = 1 + 4 + 1;
/// kind, shard, family, body length, offset
const PART_HEADER: usize = 1 + 4 + 1 + 8 + 8;
/// The largest handshake frame accepted (a cluster id, a node id, a nonce).
const HELLO_BYTES_MAX: usize = 512;
/// Incoming peer links held at once; more wait to be accepted.
const INCOMING_LINKS_MAX: usize = 256;
/// How much a reader asks the socket for at a time.
const READ_CHUNK: usize = 64 << 10;
/// Batches of incoming frames waiting for the node; a full channel stops the
/// readers, and TCP's flow control the peers.
pub const INCOMING_BATCHES_MAX: usize = 1024;

#[derive(Clone, Debug)]
pub struct LinkConfig {
    pub cluster_id: String,
    pub me: NodeId,
    pub secret: ClusterSecret,
    /// Bytes of whole frames kept per peer while its link is down or slow,
    /// and as many of messages waiting to go in parts.
    pub queue_bytes_max: usize,
    pub connect_timeout: Duration,
    /// How long the other side of a link has for its part of the handshake.
    pub handshake_timeout: Duration,
    pub backoff_max: Duration,
    /// Mutual TLS around every link (Redis's `tls-cluster`), inside which the
    /// handshake above runs.
    pub tls: Option<PeerTls>,
}

/// Why an incoming link was closed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {length} bytes is over the limit of {limit}")]
    Oversized { length: usize, limit: usize },
    #[error("the stream ended inside a frame")]
    Truncated,
    #[error("malformed handshake")]
    MalformedHandshake,
    #[error("a peer of another cluster")]
    ForeignCluster,
    #[error("the handshake took longer than {0:?}")]
    HandshakeTimeout(Duration),
    #[error("node {claimed} could not prove it knows the cluster secret")]
    Unproven { claimed: NodeId },
    #[error("the accepting side is node {found}, not node {expected}")]
    WrongPeer { expected: NodeId, found: NodeId },
    #[error("frame too short for its kind")]
    ShortFrame,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("message of {length} bytes in parts is over the limit of {limit}")]
    OversizedMessage { length: u64, limit: usize },
    #[error("a part that does not continue the message under way")]
    StrayPart,
    #[error("undecodable peer message: {0}")]
    Undecodable(String),
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// A message from a peer, for one shard.
#[derive(Debug)]
pub struct Incoming {
    pub from: NodeId,
    pub shard: u32,
    pub message: PeerMessage,
}

/// What waits for a peer: whole frames back to back with each one's length
/// (so the oldest can be dropped whole), and larger messages to go in parts.
#[derive(Default)]
struct Queue {
    whole: BytesMut,
    lengths: VecDeque<usize>,
    in_parts: VecDeque<Parted>,
    dropped: u64,
}

impl Queue {
    /// Bytes of the messages waiting to go in parts (a few at most).
    fn in_parts_bytes(&self) -> usize {
        self.in_parts.iter().map(|parted| parted.message.body().len()).sum()
    }
}

/// A message too large for one frame, and how much of it has been sent.
struct Parted {
    shard: u32,
    message: PeerMessage,
    sent: usize,
}

impl Parted {
    /// Appends the next part's frame to `out`; true once the last one is.
    fn put_next_part(&mut self, out: &mut BytesMut) -> bool {
        let body = self.message.body();
        let part = &body[self.sent..body.len().min(self.sent + PART_BYTES)];
        out.put_u32_le((PART_HEADER + part.len()) as u32);
        out.put_u8(PART);
        out.put_u32_le(self.shard);
        out.put_u8(self.message.family().0);
        out.put_u64_le(body.len() as u64);
        out.put_u64_le(self.sent as u64);
        out.put_slice(part);
        self.sent += part.len();
        self.sent == body.len()
    }
}

struct Peer {
    queue: Mutex<Queue>,
    wake: Notify,
}

/// The sending side: a queue and a writer task per peer, the tasks on the
/// runtime that made the links whichever thread sends.
pub struct Links {
    config: Arc<LinkConfig>,
    runtime: tokio::runtime::Handle,
    peers: Mutex<HashMap<NodeId, Arc<Peer>>>,
    addresses: Arc<Mutex<HashMap<NodeId, String>>>,
}

impl Links {
    /// Links whose writers run on the current runtime.
    pub fn new(config: LinkConfig) -> Arc<Self> {
        assert!(config.queue_bytes_max > 0, "a link must be able to hold a frame");
        Arc::new(Self {
            config: Arc::new(config),
            runtime: tokio::runtime::Handle::current(),
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
        let body_bytes = message.body().len();
        if body_bytes > MESSAGE_BYTES_MAX {
            // No peer would accept it; the protocol's resend meets the same fate.
            tracing::error!(peer = %to, bytes = body_bytes, "a peer message over the limit is not sent");
            return;
        }
        let peer = self.peer(to);
        {
            let mut queue = peer.queue.lock();
            let limit = self.config.queue_bytes_max;
            if body_bytes > PART_BYTES {
                while !queue.in_parts.is_empty() && queue.in_parts_bytes() + body_bytes > limit {
                    queue.in_parts.pop_front();
                    queue.dropped += 1;
                }
                queue.in_parts.push_back(Parted { shard, message: message.clone(), sent: 0 });
            } else {
                let length = 4 + WHOLE_HEADER + body_bytes;
                while !queue.lengths.is_empty() && queue.whole.len() + length > limit {
                    let oldest = queue.lengths.pop_front().expect("not empty");
                    queue.whole.advance(oldest);
                    queue.dropped += 1;
                }
                queue.whole.put_u32_le((WHOLE_HEADER + body_bytes) as u32);
                queue.whole.put_u8(WHOLE);
                queue.whole.put_u32_le(shard);
                message.encode(&mut queue.whole);
                queue.lengths.push_back(length);
            }
        }
        peer.wake.notify_one();
    }

    /// What the links were made with (the incoming side checks the same).
    pub fn config(&self) -> Arc<LinkConfig> {
        self.config.clone()
    }

    /// Memory the queues to every peer hold.
    pub fn queued_bytes(&self) -> usize {
        let peers: Vec<Arc<Peer>> = self.peers.lock().values().cloned().collect();
        peers
            .iter()
            .map(|peer| {
                let queue = peer.queue.lock();
                queue.whole.capacity() + queue.in_parts_bytes()
            })
            .sum()
    }

    /// Messages dropped for a peer because its queue was full.
    pub fn dropped(&self, peer: NodeId) -> u64 {
        self.peers.lock().get(&peer).map_or(0, |peer| peer.queue.lock().dropped)
    }

    fn peer(&self, node: NodeId) -> Arc<Peer> {
        let mut peers = self.peers.lock();
        peers
            .entry(node)
            .or_insert_with(|| {
                let peer = Arc::new(Peer { queue: Mutex::new(Queue::default()), wake: Notify::new() });
                let writer = write_loop(node, peer.clone(), self.config.clone(), self.addresses.clone());
                self.runtime.spawn(writer);
                peer
            })
            .clone()
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(body);
    frame
}

/// The connecting side of the handshake: names this node, checks that the
/// accepting side is `peer` and knows the secret, and proves it knows it too.
async fn connect_handshake(
    stream: MaybeTls,
    peer: NodeId,
    config: &LinkConfig,
) -> Result<MaybeTls, LinkError> {
    let mut reader = FrameReader { stream, buffer: BytesMut::new() };
    let connecting_nonce = nonce();
    let mut hello = Vec::new();
    hello.extend_from_slice(&(config.cluster_id.len() as u32).to_le_bytes());
    hello.extend_from_slice(config.cluster_id.as_bytes());
    hello.extend_from_slice(&config.me.0.to_le_bytes());
    hello.extend_from_slice(&connecting_nonce);
    reader.stream.write_all(&frame(&hello)).await?;
    let mut frames = Vec::new();
    reader.frames(HELLO_BYTES_MAX, 1, &mut frames).await?;
    let challenge = frames.pop().ok_or(LinkError::MalformedHandshake)?;
    if challenge.len() != 4 + NONCE_BYTES + PROOF_BYTES {
        return Err(LinkError::MalformedHandshake);
    }
    let found = NodeId(u32::from_le_bytes(challenge[..4].try_into().expect("4 bytes")));
    if found != peer {
        return Err(LinkError::WrongPeer { expected: peer, found });
    }
    let transcript = Transcript {
        cluster: config.cluster_id.clone(),
        connecting: config.me.0.to_string(),
        accepting: peer.0.to_string(),
        connecting_nonce,
        accepting_nonce: challenge[4..4 + NONCE_BYTES].try_into().expect("nonce bytes"),
    };
    if !config.secret.verify_accepting(&transcript, &challenge[4 + NONCE_BYTES..]) {
        return Err(LinkError::Unproven { claimed: peer });
    }
    reader.stream.write_all(&frame(&config.secret.connecting_proof(&transcript))).await?;
    Ok(reader.stream)
}

/// The accepting side of the handshake: the node the link is from, once it
/// has proved it knows the secret. Nothing about this cluster is told to a
/// side that names another.
async fn accept_handshake(reader: &mut FrameReader, config: &LinkConfig) -> Result<NodeId, LinkError> {
    let mut frames = Vec::new();
    reader.frames(HELLO_BYTES_MAX, 1, &mut frames).await?;
    let Some(hello) = frames.pop() else { return Err(LinkError::MalformedHandshake) };
    let id_length =
        hello.get(..4).map(|bytes| u32::from_le_bytes(bytes.try_into().expect("4 bytes")) as usize);
    let (cluster, from, connecting_nonce) = match id_length {
        Some(length) if hello.len() == 8 + length + NONCE_BYTES => {
            let node = u32::from_le_bytes(hello[4 + length..8 + length].try_into().expect("4 bytes"));
            let nonce: [u8; NONCE_BYTES] = hello[8 + length..].try_into().expect("nonce bytes");
            (&hello[4..4 + length], NodeId(node), nonce)
        }
        _ => return Err(LinkError::MalformedHandshake),
    };
    if cluster != config.cluster_id.as_bytes() {
        return Err(LinkError::ForeignCluster);
    }
    let transcript = Transcript {
        cluster: config.cluster_id.clone(),
        connecting: from.0.to_string(),
        accepting: config.me.0.to_string(),
        connecting_nonce,
        accepting_nonce: nonce(),
    };
    let mut challenge = config.me.0.to_le_bytes().to_vec();
    challenge.extend_from_slice(&transcript.accepting_nonce);
    challenge.extend_from_slice(&config.secret.accepting_proof(&transcript));
    reader.stream.write_all(&frame(&challenge)).await?;
    reader.frames(HELLO_BYTES_MAX, 1, &mut frames).await?;
    match frames.pop() {
        Some(proof) if config.secret.verify_connecting(&transcript, &proof) => Ok(from),
        Some(_) => Err(LinkError::Unproven { claimed: from }),
        None => Err(LinkError::MalformedHandshake),
    }
}

async fn within<T>(limit: Duration, work: impl std::future::Future<Output = T>) -> Result<T, LinkError> {
    tokio::time::timeout(limit, work).await.map_err(|_| LinkError::HandshakeTimeout(limit))
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
        let connected = match &address {
            Some(address) => {
                tokio::time::timeout(config.connect_timeout, TcpStream::connect(&address)).await.ok()
            }
            None => None,
        };
        let opened = match (connected, address) {
            (Some(Ok(stream)), Some(address)) => {
                let _ = stream.set_nodelay(true);
                // The accepting side gets as long for TLS and the handshake as it gives.
                let handshake = async {
                    let stream = tls::connecting(config.tls.as_ref(), stream, &address).await?;
                    connect_handshake(stream, node, &config).await
                };
                match within(config.handshake_timeout, handshake).await.and_then(|done| done) {
                    Ok(stream) => Some(stream),
                    // A peer gone mid-handshake is like one not there; a refusal is news.
                    Err(LinkError::Io(_)) => None,
                    Err(error) => {
                        tracing::warn!(peer = %node, %error, "peer link refused");
                        None
                    }
                }
            }
            _ => None, // not reachable, or not in the map (yet)
        };
        let Some(mut stream) = opened else {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(config.backoff_max);
            continue;
        };
        backoff = Duration::from_millis(10);
        // Write whatever whole frames are queued and the next part of a large
        // message, in one batch, until the connection fails; a message cut
        // off by a failure is not resumed (the receiver forgets its parts).
        let mut in_parts: Option<Parted> = None;
        loop {
            let mut batch = {
                let mut queue = peer.queue.lock();
                queue.lengths.clear();
                if in_parts.is_none() {
                    in_parts = queue.in_parts.pop_front();
                }
                queue.whole.split()
            };
            if let Some(parted) = &mut in_parts {
                if parted.put_next_part(&mut batch) {
                    in_parts = None;
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
        }
    }
}

/// Accepts peer links, at most [`INCOMING_LINKS_MAX`] at once, and delivers
/// their frames to `incoming`, a batch per read. A side that does not
/// complete the handshake in time, or sends a malformed frame, is
/// disconnected.
pub async fn serve_incoming(
    listener: TcpListener,
    config: Arc<LinkConfig>,
    incoming: mpsc::Sender<Vec<Incoming>>,
) {
    let room = Arc::new(Semaphore::new(INCOMING_LINKS_MAX));
    loop {
        let Ok(permit) = room.clone().acquire_owned().await else { return };
        let Ok((stream, remote)) = listener.accept().await else { continue };
        let (config, incoming) = (config.clone(), incoming.clone());
        tokio::spawn(async move {
            if let Err(error) = read_peer(stream, &config, &incoming).await {
                tracing::warn!(%remote, %error, "peer link closed");
            }
            drop(permit);
        });
    }
}

/// Length-prefixed frames from a stream, read a chunk at a time.
struct FrameReader {
    stream: MaybeTls,
    buffer: BytesMut,
}

impl FrameReader {
    /// Appends up to `most` frames complete in what has arrived, reading
    /// until there is at least one; none when the stream ended between frames.
    async fn frames(&mut self, limit: usize, most: usize, frames: &mut Vec<Bytes>) -> Result<(), LinkError> {
        let before = frames.len();
        loop {
            while self.buffer.len() >= 4 && frames.len() - before < most {
                let length = u32::from_le_bytes(self.buffer[..4].try_into().expect("4 bytes")) as usize;
                if length > limit {
                    return Err(LinkError::Oversized { length, limit });
                }
                if self.buffer.len() < 4 + length {
                    break;
                }
                self.buffer.advance(4);
                frames.push(self.buffer.split_to(length).freeze());
            }
            if frames.len() > before {
                return Ok(());
            }
            // The buffer grows with the bytes that arrive, a chunk at a time,
            // never to the length a frame claims.
            self.buffer.reserve(READ_CHUNK);
            if self.stream.read_buf(&mut self.buffer).await? == 0 {
                return if self.buffer.is_empty() { Ok(()) } else { Err(LinkError::Truncated) };
            }
        }
    }
}

async fn read_peer(
    stream: TcpStream,
    config: &LinkConfig,
    incoming: &mpsc::Sender<Vec<Incoming>>,
) -> Result<(), LinkError> {
    let accepted = async {
        let stream = tls::accepting(config.tls.as_ref(), stream).await?;
        let mut reader = FrameReader { stream, buffer: BytesMut::new() };
        let from = accept_handshake(&mut reader, config).await?;
        Ok::<_, LinkError>((reader, from))
    };
    let (mut reader, from) = within(config.handshake_timeout, accepted).await??;
    let mut frames = Vec::new();
    let mut gathering = Gathering::default();
    loop {
        reader.frames(FRAME_BYTES_MAX, usize::MAX, &mut frames).await?;
        if frames.is_empty() {
            return Ok(()); // the peer closed the link
        }
        let mut batch = Vec::with_capacity(frames.len());
        for frame in frames.drain(..) {
            if let Some((shard, message)) = gathering.take(frame)? {
                batch.push(Incoming { from, shard, message });
            }
        }
        if !batch.is_empty() && incoming.send(batch).await.is_err() {
            return Ok(()); // the node is shutting down
        }
    }
}

/// The message under way in parts on one link.
#[derive(Default)]
struct Gathering {
    under_way: Option<(u32, Family, usize, BytesMut)>,
}

impl Gathering {
    /// The message a frame completes, if any.
    fn take(&mut self, mut frame: Bytes) -> Result<Option<(u32, PeerMessage)>, LinkError> {
        let kind = *frame.first().ok_or(LinkError::ShortFrame)?;
        match kind {
            WHOLE => {
                if frame.len() < WHOLE_HEADER {
                    return Err(LinkError::ShortFrame);
                }
                let shard = u32::from_le_bytes(frame[1..5].try_into().expect("4 bytes"));
                let message = PeerMessage::decode(frame.slice(5..))
                    .map_err(|error| LinkError::Undecodable(error.to_string()))?;
                Ok(Some((shard, message)))
            }
            PART => {
                if frame.len() < PART_HEADER {
                    return Err(LinkError::ShortFrame);
                }
                frame.advance(1);
                let (shard, family) = (frame.get_u32_le(), Family(frame.get_u8()));
                let (length, offset) = (frame.get_u64_le(), frame.get_u64_le());
                if length > MESSAGE_BYTES_MAX as u64 {
                    return Err(LinkError::OversizedMessage { length, limit: MESSAGE_BYTES_MAX });
                }
                let length = length as usize;
                let under_way =
                    self.under_way.get_or_insert_with(|| (shard, family, length, BytesMut::new()));
                let (expected_shard, expected_family, expected_length, body) = under_way;
                if (shard, family, length) != (*expected_shard, *expected_family, *expected_length)
                    || offset != body.len() as u64
                    || body.len() + frame.len() > length
                {
                    return Err(LinkError::StrayPart);
                }
                // Grows with the parts that arrive, never to the announced length at once.
                body.extend_from_slice(&frame);
                if body.len() < length {
                    return Ok(None);
                }
                let (shard, family, _, body) = self.under_way.take().expect("under way");
                Ok(Some((shard, PeerMessage::from_parts(family, body.freeze()))))
            }
            kind => Err(LinkError::UnknownKind(kind)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_protocol::chain::ChainMessage;

    /// One secret for the tests' cluster; a stranger makes its own.
    fn secret() -> ClusterSecret {
        static SECRET: std::sync::OnceLock<ClusterSecret> = std::sync::OnceLock::new();
        SECRET.get_or_init(ClusterSecret::generate).clone()
    }

    fn config(me: u32, cluster: &str) -> LinkConfig {
        LinkConfig {
            cluster_id: cluster.into(),
            me: NodeId(me),
            secret: secret(),
            queue_bytes_max: 1 << 20,
            connect_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_millis(300),
            backoff_max: Duration::from_millis(100),
            tls: None,
        }
    }

    fn ack(seq: u64) -> PeerMessage {
        PeerMessage::new(&ChainMessage::Ack { view: 1, seq })
    }

    /// What one queued acknowledgement takes.
    fn ack_frame_bytes() -> usize {
        4 + WHOLE_HEADER + ack(0).body().len()
    }

    /// A message of about `bytes`, distinct per `seq`.
    fn large(seq: u64, bytes: usize) -> PeerMessage {
        let mut value = vec![(seq % 251) as u8; bytes];
        value[bytes / 2] = 7;
        PeerMessage::new(&ChainMessage::Forward {
            view: 1,
            seq,
            origin: NodeId(7),
            writes: vec![(Bytes::from_static(b"k"), tessera_protocol::Write::Put(Bytes::from(value)))],
        })
    }

    /// The receiving end, one message at a time.
    struct Received {
        batches: mpsc::Receiver<Vec<Incoming>>,
        pending: VecDeque<Incoming>,
    }

    impl Received {
        async fn next(&mut self) -> Option<Incoming> {
            while self.pending.is_empty() {
                self.pending.extend(self.batches.recv().await?);
            }
            self.pending.pop_front()
        }

        async fn within(&mut self, wait: Duration) -> Option<Incoming> {
            tokio::time::timeout(wait, self.next()).await.ok().flatten()
        }
    }

    /// Node 1's incoming side, as `config` has it.
    async fn serve(listener: TcpListener, config: LinkConfig) -> (Received, tokio::task::JoinHandle<()>) {
        let (sender, batches) = mpsc::channel(INCOMING_BATCHES_MAX);
        let task = tokio::spawn(serve_incoming(listener, Arc::new(config), sender));
        (Received { batches, pending: VecDeque::new() }, task)
    }

    async fn listen_as(config: LinkConfig) -> (String, Received, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (received, task) = serve(listener, config).await;
        (address, received, task)
    }

    async fn listen(cluster: &str) -> (String, Received, tokio::task::JoinHandle<()>) {
        listen_as(config(1, cluster)).await
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
            let incoming = received.next().await.unwrap();
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
        let (mut received, _server) = serve(listener, config(1, "c1")).await;
        // Frames sent into the dead connection may be lost; later ones arrive.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut seq = 1000;
        loop {
            links.send(NodeId(1), 3, &ack(seq));
            seq += 1;
            if let Some(incoming) = received.within(Duration::from_millis(50)).await {
                assert_eq!(incoming.from, NodeId(7));
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the link never came back");
        }
    }

    #[tokio::test]
    async fn a_full_queue_drops_the_oldest_and_another_cluster_is_refused() {
        let links = Links::new(LinkConfig { queue_bytes_max: 10 * ack_frame_bytes(), ..config(1, "c1") });
        // No address known yet: everything queues.
        for seq in 0..25 {
            links.send(NodeId(2), 0, &ack(seq));
        }
        assert_eq!(links.dropped(NodeId(2)), 15);
        let (address, mut received, _server) = listen_as(config(2, "c1")).await;
        links.set_addresses(HashMap::from([(NodeId(2), address)]));
        for seq in 15..25 {
            let incoming = received.within(Duration::from_secs(5)).await.unwrap();
            assert_eq!(incoming.message, ack(seq), "the oldest were dropped, the rest arrive whole");
        }

        let (stranger_address, mut stranger_received, _stranger) = listen_as(config(3, "c2")).await;
        links.set_addresses(HashMap::from([(NodeId(3), stranger_address)]));
        links.send(NodeId(3), 0, &ack(1));
        let nothing = stranger_received.within(Duration::from_millis(300)).await;
        assert!(nothing.is_none(), "a node of another cluster delivers nothing");
    }

    #[tokio::test]
    async fn a_large_message_arrives_whole_and_small_ones_pass_it_on_the_way() {
        let (address, mut received, _server) = listen("c1").await;
        let links = Links::new(config(7, "c1"));
        let big = large(1, 40 * PART_BYTES + 123);
        links.send(NodeId(1), 4, &big);
        links.send(NodeId(1), 4, &ack(1));
        links.set_addresses(HashMap::from([(NodeId(1), address)]));
        let first = received.within(Duration::from_secs(5)).await.unwrap();
        assert_eq!(first.message, ack(1), "the small message does not wait for 40 parts");
        let second = received.within(Duration::from_secs(5)).await.unwrap();
        assert_eq!((second.from, second.shard), (NodeId(7), 4));
        assert!(second.message == big, "the large message arrives byte for byte");
        // Messages waiting for parts are bounded by bytes too, the oldest going first.
        let small_queue = Links::new(LinkConfig { queue_bytes_max: 3 * PART_BYTES, ..config(7, "c1") });
        for seq in 0..4 {
            small_queue.send(NodeId(2), 0, &large(seq, 2 * PART_BYTES));
        }
        assert_eq!(small_queue.dropped(NodeId(2)), 3, "one message of two parts fits");
        small_queue.send(NodeId(2), 0, &large(9, 5 * PART_BYTES));
        assert_eq!(small_queue.dropped(NodeId(2)), 4, "a message over the bound is kept alone");
    }

    /// An authenticated link to node 1 at `address`, as node 7, for writing raw frames.
    async fn authenticated_stream(address: &str) -> MaybeTls {
        let stream = TcpStream::connect(address).await.unwrap();
        connect_handshake(MaybeTls::Plain(stream), NodeId(1), &config(7, "c1")).await.unwrap()
    }

    fn part_frame(shard: u32, length: u64, offset: u64, bytes: &[u8]) -> Vec<u8> {
        let mut body = vec![PART];
        body.extend_from_slice(&shard.to_le_bytes());
        body.push(ack(0).family().0);
        body.extend_from_slice(&length.to_le_bytes());
        body.extend_from_slice(&offset.to_le_bytes());
        body.extend_from_slice(bytes);
        frame(&body)
    }

    #[tokio::test]
    async fn parts_out_of_order_or_over_the_limit_close_the_link() {
        let (address, mut received, _server) = listen("c1").await;
        let cases = [
            ("a second part first", part_frame(0, 100, 50, &[0; 50])),
            ("a message over the limit", part_frame(0, MESSAGE_BYTES_MAX as u64 + 1, 0, &[0; 10])),
            ("more bytes than announced", part_frame(0, 10, 0, &[0; 20])),
            ("another message's part before the first ends", {
                let mut bytes = part_frame(0, 100, 0, &[0; 50]);
                bytes.extend_from_slice(&part_frame(1, 100, 50, &[0; 50]));
                bytes
            }),
            ("an unknown kind", frame(&[9, 0, 0, 0, 0, 0])),
        ];
        for (case, bytes) in cases {
            let mut stream = authenticated_stream(&address).await;
            stream.write_all(&bytes).await.unwrap();
            let mut rest = [0u8; 1];
            let closed = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut rest)).await;
            assert!(matches!(closed, Ok(Ok(0) | Err(_))), "{case}: the link was closed");
        }
        assert!(received.within(Duration::from_millis(50)).await.is_none(), "nothing was delivered");
        // The parts of one message, in order, are delivered as one message.
        let mut stream = authenticated_stream(&address).await;
        let body = ack(5).body().clone();
        let (head, tail) = body.split_at(body.len() / 2);
        stream.write_all(&part_frame(3, body.len() as u64, 0, head)).await.unwrap();
        stream.write_all(&part_frame(3, body.len() as u64, head.len() as u64, tail)).await.unwrap();
        let incoming = received.within(Duration::from_secs(5)).await.expect("the gathered message");
        assert_eq!((incoming.shard, incoming.message), (3, ack(5)));
    }

    fn peer_tls(dir: &std::path::Path) -> PeerTls {
        PeerTls::from_files(&dir.join("server.crt"), &dir.join("server.key"), &dir.join("ca.crt")).unwrap()
    }

    #[tokio::test]
    async fn links_under_tls_carry_messages_and_a_peer_without_it_is_refused() {
        let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for dir in [&ours, &theirs] {
            crate::tls::write_certificates(dir.path(), &["127.0.0.1".to_string()]).unwrap();
        }
        let secured = |me| LinkConfig { tls: Some(peer_tls(ours.path())), ..config(me, "c1") };
        let (address, mut received, _server) = listen_as(secured(1)).await;
        let member = Links::new(secured(7));
        member.set_addresses(HashMap::from([(NodeId(1), address.clone())]));
        member.send(NodeId(1), 2, &ack(1));
        member.send(NodeId(1), 2, &large(2, 3 * PART_BYTES));
        let first = received.within(Duration::from_secs(5)).await.expect("a message under TLS");
        assert_eq!((first.from, first.message), (NodeId(7), ack(1)));
        let second = received.within(Duration::from_secs(5)).await.expect("a large one too");
        assert!(second.message == large(2, 3 * PART_BYTES));
        // Knowing the secret is not enough without TLS, nor TLS from another CA.
        for stranger in
            [config(8, "c1"), LinkConfig { tls: Some(peer_tls(theirs.path())), ..config(9, "c1") }]
        {
            let links = Links::new(stranger);
            links.set_addresses(HashMap::from([(NodeId(1), address.clone())]));
            links.send(NodeId(1), 2, &ack(3));
            assert!(received.within(Duration::from_millis(500)).await.is_none(), "refused");
        }
    }

    /// A reader over the far end of a connection whose near end the test writes.
    async fn reader_and_writer() -> (FrameReader, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        (FrameReader { stream: MaybeTls::Plain(stream), buffer: BytesMut::new() }, writer)
    }

    #[tokio::test]
    async fn a_claimed_length_costs_nothing_until_its_bytes_arrive() {
        let (mut reader, mut writer) = reader_and_writer().await;
        let mut bytes = ((FRAME_BYTES_MAX - 1) as u32).to_le_bytes().to_vec();
        bytes.push(7);
        writer.write_all(&bytes).await.unwrap();
        let mut frames = Vec::new();
        let read = tokio::time::timeout(
            Duration::from_millis(200),
            reader.frames(FRAME_BYTES_MAX, usize::MAX, &mut frames),
        )
        .await;
        assert!(read.is_err(), "still waiting for the frame's bytes");
        assert!(reader.buffer.capacity() <= 2 * READ_CHUNK, "capacity {}", reader.buffer.capacity());

        let (mut reader, mut writer) = reader_and_writer().await;
        writer.write_all(&((FRAME_BYTES_MAX + 1) as u32).to_le_bytes()).await.unwrap();
        let refused = reader.frames(FRAME_BYTES_MAX, usize::MAX, &mut frames).await;
        assert!(matches!(refused, Err(LinkError::Oversized { .. })), "{refused:?}");

        let (mut reader, mut writer) = reader_and_writer().await;
        writer.write_all(&[3, 0, 0, 0, 1, 2, 3, 2, 0, 0, 0, 9]).await.unwrap();
        drop(writer);
        reader.frames(FRAME_BYTES_MAX, usize::MAX, &mut frames).await.unwrap();
        assert_eq!(frames, vec![Bytes::from_static(&[1, 2, 3])], "one whole frame");
        frames.clear();
        let cut = reader.frames(FRAME_BYTES_MAX, usize::MAX, &mut frames).await;
        assert!(matches!(cut, Err(LinkError::Truncated)), "{cut:?}");
    }

    #[tokio::test]
    async fn a_hello_longer_than_a_hello_is_refused() {
        let (address, mut received, _server) = listen("c1").await;
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream.write_all(&(HELLO_BYTES_MAX as u32 + 1).to_le_bytes()).await.unwrap();
        let mut rest = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut rest)).await.unwrap();
        assert!(matches!(closed, Ok(0) | Err(_)), "the link was closed");
        assert!(received.within(Duration::from_millis(50)).await.is_none());
    }

    #[tokio::test]
    async fn only_who_proves_the_secret_is_heard_and_only_as_itself() {
        let (address, mut received, _server) = listen("c1").await;
        // A process that knows the cluster id but not the secret.
        let stranger = Links::new(LinkConfig { secret: ClusterSecret::generate(), ..config(7, "c1") });
        stranger.set_addresses(HashMap::from([(NodeId(1), address.clone())]));
        stranger.send(NodeId(1), 0, &ack(1));
        assert!(
            received.within(Duration::from_millis(300)).await.is_none(),
            "a forged link delivers nothing"
        );

        // A member that connects to an address where another node listens
        // finds out before it sends anything there.
        let member = Links::new(config(7, "c1"));
        member.set_addresses(HashMap::from([(NodeId(4), address.clone())]));
        member.send(NodeId(4), 0, &ack(2));
        assert!(
            received.within(Duration::from_millis(300)).await.is_none(),
            "sent to node 4, heard by node 1"
        );

        // The accepting side checks the proof over what it was told: a
        // hello followed by someone else's proof is refused.
        let mut stream = TcpStream::connect(&address).await.unwrap();
        let mut hello = 2u32.to_le_bytes().to_vec();
        hello.extend_from_slice(b"c1");
        hello.extend_from_slice(&9u32.to_le_bytes());
        hello.extend_from_slice(&nonce());
        stream.write_all(&frame(&hello)).await.unwrap();
        let mut reader = FrameReader { stream: MaybeTls::Plain(stream), buffer: BytesMut::new() };
        let mut frames = Vec::new();
        reader.frames(HELLO_BYTES_MAX, 1, &mut frames).await.unwrap();
        assert_eq!(frames[0].len(), 4 + NONCE_BYTES + PROOF_BYTES, "a challenge");
        reader.stream.write_all(&frame(&[0; PROOF_BYTES])).await.unwrap();
        let mut rest = [0u8; 1];
        let closed =
            tokio::time::timeout(Duration::from_secs(5), reader.stream.read(&mut rest)).await.unwrap();
        assert!(matches!(closed, Ok(0) | Err(_)), "closed after a wrong proof");

        // A member is heard, as itself.
        member.set_addresses(HashMap::from([(NodeId(1), address)]));
        member.send(NodeId(1), 5, &ack(3));
        let incoming = received.within(Duration::from_secs(5)).await.expect("a member's frame");
        assert_eq!((incoming.from, incoming.shard, incoming.message), (NodeId(7), 5, ack(3)));
    }

    #[tokio::test]
    async fn a_side_that_stalls_in_the_handshake_is_let_go() {
        let (address, _received, _server) = listen("c1").await;
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream.write_all(&[10, 0, 0]).await.unwrap(); // part of a length, then nothing
        let mut rest = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut rest)).await.unwrap();
        assert!(matches!(closed, Ok(0) | Err(_)), "closed once the handshake time ran out");
    }

    /// After whatever a fuzz test sent: a member's message still arrives.
    async fn a_member_is_still_heard(address: String, received: &mut Received) {
        let member = Links::new(config(7, "c1"));
        member.set_addresses(HashMap::from([(NodeId(1), address)]));
        member.send(NodeId(1), 2, &ack(9));
        let incoming = received.within(Duration::from_secs(5)).await.expect("a member is still heard");
        assert_eq!((incoming.from, incoming.message), (NodeId(7), ack(9)));
    }

    /// Whatever frames a member sends, whole or in parts, the link either
    /// delivers messages or closes; the port goes on serving.
    #[test]
    fn a_peer_port_survives_whatever_frames_a_member_sends() {
        use proptest::prelude::*;

        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (address, mut received, _server) = runtime.block_on(listen("c1"));
        let whole =
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(shard, body)| {
                let mut frame_body = vec![WHOLE];
                frame_body.extend_from_slice(&shard.to_le_bytes());
                frame_body.extend_from_slice(&body);
                frame(&frame_body)
            });
        let part = (0u32..3, 0u64..300, 0u64..300, proptest::collection::vec(any::<u8>(), 0..200))
            .prop_map(|(shard, length, offset, bytes)| part_frame(shard, length, offset, &bytes));
        let raw = proptest::collection::vec(any::<u8>(), 0..100).prop_map(|bytes| frame(&bytes));
        let frames = proptest::collection::vec(prop_oneof![whole, part, raw], 1..12);
        let panics = tessera_testkit::panics_so_far();
        let cases = tessera_testkit::fuzz_cases(64);
        proptest!(ProptestConfig { cases, ..ProptestConfig::default() }, |(frames in frames)| {
            runtime.block_on(async {
                let mut stream = authenticated_stream(&address).await;
                let _ = stream.write_all(&frames.concat()).await;
                let _ = stream.shutdown().await;
                let mut sink = [0u8; 256];
                let drained = async { while matches!(stream.read(&mut sink).await, Ok(read) if read > 0) {} };
                let _ = tokio::time::timeout(Duration::from_millis(400), drained).await;
            });
        });
        runtime.block_on(async {
            while received.within(Duration::from_millis(50)).await.is_some() {}
            a_member_is_still_heard(address, &mut received).await;
        });
        assert_eq!(tessera_testkit::panics_so_far(), panics, "a link's task panicked");
    }

    /// Whatever a connection sends a peer port, nothing is delivered without
    /// the secret, nothing panics, and members' links go on working.
    /// `PROPTEST_CASES` raises the count (scripts/fuzz.sh).
    #[test]
    fn a_peer_port_survives_whatever_a_connection_sends() {
        use proptest::prelude::*;
        use std::io::{Read, Write};

        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let (address, mut received, _server) = runtime.block_on(listen("c1"));
        let hello_like =
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..80)).prop_map(|(node, tail)| {
                let mut body = 2u32.to_le_bytes().to_vec();
                body.extend_from_slice(b"c1");
                body.extend_from_slice(&node.to_le_bytes());
                body.extend_from_slice(&tail);
                let mut bytes = frame(&body);
                bytes.extend_from_slice(&frame(&tail));
                bytes
            });
        let input = prop_oneof![hello_like, proptest::collection::vec(any::<u8>(), 0..600)];
        let panics = tessera_testkit::panics_so_far();
        let cases = tessera_testkit::fuzz_cases(64);
        proptest!(ProptestConfig { cases, ..ProptestConfig::default() }, |(bytes in input)| {
            let mut stream = std::net::TcpStream::connect(&address).unwrap();
            stream.set_read_timeout(Some(Duration::from_millis(400))).unwrap();
            let _ = stream.write_all(&bytes);
            let _ = stream.shutdown(std::net::Shutdown::Write);
            let mut sink = [0u8; 256];
            while matches!(stream.read(&mut sink), Ok(read) if read > 0) {}
        });
        runtime.block_on(async {
            assert!(received.within(Duration::from_millis(100)).await.is_none(), "junk delivered nothing");
            a_member_is_still_heard(address, &mut received).await;
        });
        assert_eq!(tessera_testkit::panics_so_far(), panics, "a link's task panicked");
    }
}
