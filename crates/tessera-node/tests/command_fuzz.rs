//! Random commands with random arguments, run against a real node state: no input
//! may panic the node, and every command must produce exactly one whole reply.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use tessera_node::clock::now_ms;
use tessera_node::commands::{all_commands, dispatch, Context, Session};
use tessera_node::config::Config;
use tessera_node::node_state::{NodeState, WorkerStats};
use tessera_wire::{parse_value, Protocol, ReplyWriter, Request, Value};

fn argument() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Words commands understand, so that handlers get past their parsers.
        prop::sample::select(vec![
            "k",
            "h",
            "0",
            "1",
            "-1",
            "10",
            "9223372036854775807",
            "-9223372036854775808",
            "EX",
            "PX",
            "NX",
            "XX",
            "GET",
            "KEEPTTL",
            "MATCH",
            "COUNT",
            "TYPE",
            "hash",
            "string",
            "*",
            "PREFIX",
            "ENGINE",
            "memory",
            "ordered",
            "t",
            "p:",
            "AUTH",
            "SETNAME",
            "GT",
            "LT",
            "INFO",
            "LIST",
            "DOCS",
            "GETKEYS",
            "2",
            "3",
        ])
        .prop_map(|word| word.as_bytes().to_vec()),
        proptest::collection::vec(any::<u8>(), 0..12),
    ]
}

fn command() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let names: Vec<&'static str> =
        all_commands().map(|spec| spec.name).filter(|name| *name != "table.drop").collect();
    (prop::sample::select(names), proptest::collection::vec(argument(), 0..7)).prop_map(|(name, mut args)| {
        args.insert(0, name.as_bytes().to_vec());
        args
    })
}

/// Runs one command the way a connection does and returns its raw reply.
fn run(
    node: &Arc<NodeState>,
    stats: &Arc<WorkerStats>,
    session: &mut Session,
    protocol: Protocol,
    args: &[Vec<u8>],
) -> Vec<u8> {
    let mut buffer = Vec::new();
    let mut ranges = Vec::new();
    for arg in args {
        ranges.push(buffer.len()..buffer.len() + arg.len());
        buffer.extend_from_slice(arg);
    }
    let tables = node.tables();
    let mut out = ReplyWriter::new(protocol);
    let mut context = Context {
        node,
        tables: &tables,
        session,
        out: &mut out,
        stats,
        cluster: None,
        now_ms: now_ms(),
        engine_override: None,
        locks_held: false,
    };
    dispatch(&mut context, &Request::new(&buffer, &ranges));
    if let Some(script) = session.script.take() {
        // A script answers from its thread, as a connection would wait for.
        out.raw(&script.blocking_recv().expect("a script thread answers").reply);
    }
    out.as_bytes().to_vec()
}

#[test]
fn random_commands_never_panic_and_always_reply_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config { dir: dir.path().to_path_buf(), ..Config::default() };
    let node = Arc::new(NodeState::open(config, tessera_node::commands::acl::catalog()).unwrap());
    // Half the cases run as a user with some commands and keys only, so the
    // permission checks see every command too.
    node.acl.set_user("restricted", &["on", "nopass", "~k*", "%R~a*", "+@read", "+@string", "-get"]).unwrap();
    let stats = node.new_worker_stats(tessera_node::commands::command_count());
    let cases = tessera_testkit::fuzz_cases(2000);
    let mut runner =
        TestRunner::new(RunnerConfig { cases, failure_persistence: None, ..RunnerConfig::default() });
    runner
        .run(
            &(proptest::collection::vec(command(), 1..20), any::<bool>(), any::<bool>()),
            |(commands, resp3, restricted)| {
                let protocol = if resp3 { Protocol::Resp3 } else { Protocol::Resp2 };
                let user = if restricted { "restricted" } else { "default" };
                let mut session = Session { authenticated: true, user: user.into(), ..Session::default() };
                for args in &commands {
                    let mut reply = run(&node, &stats, &mut session, protocol, args);
                    if let Some(blocked) = &mut session.blocked {
                        // A blocking command that found nothing answers nothing
                        // until its connection wakes it: here, at its deadline.
                        prop_assert!(reply.is_empty(), "a blocked command answered {:?}", reply);
                        blocked.timed_out = true;
                        reply = run(&node, &stats, &mut session, protocol, args);
                        prop_assert!(
                            session.blocked.is_none(),
                            "still blocked past the deadline: {:?}",
                            args
                        );
                    }
                    // (Un)subscribing answers once per channel, as in Redis.
                    let name = String::from_utf8_lossy(&args[0]).to_ascii_lowercase();
                    let replies_per_channel = name.ends_with("subscribe") && !reply.starts_with(b"-");
                    let mut at = 0;
                    let mut values = Vec::new();
                    while at < reply.len() {
                        let parsed = parse_value(&reply[at..])
                            .map_err(|error| TestCaseError::fail(error.to_string()))?;
                        let (value, used) = parsed
                            .ok_or_else(|| TestCaseError::fail(format!("incomplete reply to {args:?}")))?;
                        values.push(value);
                        at += used;
                    }
                    prop_assert!(!values.is_empty(), "no reply to {:?}", args);
                    prop_assert!(
                        values.len() == 1 || replies_per_channel,
                        "more than one reply to {:?}",
                        args
                    );
                    let value = values.swap_remove(0);
                    if let Value::Error(message) = &value {
                        prop_assert!(
                            message
                                .split(' ')
                                .next()
                                .is_some_and(|code| code.chars().all(|c| c.is_ascii_uppercase())),
                            "error without a code: {}",
                            message
                        );
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}
