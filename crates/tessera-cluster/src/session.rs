//! A session with the coordinator, as a node or as the operator: reach the
//! leader among the coordinators listed (only the leader listens), run TLS
//! when the cluster does (`tls_cluster`, the same certificates as the peer
//! links), log in with the cluster secret ([`Login`]), then send
//! RESP commands one at a time.

use std::time::Duration;

use tessera_wire::{encode_command, parse_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::auth::{ClusterSecret, Login, LoginError, LoginTo};
use crate::tls::{self, MaybeTls, PeerTls, TlsError};

/// The longest a coordinator may take to accept a connection, run TLS and
/// answer the login.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// The most a reply may hold (a cluster map is the largest); past it the
/// coordinator is confused or forged.
const REPLY_BYTES_MAX: usize = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no coordinator answered: {}", .0.join("; "))]
    Unreachable(Vec<String>),
    #[error("the connection to the coordinator failed: {0}")]
    Connection(#[from] std::io::Error),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("the coordinator closed the connection")]
    Closed,
    #[error("the coordinator's answer is not RESP: {0}")]
    Malformed(String),
    #[error("the coordinator's answer is over {REPLY_BYTES_MAX} bytes")]
    TooLarge,
    #[error("cannot log in to the coordinator of cluster '{cluster}' as {identity}: {source}")]
    Login { cluster: String, identity: String, source: LoginError },
}

/// Who logs in, to which cluster, and how.
#[derive(Clone, Copy)]
pub struct Credentials<'a> {
    pub cluster: &'a str,
    /// A node id in decimal, or [`crate::auth::ADMIN`].
    pub identity: &'a str,
    pub secret: &'a ClusterSecret,
    pub tls: Option<&'a PeerTls>,
}

/// A logged-in connection to the leading coordinator.
pub struct CoordinatorSession {
    stream: MaybeTls,
    buffer: Vec<u8>,
}

impl CoordinatorSession {
    /// Logs in to the first of `addresses` (comma-separated) that answers.
    /// A refused login is final ([`SessionError::Login`]); anything else is
    /// worth retrying, since a coordinator may be starting or taking over.
    pub async fn open(addresses: &str, credentials: Credentials<'_>) -> Result<Self, SessionError> {
        let mut failures = Vec::new();
        for address in addresses.split(',').map(str::trim).filter(|address| !address.is_empty()) {
            match tokio::time::timeout(OPEN_TIMEOUT, Self::open_one(address, credentials)).await {
                Ok(Ok(session)) => return Ok(session),
                Ok(Err(error @ SessionError::Login { .. })) => return Err(error),
                Ok(Err(error)) => failures.push(format!("{address}: {error}")),
                Err(_) => failures.push(format!("{address}: timed out")),
            }
        }
        Err(SessionError::Unreachable(failures))
    }

    async fn open_one(address: &str, credentials: Credentials<'_>) -> Result<Self, SessionError> {
        let stream = TcpStream::connect(address).await?;
        let _ = stream.set_nodelay(true);
        let stream = tls::connecting(credentials.tls, stream, address).await?;
        let mut session = Self { stream, buffer: Vec::new() };
        let login = Login::new(LoginTo::Coordinator, credentials.cluster, credentials.identity);
        let failed = |source| SessionError::Login {
            cluster: credentials.cluster.to_string(),
            identity: credentials.identity.to_string(),
            source,
        };
        let challenge = session.call(&login.hello()).await?;
        let auth = login.auth(credentials.secret, challenge).map_err(failed)?;
        Login::accepted(session.call(&auth).await?).map_err(failed)?;
        Ok(session)
    }

    /// Sends one command and reads its answer (an error reply is `Ok`).
    pub async fn call<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<Value, SessionError> {
        let mut request = Vec::new();
        encode_command(args, &mut request);
        self.stream.write_all(&request).await?;
        loop {
            let parsed =
                parse_value(&self.buffer).map_err(|error| SessionError::Malformed(error.to_string()))?;
            if let Some((value, used)) = parsed {
                self.buffer.drain(..used);
                return Ok(value);
            }
            if self.buffer.len() > REPLY_BYTES_MAX {
                return Err(SessionError::TooLarge);
            }
            if self.stream.read_buf(&mut self.buffer).await? == 0 {
                return Err(SessionError::Closed);
            }
        }
    }
}

/// What a node tells its coordinator of its load (COORD.LOAD), for the
/// dashboard, which has writes per group from the heartbeats already.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeLoad {
    /// Commands that only read (`readonly`) since the node started.
    pub reads: u64,
    /// Bounds of the latency buckets the median and the 99th percentile of
    /// every command so far fall in, in microseconds.
    pub p50_us: u64,
    pub p99_us: u64,
}
