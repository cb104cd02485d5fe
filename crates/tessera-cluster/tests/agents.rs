//! A coordinator and three node agents on loopback: shards granted by
//! heartbeats, writes committed through chains over real peer links, and a
//! failed middle replica replaced while writes go on.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_cluster::agent::{Agent, AgentConfig, AgentError};
use tessera_cluster::auth::{ClusterSecret, LoginError};
use tessera_cluster::session::{CoordinatorSession, Credentials, SessionError};
use tessera_cluster::tls::{write_certificates, PeerTls};
use tessera_cluster::{ClusterMap, CoordinatorServer, FileStore, Shard, Timing};
use tessera_engine::{EngineKind, EngineSpec};
use tessera_protocol::Role;
use tessera_protocol::{read_visible, ClientReply, Consistency, Operation};
use tessera_wire::slot::key_slot;

const TIMING: Timing = Timing { lease_ms: 400, failure_timeout_ms: 600 };

/// A peer port whose client port (peer − 10000) is a valid port number.
fn peer_port() -> u16 {
    loop {
        let port = tessera_testkit::free_port();
        if port > 11_000 {
            return port;
        }
    }
}

/// `name` with a hash tag that puts it in one of `shard`'s slots: a shard's
/// first member deletes the keys of slots the shard does not own.
fn key_of(shard: &Shard, name: &str) -> String {
    (0..)
        .map(|tag| format!("{name}{{{tag}}}"))
        .find(|key| shard.owns(key_slot(key.as_bytes()) as u16))
        .expect("some tag lands in the shard")
}

