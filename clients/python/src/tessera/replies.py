"""Replies as redis-py hands them over, whatever the protocol version and
whether it decodes: RESP3 maps arrive as dicts, RESP2 as flat lists."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A reply's string, decoded if redis-py left it as bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    return str(value)


def as_dict(reply: Any) -> dict[Any, Any]:
    """A map reply: a RESP3 dict as it is, a RESP2 list of names and values paired."""
    if isinstance(reply, dict):
        return reply
    if isinstance(reply, (list, tuple)) and len(reply) % 2 == 0:
        return dict(zip(reply[::2], reply[1::2]))
    raise ValueError(f"expected a map reply, got {reply!r}")
