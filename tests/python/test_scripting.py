"""Scripts (EVAL, EVALSHA, SCRIPT) against a real Redis: the same scripts
must answer the same, errors and their wording included; a script that
runs too long makes other clients BUSY until SCRIPT KILL stops it, on both;
and scripts are atomic under concurrency on Tessera's many threads."""

import threading
import time

import pytest
import redis

from conftest import Node

# Each: (script, keys, args). Run on both servers, one after another on
# the same data, replies compared exactly.
CASES = [
    ("return redis.call('set', KEYS[1], ARGV[1])", ["s"], ["abc"]),
    ("return redis.call('incr', KEYS[1])", ["s"], []),
    ("return redis.pcall('incr', KEYS[1])", ["s"], []),
    ("return redis.call('incr', KEYS[1])", ["n"], []),
    ("return redis.error_reply('My Error')", [], []),
    ("return redis.error_reply('-CODE with a dash')", [], []),
    ("return redis.status_reply('FINE')", [], []),
    ("return {err='x'}", [], []),
    ("return {ok='x', err='y'}", [], []),
    ("return {1, 2, {3, 'a'}, nil, 5}", [], []),
    ("return {1, {err='inner'}, 3}", [], []),
    ("return {1, {err='ERR reached lua stack limit'}}", [], []),
    ("return 3.99", [], []),
    ("return -3.7", [], []),
    ("return 1e30", [], []),
    ("return true", [], []),
    ("return false", [], []),
    ("return nil", [], []),
    ("return", [], []),
    ("return redis.call('nosuch')", [], []),
    ("return redis.pcall('nosuch')", [], []),
    ("return redis.call('get')", [], []),
    ("return redis.call()", [], []),
    ("return redis.call('get', {})", [], []),
    ("return redis.call('multi')", [], []),
    ("return redis.call('eval', 'return 1', 0)", [], []),
    ("x = 1", [], []),
    ("return y", [], []),
    ("string.x = 1", [], []),
    ("rawset(_G, 'x', 1)", [], []),
    ("return type(getfenv)", [], []),
    ("return _G == _G._G", [], []),
    ("error('boom')", [], []),
    ("error({err='BAD thing'})", [], []),
    ("local ok, e = pcall(redis.call, 'nosuch') return e", [], []),
    ("local ok, e = pcall(redis.call, 'incr', KEYS[1]) return type(e)", ["s"], []),
    ("local ok, e = pcall(cjson.decode, '{') return e", [], []),
    ("retur n", [], []),
    ("return cjson.encode({1, 2, {a=1}})", [], []),
    ("return cjson.encode({})", [], []),
    ("return cjson.encode(function() end)", [], []),
    ("return cjson.decode('{')", [], []),
    ("return cjson.decode('[1,2,3')", [], []),
    ("return cjson.decode('[1,null,3]')", [], []),
    ("return cjson.decode(ARGV[1]).a.b", [], ['{"a":{"b":"deep"}}']),
    ("return tostring(cjson.decode('[1,null,3]')[2])", [], []),
    ("return bit.band(7, 3)", [], []),
    ("return bit.tohex(65535, -4)", [], []),
    ("return bit.band('x')", [], []),
    ("return redis.sha1hex('')", [], []),
    ("return redis.sha1hex(nil)", [], []),
    ("return loadstring('return 1')()", [], []),
    ("return {KEYS[1], KEYS[2], ARGV[1], ARGV[2], #KEYS, #ARGV}", ["k1", "k2"], ["a1", "a2"]),
    ("redis.call('hset', KEYS[1], 'f', '1') redis.setresp(3) return redis.call('hgetall', KEYS[1])", ["h"], []),
    ("redis.setresp(3) return redis.call('get', 'missing')", [], []),
    ("return redis.setresp(4)", [], []),
    ("redis.call('rpush', KEYS[1], 'a', 'b') return redis.call('blpop', KEYS[1], 0)", ["l"], []),
    ("return redis.call('blpop', 'empty', 0)", [], []),
    ("return redis.call('zadd', KEYS[1], 1, 'm', 2, 'n')", ["z"], []),
    ("return redis.call('zrange', KEYS[1], 0, -1, 'WITHSCORES')", ["z"], []),
    ("#!lua flags=no-writes\nreturn redis.call('set', KEYS[1], 1)", ["s"], []),
    ("#!lua flags=no-writes\nreturn redis.call('get', KEYS[1])", ["s"], []),
    ("#!lua flags=no-such-flag\nreturn 1", [], []),
    ("#!python\nreturn 1", [], []),
    ("return redis.REDIS_VERSION ~= nil", [], []),
]


