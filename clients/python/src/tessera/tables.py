"""Tables: TABLE.CREATE, DROP, LIST, INFO and ALTER as Python calls, and
TABLE.RANGE paged into an iterator."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from .replies import as_dict, text

if TYPE_CHECKING:
    from .client import TesseraApi

TOPOLOGIES = ("ms", "aa")
CONSISTENCIES = ("strong", "eventual")

# One shard of TABLE.INFO on a cluster node: "3 slots [(0, 1364)] view 2 n0>n1>n2"
# or, in a range-partitioned table, "5 keys [ix:g (ix:p view 1 n2>n0>n1".
_SLOT_RANGE = re.compile(r"\((\d+), (\d+)\)")
_SHARD = re.compile(r"^(?P<id>\d+) (?P<holds>(?:slots|keys) .*) view (?P<view>\d+) (?P<members>\S*)$")


@dataclass(frozen=True)
class ShardInfo:
    """One shard (replica group) of a table on a cluster."""

    id: int
    holds: str
    """What the shard holds: ``slots [..]``, or ``keys [from (to`` in a
    range-partitioned table (TABLE.RANGE's notation)."""
    view: int
    """The shard's view number: it grows at every change of members."""
    members: list[str]
    """The members in replication order, the head first (``n0``, ``n3``...)."""

    @property
    def slots(self) -> list[tuple[int, int]]:
        """The slot ranges a hash-partitioned shard holds, both ends included."""
        if not self.holds.startswith("slots"):
            return []
        return [(int(low), int(high)) for low, high in _SLOT_RANGE.findall(self.holds)]


@dataclass(frozen=True)
class TableInfo:
    """What TABLE.INFO says of a table. A single node knows its keys and its
    engine's own figures; a cluster node knows the mode and the shards."""

    name: str
    prefix: str
    engine: str
    options: dict[str, str]
    mode: str | None = None
    """``ms+sc``, ``ms+ec``, ``aa+sc`` or ``aa+ec`` (or a switch under way) on a
    cluster; ``None`` on a single node, which keeps one copy."""
    partition: str | None = None
    """``hash`` or ``range`` on a cluster."""
    keys: int | None = None
    ordered: bool | None = None
    """Whether the engine keeps keys in order (TABLE.RANGE walks it); a single node says."""
    persistent: bool | None = None
    shards: list[ShardInfo] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    """The engine's own figures (a single node): what TABLE.INFO adds."""


def parse_info(reply: Any) -> TableInfo:
    """A TABLE.INFO reply, RESP2 or RESP3, from a single node or a cluster node."""
    fields = {text(name): value for name, value in as_dict(reply).items()}
    options = dict(option.split("=", 1) for option in text(fields.pop("options", "")).split() if "=" in option)
    shards = [parse_shard(text(line)) for line in fields.pop("shards", [])]
    known = {"name", "prefix", "engine", "mode", "partition", "keys", "ordered", "persistent"}
    return TableInfo(
        name=text(fields["name"]),
        prefix=text(fields["prefix"]),
        engine=text(fields["engine"]),
        options=options,
        mode=text(fields["mode"]) if "mode" in fields else None,
        partition=text(fields["partition"]) if "partition" in fields else None,
        keys=int(fields["keys"]) if "keys" in fields else None,
        ordered=bool(int(fields["ordered"])) if "ordered" in fields else None,
        persistent=bool(int(fields["persistent"])) if "persistent" in fields else None,
        shards=shards,
        stats={name: int(value) for name, value in fields.items() if name not in known},
    )


def parse_shard(line: str) -> ShardInfo:
    matched = _SHARD.match(line)
    if matched is None:
        raise ValueError(f"a TABLE.INFO shard line not understood: {line!r}")
    members = matched["members"]
    return ShardInfo(
        id=int(matched["id"]),
        holds=matched["holds"],
        view=int(matched["view"]),
        members=members.split(">") if members else [],
    )


class Tables:
    """A client's tables: ``client.tables.create(...)`` and so on. On a
    cluster any node answers, and a change answers once every live node
    routes by it."""

    def __init__(self, client: TesseraApi) -> None:
        self._client = client

    def create(
        self,
        name: str,
        prefix: str,
        engine: str = "memory",
        options: Mapping[str, str | int] | None = None,
        partition: str | None = None,
        splits: Sequence[str] = (),
    ) -> None:
        """A table owning the keys that start with ``prefix``, on ``engine``
        with its ``options`` (``{"fsync": "always"}``, ``{"memory-bytes":
        "1gb"}``). ``partition="range"`` with ``splits`` divides a cluster's
        table by key ranges, for ordered walks (:meth:`TesseraApi.range`)."""
        args: list[str | int] = ["TABLE.CREATE", name, "PREFIX", prefix, "ENGINE", engine]
        if partition is not None:
            args += ["PARTITION", partition]
        for split in splits:
            args += ["SPLIT", split]
        for option, value in (options or {}).items():
            args += [option, value]
        self._client.admin_command(*args)

    def drop(self, name: str) -> None:
        """Drops the table and its data."""
        self._client.admin_command("TABLE.DROP", name)

    def list(self) -> list[str]:
        """The tables' names, ``default`` among them."""
        return [text(name) for name in self._client.admin_command("TABLE.LIST")]

    def info(self, name: str) -> TableInfo:
        return parse_info(self._client.admin_command("TABLE.INFO", name))

    def alter(self, name: str, topology: str | None = None, consistency: str | None = None) -> None:
        """Switches a cluster table's replication mode while it serves:
        ``topology`` ``ms`` (master–slave) or ``aa`` (active–active),
        ``consistency`` ``strong`` or ``eventual``; what is not named stays.
        Answers once every shard runs the new mode."""
        if topology is None and consistency is None:
            raise ValueError("TABLE.ALTER needs a topology, a consistency or both")
        if topology is not None and topology not in TOPOLOGIES:
            raise ValueError(f"topology is one of {TOPOLOGIES}, not {topology!r}")
        if consistency is not None and consistency not in CONSISTENCIES:
            raise ValueError(f"consistency is one of {CONSISTENCIES}, not {consistency!r}")
        args = ["TABLE.ALTER", name]
        if topology is not None:
            args += ["TOPOLOGY", topology]
        if consistency is not None:
            args += ["CONSISTENCY", consistency]
        self._client.admin_command(*args)


def range_bounds(start: str | bytes | None, end: str | bytes | None) -> tuple[bytes, bytes]:
    """TABLE.RANGE's bounds for the keys from ``start`` (inclusive) up to
    ``end`` (exclusive), ``None`` being open."""
    lowest = b"-" if start is None else b"[" + _bytes(start)
    highest = b"+" if end is None else b"(" + _bytes(end)
    return lowest, highest


def walk_range(
    client: TesseraApi, table: str, start: str | bytes | None, end: str | bytes | None, page: int
) -> Iterator[Any]:
    """Every key of ``table`` in order, ``page`` keys per TABLE.RANGE."""
    if page < 1:
        raise ValueError("a page holds at least one key")
    lowest, highest = range_bounds(start, end)
    while True:
        keys = client.admin_command("TABLE.RANGE", table, lowest, highest, "COUNT", page)
        yield from keys
        if len(keys) < page:
            return
        lowest = b"(" + _bytes(keys[-1])


def _bytes(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()
