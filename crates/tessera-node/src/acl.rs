//! Users and what they may do, in Redis's ACL syntax: `ACL SETUSER alice on
//! >secret ~cache:* %R~shared:* +@read -keys`. A user has passwords (kept only
//! as SHA-256 hashes), the commands it may run (by name and by category) and
//! the keys it may read and write (glob patterns; a table's keys are its
//! prefix followed by the key, so `~orders:*` grants a table's range).
//!
//! The users live in `<dir>/users.acl`, one `user …` line each in the form
//! ACL LIST prints, rewritten whole (through a temporary file) on every change.
//! The `default` user is open (`nopass`, every command and key) unless the
//! node has a `password`, which becomes its password.
//!
//! A cluster node serves the cluster's users instead, as the coordinator's
//! map holds them ([`Acl::adopt`]): ACL SETUSER and DELUSER there change the
//! map, and every node takes the new users before it reports the map seen.
//! Its own `default` user stays unless the map has one.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use tessera_cluster::auth::{from_hex, to_hex};

use crate::glob::glob_match;

pub const DEFAULT_USER: &str = "default";
const FILE_NAME: &str = "users.acl";
/// Redis's words for a `#` or `!` rule that is not a SHA-256 in hex.
const HASH_FORMAT: &str =
    "The password hash must be exactly 64 characters and contain only lowercase hexadecimal characters";

/// What the ACL knows of the commands: their names and their categories
/// (the commands module builds it, so that users can be checked without
/// this module knowing any command).
#[derive(Debug, Default)]
pub struct CommandCatalog {
    commands: HashSet<&'static str>,
    by_category: BTreeMap<&'static str, Vec<&'static str>>,
}

impl CommandCatalog {
    pub fn new(commands: impl Iterator<Item = (&'static str, Vec<&'static str>)>) -> Self {
        let mut catalog = Self::default();
        for (name, categories) in commands {
            catalog.commands.insert(name);
            for category in categories {
                catalog.by_category.entry(category).or_default().push(name);
            }
        }
        catalog
    }

    pub fn categories(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.by_category.keys().copied()
    }

    /// The commands of a category, `None` if there is no such category.
    pub fn in_category(&self, category: &str) -> Option<&[&'static str]> {
        self.by_category.get(category).map(Vec::as_slice)
    }

    fn command(&self, name: &str) -> Option<&'static str> {
        self.commands.get(name).copied()
    }
}

fn hash(password: &[u8]) -> [u8; 32] {
    Sha256::digest(password).into()
}

/// A key pattern and what it grants.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KeyPattern {
    pattern: Vec<u8>,
    read: bool,
    write: bool,
}

