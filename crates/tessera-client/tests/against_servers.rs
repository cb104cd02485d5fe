//! The client against real servers: redis-server, a real Redis Cluster
//! (resharded under it, with MOVED and ASK), and a Tessera node.

use std::time::Duration;

use tessera_client::{cmd, Client, ClusterClient, Error, Level, Options, Value};
use tessera_testkit::{RedisCluster, RedisServer};
use tessera_wire::slot::key_slot;

fn one_connection(request_timeout: Duration) -> Options {
    Options { connections_per_server: 1, request_timeout, ..Options::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_pipeline_on_few_connections_and_each_gets_its_own_answer() {
    let Some(redis) = RedisServer::start() else { return };
    let client = Client::new(&redis.address(), Options::default());
    let tasks: Vec<_> = (0..50)
        .map(|task| {
            let client = client.clone();
            tokio::spawn(async move {
                for round in 0..200 {
                    let key = format!("task:{task}");
                    let counted = client.request(&cmd("INCR").key(&key)).await.unwrap();
                    assert_eq!(counted, Value::Integer(round + 1), "{key} answered another's count");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let sets: Vec<_> = (0..1000).map(|n| cmd("SET").key(format!("k{n}")).arg(n.to_string())).collect();
    assert!(client.pipeline(&sets).await.unwrap().iter().all(|answer| answer.is_ok()));
    let gets: Vec<_> = (0..1000).map(|n| cmd("GET").key(format!("k{n}"))).collect();
    for (n, answer) in client.pipeline(&gets).await.unwrap().into_iter().enumerate() {
        assert_eq!(answer.unwrap(), Value::Bulk(n.to_string().into()));
    }
    let refused = client.request(&cmd("INCR").key("k1").arg("extra")).await;
    assert!(matches!(refused, Err(Error::Server(message)) if message.contains("wrong number")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_late_past_its_timeout_does_not_go_to_the_next_request() {
    let Some(redis) = RedisServer::start() else { return };
    let client = Client::new(&redis.address(), one_connection(Duration::from_millis(200)));
    client.set("k", "v").await.unwrap();
    // BLPOP blocks the connection for 0.5 s, then answers nil.
    let late = client.request(&cmd("BLPOP").key("empty").arg("0.5")).await;
    assert!(matches!(late, Err(Error::Unknown(_))), "{late:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(client.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_asked_again_only_for_an_idempotent_command() {
    let Some(redis) = RedisServer::start() else { return };
    let client = Client::new(&redis.address(), one_connection(Duration::from_secs(5)));
    client.set("k", "v").await.unwrap();
    // On one connection: a BLPOP that blocks it, then a read and a write
    // the server has not run yet when the connection is killed.
    let blocked = tokio::spawn({
        let client = client.clone();
        async move { client.request(&cmd("BLPOP").key("queue").arg("5")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let read = tokio::spawn({
        let client = client.clone();
        async move { client.get("k").await }
    });
    let write = tokio::spawn({
        let client = client.clone();
        async move { client.request(&cmd("INCR").key("counter")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let killer = Client::new(&redis.address(), Options::default());
    killer
        .request(&cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").arg("SKIPME").arg("yes"))
        .await
        .unwrap();

    assert!(matches!(blocked.await.unwrap(), Err(Error::Unknown(_))));
    assert_eq!(read.await.unwrap().unwrap().as_deref(), Some(&b"v"[..]), "the read was asked again");
    assert!(matches!(write.await.unwrap(), Err(Error::Unknown(_))), "the write's outcome is unknown");
    assert_eq!(killer.get("counter").await.unwrap(), None, "the write was not sent again");
}

/// Each master's id and address.
async fn masters(cluster: &RedisCluster) -> Vec<(String, String)> {
    let mut masters = Vec::new();
    for address in cluster.addresses() {
        let node = Client::new(&address, Options::default());
        let id = node.request(&cmd("CLUSTER").arg("MYID")).await.unwrap();
        masters.push((String::from_utf8(id.as_bytes().unwrap().to_vec()).unwrap(), address));
    }
    masters
}

fn owner_of(masters: &[(String, String)], nodes: &str, slot: usize) -> usize {
    let line = nodes
        .lines()
        .find(|line| {
            line.split(' ').skip(8).any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                (low.parse::<usize>().unwrap()..=high.parse().unwrap()).contains(&slot)
            })
        })
        .unwrap();
    masters.iter().position(|(id, _)| line.starts_with(id.as_str())).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_client_follows_moved_and_ask_through_a_resharding() {
    let Some(cluster) = RedisCluster::start(3, 0) else { return };
    let addresses = cluster.addresses();
    let seeds: Vec<&str> = addresses.iter().map(String::as_str).collect();
    let client = ClusterClient::connect(&seeds, Options::default()).await.unwrap();
    for n in 0..300 {
        client.set(format!("user:{n}"), n.to_string()).await.unwrap();
    }
    let gets: Vec<_> = (0..300).map(|n| cmd("GET").key(format!("user:{n}"))).collect();
    for (n, answer) in client.pipeline(&gets).await.into_iter().enumerate() {
        assert_eq!(answer.unwrap(), Value::Bulk(n.to_string().into()));
    }

    let masters = masters(&cluster).await;
    let admin: Vec<Client> =
        masters.iter().map(|(_, address)| Client::new(address, Options::default())).collect();
    let nodes = admin[0].request(&cmd("CLUSTER").arg("NODES")).await.unwrap();
    let nodes = String::from_utf8(nodes.as_bytes().unwrap().to_vec()).unwrap();

    // MOVED: an empty slot handed to another master behind the client's back.
    let slot = key_slot(b"moved-key");
    let (from, to) = (owner_of(&masters, &nodes, slot), (owner_of(&masters, &nodes, slot) + 1) % 3);
    for node in &admin {
        let moved = cmd("CLUSTER").arg("SETSLOT").arg(slot.to_string()).arg("NODE").arg(&masters[to].0);
        node.request(&moved).await.unwrap();
    }
    client.set("moved-key", "here").await.unwrap();
    assert_eq!(admin[to].get("moved-key").await.unwrap().as_deref(), Some(&b"here"[..]));
    assert_ne!(from, to);

    // ASK: a slot being migrated; a key the source lacks is asked of the target.
    let slot = key_slot(b"ask-key");
    let (source, target) = (owner_of(&masters, &nodes, slot), (owner_of(&masters, &nodes, slot) + 1) % 3);
    let setslot = |state: &str, node: usize| {
        cmd("CLUSTER").arg("SETSLOT").arg(slot.to_string()).arg(state).arg(&masters[node].0)
    };
    admin[target].request(&setslot("IMPORTING", source)).await.unwrap();
    admin[source].request(&setslot("MIGRATING", target)).await.unwrap();
    client.set("ask-key", "there").await.unwrap();
    assert_eq!(client.get("ask-key").await.unwrap().as_deref(), Some(&b"there"[..]));
    let on_source = admin[source].get("ask-key").await;
    assert!(
        matches!(on_source, Err(Error::Server(message)) if message.starts_with("ASK")),
        "the source lacks it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tessera_node_says_at_what_level_it_served_a_read() {
    let dir = tempfile::tempdir().unwrap();
    let config = tessera_node::Config {
        port: 0,
        dir: dir.path().to_path_buf(),
        threads: 1,
        ..tessera_node::Config::default()
    };
    let server = tessera_node::Server::start(config).unwrap();
    let client = Client::new(&server.local_addr().to_string(), Options::default());
    client.set("k", "v").await.unwrap();
    let (level, value) = client.read_at(Level::Eventual, cmd("GET").key("k")).await.unwrap();
    assert_eq!((level, value), (Level::Strong, Value::Bulk("v".into())), "one copy: every read is strong");
    let refused = client.read_at(Level::Strong, cmd("INCR").key("k")).await;
    assert!(matches!(&refused, Err(Error::Server(message)) if message.contains("not one")), "{refused:?}");
    let missing = client.read_at(Level::Strong, cmd("GET").key("nothing")).await.unwrap();
    assert_eq!(missing, (Level::Strong, Value::Null));
}
