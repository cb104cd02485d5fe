//! One pipelined connection to one server. Requests are written as they come
//! (those waiting are written together) and answered in order: a writer task
//! and a reader task share the queue of those waiting for an answer, so any
//! number of callers can have requests in flight on it at once, up to a
//! bound. A caller that stops waiting (a timeout) leaves its place in the
//! queue, so the answers after it still go to their own requests.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tessera_wire::{encode_command, parse_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::Error;

/// How connections are opened and how long requests wait.
#[derive(Clone, Debug)]
pub struct Options {
    pub connect_timeout: Duration,
    /// How long a request waits for its answer; past it, its outcome is unknown.
    pub request_timeout: Duration,
    /// Batches of requests written and not yet answered, per connection.
    pub max_in_flight: usize,
    /// The largest answer read; a server sending more is cut off.
    pub max_reply_bytes: usize,
    /// Connections per server, which requests take in turn.
    pub connections_per_server: usize,
    /// `AUTH` sent on every new connection: user (or none) and password.
    pub auth: Option<(Option<String>, String)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            max_in_flight: 1024,
            max_reply_bytes: 512 << 20,
            connections_per_server: 2,
            auth: None,
        }
    }
}

type Answer = oneshot::Sender<Result<Value, Error>>;

/// Requests written together: one answer each, and one place in the bound.
struct Batch {
    bytes: Vec<u8>,
    answers: Vec<Answer>,
    permit: OwnedSemaphorePermit,
}

/// Those written and waiting for their answers, oldest first; a batch's
/// permit is released with its last answer.
type Waiting = Arc<Mutex<VecDeque<(Answer, Option<OwnedSemaphorePermit>)>>>;

#[derive(Clone)]
pub struct Connection {
    address: Arc<str>,
    batches: mpsc::Sender<Batch>,
    in_flight: Arc<Semaphore>,
    closed: Arc<AtomicBool>,
    timeout: Duration,
}

impl Connection {
    /// Connects to `address` and logs in if `options` say so.
    pub async fn open(address: &str, options: &Options) -> Result<Self, Error> {
        let not_sent = |why: String| Error::NotSent(format!("{address}: {why}"));
        let stream = tokio::time::timeout(options.connect_timeout, TcpStream::connect(address))
            .await
            .map_err(|_| not_sent(format!("no connection within {:?}", options.connect_timeout)))?
            .map_err(|error| not_sent(error.to_string()))?;
        stream.set_nodelay(true).map_err(|error| not_sent(error.to_string()))?;
        let (reader, writer) = stream.into_split();
        let (batches, queued) = mpsc::channel(options.max_in_flight.max(1));
        let waiting = Waiting::default();
        let closed = Arc::new(AtomicBool::new(false));
        let writing = tokio::spawn(write_batches(writer, queued, waiting.clone(), closed.clone()));
        tokio::spawn(read_answers(reader, waiting, closed.clone(), writing, options.max_reply_bytes));
        let connection = Self {
            address: address.into(),
            batches,
            in_flight: Arc::new(Semaphore::new(options.max_in_flight.max(1))),
            closed,
            timeout: options.request_timeout,
        };
        if let Some((user, password)) = &options.auth {
            let mut auth = vec!["AUTH"];
            auth.extend(user.as_deref());
            auth.push(password);
            if let Value::Error(message) = connection.request(&auth).await? {
                return Err(Error::Server(message));
            }
        }
        Ok(connection)
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Whether the connection broke; its requests then fail without being sent.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// One command's answer; a server error is an answer (`Value::Error`).
    pub async fn request<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<Value, Error> {
        self.pipeline(&[args]).await.pop().expect("one answer per command")
    }

    /// Commands written together, in order, and their answers in the same order.
    pub async fn pipeline<A: AsRef<[u8]>, C: AsRef<[A]>>(&self, commands: &[C]) -> Vec<Result<Value, Error>> {
        let refused = |why: &str| (0..commands.len()).map(|_| Err(self.not_sent(why))).collect();
        if self.is_closed() {
            return refused("the connection is closed");
        }
        let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
            return refused("the connection is closed");
        };
        let mut bytes = Vec::new();
        let mut answers = Vec::with_capacity(commands.len());
        let mut receivers = Vec::with_capacity(commands.len());
        for command in commands {
            encode_command(command.as_ref(), &mut bytes);
            let (answer, receiver) = oneshot::channel();
            answers.push(answer);
            receivers.push(receiver);
        }
        if self.batches.send(Batch { bytes, answers, permit }).await.is_err() {
            return refused("the connection is closed");
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut results = Vec::with_capacity(receivers.len());
        for receiver in receivers {
            results.push(match tokio::time::timeout_at(deadline, receiver).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(self.unknown("the connection closed before the answer")),
                Err(_) => Err(self.unknown(&format!("no answer within {:?}", self.timeout))),
            });
        }
        results
    }

