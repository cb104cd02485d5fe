//! The client workload of tests/clients (see README.md there) through
//! redis-rs's cluster client: `redis-rs-workload nodes seconds prefix`. Each
//! key keeps the values it may hold: those of its writes since the last one
//! known to have taken effect (a write that failed may have); a read outside
//! them is a violation, and so is a counter outside its bounds.

use std::collections::{BTreeSet, HashMap};
use std::process::exit;
use std::thread::sleep;
use std::time::{Duration, Instant};

use rand::Rng;
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{Commands, RedisResult};

const KEYS: usize = 40;

/// What a key or field may hold (`None`: nothing).
type Possible = BTreeSet<Option<String>>;

fn only(value: Option<String>) -> Possible {
    BTreeSet::from([value])
}

fn fail(message: String) -> ! {
    eprintln!("redis-rs: {message}");
    exit(1)
}

/// A connection, opened again after an error: redis-rs's cluster
/// connection reads the slot map again on MOVED, and a new one reads it
/// from the nodes it was given.
struct Session {
    client: ClusterClient,
    connection: Option<ClusterConnection>,
}

impl Session {
    fn run<T>(&mut self, command: impl FnOnce(&mut ClusterConnection) -> RedisResult<T>) -> RedisResult<T> {
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => self.connection.insert(self.client.get_connection()?),
        };
        let result = command(connection);
        if result.is_err() {
            self.connection = None;
        }
        result
    }

    /// Until the command succeeds, for up to `settle`.
    fn retry<T>(
        &mut self,
        settle: Instant,
        mut command: impl FnMut(&mut ClusterConnection) -> RedisResult<T>,
    ) -> T {
        loop {
            match self.run(&mut command) {
                Ok(value) => return value,
                Err(error) if Instant::now() > settle => fail(format!("reading back: {error}")),
                Err(_) => sleep(Duration::from_millis(100)),
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes: Vec<String> = args
        .get(1)
        .map_or("127.0.0.1:7001", String::as_str)
        .split(',')
        .map(|address| format!("redis://{address}"))
        .collect();
    let seconds: f64 = args.get(2).map_or(Ok(8.0), |text| text.parse()).expect("seconds");
    let prefix = args.get(3).cloned().unwrap_or_else(|| "redis-rs".into());
    let client = ClusterClient::builder(nodes)
        .connection_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .retries(5)
        .build()
        .expect("cluster client");
    let mut session = Session { client, connection: None };

    let mut values: Vec<Possible> = (0..KEYS).map(|_| only(None)).collect();
    let mut fields: HashMap<String, Possible> = HashMap::new();
    let counter = format!("{prefix}:counter");
    let hash = format!("{prefix}:hash");
    let (mut counter_low, mut counter_high) = (0i64, 0i64);
    let (mut ops, mut failures) = (0u64, 0u64);
    let mut random = rand::thread_rng();

    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut sequence = 0u64;
    while Instant::now() < deadline {
        sequence += 1;
        let i = random.gen_range(0..KEYS);
        let key = format!("{prefix}:k:{i}");
        let value = sequence.to_string();
        let outcome: RedisResult<()> = match random.gen_range(0..10) {
            0..=3 => {
                values[i].insert(Some(value.clone()));
                session.run(|connection| connection.set::<_, _, ()>(&key, &value)).map(|()| {
                    values[i] = only(Some(value.clone()));
                })
            }
            4..=7 => session.run(|connection| connection.get::<_, Option<String>>(&key)).map(|got| {
                if !values[i].contains(&got) {
                    fail(format!("GET {key} = {got:?}, not one of {:?}", values[i]));
                }
                values[i] = only(got);
            }),
            8 => {
                counter_high += 1;
                session.run(|connection| connection.incr::<_, _, i64>(&counter, 1)).map(|got| {
                    if got < counter_low + 1 || got > counter_high {
                        fail(format!(
                            "INCR {counter} = {got}, not within [{}, {counter_high}]",
                            counter_low + 1
                        ));
                    }
                    (counter_low, counter_high) = (got, got);
                })
            }
            _ => {
                let field = (i % 8).to_string();
                fields.entry(field.clone()).or_insert_with(|| only(None)).insert(Some(value.clone()));
                session.run(|connection| connection.hset::<_, _, _, ()>(&hash, &field, &value)).map(|()| {
                    fields.insert(field, only(Some(value.clone())));
                })
            }
        };
        ops += 1;
        if outcome.is_err() {
            failures += 1;
            sleep(Duration::from_millis(20));
        }
    }

    // Everything read back once the cluster has settled, errors retried a while.
    let settle = Instant::now() + Duration::from_secs(20);
    for (i, possible) in values.iter().enumerate() {
        let key = format!("{prefix}:k:{i}");
        let got: Option<String> = session.retry(settle, |connection| connection.get(&key));
        if !possible.contains(&got) {
            fail(format!("at the end GET {key} = {got:?}, not one of {possible:?}"));
        }
    }
    let total: Option<i64> = session.retry(settle, |connection| connection.get(&counter));
    let total = total.unwrap_or(0);
    if total < counter_low || total > counter_high {
        fail(format!("at the end {counter} = {total}, not within [{counter_low}, {counter_high}]"));
    }
    let stored: HashMap<String, String> = session.retry(settle, |connection| connection.hgetall(&hash));
    for (field, possible) in &fields {
        let got = stored.get(field).cloned();
        if !possible.contains(&got) {
            fail(format!("at the end HGET {hash} {field} = {got:?}, not one of {possible:?}"));
        }
    }
    println!("{{\"client\":\"redis-rs\",\"ops\":{ops},\"errors\":{failures}}}");
}
