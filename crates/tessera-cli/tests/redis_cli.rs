//! The real `tessera` binary driven by redis-cli (Debian's redis-tools), a
//! client nobody here wrote, and by `tessera`'s own client commands.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tessera_testkit::{external_program_available, free_port, wait_for_port};

struct Node {
    port: u16,
    child: Child,
    /// The node's own stderr, shown when a command against it fails.
    stderr: tempfile::NamedTempFile,
}

impl Node {
    fn start(dir: &Path, args: &[&str]) -> Self {
        let port = free_port();
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--port", &port.to_string(), "--log", "warn"])
            .arg("--dir")
            .arg(dir)
            .args(args)
            .stdout(Stdio::null())
            .stderr(stderr.reopen().unwrap())
            .spawn()
            .expect("start tessera");
        let mut node = Self { port, child, stderr };
        assert!(wait_for_port(port, Duration::from_secs(15)), "tessera did not start: {}", node.state());
        node
    }

    /// Whether the node still runs, and what it wrote to stderr.
    fn state(&mut self) -> String {
        let running = match self.child.try_wait() {
            Ok(None) => "running".to_string(),
            Ok(Some(status)) => format!("exited with {status}"),
            Err(error) => error.to_string(),
        };
        let stderr = std::fs::read_to_string(self.stderr.path()).unwrap_or_default();
        format!("node on port {} {running}; its stderr: {stderr:?}", self.port)
    }

    /// A client command that must succeed; its stdout.
    fn tessera_ok(&mut self, args: &[&str]) -> String {
        let output = self.tessera(args);
        assert!(
            output.status.success(),
            "tessera {args:?}: {}; {}",
            String::from_utf8_lossy(&output.stderr),
            self.state()
        );
        String::from_utf8(output.stdout).unwrap()
    }

    fn redis_cli(&self, args: &[&str]) -> String {
        let output =
            Command::new("redis-cli").args(["-p", &self.port.to_string()]).args(args).output().unwrap();
        assert!(output.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap().trim_end().to_string()
    }

    fn tessera(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["--addr", &format!("127.0.0.1:{}", self.port)])
            .args(args)
            .output()
            .unwrap()
    }

