"""Tessera's clients: redis-py's ``Redis`` and ``RedisCluster`` with Tessera's
own API beside Redis's (tables, per-request consistency, causal sessions,
ordered walks, cluster status, pipelined batches)."""

from __future__ import annotations

import os
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster

from .replies import text
from .status import ClusterStatus, parse_cluster_info, parse_cluster_nodes
from .tables import Tables, walk_range

LEVELS = ("strong", "eventual", "causal")
"""What a read may ask for. What it gets may be weaker: an active–active
eventual table has no strong reads to give; a single node is always strong."""

ADMIN_COMMANDS = ("TABLE.CREATE", "TABLE.DROP", "TABLE.LIST", "TABLE.INFO", "TABLE.ALTER", "TABLE.RANGE")
"""Tessera's commands of no key, which any node of a cluster answers."""

NODE_ADDRESS = "127.0.0.1:7379"
"""Where ``tessera serve`` listens unless told otherwise."""

CLUSTER_ADDRESS = "127.0.0.1:7001"
"""The first node of ``tessera cluster up`` (the coordinator is on 7000)."""


def address_from_environment(default: str) -> tuple[str, int]:
    """``TESSERA_ADDR`` (as the ``tessera`` command reads it), else ``default``."""
    address = os.environ.get("TESSERA_ADDR") or default
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an address is host:port, not {address!r}")
    return host, int(port)


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"consistency is one of {LEVELS}, not {level!r}")
    return level


@dataclass(frozen=True)
class Leveled:
    """A read's reply and the consistency level the server served it at."""

    value: Any
    level: str


@dataclass(frozen=True)
class Batch:
    """What :meth:`TesseraApi.pipelined` sent and got back."""

    replies: list[Any]
    """One per command, in order; a command that failed has its error here."""
    seconds: float

    @property
    def errors(self) -> list[Exception]:
        return [reply for reply in self.replies if isinstance(reply, Exception)]

    @property
    def ops_per_second(self) -> float:
        return len(self.replies) / self.seconds if self.seconds > 0 else 0.0


class Consistency:
    """A consistency level for a client's reads: a context manager for a
    block of code, or called on directly for one read
    (``client.consistency("eventual").get("k")``). Writes are not changed:
    a write is always ordered by the table's replication mode."""

    def __init__(self, client: TesseraApi, level: str) -> None:
        self._client = client
        self.level = check_level(level)
        self._tokens: list[Token[str | None]] = []

    def __enter__(self) -> Consistency:
        self._tokens.append(self._client._read_level.set(self.level))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._client._read_level.reset(self._tokens.pop())

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def at_level(*args: Any, **kwargs: Any) -> Any:
            with self:
                return method(*args, **kwargs)

        return at_level


