//! The coordinator as a process: [`ClusterCoordinator`] behind a RESP port,
//! its map kept in a [`MetadataStore`] after every change. With the cluster's
//! certificates (`tls_cluster`) it speaks only mutual TLS. A connection opens
//! a session with the cluster plane's handshake ([`crate::auth`]) before it
//! may change anything; a node's session may heartbeat only as that node.
//!
//! ```text
//! COORD.HELLO cluster-id identity nonce            [nonce, proof]  (identity: a node id, or admin)
//! COORD.AUTH proof                                 +OK: the session is the identity's
//! COORD.JOIN cluster-id node [tls-port]             the lease in ms, or an error naming the mismatch
//! COORD.HEARTBEAT cluster-id node incarnation known-epoch [shard applied ready-learner ready-view]...
//!     -> [epoch, [shard, view-number, [members...], [learners...]]...]   (ready-learner -1: none)
//! COORD.LOAD node reads p50-us p99-us             +OK (the node's reads and latency, for the dashboard)
//! COORD.ADD-NODE address                           the new standby node's id
//! COORD.TABLE-CREATE name prefix engine [option value]...   +OK (prefix \xNN-escaped)
//!     (option PARTITION RANGE|HASH; SPLIT key, repeated, for a range-partitioned table)
//! COORD.TABLE-DROP name                             +OK
//!     (table changes answer once every live node routes by the changed map)
//! COORD.ACL-SETUSER name expected rules             +OK once every node serves the user with
//!                                                   `rules`; TRYAGAIN unless its rules were
//!                                                   `expected` ("" for no such user)
//! COORD.ACL-DELUSER name...                         how many there were, once no node has them
//! COORD.MAP [known-epoch wait-ms]                   the map as JSON; with an epoch, answers
//!                                                   once the map is newer or the wait is over
//!                                                   (the users only to a session)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tessera_protocol::migration::MigrationReport;
use tessera_protocol::{Mode, NodeId, Progress};

/// What a heartbeat says of each shard: its id, applied position, ready
/// learner and its view, drained view, then the migration it streams (id,
/// entries, bytes, caught up, forwarded view; zeros for none).
pub const HEARTBEAT_SHARD_FIELDS: usize = 10;
use tessera_wire::{Limits, Parsed, Protocol as Resp, ReplyWriter, Request, RequestParser};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::auth::{
    from_hex, to_hex, ClusterSecret, Transcript, ADMIN, COORDINATOR, NONCE_BYTES, PROOF_BYTES,
};
use crate::coordinator::{ClusterCoordinator, JoinError, SlotCommand, Timing};
use crate::map::{ClusterMap, ClusterTable, MapError, MigrationPhase, NodeRole, Shard};
use crate::metrics::{counter, counters, gauge, gauges, Labels};
use crate::session::NodeLoad;
use crate::store::{MetadataStore, StoreError};
use crate::tls::{self, MaybeTls, PeerTls};

/// The longest a `COORD.MAP` watch may wait.
const WAIT_MS_MAX: u64 = 60_000;

/// Connections open at once; past it new ones are closed at once.
const CONNECTIONS_MAX: usize = 1024;

/// The longest a connection may take over its TLS handshake.
const TLS_TIMEOUT: Duration = Duration::from_secs(5);

/// What a coordinator command may hold: names, addresses, table options,
/// and a heartbeat's five numbers per shard.
const LIMITS: Limits = Limits { bulk_bytes_max: 64 << 10, args_max: 1 << 20, inline_bytes_max: 64 << 10 };
const REQUEST_BYTES_MAX: usize = 16 << 20;

/// Why the coordinator did not do what a command asked: each is one error
/// reply, written in [`answer`].
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("authentication failed (a wrong cluster id or secret)")]
    Unauthenticated,
    #[error("authenticate with COORD.HELLO and COORD.AUTH first")]
    NoSession,
    #[error("this session is {0}'s, not node {1}'s")]
    NotYours(Identity, u32),
    #[error("unknown command '{0}' for a coordinator")]
    UnknownCommand(String),
    #[error("wrong number of arguments for '{0}'")]
    WrongArity(String),
    #[error("{0} is not a number")]
    NotANumber(&'static str),
    #[error("unknown partitioning '{0}'; choose hash or range")]
    UnknownPartitioning(String),
    #[error("unknown mode {0:?}; choose ms+sc, ms+ec, aa+sc or aa+ec")]
    UnknownMode(String),
    #[error(transparent)]
    Join(#[from] JoinError),
    #[error(transparent)]
    Map(#[from] MapError),
    #[error("this coordinator stopped deciding: {0}")]
    Fenced(String),
    #[error("table {table} is still switching to {mode}; TABLE.INFO shows when it is done")]
    StillSwitching { table: String, mode: &'static str },
    #[error("the change is made, but node {0} has not seen it yet; retry to wait again")]
    NotSeenBy(u32),
    #[error("invalid slot range {0:?}; write FIRST-LAST or SLOT, each below 16384")]
    SlotRange(String),
}

impl Refused {
    /// The RESP error code it is told with.
    fn code(&self) -> &'static str {
        match self {
            Refused::NoSession => "NOAUTH",
            Refused::Map(MapError::UserChanged(_)) => "TRYAGAIN",
            _ => "ERR",
        }
    }
}

/// Why a coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the store holds cluster '{stored}', not '{given}'; use another directory")]
    OtherCluster { stored: String, given: String },
    #[error("no cluster map stored, and none given to start one")]
    NoMap,
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
}

/// Who a session authenticated as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Identity {
    Node(u32),
    Admin,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Node(node) => write!(f, "node {node}"),
            Identity::Admin => f.write_str(ADMIN),
        }
    }
}

