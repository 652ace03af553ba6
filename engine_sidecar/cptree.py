"""CP-Tree (CRAFT): a tree of chunk sequences whose KV is stored exactly, at fixed positions.

A path root -> C1 -> C2 -> C3 means a request once computed [prefix, C1, C2, C3] with full
attention and kept each chunk's KV at its exact positions. A new request starting with the same
prefix and chunks reuses the longest matching path with no rotation and no recompute; a stored
[C1, C2, C3] also serves [C1] and [C1, C2] (prefix slicing), since each node keeps only its own
span. A node's KV lives in the chunk store; `is_alive` asks the store, and a node whose KV was
evicted is cut off with its subtree, so evicted KV can never be used.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def chain_digest(parent: str, child: str) -> str:
    return hashlib.blake2b(f"{parent}>{child}".encode(), digest_size=16).hexdigest()


@dataclass
class CPNode:
    chunk_digest: str  # digest of this chunk's token ids ('' for a root)
    path_digest: str  # chain digest of root .. this node: names the node's KV in the store
    chunk_id: str | None = None
    tenant: str = ""
    children: dict[str, CPNode] = field(default_factory=dict)
    parent: CPNode | None = None

    @property
    def depth(self) -> int:
        node, depth = self, 0
        while node.parent is not None:
            node, depth = node.parent, depth + 1
        return depth


class CPTree:
    """Bounded: past `max_nodes` nodes (or `max_roots` roots) a sweep drops nodes whose KV left
    the store and roots with no children, then, if still over, the least recently used roots
    whole (their KV stays in the store until it evicts it; only the exact-path index forgets it).
    The most recently used root is never swept, so the bound holds up to one root's paths."""

    def __init__(self, is_alive: Callable[[CPNode], bool], promote_threshold: int = 2,
                 max_nodes: int = 100_000, max_roots: int = 10_000):
        self.is_alive = is_alive
        self.promote_threshold = promote_threshold
        self.max_nodes = max_nodes
        self.max_roots = max_roots
        self._roots: dict[str, CPNode] = {}  # least recently used first
        self._lock = threading.RLock()
        self._count = 0

    def root(self, root_digest: str, tenant: str = "") -> CPNode:
        """The root for one (tenant, template prefix): paths never cross prefixes or tenants."""
        with self._lock:
            node = self._roots.pop(root_digest, None)
            if node is None:
                node = CPNode("", root_digest, tenant=tenant)
            self._roots[root_digest] = node
            if len(self._roots) > self.max_roots:
                self._sweep()
            return node

    def _sweep(self) -> None:
        """Drop dead nodes and empty roots; then whole roots, oldest first, while over a bound."""
        def prune(node: CPNode) -> None:
            for child in list(node.children.values()):
                if not self.is_alive(child):
                    self.remove(child)
                else:
                    prune(child)

        # the newest root is the one being planned under: its new nodes get their KV only after
        # the prefill, so they look dead now and are left alone
        newest = next(reversed(self._roots))
        for digest, root in list(self._roots.items()):
            if digest == newest:
                continue
            prune(root)
            if not root.children:
                del self._roots[digest]
        while (self._count > self.max_nodes or len(self._roots) > self.max_roots) and len(self._roots) > 1:
            digest = next(iter(self._roots))
            for child in list(self._roots[digest].children.values()):
                self.remove(child)
            del self._roots[digest]

    def match(self, root_digest: str, chunk_digests: Sequence[str], tenant: str = "") -> list[CPNode]:
        """Longest stored path for these leading chunks (dead nodes are pruned on the way)."""
        path: list[CPNode] = []
        node = self.root(root_digest, tenant)
        for digest in chunk_digests:
            child = node.children.get(digest)
            if child is None:
                break
            if not self.is_alive(child):
                self.remove(child)
                break
            path.append(child)
            node = child
        return path

    def child_path_digest(self, parent: CPNode, chunk_digest: str) -> str:
        return chain_digest(parent.path_digest, chunk_digest)

    def insert(self, parent: CPNode, chunk_digest: str, chunk_id: str | None = None) -> CPNode:
        with self._lock:
            child = parent.children.get(chunk_digest)
            if child is None:
                child = CPNode(chunk_digest, self.child_path_digest(parent, chunk_digest), chunk_id,
                               tenant=parent.tenant, parent=parent)
                parent.children[chunk_digest] = child
                self._count += 1
                if self._count > self.max_nodes:
                    self._sweep()
            return child

    def should_promote(self, counts: Sequence[int], threshold: int | None = None) -> bool:
        """A path [C1..Cd] is promoted once every chunk on it reached the threshold."""
        limit = self.promote_threshold if threshold is None else threshold
        return bool(counts) and all(c >= limit for c in counts)

    def remove(self, node: CPNode) -> None:
        with self._lock:
            if node.parent is not None and node.parent.children.get(node.chunk_digest) is node:
                del node.parent.children[node.chunk_digest]
                self._count -= _subtree_size(node)
            node.parent = None

    def nodes(self) -> int:
        return self._count

    def roots(self) -> int:
        return len(self._roots)


def _subtree_size(node: CPNode) -> int:
    return 1 + sum(_subtree_size(c) for c in node.children.values())
