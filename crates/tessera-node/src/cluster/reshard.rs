//! Redis Cluster's resharding commands on a cluster node (docs/ARCHITECTURE.md,
//! "Redis Cluster's interface"): CLUSTER SETSLOT, GETKEYSINSLOT and
//! COUNTKEYSINSLOT, and MIGRATE. Groups own slots, so each command speaks
//! for the groups this node heads; the coordinator keeps the open slots and
//! moves each with a migration of its own.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use tessera_cluster::capture::CapturingView;
use tessera_cluster::map::ClusterMap;
use tessera_engine::{Engine, KeyRange, ScanCursor};
use tessera_wire::slot::{key_slot, SLOTS};
use tessera_wire::{ReplyWriter, Request, Value};

use super::ClusterNode;
use crate::commands::cluster::{node_name, shown_master};
use crate::commands::is;
use crate::commands::keys::live_kind;
use crate::error::{CommandError, CommandResult};

/// How long SETSLOT NODE waits for its slot to move.
const SLOT_MOVE_WAIT: Duration = Duration::from_secs(60);

/// The least MIGRATE waits for its keys' slots to move, whatever its
/// timeout: Redis's timeout bounds one exchange with the target, and here
/// the whole slot moves at once.
const MIGRATE_WAIT_MIN: Duration = Duration::from_secs(10);

/// How long SETSLOT IMPORTING / MIGRATING / STABLE wait for this node to see
/// the map that records them.
const MARK_WAIT: Duration = Duration::from_secs(5);

pub(super) fn integer(arg: &[u8]) -> CommandResult<i64> {
    std::str::from_utf8(arg).ok().and_then(|text| text.parse().ok()).ok_or(CommandError::NotInteger)
}

pub(super) fn valid_slot(number: i64) -> Option<u16> {
    u16::try_from(number).ok().filter(|slot| usize::from(*slot) < SLOTS)
}

/// The node a Redis Cluster node name (as CLUSTER NODES shows it) stands for.
fn node_named(map: &ClusterMap, name: &[u8]) -> Option<u32> {
    map.nodes
        .iter()
        .find(|node| node_name(map, node.id).as_bytes().eq_ignore_ascii_case(name))
        .map(|node| node.id)
}

impl ClusterNode {
    /// Asks the coordinator for `COORD.SETSLOT me slot words...`.
    async fn ask_set_slot(&self, slot: u16, words: &[&[u8]]) -> CommandResult {
        let (me, slot) = (self.agent.node_id().to_string(), slot.to_string());
        let mut args = vec![b"COORD.SETSLOT".as_slice(), me.as_bytes(), slot.as_bytes()];
        args.extend_from_slice(words);
        match self.agent.ask_coordinator(&args).await? {
            Value::Error(message) => Err(CommandError::Relayed(message)),
            _ => Ok(()),
        }
    }

    /// Waits until this node's map no longer has `slot` open, then checks
    /// that it left group `source` (for the group it was opened towards,
    /// whoever heads that now) or is already `owner`'s: it could have been
    /// closed instead, by SETSLOT STABLE elsewhere.
    async fn wait_moved(&self, slot: u16, source: u32, owner: u32, wait: Duration) -> CommandResult {
        if !self.agent.wait_for_map(|map| map.open_slot(slot).is_none(), wait).await {
            return Err(CommandError::Timeout(format!(
                "hash slot {slot} is still moving after {} ms; ask again to wait for it",
                wait.as_millis()
            )));
        }
        let map = self.map()?;
        match map.shard_for_slot(slot) {
            Some(shard) if shard.id != source || map.stands_for(owner, shard.id) => Ok(()),
            _ => Err(CommandError::Other(format!("the move of hash slot {slot} was cancelled"))),
        }
    }