/// A connection's standing: a handshake under way, then an identity.
#[derive(Default)]
struct Session {
    challenged: Option<(Identity, Transcript)>,
    identity: Option<Identity>,
}

impl Session {
    fn identity(&self) -> Result<Identity, Refused> {
        self.identity.ok_or(Refused::NoSession)
    }

    /// The node this session is, if `node` is it.
    fn check_node(&self, node: u32) -> Result<(), Refused> {
        match self.identity()? {
            Identity::Node(own) if own == node => Ok(()),
            other => Err(Refused::NotYours(other, node)),
        }
    }
}

struct State {
    coordinator: ClusterCoordinator,
    secret: ClusterSecret,
    store: Box<dyn MetadataStore>,
    version: Option<u64>,
    epochs: watch::Sender<u64>,
    started: Instant,
    /// Told to joining nodes, which count their leases with it.
    lease_ms: u64,
    failure_timeout_ms: u64,
    /// Per node, the newest map epoch it said it routes by, and when.
    known_epochs: HashMap<u32, (u64, u64)>,
    /// Per node of the map, the load it last reported, and when.
    loads: HashMap<u32, (NodeLoad, u64)>,
    /// Set when storing the map failed: this coordinator decides nothing more.
    fenced: Option<String>,
}

impl State {
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Refuses once storing the map failed (another coordinator may decide).
    fn check_deciding(&self) -> Result<(), Refused> {
        match &self.fenced {
            Some(reason) => Err(Refused::Fenced(reason.clone())),
            None => Ok(()),
        }
    }

    /// Stores the map if it changed; a conflict means another writer took
    /// over the store, after which this coordinator must not decide anything.
    fn persist(&mut self) -> Result<(), Refused> {
        self.check_deciding()?;
        if let Some(map) = self.coordinator.take_changed_map() {
            match self.store.store(self.version, &map) {
                Ok(version) => self.version = Some(version),
                Err(error) => {
                    tracing::error!(%error, "cannot store the cluster map; this coordinator stops deciding");
                    self.fenced = Some(error.to_string());
                    return Err(Refused::Fenced(error.to_string()));
                }
            }
            self.epochs.send_replace(map.epoch);
        }
        Ok(())
    }
}

