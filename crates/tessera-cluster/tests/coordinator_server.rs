//! The coordinator process's RESP interface, over real sockets.

use std::time::{Duration, Instant};

use tessera_cluster::{ClusterMap, CoordinatorServer, FileStore, StartError, Timing};
use tessera_wire::{Client, Value};

const TIMING: Timing = Timing { lease_ms: 300, failure_timeout_ms: 400 };

fn addresses(count: usize) -> Vec<String> {
    (0..count).map(|index| format!("127.0.0.1:{}", 17000 + index)).collect()
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
    let server = CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(FileStore::new(dir.path())),
        Some(map.clone()),
        TIMING,
    )
    .await
    .unwrap();
    let address = server.local_addr();
    let mut client = Client::connect(address, Duration::from_secs(5)).unwrap();

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
        heartbeat(&mut client, 1);
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
    heartbeat(&mut client, 3);
    let with_learner = map_of(&mut client);
    assert_eq!(with_learner.shards.iter().filter(|shard| shard.learners == vec![3]).count(), 1);

    // A new coordinator on the same directory resumes from the stored map and
    // refuses a map for another cluster.
    drop(server);
    let resumed = CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(FileStore::new(dir.path())),
        None,
        TIMING,
    )
    .await
    .unwrap();
    assert!(resumed.map().epoch >= changed.epoch);
    assert_eq!(resumed.map().shards, with_learner.shards);
    let other = ClusterMap::place("c2", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses(3), 3)
        .unwrap();
    let refused = CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(FileStore::new(dir.path())),
        Some(other),
        TIMING,
    )
    .await;
    assert!(matches!(refused.err(), Some(StartError::OtherCluster { stored, .. }) if stored == "c1"));
}
