//! docs/COMMANDS.md, generated from the command table: every command of
//! Redis 7.0, served (with what differs, where something does) or not
//! (and why), and Tessera's own. `cargo test -p tessera-node
//! the_command_reference` checks the file; `TESSERA_BLESS=1` rewrites it.

use super::{commands_by_family, lookup};

/// Redis 7.0's commands, as its `COMMAND LIST` names them (subcommands
/// aside). The differential tests check this list against redis-server.
pub const REDIS_COMMANDS: &[&str] = &[
    "acl",
    "append",
    "asking",
    "auth",
    "bgrewriteaof",
    "bgsave",
    "bitcount",
    "bitfield",
    "bitfield_ro",
    "bitop",
    "bitpos",
    "blmove",
    "blmpop",
    "blpop",
    "brpop",
    "brpoplpush",
    "bzmpop",
    "bzpopmax",
    "bzpopmin",
    "client",
    "cluster",
    "command",
    "config",
    "copy",
    "dbsize",
    "debug",
    "decr",
    "decrby",
    "del",
    "discard",
    "dump",
    "echo",
    "eval",
    "eval_ro",
    "evalsha",
    "evalsha_ro",
    "exec",
    "exists",
    "expire",
    "expireat",
    "expiretime",
    "failover",
    "fcall",
    "fcall_ro",
    "flushall",
    "flushdb",
    "function",
    "geoadd",
    "geodist",
    "geohash",
    "geopos",
    "georadius",
    "georadius_ro",
    "georadiusbymember",
    "georadiusbymember_ro",
    "geosearch",
    "geosearchstore",
    "get",
    "getbit",
    "getdel",
    "getex",
    "getrange",
    "getset",
    "hdel",
    "hello",
    "hexists",
    "hget",
    "hgetall",
    "hincrby",
    "hincrbyfloat",
    "hkeys",
    "hlen",
    "hmget",
    "hmset",
    "hrandfield",
    "hscan",
    "hset",
    "hsetnx",
    "hstrlen",
    "hvals",
    "incr",
    "incrby",
    "incrbyfloat",
    "info",
    "keys",
    "lastsave",
    "latency",
    "lcs",
    "lindex",
    "linsert",
    "llen",
    "lmove",
    "lmpop",
    "lolwut",
    "lpop",
    "lpos",
    "lpush",
    "lpushx",
    "lrange",
    "lrem",
    "lset",
    "ltrim",
    "memory",
    "mget",
    "migrate",
    "module",
    "monitor",
    "move",
    "mset",
    "msetnx",
    "multi",
    "object",
    "persist",
    "pexpire",
    "pexpireat",
    "pexpiretime",
    "pfadd",
    "pfcount",
    "pfdebug",
    "pfmerge",
    "pfselftest",
    "ping",
    "psetex",
    "psubscribe",
    "psync",
    "pttl",
    "publish",
    "pubsub",
    "punsubscribe",
    "quit",
    "randomkey",
    "readonly",
    "readwrite",
    "rename",
    "renamenx",
    "replconf",
    "replicaof",
    "reset",
    "restore",
    "restore-asking",
    "role",
    "rpop",
    "rpoplpush",
    "rpush",
    "rpushx",
    "sadd",
    "save",
    "scan",
    "scard",
    "script",
    "sdiff",
    "sdiffstore",
    "select",
    "set",
    "setbit",
    "setex",
    "setnx",
    "setrange",
    "shutdown",
    "sinter",
    "sintercard",
    "sinterstore",
    "sismember",
    "slaveof",
    "slowlog",
    "smembers",
    "smismember",
    "smove",
    "sort",
    "sort_ro",
    "spop",
    "spublish",
    "srandmember",
    "srem",
    "sscan",
    "ssubscribe",
    "strlen",
    "subscribe",
    "substr",
    "sunion",
    "sunionstore",
    "sunsubscribe",
    "swapdb",
    "sync",
    "time",
    "touch",
    "ttl",
    "type",
    "unlink",
    "unsubscribe",
    "unwatch",
    "wait",
    "watch",
    "xack",
    "xadd",
    "xautoclaim",
    "xclaim",
    "xdel",
    "xgroup",
    "xinfo",
    "xlen",
    "xpending",
    "xrange",
    "xread",
    "xreadgroup",
    "xrevrange",
    "xsetid",
    "xtrim",
    "zadd",
    "zcard",
    "zcount",
    "zdiff",
    "zdiffstore",
    "zincrby",
    "zinter",
    "zintercard",
    "zinterstore",
    "zlexcount",
    "zmpop",
    "zmscore",
    "zpopmax",
    "zpopmin",
    "zrandmember",
    "zrange",
    "zrangebylex",
    "zrangebyscore",
    "zrangestore",
    "zrank",
    "zrem",
    "zremrangebylex",
    "zremrangebyrank",
    "zremrangebyscore",
    "zrevrange",
    "zrevrangebylex",
    "zrevrangebyscore",
    "zrevrank",
    "zscan",
    "zscore",
    "zunion",
    "zunionstore",
];

