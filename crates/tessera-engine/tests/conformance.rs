//! One conformance suite, run against every engine. The model is a BTreeMap.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tessera_engine::{
    Engine, EngineKind, EngineSpec, FsyncPolicy, KeyRange, LogEngine, LogOptions, ScanCursor,
};
use tessera_testkit::RedisServer;

/// Opens an engine, on the given directory for persistent ones.
type Opener = Box<dyn Fn(Option<&PathBuf>) -> Arc<dyn Engine>>;

/// An engine under test, and how to open it again on the same data.
struct Subject {
    name: &'static str,
    dir: Option<tempfile::TempDir>,
    open: Opener,
    _server: Option<RedisServer>,
}

impl Subject {
    fn open(&self) -> Arc<dyn Engine> {
        (self.open)(self.dir.as_ref().map(|dir| dir.path().to_path_buf()).as_ref())
    }

    fn persistent(&self) -> bool {
        self.dir.is_some()
    }
}

fn spec(kind: EngineKind, options: &[(&str, &str)]) -> EngineSpec {
    let options = options.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect();
    EngineSpec::new(kind, options).expect("valid spec")
}

fn subjects() -> Vec<Subject> {
    let mut subjects = vec![
        Subject {
            name: "memory",
            dir: None,
            open: Box::new(|_| spec(EngineKind::Memory, &[]).open(&PathBuf::new()).unwrap()),
            _server: None,
        },
        Subject {
            name: "ordered",
            dir: None,
            open: Box::new(|_| spec(EngineKind::Ordered, &[]).open(&PathBuf::new()).unwrap()),
            _server: None,
        },
        Subject {
            name: "log",
            dir: Some(tempfile::tempdir().unwrap()),
            // Small segments so that tests cross segment boundaries.
            open: Box::new(|dir| {
                spec(EngineKind::Log, &[("fsync", "never"), ("segment-bytes", "4096")])
                    .open(dir.unwrap())
                    .unwrap()
            }),
            _server: None,
        },
        Subject {
            name: "lsm",
            dir: Some(tempfile::tempdir().unwrap()),
            open: Box::new(|dir| spec(EngineKind::Lsm, &[("fsync", "never")]).open(dir.unwrap()).unwrap()),
            _server: None,
        },
        Subject {
            name: "hybrid",
            dir: Some(tempfile::tempdir().unwrap()),
            // A budget of 256 MiB holds the 64 MiB value; the tests of the
            // hybrid engine's own (tests/hybrid.rs) use small budgets.
            open: Box::new(|dir| {
                spec(EngineKind::Hybrid, &[("fsync", "never"), ("memory-bytes", "256mb")])
                    .open(dir.unwrap())
                    .unwrap()
            }),
            _server: None,
        },
    ];
    if let Some(server) = RedisServer::start() {
        let address = server.address();
        subjects.push(Subject {
            name: "redis",
            dir: None,
            open: Box::new(move |_| {
                spec(EngineKind::Redis, &[("addr", &address), ("owns-database", "yes")])
                    .open(&PathBuf::new())
                    .unwrap()
            }),
            _server: Some(server),
        });
    }
    subjects
}

/// Every entry of the engine, by draining scans of `page` entries.
fn scan_all(engine: &dyn Engine, range: &KeyRange, page: usize) -> Vec<(Bytes, Bytes)> {
    let mut cursor = ScanCursor::start();
    let mut all = Vec::new();
    loop {
        let result = engine.scan(range, &cursor, page).unwrap();
        all.extend(result.entries);
        match result.next {
            Some(next) => cursor = next,
            None => return all,
        }
    }
}

