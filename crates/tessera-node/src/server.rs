//! The node's threads: shared-nothing workers over shared node state
//! ([`NodeState`](crate::node_state::NodeState)).
//!
//! Each worker thread runs its own single-threaded tokio runtime and its own
//! listening socket on the same port (`SO_REUSEPORT`: the kernel spreads new
//! connections over them). A connection lives and dies on one thread, so a
//! request never hops threads (Shadowfax: partitioned dispatch over shared
//! data). In a cluster the first worker also runs the agent's loops (peer
//! links, ticks, heartbeats): with one worker, a replicated write goes from
//! its client to its peers and back without waking another thread. An engine call that blocks holds up
//! only its own worker's connections; `threads` above the core count leaves
//! others to serve meanwhile.
//!
//! Shutdown: stop accepting, let every connection answer the batch it has read,
//! wait up to `shutdown_timeout_ms`, then flush every engine.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::cluster::{ClusterNode, JoinError};
use crate::config::{Config, ConfigError};
use crate::connection::Connection;
use crate::node_state::{CommandTotals, NodeState};
use crate::tables::TableError;
use crate::tls::{acceptor, ClientStream, TlsError};
use tessera_cluster::session::NodeLoad;
use tokio_rustls::TlsAcceptor;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the data: {0}")]
    Tables(#[from] TableError),
    #[error("cannot listen on {0}: {1}")]
    Bind(String, std::io::Error),
    #[error("cannot start a worker thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot start a worker's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot join the cluster: {0}")]
    Cluster(#[from] JoinError),
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// How long a client on the TLS port has for its handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A running node. Dropping it without [`shutdown`](Self::shutdown) leaves the
/// threads running until the process exits.
pub struct Server {
    node: Arc<NodeState>,
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    workers: Vec<JoinHandle<()>>,
    sweeper_stop: Arc<AtomicBool>,
    sweeper: Option<JoinHandle<()>>,
    /// The Prometheus endpoint's thread, when `metrics_bind` is set.
    metrics: Option<JoinHandle<()>>,
}

/// A listening socket that other workers may bind too. tokio's listener must be
/// created inside the worker's runtime, so this hands over a non-blocking std one.
fn listen(address: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(address), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

impl Server {
    /// Opens the tables, binds one listening socket per worker and starts serving.
    pub fn start(config: Config) -> Result<Self, ServerError> {
        config.validate()?;
        let text_address = format!("{}:{}", config.bind, config.port);
        let bind_error = |error| ServerError::Bind(text_address.clone(), error);
        let address: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(text_address.as_str())
            .map_err(bind_error)?
            .next()
            .ok_or_else(|| bind_error(std::io::Error::other("address resolves to nothing")))?;
        let threads = config.worker_threads();
        let tls = acceptor(&config)?;
        let node = Arc::new(NodeState::open(config, crate::commands::acl::catalog())?);
        // The first socket picks the port when port 0 asks for any free one.
        let first = listen(address).map_err(bind_error)?;
        let local_addr = first.local_addr().map_err(bind_error)?;
        let mut listeners = vec![first];
        for _ in 1..threads {
            listeners.push(listen(local_addr).map_err(bind_error)?);
        }
        let mut tls_listeners: Vec<Option<(std::net::TcpListener, TlsAcceptor)>> = Vec::new();
        for _ in 0..threads {
            tls_listeners.push(match &tls {
                Some(acceptor) => {
                    let tls_address = SocketAddr::new(address.ip(), node.config.tls_port);
                    let tls_bind_error = |error| ServerError::Bind(tls_address.to_string(), error);
                    Some((listen(tls_address).map_err(tls_bind_error)?, acceptor.clone()))
                }
                None => None,
            });
        }
        let runtimes = (0..threads)
            .map(|_| tokio::runtime::Builder::new_current_thread().enable_all().build())
            .collect::<Result<Vec<_>, _>>()
            .map_err(ServerError::Runtime)?;
        let cluster = match node.config.cluster {
            Some(_) => Some(Arc::new(ClusterNode::start(&node.config, local_addr, &runtimes[0])?)),
            None => None,
        };
        if let Some(cluster) = &cluster {
            // A cluster node serves the cluster's users.
            let node = Arc::downgrade(&node);
            cluster.agent.watch_maps(Box::new({
                let node = node.clone();
                move |map| {
                    if let Some(node) = node.upgrade() {
                        node.acl.adopt(&map.users);
                    }
                }
            }));
            cluster.agent.watch_placement(Box::new({
                let node = node.clone();
                move || {
                    if let Some(node) = node.upgrade() {
                        node.waiters.wake_all();
                    }
                }
            }));
            cluster
                .agent
                .report_load(Box::new(move || node.upgrade().map(|node| load(&node)).unwrap_or_default()));
        }
        let (stop, stopping) = watch::channel(false);
        let metrics = match &node.config.metrics_bind {
            Some(address) => Some(start_metrics(address, &node, cluster.clone(), stopping.clone())?),
            None => None,
        };
        let mut workers = Vec::with_capacity(threads);
        let sockets = listeners.into_iter().zip(tls_listeners);
        for (index, ((listener, tls_listener), runtime)) in sockets.zip(runtimes).enumerate() {
            let (node, cluster, stopping) = (node.clone(), cluster.clone(), stopping.clone());
            let worker = thread::Builder::new()
                .name(format!("tessera-worker-{index}"))
                .spawn(move || run_worker(runtime, node, cluster, listener, tls_listener, stopping))
                .map_err(ServerError::Thread)?;
            workers.push(worker);
        }
        let sweeper_stop = Arc::new(AtomicBool::new(false));
        let sweeper = {
            let (node, cluster, stop) = (node.clone(), cluster.clone(), sweeper_stop.clone());
            thread::Builder::new()
                .name("tessera-upkeep".into())
                .spawn(move || upkeep(node, cluster, stop))
                .map_err(ServerError::Thread)?
        };
        Ok(Self { node, local_addr, stop, workers, sweeper_stop, sweeper: Some(sweeper), metrics })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn node(&self) -> &Arc<NodeState> {
        &self.node
    }

    /// Stops gracefully and returns once every engine is flushed.
    pub fn shutdown(mut self) {
        tracing::info!("shutting down: finishing in-flight requests");
        let _ = self.stop.send(true);
        for worker in self.workers.drain(..) {
            if worker.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
        self.sweeper_stop.store(true, Ordering::Relaxed);
        if let Some(sweeper) = self.sweeper.take() {
            let _ = sweeper.join();
        }
        if let Some(metrics) = self.metrics.take() {
            let _ = metrics.join();
        }
        self.node.flush_all();
        tracing::info!("shutdown complete");
    }
}

/// Binds the Prometheus endpoint and serves it on a thread of its own, so
/// that a scrape never waits behind clients' requests, until `stopping`.
fn start_metrics(
    address: &str,
    node: &Arc<NodeState>,
    cluster: Option<Arc<ClusterNode>>,
    stopping: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, ServerError> {
    let bind_error = |error| ServerError::Bind(format!("{address} (metrics)"), error);
    let listener = std::net::TcpListener::bind(address).map_err(bind_error)?;
    listener.set_nonblocking(true).map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    let token = match &node.config.metrics_token_file {
        Some(path) => Some(
            tessera_cluster::http::load_token(path)
                .map_err(|error| ServerError::Config(ConfigError::Invalid(error)))?,
        ),
        None => None,
    };
    let collector = crate::metrics::NodeCollector { node: node.clone(), cluster };
    let endpoint = Arc::new(tessera_cluster::metrics::MetricsEndpoint::new(collector, token));
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(ServerError::Runtime)?;
    let thread = thread::Builder::new()
        .name("tessera-metrics".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => tessera_cluster::http::serve(listener, endpoint, stopping).await,
                    Err(error) => tracing::error!(%error, "cannot serve metrics"),
                }
            })
        })
        .map_err(ServerError::Thread)?;
    tracing::info!(address = %local, "serving Prometheus metrics at /metrics");
    Ok(thread)
}

fn run_worker(
    runtime: tokio::runtime::Runtime,
    node: Arc<NodeState>,
    cluster: Option<Arc<ClusterNode>>,
    listener: std::net::TcpListener,
    tls_listener: Option<(std::net::TcpListener, TlsAcceptor)>,
    stopping: watch::Receiver<bool>,
) {
    runtime.block_on(async move {
        let registered = TcpListener::from_std(listener).and_then(|listener| {
            let tls = tls_listener
                .map(|(listener, acceptor)| {
                    TcpListener::from_std(listener).map(|listener| (listener, acceptor))
                })
                .transpose()?;
            Ok((listener, tls))
        });
        match registered {
            Ok((listener, tls)) => serve(node, cluster, listener, tls, stopping).await,
            Err(error) => tracing::error!(%error, "cannot register the listening socket"),
        }
    });
}

/// Accepts on the TLS listener, if there is one.
async fn accept_tls(tls: &Option<(TcpListener, TlsAcceptor)>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match tls {
        Some((listener, _)) => listener.accept().await,
        None => std::future::pending().await,
    }
}

async fn serve(
    node: Arc<NodeState>,
    cluster: Option<Arc<ClusterNode>>,
    listener: TcpListener,
    tls: Option<(TcpListener, TlsAcceptor)>,
    mut stopping: watch::Receiver<bool>,
) {
    let worker_stats = node.new_worker_stats(crate::commands::command_count());
    let mut connections = JoinSet::new();
    loop {
        let (accepted, secure) = tokio::select! {
            accepted = listener.accept() => (accepted, false),
            accepted = accept_tls(&tls) => (accepted, true),
            _ = stopping.changed() => break,
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: wait instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let stats = &node.stats;
        stats.connections_received.fetch_add(1, Ordering::Relaxed);
        // Count first, then check, so that workers racing cannot overshoot.
        if stats.connected_clients.fetch_add(1, Ordering::AcqRel) >= node.config.max_clients {
            stats.connected_clients.fetch_sub(1, Ordering::AcqRel);
            stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(reject(stream));
            continue;
        }
        let (node, cluster, stats, stopping) =
            (node.clone(), cluster.clone(), worker_stats.clone(), stopping.clone());
        let acceptor = tls.as_ref().filter(|_| secure).map(|(_, acceptor)| acceptor.clone());
        connections.spawn(async move {
            let stream = match acceptor {
                None => Some(ClientStream::Plain(stream)),
                Some(acceptor) => {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => Some(ClientStream::Tls(Box::new(stream.into()))),
                        Ok(Err(error)) => {
                            tracing::debug!(%error, "TLS handshake failed");
                            None
                        }
                        Err(_) => None,
                    }
                }
            };
            if let Some(stream) = stream {
                Connection::new(node.clone(), cluster, stats, stream).run(stopping).await;
            }
            node.stats.connected_clients.fetch_sub(1, Ordering::AcqRel);
        });
    }
    drop(listener);
    let timeout = Duration::from_millis(node.config.shutdown_timeout_ms);
    if tokio::time::timeout(timeout, async { while connections.join_next().await.is_some() {} })
        .await
        .is_err()
    {
        tracing::warn!(remaining = connections.len(), "shutdown timeout: closing remaining connections");
        connections.abort_all();
    }
}

/// Tells a client over the connection cap why it is being turned away.
async fn reject(mut stream: TcpStream) {
    let _ = stream.write_all(b"-ERR max number of clients reached\r\n").await;
    // Close politely: read until the client hangs up, so that unread input does
    // not turn the close into a reset that destroys the error unread.
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 1024];
    let drain = async { while matches!(stream.read(&mut sink).await, Ok(read) if read > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Now and then: samples the totals behind INFO's rates, and deletes expired
/// keys from a node's own tables, or, on a cluster node, the shards it heads.
fn upkeep(node: Arc<NodeState>, cluster: Option<Arc<ClusterNode>>, stop: Arc<AtomicBool>) {
    let interval = Duration::from_millis(node.config.expiry_sweep_interval_ms);
    while !stop.load(Ordering::Relaxed) {
        thread::sleep(interval);
        node.sample_gauges();
        match &cluster {
            Some(cluster) => cluster.sweep_expired(&node),
            None => node.sweep_expired(node.config.expiry_sweep_entries),
        }
    }
}

/// What the node reports of its load to the coordinator's dashboard: its
/// reads so far, and the latency of all its commands.
fn load(node: &NodeState) -> NodeLoad {
    let specs: Vec<_> = crate::commands::all_commands().collect();
    let mut all = CommandTotals::default();
    let mut reads = 0;
    for (index, totals) in node.command_totals() {
        if specs.get(index).is_some_and(|spec| spec.flags.contains(&"readonly")) {
            reads += totals.calls;
        }
        for (sum, bucket) in all.latency.iter_mut().zip(&totals.latency) {
            *sum += bucket;
        }
    }
    let observed = all.latency.iter().any(|count| *count > 0);
    let quantile = |quantile| if observed { all.latency_quantile_micros(quantile) } else { 0 };
    NodeLoad { reads, p50_us: quantile(0.5), p99_us: quantile(0.99) }
}