/// Commands served with a difference a client may notice.
pub const DIFFERENCES: &[(&str, &str)] = &[
    ("select", "Database 0 only: tables take the place of numbered databases."),
    ("copy", "`DB` 0 only (one database per node)."),
    ("migrate", "A node outside a cluster sends keys to any server; a cluster node moves slots between the cluster's own groups, and refuses `COPY`."),
    ("sort", "`ALPHA` orders by bytes (Redis by the locale unless `STORE`: the same in the C locale). `BY` and `GET` patterns are refused in a cluster, as in Redis Cluster."),
    ("sort_ro", "As SORT."),
    ("wait", "Counts the other members of each shard the connection wrote that hold its writes there (the fewest over those shards). MS+SC answers a write only once every member holds it; AA+SC once a majority does. Outside a cluster: 0, as a Redis without replicas."),
    ("object", "`ENCODING` names what Redis 7.2 would use for the value; `FREQ` answers Redis's error for a node without an LFU policy (Tessera has none)."),
    ("client", "`TRACKING`, `CACHING`, `GETREDIR`, `TRACKINGINFO` and `UNBLOCK` are not served; `NO-EVICT` is kept, but Tessera never evicts clients."),
    ("config", "The parameters Tessera has, plus Redis's encoding parameters, accepted and ignored (docs/OPERATIONS.md); `REWRITE` is refused."),
    ("info", "Sections Server, Clients, Memory, Persistence, Stats, Replication, CPU, Commandstats, Latencystats (percentiles at the resolution of power-of-two buckets of microseconds), Cluster, Keyspace and Tessera's Tables, with the fields monitoring tools read under Redis's names. No RDB or AOF: Persistence says so, and counts write commands since start as the changes since the last save. A cluster node's Replication is `role:master` if it heads a group, with a `groupN` line per group it holds (role, mode, view, members); its Keyspace counts the keys of the groups it heads, as DBSIZE. `expires` and `avg_ttl` (and a cluster node's `keys`) are the expiry sweep's count from its last pass over each keyspace."),
    ("command", "`DOCS` carries Redis 7.0's version, group and arguments for each command (what redis-cli builds its help and hints from; `scripts/gen-command-docs.py` writes the table), but not Redis's prose: the summary is the command's syntax, and there is no complexity. `INFO` derives key specs from the command table: one range where Redis splits one per role (RENAME's source and destination), flags RW or RO by what the command does, SORT's STORE as a keyword; a container's subcommands carry its ACL categories."),
    ("memory", "`USAGE` estimates Tessera's own layout from a sample of elements; `STATS` reports a subset of Redis's fields; `DOCTOR` and `MALLOC-STATS` have no report."),
    ("latency", "`LATEST`, `HISTORY`, `RESET` and `DOCTOR`; no `GRAPH` or `HISTOGRAM`."),
    ("slowlog", "A transaction is logged as its EXEC (Redis logs the commands inside it)."),
    ("watch", "On an AA+SC table: each key's record is fetched through the quorum and EXEC's conditional batch checks it; a watched key places EXEC with the transaction's keys, so it must be in their slot (CROSSSLOT otherwise). A read of the key through another member can move its record and abort the EXEC needlessly."),
    ("eval", "A script that touches a key it did not declare, while another client holds that key, may fail: declare every key, as Redis asks."),
    ("evalsha", "As EVAL."),
    ("eval_ro", "As EVAL."),
    ("evalsha_ro", "As EVAL."),
    ("script", "`DEBUG` is not served."),
    ("cluster", "Served from the Tessera cluster's map: `INFO`, `MYID`, `NODES`, `SHARDS`, `SLOTS`, `KEYSLOT`, `COUNTKEYSINSLOT`, `GETKEYSINSLOT`, `SETSLOT`; slots are assigned by the coordinator, not by `ADDSLOTS` or `MEET`."),
    ("acl", "`CAT`, `DELUSER`, `GENPASS`, `GETUSER`, `LIST`, `SETUSER`, `USERS`, `WHOAMI`; in a cluster, users are the cluster's (changed through the coordinator)."),
    ("save", "Only the calling connection waits. Outside a cluster, writes wait until the file is written (reads go on); in a cluster each group is read while it serves, at one write position (docs/OPERATIONS.md, Backup and restore)."),
    ("bgsave", "A thread, not a fork: outside a cluster, writes wait until the file is written (reads go on); in a cluster each group is read while it serves, at one write position. `SCHEDULE` starts it at once (there is no AOF rewrite to wait for)."),
    ("publish", "In a cluster, delivered on every node; answers the receiving node's subscriber count, as a Redis Cluster node does."),
];