fn assert_matches_model(engine: &dyn Engine, model: &BTreeMap<Vec<u8>, Vec<u8>>, context: &str) {
    let mut scanned = scan_all(engine, &KeyRange::all(), 3);
    if engine.capabilities().ordered {
        let keys: Vec<_> = scanned.iter().map(|(key, _)| key.clone()).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted, "{context}: ordered engine scanned out of order");
    }
    scanned.sort();
    let expected: Vec<_> =
        model.iter().map(|(key, value)| (Bytes::from(key.clone()), Bytes::from(value.clone()))).collect();
    assert_eq!(scanned, expected, "{context}: scan differs from the model");
    assert_eq!(engine.len().unwrap(), model.len() as u64, "{context}: len");
    for (key, value) in model {
        assert_eq!(engine.get(key).unwrap().as_deref(), Some(value.as_slice()), "{context}: get");
    }
    // A batch of every key, each followed by one that is absent, in more
    // than one of the hybrid engine's batches.
    let absent: Vec<Vec<u8>> = model.keys().map(|key| [key.as_slice(), b"\xffabsent"].concat()).collect();
    let keys: Vec<&[u8]> =
        model.keys().zip(&absent).flat_map(|(key, absent)| [&key[..], &absent[..]]).collect();
    let expected: Vec<Option<Bytes>> =
        model.values().flat_map(|value| [Some(Bytes::from(value.clone())), None]).collect();
    let mut batched = vec![None; keys.len()];
    engine.get_many_with(&keys, &mut |at, value| batched[at] = value.map(Bytes::copy_from_slice)).unwrap();
    assert_eq!(batched, expected, "{context}: get_many_with");
    assert_eq!(engine.get_many(&keys).unwrap(), expected, "{context}: get_many");
}

#[derive(Clone, Debug)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    Get(Vec<u8>),
    Update(Vec<u8>, Edit),
    Scan(Option<Vec<u8>>, Option<Vec<u8>>),
    /// Close and open again (persistent engines only).
    Reopen,
    Clear,
}

/// What an `update` does to the value it is handed.
#[derive(Clone, Debug)]
enum Edit {
    /// Appends, creating the value when absent.
    Append(Vec<u8>),
    /// Drops the first byte in place, or replaces a missing value with nothing.
    DropFirst,
    /// Changes every byte, keeping the length (an edit that fits where the
    /// value lies), or replaces a missing value with nothing.
    Flip,
    Remove,
    /// Reads and reports no change.
    Leave,
}

impl Edit {
    /// Applies the edit as `update`'s closure would; returns whether it changed anything.
    fn apply(&self, value: &mut Option<Vec<u8>>) -> bool {
        match self {
            Edit::Append(tail) => value.get_or_insert_with(Vec::new).extend_from_slice(tail),
            Edit::DropFirst => match value {
                Some(bytes) if !bytes.is_empty() => drop(bytes.remove(0)),
                _ => *value = Some(Vec::new()),
            },
            Edit::Flip => value.get_or_insert_with(Vec::new).iter_mut().for_each(|byte| *byte ^= 0x5a),
            Edit::Remove => *value = None,
            Edit::Leave => return false,
        }
        true
    }
}

fn edit_strategy() -> impl Strategy<Value = Edit> {
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..24).prop_map(Edit::Append),
        // Past the size at which `memory` shares a value rather than copy it.
        1 => proptest::collection::vec(any::<u8>(), 500..700).prop_map(Edit::Append),
        1 => Just(Edit::DropFirst),
        2 => Just(Edit::Flip),
        1 => Just(Edit::Remove),
        1 => Just(Edit::Leave),
    ]
}

fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    // A small key space, so that operations meet on the same keys; binary and
    // empty keys included.
    prop_oneof![
        Just(Vec::new()),
        Just(vec![0u8]),
        Just(vec![0xff, 0x00, 0x7f]),
        (0u8..24).prop_map(|n| format!("key:{n}").into_bytes()),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (key_strategy(), proptest::collection::vec(any::<u8>(), 0..48)).prop_map(|(k, v)| Op::Put(k, v)),
        2 => key_strategy().prop_map(Op::Delete),
        2 => key_strategy().prop_map(Op::Get),
        3 => (key_strategy(), edit_strategy()).prop_map(|(k, edit)| Op::Update(k, edit)),
        1 => (proptest::option::of(key_strategy()), proptest::option::of(key_strategy()))
            .prop_map(|(start, end)| Op::Scan(start, end)),
        1 => Just(Op::Reopen),
        1 => Just(Op::Clear),
    ]
}