def normal(value):
    """Errors inside replies as comparable values."""
    if isinstance(value, redis.ResponseError):
        return ("error", str(value))
    if isinstance(value, list):
        return [normal(item) for item in value]
    return value


def reply(client, *command):
    try:
        return normal(client.execute_command(*command))
    except redis.ResponseError as error:
        return ("error", str(error))


@pytest.fixture
def both(node, redis_server):
    ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
    for client in (ours, theirs):
        client.response_callbacks.clear()
        client.execute_command("FLUSHALL")
    yield ours, theirs
    ours.close()
    theirs.close()


def test_scripts_answer_as_on_redis(both):
    ours, theirs = both
    for body, keys, args in CASES:
        for command in (["EVAL", body, len(keys), *keys, *args], ["EVAL_RO", body, len(keys), *keys, *args]):
            expected, got = reply(theirs, *command), reply(ours, *command)
            assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"
    for client in (ours, theirs):
        assert client.execute_command("KEYS", "*") is not None
    assert sorted(ours.execute_command("KEYS", "*")) == sorted(theirs.execute_command("KEYS", "*"))


def test_a_reply_nested_past_the_limit_is_one_error(node):
    """Redis answers a table that holds itself with thousands of nested
    arrays around the error; Tessera answers the error alone."""
    client = node.client()
    with pytest.raises(redis.ResponseError, match="^reached lua stack limit$"):
        client.eval("local t = {} t[1] = t return t", 0)
    client.close()


