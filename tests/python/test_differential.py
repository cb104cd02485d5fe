"""Differential testing against a real Redis: seeded random sequences of the
commands Tessera serves (strings, keys, hashes, sorted sets, lists, sets,
scripts, and transactions around them, mixed on a few
keys so that types collide) go to a Tessera node and to Debian's
redis-server, and every reply and the final state must be the same,
errors included (wrong type, wrong arity, syntax, not an integer).

Differences that are allowed, and how the comparison absorbs them:
- the order of KEYS and SCAN replies (sorted before comparing);
- TTL, PTTL, EXPIRETIME and PEXPIRETIME while a deadline runs (compared
  as "has one" or not: the two servers read their clocks at different
  moments). For the same reason GT and LT come only with absolute
  deadlines (EXPIREAT): two relative deadlines of the same length set one
  millisecond apart on one server and within one on the other compare
  differently;
- which key RANDOMKEY picks (compared as "one" or "none"), which members
  SRANDMEMBER and fields HRANDFIELD pick (compared by number) and the order of a set's members
  (sorted); SPOP is sent only to take every member;
- SSCAN's, HSCAN's and ZSCAN's cursors and order (what a whole scan
  returns is compared: Redis scans a large sorted set in its hash table's
  order);
- SORT's order where Redis's is its own: BY without "*" on a set (Redis
  answers in the set's layout order; Tessera sorts by bytes), and BY ...
  ALPHA, whose ties Redis's sort orders as it happens to (compared as
  multisets, and by length under LIMIT);
- ALPHA compares bytes; Redis uses the locale's collation, the same order
  in the C locale the test runs Redis under.

- how a score that needs 17 digits prints: Redis 7.0 prints 17
  significant digits (2.1428571428571428), Tessera the shortest form that
  reads back as the same double (2.142857142857143), as Redis 7.2 and
  later do. The final state compares scores as numbers; the sequences use
  scores that print alike.

Not sent: other databases than 0 (SELECT 1, COPY … DB 1): Tessera has one
database, and tables take their place.

CI runs a fixed budget; a longer run is one command:

    TESSERA_DIFF_SEQUENCES=2000 TESSERA_DIFF_SEED=7 pytest tests/python/test_differential.py
"""

import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import redis

from conftest import Node, free_port, resp_command

SEQUENCES = int(os.environ.get("TESSERA_DIFF_SEQUENCES", "60"))
FIRST_SEED = int(os.environ.get("TESSERA_DIFF_SEED", "1"))
COMMANDS_PER_SEQUENCE = 250

KEYS = ["a", "b", "c", "{t}x", "{t}y"]
FIELDS = ["f1", "f2", "f3", "field-4", ""]
VALUES = ["", "0", "1", "-7", "12", "9223372036854775807", "-9223372036854775808", "3.5", "abc", "x" * 40,
          "ohmytext", "mynewtext"]


def integer(rng):
    return rng.choice([0, 1, -1, 5, 100, -100, 9223372036854775807, "nope", "1.5", ""])


def strings(rng, key):
    value = rng.choice(VALUES)
    return rng.choice([
        ["SET", key, value],
        ["SET", key, value, rng.choice(["NX", "XX", "GET", "KEEPTTL"])],
        ["SET", key, value, "EX", rng.choice([100, 0, -1, "x"])],
        ["SET", key, value, "PX", 100000, rng.choice(["NX", "XX", "GET"])],
        ["SET", key, value, "EX", 10, "PX", 10],
        ["SET", key],
        ["SETNX", key, value],
        ["SETEX", key, rng.choice([100, 0, -5, "x"]), value],
        ["PSETEX", key, rng.choice([100000, 0, "x"]), value],
        ["GET", key],
        ["GET", key, key],
        ["GETSET", key, value],
        ["GETDEL", key],
        ["MGET", *rng.sample(KEYS, rng.randint(1, 4))],
        ["MSET", key, value, rng.choice(KEYS), rng.choice(VALUES)],
        ["MSET", key],
        ["INCR", key],
        ["DECR", key],
        ["INCRBY", key, integer(rng)],
        ["DECRBY", key, integer(rng)],
        ["APPEND", key, value],
        ["STRLEN", key],
        ["GETEX", key, *rng.choice([[], ["EX", 100], ["PX", rng.choice([100000, 0, -1, "x"])],
                                    ["EXAT", rng.choice([4102444800, 1])], ["PXAT", 4102444800000], ["PERSIST"],
                                    ["EX"], ["EX", 10, "PX", 10], ["PERSIST", "EX", 10], ["BAD"]])],
        [rng.choice(["GETRANGE", "SUBSTR"]), key, rng.choice([0, 1, -1, -3, 5, -100, "x"]),
         rng.choice([0, 2, -1, -2, 100, -100])],
        ["SETRANGE", key, rng.choice([0, 1, 5, -1, "x", 536870912]), rng.choice(["", "ab", "xyz"])],
        ["MSETNX", key, value, rng.choice(KEYS), rng.choice(VALUES)],
        ["MSETNX", key],
        ["INCRBYFLOAT", key, rng.choice(["0.1", "-2.5", "1e3", "3", "abc", "inf", "", "5.0e-1", "0.2"])],
        ["SETBIT", key, rng.choice([0, 7, 8, 100, -1, "x", 4294967296]), rng.choice([0, 1, 1, 2, "x"])],
        ["GETBIT", key, rng.choice([0, 3, 7, 100, -1, "x"])],
        ["BITCOUNT", key, *rng.choice([[], [0, -1], [1, 1], [-2, -1], [0], [0, -1, "BIT"], [3, 10, "BIT"],
                                       [0, -1, "BYTE"], [0, 1, "BAD"], ["x", 1], [-1, -3]])],
        ["BITPOS", key, rng.choice([0, 1, 2]), *rng.choice([[], [0], [1], [-1], [0, -1], [2, 1], [-10, -20],
                                                          [0, -1, "BIT"], [3, 20, "BIT"], [0, 0, "BYTE"],
                                                          [0, 1, "BAD"], ["x"]])],
        ["BITOP", rng.choice(["AND", "OR", "XOR", "NOT", "NAND"]), key, *rng.sample(KEYS, rng.randint(1, 3))],
        ["LCS", key, rng.choice(KEYS), *rng.choice([[], ["LEN"], ["IDX"], ["IDX", "WITHMATCHLEN"], ["LEN", "IDX"],
                                                   ["IDX", "MINMATCHLEN", rng.choice([0, 2, -1, "x"])], ["BAD"]])],
        [rng.choice(["BITFIELD", "BITFIELD", "BITFIELD_RO"]), key,
         *[part for _ in range(rng.randint(0, 4)) for part in bitfield_operation(rng)]],
    ])


def bitfield_operation(rng):
    kind = rng.choice(["i8", "u8", "i5", "u1", "i64", "u63", "u16", "i1", "u64", "i0", "x8", "I8"])
    offset = rng.choice([0, 3, 7, 8, 13, 64, "#1", "#3", -1, "x", 4294967296])
    number = rng.choice([0, 1, -1, 100, 127, 128, -129, 255, 256, 9223372036854775807, -9223372036854775808, "x"])
    return rng.choice([
        ["GET", kind, offset],
        ["SET", kind, offset, number],
        ["INCRBY", kind, offset, number],
        ["OVERFLOW", rng.choice(["WRAP", "SAT", "FAIL", "fail", "BAD"])],
        ["GET", kind],
        ["BAD", kind, offset],
    ])


def keyspace(rng, key):
    other = rng.choice(KEYS)
    return rng.choice([
        ["DEL", key, other],
        ["UNLINK", key],
        ["EXISTS", key, other, key],
        ["EXPIRE", key, rng.choice([100, 0, -1, "x"])],
        ["EXPIRE", key, 100, *rng.choice([["NX"], ["XX"], ["BAD"], ["NX", "XX"]])],
        ["PEXPIRE", key, rng.choice([100000, -1])],
        ["EXPIREAT", key, rng.choice([4102444800, 4102444900, 1, "x"])],
        ["EXPIREAT", key, rng.choice([4102444800, 4102444900]), rng.choice(["NX", "XX", "GT", "LT"])],
        ["PEXPIREAT", key, 4102444850000, rng.choice(["GT", "LT"])],
        ["TTL", key],
        ["PTTL", key],
        ["PERSIST", key],
        ["TYPE", key],
        ["EXISTS"],
        ["KEYS", rng.choice(["*", "a*", "{t}*", "?", "[ab]"])],
        ["DBSIZE"],
        ["RENAME", key, other],
        ["RENAMENX", key, other],
        ["COPY", key, other, *rng.choice([[], ["REPLACE"], ["DB", 0], ["DB", "x"], ["BAD"]])],
        ["EXPIRETIME", key],
        ["PEXPIRETIME", key],
        ["TOUCH", key, other],
        ["RANDOMKEY"],
    ])


def hashes(rng, key):
    field, value = rng.choice(FIELDS), rng.choice(VALUES)
    return rng.choice([
        ["HSET", key, field, value],
        ["HSET", key, field, value, rng.choice(FIELDS), rng.choice(VALUES)],
        ["HSET", key, field],
        ["HMSET", key, field, value],
        ["HSETNX", key, field, value],
        ["HGET", key, field],
        ["HMGET", key, field, rng.choice(FIELDS)],
        ["HGETALL", key],
        ["HDEL", key, field, rng.choice(FIELDS)],
        ["HLEN", key],
        ["HEXISTS", key, field],
        ["HKEYS", key],
        ["HVALS", key],
        ["HSTRLEN", key, field],
        ["HINCRBY", key, field, integer(rng)],
        ["HINCRBYFLOAT", key, field, rng.choice(["0.1", "-2.5", "1e3", "abc", "inf", "", "0.2"])],
        ["HRANDFIELD", key, *rng.choice([[], [2], [-3], [1000], [1000, "WITHVALUES"], ["x"], [1, "BAD"]])],
        ["HSCAN", key, rng.choice([0, "x"]), *rng.choice([[], ["COUNT", 1000], ["MATCH", "f*", "COUNT", 1000],
                                                          ["COUNT", 0]])],
    ])