#[test]
fn every_engine_behaves_like_a_btreemap() {
    for subject in subjects() {
        let mut runner =
            TestRunner::new(Config { cases: 48, failure_persistence: None, ..Config::default() });
        let result = runner.run(&proptest::collection::vec(op_strategy(), 1..80), |ops| {
            let mut engine = subject.open();
            engine.clear().unwrap();
            let mut model = BTreeMap::new();
            for op in &ops {
                match op {
                    Op::Put(key, value) => {
                        engine.put(key, Bytes::from(value.clone())).unwrap();
                        model.insert(key.clone(), value.clone());
                    }
                    Op::Delete(key) => {
                        let existed = engine.delete(key).unwrap();
                        prop_assert_eq!(existed, model.remove(key).is_some(), "delete's answer");
                    }
                    Op::Get(key) => {
                        let got = engine.get(key).unwrap();
                        prop_assert_eq!(got.as_deref(), model.get(key).map(Vec::as_slice));
                    }
                    Op::Update(key, edit) => {
                        let before = model.get(key).cloned();
                        let mut handed = None;
                        engine
                            .update(key, &mut |value| {
                                handed = Some(value.clone());
                                edit.apply(value)
                            })
                            .unwrap();
                        prop_assert_eq!(handed, Some(before.clone()), "update is handed the value");
                        let mut expected = before;
                        edit.apply(&mut expected);
                        match expected {
                            Some(value) => model.insert(key.clone(), value),
                            None => model.remove(key),
                        };
                    }
                    Op::Scan(start, end) => {
                        let range = KeyRange {
                            start: start.clone().map(Bytes::from),
                            end: end.clone().map(Bytes::from),
                        };
                        let mut got = scan_all(engine.as_ref(), &range, 2);
                        got.sort();
                        let expected: Vec<_> = model
                            .iter()
                            .filter(|(key, _)| range.contains(key))
                            .map(|(key, value)| (Bytes::from(key.clone()), Bytes::from(value.clone())))
                            .collect();
                        prop_assert_eq!(got, expected);
                    }
                    Op::Reopen => {
                        if subject.persistent() {
                            engine.flush().unwrap();
                            drop(engine);
                            engine = subject.open();
                        }
                    }
                    Op::Clear => {
                        engine.clear().unwrap();
                        model.clear();
                    }
                }
            }
            assert_matches_model(engine.as_ref(), &model, subject.name);
            Ok(())
        });
        if let Err(error) = result {
            panic!("engine {}: {error}", subject.name);
        }
    }
}

#[test]
fn empty_binary_and_large_values_round_trip() {
    let one_mib = Bytes::from((0..1 << 20).map(|i| (i * 7) as u8).collect::<Vec<u8>>());
    let sixty_four_mib = Bytes::from(vec![0xabu8; 64 << 20]);
    let every_byte: Vec<u8> = (0..=255u8).collect();
    for subject in subjects() {
        let engine = subject.open();
        engine.clear().unwrap();
        engine.put(b"", Bytes::new()).unwrap();
        engine.put(&every_byte, Bytes::from(every_byte.clone())).unwrap();
        engine.put(b"one-mib", one_mib.clone()).unwrap();
        engine.put(b"sixty-four-mib", sixty_four_mib.clone()).unwrap();
        let check = |engine: &dyn Engine| {
            assert_eq!(engine.get(b"").unwrap().as_deref(), Some(&b""[..]), "{}: empty key", subject.name);
            assert_eq!(
                engine.get(&every_byte).unwrap().as_deref(),
                Some(every_byte.as_slice()),
                "{}",
                subject.name
            );
            assert!(
                engine.get(b"one-mib").unwrap() == Some(one_mib.clone()),
                "{}: 1 MiB value",
                subject.name
            );
            assert!(
                engine.get(b"sixty-four-mib").unwrap() == Some(sixty_four_mib.clone()),
                "{}: 64 MiB value",
                subject.name
            );
        };
        check(engine.as_ref());
        if subject.persistent() {
            engine.flush().unwrap();
            drop(engine);
            check(subject.open().as_ref());
        }
    }
}