class TesseraApi:
    """What Tessera adds to a redis-py client. Mixed into :class:`Tessera`
    (a ``redis.Redis``) and :class:`TesseraCluster` (a ``RedisCluster``)."""

    def _init_tessera(self) -> None:
        # Per client, per thread and per asyncio task: what reads ask for
        # here, and the level the last read was served at.
        self._read_level: ContextVar[str | None] = ContextVar(f"tessera-read-level-{id(self)}", default=None)
        self._level_got: ContextVar[str | None] = ContextVar(f"tessera-level-got-{id(self)}", default=None)
        self._keyed_reads: frozenset[str] | None = None
        self.tables = Tables(self)

    # What each kind of client does its own way.

    def admin_command(self, *args: Any) -> Any:
        """A command of no key that any node answers (TABLE.*)."""
        raise NotImplementedError

    def node_client(self) -> redis.Redis:
        """A plain client of one node, for node-wide questions."""
        raise NotImplementedError

    def node_clients(self) -> list[redis.Redis]:
        """Plain clients of every node known, :meth:`node_client`'s first."""
        raise NotImplementedError

    def _send(self, *args: Any, **options: Any) -> Any:
        """The command sent as redis-py sends it, without Tessera's wrapping."""
        raise NotImplementedError

    def _callbacks(self) -> dict[str, Callable[..., Any]]:
        raise NotImplementedError

    # Per-request consistency.

    def consistency(self, level: str) -> Consistency:
        """Reads at ``level`` (``strong``, ``eventual`` or ``causal``)::

            with client.consistency("eventual"):
                client.get("k")                       # from any replica
            client.consistency("strong").get("k")    # this read only

        Each read is sent as ``CONSISTENCY.READ level ...`` and the level it
        got is kept in :attr:`last_level`."""
        return Consistency(self, level)

    def read_at(self, level: str, *command: Any, **options: Any) -> Leveled:
        """One read of keys at ``level``, with the level it was served at:
        ``client.read_at("eventual", "HGET", "h", "f")``."""
        check_level(level)
        got, reply = self._send("CONSISTENCY.READ", level, *command)
        if isinstance(reply, Exception):
            raise reply
        options.pop("keys", None)
        callback = self._callbacks().get(text(command[0]).upper())
        value = callback(reply, **options) if callback is not None else reply
        leveled = Leveled(value, text(got))
        self._level_got.set(leveled.level)
        return leveled

    @property
    def last_level(self) -> str | None:
        """The level the last read made through :meth:`consistency` or
        :meth:`read_at` was served at, in this thread or task."""
        return self._level_got.get()

    def execute_command(self, *args: Any, **options: Any) -> Any:
        level = self._read_level.get()
        if level is not None and text(args[0]).upper() in self._reads_of_keys():
            return self.read_at(level, *args, **options).value
        return self._send(*args, **options)

    def _reads_of_keys(self) -> frozenset[str]:
        """The commands CONSISTENCY.READ runs: read-only commands of keys,
        as the server's COMMAND describes them."""
        if self._keyed_reads is None:
            described = self._send("COMMAND")
            self._keyed_reads = frozenset(
                name.upper()
                for name, spec in described.items()
                if "readonly" in spec["flags"] and int(spec["first_key_pos"]) > 0
            )
        return self._keyed_reads

    # Tables, walks, status, batches.

    def range(
        self, table: str, start: str | bytes | None = None, end: str | bytes | None = None, page: int = 1000
    ) -> Iterator[Any]:
        """The keys of ``table`` from ``start`` (included) up to ``end``
        (excluded) in order, across every shard: ``page`` keys per
        TABLE.RANGE. The table needs an ordered engine and, in a cluster,
        ``partition="range"``."""
        return walk_range(self, table, start, end, page)

    def cluster_status(self) -> ClusterStatus:
        """The cluster as the first node that answers sees it, with every
        table's shards."""
        failures = []
        for node in self.node_clients():
            try:
                info = parse_cluster_info(text(node.execute_command("CLUSTER", "INFO")))
                nodes = parse_cluster_nodes(text(node.execute_command("CLUSTER", "NODES")))
                break
            except (redis.ConnectionError, redis.TimeoutError) as error:
                failures.append(error)
        else:
            raise redis.ConnectionError(f"no node answered: {failures}")
        return ClusterStatus(
            state=info.get("cluster_state", "fail"),
            slots_ok=int(info.get("cluster_slots_ok", 0)),
            known_nodes=int(info.get("cluster_known_nodes", len(nodes))),
            epoch=int(info.get("cluster_current_epoch", 0)),
            nodes=nodes,
            tables=[self.tables.info(name) for name in self.tables.list()],
        )

    def pipelined(self, commands: Iterable[Sequence[Any]], depth: int = 64) -> Batch:
        """Sends ``commands`` (each a sequence: ``("SET", "k", "v")``) with up
        to ``depth`` of them in flight at once, and times the whole: for bulk
        loads and quick measurements. Errors come back in their places."""
        if depth < 1:
            raise ValueError("depth is at least 1")
        replies: list[Any] = []
        pipe = self._batch()
        queued = 0
        started = time.perf_counter()
        for command in commands:
            pipe.execute_command(*command)
            queued += 1
            if queued == depth:
                replies += pipe.execute(raise_on_error=False)
                queued = 0
        if queued:
            replies += pipe.execute(raise_on_error=False)
        return Batch(replies, time.perf_counter() - started)

    def _batch(self) -> Any:
        raise NotImplementedError


class Tessera(TesseraApi, redis.Redis):
    """A client of one Tessera node: a ``redis.Redis`` with Tessera's API.
    Without a host or port it connects to ``TESSERA_ADDR``, else to
    127.0.0.1:7379, where ``tessera serve`` listens. A cluster node works
    too: it forwards what it does not hold."""

    def __init__(self, host: str | None = None, port: int | None = None, **kwargs: Any) -> None:
        if host is None and port is None and "unix_socket_path" not in kwargs:
            host, port = address_from_environment(NODE_ADDRESS)
        self._init_tessera()
        super().__init__(host=host or "127.0.0.1", port=port or 7379, **kwargs)

    def admin_command(self, *args: Any) -> Any:
        return self._send(*args)

    def node_client(self) -> redis.Redis:
        return self

    def node_clients(self) -> list[redis.Redis]:
        return [self]

    def _send(self, *args: Any, **options: Any) -> Any:
        return redis.Redis.execute_command(self, *args, **options)

    def _callbacks(self) -> dict[str, Callable[..., Any]]:
        return dict(self.response_callbacks)

    def _batch(self) -> Any:
        return self.pipeline(transaction=False)

    def session(self, level: str | None = None) -> Session:
        """A client on a connection of its own, whose reads ask for ``level``
        (CONSISTENCY): what a causal session needs, since the server keeps
        its context with the connection."""
        return Session(self.connection_pool, level)