impl KeyPattern {
    fn rule(&self) -> String {
        let pattern = String::from_utf8_lossy(&self.pattern);
        match (self.read, self.write) {
            (true, true) => format!("~{pattern}"),
            (true, false) => format!("%R~{pattern}"),
            (false, _) => format!("%W~{pattern}"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct User {
    pub name: String,
    pub enabled: bool,
    nopass: bool,
    passwords: BTreeSet<[u8; 32]>,
    allowed: HashSet<&'static str>,
    /// The command rules as given, after the last `+@all` or `-@all`.
    command_rules: Vec<String>,
    keys: Vec<KeyPattern>,
    channels: Vec<String>,
}

/// A rule ACL SETUSER cannot apply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("Error in ACL SETUSER modifier '{rule}': {reason}")]
pub struct RuleError {
    pub rule: String,
    pub reason: &'static str,
}

impl User {
    /// A user as ACL SETUSER creates one: off, no password, no command, no key.
    fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            enabled: false,
            nopass: false,
            passwords: BTreeSet::new(),
            allowed: HashSet::new(),
            command_rules: vec!["-@all".into()],
            keys: Vec::new(),
            channels: Vec::new(),
        }
    }

    /// `base` (or a new user named `name`) after `rules`, in order.
    fn after<'a>(
        base: Option<&User>,
        name: &str,
        rules: impl IntoIterator<Item = &'a str>,
        catalog: &CommandCatalog,
    ) -> Result<Self, RuleError> {
        let mut user = base.cloned().unwrap_or_else(|| User::new(name));
        for rule in rules {
            user.apply(rule, catalog)?;
        }
        Ok(user)
    }

    fn apply(&mut self, rule: &str, catalog: &CommandCatalog) -> Result<(), RuleError> {
        let error = |reason| RuleError { rule: rule.to_string(), reason };
        let lower = rule.to_ascii_lowercase();
        match lower.as_str() {
            "on" => self.enabled = true,
            "off" => self.enabled = false,
            "nopass" => {
                self.nopass = true;
                self.passwords.clear();
            }
            "resetpass" => {
                self.nopass = false;
                self.passwords.clear();
            }
            "allkeys" => self.apply("~*", catalog)?,
            "resetkeys" => self.keys.clear(),
            "allchannels" => self.channels = vec!["*".into()],
            "resetchannels" => self.channels.clear(),
            "allcommands" => self.apply("+@all", catalog)?,
            "nocommands" => self.apply("-@all", catalog)?,
            "reset" => {
                for rule in ["resetpass", "resetkeys", "resetchannels", "off", "-@all"] {
                    self.apply(rule, catalog)?;
                }
            }
            _ => {
                if let Some(password) = rule.strip_prefix('>') {
                    self.passwords.insert(hash(password.as_bytes()));
                    self.nopass = false;
                } else if let Some(password) = rule.strip_prefix('<') {
                    if !self.passwords.remove(&hash(password.as_bytes())) {
                        return Err(error("no such password"));
                    }
                } else if let Some(digest) = rule.strip_prefix('#') {
                    self.passwords.insert(from_hex(digest.as_bytes()).ok_or_else(|| error(HASH_FORMAT))?);
                    self.nopass = false;
                } else if let Some(digest) = rule.strip_prefix('!') {
                    let digest = from_hex(digest.as_bytes()).ok_or_else(|| error(HASH_FORMAT))?;
                    if !self.passwords.remove(&digest) {
                        return Err(error("no such password"));
                    }
                } else if let Some(pattern) = rule.strip_prefix('~') {
                    self.add_keys(pattern, true, true);
                } else if let Some(rest) = rule.strip_prefix('%') {
                    let (grant, pattern) = rest.split_once('~').ok_or_else(|| error("Syntax error"))?;
                    let grant = grant.to_ascii_uppercase();
                    let (read, write) = (grant.contains('R'), grant.contains('W'));
                    if grant.is_empty() || grant.chars().any(|c| c != 'R' && c != 'W') {
                        return Err(error("Syntax error"));
                    }
                    self.add_keys(pattern, read, write);
                } else if let Some(pattern) = rule.strip_prefix('&') {
                    self.channels.push(pattern.to_string());
                } else if let Some(name) = lower.strip_prefix('+') {
                    self.grant(name, true, catalog)
                        .map_err(|()| error("Unknown command or category name in ACL"))?;
                } else if let Some(name) = lower.strip_prefix('-') {
                    self.grant(name, false, catalog)
                        .map_err(|()| error("Unknown command or category name in ACL"))?;
                } else {
                    return Err(error("Syntax error"));
                }
            }
        }
        Ok(())
    }

    fn add_keys(&mut self, pattern: &str, read: bool, write: bool) {
        match self.keys.iter_mut().find(|key| key.pattern == pattern.as_bytes()) {
            Some(key) => {
                key.read |= read;
                key.write |= write;
            }
            None => self.keys.push(KeyPattern { pattern: pattern.as_bytes().to_vec(), read, write }),
        }
    }

    /// `+name` / `-name` for a command or `@category`.
    fn grant(&mut self, name: &str, allow: bool, catalog: &CommandCatalog) -> Result<(), ()> {
        let names: Vec<&'static str> = match name.strip_prefix('@') {
            Some(category) => catalog.in_category(category).ok_or(())?.to_vec(),
            None => vec![catalog.command(name).ok_or(())?],
        };
        for command in names {
            if allow {
                self.allowed.insert(command);
            } else {
                self.allowed.remove(command);
            }
        }
        let rule = format!("{}{name}", if allow { '+' } else { '-' });
        if name == "@all" {
            self.command_rules.clear();
        }
        self.command_rules.push(rule);
        Ok(())
    }

    /// Every command and every key: no check needed.
    pub fn unrestricted(&self, catalog: &CommandCatalog) -> bool {
        self.allowed.len() == catalog.commands.len()
            && self.keys.iter().any(|key| key.pattern == b"*" && key.read && key.write)
    }

    /// Whether the user may read every key.
    pub fn reads_every_key(&self) -> bool {
        self.keys.iter().any(|key| key.pattern == b"*" && key.read)
    }

