"""Tessera's Python client: redis-py's clients, with Tessera's own API.

:class:`Tessera` is a ``redis.Redis`` and :class:`TesseraCluster` a
``redis.cluster.RedisCluster``, so everything redis-py does works as it does on
Redis. Beside it: ``client.tables`` (create, drop, list, info, alter),
``client.consistency(level)`` and ``client.read_at(level, ...)`` for the
consistency of reads and the level each was served at, ``client.session()``
for a connection of its own (causal sessions and their tokens),
``client.range(table, start, end)`` over every shard in key order,
``client.cluster_status()`` and ``client.pipelined(commands)``.
"""

from .client import (
    CLUSTER_ADDRESS,
    LEVELS,
    NODE_ADDRESS,
    Batch,
    Consistency,
    Leveled,
    Session,
    Tessera,
    TesseraApi,
    TesseraCluster,
)
from .status import ClusterStatus, NodeStatus
from .tables import ShardInfo, TableInfo, Tables

__all__ = [
    "CLUSTER_ADDRESS",
    "LEVELS",
    "NODE_ADDRESS",
    "Batch",
    "ClusterStatus",
    "Consistency",
    "Leveled",
    "NodeStatus",
    "Session",
    "ShardInfo",
    "TableInfo",
    "Tables",
    "Tessera",
    "TesseraApi",
    "TesseraCluster",
]
