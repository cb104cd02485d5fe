//! get / put per engine: 16-byte keys, 100-byte values, over 100k keys.
//! `cargo bench -p tessera-engine`; the `redis` engine runs when redis-server is installed.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use tessera_engine::{Engine, EngineKind, EngineSpec};
use tessera_testkit::RedisServer;

const KEYS: u64 = 100_000;

/// The keys, made before timing starts so that the loop measures the engine.
fn keys() -> Vec<[u8; 16]> {
    (0..KEYS)
        .map(|index| {
            let mut key = *b"key:000000000000";
            key[4..].copy_from_slice(format!("{index:012}").as_bytes());
            key
        })
        .collect()
}

fn open(kind: EngineKind, options: &[(&str, &str)], dir: &Path) -> Arc<dyn Engine> {
    let options: BTreeMap<String, String> =
        options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    EngineSpec::new(kind, options).unwrap().open(dir).unwrap()
}

fn bench_engine(c: &mut Criterion, name: &str, engine: Arc<dyn Engine>) {
    let value = Bytes::from(vec![b'v'; 100]);
    let keys = keys();
    for key in &keys {
        engine.put(key, value.clone()).unwrap();
    }
    let mut group = c.benchmark_group(name);
    let mut next = 0u64;
    group.bench_function("get", |b| {
        b.iter(|| {
            next = (next + 7919) % KEYS;
            engine.get(&keys[next as usize]).unwrap()
        })
    });
    group.bench_function("put", |b| {
        b.iter_batched(
            || {
                next = (next + 7919) % KEYS;
                keys[next as usize]
            },
            |key| engine.put(&key, value.clone()).unwrap(),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn engines(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    bench_engine(c, "memory", open(EngineKind::Memory, &[], dir.path()));
    bench_engine(c, "ordered", open(EngineKind::Ordered, &[], dir.path()));
    bench_engine(c, "log", open(EngineKind::Log, &[("fsync", "everysec")], &dir.path().join("log")));
    bench_engine(c, "lsm", open(EngineKind::Lsm, &[("fsync", "everysec")], &dir.path().join("lsm")));
    if let Some(server) = RedisServer::start() {
        bench_engine(c, "redis", open(EngineKind::Redis, &[("addr", &server.address())], dir.path()));
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = engines
}
criterion_main!(benches);
