//! Redis Cluster's commands, answered from the cluster map: CLUSTER SLOTS,
//! SHARDS, NODES, INFO, KEYSLOT, MYID, and READONLY / READWRITE / ASKING; and
//! Tessera's RELAY.HELLO / RELAY.AUTH, with which another node's forwarding
//! link proves it holds the cluster secret (docs/ARCHITECTURE.md, "Who may
//! speak on the cluster plane").
//!
//! A Tessera node may head one shard and follow in others, which Redis
//! Cluster's one-master-or-one-replica model cannot say: SLOTS and SHARDS list
//! every shard's members exactly; NODES shows a node as the master of the
//! shards it heads. The shards shown are the default table's: every other
//! table's shards start on the same nodes, slot for slot.

use tessera_cluster::auth::{from_hex, to_hex, LoginTo, Transcript, NONCE_BYTES, PROOF_BYTES};
use tessera_cluster::{ClusterMap, NodeRole};
use tessera_wire::slot::key_slot;
use tessera_wire::Request;

use super::{is, CommandSpec, Context, Scope};
use crate::error::{CommandError, CommandResult};
use crate::membership::Membership;

/// CLUSTER's subcommands and their arities.
pub const SUBCOMMANDS: &[(&str, i32)] = &[
    ("countkeysinslot", 3),
    ("getkeysinslot", 4),
    ("info", 2),
    ("keyslot", 3),
    ("myid", 2),
    ("nodes", 2),
    ("setslot", -4),
    ("shards", 2),
    ("slot-stats", -4),
    ("slots", 2),
];

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "cluster", arity: -2, flags: &["noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Resharding, handler: cluster },
    CommandSpec { name: "migrate", arity: -6, flags: &["write", "movablekeys", "noscript"], first_key: 3, last_key: 3, step: 1, scope: Scope::Resharding, handler: migrate },
    CommandSpec { name: "readonly", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: connection_mode },
    CommandSpec { name: "readwrite", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: connection_mode },
    CommandSpec { name: "asking", arity: 1, flags: &["fast", "noscript"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: connection_mode },
    CommandSpec { name: "relay.hello", arity: 4, flags: &["noscript", "loading", "stale", "fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: relay_hello },
    CommandSpec { name: "relay.auth", arity: 2, flags: &["noscript", "loading", "stale", "fast"], first_key: 0, last_key: 0, step: 0, scope: Scope::Keys, handler: relay_auth },
];

fn member_of_cluster<'a>(context: &Context<'a>) -> CommandResult<&'a Membership> {
    context.cluster.ok_or_else(|| CommandError::Other("This instance has cluster support disabled".into()))
}

/// A node's 40-character name, as Redis Cluster clients expect one.
pub fn node_name(map: &ClusterMap, node: u32) -> String {
    let cluster = map
        .cluster_id
        .bytes()
        .fold(0x811c9dc5u32, |hash, byte| (hash ^ byte as u32).wrapping_mul(0x01000193));
    format!("{cluster:08x}{node:032x}")
}

fn host_port(address: &str) -> (&str, i64) {
    match address.rsplit_once(':') {
        Some((host, port)) => (host, port.parse().unwrap_or(0)),
        None => (address, 0),
    }
}

fn cluster(context: &mut Context, request: &Request) -> CommandResult {
    let node = member_of_cluster(context)?;
    context.session.cluster_client = true;
    let subcommand = request.arg(1);
    if is(subcommand, "keyslot") && request.len() == 3 {
        context.out.integer(key_slot(request.arg(2)) as i64);
        return Ok(());
    }
    let me = node.agent.node_id();
    let whole = node.map()?;
    let map = whole.seen_from(me);
    match () {
        _ if is(subcommand, "slots") && request.len() == 2 => slots(context, &map),
        _ if is(subcommand, "shards") && request.len() == 2 => shards(context, &map),
        _ if is(subcommand, "nodes") && request.len() == 2 => {
            context.out.bulk(nodes(&map, me, context.session.tls).as_bytes())
        }
        _ if is(subcommand, "info") && request.len() == 2 => context.out.bulk(info(&map, me).as_bytes()),
        _ if is(subcommand, "myid") && request.len() == 2 => context.out.bulk(node_name(&map, me).as_bytes()),
        _ => {
            return Err(CommandError::Other(format!(
                "unknown subcommand or wrong number of arguments for '{}'; try SLOTS, SHARDS, NODES, INFO, KEYSLOT or MYID",
                String::from_utf8_lossy(subcommand)
            )))
        }
    }
    Ok(())
}

/// MIGRATE on a node outside a cluster, to any server (a cluster node
/// serves it as resharding).
fn migrate(context: &mut Context, request: &Request) -> CommandResult {
    if context.cluster.is_some() {
        return Err(CommandError::Other("MIGRATE is served through the cluster".into()));
    }
    super::dump::migrate(context, request)
}

fn relay_refused() -> CommandError {
    CommandError::Other("authentication failed (a wrong cluster id or secret)".into())
}

/// `RELAY.HELLO cluster node nonce`: this node's half of a forwarding link's
/// login, as the coordinator answers COORD.HELLO. Another cluster's link
/// learns nothing of this one.
fn relay_hello(context: &mut Context, request: &Request) -> CommandResult {
    let config = member_of_cluster(context)?.agent.config();
    context.session.relay_challenge = None;
    let connecting_nonce = from_hex::<NONCE_BYTES>(request.arg(3)).ok_or_else(relay_refused)?;
    let node = std::str::from_utf8(request.arg(2)).map_err(|_| relay_refused())?;
    if request.arg(1) != config.cluster_id.as_bytes() {
        return Err(relay_refused());
    }
    let transcript =
        Transcript::answering(&config.cluster_id, node, LoginTo::Relay.accepting(), connecting_nonce);
    context.out.array(2);
    context.out.bulk(to_hex(&transcript.accepting_nonce).as_bytes());
    context.out.bulk(to_hex(&config.secret.accepting_proof(&transcript)).as_bytes());
    context.session.relay_challenge = Some(transcript);
    Ok(())
}

/// `RELAY.AUTH proof`: the connection becomes a relay if the proof is the
/// one its hello calls for. One proof per challenge.
fn relay_auth(context: &mut Context, request: &Request) -> CommandResult {
    let config = member_of_cluster(context)?.agent.config();
    let transcript = context.session.relay_challenge.take().ok_or_else(relay_refused)?;
    let proof = from_hex::<PROOF_BYTES>(request.arg(1)).ok_or_else(relay_refused)?;
    if !config.secret.verify_connecting(&transcript, &proof) {
        tracing::warn!(node = %transcript.connecting, "a forwarding link failed to authenticate");
        return Err(relay_refused());
    }
    context.session.authenticated = true;
    context.session.relay = true;
    context.out.ok();
    Ok(())
}

/// A node's client address as the connection should use it.
fn client_address(context: &Context, map: &ClusterMap, node: u32) -> (String, i64) {
    let address = map.node(node).map_or("", |info| info.client_address(context.session.tls));
    let (host, port) = host_port(address);
    (host.to_string(), port)
}

fn write_node(context: &mut Context, map: &ClusterMap, node: u32) {
    let (host, port) = client_address(context, map, node);
    context.out.array(3);
    context.out.bulk(host.as_bytes());
    context.out.integer(port);
    context.out.bulk(node_name(map, node).as_bytes());
}

/// [first, last, head, followers...] per slot range.
///
/// A node heads one shard and follows in others, but some clients (redis-py)
/// fix a node's role where it first appears in this reply. So every shard's
/// first slot comes first, with its head alone: every head is introduced as a
/// primary before any range names it a replica. The rest of each shard's
/// slots follow with the whole chain.
fn slots(context: &mut Context, map: &ClusterMap) {
    let mut introductions = Vec::new();
    let mut ranges = Vec::new();
    for shard in map.slot_shards() {
        for (index, (first, last)) in shard.slots.iter().enumerate() {
            if index == 0 {
                introductions.push((*first, *first, &shard.members[..1]));
                if first < last {
                    ranges.push((*first + 1, *last, &shard.members[..]));
                }
            } else {
                ranges.push((*first, *last, &shard.members[..]));
            }
        }
    }
    context.out.array(introductions.len() + ranges.len());
    for (first, last, members) in introductions.into_iter().chain(ranges) {
        context.out.array(2 + members.len());
        context.out.integer(first as i64);
        context.out.integer(last as i64);
        for member in members {
            write_node(context, map, *member);
        }
    }
}

fn shards(context: &mut Context, map: &ClusterMap) {
    context.out.array(map.slot_shards().count());
    for shard in map.slot_shards() {
        context.out.map(2);
        context.out.bulk(b"slots");
        context.out.array(shard.slots.len() * 2);
        for (first, last) in &shard.slots {
            context.out.integer(*first as i64);
            context.out.integer(*last as i64);
        }
        context.out.bulk(b"nodes");
        context.out.array(shard.members.len());
        for (position, member) in shard.members.iter().enumerate() {
            let (host, port) = client_address(context, map, *member);
            context.out.map(6);
            for (field, value) in [
                ("id", node_name(map, *member)),
                ("ip", host.to_string()),
                ("endpoint", host.to_string()),
                ("role", if position == 0 { "master" } else { "replica" }.to_string()),
                ("health", "online".to_string()),
            ] {
                context.out.bulk(field.as_bytes());
                context.out.bulk(value.as_bytes());
            }
            context.out.bulk(b"port");
            context.out.integer(port);
        }
    }
}

/// The master CLUSTER NODES shows `node` replicating: none if it heads a
/// shard, else the head of the first shard it follows.
pub fn shown_master(map: &ClusterMap, node: u32) -> Option<u32> {
    if map.headed_by(node).next().is_some() {
        return None;
    }
    let followed = map.slot_shards().find(|shard| shard.members.iter().skip(1).any(|id| *id == node))?;
    followed.members.first().copied()
}

/// CLUSTER NODES: one line per node; a node is the master of the shards it
/// heads and otherwise a replica of the first shard it follows. Its own line
/// shows the slots it is migrating (`[slot->-target]`) or importing
/// (`[slot-<-source]`), as Redis does.
fn nodes(map: &ClusterMap, me: u32, tls: bool) -> String {
    let mut text = String::new();
    let head = |shard: u32| map.shard(shard).and_then(|shard| shard.members.first()).copied();
    for node in &map.nodes {
        let headed: Vec<_> = map.headed_by(node.id).collect();
        let myself = if node.id == me { "myself," } else { "" };
        let (role, master) = match shown_master(map, node.id) {
            Some(head) => ("slave", node_name(map, head)),
            None => ("master", "-".to_string()),
        };
        // The coordinator takes a member it finds dead out of every shard: a
        // member in none is shown failed, so that clients stop using it.
        let failed = node.role == NodeRole::Member
            && !map
                .shards
                .iter()
                .any(|shard| shard.members.contains(&node.id) || shard.learners.contains(&node.id));
        let (fail, link) = if failed { (",fail", "disconnected") } else { ("", "connected") };
        let (host, port) = host_port(node.client_address(tls));
        // The peer port is the plain client port's, TLS or not.
        let bus_port = host_port(&node.address).1 + 10_000;
        text.push_str(&format!(
            "{} {host}:{port}@{bus_port} {myself}{role}{fail} {master} 0 0 {} {link}",
            node_name(map, node.id),
            map.epoch
        ));
        for shard in headed {
            for (first, last) in &shard.slots {
                if first == last {
                    text.push_str(&format!(" {first}"));
                } else {
                    text.push_str(&format!(" {first}-{last}"));
                }
            }
        }
        for open in map.open_slots.iter().filter(|_| node.id == me) {
            let (Some(source), Some(target)) = (head(open.from), head(open.to)) else { continue };
            if open.migrating && source == me {
                text.push_str(&format!(" [{}->-{}]", open.slot, node_name(map, target)));
            }
            if open.importing && target == me {
                text.push_str(&format!(" [{}-<-{}]", open.slot, node_name(map, source)));
            }
        }
        text.push('\n');
    }
    text
}

fn info(map: &ClusterMap, me: u32) -> String {
    let served: usize = map
        .shards
        .iter()
        .filter(|shard| !shard.members.is_empty())
        .flat_map(|shard| &shard.slots)
        .map(|(first, last)| (*last - *first) as usize + 1)
        .sum();
    let state = if served == tessera_wire::slot::SLOTS { "ok" } else { "fail" };
    let my_epoch = map.headed_by(me).map(|shard| shard.view_number);
    [
        format!("cluster_state:{state}"),
        format!("cluster_slots_assigned:{served}"),
        format!("cluster_slots_ok:{served}"),
        "cluster_slots_pfail:0".into(),
        "cluster_slots_fail:0".into(),
        format!("cluster_known_nodes:{}", map.nodes.len()),
        format!("cluster_size:{}", map.slot_shards().count()),
        format!("cluster_current_epoch:{}", map.epoch),
        format!("cluster_my_epoch:{}", my_epoch.max().unwrap_or(0)),
        // The default table's, whose shards cluster clients see.
        format!(
            "tessera_mode:{}",
            map.slot_shards().next().map_or(map.mode, |shard| map.mode_of(shard)).label()
        ),
        format!("tessera_replicas:{}", map.replicas),
    ]
    .join("\r\n")
        + "\r\n"
}

/// READONLY and READWRITE choose where this connection's reads go; ASKING is
/// accepted (a slot's keys move together, at its cut, so ASK is never sent).
/// Each marks the connection as a cluster client.
fn connection_mode(context: &mut Context, request: &Request) -> CommandResult {
    member_of_cluster(context)?;
    context.session.cluster_client = true;
    if is(request.arg(0), "readonly") {
        context.session.readonly = true;
    } else if is(request.arg(0), "readwrite") {
        context.session.readonly = false;
    }
    context.out.ok();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> ClusterMap {
        let addresses: Vec<String> = (0..4).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect();
        ClusterMap::place("c1", tessera_protocol::Mode::named("chain").unwrap(), 2, &addresses, 3).unwrap()
    }

    #[test]
    fn nodes_lists_heads_as_masters_with_their_slots() {
        let map = map();
        let text = nodes(&map, 1, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].contains("127.0.0.1:7000@17000 master - 0 0 1 connected 0-5460"), "{}", lines[0]);
        assert!(lines[1].contains("myself,master"), "{}", lines[1]);
        assert!(
            lines[3].contains(" master - ") && !lines[3].contains("connected "),
            "a standby heads nothing"
        );
        assert_eq!(node_name(&map, 1).len(), 40);
    }

    #[test]
    fn nodes_shows_a_member_taken_out_of_every_shard_as_failed() {
        let mut map = map();
        for shard in &mut map.shards {
            shard.members.retain(|member| *member != 2);
        }
        let text = nodes(&map, 0, false);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[2].contains(" master,fail - 0 0 1 disconnected"), "{}", lines[2]);
        assert!(lines[1].contains(" connected") && !lines[1].contains("fail"), "{}", lines[1]);
        assert!(!lines[3].contains("fail"), "a standby holds nothing and has not failed: {}", lines[3]);
    }

    #[test]
    fn info_reports_a_fully_served_map() {
        let text = info(&map(), 0);
        assert!(text.contains("cluster_state:ok\r\n"));
        assert!(text.contains("cluster_slots_assigned:16384\r\n"));
        assert!(text.contains("cluster_size:3\r\n"));
    }
}
