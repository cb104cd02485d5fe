//! Test support shared by the crates' test suites: a real `redis-server` started
//! on a free loopback port, helpers to wait for servers, and what fuzz tests
//! need.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::thread;
use std::time::{Duration, Instant};

/// How many cases a fuzz test runs: `PROPTEST_CASES` when set (scripts/fuzz.sh
/// raises it), else `default`.
pub fn fuzz_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|cases| cases.parse().ok()).unwrap_or(default)
}

/// Panics in this process since the first call, wherever they happened: a
/// server's connection task that panics is caught by its runtime, and a test
/// that only checks the server still answers would not see it.
pub fn panics_so_far() -> usize {
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    static COUNTING: Once = Once::new();
    COUNTING.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
    PANICS.load(Ordering::SeqCst)
}

/// A port that was free a moment ago, and not handed out before in this
/// process (tests run in parallel: two servers must not race for one port).
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("bind an ephemeral port")
            .local_addr()
            .expect("local address")
            .port();
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// Waits until something accepts connections on `port`. A connection to
/// itself does not count: with nothing listening, a connect to a port in the
/// ephemeral range can pick that very port as its source and succeed.
pub fn wait_for_port(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) {
            let to_itself = stream.local_addr().is_ok_and(|local| local.port() == port);
            if !to_itself {
                return true;
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Whether a Redis-speaking server answers PING on `port`.
fn answers_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok() && stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}

/// Whether a program is on the PATH.
pub fn have_program(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| Path::new(&dir).join(name).is_file()))
        .unwrap_or(false)
}

/// Tests that need an external program call this: it returns false (and says
/// why) when the program is missing, unless `TESSERA_REQUIRE_EXTERNAL=1` (set by
/// the project's test command), in which case a missing program fails the test.
pub fn external_program_available(name: &str) -> bool {
    if have_program(name) {
        return true;
    }
    if std::env::var("TESSERA_REQUIRE_EXTERNAL").is_ok_and(|value| value == "1") {
        panic!("{name} is required (TESSERA_REQUIRE_EXTERNAL=1) but not installed");
    }
    eprintln!("skipping: {name} is not installed (the project's test command installs it)");
    false
}

/// Starts a server (`spawn` on a given port) on a port that was free a moment
/// ago. Tests run in parallel and start many servers, so the port may be taken
/// by the time the server binds it: it must be our server that is `ready` on
/// it, and another port is tried if the server exits instead.
fn start_on_a_free_port(
    name: &str,
    timeout: Duration,
    ready: impl Fn(u16) -> bool,
    spawn: impl Fn(u16) -> Child,
) -> (u16, Child) {
    for _ in 0..10 {
        let port = free_port();
        let mut child = spawn(port);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                break; // it could not bind: try another port
            }
            if ready(port) {
                return (port, child);
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("{name} did not start on any of 10 ports");
}

/// A real redis-server with no persistence, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one, or returns `None` when redis-server is not installed.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// Starts one with extra configuration arguments.
    pub fn start_with(extra: &[String]) -> Option<Self> {
        if !external_program_available("redis-server") {
            return None;
        }
        let dir = tempfile::tempdir().expect("temporary directory");
        let (port, child) =
            start_on_a_free_port("redis-server", Duration::from_secs(10), answers_ping, |port| {
                Command::new("redis-server")
                    .args([
                        "--port",
                        &port.to_string(),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ])
                    .args(extra)
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-server")
            });
        Some(Self { port, child, _dir: dir })
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real Redis Cluster on loopback: `masters` masters with `replicas` replicas
/// each, made by `redis-cli --cluster create`; killed when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts one, or returns `None` when redis-server or redis-cli is missing.
    pub fn start(masters: usize, replicas: usize) -> Option<Self> {
        if !external_program_available("redis-server") || !external_program_available("redis-cli") {
            return None;
        }
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                // The bus port is chosen too: port + 10000 may not exist.
                let bus = free_port().to_string();
                let extra =
                    ["--cluster-enabled", "yes", "--cluster-port", &bus, "--cluster-node-timeout", "5000"];
                RedisServer::start_with(&extra.map(String::from)).expect("redis-server is installed")
            })
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(RedisServer::address))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(created.status.success(), "cluster create: {}", String::from_utf8_lossy(&created.stdout));
        let cluster = Self { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        let (count, replica_count) = (cluster.nodes.len(), masters * replicas);
        while !cluster.nodes.iter().all(|node| cluster_ok(node.port, count, replica_count)) {
            assert!(Instant::now() < deadline, "the Redis Cluster did not become ready");
            thread::sleep(Duration::from_millis(100));
        }
        Some(cluster)
    }

    pub fn addresses(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::address).collect()
    }
}