#[test]
fn scans_return_each_key_once_and_survive_concurrent_writes() {
    for subject in subjects() {
        let engine = subject.open();
        engine.clear().unwrap();
        let stable: BTreeSet<Vec<u8>> = (0..3000).map(|i| format!("stable:{i:05}").into_bytes()).collect();
        for key in &stable {
            engine.put(key, Bytes::from_static(b"v")).unwrap();
        }
        let writer_engine = engine.clone();
        let writer = std::thread::spawn(move || {
            for i in 0..3000 {
                let key = format!("churn:{i:05}");
                writer_engine.put(key.as_bytes(), Bytes::from_static(b"w")).unwrap();
                if i % 3 == 0 {
                    writer_engine.delete(key.as_bytes()).unwrap();
                }
            }
        });
        let scanned = scan_all(engine.as_ref(), &KeyRange::all(), 17);
        writer.join().unwrap();
        let stable_seen: Vec<_> = scanned.iter().filter(|(key, _)| key.starts_with(b"stable:")).collect();
        let distinct: BTreeSet<_> = stable_seen.iter().map(|(key, _)| key.to_vec()).collect();
        assert_eq!(distinct, stable, "{}: a key present for the whole scan was missed", subject.name);
        if subject.name != "redis" {
            // Redis's SCAN may repeat keys when its table is resized; ours must not.
            assert_eq!(stable_seen.len(), stable.len(), "{}: a key was returned twice", subject.name);
        }
    }
}

#[test]
fn failed_scan_cursor_is_an_error_not_a_panic() {
    for subject in subjects() {
        let engine = subject.open();
        let result = engine.scan(&KeyRange::all(), &ScanCursor(Bytes::from_static(b"\xff\xff\xff")), 10);
        if engine.capabilities().ordered {
            // An ordered engine's cursor is a key: any bytes are a valid place to resume.
            assert!(result.is_ok(), "{}: {:?}", subject.name, result.err());
        } else {
            assert!(result.is_err(), "{}: a garbage cursor was accepted", subject.name);
        }
    }
}

// ---- the log engine's crash recovery and compaction ----

fn log_options() -> LogOptions {
    LogOptions { fsync: FsyncPolicy::Never, segment_bytes_max: 1 << 30, ..LogOptions::default() }
}

fn segment_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "seg"))
        .collect();
    files.sort();
    files
}

#[test]
fn log_recovery_keeps_every_whole_record_after_truncation_anywhere() {
    // Writes go to one segment; after truncating it at an offset, the engine
    // must hold exactly the writes whose records ended before that offset.
    let dir = tempfile::tempdir().unwrap();
    let mut states = vec![(0u64, BTreeMap::new())];
    {
        let engine = LogEngine::open(dir.path(), log_options()).unwrap();
        let mut model = BTreeMap::new();
        for i in 0..200u32 {
            let key = format!("k{}", i % 37).into_bytes();
            if i % 5 == 4 {
                engine.delete(&key).unwrap();
                model.remove(&key);
            } else {
                let value = vec![i as u8; (i as usize * 13) % 300];
                engine.put(&key, Bytes::from(value.clone())).unwrap();
                model.insert(key, value);
            }
            let size = std::fs::metadata(segment_files(dir.path()).last().unwrap()).unwrap().len();
            if states.last().unwrap().0 != size {
                states.push((size, model.clone()));
            }
        }
    }
    let original = std::fs::read(segment_files(dir.path()).last().unwrap()).unwrap();
    let mut runner = TestRunner::new(Config { cases: 64, failure_persistence: None, ..Config::default() });
    runner
        .run(&(0..=original.len()), |cut| {
            let copy = tempfile::tempdir().unwrap();
            std::fs::write(copy.path().join("00000000000000000000.seg"), &original[..cut]).unwrap();
            let engine = LogEngine::open(copy.path(), log_options()).unwrap();
            let expected = &states.iter().rev().find(|(size, _)| *size <= cut as u64).unwrap().1;
            assert_matches_model(&engine, expected, &format!("truncated at {cut}"));
            // The torn tail is gone: new writes land after the good records.
            engine.put(b"after", Bytes::from_static(b"crash")).unwrap();
            drop(engine);
            let engine = LogEngine::open(copy.path(), log_options()).unwrap();
            let after = engine.get(b"after").unwrap();
            prop_assert_eq!(after.as_deref(), Some(&b"crash"[..]));
            Ok(())
        })
        .unwrap();
}

