//! Table administration and node-wide commands on a cluster node: TABLE.*, the
//! shards a node heads for SCAN / KEYS / DBSIZE, FLUSHALL through replication.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tessera_cluster::agent::{Completion, Routing};
use tessera_cluster::capture::CapturingView;
use tessera_cluster::map::{range_index, ClusterMap, Shard};
use tessera_cluster::DEFAULT_TABLE;
use tessera_engine::{reserved, Engine, KeyRange, ScanCursor};
use tessera_protocol::{Mode, Operation, Refusal, Role};
use tessera_wire::prefix::{escape_prefix, unescape_prefix};
use tessera_wire::{encode_command, parse_value, ReplyWriter, Request, Value};

use super::forward::Forwarder;
use super::{ClusterNode, TRANSITION_WAIT};
use crate::acl::{AclError, DEFAULT_USER};
use crate::commands::acl::{acl_error, text as acl_text};
use crate::commands::is;
use crate::commands::tables::{ordered_keys, parse_alter, parse_create, parse_range, text};
use crate::error::{CommandError, CommandResult};
use crate::node_state::NodeState;
use crate::tables::{Table, TableDef, TableSet};
use crate::typed::ReservedEntries;

/// How many times ACL SETUSER tries while other nodes change the same user.
const USER_CHANGE_ATTEMPTS: usize = 5;

impl ClusterNode {
    /// TABLE.CREATE / DROP / LIST / INFO on a cluster node: tables are part of
    /// the cluster map, changed through the coordinator.
    pub async fn table_command(&self, request: &Request<'_>, out: &mut ReplyWriter) -> CommandResult {
        let name = request.arg(0).to_ascii_lowercase();
        let change: Vec<Vec<u8>> = match name.as_slice() {
            b"table.create" => {
                let (def, split_keys) = parse_create(request)?;
                let mut args = vec![b"COORD.TABLE-CREATE".to_vec(), def.name.into_bytes()];
                args.extend([def.prefix.into_bytes(), def.engine.into_bytes()]);
                for (option, value) in def.options {
                    args.extend([option.into_bytes(), value.into_bytes()]);
                }
                if let Some(splits) = split_keys {
                    args.extend([b"PARTITION".to_vec(), b"RANGE".to_vec()]);
                    for split in splits {
                        args.extend([b"SPLIT".to_vec(), escape_prefix(&split).into_bytes()]);
                    }
                }
                args
            }
            b"table.drop" => vec![b"COORD.TABLE-DROP".to_vec(), request.arg(1).to_vec()],
            b"table.alter" => return self.alter_table(request, out).await,
            b"table.list" => {
                let map = self.map()?;
                out.array(1 + map.tables.len());
                out.bulk(DEFAULT_TABLE.as_bytes());
                for table in &map.tables {
                    out.bulk(table.name.as_bytes());
                }
                return Ok(());
            }
            _ => return self.table_info(&text(request.arg(1))?, out),
        };
        let args: Vec<&[u8]> = change.iter().map(Vec::as_slice).collect();
        if let Value::Error(message) = self.agent.ask_coordinator(&args).await? {
            return Err(CommandError::Relayed(message));
        }
        let table = text(request.arg(1))?;
        let creating = name == b"table.create";
        let arrived = self
            .agent
            .wait_for_map(|map| map.table(&table).is_some() == creating, Duration::from_secs(5))
            .await;
        if !arrived {
            return Err(CommandError::TryAgain(
                "the coordinator changed the map; this node has not seen it yet".into(),
            ));
        }
        out.ok();
        Ok(())
    }