    fn not_sent(&self, why: &str) -> Error {
        Error::NotSent(format!("{}: {why}", self.address))
    }

    fn unknown(&self, why: &str) -> Error {
        Error::Unknown(format!("{}: {why}", self.address))
    }
}

async fn write_batches(
    mut writer: OwnedWriteHalf,
    mut queued: mpsc::Receiver<Batch>,
    waiting: Waiting,
    closed: Arc<AtomicBool>,
) {
    let mut bytes = Vec::new();
    while let Some(first) = queued.recv().await {
        // Everything queued goes out in one write.
        let mut next = Some(first);
        while let Some(batch) = next {
            bytes.extend_from_slice(&batch.bytes);
            let mut queue = waiting.lock().expect("the waiting queue");
            let last = batch.answers.len().saturating_sub(1);
            let mut permit = Some(batch.permit);
            for (index, answer) in batch.answers.into_iter().enumerate() {
                queue.push_back((answer, if index == last { permit.take() } else { None }));
            }
            drop(queue);
            next = queued.try_recv().ok();
        }
        if closed.load(Ordering::Acquire) || writer.write_all(&bytes).await.is_err() {
            closed.store(true, Ordering::Release);
            for (answer, _) in waiting.lock().expect("the waiting queue").drain(..) {
                let _ = answer.send(Err(Error::Unknown("the connection broke while writing".into())));
            }
            return;
        }
        bytes.clear();
    }
}

async fn read_answers(
    mut reader: OwnedReadHalf,
    waiting: Waiting,
    closed: Arc<AtomicBool>,
    writing: tokio::task::JoinHandle<()>,
    max_reply_bytes: usize,
) {
    let mut buffer = BytesMut::with_capacity(16 << 10);
    let why = loop {
        match reader.read_buf(&mut buffer).await {
            Ok(0) => break "the server closed the connection".to_string(),
            Ok(_) => {}
            Err(error) => break error.to_string(),
        }
        let failed = loop {
            match parse_value(&buffer) {
                Ok(Some((Value::Push(_), used))) => buffer.advance(used), // not asked for here
                Ok(Some((value, used))) => {
                    buffer.advance(used);
                    let Some((answer, _permit)) = waiting.lock().expect("the waiting queue").pop_front()
                    else {
                        break Some("an answer came to no request".to_string());
                    };
                    let _ = answer.send(Ok(value));
                }
                Ok(None) if buffer.len() > max_reply_bytes => {
                    break Some(format!("an answer over {max_reply_bytes} bytes"));
                }
                Ok(None) => break None,
                Err(error) => break Some(format!("a malformed answer: {error}")),
            }
        };
        if let Some(why) = failed {
            break why;
        }
    };
    closed.store(true, Ordering::Release);
    writing.abort();
    // Whatever was written may have taken effect.
    for (answer, _) in waiting.lock().expect("the waiting queue").drain(..) {
        let _ = answer.send(Err(Error::Unknown(why.clone())));
    }
}