def sorted_sets(rng, key):
    member = rng.choice(FIELDS)
    score = rng.choice([1, -2, 0.5, "inf", "-inf", "nan", "x"])
    return rng.choice([
        ["ZADD", key, score, member],
        ["ZADD", key, rng.choice(["NX", "XX", "GT", "LT", "CH", "INCR"]), score, member],
        ["ZADD", key, "NX", "XX", 1, member],
        ["ZINCRBY", key, score, member],
        ["ZREM", key, member, rng.choice(FIELDS)],
        ["ZSCORE", key, member],
        ["ZMSCORE", key, member, rng.choice(FIELDS)],
        ["ZCARD", key],
        ["ZCOUNT", key, rng.choice(["-inf", "0", "(1"]), rng.choice(["+inf", "1", "x"])],
        ["ZRANK", key, member],
        ["ZREVRANK", key, member],
        ["ZRANGE", key, 0, -1, rng.choice(["WITHSCORES", "REV", "BYSCORE", "BADOPTION"])],
        ["ZRANGEBYSCORE", key, "-inf", "+inf", "LIMIT", rng.choice([0, 1, "x"]), 2],
        ["ZREVRANGEBYSCORE", key, "+inf", "-inf", "WITHSCORES"],
        [rng.choice(["ZPOPMIN", "ZPOPMAX"]), key, *rng.choice([[], [2], [0], [-1], ["x"], [1, 2]])],
        ["ZMPOP", rng.choice([1, 2, 0, "x"]), key, rng.choice(KEYS), rng.choice(["MIN", "MAX", "BAD"]),
         *rng.choice([[], ["COUNT", 2], ["COUNT", 0]])],
        [rng.choice(["BZPOPMIN", "BZPOPMAX"]), key, rng.choice(KEYS), rng.choice([0.01, "x", -1])],
        ["BZMPOP", 0.01, 1, key, rng.choice(["MIN", "MAX"]), *rng.choice([[], ["COUNT", 3]])],
        ["ZREMRANGEBYRANK", key, rng.choice([0, 1, -1, -5, "x"]), rng.choice([0, -1, 2, 10])],
        ["ZREMRANGEBYSCORE", key, rng.choice(["-inf", "0", "(1"]), rng.choice(["+inf", "1", "x"])],
        ["ZRANDMEMBER", key, *rng.choice([[], [2], [-3], [1000], [1000, "WITHSCORES"], ["x"], [1, "BAD"]])],
        [*rng.choice([["ZUNION"], ["ZINTER"], ["ZDIFF"], ["ZUNIONSTORE", key], ["ZINTERSTORE", key], ["ZDIFFSTORE", key]]),
         *combination(rng)],
        ["ZINTERCARD", *combination(rng, ["LIMIT", rng.choice([0, 1, -1])])],
        ["ZADD", key, 0, member, 0, rng.choice(FIELDS)],
        [rng.choice(["ZRANGEBYLEX", "ZLEXCOUNT", "ZREMRANGEBYLEX"]), key, lex_bound(rng), lex_bound(rng)],
        ["ZRANGEBYLEX", key, lex_bound(rng), lex_bound(rng), "LIMIT", rng.choice([0, 1, -1]), rng.choice([1, 2, -1])],
        ["ZREVRANGEBYLEX", key, lex_bound(rng), lex_bound(rng), *rng.choice([[], ["LIMIT", 1, 1], ["WITHSCORES"]])],
        ["ZREVRANGE", key, rng.choice([0, 1, -1, -3, 5, "x"]), rng.choice([-1, 0, 2, 10, -5]),
         *rng.choice([[], ["WITHSCORES"], ["LIMIT", 0, 1], ["BAD"]])],
        ["ZRANGE", key, lex_bound(rng), lex_bound(rng), "BYLEX", *rng.choice([[], ["REV"], ["LIMIT", 0, 2], ["WITHSCORES"]])],
        ["ZRANGE", key, 0, 5, "BYSCORE", "BYLEX"],
        ["ZRANGESTORE", rng.choice(KEYS), key, *rng.choice([[0, -1], [1, 2, "REV"], ["-inf", "+inf", "BYSCORE", "LIMIT", 1, 2],
                                                           [lex_bound(rng), lex_bound(rng), "BYLEX"], [0, -1, "WITHSCORES"]])],
        ["ZSCAN", key, rng.choice([0, "x"]), *rng.choice([[], ["MATCH", "f*"], ["COUNT", 1], ["COUNT", 0]])],
    ])


def lex_bound(rng):
    return rng.choice(["-", "+", "[f1", "(f1", "[f3", "(field-4", "[", "(", "f1", "[z"])


def combination(rng, extra=None):
    """numkeys, the keys, and options for ZUNION and its kin (sometimes wrong)."""
    keys = rng.sample(KEYS, rng.randint(1, 3))
    numkeys = rng.choice([len(keys)] * 6 + [0, 9, "x"])
    options = extra if extra is not None and rng.random() < 0.5 else rng.choice([
        [], ["WITHSCORES"], ["WEIGHTS", *[rng.choice([2, 0.5, -1, "x"]) for _ in keys]],
        ["AGGREGATE", rng.choice(["MIN", "MAX", "SUM", "BAD"])], ["WEIGHTS", 1], ["BAD"],
        ["WEIGHTS", *[2] * len(keys), "AGGREGATE", "MAX", "WITHSCORES"],
    ])
    return [numkeys, *keys, *options]


def lists(rng, key):
    element, other = rng.choice(FIELDS + ["0", "1"]), rng.choice(KEYS)
    end = lambda: rng.choice(["LEFT", "RIGHT", "LEFT", "RIGHT", "UP"])  # noqa: E731
    # Blocking pops wait 10 ms at most: a timeout of 0 would wait for ever.
    return rng.choice([
        ["LPUSH", key, element, *rng.sample(FIELDS, rng.randint(0, 3))],
        ["RPUSH", key, element, *rng.sample(FIELDS, rng.randint(0, 3))],
        [rng.choice(["LPUSHX", "RPUSHX"]), key, element],
        [rng.choice(["LPOP", "RPOP"]), key],
        [rng.choice(["LPOP", "RPOP"]), key, rng.choice([0, 1, 3, -1, "x"])],
        ["RPOP", key, 2, 3],
        ["LLEN", key],
        ["LINDEX", key, rng.choice([0, 1, -1, -5, 10, "x"])],
        ["LSET", key, rng.choice([0, -1, 5, "x"]), element],
        ["LRANGE", key, rng.choice([0, 1, -2, -100, 5]), rng.choice([-1, 0, 2, 100, -100])],
        ["LTRIM", key, rng.choice([0, 1, -2, 5]), rng.choice([-1, 0, 2, -3])],
        ["LREM", key, rng.choice([0, 1, -1, 2, -2, "x"]), element],
        ["LINSERT", key, rng.choice(["BEFORE", "AFTER", "MIDDLE"]), rng.choice(FIELDS), element],
        ["LPOS", key, element, *rng.choice([[], ["RANK", rng.choice([1, -1, 2, 0])], ["COUNT", rng.choice([0, 2, -1])],
                                            ["MAXLEN", rng.choice([1, 0, -1])], ["RANK", -2, "COUNT", 0, "MAXLEN", 3],
                                            ["BAD", 1], ["RANK"]])],
        ["LMOVE", key, other, end(), end()],
        ["RPOPLPUSH", key, other],
        ["LMPOP", rng.choice([1, 2, 0, -1, 9, "x"]), key, other, end(),
         *rng.choice([[], ["COUNT", rng.choice([1, 2, 0, -1])], ["COUNT"]])],
        [rng.choice(["BLPOP", "BRPOP"]), key, other, rng.choice([0.01, "x", -1])],
        ["BLMOVE", key, other, end(), end(), 0.01],
        ["BRPOPLPUSH", key, other, 0.01],
        ["BLMPOP", 0.01, rng.choice([1, 2]), key, other, end(), *rng.choice([[], ["COUNT", 2]])],
    ])


def sets(rng, key):
    member, other = rng.choice(FIELDS + ["0", "7"]), rng.choice(KEYS)
    keys = rng.sample(KEYS, rng.randint(1, 3))
    return rng.choice([
        ["SADD", key, member, *rng.sample(FIELDS, rng.randint(0, 3))],
        ["SREM", key, member, rng.choice(FIELDS)],
        ["SISMEMBER", key, member],
        ["SMISMEMBER", key, member, rng.choice(FIELDS)],
        ["SCARD", key],
        ["SMEMBERS", key],
        # SPOP takes random members: only all of them keeps the two servers alike.
        ["SPOP", key, rng.choice([1000, 0, -1, "x"])],
        ["SPOP", key, 1000, 2],
        ["SRANDMEMBER", key, *rng.choice([[], [2], [-3], [1000], ["x"], [1, 2]])],
        ["SMOVE", key, other, member],
        [rng.choice(["SINTER", "SUNION", "SDIFF"]), *keys],
        [rng.choice(["SINTERSTORE", "SUNIONSTORE", "SDIFFSTORE"]), other, *keys],
        ["SINTERCARD", rng.choice([len(keys), 0, 9, "x"]), *keys, *rng.choice([[], ["LIMIT", 1], ["LIMIT", -1], ["BAD"]])],
        ["SSCAN", key, rng.choice([0, "x"]), *rng.choice([[], ["COUNT", 1000], ["MATCH", "f*", "COUNT", 1000], ["COUNT", 0]])],
    ])