    /// ACL SETUSER / DELUSER on a cluster node: the users are the map's. A
    /// new user's rules are computed here from this node's copy and stored
    /// only if the map still holds what this node saw (else it tries again
    /// on the newer map); the coordinator answers once every node serves them.
    pub async fn change_users(
        &self,
        node: &NodeState,
        request: &Request<'_>,
        out: &mut ReplyWriter,
    ) -> CommandResult {
        let args = request.args().skip(2).map(acl_text).collect::<CommandResult<Vec<&str>>>()?;
        if is(request.arg(1), "deluser") {
            if args.contains(&DEFAULT_USER) {
                return Err(acl_error(AclError::DefaultUser));
            }
            let mut change = vec![b"COORD.ACL-DELUSER".as_slice()];
            change.extend(args.iter().map(|name| name.as_bytes()));
            return match self.agent.ask_coordinator(&change).await? {
                Value::Integer(deleted) => {
                    out.integer(deleted);
                    Ok(())
                }
                Value::Error(message) => Err(CommandError::Relayed(message)),
                other => Err(CommandError::Other(format!("the coordinator answered {other:?}"))),
            };
        }
        let (name, rules) = (args[0], &args[1..]);
        for _ in 0..USER_CHANGE_ATTEMPTS {
            let expected = self.map()?.users.get(name).cloned().unwrap_or_default();
            let proposed = node.acl.proposed(name, rules).map_err(acl_error)?;
            let change =
                [b"COORD.ACL-SETUSER".as_slice(), name.as_bytes(), expected.as_bytes(), proposed.as_bytes()];
            match self.agent.ask_coordinator(&change).await? {
                Value::Error(message) if message.starts_with("TRYAGAIN") => {
                    let newer = |map: &ClusterMap| map.users.get(name).map_or("", String::as_str) != expected;
                    self.agent.wait_for_map(newer, Duration::from_secs(1)).await;
                }
                Value::Error(message) => return Err(CommandError::Relayed(message)),
                _ => {
                    out.ok();
                    return Ok(());
                }
            }
        }
        Err(CommandError::TryAgain(format!("user {name} kept changing on other nodes")))
    }

    /// TABLE.ALTER: switches every shard of the table to the mode asked for
    /// while it serves, and answers once the coordinator reports them all
    /// switched (from then on the new mode's guarantees hold) and this node
    /// routes by a map that says so.
    async fn alter_table(&self, request: &Request<'_>, out: &mut ReplyWriter) -> CommandResult {
        let (table, topology, consistency) = parse_alter(request)?;
        let map = self.map()?;
        let shards: Vec<&Shard> = map.shards.iter().filter(|shard| shard.table == table).collect();
        let Some(current) = shards.first().map(|shard| map.mode_of(shard)) else {
            return Err(CommandError::Other(format!("no such table '{table}'")));
        };
        let (current_topology, current_consistency) = current.parts();
        let mode = Mode::for_table(
            topology.as_deref().unwrap_or(current_topology),
            consistency.as_deref().unwrap_or(current_consistency),
        )
        .map_err(CommandError::Other)?;
        let answer = self
            .agent
            .ask_coordinator(&[b"COORD.TABLE-ALTER", table.as_bytes(), mode.name.as_bytes()])
            .await?;
        if let Value::Error(message) = answer {
            return Err(CommandError::Relayed(message));
        }
        if !self.agent.wait_for_map(|map| map.table_runs(&table, mode), Duration::from_secs(5)).await {
            return Err(CommandError::TryAgain(
                "the coordinator switched the table; this node has not seen it yet".into(),
            ));
        }
        out.ok();
        Ok(())
    }

    /// TABLE.RANGE on a cluster node: the key ranges the query spans, in
    /// order, each read at its shard's head (this node, or forwarded there)
    /// until `count` keys are found. Only range-partitioned tables are ordered
    /// across their shards.
    pub async fn table_range(
        &self,
        request: &Request<'_>,
        relay: bool,
        now_ms: u64,
        forwarder: &mut Forwarder,
    ) -> CommandResult<Vec<Bytes>> {
        let query = parse_range(request)?;
        let routing = self.agent.routing().ok_or_else(CommandError::no_map_yet)?;
        let Some(ranges) = routing.ranges(&query.table) else {
            let known = query.table == DEFAULT_TABLE || routing.map.table(&query.table).is_some();
            return Err(CommandError::Other(if known {
                format!("table '{}' is hash-partitioned; TABLE.RANGE needs PARTITION RANGE", query.table)
            } else {
                format!("no such table '{}'", query.table)
            }));
        };
        let mut keys = Vec::new();
        let first = query.keys.start.as_deref().map_or(0, |start| range_index(&ranges.splits, start));
        for (index, shard) in ranges.shards.iter().enumerate().skip(first) {
            let (from, to) = ranges.bounds(index);
            let part = KeyRange {
                start: query.keys.start.clone().max(from.map(Bytes::copy_from_slice)),
                end: match (query.keys.end.clone(), to) {
                    (Some(end), Some(to)) => Some(end.min(Bytes::copy_from_slice(to))),
                    (end, to) => end.or(to.map(Bytes::copy_from_slice)),
                },
            };
            if part.start.is_some() && part.end.is_some() && part.start >= part.end {
                break;
            }
            let limit = query.count - keys.len();
            keys.extend(
                self.shard_range(&routing, *shard, &query.table, &part, limit, relay, now_ms, forwarder)
                    .await?,
            );
            if keys.len() >= query.count {
                break;
            }
        }
        Ok(keys)
    }