/// A running coordinator; dropping it stops it.
pub struct CoordinatorServer {
    state: Arc<Mutex<State>>,
    address: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for CoordinatorServer {
    fn drop(&mut self) {
        // Connections still open must not decide for a stopped coordinator.
        self.state.lock().fenced = Some("the coordinator was stopped".into());
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl CoordinatorServer {
    /// Loads the map from `store` (or stores `initial` if there is none) and
    /// starts serving on `listen`. A stored map wins over `initial` only if it
    /// is for the same cluster: a stray directory must not take over another.
    pub async fn start(
        listen: SocketAddr,
        store: Box<dyn MetadataStore>,
        initial: Option<ClusterMap>,
        timing: Timing,
        secret: ClusterSecret,
        tls: Option<PeerTls>,
    ) -> Result<Self, StartError> {
        let stored = store.load()?;
        let (map, version) = match (stored, initial) {
            (Some(stored), Some(initial)) if stored.map.cluster_id != initial.cluster_id => {
                return Err(StartError::OtherCluster {
                    stored: stored.map.cluster_id,
                    given: initial.cluster_id,
                })
            }
            (Some(stored), _) => (stored.map, Some(stored.version)),
            (None, Some(initial)) => {
                let version = store.store(None, &initial)?;
                (initial, Some(version))
            }
            (None, None) => return Err(StartError::NoMap),
        };
        let (epochs, _) = watch::channel(map.epoch);
        let started = Instant::now();
        let state = State {
            coordinator: ClusterCoordinator::new(map, timing, 0),
            secret,
            lease_ms: timing.lease_ms,
            failure_timeout_ms: timing.failure_timeout_ms,
            known_epochs: HashMap::new(),
            loads: HashMap::new(),
            store,
            version,
            epochs,
            started,
            fenced: None,
        };
        let state = Arc::new(Mutex::new(state));
        let listener = TcpListener::bind(listen).await.map_err(|error| StartError::Listen(listen, error))?;
        let address = listener.local_addr().map_err(|error| StartError::Listen(listen, error))?;
        let tasks = vec![
            tokio::spawn(accept(listener, state.clone(), tls)),
            tokio::spawn(tick(state.clone(), timing)),
        ];
        Ok(Self { state, address, tasks })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    pub fn map(&self) -> ClusterMap {
        self.state.lock().coordinator.map().clone()
    }
}

/// What a coordinator's Prometheus endpoint and dashboard read: the map
/// and decisions of the coordinator this process runs once it leads; while
/// it stands by (another leads through etcd), only that it does not lead.
#[derive(Clone, Default)]
pub struct CoordinatorObserver {
    leading: Arc<Mutex<Option<Weak<Mutex<State>>>>>,
}

impl std::fmt::Debug for CoordinatorObserver {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("CoordinatorObserver").finish_non_exhaustive()
    }
}

impl CoordinatorObserver {
    /// From now on, report `server`'s state (until it stops).
    pub fn lead(&self, server: &CoordinatorServer) {
        *self.leading.lock() = Some(Arc::downgrade(&server.state));
    }

    fn state(&self) -> Option<Arc<Mutex<State>>> {
        self.leading.lock().as_ref().and_then(Weak::upgrade)
    }

    /// What the dashboard shows, as JSON: the map (its users left out),
    /// each shard's mode, when each node was last heard from, and the
    /// latest decisions.
    pub fn dashboard_state(&self) -> serde_json::Value {
        let Some(state) = self.state() else { return serde_json::json!({ "leader": false }) };
        let state = state.lock();
        let now = state.now_ms();
        let map = state.coordinator.map();
        let decisions = state.coordinator.decisions();
        let mut shards = serde_json::to_value(&map.shards).unwrap_or_default();
        for (json, shard) in shards.as_array_mut().into_iter().flatten().zip(&map.shards) {
            json["mode_label"] = map.mode_of(shard).label().into();
            let head = shard.members.first().and_then(|head| state.coordinator.applied(shard.id, *head));
            json["head_applied"] = head.into();
        }
        let nodes: Vec<serde_json::Value> = map
            .nodes
            .iter()
            .map(|node| {
                let mut json = serde_json::to_value(node).unwrap_or_default();
                json["heard_ms_ago"] =
                    state.known_epochs.get(&node.id).map(|(_, at)| now.saturating_sub(*at)).into();
                if let Some((load, at)) = state.loads.get(&node.id) {
                    json["load"] = serde_json::json!({
                        "at_ms": at,
                        "reads": load.reads,
                        "p50_us": load.p50_us,
                        "p99_us": load.p99_us,
                    });
                }
                json
            })
            .collect();
        serde_json::json!({
            "leader": state.fenced.is_none(),
            "cluster_id": map.cluster_id,
            "epoch": map.epoch,
            "now_ms": now,
            "mode": map.mode.label(),
            "replicas": map.replicas,
            "nodes": nodes,
            "shards": shards,
            "tables": map.tables,
            "migrations": map.migrations,
            "replica_moves": map.replica_moves,
            "failovers": decisions.failovers,
            "decisions": decisions.recent,
        })
    }
}

impl Collector for CoordinatorObserver {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let encoder = &mut encoder;
        let Some(state) = self.state() else {
            return gauge(
                encoder,
                "tessera_coordinator_leader",
                "1 if this coordinator leads and decides.",
                0,
            );
        };
        // Copied out so that a scrape holds the coordinator's lock briefly.
        let (map, view_changes, failovers, fenced) = {
            let state = state.lock();
            let decisions = state.coordinator.decisions();
            let map = state.coordinator.map().clone();
            (map, decisions.view_changes.clone(), decisions.failovers, state.fenced.is_some())
        };
        gauge(
            encoder,
            "tessera_coordinator_leader",
            "1 if this coordinator leads and decides.",
            u32::from(!fenced),
        )?;
        gauge(encoder, "tessera_coordinator_epoch", "The cluster map's epoch.", map.epoch)?;
        let members = map.nodes.iter().filter(|node| node.role == NodeRole::Member).count();
        gauges(
            encoder,
            "tessera_coordinator_nodes",
            "Nodes in the map, by role.",
            [(vec![("role", "member")], members), (vec![("role", "standby")], map.nodes.len() - members)],
        )?;
        let shard_labels = |shard: &Shard| -> Labels {
            vec![("shard", shard.id.to_string()), ("table", shard.table.clone())]
        };
        gauges(
            encoder,
            "tessera_coordinator_shard_view",
            "Each shard's view number.",
            map.shards.iter().map(|shard| (shard_labels(shard), shard.view_number)),
        )?;
        gauges(
            encoder,
            "tessera_coordinator_shard_members",
            "Each shard's members (learners left out).",
            map.shards.iter().map(|shard| (shard_labels(shard), shard.members.len())),
        )?;
        gauges(
            encoder,
            "tessera_coordinator_shard_learners",
            "Each shard's learners (replicas being filled).",
            map.shards.iter().map(|shard| (shard_labels(shard), shard.learners.len())),
        )?;
        gauge(
            encoder,
            "tessera_coordinator_transitions",
            "Shards switching modes.",
            map.shards.iter().filter(|shard| shard.next_mode.is_some()).count(),
        )?;
        gauges(
            encoder,
            "tessera_coordinator_migrations",
            "Slot migrations under way, by phase.",
            [MigrationPhase::Copying, MigrationPhase::Cutting].map(|phase| {
                let name = if phase == MigrationPhase::Copying { "copying" } else { "cutting" };
                (
                    vec![("phase", name)],
                    map.migrations.iter().filter(|migration| migration.phase == phase).count(),
                )
            }),
        )?;
        gauge(
            encoder,
            "tessera_coordinator_replica_moves",
            "Replicas moving between nodes.",
            map.replica_moves.len(),
        )?;
        counters(
            encoder,
            "tessera_coordinator_view_changes",
            "View changes this coordinator decided, by reason.",
            view_changes.iter().map(|(reason, count)| (vec![("reason", *reason)], *count)),
        )?;
        counter(
            encoder,
            "tessera_coordinator_failovers",
            "Shards whose head was replaced without handing over.",
            failovers,
        )
    }
}

async fn tick(state: Arc<Mutex<State>>, timing: Timing) {
    let mut ticker = tokio::time::interval(Duration::from_millis((timing.failure_timeout_ms / 10).max(5)));
    loop {
        ticker.tick().await;
        let mut state = state.lock();
        if state.fenced.is_some() {
            continue;
        }
        let now = state.now_ms();
        state.coordinator.tick(now);
        let _ = state.persist();
    }
}

async fn accept(listener: TcpListener, state: Arc<Mutex<State>>, tls: Option<PeerTls>) {
    let connections = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Ok(permit) = connections.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "too many coordinator connections; refusing one");
                    continue; // dropping the stream closes it
                };
                let _ = stream.set_nodelay(true);
                let (state, tls) = (state.clone(), tls.clone());
                tokio::spawn(async move {
                    let secured =
                        tokio::time::timeout(TLS_TIMEOUT, tls::accepting(tls.as_ref(), stream)).await;
                    match secured {
                        Ok(Ok(stream)) => serve(stream, state).await,
                        Ok(Err(error)) => {
                            tracing::warn!(%peer, %error, "a coordinator connection failed TLS")
                        }
                        Err(_) => tracing::warn!(%peer, "a coordinator connection's TLS timed out"),
                    }
                    drop(permit);
                });
            }
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve(mut stream: MaybeTls, state: Arc<Mutex<State>>) {
    let mut parser = RequestParser::new(LIMITS);
    let mut input = Vec::with_capacity(4096);
    let mut out = ReplyWriter::new(Resp::Resp2);
    let mut session = Session::default();
    loop {
        match stream.read_buf(&mut input).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut start = 0;
        let mut close = false;
        loop {
            match parser.parse(&input, start) {
                Ok(Parsed::Complete { end }) => {
                    let args: Vec<Vec<u8>> =
                        Request::new(&input, parser.args()).args().map(<[u8]>::to_vec).collect();
                    start = end;
                    answer(&state, &mut session, &args, &mut out).await;
                }
                Ok(Parsed::Empty { end }) => start = end,
                Ok(Parsed::Incomplete) if input.len() - start > REQUEST_BYTES_MAX => {
                    out.error(&format!("ERR a request to the coordinator is over {REQUEST_BYTES_MAX} bytes"));
                    close = true;
                    break;
                }
                Ok(Parsed::Incomplete) => break,
                Err(error) => {
                    out.error(&format!("ERR {error}"));
                    close = true;
                    break;
                }
            }
        }
        input.drain(..start);
        parser.discard_front(start);
        if stream.write_all(out.as_bytes()).await.is_err() || close {
            return;
        }
        out.clear();
    }
}

