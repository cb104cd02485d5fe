//! Publish/subscribe, as Redis has it: channels, patterns, and shard
//! channels (SSUBSCRIBE / SPUBLISH, served by the slot's head in a cluster).
//!
//! A subscribed connection owns a [`Subscription`]: its channels and a queue
//! of messages that its connection writes out as they come, between
//! commands. Publishers put messages in the queues of the matching
//! subscribers and never wait for them; a subscriber whose queue holds more
//! than `client_output_buffer_limit` bytes is marked and its connection
//! closed, as Redis closes a pub/sub client past its output buffer limit.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::glob::glob_match;

/// What a subscriber is sent.
#[derive(Debug)]
pub struct Message {
    /// The pattern it matched, for PSUBSCRIBE's `pmessage`.
    pub pattern: Option<Bytes>,
    pub channel: Bytes,
    pub payload: Bytes,
    /// Sent to a shard channel (`smessage`).
    pub shard: bool,
}

impl Message {
    fn bytes(&self) -> usize {
        self.pattern.as_ref().map_or(0, Bytes::len) + self.channel.len() + self.payload.len() + 64
    }
}

#[derive(Debug)]
struct Subscriber {
    sender: mpsc::UnboundedSender<Message>,
    /// Bytes queued and not yet written out.
    pending: AtomicUsize,
    overflowed: AtomicBool,
    /// Signalled when it overflows, to stop a write the client is not reading.
    overflow: Arc<Notify>,
}

/// Which registry a subscription is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Channel,
    Pattern,
    ShardChannel,
}

type Subscribers = HashMap<Bytes, HashMap<u64, Arc<Subscriber>>>;

/// The node's subscribers, by channel, pattern and shard channel.
pub struct PubSub {
    registries: Mutex<HashMap<Kind, Subscribers>>,
    next_id: AtomicU64,
    /// A subscriber's most queued bytes (0: no limit).
    limit: usize,
}

impl PubSub {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self { registries: Mutex::new(HashMap::new()), next_id: AtomicU64::new(1), limit })
    }

    /// A new subscription for a connection, subscribed to nothing yet.
    pub fn subscription(self: &Arc<Self>) -> Subscription {
        let (sender, receiver) = mpsc::unbounded_channel();
        Subscription {
            pubsub: self.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            subscriber: Arc::new(Subscriber {
                sender,
                pending: AtomicUsize::new(0),
                overflowed: AtomicBool::new(false),
                overflow: Arc::new(Notify::new()),
            }),
            receiver,
            names: HashMap::new(),
        }
    }

    /// Sends `payload` to `channel`'s subscribers (and, unless `shard`, to
    /// the patterns it matches): how many received it.
    pub fn publish(&self, channel: &[u8], payload: &[u8], shard: bool) -> usize {
        let registries = self.registries.lock();
        let (channel, payload) = (Bytes::copy_from_slice(channel), Bytes::copy_from_slice(payload));
        let mut received = 0;
        let kind = if shard { Kind::ShardChannel } else { Kind::Channel };
        if let Some(subscribers) = registries.get(&kind).and_then(|by_name| by_name.get(&channel)) {
            for subscriber in subscribers.values() {
                let message =
                    Message { pattern: None, channel: channel.clone(), payload: payload.clone(), shard };
                received += usize::from(self.deliver(subscriber, message));
            }
        }
        if !shard {
            for (pattern, subscribers) in registries.get(&Kind::Pattern).into_iter().flatten() {
                if glob_match(pattern, &channel) {
                    for subscriber in subscribers.values() {
                        let message = Message {
                            pattern: Some(pattern.clone()),
                            channel: channel.clone(),
                            payload: payload.clone(),
                            shard,
                        };
                        received += usize::from(self.deliver(subscriber, message));
                    }
                }
            }
        }
        received
    }

    fn deliver(&self, subscriber: &Subscriber, message: Message) -> bool {
        if subscriber.overflowed.load(Ordering::Relaxed) {
            return false;
        }
        let bytes = message.bytes();
        let pending = subscriber.pending.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if self.limit != 0 && pending > self.limit {
            subscriber.overflowed.store(true, Ordering::Relaxed);
            subscriber.overflow.notify_one();
            return false;
        }
        subscriber.sender.send(message).is_ok()
    }

    /// PUBSUB CHANNELS / SHARDCHANNELS: the names with subscribers, those
    /// `pattern` matches if given.
    pub fn channels(&self, kind: Kind, pattern: Option<&[u8]>) -> Vec<Bytes> {
        let registries = self.registries.lock();
        registries
            .get(&kind)
            .into_iter()
            .flat_map(|by_name| by_name.keys())
            .filter(|name| pattern.is_none_or(|pattern| glob_match(pattern, name)))
            .cloned()
            .collect()
    }

    /// PUBSUB NUMSUB / SHARDNUMSUB: a channel's subscribers.
    pub fn subscribers(&self, kind: Kind, channel: &[u8]) -> usize {
        self.registries.lock().get(&kind).and_then(|by_name| by_name.get(channel)).map_or(0, HashMap::len)
    }

    /// PUBSUB NUMPAT: patterns subscribed to (by anyone).
    pub fn patterns(&self) -> usize {
        self.registries.lock().get(&Kind::Pattern).map_or(0, HashMap::len)
    }
}

