//! The driver against a real Redis and a real Tessera node, with few records.

use std::time::Duration;

use tessera_bench::driver::{load, run, DriverConfig, RecordKind};
use tessera_bench::workload::{Mix, Workload};
use tessera_testkit::RedisServer;
use tessera_wire::{Client, Value};

fn config(target: String) -> DriverConfig {
    DriverConfig {
        targets: vec![target],
        connections: 4,
        pipeline: 8,
        records: 500,
        operations: 4_000,
        record_kind: RecordKind::Hash,
        fields: 10,
        field_bytes: 100,
        seed: 1,
        password: None,
        connect_timeout: Duration::from_secs(5),
        target_rate: None,
        duration: None,
        progress: false,
    }
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
    let dir = tempfile::tempdir().unwrap();
    let node_config = tessera_node::Config {
        port: 0,
        dir: dir.path().to_path_buf(),
        threads: 1,
        ..tessera_node::Config::default()
    };
    let server = tessera_node::Server::start(node_config).unwrap();
    load_and_run(server.local_addr().to_string()).await;
    let mix = Workload { mix: Mix::parse("read=0.5,rmw=0.5").unwrap(), ..Workload::named("F").unwrap() };
    let report = run(&config(server.local_addr().to_string()), &mix).await.unwrap();
    assert!(report.latency["rmw"].count > 1_000 && report.errors.is_empty());
    server.shutdown();
}

#[tokio::test]
async fn unreachable_targets_and_scans_are_clear_errors() {
    let mut unreachable = config(format!("127.0.0.1:{}", tessera_testkit::free_port()));
    unreachable.connect_timeout = Duration::from_secs(2);
    let error = run(&unreachable, &Workload::named("A").unwrap()).await.unwrap_err();
    assert!(error.contains("cannot connect"), "{error}");
    let error = run(&unreachable, &Workload::named("E").unwrap()).await.unwrap_err();
    assert!(error.contains("scans"), "{error}");
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
    let config = DriverConfig { record_kind: RecordKind::String, field_bytes: 3, ..config(server.address()) };
    let workload = Workload::named("A").unwrap();
    load(&config, &workload).await.unwrap();
    let report = run(&config, &workload).await.unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let mut client = Client::connect(server.address().as_str(), Duration::from_secs(5)).unwrap();
    let value = client.command(&["GET", "user7"]).unwrap();
    assert_eq!(value.as_bytes().map(<[u8]>::len), Some(3));
}
