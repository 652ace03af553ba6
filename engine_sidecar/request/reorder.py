"""The engine's request orders. The CA-Table itself (CRAFT: chunk access counts over a sliding
window of the last W requests; updates O(k) per request, memory bounded by W·k) is the
standard-library one the adapters use too, keyed here per tenant."""

from __future__ import annotations

from typing import Literal

from engine_sidecar.errors import InvalidPromptError
from ragcache_integrations.access_table import ChunkAccessTable

__all__ = ["ChunkAccessTable", "Order", "access_key", "check_order"]

Order = Literal["preserve", "frequency", "hits-first", "misses-first"]


ORDERS: tuple[str, ...] = ("preserve", "frequency", "hits-first", "misses-first")


def access_key(tenant: str, chunk_id: str) -> str:
    """The CA-Table key: chunk ids count per tenant."""
    return f"{tenant}\x00{chunk_id}"


def check_order(order: str) -> Order:
    if order not in ORDERS:
        raise InvalidPromptError(f"unknown order '{order}': use {', '.join(ORDERS)}")
    return order  # type: ignore[return-value]