def transactions(rng, key):
    return rng.choice([
        ["MULTI"], ["MULTI"], ["EXEC"], ["EXEC"], ["DISCARD"], ["WATCH", key, rng.choice(KEYS)], ["UNWATCH"],
    ])


SCRIPTS = [
    "return redis.call('incr', KEYS[1])",
    "local v = redis.call('get', KEYS[1]) if v then redis.call('set', KEYS[1], v .. ARGV[1]) end return v",
    "return redis.call('lpush', KEYS[1], ARGV[1], ARGV[1])",
    "return {redis.call('lpop', KEYS[1]), redis.call('llen', KEYS[1])}",
    "redis.call('hset', KEYS[1], 'f', ARGV[1]) return redis.call('hgetall', KEYS[1])",
    "return redis.pcall('hincrby', KEYS[1], 'f', 1)",
    "return redis.call('sadd', KEYS[1], ARGV[1])",
    "return redis.call('zadd', KEYS[1], 1, ARGV[1])",
    "return redis.call('type', KEYS[1])",
    "return redis.call('exists', KEYS[1], KEYS[1])",
    "return {1, 2.9, -3.2, 'x', false, true, {ok='fine'}, nil, 'after nil'}",
    "return cjson.encode({key = KEYS[1], n = #ARGV})",
    "return cjson.decode(ARGV[1])",
    "return redis.error_reply('MYERR ' .. KEYS[1])",
    "return redis.status_reply('DONE')",
    "return redis.call('nosuchcommand')",
    "return redis.call('get')",
    "return redis.call('set', KEYS[1])",
    "return redis.call('get', KEYS[1], {})",
    "local ok, e = pcall(redis.call, 'incr', KEYS[1]) return {tostring(ok), e}",
    "error('failed on ' .. KEYS[1])",
    "return undefined_global",
    "x = 1",
    "return tonumber(ARGV[1]) + 1",
    "return redis.call('del', KEYS[1])",
    "redis.call('set', KEYS[1], 'written') return redis.call('incr', KEYS[1])",
    "return redis.call('expire', KEYS[1], 100)",
    "return bit.bxor(tonumber(ARGV[1]) or 0, 5)",
    "return redis.sha1hex(ARGV[1])",
    "#!lua flags=no-writes\nreturn redis.call('set', KEYS[1], 1)",
    "#!lua flags=no-writes\nreturn redis.call('get', KEYS[1])",
    "return redis.call('multi')",
    "return ARGV",
    "return KEYS",
]


def scripts(rng, key):
    body = rng.choice(SCRIPTS)
    arg = rng.choice(VALUES + ['[1,2,{"a":null}]', '{"k":"v"}', "[1,"])
    return rng.choice([
        ["EVAL", body, 1, key, arg],
        ["EVAL", body, 1, key, arg],
        ["EVAL_RO", body, 1, key, arg],
        ["EVAL", body, 0],
        ["EVAL", body, rng.choice([-1, 3, "x"]), key],
        ["EVALSHA", rng.choice(["ffffffffffffffffffffffffffffffffffffffff", "short"]), 1, key],
        ["SCRIPT", "EXISTS", "ffffffffffffffffffffffffffffffffffffffff"],
    ])


# Elements that are also keys (or, with "{t}" before them, keys), so that
# SORT's BY and GET patterns find weights and values.
SORTABLE = ["a", "b", "c", "x", "y", "3", "10", "-2", "2.5", ""]


def sorting(rng, key):
    fill = rng.sample(SORTABLE, rng.randint(1, 5))
    weights = [rng.choice(["1", "3", "-1", "2.5", "abc", "", " 7", "1e400"]) for _ in range(3)]
    by = rng.choice([[], [], ["BY", "*"], ["BY", "{t}*"], ["BY", "*->f1"], ["BY", "nosort"], ["BY", "missing_*"]])
    window = rng.choice([[], [], ["LIMIT", rng.choice([0, 1, -1, 5]), rng.choice([1, 2, 0, -1])], ["LIMIT", "x", 1],
                         ["LIMIT", 1]])
    gets = rng.choice([[], [], ["GET", "#"], ["GET", "*", "GET", "#"], ["GET", "*->f1"], ["GET", "nokey"]])
    order = rng.sample(["ASC", "DESC", "ALPHA"], rng.randint(0, 2))
    # STORE only where the order is Redis's own too: not BY ... ALPHA, whose
    # ties Redis leaves to its sort, and not BY without "*" (a set's order).
    deterministic = not by or (by[1] in ("*", "{t}*", "missing_*") and "ALPHA" not in order)
    store = ["STORE", rng.choice(KEYS)] if deterministic and rng.random() < 0.3 else []
    return rng.choice([
        [rng.choice(["RPUSH", "SADD"]), key, *fill],
        ["ZADD", key, *[part for element in fill for part in (rng.choice([1, 2, -1]), element)]],
        ["MSET", *[part for element, weight in zip(rng.sample(SORTABLE, 3), weights) for part in (element, weight)]],
        ["MSET", *[part for element, weight in zip(rng.sample(SORTABLE, 3), weights) for part in ("{t}" + element, weight)]],
        ["HSET", rng.choice(SORTABLE), "f1", weights[0]],
        ["SORT", key, *by, *window, *gets, *order, *store],
        ["SORT", key, *by, *window, *gets, *order, *store],
        ["SORT_RO", key, *by, *window, *gets, *order],
        ["SORT_RO", key, "STORE", "a"],
        ["SORT", key, rng.choice(["BAD", "LIMIT", "GET", "BY", "STORE"])],
    ])


FAMILIES = [strings, keyspace, hashes, sorted_sets, lists, sets, transactions, scripts, sorting]


def random_command(rng):
    command = rng.choice(FAMILIES)(rng, rng.choice(KEYS))
    # Wrong arity, mostly; not for SPOP, which must take every member (above).
    if rng.random() < 0.03 and len(command) > 1 and command[0] != "SPOP":
        command = command[: rng.randint(1, len(command) - 1)]
    return [str(arg) for arg in command]


def reply_of(client, command, queued=None):
    """The reply to `command`, in a form both servers must agree on. For
    EXEC, `queued` lists the commands the transaction queued, and each of
    their replies is put in that form too."""
    try:
        reply = client.execute_command(*command)
    except redis.ResponseError as error:
        return ("error", str(error))
    return comparable(command, reply, queued)


def comparable(command, reply, queued=None):
    if isinstance(reply, redis.ResponseError):
        return ("error", str(reply))
    if reply == b"QUEUED":
        return reply  # answered for the command, which runs at EXEC
    name = command[0].upper()
    if name == "EXEC" and isinstance(reply, list) and queued is not None:
        return [comparable(inner, inner_reply) for inner, inner_reply in zip(queued, reply)]
    if name == "KEYS" and isinstance(reply, list):
        return sorted(reply)
    if name in ("TTL", "PTTL", "EXPIRETIME", "PEXPIRETIME") and isinstance(reply, int):
        return reply if reply < 0 else "has a deadline"
    if name == "RANDOMKEY":
        return reply is not None
    if name in ("SMEMBERS", "SINTER", "SUNION", "SDIFF", "SPOP") and isinstance(reply, list):
        return sorted(reply)
    if name == "SRANDMEMBER" or (name in ("HRANDFIELD", "ZRANDMEMBER") and not (len(command) >= 3 and command[2] == "1000")):
        return len(reply) if isinstance(reply, list) else reply is not None
    if name in ("SORT", "SORT_RO") and isinstance(reply, list) and sort_order_is_open(command):
        if "LIMIT" in (str(arg).upper() for arg in command):
            return len(reply)  # which tied elements the window takes is open too
        return sorted(reply, key=lambda value: (value is None, value or b""))
    if name in ("SSCAN", "HSCAN") and isinstance(reply, list):
        return sorted(reply[1])  # the cursor's form is each server's own
    if name == "ZSCAN" and isinstance(reply, list):
        return sorted(zip(reply[1][::2], reply[1][1::2]))  # a hash-table zset scans in its table's order
    if name in ("HRANDFIELD", "ZRANDMEMBER") and isinstance(reply, list):
        if len(command) == 4:
            return sorted(zip(reply[::2], reply[1::2]))  # every one, with its value or score
        return sorted(reply)
    return reply


def sort_order_is_open(command):
    """SORT ... BY without "*" answers a set in its own order, and BY ...
    ALPHA leaves ties to Redis's sort: both compared as multisets."""
    upper = [str(arg).upper() for arg in command]
    patterns = [command[at + 1] for at, arg in enumerate(upper[:-1]) if arg == "BY"]
    return any("*" not in pattern for pattern in patterns) or (bool(patterns) and "ALPHA" in upper)