async fn put(agent: &Agent, shard: u32, key: &str, value: &str) -> ClientReply {
    agent
        .submit(
            shard,
            Operation::Put { key: Bytes::from(key.to_string()), value: Bytes::from(value.to_string()) },
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_commit_over_peer_links_and_survive_a_dead_middle_replica() {
    let dir = tempfile::tempdir().unwrap();
    let peers: Vec<u16> = (0..3).map(|_| peer_port()).collect();
    let addresses: Vec<String> = peers.iter().map(|port| format!("127.0.0.1:{}", port - 10_000)).collect();
    let map =
        ClusterMap::place("c1", tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses, 3).unwrap();
    // The peer links and coordinator sessions run in mutual TLS
    // (tls_cluster) with the certificates `tessera tls-certs` writes, the
    // cluster-secret handshake inside.
    let certificates = dir.path().join("tls");
    write_certificates(&certificates, &["127.0.0.1".to_string()]).unwrap();
    let tls = PeerTls::from_files(
        &certificates.join("server.crt"),
        &certificates.join("server.key"),
        &certificates.join("ca.crt"),
    )
    .unwrap();
    let secret = ClusterSecret::generate();
    let coordinator = CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(FileStore::new(&dir.path().join("coordinator"))),
        Some(map),
        TIMING,
        secret.clone(),
        Some(tls.clone()),
    )
    .await
    .unwrap();
    let mut agents: Vec<Option<Arc<Agent>>> = Vec::new();
    for (node, port) in peers.iter().enumerate() {
        let config = AgentConfig {
            cluster_id: "c1".into(),
            node: node as u32,
            secret: secret.clone(),
            incarnation: 1,
            coordinator: coordinator.local_addr().to_string(),
            peer_listen: format!("127.0.0.1:{port}").parse().unwrap(),
            data_dir: dir.path().join(format!("node{node}")),
            engine: EngineSpec::new(EngineKind::Memory, BTreeMap::new()).unwrap(),
            heartbeat_ms: 100,
            tick_ms: 10,
            max_uncommitted_writes: 8,
            snapshot_bytes_per_sec: None,
            tls: Some(tls.clone()),
            tls_client_port: 0,
            datacenter_delay: None,
            clock_ahead: Duration::ZERO,
        };
        agents.push(Some(Agent::start(config).await.unwrap()));
    }
    let wrong = AgentConfig {
        cluster_id: "other".into(),
        node: 0,
        secret: secret.clone(),
        incarnation: 1,
        coordinator: coordinator.local_addr().to_string(),
        peer_listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().join("stranger"),
        engine: EngineSpec::new(EngineKind::Memory, BTreeMap::new()).unwrap(),
        heartbeat_ms: 100,
        tick_ms: 10,
        max_uncommitted_writes: 8,
        snapshot_bytes_per_sec: None,
        tls: Some(tls.clone()),
        tls_client_port: 0,
        datacenter_delay: None,
        clock_ahead: Duration::ZERO,
    };
    let refused = Agent::start(wrong.clone()).await.err();
    let login_refused = |error: &Option<AgentError>, expected: fn(&LoginError) -> bool| match error {
        Some(AgentError::Coordinator(SessionError::Login { source, .. })) => expected(source),
        _ => false,
    };
    assert!(login_refused(&refused, |source| matches!(source, LoginError::Refused(_))), "{refused:?}");
    let stranger = AgentConfig { cluster_id: "c1".into(), secret: ClusterSecret::generate(), ..wrong };
    let refused = Agent::start(stranger).await.err();
    assert!(login_refused(&refused, |source| matches!(source, LoginError::Unproven)), "{refused:?}");
    // Without the cluster's certificate there is no session at all, even
    // with the secret.
    let credentials = Credentials { cluster: "c1", identity: "0", secret: &secret, tls: None };
    let plain = CoordinatorSession::open(&coordinator.local_addr().to_string(), credentials).await;
    assert!(matches!(plain, Err(SessionError::Unreachable(_))), "{:?}", plain.err());

    let deadline = Instant::now() + Duration::from_secs(10);
    while !agents.iter().flatten().all(|agent| agent.shards().len() == 3) {
        assert!(Instant::now() < deadline, "shards were never granted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let shard = coordinator.map().shards[0].clone();
    let (head, middle, tail) =
        (shard.members[0] as usize, shard.members[1] as usize, shard.members[2] as usize);
    let agent = |index: usize| agents[index].as_ref().unwrap().clone();
    let (head_agent, middle_agent, tail_agent) = (agent(head), agent(middle), agent(tail));

    // A write at the head commits once the tail has it; every replica holds it.
    let k1 = key_of(&shard, "k1");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match put(&head_agent, shard.id, &k1, "v1").await {
            ClientReply::Written => break,
            other => assert!(Instant::now() < deadline, "no write committed: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read = tail_agent
        .submit(shard.id, Operation::Get { key: Bytes::from(k1.clone()), consistency: Consistency::Strong })
        .await;
    assert_eq!(read, ClientReply::Value(Some(Bytes::from_static(b"v1"))));
    for agent in [&head_agent, &middle_agent, &tail_agent] {
        let engine = agent.engine(shard.id).unwrap();
        assert_eq!(read_visible(engine.as_ref(), k1.as_bytes()).unwrap(), Some(Bytes::from_static(b"v1")));
    }

    // The middle replica dies: writes resume once the coordinator drops it.
    drop(middle_agent);
    agents[middle] = None;
    let died = Instant::now();
    // Dropping an agent aborts its tasks, and a task in the middle of a poll
    // on another thread finishes that poll first (it may still pass writes
    // on): wait until its peer listener is gone.
    while tokio::net::TcpStream::connect(("127.0.0.1", peers[middle])).await.is_ok() {
        assert!(died.elapsed() < Duration::from_secs(5), "the middle replica's listener outlived it");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Meanwhile nothing commits: past 8 waiting writes, writers must wait.
    let stuck: Vec<_> = (0..8)
        .map(|index| {
            let key = Bytes::from(key_of(&shard, &format!("stuck{index}")));
            head_agent.begin_all(shard.id, vec![Operation::Put { key, value: Bytes::from_static(b"v") }])
        })
        .collect();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), head_agent.wait_for_room()).await.is_err(),
        "room while 8 writes wait"
    );
    tokio::time::timeout(Duration::from_secs(15), head_agent.wait_for_room())
        .await
        .expect("room once they commit");
    drop(stuck);
    let mut written = 0;
    let recovered = loop {
        let key = key_of(&shard, &format!("after{written}"));
        if put(&head_agent, shard.id, &key, "v").await == ClientReply::Written {
            written += 1;
            if written == 1 {
                break died.elapsed();
            }
        }
        assert!(died.elapsed() < Duration::from_secs(15), "writes never resumed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    eprintln!("writes resumed {recovered:?} after the middle replica died");
    let view = coordinator.map().shards[0].clone();
    assert_eq!(view.members, vec![head as u32, tail as u32]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tail_agent.role(shard.id) != Some(Role::Tail) || head_agent.role(shard.id) != Some(Role::Head) {
        assert!(Instant::now() < deadline, "roles after the failure");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let engine = tail_agent.engine(shard.id).unwrap();
    let after0 = key_of(&shard, "after0");
    assert_eq!(read_visible(engine.as_ref(), after0.as_bytes()).unwrap(), Some(Bytes::from_static(b"v")));
}
