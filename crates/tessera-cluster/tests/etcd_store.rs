//! The etcd metadata store and leader election against a real etcd.

use std::time::{Duration, Instant};

use base64::Engine as _;
use tessera_cluster::store::{MetadataStore, StoreError};
use tessera_cluster::{ClusterMap, CoordinatorServer, Etcd, EtcdStore, Timing};
use tessera_testkit::EtcdServer;

fn map(cluster_id: &str) -> ClusterMap {
    let addresses: Vec<String> = (0..3).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
    ClusterMap::place(cluster_id, tessera_protocol::Mode::named("chain").unwrap(), 3, &addresses, 3).unwrap()
}

fn store(etcd: &EtcdServer, cluster_id: &str) -> EtcdStore {
    EtcdStore::new(Etcd::new(&etcd.endpoint()).unwrap(), cluster_id)
}

#[test]
fn versions_guard_every_write() {
    let Some(etcd) = EtcdServer::start() else { return };
    let store = store(&etcd, "c1");
    assert_eq!(store.load().unwrap(), None);
    let mut map = map("c1");
    let first = store.store(None, &map).unwrap();
    assert!(matches!(store.store(None, &map), Err(StoreError::Conflict { .. })));
    map.epoch += 1;
    let second = store.store(Some(first), &map).unwrap();
    assert!(second > first);
    assert!(
        matches!(store.store(Some(first), &map), Err(StoreError::Conflict { found: Some(found), .. }) if found == second)
    );
    let loaded = store.load().unwrap().unwrap();
    assert_eq!((loaded.version, loaded.map), (second, map));
    // Another cluster's prefix is another map.
    assert_eq!(self::store(&etcd, "c2").load().unwrap(), None);
}

#[test]
fn a_malformed_map_in_etcd_is_a_clear_error_and_is_not_overwritten() {
    let Some(etcd) = EtcdServer::start() else { return };
    let base64 = base64::engine::general_purpose::STANDARD;
    let put = serde_json::json!({
        "key": base64.encode("/tessera/broken/map"),
        "value": base64.encode("{\"cluster_id\": \"broken\", \"epoch\": \"not a number\"}"),
    });
    ureq::post(&format!("http://{}/v3/kv/put", etcd.endpoint())).send_json(put).unwrap();
    let store = store(&etcd, "broken");
    let error = store.load().unwrap_err().to_string();
    assert!(error.contains("/tessera/broken/map") && error.contains("invalid cluster map"), "{error}");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let started = runtime.block_on(CoordinatorServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Box::new(self::store(&etcd, "broken")),
        Some(map("broken")),
        Timing::default(),
        tessera_cluster::auth::ClusterSecret::generate(),
        None,
    ));
    let error = started.err().expect("a coordinator does not start on a malformed map").to_string();
    assert!(error.contains("invalid cluster map"), "{error}");
    assert!(store.load().is_err(), "the malformed map was left for an operator to look at");
}

#[test]
fn one_leader_at_a_time_and_a_deposed_leader_cannot_write() {
    let Some(etcd) = EtcdServer::start() else { return };
    let first = store(&etcd, "c1").fenced_by("coordinator-a");
    let second = store(&etcd, "c1").fenced_by("coordinator-b");
    let lease = first.campaign("coordinator-a", 2).unwrap().expect("no leader yet");
    assert!(second.campaign("coordinator-b", 2).unwrap().is_none(), "a leads");
    assert_eq!(first.leader().unwrap().as_deref(), Some("coordinator-a"));
    let version = first.store(None, &map("c1")).unwrap();
    assert!(matches!(second.store(Some(version), &map("c1")), Err(StoreError::NotLeader(_))));
    lease.keep_alive().unwrap();

    // The leader stops renewing (paused, partitioned): its lease lapses, b takes
    // over, and a's writes are refused even with the right version.
    let lapsed = Instant::now();
    let taken_over = loop {
        if let Some(lease) = second.campaign("coordinator-b", 2).unwrap() {
            break lease;
        }
        assert!(lapsed.elapsed() < Duration::from_secs(10), "the lease never lapsed");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(lease.keep_alive().is_err(), "a lapsed lease cannot be renewed");
    assert!(matches!(first.store(Some(version), &map("c1")), Err(StoreError::NotLeader(_))));
    let newer = second.store(Some(version), &map("c1")).unwrap();
    assert!(newer > version);
    taken_over.revoke();
    assert_eq!(second.leader().unwrap(), None, "a revoked lease gives the leadership up at once");
}

#[test]
fn the_map_is_kept_in_an_etcd_that_speaks_only_https_with_client_certificates() {
    let certificates = tempfile::tempdir().unwrap();
    tessera_cluster::tls::write_certificates(certificates.path(), &["127.0.0.1".to_string()]).unwrap();
    let Some(etcd) = EtcdServer::start_tls(certificates.path()) else { return };
    let file = |name: &str| certificates.path().join(name);
    let client = Etcd::new(&etcd.endpoint())
        .unwrap()
        .with_tls(&file("ca.crt"), Some((&file("client.crt"), &file("client.key"))))
        .unwrap();
    let store = EtcdStore::new(client, "c1");
    let version = store.store(None, &map("c1")).unwrap();
    assert_eq!(store.load().unwrap().unwrap().version, version);

    // Without a client certificate etcd refuses; without the CA this side
    // refuses etcd; over plain HTTP nothing is understood.
    let anonymous = Etcd::new(&etcd.endpoint()).unwrap().with_tls(&file("ca.crt"), None).unwrap();
    assert!(EtcdStore::new(anonymous, "c1").load().is_err());
    let untrusting = Etcd::new(&etcd.endpoint()).unwrap();
    assert!(EtcdStore::new(untrusting, "c1").load().is_err());
    let plain = Etcd::new(&format!("127.0.0.1:{}", etcd.port)).unwrap();
    assert!(EtcdStore::new(plain, "c1").load().is_err());
}
