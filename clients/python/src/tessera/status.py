"""A cluster's state as its nodes report it (CLUSTER INFO, CLUSTER NODES and
TABLE.INFO), in one call."""

from __future__ import annotations

from dataclasses import dataclass, field

from .tables import TableInfo

SLOTS = 16384


@dataclass(frozen=True)
class NodeStatus:
    """One node as CLUSTER NODES lists it."""

    id: str
    address: str
    """``host:port`` where clients reach it."""
    role: str
    """``primary`` if it heads the slots it lists, else ``replica``."""
    primary: str | None
    """A replica's primary's id."""
    failed: bool
    """Marked failed (or suspected) by the node that answered."""
    connected: bool
    slots: list[tuple[int, int]]
    """The slot ranges it serves, both ends included."""
    myself: bool = False


@dataclass(frozen=True)
class ClusterStatus:
    """What one node says of the whole cluster."""

    state: str
    """``ok`` when every slot is served."""
    slots_ok: int
    known_nodes: int
    epoch: int
    nodes: list[NodeStatus]
    tables: list[TableInfo] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        """Every slot served and no node marked failed."""
        return self.state == "ok" and self.slots_ok == SLOTS and not any(node.failed for node in self.nodes)

    def primaries(self) -> list[NodeStatus]:
        return [node for node in self.nodes if node.role == "primary"]


def parse_cluster_info(reply: str) -> dict[str, str]:
    """CLUSTER INFO's ``name:value`` lines."""
    fields = {}
    for line in reply.splitlines():
        name, colon, value = line.strip().partition(":")
        if colon:
            fields[name] = value
    return fields


def parse_cluster_nodes(reply: str) -> list[NodeStatus]:
    """CLUSTER NODES's lines: id, address, flags, primary, pings, epoch,
    link state, then slots (``a-b``, ``a``, or ``[a->-id]`` while moving)."""
    nodes = []
    for line in reply.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        flags = set(parts[2].split(","))
        slots = []
        for item in parts[8:]:
            if item.startswith("["):
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        nodes.append(
            NodeStatus(
                id=parts[0],
                address=parts[1].split("@")[0].split(",")[0],
                role="primary" if "master" in flags else "replica",
                primary=None if parts[3] == "-" else parts[3],
                failed=bool(flags & {"fail", "fail?"}),
                connected=parts[7] == "connected",
                slots=slots,
                myself="myself" in flags,
            )
        )
    return nodes