fn text(arg: &[u8]) -> String {
    String::from_utf8_lossy(arg).into_owned()
}

fn number<T: std::str::FromStr>(arg: &[u8], what: &'static str) -> Result<T, Refused> {
    std::str::from_utf8(arg).ok().and_then(|text| text.parse().ok()).ok_or(Refused::NotANumber(what))
}

async fn answer(state: &Arc<Mutex<State>>, session: &mut Session, args: &[Vec<u8>], out: &mut ReplyWriter) {
    let name = args[0].to_ascii_uppercase();
    // What a connection may do before it has a session: log in, ping, and
    // read the map (which any client of a node sees in CLUSTER SHARDS).
    let open = matches!(name.as_slice(), b"COORD.HELLO" | b"COORD.AUTH" | b"COORD.MAP");
    let result = match name.as_slice() {
        _ if name.starts_with(b"COORD.") && !open && session.identity.is_none() => Err(Refused::NoSession),
        b"COORD.HELLO" if args.len() == 4 => hello(state, session, args, out),
        b"COORD.AUTH" if args.len() == 2 => authenticate(state, session, &args[1], out),
        b"COORD.JOIN" if args.len() == 3 || args.len() == 4 => join(state, session, args, out),
        b"COORD.HEARTBEAT" if args.len() >= 5 && (args.len() - 5).is_multiple_of(HEARTBEAT_SHARD_FIELDS) => {
            heartbeat(state, session, args, out)
        }
        b"COORD.LOAD" if args.len() == 5 => load(state, session, args, out),
        b"COORD.MAP" if args.len() == 1 || args.len() == 3 => watch_map(state, session, args, out).await,
        b"COORD.ACL-SETUSER" if args.len() == 4 => {
            let expected = (!args[2].is_empty()).then(|| text(&args[2]));
            let changed = change_map(state, |coordinator, _| {
                coordinator.set_user(&text(&args[1]), expected.as_deref(), &text(&args[3]))
            });
            match changed {
                Ok(epoch) => seen_everywhere(state, epoch).await.map(|()| out.ok()),
                Err(error) => Err(error),
            }
        }
        b"COORD.ACL-DELUSER" if args.len() >= 2 => {
            let names: Vec<String> = args[1..].iter().map(|name| text(name)).collect();
            let mut deleted = 0;
            match change_map(state, |coordinator, _| {
                deleted = coordinator.delete_users(&names);
                Ok(())
            }) {
                Ok(epoch) => seen_everywhere(state, epoch).await.map(|()| out.integer(deleted as i64)),
                Err(error) => Err(error),
            }
        }
        b"COORD.ADD-NODE" if args.len() == 2 => add_node(state, &text(&args[1]), out),
        b"COORD.TABLE-CREATE" if args.len() >= 4 && args.len().is_multiple_of(2) => {
            match create_table(state, args) {
                Ok(epoch) => seen_everywhere(state, epoch).await.map(|()| out.ok()),
                Err(error) => Err(error),
            }
        }
        b"COORD.TABLE-DROP" if args.len() == 2 => {
            match change_map(state, |coordinator, _| coordinator.drop_table(&text(&args[1]))) {
                Ok(epoch) => seen_everywhere(state, epoch).await.map(|()| out.ok()),
                Err(error) => Err(error),
            }
        }
        b"COORD.TABLE-ALTER" if args.len() == 3 => {
            alter_table(state, &text(&args[1]), &text(&args[2]), out).await
        }
        b"COORD.MIGRATE" if args.len() >= 4 => start_migration(state, args, out),
        b"COORD.MIGRATE-CANCEL" if args.len() == 2 => number(&args[1], "migration id").and_then(|id| {
            change_map(state, |coordinator, now| coordinator.cancel_migration(id, now)).map(|_| out.ok())
        }),
        b"COORD.MOVE-REPLICA" if args.len() == 4 => move_replica(state, args, out),
        b"COORD.MOVE-HEAD" if args.len() == 3 => move_head(state, args, out),
        b"COORD.SETSLOT" if args.len() == 4 || args.len() == 5 => set_slot(state, session, args, out),
        b"COORD.REMOVE-NODE" if args.len() == 2 => number(&args[1], "node").and_then(|node| {
            change_map(state, |coordinator, _| coordinator.remove_node(node)).map(|_| out.ok())
        }),
        b"COORD.MIGRATIONS" if args.len() == 1 => {
            list_migrations(state, out);
            Ok(())
        }
        b"PING" => {
            out.simple("PONG");
            Ok(())
        }
        b"COORD.HELLO"
        | b"COORD.AUTH"
        | b"COORD.JOIN"
        | b"COORD.HEARTBEAT"
        | b"COORD.LOAD"
        | b"COORD.MAP"
        | b"COORD.ADD-NODE"
        | b"COORD.TABLE-CREATE"
        | b"COORD.TABLE-DROP"
        | b"COORD.TABLE-ALTER"
        | b"COORD.MIGRATE"
        | b"COORD.MIGRATE-CANCEL"
        | b"COORD.MIGRATIONS"
        | b"COORD.MOVE-REPLICA"
        | b"COORD.MOVE-HEAD"
        | b"COORD.SETSLOT"
        | b"COORD.REMOVE-NODE"
        | b"COORD.ACL-SETUSER"
        | b"COORD.ACL-DELUSER" => Err(Refused::WrongArity(text(&args[0]).to_ascii_lowercase())),
        _ => Err(Refused::UnknownCommand(text(&args[0]))),
    };
    if let Err(refused) = result {
        out.error(&format!("{} {refused}", refused.code()));
    }
}