    /// `CLUSTER SETSLOT slot IMPORTING|MIGRATING|NODE node-name` or
    /// `CLUSTER SETSLOT slot STABLE`.
    pub async fn set_slot(&self, request: &Request<'_>, out: &mut ReplyWriter) -> CommandResult {
        let slot = integer(request.arg(2))
            .ok()
            .and_then(valid_slot)
            .ok_or_else(|| CommandError::Other("Invalid or out of range slot".into()))?;
        let action = request.arg(3);
        let map = self.map()?;
        // Checked here first, in Redis's order; the coordinator checks again.
        let source = map
            .shard_for_slot(slot)
            .ok_or_else(|| CommandError::ClusterDown(format!("hash slot {slot} has no group")))?;
        let mine = source.is_headed_by(self.agent.node_id());
        if is(action, "importing") && mine {
            return Err(CommandError::Other(format!("I'm already the owner of hash slot {slot}")));
        }
        if is(action, "migrating") && !mine {
            return Err(CommandError::Other(format!("I'm not the owner of hash slot {slot}")));
        }
        let named = || {
            let name = request.arg(4);
            node_named(&map, name).ok_or_else(|| {
                let unknown = if is(action, "node") { "Unknown node" } else { "I don't know about node" };
                CommandError::Other(format!("{unknown} {}", String::from_utf8_lossy(name)))
            })
        };
        let other = match request.len() {
            5 if ["importing", "migrating", "node"].iter().any(|word| is(action, word)) => Some(named()?),
            4 if is(action, "stable") => None,
            _ => {
                return Err(CommandError::Other(
                    "Invalid CLUSTER SETSLOT action or number of arguments. Try CLUSTER HELP".into(),
                ))
            }
        };
        let other_text = other.map(|node| node.to_string()).unwrap_or_default();
        let word = action.to_ascii_uppercase();
        let words: Vec<&[u8]> =
            if other.is_some() { vec![&word, other_text.as_bytes()] } else { vec![&word] };
        self.ask_set_slot(slot, &words).await?;
        let marked = |map: &ClusterMap| {
            let open = map.open_slot(slot);
            match word.as_slice() {
                b"IMPORTING" => open.is_some_and(|open| open.importing),
                b"MIGRATING" => open.is_some_and(|open| open.migrating),
                _ => open.is_none(),
            }
        };
        match other {
            Some(owner) if word == b"NODE" => self.wait_moved(slot, source.id, owner, SLOT_MOVE_WAIT).await?,
            _ if !self.agent.wait_for_map(marked, MARK_WAIT).await => {
                return Err(CommandError::TryAgain(
                    "the coordinator changed the map; this node has not seen it yet".into(),
                ))
            }
            _ => {}
        }
        out.ok();
        Ok(())
    }

    /// CLUSTER SETSLOT, GETKEYSINSLOT and COUNTKEYSINSLOT; MIGRATE.
    pub async fn resharding_command(
        &self,
        request: &Request<'_>,
        now_ms: u64,
        tls: bool,
        out: &mut ReplyWriter,
    ) -> CommandResult {
        if is(request.arg(0), "migrate") {
            return self.migrate(request, now_ms, tls, out).await;
        }
        let subcommand = request.arg(1);
        let arity_ok = match () {
            _ if is(subcommand, "setslot") => request.len() >= 4,
            _ if is(subcommand, "getkeysinslot") => request.len() == 4,
            _ => request.len() == 3,
        };
        if !arity_ok {
            let name = String::from_utf8_lossy(subcommand).to_ascii_lowercase();
            return Err(CommandError::WrongArity(format!("cluster|{name}")));
        }
        if is(subcommand, "setslot") {
            return self.set_slot(request, out).await;
        }
        let slot = valid_slot(integer(request.arg(2))?);
        let counting = is(subcommand, "countkeysinslot");
        let count = if counting { None } else { Some(integer(request.arg(3))?) };
        let (Some(slot), false) = (slot, count.is_some_and(|count| count < 0)) else {
            let message = if counting { "Invalid slot" } else { "Invalid slot or number of keys" };
            return Err(CommandError::Other(message.into()));
        };
        let limit = count.map_or(usize::MAX, |count| usize::try_from(count).unwrap_or(usize::MAX));
        let keys = self.keys_in_slot(slot, limit, now_ms)?;
        if counting {
            out.integer(keys.len() as i64);
        } else {
            out.array(keys.len());
            for key in &keys {
                out.bulk(key);
            }
        }
        Ok(())
    }

