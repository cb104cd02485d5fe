//! The coordinator process's RESP interface, over real sockets.

use std::time::{Duration, Instant};

use tessera_cluster::auth::{ClusterSecret, Login, LoginError, LoginTo, ADMIN};
use tessera_cluster::{ClusterMap, CoordinatorServer, FileStore, StartError, Timing};
use tessera_wire::{Client, Value};

const TIMING: Timing = Timing { lease_ms: 300, failure_timeout_ms: 400 };

fn addresses(count: usize) -> Vec<String> {
    (0..count).map(|index| format!("127.0.0.1:{}", 17000 + index)).collect()
}

fn secret() -> ClusterSecret {
    static SECRET: std::sync::OnceLock<ClusterSecret> = std::sync::OnceLock::new();
    SECRET.get_or_init(ClusterSecret::generate).clone()
}

/// A connection that has logged in as `identity` (a node id, or admin) with
/// `secret`, or the coordinator's refusal.
fn login_with(
    address: std::net::SocketAddr,
    cluster: &str,
    identity: &str,
    secret: &ClusterSecret,
) -> Result<Client, LoginError> {
    let mut client = Client::connect(address, Duration::from_secs(5)).unwrap();
    let login = Login::new(LoginTo::Coordinator, cluster, identity);
    let auth = login.auth(secret, client.command(&login.hello()).unwrap())?;
    Login::accepted(client.command(&auth).unwrap())?;
    Ok(client)
}

fn session(address: std::net::SocketAddr, identity: &str) -> Client {
    login_with(address, "c1", identity, &secret()).expect("a member's login")
}

async fn start(dir: &std::path::Path, initial: Option<ClusterMap>) -> Result<CoordinatorServer, StartError> {
    CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(FileStore::new(dir)),
        initial,
        TIMING,
        secret(),
        None,
    )
    .await
}

fn items(value: Value) -> Vec<Value> {
    value.into_items().expect("an array")
}

fn heartbeat(client: &mut Client, node: u32) -> (i64, Vec<Value>) {
    let reply = items(client.command(&["COORD.HEARTBEAT", "c1", &node.to_string(), "1", "0"]).unwrap());
    let epoch = reply[0].as_integer().unwrap();
    (epoch, items(reply[1].clone()))
}

