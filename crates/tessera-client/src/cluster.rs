//! A Redis Cluster client: commands go to the node serving their key's slot,
//! by a map read from CLUSTER SLOTS and corrected by MOVED. Tessera's nodes
//! answer as Redis Cluster's do, so this serves both.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tessera_wire::Value;

use crate::slots::{Redirect, SlotMap};
use crate::{answered, bulk_or_nil, cmd, leveled, Command, Error, Level, Options, Server};

/// How many times a command is sent (redirections and refusals included)
/// before its last error is returned.
const ATTEMPTS: usize = 16;

/// The wait after a refusal or a lost node, growing with each attempt.
fn backoff(attempt: usize) -> Duration {
    Duration::from_millis((10u64 << attempt.min(5)).min(250))
}

struct Shared {
    options: Options,
    /// The nodes first given, asked for the map when the known ones fail.
    seeds: Vec<String>,
    map: RwLock<SlotMap>,
    servers: Mutex<HashMap<String, Arc<Server>>>,
}

/// A client of a whole cluster. Cheap to clone; clones share connections
/// and the slot map.
#[derive(Clone)]
pub struct ClusterClient {
    shared: Arc<Shared>,
}

impl ClusterClient {
    /// Reads the slot map from the first of `seeds` that answers.
    pub async fn connect(seeds: &[&str], options: Options) -> Result<Self, Error> {
        let map = SlotMap { addresses: Vec::new(), master: Vec::new(), replica: Vec::new() };
        let client = Self {
            shared: Arc::new(Shared {
                options,
                seeds: seeds.iter().map(|seed| seed.to_string()).collect(),
                map: RwLock::new(map),
                servers: Mutex::default(),
            }),
        };
        client.refresh(None).await?;
        Ok(client)
    }

    fn server(&self, address: &str) -> Arc<Server> {
        let mut servers = self.shared.servers.lock().expect("the servers");
        servers
            .entry(address.to_string())
            .or_insert_with(|| Arc::new(Server::new(address.to_string(), self.shared.options.clone())))
            .clone()
    }

    /// Reads the map again from a node other than `failed`, known ones first.
    async fn refresh(&self, failed: Option<&str>) -> Result<(), Error> {
        let known = self.shared.map.read().expect("the slot map").addresses.clone();
        let mut last = Error::NotSent("no node to ask for the slot map".into());
        for address in
            known.iter().chain(&self.shared.seeds).filter(|address| Some(address.as_str()) != failed)
        {
            let asked =
                async { self.server(address).connection().await?.request(&["CLUSTER", "SLOTS"]).await };
            match asked.await.and_then(answered) {
                Ok(reply) => {
                    let map = SlotMap::from_cluster_slots(&reply).map_err(Error::Protocol)?;
                    *self.shared.map.write().expect("the slot map") = map;
                    return Ok(());
                }
                Err(error) => last = error,
            }
        }
        Err(last)
    }

    /// The node serving `slot`, or any node for a command of no key.
    fn address(&self, slot: Option<usize>) -> String {
        let map = self.shared.map.read().expect("the slot map");
        let endpoint = slot.map_or(0, |slot| map.master[slot]);
        map.addresses[endpoint as usize].clone()
    }