/// `COORD.HELLO cluster identity nonce`: the coordinator's half of the
/// handshake. A connection naming another cluster learns nothing of this one.
fn hello(
    state: &Arc<Mutex<State>>,
    session: &mut Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    session.challenged = None;
    let identity = match args[2].as_slice() {
        name if name == ADMIN.as_bytes() => Identity::Admin,
        node => Identity::Node(number(node, "node id")?),
    };
    let connecting_nonce = from_hex::<NONCE_BYTES>(&args[3]).ok_or(Refused::Unauthenticated)?;
    let state = state.lock();
    let cluster = state.coordinator.map().cluster_id.clone();
    if args[1] != cluster.as_bytes() {
        return Err(Refused::Unauthenticated);
    }
    let transcript = Transcript::answering(&cluster, &text(&args[2]), COORDINATOR, connecting_nonce);
    out.array(2);
    out.bulk(to_hex(&transcript.accepting_nonce).as_bytes());
    out.bulk(to_hex(&state.secret.accepting_proof(&transcript)).as_bytes());
    session.challenged = Some((identity, transcript));
    Ok(())
}

/// `COORD.AUTH proof`: the session becomes the identity's if the proof is
/// the one its handshake calls for. One proof per challenge.
fn authenticate(
    state: &Arc<Mutex<State>>,
    session: &mut Session,
    proof: &[u8],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let (identity, transcript) = session.challenged.take().ok_or(Refused::Unauthenticated)?;
    let proof = from_hex::<PROOF_BYTES>(proof).ok_or(Refused::Unauthenticated)?;
    if !state.lock().secret.verify_connecting(&transcript, &proof) {
        tracing::warn!(%identity, "a coordinator session failed to authenticate");
        return Err(Refused::Unauthenticated);
    }
    session.identity = Some(identity);
    out.ok();
    Ok(())
}

