//! Accepts connections, enforces the connection cap, sweeps expired keys, and
//! shuts down gracefully: stop accepting, let every connection answer what it
//! has read, then flush the engines.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::{Config, ConfigError};
use crate::connection::{run_blocking, Connection};
use crate::store::Store;
use crate::tables::TableError;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot open the data: {0}")]
    Tables(#[from] TableError),
    #[error("cannot listen on {0}: {1}")]
    Bind(String, std::io::Error),
}

pub struct Server {
    store: Arc<Store>,
    listener: TcpListener,
}

impl Server {
    /// Opens the tables and binds the listening socket.
    pub async fn bind(config: Config) -> Result<Self, ServerError> {
        config.validate()?;
        let address = format!("{}:{}", config.bind, config.port);
        let store = run_blocking(|| Store::open(config))?;
        let listener =
            TcpListener::bind(&address).await.map_err(|error| ServerError::Bind(address, error))?;
        Ok(Self { store: Arc::new(store), listener })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Serves until `shutdown` completes.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server { store, listener } = self;
        let (stop_connections, stopping) = watch::channel(false);
        let mut connections = JoinSet::new();
        let sweeper = tokio::spawn(sweep_expired(store.clone(), stopping.clone()));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = &mut shutdown => break,
                // Reap finished connections so the set does not grow.
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            };
            let (mut stream, _) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            store.stats.connections_received.fetch_add(1, Ordering::Relaxed);
            if store.stats.connected_clients.load(Ordering::Relaxed) >= store.config.max_clients {
                store.stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let _ = stream.write_all(b"-ERR max number of clients reached\r\n").await;
                    // Close politely: read until the client hangs up, so that
                    // unread input does not turn the close into a reset that
                    // could destroy the error before the client reads it.
                    let _ = stream.shutdown().await;
                    let mut sink = [0u8; 1024];
                    let drain =
                        async { while matches!(stream.read(&mut sink).await, Ok(read) if read > 0) {} };
                    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
                });
                continue;
            }
            store.stats.connected_clients.fetch_add(1, Ordering::Relaxed);
            let connection = Connection::new(store.clone(), stream);
            let (store, stopping) = (store.clone(), stopping.clone());
            connections.spawn(async move {
                connection.run(stopping).await;
                store.stats.connected_clients.fetch_sub(1, Ordering::Relaxed);
            });
        }
        drop(listener);
        tracing::info!(connections = connections.len(), "shutting down: finishing in-flight requests");
        let _ = stop_connections.send(true);
        let timeout = Duration::from_millis(store.config.shutdown_timeout_ms);
        if tokio::time::timeout(timeout, async { while connections.join_next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(remaining = connections.len(), "shutdown timeout: closing remaining connections");
            connections.abort_all();
        }
        let _ = sweeper.await;
        run_blocking(|| store.flush_all());
        tracing::info!("shutdown complete");
    }
}

async fn sweep_expired(store: Arc<Store>, mut stopping: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(Duration::from_millis(store.config.expiry_sweep_interval_ms));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stopping.changed() => return,
        }
        let entries = store.config.expiry_sweep_entries;
        run_blocking(|| store.sweep_expired(entries));
    }
}