    /// The live keys of `slot` this node answers for, up to `limit`: those
    /// of the slot's group if this node heads it, or if it heads none and
    /// CLUSTER NODES shows it replicating that group's head.
    pub fn keys_in_slot(&self, slot: u16, limit: usize, now_ms: u64) -> CommandResult<Vec<Bytes>> {
        let map = self.map()?;
        let me = self.agent.node_id();
        let Some(owner) = map.shard_for_slot(slot) else {
            return Ok(Vec::new());
        };
        let answers = owner.is_headed_by(me) || owner.members.first().copied() == shown_master(&map, me);
        let Some(engine) = answers.then(|| self.agent.engine(owner.id)).flatten() else {
            return Ok(Vec::new());
        };
        let view = CapturingView::new(engine);
        let mut keys = Vec::new();
        let mut cursor = ScanCursor::start();
        while keys.len() < limit {
            let page = view.scan(&KeyRange::all(), &cursor, 1024)?;
            for (key, raw) in page.entries {
                if keys.len() < limit
                    && key_slot(&key) == usize::from(slot)
                    && live_kind(&key, raw, now_ms).is_some()
                {
                    keys.push(key);
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        Ok(keys)
    }

    /// `MIGRATE host port key|"" db timeout [COPY] [REPLACE] [AUTH password]
    /// [AUTH2 user password] [KEYS key...]` to a node of this cluster whose
    /// group imports the keys' slot: commits the slot's move and answers once
    /// the slot has moved, every key of it with it; `NOKEY` if none of the
    /// keys is here. Routed first, as Redis routes it: keys of several slots
    /// are `CROSSSLOT`, and a slot neither this node's nor open is `MOVED`.
    async fn migrate(
        &self,
        request: &Request<'_>,
        now_ms: u64,
        tls: bool,
        out: &mut ReplyWriter,
    ) -> CommandResult {
        let keys_at = (6..request.len()).find(|index| is(request.arg(*index), "keys"));
        let keys: Vec<&[u8]> = match keys_at {
            Some(_) if !request.arg(3).is_empty() => {
                return Err(CommandError::Other(
                    "When using MIGRATE KEYS option, the key argument must be set to the empty string".into(),
                ))
            }
            Some(index) => request.args().skip(index + 1).collect(),
            None => vec![request.arg(3)],
        };
        let map = self.map()?;
        let me = self.agent.node_id();
        let slots: BTreeSet<u16> = keys.iter().map(|key| key_slot(key) as u16).collect();
        if slots.len() > 1 {
            return Err(CommandError::CrossSlot("Keys in request don't hash to the same slot".into()));
        }
        let owner = slots.first().and_then(|slot| map.shard_for_slot(*slot));
        if let (Some(slot), Some(owner)) = (slots.first(), owner) {
            let head = owner.members.first().and_then(|head| map.node(*head));
            if let Some(head) = head.filter(|_| !owner.is_headed_by(me) && map.open_slot(*slot).is_none()) {
                return Err(CommandError::Moved {
                    slot: *slot,
                    address: head.client_address(tls).to_string(),
                });
            }
        }
        let port = integer(request.arg(2))?;
        let database = integer(request.arg(4))?;
        let timeout = integer(request.arg(5))?;
        let mut copy = false;
        let mut index = 6;
        while index < keys_at.unwrap_or(request.len()) {
            let option = request.arg(index);
            if is(option, "copy") {
                copy = true;
            } else if is(option, "auth") || is(option, "auth2") {
                // The target is reached over the cluster's own links.
                index += if is(option, "auth") { 1 } else { 2 };
                if index >= request.len() {
                    return Err(CommandError::Syntax);
                }
            } else if !is(option, "replace") {
                // REPLACE changes nothing: the target holds none of a slot it imports.
                return Err(CommandError::Syntax);
            }
            index += 1;
        }
        if copy {
            return Err(CommandError::Other(
                "MIGRATE COPY is not supported: a Tessera cluster moves a slot's keys together, and a copy kept here would sit in a slot this node no longer serves".into(),
            ));
        }
        let destination = format!("{}:{port}", String::from_utf8_lossy(request.arg(1)));
        let target = map
            .nodes
            .iter()
            .find(|node| node.address == destination || node.tls_address.as_deref() == Some(destination.as_str()))
            .ok_or_else(|| {
                CommandError::Other(format!(
                    "MIGRATE to {destination}: not a node of this cluster (Tessera moves keys between the groups of one cluster)"
                ))
            })?;
        if database != 0 {
            return Err(CommandError::Other(
                "Target instance replied with error: ERR SELECT is not allowed in cluster mode".into(),
            ));
        }
        let here = owner.filter(|owner| owner.is_headed_by(me)).and_then(|owner| self.agent.engine(owner.id));
        let mut present = false;
        if let Some(engine) = here {
            let view = CapturingView::new(engine);
            for key in &keys {
                present |= view.get(key)?.is_some_and(|raw| live_kind(key, raw, now_ms).is_some());
            }
        }
        let (Some(slot), Some(owner), true) = (slots.first().copied(), owner, present) else {
            out.simple("NOKEY");
            return Ok(());
        };
        let importing = map
            .open_slot(slot)
            .is_some_and(|open| open.importing && open.migrating && map.stands_for(target.id, open.to));
        if !importing {
            // What a Redis target that does not import the slot answers.
            let address = map.node(me).map_or("", |node| node.client_address(tls));
            return Err(CommandError::Other(format!(
                "Target instance replied with error: MOVED {slot} {address}"
            )));
        }
        debug_assert!(owner.is_headed_by(me), "keys are present only in a group this node heads");
        self.ask_set_slot(slot, &[b"COMMIT", target.id.to_string().as_bytes()]).await?;
        let wait = Duration::from_millis(timeout.max(0) as u64).max(MIGRATE_WAIT_MIN);
        self.wait_moved(slot, owner.id, target.id, wait).await?;
        out.ok();
        Ok(())
    }
}