fn join(
    state: &Arc<Mutex<State>>,
    session: &Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let node: u32 = number(&args[2], "node id")?;
    session.check_node(node)?;
    let tls_port: u16 = match args.get(3) {
        Some(port) => number(port, "TLS port")?,
        None => 0,
    };
    let mut state = state.lock();
    state.coordinator.check_join(&text(&args[1]), node)?;
    if let Some(tls_address) = state.coordinator.tls_address_change(node, tls_port) {
        state.check_deciding()?;
        state.coordinator.set_tls_address(node, tls_address);
        state.persist()?;
    }
    out.integer(state.lease_ms as i64);
    Ok(())
}

fn heartbeat(
    state: &Arc<Mutex<State>>,
    session: &Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let node: u32 = number(&args[2], "node id")?;
    session.check_node(node)?;
    let incarnation: u64 = number(&args[3], "incarnation")?;
    let known_epoch: u64 = number(&args[4], "known epoch")?;
    let mut progress = BTreeMap::new();
    for report in args[5..].chunks(HEARTBEAT_SHARD_FIELDS) {
        let learner: i64 = number(&report[2], "ready learner")?;
        let learner_ready = u32::try_from(learner)
            .ok()
            .map(|learner| number(&report[3], "ready view").map(|view| (NodeId(learner), view)));
        let drained: u64 = number(&report[4], "drained view")?;
        let migration: u64 = number(&report[5], "migration")?;
        let forwarded_in: u64 = number(&report[9], "forwarded view")?;
        let migration = (migration > 0)
            .then(|| -> Result<MigrationReport, Refused> {
                Ok(MigrationReport {
                    id: migration,
                    entries: number(&report[6], "migrated entries")?,
                    bytes: number(&report[7], "migrated bytes")?,
                    caught_up: number::<u8>(&report[8], "caught up")? != 0,
                    forwarded_in: (forwarded_in > 0).then_some(forwarded_in),
                })
            })
            .transpose()?;
        progress.insert(
            number(&report[0], "shard")?,
            Progress {
                applied: number(&report[1], "applied")?,
                learner_ready: learner_ready.transpose()?,
                drained: (drained > 0).then_some(drained),
                migration,
            },
        );
    }
    let mut state = state.lock();
    state.coordinator.check_join(&text(&args[1]), node)?;
    state.check_deciding()?;
    let now = state.now_ms();
    let grants = state.coordinator.heartbeat(now, node, incarnation, &progress)?;
    state.known_epochs.insert(node, (known_epoch, now));
    // A lease is granted only on a map that is stored.
    state.persist()?;
    drop(state);
    out.array(2);
    out.integer(grants.epoch as i64);
    out.array(grants.shards.len());
    for (shard, view, mode) in grants.shards {
        out.array(6);
        out.integer(i64::from(shard));
        out.integer(view.number as i64);
        out.array(view.replicas.len());
        for member in &view.replicas {
            out.integer(i64::from(member.0));
        }
        out.array(view.learners.len());
        for learner in &view.learners {
            out.integer(i64::from(learner.0));
        }
        out.integer(i64::from(view.draining));
        out.bulk(mode.name.as_bytes());
    }
    Ok(())
}