#[test]
fn log_recovery_never_returns_garbage_from_a_corrupt_tail() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = LogEngine::open(dir.path(), log_options()).unwrap();
        engine.put(b"a", Bytes::from_static(b"first")).unwrap();
        engine.put(b"b", Bytes::from_static(b"second")).unwrap();
    }
    let path = segment_files(dir.path()).pop().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 0x55; // flip bits inside the last record's value
    std::fs::write(&path, &bytes).unwrap();
    let engine = LogEngine::open(dir.path(), log_options()).unwrap();
    assert_eq!(engine.get(b"a").unwrap().as_deref(), Some(&b"first"[..]));
    assert_eq!(engine.get(b"b").unwrap(), None);
}

#[test]
fn log_keeps_acknowledged_records_after_damage_in_the_middle_of_the_newest_segment() {
    let dir = tempfile::tempdir().unwrap();
    {
        let options = LogOptions { fsync: FsyncPolicy::Always, ..log_options() };
        let engine = LogEngine::open(dir.path(), options).unwrap();
        for i in 0..100u32 {
            engine.put(format!("k{i}").as_bytes(), Bytes::from(format!("value {i}"))).unwrap();
        }
    }
    let path = segment_files(dir.path()).pop().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40; // one flipped bit: one record is bad, fifty good ones follow
    std::fs::write(&path, &bytes).unwrap();

    let error =
        LogEngine::open(dir.path(), log_options()).err().expect("damage before good records is refused");
    let message = error.to_string();
    assert!(
        message.contains(&path.display().to_string()) && message.contains("good records after it"),
        "{message}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "a refused log is left as it was");

    let repairs = tessera_engine::repair_log(dir.path()).unwrap();
    assert_eq!(repairs.len(), 1, "{repairs:?}");
    assert_eq!(repairs[0].records_kept, 99);
    assert_eq!(repairs[0].damaged.len(), 1);
    let engine = LogEngine::open(dir.path(), log_options()).unwrap();
    let missing: Vec<u32> =
        (0..100).filter(|i| engine.get(format!("k{i}").as_bytes()).unwrap().is_none()).collect();
    assert_eq!(missing.len(), 1, "only the damaged record is lost: {missing:?}");
    for i in (0..100u32).filter(|i| !missing.contains(i)) {
        assert_eq!(engine.get(format!("k{i}").as_bytes()).unwrap(), Some(Bytes::from(format!("value {i}"))));
    }
    assert!(tessera_engine::repair_log(dir.path()).unwrap().is_empty(), "nothing left to repair");
}

#[test]
fn log_refuses_to_open_over_a_corrupt_sealed_segment() {
    let dir = tempfile::tempdir().unwrap();
    {
        let options = LogOptions { segment_bytes_max: 64, ..log_options() };
        let engine = LogEngine::open(dir.path(), options).unwrap();
        for i in 0..10u8 {
            engine.put(&[i], Bytes::from(vec![i; 40])).unwrap();
        }
    }
    let first = segment_files(dir.path()).remove(0);
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[20] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();
    let error = LogEngine::open(dir.path(), log_options()).err().expect("corruption must be reported");
    assert!(error.to_string().contains("corrupt"), "{error}");
    let repairs = tessera_engine::repair_log(dir.path()).unwrap();
    assert_eq!(repairs.len(), 1, "only the damaged segment is rewritten: {repairs:?}");
    let engine = LogEngine::open(dir.path(), log_options()).unwrap();
    let kept = (0..10u8).filter(|i| engine.get(&[*i]).unwrap() == Some(Bytes::from(vec![*i; 40]))).count();
    assert_eq!(kept, 9, "every record but the damaged one");
}

#[test]
fn log_compaction_reclaims_space_while_readers_and_writers_run() {
    let dir = tempfile::tempdir().unwrap();
    let options = LogOptions { segment_bytes_max: 16 << 10, ..log_options() };
    let engine = Arc::new(LogEngine::open(dir.path(), options.clone()).unwrap());
    for round in 0..20u32 {
        for key in 0..100u32 {
            engine
                .put(format!("k{key}").as_bytes(), Bytes::from(format!("{round}:{key}").repeat(10)))
                .unwrap();
        }
    }
    let (_, dead_before) = engine.space();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for key in 0..100u32 {
                    let value = engine.get(format!("k{key}").as_bytes()).unwrap().expect("key never deleted");
                    assert!(value.ends_with(format!(":{key}").as_bytes()));
                }
            }
        })
    };
    let writer = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            for key in 0..100u32 {
                engine.put(format!("k{key}").as_bytes(), Bytes::from(format!("final:{key}"))).unwrap();
            }
        })
    };
    engine.compact().unwrap();
    writer.join().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    let (_, dead_after) = engine.space();
    assert!(dead_after < dead_before / 4, "compaction left {dead_after} of {dead_before} dead bytes");
    let expected: BTreeMap<Vec<u8>, Vec<u8>> = (0..100u32)
        .map(|key| (format!("k{key}").into_bytes(), format!("final:{key}").into_bytes()))
        .collect();
    assert_matches_model(engine.as_ref(), &expected, "after compaction");
    drop(engine);
    let reopened = LogEngine::open(dir.path(), options).unwrap();
    assert_matches_model(&reopened, &expected, "reopened after compaction");
}