/// Redis commands Tessera does not serve, and why.
pub const NOT_SERVED: &[(&str, &str)] = &[
    ("bgrewriteaof", PERSISTENCE),
    (
        "debug",
        "Redis's internals; Tessera's diagnostics are SLOWLOG, LATENCY, MEMORY and `tessera cluster status`.",
    ),
    ("failover", REPLICATION),
    ("psync", REPLICATION),
    ("replconf", REPLICATION),
    ("replicaof", REPLICATION),
    ("slaveof", REPLICATION),
    ("sync", REPLICATION),
    ("role", REPLICATION),
    ("fcall", FUNCTIONS),
    ("fcall_ro", FUNCTIONS),
    ("function", FUNCTIONS),
    ("geoadd", GEO),
    ("geodist", GEO),
    ("geohash", GEO),
    ("geopos", GEO),
    ("georadius", GEO),
    ("georadius_ro", GEO),
    ("georadiusbymember", GEO),
    ("georadiusbymember_ro", GEO),
    ("geosearch", GEO),
    ("geosearchstore", GEO),
    ("pfadd", HYPERLOGLOG),
    ("pfcount", HYPERLOGLOG),
    ("pfdebug", HYPERLOGLOG),
    ("pfmerge", HYPERLOGLOG),
    ("pfselftest", HYPERLOGLOG),
    ("xack", STREAMS),
    ("xadd", STREAMS),
    ("xautoclaim", STREAMS),
    ("xclaim", STREAMS),
    ("xdel", STREAMS),
    ("xgroup", STREAMS),
    ("xinfo", STREAMS),
    ("xlen", STREAMS),
    ("xpending", STREAMS),
    ("xrange", STREAMS),
    ("xread", STREAMS),
    ("xreadgroup", STREAMS),
    ("xrevrange", STREAMS),
    ("xsetid", STREAMS),
    ("xtrim", STREAMS),
    ("lolwut", "Redis's own signature art."),
    ("module", "Redis modules load into Redis's process; Tessera has no module interface."),
    (
        "monitor",
        "Not built yet; `CONFIG SET slowlog-log-slower-than 0` and `SLOWLOG GET` show recent commands.",
    ),
    ("move", DATABASES),
    ("swapdb", DATABASES),
    ("shutdown", "Stop a node with SIGTERM (or `tessera cluster down`): it shuts down cleanly."),
];

