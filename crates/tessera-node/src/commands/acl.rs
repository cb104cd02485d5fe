//! ACL SETUSER, GETUSER, DELUSER, LIST, USERS, WHOAMI, CAT, GENPASS
//! (the users themselves: [`crate::acl`]).

use rand::RngCore;
use tessera_cluster::auth::to_hex;
use tessera_wire::Request;

use super::{commands_by_family, is, CommandSpec, Context, Scope};
use crate::acl::{AclError, CommandCatalog};
use crate::error::{CommandError, CommandResult};

/// ACL's subcommands and their arities.
pub const SUBCOMMANDS: &[(&str, i32)] = &[
    ("cat", -2),
    ("deluser", -3),
    ("genpass", -2),
    ("getuser", 3),
    ("list", 2),
    ("setuser", -3),
    ("users", 2),
    ("whoami", 2),
];

#[rustfmt::skip]
pub const COMMANDS: &[CommandSpec] = &[
    CommandSpec { name: "acl", arity: -2, flags: &["admin", "noscript", "loading", "stale"], first_key: 0, last_key: 0, step: 0, scope: Scope::Users, handler: acl },
];

/// The categories a command belongs to: its family, what its flags say, and
/// Redis's own exceptions, as Redis 7 files its commands (the node's server
/// commands have no family there); `@tessera` and `@cluster` are Tessera's.
pub(super) fn categories(family: &'static str, spec: &CommandSpec) -> Vec<&'static str> {
    let family = match spec.name {
        "setbit" | "getbit" | "bitcount" | "bitpos" | "bitop" | "bitfield" | "bitfield_ro" => Some("bitmap"),
        "readonly" | "readwrite" | "asking" | "command" | "wait" => Some("connection"),
        "migrate" => Some("keyspace"),
        "sort" | "sort_ro" => None,
        _ if family == "server" => None,
        _ => Some(family),
    };
    let mut categories = vec!["all"];
    categories.extend(family);
    // A script is checked command by command as it runs, not as a read or
    // a write.
    let flagged: &[(&str, &str)] = if family == Some("scripting") {
        &[("admin", "admin")]
    } else {
        &[("readonly", "read"), ("write", "write"), ("admin", "admin")]
    };
    for (flag, category) in flagged.iter().chain(&[("blocking", "blocking")]) {
        if spec.flags.contains(flag) {
            categories.push(category);
        }
    }
    if matches!(spec.name, "sort" | "sort_ro") {
        categories.extend(["set", "sortedset", "list"]);
    }
    categories.push(if spec.flags.contains(&"fast") { "fast" } else { "slow" });
    let dangerous = [
        "flushdb",
        "flushall",
        "keys",
        "config",
        "info",
        "migrate",
        "restore",
        "restore-asking",
        "sort",
        "sort_ro",
        "table.create",
        "table.drop",
    ];
    if spec.flags.contains(&"admin") || dangerous.contains(&spec.name) {
        categories.push("dangerous");
    }
    categories
}

/// Every command with its categories, for the node's users to be checked against.
pub fn catalog() -> CommandCatalog {
    CommandCatalog::new(commands_by_family().map(|(family, spec)| (spec.name, categories(family, spec))))
}

pub fn text(arg: &[u8]) -> CommandResult<&str> {
    std::str::from_utf8(arg).map_err(|_| CommandError::Other("ACL arguments must be UTF-8".into()))
}

pub fn acl_error(error: AclError) -> CommandError {
    CommandError::Other(error.to_string())
}

fn acl(context: &mut Context, request: &Request) -> CommandResult {
    let subcommand = request.arg(1);
    let wrong_arity =
        || CommandError::SubcommandSyntax(String::from_utf8_lossy(subcommand).into_owned(), "ACL");
    let acl = &context.node.acl;
    let out = &mut *context.out;
    if is(subcommand, "setuser") && request.len() >= 3 {
        let name = text(request.arg(2))?;
        let rules = request.args().skip(3).map(text).collect::<CommandResult<Vec<_>>>()?;
        acl.set_user(name, &rules).map_err(acl_error)?;
        out.ok();
    } else if is(subcommand, "getuser") && request.len() == 3 {
        let Some(user) = acl.user(text(request.arg(2))?) else {
            out.null();
            return Ok(());
        };
        out.map(6);
        out.bulk(b"flags");
        let flags = user.flags();
        out.array(flags.len());
        for flag in flags {
            out.bulk(flag.as_bytes());
        }
        out.bulk(b"passwords");
        let hashes = user.password_hashes();
        out.array(hashes.len());
        for digest in hashes {
            out.bulk(digest.as_bytes());
        }
        for (field, rule) in [
            ("commands", user.commands_rule()),
            ("keys", user.keys_rule()),
            ("channels", user.channels_rule()),
        ] {
            out.bulk(field.as_bytes());
            out.bulk(rule.as_bytes());
        }
        out.bulk(b"selectors");
        out.array(0);
    } else if is(subcommand, "deluser") && request.len() >= 3 {
        let names = request.args().skip(2).map(text).collect::<CommandResult<Vec<_>>>()?;
        let deleted = acl.delete_users(&names).map_err(acl_error)?;
        out.integer(deleted as i64);
    } else if is(subcommand, "list") && request.len() == 2 {
        let users = acl.users();
        out.array(users.len());
        for user in users {
            out.bulk(user.describe().as_bytes());
        }
    } else if is(subcommand, "users") && request.len() == 2 {
        let users = acl.users();
        out.array(users.len());
        for user in users {
            out.bulk(user.name.as_bytes());
        }
    } else if is(subcommand, "whoami") && request.len() == 2 {
        out.bulk(context.session.user.as_bytes());
    } else if is(subcommand, "cat") && request.len() <= 3 {
        let names: Vec<&str> = match request.len() {
            2 => acl.catalog().categories().collect(),
            _ => {
                let category = text(request.arg(2))?.to_ascii_lowercase();
                let commands = acl.catalog().in_category(&category);
                commands
                    .ok_or_else(|| CommandError::Other(format!("Unknown category '{category}'")))?
                    .to_vec()
            }
        };
        out.array(names.len());
        for name in names {
            out.bulk(name.as_bytes());
        }
    } else if is(subcommand, "genpass") && request.len() <= 3 {
        let bits = match request.len() {
            2 => 256,
            _ => match text(request.arg(2))?.parse::<usize>() {
                Ok(bits) if (1..=4096).contains(&bits) => bits,
                _ => return Err(CommandError::Other("ACL GENPASS argument must be the number of bits for the output password, a positive number up to 4096".into())),
            },
        };
        let mut bytes = vec![0u8; bits.div_ceil(8)];
        rand::thread_rng().fill_bytes(&mut bytes);
        out.bulk(&to_hex(&bytes).as_bytes()[..bits.div_ceil(4)]);
    } else {
        return Err(wrong_arity());
    }
    Ok(())
}
