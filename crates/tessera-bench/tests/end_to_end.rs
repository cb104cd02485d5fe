//! The driver against a real Redis and a real Tessera node, with few records.

use std::time::Duration;

use tessera_bench::driver::{load, run, DriverConfig, RecordKind, SizeRange};
use tessera_bench::workload::{Mix, Workload};
use tessera_testkit::{RedisCluster, RedisServer};
use tessera_wire::{Client, Value};

fn config(target: String) -> DriverConfig {
    DriverConfig {
        connections: 4,
        pipeline: 8,
        records: 500,
        operations: 4_000,
        ..DriverConfig::new(vec![target])
    }
}

/// A one-worker Tessera node on a free port, and its data directory.
fn start_node() -> (tessera_node::Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let config = tessera_node::Config {
        port: 0,
        dir: dir.path().to_path_buf(),
        threads: 1,
        ..tessera_node::Config::default()
    };
    (tessera_node::Server::start(config).unwrap(), dir)
}

async fn load_and_run(target: String) {
    let config = config(target.clone());
    let workload = Workload::named("A").unwrap();
    let loaded = load(&config, &workload).await.unwrap();
    assert_eq!(loaded.operations, 500);
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    let report = run(&config, &workload).await.unwrap();
    assert_eq!(report.operations, 4_000);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let (reads, updates) = (report.latency["read"].count, report.latency["update"].count);
    assert!(reads > 1_500 && updates > 1_500, "reads {reads}, updates {updates}");
    assert!(report.latency["read"].p99_us >= report.latency["read"].p50_us);
    let mut client = Client::connect(target.as_str(), Duration::from_secs(5)).unwrap();
    let record = client.command(&["HGETALL", "user499"]).unwrap().into_items().unwrap();
    assert_eq!(record.len(), 20, "a loaded record is a hash of 10 fields");
    assert!(matches!(client.command(&["HLEN", "user0"]).unwrap(), Value::Integer(10)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_real_redis() {
    let Some(server) = RedisServer::start() else { return };
    load_and_run(server.address()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_real_tessera_node() {
    let (server, _dir) = start_node();
    load_and_run(server.local_addr().to_string()).await;
    let mix = Workload { mix: Mix::parse("read=0.5,rmw=0.5").unwrap(), ..Workload::named("F").unwrap() };
    let report = run(&config(server.local_addr().to_string()), &mix).await.unwrap();
    assert!(report.latency["rmw"].count > 1_000 && report.errors.is_empty());
    server.shutdown();
}

#[tokio::test]
async fn unreachable_targets_and_non_clusters_are_clear_errors() {
    let mut unreachable = config(format!("127.0.0.1:{}", tessera_testkit::free_port()));
    unreachable.connect_timeout = Duration::from_secs(2);
    let error = run(&unreachable, &Workload::named("A").unwrap()).await.unwrap_err();
    assert!(error.contains("cannot connect"), "{error}");
    let Some(server) = RedisServer::start() else { return };
    let not_a_cluster = DriverConfig { cluster: true, ..config(server.address()) };
    let error = run(&not_a_cluster, &Workload::named("A").unwrap()).await.unwrap_err();
    assert!(error.contains("CLUSTER SLOTS"), "{error}");
}

/// Workload E as YCSB's Redis binding runs it: inserts index each key in a
/// sorted set, scans read a range of it and then each record, over Redis and
/// over Tessera's sorted sets.
async fn scans(target: String) {
    let config = DriverConfig { records: 2_000, operations: 500, ..config(target.clone()) };
    let workload = Workload::named("E").unwrap();
    let loaded = load(&config, &workload).await.unwrap();
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    let report = run(&config, &workload).await.unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(report.latency["scan"].count > 400 && report.latency["insert"].count > 5);
    let mut client = Client::connect(target.as_str(), Duration::from_secs(5)).unwrap();
    let indexed = client.command(&["ZCARD", "_indices"]).unwrap().as_integer().unwrap();
    assert_eq!(indexed, 2_000 + report.latency["insert"].count as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_over_redis_and_tessera() {
    let Some(server) = RedisServer::start() else { return };
    scans(server.address()).await;
    let (node, _dir) = start_node();
    scans(node.local_addr().to_string()).await;
    node.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amplified_requests_count_once_and_write_each_key() {
    let Some(server) = RedisServer::start() else { return };
    let config = DriverConfig {
        records: 400,
        amplify: 4,
        record_kind: RecordKind::String,
        field_bytes: SizeRange { min: 10, max: 20 },
        key_bytes: Some(SizeRange::fixed(16)),
        ..config(server.address())
    };
    let loaded = load(&config, &Workload::named("W").unwrap()).await.unwrap();
    assert_eq!(loaded.operations, 100, "400 records in requests of 4 writes");
    let mut client = Client::connect(server.address().as_str(), Duration::from_secs(5)).unwrap();
    assert_eq!(client.command(&["DBSIZE"]).unwrap().as_integer(), Some(400));
    let value = client.command(&["GET", "user000000000399"]).unwrap();
    assert!((10..=20).contains(&value.as_bytes().unwrap().len()));
}

/// A real Redis Cluster (3 masters, 1 replica each): slot routing, eventual
/// reads from replicas, and MOVED / ASK followed while slots move mid-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_a_redis_cluster_through_resharding() {
    let Some(cluster) = RedisCluster::start(3, 1) else { return };
    let addresses = cluster.addresses();
    let config = DriverConfig {
        cluster: true,
        strong_reads: Some(0.5),
        records: 3_000,
        operations: 40_000,
        ..config(addresses[0].clone())
    };
    let workload = Workload::named("B").unwrap();
    let loaded = load(&config, &workload).await.unwrap();
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    // Redis lists a replica in CLUSTER SLOTS only once it has replicated data.
    let mut client = Client::connect(addresses[0].as_str(), Duration::from_secs(5)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !client
        .command(&["CLUSTER", "SLOTS"])
        .unwrap()
        .into_items()
        .unwrap()
        .iter()
        .all(|range| range.clone().into_items().is_some_and(|parts| parts.len() >= 4))
    {
        assert!(std::time::Instant::now() < deadline, "replicas never appeared in CLUSTER SLOTS");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Move slots between masters while the run goes on.
    let seed_node = addresses[0].clone();
    let reshard = std::thread::spawn(move || {
        let ids = std::process::Command::new("redis-cli")
            .args(["--cluster", "check", &seed_node])
            .output()
            .expect("redis-cli --cluster check");
        let text = String::from_utf8_lossy(&ids.stdout).into_owned();
        let masters: Vec<String> = text
            .lines()
            .filter(|line| line.starts_with("M: "))
            .filter_map(|line| line.split_whitespace().nth(1).map(String::from))
            .collect();
        std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &seed_node, "--cluster-from", &masters[0], "--cluster-to"])
            .args([&masters[1], "--cluster-slots", "300", "--cluster-yes", "--cluster-pipeline", "10"])
            .output()
            .expect("redis-cli --cluster reshard")
    });
    let report = run(&config, &workload).await.unwrap();
    let resharded = reshard.join().unwrap();
    assert!(resharded.status.success(), "{}", String::from_utf8_lossy(&resharded.stdout));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.operations, 40_000);
    let (strong, eventual) = (report.latency["read"].count, report.latency["read-eventual"].count);
    assert!(strong > 15_000 && eventual > 15_000, "strong {strong}, eventual {eventual}");
    // Replicas served the eventual reads.
    let mut served_by_replicas = 0;
    for address in &addresses {
        let mut client = Client::connect(address.as_str(), Duration::from_secs(5)).unwrap();
        let info = client.command(&["INFO", "replication"]).unwrap();
        let info = String::from_utf8_lossy(info.as_bytes().unwrap()).into_owned();
        if info.contains("role:slave") {
            let stats = client.command(&["INFO", "commandstats"]).unwrap();
            let stats = String::from_utf8_lossy(stats.as_bytes().unwrap()).into_owned();
            served_by_replicas += stats
                .lines()
                .find_map(|line| line.strip_prefix("cmdstat_hgetall:calls="))
                .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    assert!(served_by_replicas > 10_000, "replicas served {served_by_replicas} reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_holds_the_rate_and_times_from_the_schedule() {
    let Some(server) = RedisServer::start() else { return };
    let workload = Workload::named("B").unwrap();
    let mut config = config(server.address());
    load(&config, &workload).await.unwrap();
    config.target_rate = Some(4_000.0);
    config.duration = Some(Duration::from_secs(2));
    let report = run(&config, &workload).await.unwrap();
    // 2 s at 4,000 ops/s: about 8,000 operations, not as many as possible.
    assert!((7_000..=8_700).contains(&report.operations), "{} operations", report.operations);
    assert!(report.errors.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn string_records_use_get_and_set() {
    let Some(server) = RedisServer::start() else { return };
    let config = DriverConfig {
        record_kind: RecordKind::String,
        field_bytes: SizeRange::fixed(3),
        ..config(server.address())
    };
    let workload = Workload::named("A").unwrap();
    load(&config, &workload).await.unwrap();
    let report = run(&config, &workload).await.unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let mut client = Client::connect(server.address().as_str(), Duration::from_secs(5)).unwrap();
    let value = client.command(&["GET", "user7"]).unwrap();
    assert_eq!(value.as_bytes().map(<[u8]>::len), Some(3));
}