const PERSISTENCE: &str = "No AOF: each table's engine persists its own data (docs/OPERATIONS.md, Durability); SAVE and BGSAVE write an RDB file, and `tessera backup` backs a cluster up.";
const REPLICATION: &str = "Redis's replication protocol: Tessera replicates through its own groups and their protocols (docs/ARCHITECTURE.md, Clusters).";
const FUNCTIONS: &str = "Redis 7 functions are not built; EVAL and EVALSHA are.";
const GEO: &str = "The geospatial commands are not built (they would sit on sorted sets).";
const HYPERLOGLOG: &str = "HyperLogLog is not built.";
const STREAMS: &str = "Streams are not built.";
const DATABASES: &str = "One database per node: tables take the place of numbered databases.";

/// The text of docs/COMMANDS.md.
pub fn reference() -> String {
    let served = REDIS_COMMANDS.iter().filter(|name| lookup(name.as_bytes()).is_some()).count();
    let mut text = format!(
        "# Commands\n\n\
         Every command of Redis 7.0, and Tessera's own, generated from the command table\n\
         (`crates/tessera-node/src/commands`; `cargo test -p tessera-node the_command_reference`\n\
         checks this file and `TESSERA_BLESS=1` rewrites it). Tessera serves {served} of Redis\n\
         7.0's {total} commands; {different} of them differ in a way a client may notice (the last\n\
         column), and the rest answer as Redis does, which `tests/python/test_differential.py`\n\
         checks against redis-server. The {not_served} it does not serve are listed at the end, with why.\n\n\
         Arity is Redis's convention (`-n`: at least n, the name included). Throughout, a\n\
         score or other double prints in the shortest form that reads back as the same number\n\
         (as Redis 7.2 and later print it; Redis 7.0 prints 17 significant digits).\n",
        total = REDIS_COMMANDS.len(),
        different = DIFFERENCES.len(),
        not_served = NOT_SERVED.len(),
    );
    let mut family_seen = "";
    for (family, spec) in commands_by_family() {
        if family != family_seen {
            text.push_str(&format!(
                "\n## {family}\n\n| Command | Arity | Flags | Differences from Redis |\n|---|---|---|---|\n"
            ));
            family_seen = family;
        }
        let difference = DIFFERENCES.iter().find(|(name, _)| *name == spec.name).map_or("", |(_, what)| what);
        let notes = match (REDIS_COMMANDS.contains(&spec.name), difference) {
            (true, difference) => difference.to_string(),
            (false, "") => "Tessera's own.".to_string(),
            (false, difference) => format!("Tessera's own. {difference}"),
        };
        text.push_str(&format!(
            "| {} | {} | {} | {notes} |\n",
            spec.name.to_ascii_uppercase(),
            spec.arity,
            spec.flags.join(", "),
        ));
    }
    text.push_str("\n## Redis commands Tessera does not serve\n\n| Command | Why |\n|---|---|\n");
    for (name, why) in NOT_SERVED {
        text.push_str(&format!("| {} | {why} |\n", name.to_ascii_uppercase()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_redis_command_is_served_or_said_not_to_be() {
        for name in REDIS_COMMANDS {
            let served = lookup(name.as_bytes()).is_some();
            let refused = NOT_SERVED.iter().any(|(refused, _)| refused == name);
            assert!(served != refused, "{name}: served {served}, listed as not served {refused}");
        }
        for (name, _) in NOT_SERVED.iter().chain(DIFFERENCES) {
            assert!(REDIS_COMMANDS.contains(name), "{name} is not a Redis 7.0 command");
        }
        for (name, _) in DIFFERENCES {
            assert!(lookup(name.as_bytes()).is_some(), "{name} has differences noted but is not served");
        }
    }

    #[test]
    fn the_command_reference_matches_the_table() {
        let text = reference();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/COMMANDS.md");
        if std::env::var_os("TESSERA_BLESS").is_some() {
            std::fs::write(&path, &text).unwrap();
        }
        let written = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(written == text, "docs/COMMANDS.md is stale: run with TESSERA_BLESS=1");
    }
}