#[test]
fn log_recovers_when_a_crash_interrupts_compaction() {
    // A crash after the merged segment was renamed into place but before its
    // inputs were deleted leaves both; replay must give the same answer.
    let dir = tempfile::tempdir().unwrap();
    let kept = tempfile::tempdir().unwrap();
    let engine = LogEngine::open(dir.path(), log_options()).unwrap();
    for i in 0..50u32 {
        engine.put(format!("k{}", i % 10).as_bytes(), Bytes::from(i.to_string())).unwrap();
    }
    engine.delete(b"k3").unwrap();
    for path in segment_files(dir.path()) {
        std::fs::copy(&path, kept.path().join(path.file_name().unwrap())).unwrap();
    }
    engine.compact().unwrap();
    engine.put(b"k4", Bytes::from_static(b"after")).unwrap();
    drop(engine);
    for path in segment_files(kept.path()) {
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let engine = LogEngine::open(dir.path(), log_options()).unwrap();
    let mut expected: BTreeMap<Vec<u8>, Vec<u8>> =
        (40..50u32).map(|i| (format!("k{}", i % 10).into_bytes(), i.to_string().into_bytes())).collect();
    expected.remove(b"k3".as_slice());
    expected.insert(b"k4".to_vec(), b"after".to_vec());
    assert_matches_model(&engine, &expected, "old segments resurrected");
}

#[test]
fn lsm_recovery_after_journal_truncation_keeps_a_prefix() {
    // fjall's journal is its write-ahead log; cutting it anywhere must leave a
    // prefix of the writes and never garbage.
    let dir = tempfile::tempdir().unwrap();
    let writes: Vec<(Vec<u8>, Vec<u8>)> =
        (0..300u32).map(|i| (format!("k{:03}", i % 50).into_bytes(), format!("v{i}").into_bytes())).collect();
    {
        let engine = spec(EngineKind::Lsm, &[("fsync", "always")]).open(dir.path()).unwrap();
        for (key, value) in &writes {
            engine.put(key, Bytes::from(value.clone())).unwrap();
        }
    }
    let journal = walk(dir.path())
        .into_iter()
        .filter(|path| {
            path.to_string_lossy().contains("journal") || path.extension().is_some_and(|e| e == "jnl")
        })
        .max_by_key(|path| std::fs::metadata(path).map(|m| m.len()).unwrap_or(0))
        .expect("a journal file");
    let original = std::fs::read(&journal).unwrap();
    for cut in [original.len() / 3, original.len() / 2, original.len() - 7] {
        let copy = tempfile::tempdir().unwrap();
        copy_tree(dir.path(), copy.path());
        let copied_journal = copy.path().join(journal.strip_prefix(dir.path()).unwrap());
        std::fs::write(&copied_journal, &original[..cut]).unwrap();
        let engine = spec(EngineKind::Lsm, &[("fsync", "never")]).open(copy.path()).unwrap();
        let recovered: BTreeMap<Vec<u8>, Vec<u8>> = scan_all(engine.as_ref(), &KeyRange::all(), 100)
            .into_iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        let is_prefix = (0..=writes.len()).any(|n| {
            let mut model = BTreeMap::new();
            for (key, value) in &writes[..n] {
                model.insert(key.clone(), value.clone());
            }
            model == recovered
        });
        assert!(is_prefix, "cut at {cut}: recovered state is not a prefix of the writes");
    }
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    for path in walk(from) {
        let target = to.join(path.strip_prefix(from).unwrap());
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::copy(&path, &target).unwrap();
    }
}