    pub fn may_run(&self, command: &str) -> bool {
        self.allowed.contains(command)
    }

    /// Whether the user may read (or write) the key.
    pub fn may_access(&self, key: &[u8], write: bool) -> bool {
        self.keys.iter().any(|pattern| {
            (if write { pattern.write } else { pattern.read }) && glob_match(&pattern.pattern, key)
        })
    }

    /// Whether `password` opens this user; the comparison of hashes takes the
    /// same time wherever they differ.
    pub fn opens_with(&self, password: &[u8]) -> bool {
        if !self.enabled {
            return false;
        }
        let offered = hash(password);
        let matched =
            self.passwords.iter().fold(false, |found, stored| found | bool::from(stored.ct_eq(&offered)));
        self.nopass || matched
    }

    /// On without a password: connections act as this user from the start.
    pub fn is_open(&self) -> bool {
        self.enabled && self.nopass
    }

    pub fn flags(&self) -> Vec<&'static str> {
        let mut flags = vec![if self.enabled { "on" } else { "off" }];
        if self.nopass {
            flags.push("nopass");
        }
        flags
    }

    pub fn password_hashes(&self) -> Vec<String> {
        self.passwords.iter().map(|digest| to_hex(digest)).collect()
    }

    pub fn commands_rule(&self) -> String {
        self.command_rules.join(" ")
    }

    pub fn keys_rule(&self) -> String {
        self.keys.iter().map(KeyPattern::rule).collect::<Vec<_>>().join(" ")
    }

    pub fn channels_rule(&self) -> String {
        self.channels.iter().map(|channel| format!("&{channel}")).collect::<Vec<_>>().join(" ")
    }

    /// The user as one ACL LIST line, which ACL SETUSER reads back.
    pub fn describe(&self) -> String {
        format!("user {} {}", self.name, self.rules())
    }

    /// The rules that make this user from nothing, as ACL LIST writes them.
    pub fn rules(&self) -> String {
        let mut parts = Vec::new();
        parts.extend(self.flags().into_iter().map(String::from));
        parts.extend(self.password_hashes().into_iter().map(|digest| format!("#{digest}")));
        for rule in [self.keys_rule(), self.channels_rule(), self.commands_rule()] {
            if !rule.is_empty() {
                parts.push(rule);
            }
        }
        parts.join(" ")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AclError {
    #[error(transparent)]
    Rule(#[from] RuleError),
    #[error("{path}:{line}: {message}")]
    File { path: String, line: usize, message: String },
    #[error("cannot write {0}: {1}")]
    Save(String, std::io::Error),
    #[error("The 'default' user cannot be removed")]
    DefaultUser,
}

/// The node's users.
pub struct Acl {
    catalog: CommandCatalog,
    users: RwLock<BTreeMap<String, Arc<User>>>,
    /// The `default` user as the configuration makes it (`password`).
    configured_default: Arc<User>,
    /// The cluster's users last adopted from the map (a cluster node only).
    adopted: Mutex<Option<BTreeMap<String, String>>>,
    /// Bumped on every change, so connections know to look their user up again.
    generation: AtomicU64,
    path: PathBuf,
}

impl Acl {
    /// The users saved under `dir`, or only the default user (with
    /// `password`, or open) when there are none.
    pub fn open(dir: &Path, password: Option<&str>, catalog: CommandCatalog) -> Result<Self, AclError> {
        let path = dir.join(FILE_NAME);
        let mut users = BTreeMap::new();
        let password = password.map_or_else(|| "nopass".to_string(), |password| format!(">{password}"));
        let rules = ["on", "~*", "&*", "+@all", password.as_str()];
        let configured_default = Arc::new(User::after(None, DEFAULT_USER, rules, &catalog)?);
        users.insert(DEFAULT_USER.to_string(), configured_default.clone());
        if let Ok(text) = std::fs::read_to_string(&path) {
            for (index, line) in text.lines().enumerate() {
                let failed = |message: String| AclError::File {
                    path: path.display().to_string(),
                    line: index + 1,
                    message,
                };
                let mut words = line.split_whitespace();
                match (words.next(), words.next()) {
                    (None, _) => continue,
                    (Some("user"), Some(name)) => {
                        let user = User::after(None, name, words, &catalog)
                            .map_err(|error| failed(error.to_string()))?;
                        users.insert(name.to_string(), Arc::new(user));
                    }
                    _ => return Err(failed("expected `user <name> <rules>`".into())),
                }
            }
        }
        Ok(Self {
            catalog,
            users: RwLock::new(users),
            configured_default,
            adopted: Mutex::new(None),
            generation: AtomicU64::new(0),
            path,
        })
    }

    pub fn catalog(&self) -> &CommandCatalog {
        &self.catalog
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn user(&self, name: &str) -> Option<Arc<User>> {
        self.users.read().get(name).cloned()
    }

    pub fn users(&self) -> Vec<Arc<User>> {
        self.users.read().values().cloned().collect()
    }

    /// Creates or changes a user; nothing changes if a rule is refused.
    pub fn set_user(&self, name: &str, rules: &[&str]) -> Result<(), AclError> {
        let mut users = self.users.write();
        let user =
            User::after(users.get(name).map(|user| &**user), name, rules.iter().copied(), &self.catalog)?;
        users.insert(name.to_string(), Arc::new(user));
        self.changed(&users)
    }

    /// The rules user `name` would have after `rules`, applied to it as it
    /// is here (or to a new user): what a cluster node asks the coordinator
    /// to store. Refused as ACL SETUSER refuses.
    pub fn proposed(&self, name: &str, rules: &[&str]) -> Result<String, AclError> {
        let user = User::after(self.user(name).as_deref(), name, rules.iter().copied(), &self.catalog)?;
        Ok(user.rules())
    }

    /// Serves exactly the cluster's users (name → rules), and this node's
    /// configured `default` user unless they include one. A user whose rules
    /// this node cannot apply (a command it does not know) is left out, with
    /// an error logged: it cannot log in here rather than get more rights.
    /// Nothing is written to `users.acl`.
    pub fn adopt(&self, cluster_users: &BTreeMap<String, String>) {
        let mut adopted = self.adopted.lock();
        if adopted.as_ref() == Some(cluster_users) {
            return;
        }
        let mut users = BTreeMap::new();
        users.insert(DEFAULT_USER.to_string(), self.configured_default.clone());
        for (name, rules) in cluster_users {
            match User::after(None, name, rules.split_whitespace(), &self.catalog) {
                Ok(user) => {
                    users.insert(name.clone(), Arc::new(user));
                }
                Err(error) => {
                    users.remove(name); // the node's own default too, if it is that one
                    tracing::error!(user = %name, %error, "a user of the cluster cannot be served here");
                }
            }
        }
        *self.users.write() = users;
        self.generation.fetch_add(1, Ordering::Release);
        *adopted = Some(cluster_users.clone());
    }

    /// Deletes users; how many there were. `default` cannot be deleted.
    pub fn delete_users(&self, names: &[&str]) -> Result<usize, AclError> {
        if names.contains(&DEFAULT_USER) {
            return Err(AclError::DefaultUser);
        }
        let mut users = self.users.write();
        let deleted = names.iter().filter(|name| users.remove(**name).is_some()).count();
        self.changed(&users)?;
        Ok(deleted)
    }

    fn changed(&self, users: &BTreeMap<String, Arc<User>>) -> Result<(), AclError> {
        self.generation.fetch_add(1, Ordering::Release);
        let text: String = users.values().map(|user| user.describe() + "\n").collect();
        let temporary = self.path.with_extension("acl.tmp");
        let saved = std::fs::write(&temporary, text).and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o600))?;
            std::fs::rename(&temporary, &self.path)
        });
        saved.map_err(|error| AclError::Save(self.path.display().to_string(), error))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few commands, categorised as the commands module would.
    fn catalog() -> CommandCatalog {
        let commands = [
            ("get", vec!["all", "string", "read", "fast"]),
            ("set", vec!["all", "string", "write", "slow"]),
            ("del", vec!["all", "keyspace", "write", "slow"]),
            ("keys", vec!["all", "keyspace", "read", "slow", "dangerous"]),
            ("hget", vec!["all", "hash", "read", "fast"]),
            ("hdel", vec!["all", "hash", "write", "fast"]),
        ];
        CommandCatalog::new(commands.into_iter())
    }

    fn user(rules: &[&str]) -> User {
        User::after(None, "alice", rules.iter().copied(), &catalog()).unwrap()
    }

    #[test]
    fn rules_grant_commands_keys_and_passwords() {
        let alice = user(&["on", ">secret", "~cache:*", "%R~shared:*", "+@read", "-keys", "+set"]);
        assert!(alice.opens_with(b"secret") && !alice.opens_with(b"guess"));
        assert!(
            alice.may_run("get") && alice.may_run("set") && !alice.may_run("keys") && !alice.may_run("del")
        );
        assert!(alice.may_access(b"cache:1", true) && alice.may_access(b"shared:x", false));
        assert!(!alice.may_access(b"shared:x", true) && !alice.may_access(b"other", false));
        assert!(!alice.unrestricted(&catalog()));
        assert!(user(&["+@all", "allkeys"]).unrestricted(&catalog()));
        assert_eq!(alice.commands_rule(), "-@all +@read -keys +set");
        assert_eq!(alice.keys_rule(), "~cache:* %R~shared:*");
        assert!(!alice.describe().contains("secret"), "only the hash is kept");
    }

    #[test]
    fn a_described_user_reads_back_the_same() {
        let alice = user(&["on", ">secret", "~a*", "%W~b*", "&news", "+@hash", "-hdel"]);
        let line = alice.describe();
        let rules: Vec<&str> = line.split_whitespace().skip(2).collect();
        let again = user(&rules);
        assert_eq!(again.describe(), line);
        assert!(again.opens_with(b"secret"));
    }

    #[test]
    fn bad_rules_are_refused_by_name() {
        let mut alice = User::new("alice");
        for (rule, reason) in [
            ("+nosuch", "Unknown command or category name in ACL"),
            ("+@nosuch", "Unknown command or category name in ACL"),
            ("bogus", "Syntax error"),
            ("%X~k", "Syntax error"),
            ("#abc", HASH_FORMAT),
        ] {
            assert_eq!(alice.apply(rule, &catalog()), Err(RuleError { rule: rule.into(), reason }));
        }
        assert!(!alice.enabled && !alice.opens_with(b""), "a new user is off");
    }

    #[test]
    fn users_are_saved_and_read_back_without_their_passwords() {
        let dir = tempfile::tempdir().unwrap();
        let acl = Acl::open(dir.path(), Some("admin-secret"), catalog()).unwrap();
        acl.set_user("alice", &["on", ">pw", "~k*", "+get"]).unwrap();
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
        assert!(!text.contains("pw ") && !text.contains("admin-secret"), "{text}");
        let reopened = Acl::open(dir.path(), None, catalog()).unwrap();
        let alice = reopened.user("alice").unwrap();
        assert!(alice.opens_with(b"pw") && alice.may_run("get") && !alice.may_run("set"));
        assert!(reopened.user(DEFAULT_USER).unwrap().opens_with(b"admin-secret"), "saved, it wins");
        assert!(matches!(reopened.delete_users(&["alice", "default"]), Err(AclError::DefaultUser)));
        assert_eq!(reopened.delete_users(&["alice", "nobody"]).unwrap(), 1);
    }

    #[test]
    fn a_cluster_node_serves_exactly_the_clusters_users_and_its_own_default() {
        let dir = tempfile::tempdir().unwrap();
        let acl = Acl::open(dir.path(), Some("node-password"), catalog()).unwrap();
        acl.set_user("local", &["on", "nopass"]).unwrap();
        let alice = acl.proposed("alice", &["on", ">pw", "+get"]).unwrap();
        assert!(acl.user("alice").is_none(), "a proposal changes nothing here");
        let mut cluster_users =
            BTreeMap::from([("alice".to_string(), alice), ("bob".to_string(), "+nosuch".into())]);
        let before = acl.generation();
        acl.adopt(&cluster_users);
        assert!(acl.user("alice").unwrap().opens_with(b"pw"));
        assert!(acl.user("local").is_none(), "the node's own users give way to the cluster's");
        assert!(acl.user("bob").is_none(), "rules this node cannot apply leave the user out");
        assert!(acl.user(DEFAULT_USER).unwrap().opens_with(b"node-password"));
        assert!(acl.generation() > before);
        let adopted = acl.generation();
        acl.adopt(&cluster_users);
        assert_eq!(acl.generation(), adopted, "the same users again change nothing");
        cluster_users.insert(
            DEFAULT_USER.into(),
            acl.proposed(DEFAULT_USER, &["resetpass", ">cluster-wide"]).unwrap(),
        );
        acl.adopt(&cluster_users);
        let default = acl.user(DEFAULT_USER).unwrap();
        assert!(default.opens_with(b"cluster-wide") && !default.opens_with(b"node-password"));
        assert!(!std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap().contains("alice"), "not saved");
    }
}