def test_the_script_cache_matches_redis(both):
    ours, theirs = both
    body = "return ARGV[1] .. '!'"
    sequence = [
        ["EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0],
        ["SCRIPT", "LOAD", body],
        ["SCRIPT", "LOAD", "retur n"],
        ["SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "nope"],
        ["EVAL", "return 1", 0],
        ["SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "E0E1F9FABFC9D4800C877A703B823AC0578FF8DB"],
        ["EVALSHA", "short", 0],
        ["EVALSHA", "ffffffffffffffffffffffffffffffffffffffff", 2, "a"],
        ["SCRIPT", "FLUSH", "nonsense"],
        ["SCRIPT", "FLUSH", "SYNC"],
        ["SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"],
        ["SCRIPT", "KILL"],
        ["SCRIPT", "NOSUCH"],
        ["SCRIPT", "LOAD"],
        ["EVAL", "return 1", -1],
        ["EVAL", "return 1", "x"],
        ["EVAL", "return 1", 3, "a"],
        ["MULTI"], ["EVAL", "return redis.call('incr', KEYS[1])", 1, "m"], ["SCRIPT", "EXISTS"], ["EXEC"],
        ["MULTI"], ["EVAL", "return redis.call('incr', KEYS[1])", 1, "m"], ["EXEC"],
    ]
    sha = theirs.execute_command("SCRIPT", "LOAD", body).decode()
    sequence += [["EVALSHA", sha, 0, "x"], ["EVALSHA", sha.upper(), 0, "y"], ["EVALSHA_RO", sha, 0, "z"]]
    for command in sequence:
        expected, got = reply(theirs, *command), reply(ours, *command)
        assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"


def test_redis_py_scripts_load_themselves_and_resp3_replies_match(node, redis_server):
    """redis-py's register_script sends EVALSHA and loads the script on
    NOSCRIPT; a RESP3 client reads a script's map, set and double replies."""
    for port in (node.port, redis_server):
        client = redis.Redis(port=port, protocol=2)
        client.flushall()
        client.script_flush()
        take = client.register_script(
            "local job = redis.call('rpoplpush', KEYS[1], KEYS[2]) "
            "if job then redis.call('hset', KEYS[3], job, ARGV[1]) end return job"
        )
        client.rpush("{q}waiting", "j1", "j2")
        assert take(keys=["{q}waiting", "{q}active", "{q}owners"], args=["worker-1"]) == b"j2"
        assert client.hgetall("{q}owners") == {b"j2": b"worker-1"}
        client.close()
    replies = []
    for port in (node.port, redis_server):
        client = redis.Redis(port=port, protocol=3)
        client.response_callbacks.clear()
        body = ("redis.setresp(3) return {redis.call('hgetall', KEYS[1]), {double=2.5}, {set={a=true}}, "
                "{map={k='v'}}, true, false}")
        replies.append(client.execute_command("EVAL", body, 1, "{q}owners"))
        client.close()
    assert replies[0] == replies[1], replies


def busy_sequence(port, ready_limit_ms):
    """What clients see around a looping script: BUSY from others, SCRIPT
    KILL, the script's end; then UNKILLABLE for one that wrote first."""
    seen = []
    looping = redis.Redis(port=port, protocol=2, socket_timeout=30)
    result = {}

    def run(body, key):
        try:
            result[key] = looping.execute_command("EVAL", body, 0)
        except redis.ResponseError as error:
            result[key] = ("error", str(error).split(" script:")[0])

    thread = threading.Thread(target=run, args=("local i = 0 while true do i = i + 1 end", "loop"))
    thread.start()
    time.sleep(ready_limit_ms / 1000 * 2)
    # Many connections: whichever thread serves them, each is answered BUSY.
    others = [redis.Redis(port=port, protocol=2, socket_timeout=10) for _ in range(6)]
    seen.append(sorted({str(reply(other, "GET", "k")) for other in others}))
    seen.append(reply(others[0], "SCRIPT", "KILL"))
    thread.join(timeout=20)
    assert not thread.is_alive(), "SCRIPT KILL did not stop the script"
    seen.append(result["loop"])
    seen.append(reply(others[0], "SCRIPT", "KILL"))
    thread = threading.Thread(target=run, args=(
        "redis.call('set', 'written', 1) local i = 0 while i < 3e7 do i = i + 1 end return i", "wrote"))
    thread.start()
    deadline = time.time() + 10
    while time.time() < deadline and not str(reply(others[1], "PING")).startswith("('error', 'BUSY"):
        time.sleep(0.02)
    seen.append(reply(others[1], "SCRIPT", "KILL"))
    thread.join(timeout=120)
    seen.append(result["wrote"])
    seen.append(reply(others[1], "GET", "written"))
    for client in [looping, *others]:
        client.close()
    return seen


def test_a_long_script_is_busy_until_killed_as_on_redis(tmp_path, redis_server):
    limit_ms = 200
    redis.Redis(port=redis_server).config_set("lua-time-limit", limit_ms)
    theirs = busy_sequence(redis_server, limit_ms)
    node = Node(tmp_path, "--busy-reply-threshold-ms", str(limit_ms), "--threads", "2").start()
    try:
        ours = busy_sequence(node.port, limit_ms)
    finally:
        node.stop()
    assert ours == theirs
    assert theirs[0] == [str(("error", "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."))]


def test_scripts_are_atomic_under_concurrency(node):
    """Read-modify-write scripts from many clients lose no update, whether
    they declare their keys or not (one an undeclared key locks as it goes)."""
    increment = "local v = tonumber(redis.call('get', KEYS[1]) or '0') redis.call('set', KEYS[1], v + 1)"
    undeclared = ("local v = tonumber(redis.call('get', ARGV[1]) or '0') "
                  "redis.call('set', ARGV[1], v + 1) return v")
    transfer = ("local a = tonumber(redis.call('get', KEYS[1])) local b = tonumber(redis.call('get', KEYS[2])) "
                "redis.call('set', KEYS[1], a - 1) redis.call('set', KEYS[2], b + 1)")
    setup = node.client()
    setup.mset({"{acct}a": 10000, "{acct}b": 0})
    errors = []

    def worker():
        client = node.client()
        try:
            for _ in range(150):
                client.eval(increment, 1, "counter")
                client.eval(undeclared, 0, "loose-counter")
                client.eval(transfer, 2, "{acct}a", "{acct}b")
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert setup.get("counter") == b"1200"
    assert setup.get("loose-counter") == b"1200"
    assert int(setup.get("{acct}a")) + int(setup.get("{acct}b")) == 10000
    assert setup.get("{acct}b") == b"1200"
    setup.close()