    /// The command's answer, from the node serving its key. Redirections,
    /// refusals (TRYAGAIN, CLUSTERDOWN, LOADING) and commands that could not
    /// be sent are tried again; a lost answer only for an idempotent command.
    pub async fn request(&self, command: &Command) -> Result<Value, Error> {
        let mut ask: Option<String> = None;
        let mut last = Error::NotSent("never sent".into());
        for attempt in 0..ATTEMPTS {
            let address = ask.clone().unwrap_or_else(|| self.address(command.slot()));
            let answer = match self.server(&address).connection().await {
                Ok(connection) if ask.take().is_some() => {
                    let mut answers =
                        connection.pipeline(&[&[Bytes::from_static(b"ASKING")][..], command.args()]).await;
                    answers.pop().expect("two answers")
                }
                Ok(connection) => connection.request(command.args()).await,
                Err(error) => Err(error),
            };
            last = match answer {
                Ok(Value::Error(message)) => match Redirect::parse(&message) {
                    Some(redirect) if redirect.ask => {
                        ask = Some(redirect.address);
                        continue;
                    }
                    Some(redirect) => {
                        let mut map = self.shared.map.write().expect("the slot map");
                        let endpoint = map.endpoint(redirect.address);
                        map.moved(redirect.slot, endpoint);
                        continue;
                    }
                    None if refused(&message) => Error::Server(message),
                    None => return Err(Error::Server(message)),
                },
                Ok(value) => return Ok(value),
                Err(error @ Error::NotSent(_)) => {
                    let _ = self.refresh(Some(&address)).await;
                    error
                }
                Err(error @ Error::Unknown(_)) if command.is_idempotent() => {
                    let _ = self.refresh(Some(&address)).await;
                    error
                }
                Err(error) => return Err(error),
            };
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(last)
    }

    /// Commands sent at once: those for one node written together, each
    /// answered in its place. A command redirected or refused is sent again
    /// on its own, as [`ClusterClient::request`] does.
    pub async fn pipeline(&self, commands: &[Command]) -> Vec<Result<Value, Error>> {
        let mut by_node: HashMap<String, Vec<usize>> = HashMap::new();
        for (index, command) in commands.iter().enumerate() {
            by_node.entry(self.address(command.slot())).or_default().push(index);
        }
        let sends = by_node.into_iter().map(|(address, indexes)| {
            let client = self.clone();
            let batch: Vec<Command> = indexes.iter().map(|index| commands[*index].clone()).collect();
            tokio::spawn(async move {
                let answers = match client.server(&address).connection().await {
                    Ok(connection) => {
                        let args: Vec<&[Bytes]> = batch.iter().map(Command::args).collect();
                        connection.pipeline(&args).await
                    }
                    Err(error) => batch.iter().map(|_| Err(error.clone())).collect(),
                };
                let mut results = Vec::with_capacity(batch.len());
                for (command, answer) in batch.iter().zip(answers) {
                    results.push(match answer {
                        Ok(Value::Error(message)) if needs_another_try(&message) => {
                            client.request(command).await
                        }
                        Err(Error::NotSent(_)) => client.request(command).await,
                        Err(Error::Unknown(_)) if command.is_idempotent() => client.request(command).await,
                        answer => answer.and_then(answered),
                    });
                }
                (indexes, results)
            })
        });
        let sends: Vec<_> = sends.collect();
        let mut results: Vec<Option<Result<Value, Error>>> = (0..commands.len()).map(|_| None).collect();
        for send in sends {
            let (indexes, answers) = send.await.expect("a pipeline task");
            for (index, answer) in indexes.into_iter().zip(answers) {
                results[index] = Some(answer);
            }
        }
        results.into_iter().map(|result| result.expect("every command answered")).collect()
    }

    /// One read at `level` (Tessera's CONSISTENCY.READ), and the level it
    /// was served at.
    pub async fn read_at(&self, level: Level, command: Command) -> Result<(Level, Value), Error> {
        leveled(self.request(&command.at_level(level)).await?)
    }

    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Bytes>, Error> {
        bulk_or_nil(self.request(&cmd("GET").key(key).idempotent()).await?)
    }

    pub async fn set(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<(), Error> {
        self.request(&cmd("SET").key(key).arg(value)).await.map(drop)
    }
}

/// Whether an error answer refuses the command before it ran, for a while.
fn refused(message: &str) -> bool {
    ["TRYAGAIN", "CLUSTERDOWN", "LOADING"].iter().any(|refusal| message.starts_with(refusal))
}

/// Whether an error answer means the command did not run here and should
/// be sent again: a redirection or a refusal.
fn needs_another_try(message: &str) -> bool {
    Redirect::parse(message).is_some() || refused(message)
}