fn map_of(client: &mut Client) -> ClusterMap {
    let json = client.command(&["COORD.MAP"]).unwrap();
    ClusterMap::from_json(std::str::from_utf8(json.as_bytes().unwrap()).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_joins_heartbeats_and_a_watchable_map_and_resumes_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let map = ClusterMap::place("c1", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses(4), 3)
        .unwrap();
    let server = start(dir.path(), Some(map.clone())).await.unwrap();
    let address = server.local_addr();
    let mut client = session(address, "0");
    let mut second = session(address, "1");

    assert_eq!(
        client.command(&["COORD.JOIN", "c1", "0"]).unwrap(),
        Value::Integer(TIMING.lease_ms as i64),
        "a node learns the lease it must count with"
    );
    let wrong = client.command(&["COORD.JOIN", "other", "0"]).unwrap();
    assert!(matches!(&wrong, Value::Error(message) if message.contains("cluster 'other'")), "{wrong:?}");
    let unknown = client.command(&["COORD.JOIN", "c1", "99"]).unwrap();
    assert!(matches!(unknown, Value::Error(_)));
    let garbage = client.command(&["COORD.HEARTBEAT", "c1", "x", "1", "0"]).unwrap();
    assert!(matches!(garbage, Value::Error(message) if message.contains("node id")));

    let (_, grants) = heartbeat(&mut client, 0);
    assert_eq!(grants.len(), 3, "node 0 is in all three shards");
    let first_grant = items(grants[0].clone());
    assert_eq!(items(first_grant[2].clone()).len(), 3, "three members");

    // Nodes 0 and 1 keep beating; node 2 falls silent. A watcher sees the new map.
    let watcher = std::thread::spawn(move || {
        let mut watcher = Client::connect(address, Duration::from_secs(5)).unwrap();
        let before = map_of(&mut watcher).epoch;
        let json = watcher.command(&["COORD.MAP", &before.to_string(), "5000"]).unwrap();
        ClusterMap::from_json(std::str::from_utf8(json.as_bytes().unwrap()).unwrap()).unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let changed = loop {
        heartbeat(&mut client, 0);
        heartbeat(&mut second, 1);
        let current = map_of(&mut client);
        if current.shards.iter().all(|shard| !shard.members.contains(&2)) {
            break current;
        }
        assert!(Instant::now() < deadline, "node 2 was never removed");
        std::thread::sleep(Duration::from_millis(50));
    };
    let watched = watcher.join().unwrap();
    assert!(watched.epoch > map.epoch, "the watch answered with a newer map");
    // The standby is brought into one shard as its learner.
    heartbeat(&mut session(address, "3"), 3);
    let with_learner = map_of(&mut client);
    assert_eq!(with_learner.shards.iter().filter(|shard| shard.learners == vec![3]).count(), 1);

    // A new coordinator on the same directory resumes from the stored map and
    // refuses a map for another cluster.
    drop(server);
    let resumed = start(dir.path(), None).await.unwrap();
    assert!(resumed.map().epoch >= changed.epoch);
    assert_eq!(resumed.map().shards, with_learner.shards);
    let other = ClusterMap::place("c2", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses(3), 3)
        .unwrap();
    let refused = start(dir.path(), Some(other)).await;
    assert!(matches!(refused.err(), Some(StartError::OtherCluster { stored, .. }) if stored == "c1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_obeys_only_sessions_that_prove_the_secret_and_a_node_only_as_itself() {
    let dir = tempfile::tempdir().unwrap();
    let map = ClusterMap::place("c1", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses(4), 3)
        .unwrap();
    let server = start(dir.path(), Some(map.clone())).await.unwrap();
    let address = server.local_addr();
    let refused =
        |reply: Value, code: &str| matches!(&reply, Value::Error(message) if message.starts_with(code));

    // Without a session: the map may be read, nothing may be changed.
    let mut anyone = Client::connect(address, Duration::from_secs(5)).unwrap();
    assert_eq!(anyone.command(&["PING"]).unwrap(), Value::Simple("PONG".into()));
    assert!(matches!(anyone.command(&["COORD.MAP"]).unwrap(), Value::Bulk(_)));
    // What a client library sends on connecting is not refused as unauthenticated
    // (redis-py takes NOAUTH there for a failed login).
    let setinfo = anyone.command(&["CLIENT", "SETINFO", "LIB-NAME", "redis-py"]).unwrap();
    assert!(refused(setinfo, "ERR unknown command"));
    // Nothing a coordinator is told is large: a big argument closes the
    // connection before its bytes arrive, and so does a request that keeps
    // growing in small ones.
    let mut big = Client::connect(address, Duration::from_secs(5)).unwrap();
    let reply = big.command(&[b"COORD.MAP".to_vec(), vec![b'x'; 100 << 10]]).unwrap();
    assert!(refused(reply, "ERR Protocol error"), "an argument over 64 KiB");
    assert!(big.command(&["PING"]).is_err(), "closed after the error");
    let mut endless = Client::connect(address, Duration::from_secs(5)).unwrap();
    let many: Vec<Vec<u8>> = (0..400).map(|_| vec![b'y'; 60 << 10]).collect();
    // The coordinator closes while this side still writes: the error reply
    // may be lost to the reset, or the write meet the closed socket.
    match endless.command(&many) {
        Ok(reply) => assert!(refused(reply, "ERR a request to the coordinator is over")),
        Err(error) => {
            let error = error.to_string();
            assert!(error.contains("reset") || error.contains("Broken pipe"), "{error}")
        }
    }
    assert!(endless.command(&["PING"]).is_err(), "closed after the error");
    for forged in [
        vec!["COORD.JOIN", "c1", "0"],
        vec!["COORD.HEARTBEAT", "c1", "0", "1", "0"],
        vec!["COORD.ADD-NODE", "127.0.0.1:6666"],
        vec!["COORD.TABLE-CREATE", "t", "t:", "memory"],
        vec!["COORD.TABLE-DROP", "t"],
        vec!["COORD.TABLE-ALTER", "default", "aa+ec"],
    ] {
        let reply = anyone.command(&forged).unwrap();
        assert!(refused(reply.clone(), "NOAUTH"), "{forged:?}: {reply:?}");
    }
    // Neither a wrong secret, nor a wrong cluster id (which learns nothing
    // of the real one), nor a made-up proof, nor a replayed one opens a session.
    let stranger = login_with(address, "c1", "0", &ClusterSecret::generate());
    assert!(matches!(stranger, Err(LoginError::Unproven)), "the coordinator's proof is checked first");
    let wrong_cluster = login_with(address, "c9", "0", &secret()).err().expect("refused");
    assert!(
        matches!(&wrong_cluster, LoginError::Refused(message) if !message.contains("c1")),
        "{wrong_cluster}"
    );
    let login = Login::new(LoginTo::Coordinator, "c1", "0");
    anyone.command(&login.hello()).unwrap();
    let made_up = anyone.command(&["COORD.AUTH", &"00".repeat(32)]).unwrap();
    assert!(refused(made_up, "ERR authentication failed"));
    let auth = login.auth(&secret(), anyone.command(&login.hello()).unwrap()).unwrap();
    let mut replayed = Client::connect(address, Duration::from_secs(5)).unwrap();
    replayed.command(&login.hello()).unwrap();
    assert!(refused(replayed.command(&auth).unwrap(), "ERR"), "a proof is good for its own challenge only");
    assert!(refused(replayed.command(&["COORD.HEARTBEAT", "c1", "0", "1", "0"]).unwrap(), "NOAUTH"));

    // A node's session speaks for that node only.
    let mut node0 = session(address, "0");
    assert!(matches!(node0.command(&["COORD.HEARTBEAT", "c1", "0", "1", "0"]).unwrap(), Value::Array(_)));
    let as_other = node0.command(&["COORD.HEARTBEAT", "c1", "1", "1", "0"]).unwrap();
    assert!(refused(as_other, "ERR this session is node 0's"));
    assert!(refused(node0.command(&["COORD.JOIN", "c1", "2"]).unwrap(), "ERR this session is node 0's"));
    let mut admin = session(address, ADMIN);
    assert!(refused(
        admin.command(&["COORD.HEARTBEAT", "c1", "0", "1", "0"]).unwrap(),
        "ERR this session is admin's"
    ));
    assert!(matches!(admin.command(&["COORD.ADD-NODE", "127.0.0.1:17010"]).unwrap(), Value::Integer(4)));
    assert_eq!(server.map().nodes.len(), 5, "only the admin's node was added");
}

/// Whatever a connection sends, the coordinator answers or closes it, never
/// panics, and goes on serving others. `PROPTEST_CASES` raises the count
/// (scripts/fuzz.sh).
#[test]
fn the_coordinator_survives_whatever_a_connection_sends() {
    use proptest::prelude::*;
    use std::io::{Read, Write};

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let map = ClusterMap::place("c1", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses(4), 3)
        .unwrap();
    let server = runtime.block_on(start(dir.path(), Some(map))).unwrap();
    let address = server.local_addr();
    let before = server.map();
    let words = prop_oneof![
        Just(b"COORD.HELLO".to_vec()),
        Just(b"COORD.AUTH".to_vec()),
        Just(b"COORD.JOIN".to_vec()),
        Just(b"COORD.HEARTBEAT".to_vec()),
        Just(b"COORD.MAP".to_vec()),
        Just(b"COORD.TABLE-CREATE".to_vec()),
        Just(b"c1".to_vec()),
        Just(b"0".to_vec()),
        Just(b"admin".to_vec()),
        Just("ab".repeat(32).into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..24),
    ];
    let command = proptest::collection::vec(words, 1..8);
    let input = prop_oneof![
        proptest::collection::vec(command, 1..4).prop_map(|commands| {
            let mut bytes = Vec::new();
            for args in commands {
                tessera_wire::encode_command(&args, &mut bytes);
            }
            bytes
        }),
        proptest::collection::vec(any::<u8>(), 0..512),
    ];
    let panics = tessera_testkit::panics_so_far();
    let cases = tessera_testkit::fuzz_cases(64);
    proptest!(ProptestConfig { cases, ..ProptestConfig::default() }, |(bytes in input)| {
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let _ = stream.write_all(&bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut sink = [0u8; 4096];
        while matches!(stream.read(&mut sink), Ok(read) if read > 0) {}
        let mut other = Client::connect(address, Duration::from_secs(5)).unwrap();
        prop_assert_eq!(other.command(&["PING"]).unwrap(), Value::Simple("PONG".into()));
    });
    // Nothing anyone sent without the secret added a node or a table (views
    // change by themselves: no node heartbeats here).
    let after = server.map();
    assert_eq!((after.nodes, after.tables), (before.nodes, before.tables));
    assert_eq!(tessera_testkit::panics_so_far(), panics, "a connection's task panicked");
}
