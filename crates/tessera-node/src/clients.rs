//! The node's connected clients as CLIENT LIST shows them and CLIENT KILL
//! closes them. Each connection registers an entry and refreshes what it
//! shows after every batch of commands (one uncontended lock per batch).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// What a connection shows, as of its last batch.
#[derive(Clone, Debug, Default)]
pub struct ClientState {
    pub name: String,
    pub library_name: String,
    pub library_version: String,
    pub user: String,
    pub resp: u8,
    /// The last command run, `command|subcommand` for container commands.
    pub last_command: String,
    pub last_active_ms: u64,
    /// Redis's flags: N (none), P (subscriber), x (in MULTI), b (blocked).
    pub flags: String,
    pub channels: usize,
    pub patterns: usize,
    pub shard_channels: usize,
    /// Commands queued since MULTI, or -1 outside one.
    pub multi: i64,
    /// Bytes read and not yet run, and replies not yet written.
    pub query_buffer: usize,
    pub output_buffer: usize,
}

#[derive(Debug)]
pub struct ClientEntry {
    pub id: u64,
    pub address: String,
    pub local_address: String,
    pub fd: i64,
    pub created: Instant,
    pub state: Mutex<ClientState>,
    killed: AtomicBool,
    kill_signal: Notify,
}

impl ClientEntry {
    pub fn new(id: u64, address: String, local_address: String, fd: i64) -> Self {
        Self {
            id,
            address,
            local_address,
            fd,
            created: Instant::now(),
            state: Mutex::new(ClientState::default()),
            killed: AtomicBool::new(false),
            kill_signal: Notify::new(),
        }
    }

    /// Asks the connection to close (CLIENT KILL).
    pub fn kill(&self) {
        self.killed.store(true, Ordering::Release);
        self.kill_signal.notify_one();
    }

    pub fn killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    /// Resolves once the connection is asked to close.
    pub async fn kill_requested(&self) {
        if !self.killed() {
            self.kill_signal.notified().await;
        }
    }

    /// The entry as one CLIENT LIST line (Redis's field names), newline ended.
    pub fn line(&self, now_ms: u64) -> String {
        let state = self.state.lock();
        let idle_seconds = now_ms.saturating_sub(state.last_active_ms) / 1000;
        let subscriptions = (state.channels, state.patterns, state.shard_channels);
        format!(
            "id={} addr={} laddr={} fd={} name={} age={} idle={} flags={} db=0 sub={} psub={} ssub={} \
             multi={} qbuf={} obl=0 oll=0 omem={} cmd={} user={} redir=-1 resp={} lib-name={} lib-ver={}\n",
            self.id,
            self.address,
            self.local_address,
            self.fd,
            state.name,
            self.created.elapsed().as_secs(),
            if state.last_active_ms == 0 { 0 } else { idle_seconds },
            if state.flags.is_empty() { "N" } else { &state.flags },
            subscriptions.0,
            subscriptions.1,
            subscriptions.2,
            state.multi,
            state.query_buffer,
            state.output_buffer,
            if state.last_command.is_empty() { "NULL" } else { &state.last_command },
            state.user,
            state.resp,
            state.library_name,
            state.library_version,
        )
    }
}

/// Every connected client, by id.
#[derive(Default)]
pub struct Clients {
    entries: Mutex<BTreeMap<u64, Arc<ClientEntry>>>,
}

impl Clients {
    /// Enters a connection; it leaves when the registration is dropped.
    pub fn register(self: &Arc<Self>, entry: Arc<ClientEntry>) -> Registration {
        self.entries.lock().insert(entry.id, entry.clone());
        Registration { clients: self.clone(), entry }
    }

    /// The clients connected now, by id.
    pub fn all(&self) -> Vec<Arc<ClientEntry>> {
        self.entries.lock().values().cloned().collect()
    }
}

/// A connection's place among the clients.
pub struct Registration {
    clients: Arc<Clients>,
    pub entry: Arc<ClientEntry>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.clients.entries.lock().remove(&self.entry.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_leave_with_their_registration_and_a_kill_is_seen() {
        let clients = Arc::new(Clients::default());
        let entry = Arc::new(ClientEntry::new(7, "127.0.0.1:5000".into(), "127.0.0.1:7379".into(), 9));
        let registration = clients.register(entry.clone());
        assert_eq!(clients.all().len(), 1);
        let line = entry.line(0);
        assert!(line.starts_with("id=7 addr=127.0.0.1:5000 laddr=127.0.0.1:7379 fd=9 name= "), "{line}");
        assert!(line.contains(" flags=N ") && line.contains(" cmd=NULL ") && line.ends_with('\n'), "{line}");
        assert!(!entry.killed());
        entry.kill();
        assert!(entry.killed());
        // The signal waits for a connection that listens only later.
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(entry.kill_requested());
        drop(registration);
        assert!(clients.all().is_empty());
    }
}