def state_of(client):
    """Every key's type, value and whether it has a deadline (raw replies)."""
    state = {}
    for key in sorted(client.execute_command("KEYS", "*")):
        kind = client.execute_command("TYPE", key)
        if kind == b"hash":
            flat = client.execute_command("HGETALL", key)
            value = sorted(zip(flat[::2], flat[1::2]))
        else:
            read = {b"string": ["GET", key], b"zset": ["ZRANGE", key, 0, -1, "WITHSCORES"],
                    b"list": ["LRANGE", key, 0, -1], b"set": ["SMEMBERS", key]}[kind]
            value = client.execute_command(*read)
            if kind == b"set":
                value = sorted(value)
            if kind == b"zset":  # the same double, printed in either form (below)
                value = [(member, float(score)) for member, score in zip(value[::2], value[1::2])]
        state[key] = (kind, value, client.execute_command("TTL", key) >= 0)
    return state


@pytest.fixture
def both(node, redis_server):
    ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
    for client in (ours, theirs):
        client.response_callbacks.clear()  # compare the raw replies
    yield ours, theirs
    ours.close()
    theirs.close()


def test_random_sequences_match_redis(both):
    ours, theirs = both
    match_random_sequences(ours, theirs, range(FIRST_SEED, FIRST_SEED + SEQUENCES))