    /// One shard's part of a TABLE.RANGE. At the head, the keys read are
    /// answered once the writes in flight within the part have committed, as a
    /// strong read of each key would be.
    #[allow(clippy::too_many_arguments)]
    async fn shard_range(
        &self,
        routing: &Routing,
        shard: u32,
        table: &str,
        part: &KeyRange,
        limit: usize,
        relay: bool,
        now_ms: u64,
        forwarder: &mut Forwarder,
    ) -> CommandResult<Vec<Bytes>> {
        let retry = CommandError::TryAgain;
        let strong_read = || {
            let snapshot = self.agent.snapshot(shard).ok_or(Refusal::NotOwner)?;
            snapshot.strong_read.map(|barrier| (barrier, snapshot.engine))
        };
        let mut checked = strong_read();
        if matches!(checked, Err(Refusal::Draining)) {
            self.agent.wait_while_draining(shard, TRANSITION_WAIT).await;
            checked = strong_read();
        }
        match checked {
            Err(Refusal::Draining) => Err(retry("the shard is still switching modes".into())),
            Ok((barrier, engine)) => {
                if let Some(barrier) = barrier {
                    barrier.wait().await?;
                }
                let keys = ordered_keys(&CapturingView::new(engine), part, limit, now_ms)?;
                for completion in self.agent.in_flight_within(shard, part) {
                    completion.wait().await?;
                }
                Ok(keys)
            }
            Err(Refusal::LeaseExpired) => Err(retry("the shard's lease is being renewed".into())),
            Err(Refusal::Unsettled) => Err(retry("the shard's new head has not settled yet".into())),
            Err(Refusal::NotOwner) => {
                let address = routing
                    .head_address(shard)
                    .filter(|address| *address != self.address)
                    .ok_or_else(|| retry(format!("shard {shard} is changing hands")))?;
                if relay {
                    return Err(CommandError::Moved { slot: 0, address: address.to_string() });
                }
                let start =
                    part.start.as_ref().map_or(b"-".to_vec(), |start| [b"[", start.as_ref()].concat());
                let end = part.end.as_ref().map_or(b"+".to_vec(), |end| [b"(", end.as_ref()].concat());
                let count = limit.min(i64::MAX as usize).to_string();
                let mut forwarded = Vec::new();
                encode_command(
                    &[b"TABLE.RANGE", table.as_bytes(), &start, &end, b"COUNT", count.as_bytes()],
                    &mut forwarded,
                );
                let reply = forwarder.forward(&self.agent, address.to_string(), &forwarded).await?;
                match parse_value(&reply) {
                    Ok(Some((Value::Array(items), _))) => Ok(items
                        .into_iter()
                        .filter_map(|item| item.as_bytes().map(Bytes::copy_from_slice))
                        .collect()),
                    Ok(Some((Value::Error(message), _))) => Err(CommandError::Relayed(message)),
                    _ => Err(retry(format!("{address} answered TABLE.RANGE with something else"))),
                }
            }
        }
    }