/// A node's counters (its session speaks for it alone), kept for the
/// dashboard while the node is in the map.
fn load(
    state: &Arc<Mutex<State>>,
    session: &Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let node: u32 = number(&args[1], "node id")?;
    session.check_node(node)?;
    let load = NodeLoad {
        reads: number(&args[2], "reads")?,
        p50_us: number(&args[3], "p50")?,
        p99_us: number(&args[4], "p99")?,
    };
    let mut state = state.lock();
    let now = state.now_ms();
    let map = state.coordinator.map();
    if map.node(node).is_some() {
        let nodes: Vec<u32> = map.nodes.iter().map(|node| node.id).collect();
        state.loads.retain(|id, _| nodes.contains(id));
        state.loads.insert(node, (load, now));
    }
    out.ok();
    Ok(())
}

fn add_node(state: &Arc<Mutex<State>>, address: &str, out: &mut ReplyWriter) -> Result<(), Refused> {
    let mut state = state.lock();
    state.check_deciding()?;
    let id = state.coordinator.add_standby(address)?;
    state.persist()?;
    out.integer(i64::from(id));
    Ok(())
}

fn create_table(state: &Arc<Mutex<State>>, args: &[Vec<u8>]) -> Result<u64, Refused> {
    let mut options = BTreeMap::new();
    let mut split_keys = None;
    for pair in args[4..].chunks(2) {
        let (option, value) = (text(&pair[0]).to_ascii_lowercase(), text(&pair[1]));
        match option.as_str() {
            "partition" if value.eq_ignore_ascii_case("range") => {
                split_keys.get_or_insert_with(Vec::new);
            }
            "partition" if value.eq_ignore_ascii_case("hash") => {}
            "partition" => return Err(Refused::UnknownPartitioning(value)),
            "split" => split_keys.get_or_insert_with(Vec::new).push(value),
            _ => {
                options.insert(option, value);
            }
        }
    }
    let table = ClusterTable {
        name: text(&args[1]),
        prefix: text(&args[2]),
        engine: text(&args[3]).to_ascii_lowercase(),
        options,
        split_keys,
    };
    change_map(state, |coordinator, now| coordinator.create_table(table, now))
}