/// Whether a node sees the cluster whole: state ok, and every node connected
/// with the expected number of replicas.
fn cluster_ok(port: u16, nodes: usize, replicas: usize) -> bool {
    let ask = |args: &[&str]| {
        Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
            .unwrap_or_default()
    };
    let view = ask(&["cluster", "nodes"]);
    let lines: Vec<&str> = view.lines().filter(|line| !line.is_empty()).collect();
    // A master lists each replica with its sync state; a replica says whether it is syncing.
    let replication = ask(&["info", "replication"]);
    let syncing = ["state=wait_bgsave", "state=send_bulk", "master_sync_in_progress:1"]
        .iter()
        .any(|sign| replication.contains(sign));
    ask(&["cluster", "info"]).contains("cluster_state:ok")
        && !syncing
        && lines.len() == nodes
        && lines.iter().all(|line| line.contains("connected"))
        && lines.iter().filter(|line| line.contains("slave")).count() == replicas
}

/// A real single-member etcd on loopback, killed when dropped.
pub struct EtcdServer {
    pub port: u16,
    tls: bool,
    child: Child,
    _dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts one, or returns `None` when etcd is not installed.
    pub fn start() -> Option<Self> {
        Self::start_with(None)
    }

    /// Starts one that serves clients over HTTPS only and asks them for a
    /// certificate, with the files `tessera tls-certs` writes into
    /// `certificates` (its `server.crt` must name 127.0.0.1).
    pub fn start_tls(certificates: &std::path::Path) -> Option<Self> {
        Self::start_with(Some(certificates))
    }

    fn start_with(certificates: Option<&std::path::Path>) -> Option<Self> {
        if !external_program_available("etcd") {
            return None;
        }
        let dir = tempfile::tempdir().expect("temporary directory");
        // Health is asked on the metrics port, plain HTTP whatever the client port speaks.
        let metrics_port = std::cell::Cell::new(0);
        let scheme = if certificates.is_some() { "https" } else { "http" };
        let spawn = |port: u16| {
            metrics_port.set(free_port());
            let client_url = format!("{scheme}://127.0.0.1:{port}");
            let peer_url = format!("http://127.0.0.1:{}", free_port());
            let mut command = Command::new("etcd");
            command
                .args(["--name", "test", "--listen-client-urls", &client_url, "--advertise-client-urls"])
                .arg(&client_url)
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .arg("--initial-cluster")
                .arg(format!("test={peer_url}"))
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", metrics_port.get()))
                .arg("--data-dir")
                .arg(dir.path().join(port.to_string()));
            if let Some(certificates) = certificates {
                command
                    .arg("--cert-file")
                    .arg(certificates.join("server.crt"))
                    .arg("--key-file")
                    .arg(certificates.join("server.key"))
                    .arg("--trusted-ca-file")
                    .arg(certificates.join("ca.crt"))
                    .arg("--client-cert-auth");
            }
            command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start etcd")
        };
        let ready = |_: u16| etcd_healthy(metrics_port.get());
        let (port, child) = start_on_a_free_port("etcd", Duration::from_secs(20), ready, spawn);
        Some(Self { port, tls: certificates.is_some(), child, _dir: dir })
    }

    /// How a client names it: `host:port`, or an `https://` URL.
    pub fn endpoint(&self) -> String {
        match self.tls {
            true => format!("https://127.0.0.1:{}", self.port),
            false => format!("127.0.0.1:{}", self.port),
        }
    }
}

/// Whether an etcd answers `/health` as healthy on this port.
fn etcd_healthy(port: u16) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    let mut answer = String::new();
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_to_string(&mut answer).is_ok()
        && answer.contains("\"health\":\"true\"")
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