    /// Sends SIGTERM and waits for a clean exit.
    fn terminate(mut self) {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
        let exit = self.child.wait().unwrap();
        assert!(exit.success(), "tessera exited with {exit} after SIGTERM");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn redis_cli_runs_the_common_commands() {
    if !external_program_available("redis-cli") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    assert_eq!(node.redis_cli(&["PING"]), "PONG");
    assert_eq!(node.redis_cli(&["SET", "greeting", "hello world"]), "OK");
    assert_eq!(node.redis_cli(&["GET", "greeting"]), "hello world");
    assert_eq!(node.redis_cli(&["INCRBY", "n", "41"]), "41");
    assert_eq!(node.redis_cli(&["INCR", "n"]), "42");
    assert_eq!(node.redis_cli(&["HSET", "h", "a", "1", "b", "2"]), "2");
    assert_eq!(node.redis_cli(&["HGETALL", "h"]), "a\n1\nb\n2");
    assert_eq!(
        node.redis_cli(&["GET", "h"]),
        "WRONGTYPE Operation against a key holding the wrong kind of value"
    );
    assert_eq!(node.redis_cli(&["DBSIZE"]), "3");
    assert!(node.redis_cli(&["INFO", "server"]).contains("redis_version:"));
    // RESP3 through HELLO 3: redis-cli prints a map's pairs on one line each,
    // where the RESP2 flat array above gave one element per line.
    assert_eq!(node.redis_cli(&["-3", "HGETALL", "h"]), "a 1\nb 2");
    // The cursor-driven --scan mode walks every key.
    let mut keys: Vec<String> = node.redis_cli(&["--scan"]).lines().map(str::to_string).collect();
    keys.sort();
    assert_eq!(keys, ["greeting", "h", "n"]);
    assert_eq!(node.redis_cli(&["--scan", "--pattern", "g*"]), "greeting");
}

#[test]
fn redis_cli_pipe_mode_loads_many_keys() {
    if !external_program_available("redis-cli") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let mut input = Vec::new();
    for i in 0..20_000 {
        tessera_wire::encode_command(&["SET", &format!("key:{i}"), &format!("value:{i}")], &mut input);
    }
    let mut pipe = Command::new("redis-cli")
        .args(["-p", &node.port.to_string(), "--pipe"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    pipe.stdin.take().unwrap().write_all(&input).unwrap();
    let output = pipe.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(report.contains("errors: 0, replies: 20000"), "{report}");
    assert_eq!(node.redis_cli(&["DBSIZE"]), "20000");
    assert_eq!(node.redis_cli(&["GET", "key:19999"]), "value:19999");
}

#[test]
fn sigterm_flushes_a_persistent_engine_and_restart_keeps_the_data() {
    if !external_program_available("redis-cli") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // fsync=never: only the shutdown flush makes the writes durable.
    let node = Node::start(dir.path(), &["--engine", "log", "--engine-option", "fsync=never"]);
    for i in 0..100 {
        node.redis_cli(&["SET", &format!("k{i}"), &format!("v{i}")]);
    }
    node.terminate();
    let node = Node::start(dir.path(), &["--engine", "log"]);
    assert_eq!(node.redis_cli(&["DBSIZE"]), "100");
    assert_eq!(node.redis_cli(&["GET", "k99"]), "v99");
}

#[test]
fn tessera_client_commands_talk_to_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    node.tessera_ok(&["set", "city", "Lyon"]);
    assert_eq!(node.tessera_ok(&["get", "city"]), "Lyon\n");
    let missing = node.tessera(&["get", "nowhere"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no such key"));
    node.tessera_ok(&[
        "table",
        "create",
        "logs",
        "--prefix",
        "log:",
        "--engine",
        "log",
        "--option",
        "fsync=always",
    ]);
    node.tessera_ok(&["set", "log:1", "boot"]);
    assert_eq!(node.tessera_ok(&["scan", "--match", "log:*"]), "log:1\n");
    assert!(node.tessera_ok(&["table", "list"]).contains("\"logs\""));
    let bad = node.tessera(&["table", "create", "x", "--prefix", "x:", "--engine", "nosuch"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown engine"));
    assert_eq!(node.tessera_ok(&["del", "city", "log:1"]), "(integer) 2\n");
}

#[test]
fn dash_a_is_the_password_as_in_redis_cli() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &["--password", "open sesame"]);
    let refused = node.tessera(&["set", "k", "v"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("NOAUTH"), "{refused:?}");
    let stored = node.tessera(&["-a", "open sesame", "set", "k", "v"]);
    assert!(stored.status.success(), "{stored:?}");
    let read = node.tessera(&["get", "k", "-a", "open sesame"]);
    assert_eq!(String::from_utf8_lossy(&read.stdout), "v\n");
}

#[test]
fn unreachable_node_is_one_clear_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["--addr", &format!("127.0.0.1:{}", free_port()), "get", "k"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.starts_with("tessera: cannot connect"), "{stderr}");
}

#[test]
fn bad_flags_are_rejected_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--engine", "nosuch", "--port", &free_port().to_string()])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown engine"));

    let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--port", &free_port().to_string(), "--cluster-id", "c", "--node-id", "0"])
        .args(["--coordinator", "127.0.0.1:1"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--cluster-secret-file"), "a cluster node without the secret: {stderr}");
}

#[test]
fn a_coordinator_refuses_an_incomplete_or_impossible_cluster() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("cluster.secret");
    tessera_cluster::auth::ClusterSecret::generate().save(&secret).unwrap();
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["coordinator", "--port", &free_port().to_string()])
            .arg("--dir")
            .arg(dir.path())
            .args(args)
            .output()
            .unwrap();
        assert!(!output.status.success());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let coordinator = |args: &[&str]| {
        let mut with_secret = vec!["--cluster-secret-file", secret.to_str().unwrap()];
        with_secret.extend_from_slice(args);
        run(&with_secret)
    };
    assert!(run(&[]).contains("--cluster-secret-file"), "a coordinator needs the cluster's secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(coordinator(&[]).contains("chmod 600"), "a secret others may read is refused");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(coordinator(&[]).contains("no cluster map stored"));
    assert!(coordinator(&["--nodes", "127.0.0.1:1"]).contains("--cluster-id"));
    assert!(coordinator(&["--cluster-id", "c", "--nodes", "127.0.0.1:1,127.0.0.1:2"])
        .contains("cannot keep 3 replicas"));
    assert!(coordinator(&["--cluster-id", "c", "--nodes", "a,b,c"]).contains("not host:port"));
    assert!(coordinator(&["--lease-ms", "2000"]).contains("longer than --lease-ms"));
}

#[test]
fn a_node_rotates_its_log_file_by_size_and_keeps_the_files_it_was_told_to() {
    if !external_program_available("redis-cli") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("node.log");
    let log_text = log.display().to_string();
    let node = Node::start(
        &dir.path().join("data"),
        &["--log-file", &log_text, "--log-file-max-bytes", "2kb", "--log-files-kept", "2"],
    );
    // A script's redis.log lines are the node's warnings.
    let script = format!("redis.log(redis.LOG_WARNING, '{}') return 1", "w".repeat(100));
    for _ in 0..200 {
        assert_eq!(node.redis_cli(&["EVAL", &script, "0"]), "1");
    }
    assert_eq!(node.redis_cli(&["PING"]), "PONG", "the node serves on after rotating");
    let rotated = |number: usize| dir.path().join(format!("node.log.{number}"));
    for path in [log.clone(), rotated(1), rotated(2)] {
        let size = std::fs::metadata(&path).unwrap_or_else(|_| panic!("{} is missing", path.display())).len();
        // Rotated past 2 KiB: at most one line beyond it.
        assert!(size > 0 && size < 2048 + 512, "{}: {size} bytes", path.display());
    }
    assert!(!rotated(3).exists(), "only two earlier files are kept");
    let newest = std::fs::read_to_string(&log).unwrap();
    assert!(newest.lines().all(|line| line.contains(" WARN ") && !line.contains('\u{1b}')), "{newest}");
    node.terminate();
}