    fn table_info(&self, name: &str, out: &mut ReplyWriter) -> CommandResult {
        let map = self.map()?;
        let (prefix, engine, options) = match map.table(name) {
            Some(table) => (table.prefix.clone(), table.engine.clone(), table.options.clone()),
            None if name == DEFAULT_TABLE => (String::new(), "the nodes' own".into(), Default::default()),
            None => return Err(CommandError::Other(format!("no such table '{name}'"))),
        };
        let shards: Vec<_> = map.shards.iter().filter(|shard| shard.table == name).collect();
        let splits = map.table(name).and_then(|table| table.splits());
        let options: Vec<String> = options
            .iter()
            .filter(|(option, _)| option.as_str() != "password")
            .map(|(option, value)| format!("{option}={value}"))
            .collect();
        let modes: BTreeSet<String> = shards.iter().map(|shard| map.mode_label(shard)).collect();
        out.map(7);
        out.bulk(b"name");
        out.bulk(name.as_bytes());
        out.bulk(b"mode");
        out.bulk(modes.into_iter().collect::<Vec<_>>().join(", ").as_bytes());
        out.bulk(b"prefix");
        out.bulk(&unescape_prefix(&prefix).unwrap_or_default());
        out.bulk(b"engine");
        out.bulk(engine.as_bytes());
        out.bulk(b"options");
        out.bulk(options.join(" ").as_bytes());
        out.bulk(b"partition");
        out.bulk(if splits.is_some() { b"range" } else { b"hash" });
        out.bulk(b"shards");
        out.array(shards.len());
        for shard in shards {
            let members: Vec<String> = shard.members.iter().map(|node| format!("n{node}")).collect();
            // A range shard's keys in TABLE.RANGE's notation.
            let holds = match (shard.range, &splits) {
                (Some(range), Some(splits)) => {
                    let from = range
                        .checked_sub(1)
                        .map_or("-".into(), |before| format!("[{}", escape_prefix(&splits[before])));
                    let to =
                        splits.get(range).map_or("+".into(), |split| format!("({}", escape_prefix(split)));
                    format!("keys {from} {to}")
                }
                _ => format!("slots {:?}", shard.slots),
            };
            out.bulk(
                format!("{} {holds} view {} {}", shard.id, shard.view_number, members.join(">")).as_bytes(),
            );
        }
        Ok(())
    }

    /// The shards this node heads, as tables over their replicated values:
    /// what SCAN, KEYS and DBSIZE walk on a cluster node, so that across the
    /// nodes every key is seen once, at its head.
    pub fn headed_tables(&self) -> CommandResult<TableSet> {
        let map = self.map()?;
        let mut tables = Vec::new();
        for shard in self.agent.shards().into_keys() {
            let (true, Some(engine), Some(entry)) =
                (self.heads(shard), self.agent.engine(shard), map.shard(shard))
            else {
                continue;
            };
            let (def, spec) = match map.table(&entry.table) {
                Some(table) => {
                    let spec = table.engine_spec().map_err(CommandError::Engine)?;
                    let def = TableDef {
                        name: format!("{}@{shard}", table.name),
                        prefix: table.prefix.clone(),
                        engine: table.engine.clone(),
                        options: table.options.clone(),
                    };
                    (def, spec)
                }
                None => {
                    let def = TableDef {
                        name: format!("{DEFAULT_TABLE}@{shard}"),
                        prefix: String::new(),
                        engine: self.engine.kind.name().to_string(),
                        options: self.engine.options.clone(),
                    };
                    (def, self.engine.clone())
                }
            };
            tables.push(Arc::new(Table {
                prefix: Bytes::from(unescape_prefix(&def.prefix).unwrap_or_default()),
                def,
                spec,
                engine: Arc::new(CapturingView::new(engine)),
                reserved: ReservedEntries::default(),
            }));
        }
        Ok(TableSet::new(tables))
    }

    /// FLUSHDB / FLUSHALL on a cluster node: deletes every key of the shards
    /// it heads, through replication (across the nodes, the whole cluster is
    /// emptied, as a cluster client's FLUSHALL to every primary expects).
    /// Every key's lock is held while the deletes are ordered, and reads of the
    /// deleted keys wait for them to commit, as for any write.
    pub fn flush_headed(&self, node: &NodeState) -> CommandResult<Vec<Completion>> {
        let _all = node.lock_all();
        let mut completions = Vec::new();
        for shard in self.agent.shards().into_keys() {
            let (true, Some(engine)) = (self.heads(shard), self.agent.engine(shard)) else {
                continue;
            };
            let view = CapturingView::new(engine);
            let mut keys = Vec::new();
            let mut cursor = ScanCursor::start();
            loop {
                let page = view.scan(&KeyRange::all(), &cursor, 1024)?;
                keys.extend(page.entries.into_iter().map(|(key, _)| key));
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
            }
            let deletes = keys.iter().map(|key| Operation::Delete { key: key.clone() }).collect();
            let client_keys = keys.iter().map(|key| key.as_ref()).filter(|key| !reserved::is_reserved(key));
            completions.push(self.agent.begin_batch(shard, client_keys, deletes).0);
        }
        Ok(completions)
    }

    /// Whether this node is a shard's first member: where node-wide commands
    /// (SCAN, DBSIZE, FLUSHALL) take the shard's keys, so that across the nodes
    /// each key counts once, whatever the mode lets other members do.
    pub(super) fn heads(&self, shard: u32) -> bool {
        matches!(self.agent.role(shard), Some(Role::Head | Role::Alone))
    }
}