/// One connection's subscriptions and its queue of messages.
#[derive(Debug)]
pub struct Subscription {
    pubsub: Arc<PubSub>,
    id: u64,
    subscriber: Arc<Subscriber>,
    receiver: mpsc::UnboundedReceiver<Message>,
    names: HashMap<Kind, HashSet<Bytes>>,
}

impl std::fmt::Debug for PubSub {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("PubSub").finish_non_exhaustive()
    }
}

impl Subscription {
    /// How many channels, patterns and shard channels it holds.
    pub fn counts(&self) -> (usize, usize, usize) {
        let count = |kind| self.names.get(&kind).map_or(0, HashSet::len);
        (count(Kind::Channel), count(Kind::Pattern), count(Kind::ShardChannel))
    }

    /// Subscribes; the connection's count of subscriptions after it (of
    /// shard channels for a shard channel, of the others otherwise).
    pub fn subscribe(&mut self, kind: Kind, name: &[u8]) -> usize {
        let name = Bytes::copy_from_slice(name);
        if self.names.entry(kind).or_default().insert(name.clone()) {
            let mut registries = self.pubsub.registries.lock();
            registries
                .entry(kind)
                .or_default()
                .entry(name)
                .or_default()
                .insert(self.id, self.subscriber.clone());
        }
        self.count(kind)
    }

    /// Unsubscribes; the count after it.
    pub fn unsubscribe(&mut self, kind: Kind, name: &[u8]) -> usize {
        if self.names.get_mut(&kind).is_some_and(|names| names.remove(name)) {
            let mut registries = self.pubsub.registries.lock();
            if let Some(by_name) = registries.get_mut(&kind) {
                if let Some(subscribers) = by_name.get_mut(name) {
                    subscribers.remove(&self.id);
                    if subscribers.is_empty() {
                        by_name.remove(name);
                    }
                }
            }
        }
        self.count(kind)
    }

    /// The names subscribed to of `kind`.
    pub fn names(&self, kind: Kind) -> Vec<Bytes> {
        self.names.get(&kind).map(|names| names.iter().cloned().collect()).unwrap_or_default()
    }

    /// What SUBSCRIBE and friends count: shard channels apart, channels and
    /// patterns together.
    pub fn count(&self, kind: Kind) -> usize {
        let of = |kind| self.names.get(&kind).map_or(0, HashSet::len);
        match kind {
            Kind::ShardChannel => of(Kind::ShardChannel),
            Kind::Channel | Kind::Pattern => of(Kind::Channel) + of(Kind::Pattern),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.names.values().all(HashSet::is_empty)
    }

    /// The next message, when one comes.
    pub async fn next(&mut self) -> Option<Message> {
        let message = self.receiver.recv().await?;
        self.subscriber.pending.fetch_sub(message.bytes(), Ordering::Relaxed);
        Some(message)
    }

    /// A message already queued, if any.
    pub fn try_next(&mut self) -> Option<Message> {
        let message = self.receiver.try_recv().ok()?;
        self.subscriber.pending.fetch_sub(message.bytes(), Ordering::Relaxed);
        Some(message)
    }

    /// Whether publishers found the queue over the limit: the connection closes.
    pub fn overflowed(&self) -> bool {
        self.subscriber.overflowed.load(Ordering::Relaxed)
    }

    /// Signalled when the queue overflows.
    pub fn overflow_signal(&self) -> Arc<Notify> {
        self.subscriber.overflow.clone()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        for (kind, names) in std::mem::take(&mut self.names) {
            let mut registries = self.pubsub.registries.lock();
            let Some(by_name) = registries.get_mut(&kind) else { continue };
            for name in names {
                if let Some(subscribers) = by_name.get_mut(&name) {
                    subscribers.remove(&self.id);
                    if subscribers.is_empty() {
                        by_name.remove(&name);
                    }
                }
            }
        }
    }
}