/// Applies an administrative change to the map and stores it; returns the
/// map's new epoch.
/// Switches a table's shards to another mode and answers once every shard
/// runs it and every node routes by a map that says so: from then on the new
/// mode's guarantees hold.
async fn alter_table(
    state: &Arc<Mutex<State>>,
    table: &str,
    mode: &str,
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let mode = Mode::named(mode)
        .filter(|mode| mode.offered)
        .ok_or_else(|| Refused::UnknownMode(mode.to_string()))?;
    change_map(state, |coordinator, now| coordinator.alter_table(table, mode, now).map(drop))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let switched = {
            let state = state.lock();
            let map = state.coordinator.map();
            map.table_runs(table, mode).then_some(map.epoch)
        };
        if let Some(epoch) = switched {
            return seen_everywhere(state, epoch).await.map(|()| out.ok());
        }
        if Instant::now() >= deadline {
            return Err(Refused::StillSwitching { table: table.to_string(), mode: mode.label() });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `COORD.MIGRATE from to ranges...`: starts moving slots; answers the
/// migration's id.
fn start_migration(
    state: &Arc<Mutex<State>>,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let from: u32 = number(&args[1], "source shard")?;
    let to: u32 = number(&args[2], "target shard")?;
    let slots =
        args[3..].iter().map(|range| parse_slot_range(&text(range))).collect::<Result<Vec<_>, _>>()?;
    let mut id = 0;
    change_map(state, |coordinator, _| {
        id = coordinator.start_migration(from, to, slots)?;
        Ok(())
    })?;
    out.integer(id as i64);
    Ok(())
}

/// `COORD.SETSLOT node slot IMPORTING|MIGRATING|COMMIT|NODE other-node` or
/// `COORD.SETSLOT node slot STABLE`: CLUSTER SETSLOT (or MIGRATE's commit)
/// as node `node` was sent it, from that node's session.
fn set_slot(
    state: &Arc<Mutex<State>>,
    session: &Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    let node: u32 = number(&args[1], "node")?;
    session.check_node(node)?;
    let slot: u16 = number(&args[2], "slot")?;
    let other = || args.get(4).map_or(Err(Refused::NotANumber("node")), |other| number(other, "node"));
    let command = match (args[3].to_ascii_uppercase().as_slice(), args.len()) {
        (b"IMPORTING", 5) => SlotCommand::Importing { source: other()? },
        (b"MIGRATING", 5) => SlotCommand::Migrating { target: other()? },
        (b"COMMIT", 5) => SlotCommand::Commit { target: other()? },
        (b"NODE", 5) => SlotCommand::Node { owner: other()? },
        (b"STABLE", 4) => SlotCommand::Stable,
        _ => return Err(Refused::WrongArity("coord.setslot".into())),
    };
    change_map(state, |coordinator, now| coordinator.set_slot(node, slot, command, now))?;
    out.ok();
    Ok(())
}

/// `COORD.MOVE-REPLICA shard from-node to-node`.
fn move_replica(state: &Arc<Mutex<State>>, args: &[Vec<u8>], out: &mut ReplyWriter) -> Result<(), Refused> {
    let shard: u32 = number(&args[1], "shard")?;
    let from: u32 = number(&args[2], "node")?;
    let to: u32 = number(&args[3], "node")?;
    change_map(state, |coordinator, _| coordinator.start_replica_move(shard, from, to))?;
    out.ok();
    Ok(())
}

/// `COORD.MOVE-HEAD shard node`: hands the shard's head to its member `node`.
fn move_head(state: &Arc<Mutex<State>>, args: &[Vec<u8>], out: &mut ReplyWriter) -> Result<(), Refused> {
    let shard: u32 = number(&args[1], "shard")?;
    let node: u32 = number(&args[2], "node")?;
    change_map(state, |coordinator, now| coordinator.start_handover(shard, node, now))?;
    out.ok();
    Ok(())
}

/// `FIRST-LAST` or one slot.
fn parse_slot_range(range: &str) -> Result<(u16, u16), Refused> {
    let bad = || Refused::SlotRange(range.to_string());
    let (first, last) = range.split_once('-').unwrap_or((range, range));
    let first: u16 = first.trim().parse().map_err(|_| bad())?;
    let last: u16 = last.trim().parse().map_err(|_| bad())?;
    if first > last || usize::from(last) >= tessera_wire::slot::SLOTS {
        return Err(bad());
    }
    Ok((first, last))
}

/// `COORD.MIGRATIONS`: per migration under way, its id, source and target
/// shards, slots (`a-b,c-d`), phase, and what its source last reported:
/// entries and bytes sent, and whether its copy caught up (1) or not (0).
fn list_migrations(state: &Arc<Mutex<State>>, out: &mut ReplyWriter) {
    let state = state.lock();
    let map = state.coordinator.map();
    out.array(map.migrations.len());
    for migration in &map.migrations {
        let report = state.coordinator.migration_reports().get(&migration.id);
        let (entries, bytes, caught_up) =
            report.map_or((0, 0, false), |(report, _)| (report.entries, report.bytes, report.caught_up));
        let slots: Vec<String> =
            migration.slots.iter().map(|(first, last)| format!("{first}-{last}")).collect();
        out.array(8);
        out.integer(migration.id as i64);
        out.integer(i64::from(migration.from));
        out.integer(i64::from(migration.to));
        out.bulk(slots.join(",").as_bytes());
        out.bulk(match migration.phase {
            MigrationPhase::Copying => b"copying",
            MigrationPhase::Cutting => b"cutting",
        });
        out.integer(entries as i64);
        out.integer(bytes as i64);
        out.integer(i64::from(caught_up));
    }
}

fn change_map(
    state: &Arc<Mutex<State>>,
    change: impl FnOnce(&mut ClusterCoordinator, u64) -> Result<(), MapError>,
) -> Result<u64, Refused> {
    let mut state = state.lock();
    state.check_deciding()?;
    let now = state.now_ms();
    change(&mut state.coordinator, now)?;
    state.persist()?;
    Ok(state.coordinator.map().epoch)
}

/// Returns once every node of the map (standbys too: they answer clients
/// and check their users) routes by a map of at least `epoch` (it said so in
/// a heartbeat), or has been silent long enough that its lease has run out:
/// then no node can place a request by the older map.
async fn seen_everywhere(state: &Arc<Mutex<State>>, epoch: u64) -> Result<(), Refused> {
    let deadline =
        Instant::now() + Duration::from_millis(state.lock().failure_timeout_ms) + Duration::from_secs(3);
    loop {
        let behind = {
            let state = state.lock();
            let now = state.now_ms();
            let map = state.coordinator.map();
            map.nodes
                .iter()
                .find(|node| match state.known_epochs.get(&node.id) {
                    Some((known, _)) if *known >= epoch => false,
                    Some((_, heard_at)) => now.saturating_sub(*heard_at) <= state.failure_timeout_ms,
                    None => now <= state.failure_timeout_ms,
                })
                .map(|node| node.id)
        };
        match behind {
            None => return Ok(()),
            Some(node) if Instant::now() >= deadline => return Err(Refused::NotSeenBy(node)),
            Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn watch_map(
    state: &Arc<Mutex<State>>,
    session: &Session,
    args: &[Vec<u8>],
    out: &mut ReplyWriter,
) -> Result<(), Refused> {
    if args.len() == 3 {
        let known: u64 = number(&args[1], "epoch")?;
        let wait = Duration::from_millis(number::<u64>(&args[2], "wait")?.min(WAIT_MS_MAX));
        let mut epochs = state.lock().epochs.subscribe();
        let _ = tokio::time::timeout(wait, epochs.wait_for(|epoch| *epoch > known)).await;
    }
    let json = match session.identity {
        Some(_) => state.lock().coordinator.map().to_json(),
        None => state.lock().coordinator.map().to_public_json(),
    };
    out.bulk(json.as_bytes());
    Ok(())
}