class Session(Tessera):
    """One connection to one node, with its consistency set on it. A causal
    session's context lives on the server with the connection:
    :meth:`token` carries it to another connection or node of the same
    datacenter, and :meth:`resume` takes it up. If the connection breaks,
    the context is gone, so a causal session refuses to reconnect."""

    def __init__(self, pool: redis.ConnectionPool, level: str | None) -> None:
        self.level = None if level is None else check_level(level)
        self._connected_once = False
        kwargs = dict(pool.connection_kwargs)
        kwargs["redis_connect_func"] = self._on_connect
        own_pool = redis.ConnectionPool(connection_class=pool.connection_class, max_connections=1, **kwargs)
        self._init_tessera()
        redis.Redis.__init__(self, connection_pool=own_pool, single_connection_client=True)

    def _on_connect(self, connection: Any) -> None:
        if self._connected_once and self.level == "causal":
            raise redis.ConnectionError(
                "a causal session's connection broke and its context went with it: start a session and resume() a token"
            )
        connection.on_connect()
        if self.level is not None:
            connection.send_command("CONSISTENCY", self.level)
            reply = connection.read_response()
            if text(reply) != "OK":
                raise redis.ResponseError(f"CONSISTENCY {self.level}: {text(reply)}")
        self._connected_once = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
        self.connection_pool.disconnect()

    def levels(self) -> tuple[str, str]:
        """The level this session's reads ask for and the level they get."""
        asked, got = self._send("CONSISTENCY")
        return text(asked), text(got)

    def token(self) -> str:
        """The session's causal context, sealed by the cluster (CAUSAL.TOKEN)."""
        return text(self._send("CAUSAL.TOKEN"))

    def resume(self, token: str) -> None:
        """Takes up a token's context, merged with this session's own; the
        session becomes causal (CAUSAL.TOKEN SET)."""
        self._send("CAUSAL.TOKEN", "SET", token)
        self.level = "causal"


class TesseraCluster(TesseraApi, RedisCluster):
    """A client of a Tessera cluster: a redis-py ``RedisCluster`` (routed by
    CLUSTER SLOTS, following MOVED and ASK) with Tessera's API. Without
    nodes named it starts from ``TESSERA_ADDR``, else from 127.0.0.1:7001,
    the first node ``tessera cluster up`` starts."""

    def __init__(self, host: str | None = None, port: int | None = None, **kwargs: Any) -> None:
        if host is None and port is None and "startup_nodes" not in kwargs and "url" not in kwargs:
            kwargs["startup_nodes"] = [ClusterNode(*address_from_environment(CLUSTER_ADDRESS))]
        if host is not None:
            kwargs["host"] = host
        if port is not None:
            kwargs["port"] = port
        self._init_tessera()  # before redis-py's, which sends commands
        super().__init__(**kwargs)
        # Any node answers these, and redis-py retries them on another.
        for name in ADMIN_COMMANDS:
            self.command_flags[name] = RedisCluster.RANDOM

    def admin_command(self, *args: Any) -> Any:
        return self._send(*args)

    def node_client(self) -> redis.Redis:
        node = self.get_default_node()
        assert node is not None and node.redis_connection is not None, "the cluster client has no node"
        return node.redis_connection

    def node_clients(self) -> list[redis.Redis]:
        others = [node.redis_connection for node in self.get_nodes() if node != self.get_default_node()]
        return [self.node_client(), *(client for client in others if client is not None)]

    def _send(self, *args: Any, **options: Any) -> Any:
        return RedisCluster.execute_command(self, *args, **options)

    def _callbacks(self) -> dict[str, Callable[..., Any]]:
        return dict(self.node_client().response_callbacks)

    def _batch(self) -> Any:
        return self.pipeline()

    def determine_slot(self, *args: Any) -> Any:
        # CONSISTENCY.READ level command ...: the slot of the read it wraps.
        if args and text(args[0]).upper() == "CONSISTENCY.READ":
            return super().determine_slot(*args[2:])
        return super().determine_slot(*args)

    def session(self, level: str | None = None, key: str | bytes | None = None) -> Session:
        """A session (:meth:`Tessera.session`) on one node: the node heading
        ``key``'s slot, or the client's default node. Any node serves every
        key (it forwards), but the head answers without a hop."""
        node = self.get_node_from_key(key) if key is not None else self.get_default_node()
        assert node is not None and node.redis_connection is not None, "the cluster client has no node"
        return Session(node.redis_connection.connection_pool, level)