def test_random_sequences_match_redis_on_the_hybrid_engine(tmp_path, redis_server):
    """The same sequences over the `hybrid` engine with a budget small enough
    that large collections and old records live on disk."""
    node = Node(tmp_path, "--engine", "hybrid", "--engine-option", "memory-bytes=1mb").start()
    try:
        ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
        for client in (ours, theirs):
            client.response_callbacks.clear()
        match_random_sequences(ours, theirs, range(FIRST_SEED, FIRST_SEED + max(SEQUENCES // 3, 1)))
    finally:
        node.stop()


def match_random_sequences(ours, theirs, seeds):
    for seed in seeds:
        rng = random.Random(seed)
        for client in (ours, theirs):
            reset(client)
        queued = None  # the commands queued since MULTI
        for step in range(COMMANDS_PER_SEQUENCE):
            command = random_command(rng)
            expected = reply_of(theirs, command, queued)
            got = reply_of(ours, command, queued)
            assert got == expected, f"seed {seed} step {step}: {command}: Tessera {got!r}, Redis {expected!r}"
            name = command[0].upper()
            if name == "MULTI" and expected == b"OK":
                queued = []
            elif name in ("EXEC", "DISCARD") and not (isinstance(expected, tuple) and "without MULTI" in expected[1]):
                queued = None
            elif queued is not None and expected == b"QUEUED":
                queued.append(command)
        for client in (ours, theirs):
            reset(client)
        assert state_of(ours) == state_of(theirs), f"seed {seed}: final state"


def reset(client):
    """Out of any transaction, no key watched, no key."""
    for command in (["DISCARD"], ["UNWATCH"], ["FLUSHALL"]):
        try:
            client.execute_command(*command)
        except redis.ResponseError:
            pass


def test_the_generator_reaches_every_family_and_error_kind(both):
    """The comparison is only as good as what the sequences send: each family
    runs, and Redis answers wrong-type, arity, syntax and integer errors."""
    _, theirs = both
    rng = random.Random(FIRST_SEED)
    seen = set()
    for _ in range(3000):
        command = random_command(rng)
        reply = reply_of(theirs, command)
        seen.add(command[0].upper())
        if isinstance(reply, tuple):
            message = reply[1]
            for kind in ("WRONGTYPE", "wrong number of arguments", "syntax error", "not an integer"):
                if kind in message:
                    seen.add(kind)
    for expected in ("SET", "EXPIRE", "HSET", "ZADD", "LPUSH", "BLPOP", "SADD", "SINTERSTORE", "MULTI", "EVAL", "WRONGTYPE", "wrong number of arguments",
                     "syntax error", "not an integer"):
        assert expected in seen, expected


def test_long_lists_match_redis(both):
    """Lists past the inline limit are pages on Tessera: the same random
    changes on a list of thousands of elements, with indexes across it."""
    ours, theirs = both
    for seed in range(FIRST_SEED, FIRST_SEED + max(SEQUENCES // 10, 3)):
        rng = random.Random(seed)
        for client in (ours, theirs):
            client.execute_command("FLUSHALL")
        elements = [rng.choice("abcdefgh") * rng.randint(1, 300) for _ in range(rng.randint(200, 3000))]
        for command in (["RPUSH", "L", *elements], ["LPUSH", "M", *elements[:150]]):
            assert reply_of(ours, command) == reply_of(theirs, command)
        for step in range(200):
            length = max(int(reply_of(theirs, ["LLEN", "L"])), 1)
            index = lambda: rng.randint(-length - 5, length + 5)  # noqa: E731
            element = rng.choice("abcdefgh") * rng.randint(1, 300)
            command = rng.choice([
                ["LINDEX", "L", index()],
                ["LSET", "L", index(), element],
                ["LRANGE", "L", index(), index()],
                ["LINSERT", "L", rng.choice(["BEFORE", "AFTER"]), rng.choice(elements), element],
                ["LREM", "L", rng.choice([0, 1, -1, 3, -3]), rng.choice(elements)],
                ["LPOS", "L", rng.choice(elements), "RANK", rng.choice([1, -1, 3, -3]), "COUNT", rng.choice([0, 1, 5])],
                ["LTRIM", "L", rng.randint(0, 20), rng.choice([-1, -5, length // 2])],
                [rng.choice(["LPOP", "RPOP"]), "L", rng.randint(0, 300)],
                [rng.choice(["LPUSH", "RPUSH"]), "L", *([element] * rng.randint(1, 200))],
                ["LMOVE", "L", rng.choice(["L", "M"]), rng.choice(["LEFT", "RIGHT"]), rng.choice(["LEFT", "RIGHT"])],
                ["LLEN", "L"],
            ])
            expected, got = reply_of(theirs, command), reply_of(ours, command)
            assert got == expected, f"seed {seed} step {step}: {command[:6]}: Tessera {got!r}, Redis {expected!r}"
        assert state_of(ours) == state_of(theirs), f"seed {seed}: final state"


def test_blocked_clients_are_served_in_the_order_they_blocked(node, redis_server):
    """Three clients block on one list, one on two; pushes wake them in turn.
    Who gets what, and when a wait times out, must be as on Redis."""

    def scenario(port):
        clients = [redis.Redis(port=port, protocol=2) for _ in range(4)]
        clients[0].delete("q", "other")
        results = {}

        def block(n, command):
            results[n] = clients[n].execute_command(*command)

        waits = [["BLPOP", "q", 5], ["BRPOP", "other", "q", 5], ["BLMOVE", "q", "moved", "LEFT", "RIGHT", 5]]
        threads = []
        for n, command in enumerate(waits):
            thread = threading.Thread(target=block, args=(n, command))
            thread.start()
            threads.append(thread)
            time.sleep(0.1)  # each blocks before the next
        control = clients[3]
        assert control.info("clients")["blocked_clients"] == 3
        control.execute_command("RPUSH", "q", "a", "b")
        time.sleep(0.2)
        control.execute_command("LPUSH", "other", "c")
        time.sleep(0.2)
        control.execute_command("RPUSH", "q", "d", "e")
        for thread in threads:
            thread.join(timeout=10)
        timed_out = control.execute_command("BLPOP", "nothing", 0.05)
        state = (control.execute_command("LRANGE", "q", 0, -1), control.execute_command("LRANGE", "moved", 0, -1))
        for client in clients:
            client.close()
        return results, timed_out, state

    assert scenario(node.port) == scenario(redis_server)


def test_a_client_that_leaves_while_blocked_takes_nothing(node):
    """A blocked client that disconnects leaves the queue: the next push goes
    to the next waiter, and no element is popped for a client that is gone."""

    leaving = socket.create_connection(("127.0.0.1", node.port))
    leaving.sendall(b"*3\r\n$5\r\nBLPOP\r\n$4\r\njobs\r\n$1\r\n0\r\n")
    waiting = node.client()
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("reply", waiting.execute_command("BLPOP", "jobs", 5)))
    time.sleep(0.2)
    thread.start()
    time.sleep(0.2)
    leaving.close()
    time.sleep(0.2)
    pusher = node.client()
    pusher.execute_command("RPUSH", "jobs", "job-1")
    thread.join(timeout=10)
    assert list(got["reply"]) == [b"jobs", b"job-1"]
    assert pusher.execute_command("LLEN", "jobs") == 0


def full_scan(client, command, key):
    """Everything an SSCAN, HSCAN or ZSCAN from cursor 0 to the end returns,
    sorted (an HSCAN's and a ZSCAN's as pairs)."""
    found, cursor = set(), b"0"
    while True:
        cursor, page = client.execute_command(command, key, cursor, "COUNT", 100)
        found.update(zip(page[::2], page[1::2]) if command in ("HSCAN", "ZSCAN") else page)
        if cursor in (b"0", 0):
            return sorted(found)


def test_large_sets_match_redis(both):
    """Sets past the inline limit are hashed buckets on Tessera: the same
    random changes and algebra on sets of thousands of members."""
    ours, theirs = both
    for seed in range(FIRST_SEED, FIRST_SEED + max(SEQUENCES // 10, 3)):
        rng = random.Random(seed)
        for client in (ours, theirs):
            client.execute_command("FLUSHALL")
        universe = [f"member-{n}" for n in range(6000)]
        for key in ("{s}a", "{s}b"):
            command = ["SADD", key, *rng.sample(universe, rng.randint(150, 3000))]
            assert reply_of(ours, command) == reply_of(theirs, command)
        for step in range(150):
            key, other = rng.sample(["{s}a", "{s}b", "{s}c"], 2)
            command = rng.choice([
                ["SADD", key, *rng.sample(universe, rng.randint(1, 300))],
                ["SREM", key, *rng.sample(universe, rng.randint(1, 300))],
                ["SISMEMBER", key, rng.choice(universe)],
                ["SMISMEMBER", key, *rng.sample(universe, 5)],
                ["SCARD", key],
                ["SMOVE", key, other, rng.choice(universe)],
                [rng.choice(["SINTER", "SUNION", "SDIFF"]), key, other],
                [rng.choice(["SINTERSTORE", "SUNIONSTORE", "SDIFFSTORE"]), "{s}c", key, other],
                ["SINTERCARD", 2, key, other, "LIMIT", rng.choice([0, 10])],
            ])
            expected, got = reply_of(theirs, command), reply_of(ours, command)
            assert got == expected, f"seed {seed} step {step}: {command[:5]}: Tessera {got!r}, Redis {expected!r}"
            if step % 50 == 0:
                assert full_scan(ours, "SSCAN", key) == full_scan(theirs, "SSCAN", key)
                picked = ours.execute_command("SRANDMEMBER", key, 20)
                assert len(set(picked)) == len(picked) and set(picked) <= set(full_scan(ours, "SSCAN", key))
        assert state_of(ours) == state_of(theirs), f"seed {seed}: final state"


def test_large_hashes_match_redis(both):
    """Hashes past the inline limit are hashed buckets on Tessera: the same
    random changes on hashes of thousands of fields."""
    ours, theirs = both
    for seed in range(FIRST_SEED, FIRST_SEED + max(SEQUENCES // 10, 3)):
        rng = random.Random(seed)
        for client in (ours, theirs):
            client.execute_command("FLUSHALL")
        fields = [f"field-{n}" for n in range(5000)]
        pairs = [part for field in rng.sample(fields, rng.randint(150, 3000)) for part in (field, rng.randint(0, 9))]
        assert reply_of(ours, ["HSET", "h", *pairs]) == reply_of(theirs, ["HSET", "h", *pairs])
        for step in range(150):
            command = rng.choice([
                ["HSET", "h", *[part for field in rng.sample(fields, 50) for part in (field, rng.randint(0, 9))]],
                ["HDEL", "h", *rng.sample(fields, rng.randint(1, 200))],
                ["HGET", "h", rng.choice(fields)],
                ["HMGET", "h", *rng.sample(fields, 5)],
                ["HLEN", "h"],
                ["HEXISTS", "h", rng.choice(fields)],
                ["HINCRBY", "h", rng.choice(fields), rng.randint(-5, 5)],
                ["HINCRBYFLOAT", "h", rng.choice(fields), rng.choice(["0.1", "-1.5", "2e2"])],
                ["HSETNX", "h", rng.choice(fields), "new"],
            ])
            expected, got = reply_of(theirs, command), reply_of(ours, command)
            assert got == expected, f"seed {seed} step {step}: {command[:5]}: Tessera {got!r}, Redis {expected!r}"
        assert full_scan(ours, "HSCAN", "h") == full_scan(theirs, "HSCAN", "h")
        assert state_of(ours) == state_of(theirs), f"seed {seed}: final state"


def test_large_collections_as_keys_match_redis(both, node, redis_server):
    """What a large set, hash, list or sorted set shares with every key, on
    Redis and on a Tessera node whose memory engine keeps it native: deadlines
    through changes, WATCH moved by a change and not by a no-op, RENAME,
    COPY, DUMP and RESTORE, and SPOP to the last member."""
    ours, theirs = both
    others = node.client(), redis.Redis(port=redis_server, protocol=2)
    members = [f"member-{n}" for n in range(400)]
    pairs = [part for n in range(400) for part in (f"field-{n}", n)]

    def run(*command):
        expected, got = reply_of(theirs, command), reply_of(ours, command)
        assert got == expected, f"{command[:4]}: Tessera {got!r}, Redis {expected!r}"
        return got

    for client in (ours, theirs):
        client.execute_command("FLUSHALL")
    run("SADD", "s", *members)
    run("HSET", "h", *pairs)
    run("RPUSH", "l", *members)
    run("ZADD", "z", *[part for n in range(400) for part in (n % 37, f"member-{n}")])
    for command in (["EXPIRE", "s", 100], ["SADD", "s", "one more"], ["SREM", "s", "member-1"], ["TTL", "s"],
                    ["SCARD", "s"], ["PERSIST", "s"], ["TTL", "s"], ["PEXPIRE", "h", 100000], ["HSET", "h", "x", 1],
                    ["HDEL", "h", "field-3"], ["PTTL", "h"], ["HLEN", "h"], ["EXPIRE", "l", 100],
                    ["LPUSH", "l", "first"], ["RPOP", "l"], ["TTL", "l"], ["OBJECT", "ENCODING", "l"],
                    ["LINDEX", "l", 200], ["LLEN", "l"], ["EXPIRE", "z", 100], ["ZADD", "z", 5, "new"],
                    ["ZPOPMIN", "z"], ["ZPOPMAX", "z", 2], ["TTL", "z"], ["ZRANK", "z", "member-77"],
                    ["ZRANGE", "z", 10, 20, "WITHSCORES"], ["ZCARD", "z"], ["OBJECT", "ENCODING", "z"]):
        run(*command)
    # A transaction watching the set: a member already there moves nothing,
    # a new one aborts it.
    for added, key in (("member-5", "s"), ("brand new", "s"), ("field-9", "h")):
        run("WATCH", key)
        for other in others:
            other.execute_command(*(["SADD", key, added] if key == "s" else ["HSET", key, added, 9]))
        run("MULTI")
        run("SCARD" if key == "s" else "HLEN", key)
        assert comparable(["EXEC"], ours.execute_command("EXEC"), [["SCARD", key]]) == comparable(
            ["EXEC"], theirs.execute_command("EXEC"), [["SCARD", key]])
    run("RENAME", "s", "s2")
    run("COPY", "s2", "s3")
    run("SADD", "s3", "only in the copy")
    run("SISMEMBER", "s2", "only in the copy")
    run("COPY", "h", "h2")
    run("HDEL", "h2", "field-7")
    run("HEXISTS", "h", "field-7")
    run("RENAME", "l", "l2")
    run("COPY", "l2", "l3")
    run("LSET", "l3", 5, "only in the copy")
    run("LRANGE", "l2", 0, 10)
    run("RENAME", "z", "z2")
    run("COPY", "z2", "z3")
    run("ZINCRBY", "z3", 100, "member-9")
    run("ZSCORE", "z2", "member-9")
    for key in ("s2", "h", "l2", "z2"):
        payload = theirs.execute_command("DUMP", key)
        run("RESTORE", f"{key}:restored", 0, payload)
        payload = ours.execute_command("DUMP", key)
        run("RESTORE", f"{key}:ours", 0, payload)
    assert state_of(ours) == state_of(theirs)
    # A set popped to its last member, and past it (which members is each
    # server's own draw).
    card = run("SCARD", "s3")
    for pops in (card - 1, 1):
        assert len(ours.execute_command("SPOP", "s3", pops)) == len(theirs.execute_command("SPOP", "s3", pops))
        run("SCARD", "s3")
    run("EXISTS", "s3")
    run("ZPOPMIN", "z3", 1000)
    run("EXISTS", "z3")
    # A deadline that passes takes the whole value.
    run("PEXPIRE", "s2", 20)
    time.sleep(0.1)
    run("SCARD", "s2")
    run("SADD", "s2", "after")
    run("SMEMBERS", "s2")
    assert state_of(ours) == state_of(theirs)
    for other in others:
        other.close()


def test_large_sorted_sets_by_member_match_redis(both):
    """Sorted sets of thousands of members of one score, paged on Tessera:
    lexicographic ranges, counts, removals and stores, and a whole ZSCAN."""
    ours, theirs = both
    for seed in range(FIRST_SEED, FIRST_SEED + max(SEQUENCES // 20, 2)):
        rng = random.Random(seed)
        for client in (ours, theirs):
            client.execute_command("FLUSHALL")
        words = [f"{rng.choice('abcdefgh')}{n:05}" for n in range(4000)]
        members = [part for word in words for part in (0, word)]
        assert reply_of(ours, ["ZADD", "{z}words", *members]) == reply_of(theirs, ["ZADD", "{z}words", *members])

        def bound():
            return rng.choice(["-", "+", f"[{rng.choice(words)}", f"({rng.choice(words)}", f"[{rng.choice('abcdefgh')}"])

        for step in range(120):
            command = rng.choice([
                ["ZRANGEBYLEX", "{z}words", bound(), bound(), "LIMIT", rng.randint(0, 50), rng.randint(1, 30)],
                ["ZREVRANGEBYLEX", "{z}words", bound(), bound(), "LIMIT", rng.randint(0, 50), rng.randint(1, 30)],
                ["ZLEXCOUNT", "{z}words", bound(), bound()],
                ["ZREMRANGEBYLEX", "{z}words", f"[{rng.choice(words)}", f"({rng.choice(words)}"],
                ["ZRANGESTORE", "{z}copy", "{z}words", bound(), bound(), "BYLEX", "LIMIT", 0, rng.randint(1, 500)],
                ["ZRANGE", "{z}copy", 0, -1],
            ])
            expected, got = reply_of(theirs, command), reply_of(ours, command)
            assert got == expected, f"seed {seed} step {step}: {command}: Tessera {got!r}, Redis {expected!r}"
        ours_scan = full_scan(ours, "ZSCAN", "{z}words")
        assert ours_scan == full_scan(theirs, "ZSCAN", "{z}words")
        assert len(ours_scan) == ours.execute_command("ZCARD", "{z}words")
        assert state_of(ours) == state_of(theirs), f"seed {seed}: final state"


def test_object_matches_redis(both):
    """OBJECT's answers for strings, hashes and sorted sets (lists and sets
    are named as Redis 7.2 names them, which the 7.0 server here does not),
    and its errors. IDLETIME grows while a key is left alone."""
    ours, theirs = both
    setup = [["SET", "int", "123"], ["SET", "big", "12345678"], ["SET", "padded", "0123"], ["SET", "short", "hello"],
             ["SET", "long", "x" * 50], ["SET", "huge", "9" * 25], ["HSET", "hash", "f", "v"],
             ["HSET", "bighash", *[part for n in range(200) for part in (f"f{n}", n)]], ["ZADD", "zset", 1, "m"],
             ["ZADD", "bigzset", *[part for n in range(200) for part in (n, f"m{n}")]],
             ["ZADD", "longmember", 1, "m" * 70]]
    for command in setup:
        assert reply_of(ours, command) == reply_of(theirs, command)
    for command in [["OBJECT", sub, key] for sub in ("ENCODING", "REFCOUNT", "FREQ")
                    for key in ("int", "big", "padded", "short", "long", "huge", "hash", "bighash", "zset",
                                "bigzset", "longmember", "missing")] + [
            ["OBJECT"], ["OBJECT", "ENCODING"], ["OBJECT", "NOSUCH", "int"],
            ["OBJECT", "ENCODING", "int", "extra"]]:
        expected, got = reply_of(theirs, command), reply_of(ours, command)
        assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"
    time.sleep(2.2)
    assert ours.execute_command("OBJECT", "IDLETIME", "short") >= 2
    ours.execute_command("GET", "short")
    assert ours.execute_command("OBJECT", "IDLETIME", "short") == 0
    assert len(ours.execute_command("OBJECT", "HELP")) > 3


def test_wait_without_replicas_matches_redis(both):
    """WAIT on a server without replicas: 0 at once when 0 are asked for,
    else 0 after the timeout; at once inside MULTI; Redis's errors for bad
    arguments; refused inside a script."""
    ours, theirs = both
    for command in [["SET", "k", "v"], ["WAIT", 0, 0], ["WAIT", -1, 10], ["WAIT", "x", 0], ["WAIT", 0, "x"],
                    ["WAIT", 0, -1], ["WAIT", 0, "1.5"], ["WAIT", 0], ["WAIT", 0, 0, 0],
                    ["EVAL", "return redis.call('wait', 0, 0)", 0]]:
        expected, got = reply_of(theirs, command), reply_of(ours, command)
        assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"
    for client in (ours, theirs):
        started = time.monotonic()
        assert client.execute_command("WAIT", 1, 150) == 0
        assert 0.14 <= time.monotonic() - started < 2
        client.execute_command("MULTI")
        client.execute_command("WAIT", 5, 0)
        assert client.execute_command("EXEC") == [0], "a transaction never blocks"


def key_positions(entry, argc=12):
    """The argument positions a COMMAND INFO entry's key specifications name
    in a call of `argc` arguments (ranges), and the searches they describe
    otherwise (counted keys, keywords), comparable across servers."""
    positions, searches = set(), set()
    for spec in entry[8]:
        spec = dict(zip(spec[0::2], spec[1::2]))
        begin, find = dict(zip(spec[b"begin_search"][0::2], spec[b"begin_search"][1::2])), \
            dict(zip(spec[b"find_keys"][0::2], spec[b"find_keys"][1::2]))
        begin_spec = dict(zip(begin[b"spec"][0::2], begin[b"spec"][1::2]))
        find_spec = dict(zip(find[b"spec"][0::2], find[b"spec"][1::2]))
        if begin[b"type"] == b"unknown" or find[b"type"] == b"unknown":
            continue
        if begin[b"type"] == b"index" and find[b"type"] == b"range":
            first = begin_spec[b"index"]
            last = first + find_spec[b"lastkey"] if find_spec[b"lastkey"] >= 0 else argc + find_spec[b"lastkey"]
            positions.update(range(first, last + 1, find_spec[b"keystep"]))
        else:
            searches.add((begin[b"type"], tuple(sorted(begin_spec.items())), find[b"type"],
                          tuple(sorted(find_spec.items()))))
    return positions, searches


def test_command_info_matches_redis(both):
    """COMMAND INFO of every command both serve, against Redis 7.0: arity,
    first and last key and step (flags are Tessera's own), the keys the key specifications find (Redis
    sometimes splits one range in two specs, one per role), ACL categories,
    and the subcommands of a container, each with Redis's arity. Allowed:
    SORT's STORE is a keyword spec here (Redis: unknown), and a container's
    subcommands share its categories here (Redis files a few apart)."""
    ours, theirs = both
    names = [name.decode() for name in ours.execute_command("COMMAND", "LIST")]
    theirs_by_name = {entry[0].decode(): entry for entry in theirs.execute_command("COMMAND", "INFO", *names) if entry}
    ours_by_name = {entry[0].decode(): entry for entry in ours.execute_command("COMMAND", "INFO", *names)}
    assert len(theirs_by_name) > 180
    # Forms added after Redis 7.0: ZRANK's WITHSCORE, CLIENT SETINFO, CLUSTER SLOT-STATS.
    redis_7_2 = {"client|setinfo", "zrank", "zrevrank", "cluster|slot-stats"}
    for name, expected in theirs_by_name.items():
        got = ours_by_name[name]
        assert [got[1], *got[3:6]] == [expected[1], *expected[3:6]] or name in redis_7_2, (name, got, expected)
        if name not in ("sort", "sort_ro"):
            assert key_positions(got) == key_positions(expected), (name, got[8], expected[8])
        if not got[9]:
            assert set(got[6]) == set(expected[6]), (name, got[6], expected[6])
        redis_subcommands = {sub[0].decode(): sub[1] for sub in expected[9]}
        for sub in got[9]:
            sub_name = sub[0].decode()
            assert sub_name in redis_7_2 or redis_subcommands.get(sub_name) == sub[1], (sub_name, sub[1])


def comparable_docs(flat):
    """A COMMAND DOCS entry as both servers must agree on it: version, group,
    and the arguments (key specification numbers and prose left out), with
    the subcommands'."""
    fields = dict(zip(flat[0::2], flat[1::2]))

    def arguments(args):
        result = []
        for arg in args:
            arg = dict(zip(arg[0::2], arg[1::2]))
            result.append((arg[b"name"], arg[b"type"], arg.get(b"token"), arg.get(b"display_text"),
                           sorted(arg.get(b"flags", [])), arguments(arg.get(b"arguments", []))))
        return result

    subcommands = dict(zip(fields.get(b"subcommands", [])[0::2], fields.get(b"subcommands", [])[1::2]))
    return (fields[b"since"], fields[b"group"], arguments(fields.get(b"arguments", [])),
            {name: comparable_docs(sub) for name, sub in subcommands.items()})


def test_command_docs_match_redis(both):
    """COMMAND DOCS of every command both serve carries Redis's version,
    group and arguments (what redis-cli builds its help and hints from), and
    a container's subcommands that Tessera serves; Tessera's own commands
    are documented too."""
    ours, theirs = both
    names = [name.decode() for name in ours.execute_command("COMMAND", "LIST")]
    our_docs = dict(zip(*[iter(ours.execute_command("COMMAND", "DOCS"))] * 2))
    assert sorted(name.decode() for name in our_docs) == sorted(names)
    their_docs = dict(zip(*[iter(theirs.execute_command("COMMAND", "DOCS", *names))] * 2))
    assert len(their_docs) > 180
    for name, expected in their_docs.items():
        got = comparable_docs(our_docs[name])
        expected = comparable_docs(expected)
        assert got[:3] == expected[:3], name
        for sub, sub_docs in got[3].items():
            assert sub_docs == expected[3][sub], sub
    assert dict(zip(*[iter(our_docs[b"table.create"])] * 2))[b"group"] == b"tessera"
    assert ours.execute_command("COMMAND", "DOCS", "get", "nosuch")[0] == b"get"


def test_sort_matches_redis_where_order_is_defined(both):
    """SORT's orders that the random sequences compare loosely, compared
    exactly: a list and a sorted set under BY without "*" (their own order,
    windowed from either end), BY ... ALPHA over distinct weights, large
    values, hash fields, STORE over every type, and a user who may not
    read every key."""
    ours, theirs = both
    elements = [f"e{n}" for n in range(300)]
    setup = [["RPUSH", "list", *elements], ["ZADD", "zset", *[part for n, e in enumerate(elements) for part in (n % 7, e)]],
             ["SADD", "set", *elements[:50]],
             ["MSET", *[part for n, e in enumerate(elements) for part in (f"w_{e}", f"{(n * 7919) % 1000:04d}")]],
             *[["HSET", f"h_{e}", "f", n] for n, e in enumerate(elements[:40])]]
    for command in setup:
        assert reply_of(ours, command) == reply_of(theirs, command)
    commands = [["SORT", key, "BY", "nosort", *window, *order] for key in ("list", "zset")
                for window in ([], ["LIMIT", 0, 5], ["LIMIT", 290, 20], ["LIMIT", 3, -1], ["LIMIT", -5, 3])
                for order in ([], ["DESC"])]
    commands += [["SORT", "list", "BY", "w_*", "ALPHA", *extra] for extra in ([], ["DESC"], ["LIMIT", 10, 5])]
    commands += [["SORT", "list", "BY", "w_*", "GET", "#", "GET", "w_*", "LIMIT", 0, 10],
                 ["SORT", "set", "BY", "h_*->f", "GET", "h_*->f", "DESC"], ["SORT", "zset", "ALPHA", "LIMIT", 0, 20],
                 ["SORT", "set", "ALPHA", "STORE", "dest"], ["LRANGE", "dest", 0, -1],
                 ["SORT", "zset", "BY", "w_*", "STORE", "dest"], ["LRANGE", "dest", 0, -1],
                 ["SORT", "list", "BY", "nosort", "GET", "h_*->f", "STORE", "dest"], ["LRANGE", "dest", 0, -1],
                 ["SORT", "missing", "STORE", "dest"], ["EXISTS", "dest"], ["SORT", "w_e1"], ["SORT", "list"]]
    def exact(client, command):
        try:
            return client.execute_command(*command)
        except redis.ResponseError as error:
            return ("error", str(error))

    for command in commands:
        expected, got = exact(theirs, command), exact(ours, command)
        assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"
    for client in (ours, theirs):
        client.execute_command("ACL", "SETUSER", "sorter", "on", "nopass", "+@all", "~list", "~dest")
        client.execute_command("AUTH", "sorter", "any")
    for command in (["SORT", "list", "BY", "w_*"], ["SORT", "list", "GET", "#"], ["SORT", "list", "BY", "nosort", "LIMIT", 0, 2],
                    ["SORT", "list", "LIMIT", 0, 2, "STORE", "dest"]):
        expected, got = exact(theirs, command), exact(ours, command)
        assert got == expected, f"{command}: Tessera {got!r}, Redis {expected!r}"


def values_of_every_encoding(client):
    """Keys of every type in each of Redis's encodings (small and large,
    integers, long strings it compresses), with and without deadlines."""
    commands = [["SET", "int", "12345"], ["SET", "negative", "-7"], ["SET", "short", "hello"],
                ["SET", "compressible", "abc" * 200], ["SET", "binary", bytes(range(256)) * 3],
                ["SET", "expiring", "soon", "EX", 1000],
                ["RPUSH", "small-list", "a", "1", "-5000", "70000", "4294967296", ""],
                ["RPUSH", "large-list", *[f"element-{n}" * (n % 5 + 1) for n in range(3000)]],
                ["SADD", "intset", *range(-3, 300, 7)], ["SADD", "small-set", "a", "b", "c"],
                ["SADD", "large-set", *[f"member-{n}" for n in range(1000)]],
                ["HSET", "small-hash", "f", "v", "n", "12"],
                ["HSET", "large-hash", *[part for n in range(1000) for part in (f"field-{n}", n * 3)]],
                ["ZADD", "small-zset", 1.5, "m", "-inf", "low", 3, "three"],
                ["ZADD", "large-zset", *[part for n in range(1000) for part in (n / 7, f"member-{n}")]],
                ["ZADD", "long-member-zset", 1, "m" * 100], ["PEXPIRE", "large-zset", 500000]]
    for command in commands:
        client.execute_command(*command)
    return [command[1] for command in commands if command[0] != "PEXPIRE"]


def test_dump_and_restore_carry_every_type_between_tessera_and_redis(both):
    """Each of Redis's encodings, dumped by Redis and restored into Tessera,
    reads back as Redis holds it; Tessera's own dumps restore into Redis the
    same; RESTORE's options and errors match Redis's."""
    ours, theirs = both
    keys = values_of_every_encoding(theirs)
    for key in keys:
        payload = theirs.execute_command("DUMP", key)
        ttl = max(theirs.execute_command("PTTL", key), 0)
        assert ours.execute_command("RESTORE", key, ttl, payload) == b"OK", key
    assert state_of(ours) == state_of(theirs)

    # Back: Tessera's dumps, restored into Redis under new names.
    for key in keys:
        payload = ours.execute_command("DUMP", key)
        assert theirs.execute_command("RESTORE", f"back-{key}", 0, payload) == b"OK", key
        assert reply_of(theirs, ["TYPE", f"back-{key}"]) == reply_of(theirs, ["TYPE", key])
    for key in keys:
        theirs.execute_command("PERSIST", key)
        theirs.execute_command("RENAME", f"back-{key}", f"restored:{key}")
        ours.execute_command("PERSIST", key)
        ours.execute_command("COPY", key, f"restored:{key}")
    assert state_of(ours) == state_of(theirs)

    payload = theirs.execute_command("DUMP", "small-hash")
    corrupt = payload[:-1] + bytes([payload[-1] ^ 1])
    truncated_body = payload[:3] + payload[-10:]
    commands = [["DUMP", "missing"], ["RESTORE", "short", 0, payload], ["RESTORE", "short", 0, payload, "REPLACE"],
                ["HGETALL", "short"], ["RESTORE", "fresh", -1, payload], ["RESTORE", "fresh", "x", payload],
                ["RESTORE", "fresh", 0, corrupt], ["RESTORE", "fresh", 0, truncated_body], ["RESTORE", "fresh", 0, "tiny"],
                ["RESTORE", "fresh", 0, payload, "BAD"], ["RESTORE", "fresh", 0, payload, "IDLETIME", -1],
                ["RESTORE", "fresh", 0, payload, "FREQ", 256], ["RESTORE", "fresh", 0, payload, "IDLETIME", 5, "FREQ", 3],
                ["RESTORE", "fresh", 0, payload, "FREQ", 3, "REPLACE"], ["HGETALL", "fresh"],
                ["RESTORE", "past", 1, payload, "ABSTTL"], ["EXISTS", "past"],
                ["RESTORE", "fresh", 1, payload, "ABSTTL", "REPLACE"], ["EXISTS", "fresh"],
                ["RESTORE", "idle", 0, payload, "IDLETIME", 1000], ["OBJECT", "IDLETIME", "idle"],
                ["RESTORE", "later", 4102444800000, payload, "ABSTTL"], ["PEXPIRETIME", "later"]]
    for command in commands:
        expected, got = reply_of(theirs, command), reply_of(ours, command)
        assert got == expected, f"{command[:2]}: Tessera {got!r}, Redis {expected!r}"


def test_redis_migrates_keys_into_tessera(both, node, redis_server):
    """Redis's MIGRATE speaks to Tessera as to a Redis target (SELECT 0,
    then RESTORE with the payload): every type arrives with its deadline;
    COPY, REPLACE and BUSYKEY behave as between two Redis servers."""
    ours, theirs = both
    keys = values_of_every_encoding(theirs)
    assert theirs.execute_command("MIGRATE", "127.0.0.1", node.port, "", 0, 5000, "COPY", "KEYS", *keys) == b"OK"
    assert state_of(ours) == state_of(theirs)
    assert theirs.execute_command("MIGRATE", "127.0.0.1", node.port, "short", 0, 5000, "REPLACE") == b"OK"
    assert theirs.execute_command("EXISTS", "short") == 0 and ours.execute_command("GET", "short") == b"hello"
    theirs.execute_command("SET", "short", "again")
    with pytest.raises(redis.ResponseError, match="BUSYKEY"):
        theirs.execute_command("MIGRATE", "127.0.0.1", node.port, "short", 0, 5000, "COPY")
    assert theirs.execute_command("MIGRATE", "127.0.0.1", node.port, "short", 0, 5000, "REPLACE") == b"OK"
    assert ours.execute_command("GET", "short") == b"again"


def test_tessera_migrates_keys_into_redis(both, redis_server):
    """A node's MIGRATE sends its keys to Redis as a Redis node would:
    every type with its deadline, COPY, REPLACE, NOKEY, the target's
    refusals (a key it refused stays here) and an unreachable target."""
    ours, theirs = both
    keys = values_of_every_encoding(ours)
    assert ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "", 0, 5000, "COPY", "KEYS", *keys) == b"OK"
    assert state_of(ours) == state_of(theirs)
    moved = ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "", 0, 5000, "REPLACE", "KEYS", "short", "int",
                                 "missing")
    assert moved == b"OK"
    assert ours.execute_command("EXISTS", "short", "int") == 0 and theirs.execute_command("GET", "short") == b"hello"
    assert ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "missing", 0, 5000) == b"NOKEY"
    ours.execute_command("SET", "short", "again")
    with pytest.raises(redis.ResponseError, match="Target instance replied with error: BUSYKEY"):
        ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "short", 0, 5000)
    assert ours.execute_command("GET", "short") == b"again", "a key the target refused stays"
    with pytest.raises(redis.ResponseError, match="Target instance replied with error: ERR AUTH"):
        ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "short", 0, 5000, "AUTH", "nope")
    with pytest.raises(redis.ResponseError, match="IOERR error or timeout connecting"):
        ours.execute_command("MIGRATE", "127.0.0.1", free_port(), "short", 0, 200)
    with pytest.raises(redis.ResponseError, match="KEYS option, the key argument must be set to the empty string"):
        ours.execute_command("MIGRATE", "127.0.0.1", redis_server, "short", 0, 5000, "KEYS", "int")


def test_the_command_reference_covers_every_redis_command(node, redis_server):
    """docs/COMMANDS.md names every command redis-server lists, each once:
    served (and then Tessera lists it too) or not, with why."""
    reference = (Path(__file__).resolve().parents[2] / "docs" / "COMMANDS.md").read_text()
    rows = re.findall(r"^\| ([A-Z_.\-]+) \|", reference, re.MULTILINE)
    not_served = set(re.findall(r"^\| ([A-Z_.\-]+) \| [^|]+ \|$", reference.split("does not serve")[-1], re.MULTILINE))
    theirs, ours = redis.Redis(port=redis_server), node.client()
    for client in (theirs, ours):
        client.response_callbacks.clear()
    redis_commands = {name.decode().upper() for name in theirs.execute_command("COMMAND", "LIST") if b"|" not in name}
    ours = {name.decode().upper() for name in ours.execute_command("COMMAND", "LIST")}
    assert len(rows) == len(set(rows)), "each command once"
    assert redis_commands <= set(rows), sorted(redis_commands - set(rows))
    assert (redis_commands - not_served) <= ours and not (not_served & ours)
    assert ours == set(rows) - not_served


def raw_exchange(port, script):
    """Sends each step's commands on its connection (0 subscribes, 1
    publishes) and returns, per step, the bytes each connection received."""
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    received = []
    for which, commands in script:
        for command in commands:
            connections[which].sendall(resp_command(*command))
        time.sleep(0.05)
        step = []
        for connection in connections:
            connection.settimeout(0.05)
            data = b""
            try:
                while chunk := connection.recv(65536):
                    data += chunk
            except socket.timeout:
                pass
            step.append(data)
        received.append(step)
    for connection in connections:
        connection.close()
    return received


def test_pubsub_replies_and_messages_match_redis(node, redis_server):
    """Subscriptions, their confirmations, messages by channel and pattern,
    the counts PUBLISH answers, what a subscribed RESP2 connection may send,
    and PUBSUB's answers: the same bytes as Redis, in RESP2 and RESP3."""
    script = [
        (0, [[b"SUBSCRIBE", b"news", b"sport"], [b"PSUBSCRIBE", b"n*"]]),
        (1, [[b"PUBLISH", b"news", b"hello"], [b"PUBLISH", b"sport", b""], [b"PUBLISH", b"none", b"x"]]),
        (1, [[b"PUBSUB", b"NUMSUB", b"news", b"none"], [b"PUBSUB", b"NUMPAT"], [b"PUBSUB", b"CHANNELS", b"s*"]]),
        (0, [[b"GET", b"k"], [b"PING"], [b"PING", b"hi"]]),
        (0, [[b"UNSUBSCRIBE", b"news"], [b"PUNSUBSCRIBE"], [b"UNSUBSCRIBE"], [b"UNSUBSCRIBE"]]),
        (1, [[b"PUBLISH", b"news", b"after"]]),
        (0, [[b"PING"], [b"HELLO", b"3"]]),
        (0, [[b"SUBSCRIBE", b"news"], [b"GET", b"k"]]),
        (1, [[b"PUBLISH", b"news", b"in resp3"], [b"PUBSUB", b"NUMSUB"], [b"PUBSUB", b"NOPE"]]),
    ]
    ours, theirs = raw_exchange(node.port, script), raw_exchange(redis_server, script)
    for step, (got, expected) in enumerate(zip(ours, theirs)):
        if script[step][1][0][:2] == [b"HELLO", b"3"] or [b"HELLO", b"3"] in script[step][1]:
            continue  # HELLO's reply describes each server
        assert got == expected, f"step {step} {script[step]}: Tessera {got!r}, Redis {expected!r}"


def test_a_slow_subscriber_is_closed_at_its_output_limit(tmp_path):
    """A subscriber that does not read is disconnected once its queue passes
    client-output-buffer-limit; the node and other clients carry on."""
    node = Node(str(tmp_path), "--client-output-buffer-limit", str(1 << 20)).start()
    try:
        slow = socket.create_connection(("127.0.0.1", node.port))
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(b"*2\r\n$9\r\nSUBSCRIBE\r\n$4\r\nfeed\r\n")
        time.sleep(0.2)
        publisher = node.client()
        payload = b"p" * 10_000
        for _ in range(2000):  # 20 MB, far past the limit and the socket buffers
            publisher.publish("feed", payload)
        deadline = time.time() + 10
        while publisher.pubsub_numsub("feed")[0][1] and time.time() < deadline:
            time.sleep(0.1)
        assert publisher.pubsub_numsub("feed")[0][1] == 0, "the slow subscriber was let go"
        assert publisher.ping()
    finally:
        node.stop()


# What monitoring tools read from INFO (redis_exporter, redis-cli --stat,
# RedisInsight's overview), by section: each must be in Redis's INFO and in
# Tessera's, with a value of the same kind.
INFO_FIELDS_TOOLS_READ = {
    "server": ["redis_version", "redis_mode", "os", "arch_bits", "process_id", "run_id", "tcp_port",
               "uptime_in_seconds", "uptime_in_days", "hz", "executable"],
    "clients": ["connected_clients", "blocked_clients", "maxclients"],
    "memory": ["used_memory", "used_memory_human", "used_memory_rss", "used_memory_peak", "total_system_memory",
               "maxmemory", "maxmemory_policy", "mem_fragmentation_ratio"],
    "persistence": ["loading", "rdb_changes_since_last_save", "rdb_bgsave_in_progress", "rdb_last_save_time",
                    "rdb_last_bgsave_status", "aof_enabled", "aof_rewrite_in_progress", "aof_last_write_status"],
    "stats": ["total_connections_received", "total_commands_processed", "instantaneous_ops_per_sec",
              "total_net_input_bytes", "total_net_output_bytes", "instantaneous_input_kbps",
              "instantaneous_output_kbps", "rejected_connections", "expired_keys", "evicted_keys", "keyspace_hits",
              "keyspace_misses", "pubsub_channels", "pubsub_patterns", "latest_fork_usec"],
    "replication": ["role", "connected_slaves", "master_replid", "master_repl_offset"],
    "cpu": ["used_cpu_sys", "used_cpu_user", "used_cpu_sys_children", "used_cpu_user_children"],
    "cluster": ["cluster_enabled"],
}


def test_info_has_what_tools_read_and_counts_as_redis_does(node, redis_server):
    ours, theirs = node.client(), redis.Redis(port=redis_server)
    for section, fields in INFO_FIELDS_TOOLS_READ.items():
        mine, reference = ours.info(section), theirs.info(section)
        for field in fields:
            assert field in reference, f"{section}: {field} is not Redis's"
            assert field in mine, f"{section}: {field} missing"
            assert type(mine[field]) is type(reference[field]), (section, field, mine[field], reference[field])

    # The same writes to both: keys, keys with a time to live and the
    # changes since the last save are counted alike.
    changes = {name: client.info("persistence")["rdb_changes_since_last_save"]
               for name, client in (("ours", ours), ("theirs", theirs))}
    for client in (ours, theirs):
        client.flushall()
        for index in range(40):
            client.set(f"census:{index}", "v", ex=1000 + index if index % 4 == 0 else None)
        client.hset("census:hash", mapping={"a": 1, "b": 2})
        client.expire("census:hash", 500)
    assert theirs.info("persistence")["rdb_changes_since_last_save"] - changes["theirs"] >= 42
    assert ours.info("persistence")["rdb_changes_since_last_save"] - changes["ours"] == 43  # FLUSHALL, 40 SETs, HSET, EXPIRE
    expected = theirs.info("keyspace")["db0"]
    assert (expected["keys"], expected["expires"]) == (41, 11)
    deadline = time.time() + 10
    while (mine := ours.info("keyspace")["db0"]) and (mine["keys"], mine["expires"]) != (41, 11):
        assert time.time() < deadline, f"keyspace {mine}, Redis {expected}"
        time.sleep(0.1)
    assert 500_000 <= mine["avg_ttl"] <= 1_010_000, mine

    # Per-command counts, in Redis's form: 40 SETs each, one refused for its
    # arity, one INCRBY (redis-py's incr) failed on a value that is no integer.
    for client in (ours, theirs):
        with pytest.raises(redis.ResponseError):
            client.execute_command("SET", "census:0")
        with pytest.raises(redis.ResponseError):
            client.incr("census:1")
    mine_set, their_set = ours.info("commandstats")["cmdstat_set"], theirs.info("commandstats")["cmdstat_set"]
    assert set(mine_set) == set(their_set), (mine_set, their_set)
    assert (mine_set["calls"], mine_set["rejected_calls"]) == (their_set["calls"], their_set["rejected_calls"]) == (40, 1)
    mine_incr, their_incr = (client.info("commandstats")["cmdstat_incrby"] for client in (ours, theirs))
    assert (mine_incr["calls"], mine_incr["failed_calls"]) == (their_incr["calls"], their_incr["failed_calls"]) == (1, 1)
    mine_latency = ours.info("latencystats")["latency_percentiles_usec_set"]
    assert set(mine_latency) == set(theirs.info("latencystats")["latency_percentiles_usec_set"]), mine_latency
    assert "cmdstat_set" not in ours.info() and "cmdstat_set" in ours.info("all")

    # Under load the instantaneous rate and the CPU time move.
    cpu_before = ours.info("cpu")
    pipeline = ours.pipeline(transaction=False)
    stop = time.time() + 1.0
    while time.time() < stop:
        for _ in range(200):
            pipeline.ping()
        pipeline.execute()
    stats, cpu = ours.info("stats"), ours.info("cpu")
    assert stats["instantaneous_ops_per_sec"] > 1000, stats
    assert stats["instantaneous_input_kbps"] > 0
    assert cpu["used_cpu_user"] + cpu["used_cpu_sys"] > cpu_before["used_cpu_user"] + cpu_before["used_cpu_sys"]
    memory = ours.info("memory")
    assert memory["used_memory_peak"] >= memory["used_memory"] > 0, memory
    ours.close()
    theirs.close()
