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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def chain_digest(parent: str, child: str) -> str:
    return hashlib.blake2b(f"{parent}>{child}".encode(), digest_size=16).hexdigest()


@dataclass(eq=False)
class CPNode:
    chunk_digest: str  # digest of this chunk's token ids ('' for a root)
    path_digest: str  # chain digest of root .. this node: names the node's KV in the store
    chunk_id: str | None = None
    tenant: str = ""
    children: dict[str, CPNode] = field(default_factory=dict)
    parent: CPNode | None = None
    born: float = 0.0  # when inserted: its KV is stored only after that request's prefill
    used: float = 0.0  # last insert or match through it (least recently used paths go first)

    @property
    def depth(self) -> int:
        node, depth = self, 0
        while node.parent is not None:
            node, depth = node.parent, depth + 1
        return depth


class CPTree:
    """Bounded: `nodes() <= max_nodes` and `roots() <= max_roots` after every call. Past a bound a
    sweep drops nodes whose KV left the store and roots with no children, then the least recently
    used roots whole, then the least recently used paths of the roots left, down to 90% of the
    bound (so a tree at its bound is not walked again on every insert). Dropping a live node only
    makes the exact-path index forget it: its KV stays in the store until the store evicts it.

    A node inserted less than `pending_s` ago under the most recently used root is not taken for
    dead: its KV is stored only after the prefill of the request planning it. Nodes of a subtree
    the tree no longer holds (a request kept a node across a sweep) are never counted: inserting
    under one gives a node with the right path digest that the tree does not hold."""

    def __init__(self, is_alive: Callable[[CPNode], bool], promote_threshold: int = 2,
                 max_nodes: int = 100_000, max_roots: int = 10_000, pending_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_nodes < 1 or max_roots < 1:
            raise ValueError("max_nodes and max_roots must be >= 1")
        self.is_alive = is_alive
        self.promote_threshold = promote_threshold
        self.max_nodes = max_nodes
        self.max_roots = max_roots
        self.pending_s = pending_s
        self.clock = clock
        self._roots: dict[str, CPNode] = {}  # least recently used first
        self._lock = threading.RLock()
        self._count = 0

    def root(self, root_digest: str, tenant: str = "") -> CPNode:
        """The root for one (tenant, template prefix): paths never cross prefixes or tenants."""
        with self._lock:
            now = self.clock()
            node = self._roots.pop(root_digest, None)
            if node is None:
                node = CPNode("", root_digest, tenant=tenant, born=now)
            node.used = now
            self._roots[root_digest] = node
            if len(self._roots) > self.max_roots:
                self._sweep()
            return node

    def _attached(self, node: CPNode) -> bool:
        """Whether the tree holds this node (its chain of parents ends at a current root)."""
        while node.parent is not None:
            parent = node.parent
            if parent.children.get(node.chunk_digest) is not node:
                return False
            node = parent
        return self._roots.get(node.path_digest) is node

    def _sweep(self) -> None:
        """Dead nodes and empty roots; then whole roots, then paths, least recently used first,
        while over a bound."""
        now = self.clock()
        newest = next(reversed(self._roots))

        def prune(node: CPNode, spare_after: float) -> None:
            for child in list(node.children.values()):
                if child.born <= spare_after and not self.is_alive(child):
                    self._detach(child)
                else:
                    prune(child, spare_after)

        for digest, root in list(self._roots.items()):
            # the newest root is the one being planned under: its new nodes look dead until the
            # prefill stores their KV
            prune(root, now - self.pending_s if digest == newest else float("inf"))
            if not root.children and digest != newest:
                del self._roots[digest]
        node_target = self.max_nodes - self.max_nodes // 10
        root_target = self.max_roots - self.max_roots // 10
        if self._count > self.max_nodes or len(self._roots) > self.max_roots:
            while (self._count > node_target or len(self._roots) > root_target) and len(self._roots) > 1:
                digest = next(iter(self._roots))
                for child in list(self._roots[digest].children.values()):
                    self._detach(child)
                del self._roots[digest]
        if self._count > self.max_nodes:  # one root's paths alone are over: its oldest go
            nodes: list[CPNode] = []
            stack = list(self._roots.values())
            while stack:
                node = stack.pop()
                for child in node.children.values():
                    nodes.append(child)
                    stack.append(child)
            # a node was used whenever a descendant was: parents sort no later than children
            nodes.sort(key=lambda n: (n.used, -n.depth))
            for node in nodes:
                if self._count <= node_target:
                    break
                if self._attached(node):
                    self._detach(node)

    def match(self, root_digest: str, chunk_digests: Sequence[str], tenant: str = "") -> list[CPNode]:
        """Longest stored path for these leading chunks (dead nodes are pruned on the way). A
        root that does not exist yet is not created: planning adds nothing to the tree."""
        with self._lock:
            path: list[CPNode] = []
            if root_digest not in self._roots:
                return path
            node = self.root(root_digest, tenant)
            now = node.used
            for digest in chunk_digests:
                child = node.children.get(digest)
                if child is None:
                    break
                if not self.is_alive(child):
                    self._detach(child)
                    break
                child.used = now
                path.append(child)
                node = child
            return path

    def child_path_digest(self, parent: CPNode, chunk_digest: str) -> str:
        return chain_digest(parent.path_digest, chunk_digest)

    def insert(self, parent: CPNode, chunk_digest: str, chunk_id: str | None = None) -> CPNode:
        with self._lock:
            now = self.clock()
            child = parent.children.get(chunk_digest)
            attached = self._attached(parent)
            if child is None or not attached:
                child = CPNode(chunk_digest, self.child_path_digest(parent, chunk_digest), chunk_id,
                               tenant=parent.tenant, parent=parent if attached else None, born=now)
                if not attached:  # swept meanwhile: counting it would leak a node per insert
                    child.used = now
                    return child
                parent.children[chunk_digest] = child
                self._count += 1
            node: CPNode | None = child
            while node is not None:
                node.used = now
                node = node.parent
            if self._count > self.max_nodes:
                self._sweep()
            return child

    def propose(self, parent: CPNode | None, root_digest: str, chunk_digest: str, chunk_id: str | None,
                tenant: str = "") -> CPNode:
        """A node as planning sees it, outside the tree: `commit` inserts it once its KV is stored
        (a prefill that fails leaves the tree as it was). `parent` is a matched node or an
        earlier proposal; None means the root of `root_digest`."""
        if parent is None:
            parent = CPNode("", root_digest, tenant=tenant)
        return CPNode(chunk_digest, self.child_path_digest(parent, chunk_digest), chunk_id, tenant=parent.tenant,
                      parent=parent)

    def commit(self, proposed: CPNode) -> CPNode:
        """Insert a proposed node (and the proposals it hangs from), returning the tree's node."""
        parent = proposed.parent
        if parent is None:
            raise ValueError("a proposed node has a parent")
        with self._lock:
            if parent.parent is None:
                held = self.root(parent.path_digest, parent.tenant)
            elif parent.parent.children.get(parent.chunk_digest) is parent:
                held = parent  # a matched node (insert copes if a sweep dropped it meanwhile)
            else:
                held = self.commit(parent)
            return self.insert(held, proposed.chunk_digest, proposed.chunk_id)

    def should_promote(self, counts: Sequence[int], threshold: int | None = None) -> bool:
        """A path [C1..Cd] is promoted once every chunk on it reached the threshold."""
        limit = self.promote_threshold if threshold is None else threshold
        return bool(counts) and all(c >= limit for c in counts)

    def remove(self, node: CPNode) -> None:
        with self._lock:
            self._detach(node)

    def _detach(self, node: CPNode) -> None:
        """With the lock held: cut the node and its subtree off (counted only if the tree held it)."""
        if node.parent is not None and node.parent.children.get(node.chunk_digest) is node:
            if self._attached(node):
                self._count -= _subtree_size(node)
            del node.parent.children[node.chunk_digest]
        node.parent = None

    def nodes(self) -> int:
        return self._count

    def roots(self) -> int:
        return len(self._roots)

    def walk(self) -> list[tuple[str, list[CPNode]]]:
        """Every held path from a root (root digest, nodes root-first), for checks and debugging."""
        out: list[tuple[str, list[CPNode]]] = []
        with self._lock:
            for digest, root in self._roots.items():
                stack: list[list[CPNode]] = [[child] for child in root.children.values()]
                while stack:
                    path = stack.pop()
                    out.append((digest, path))
                    stack.extend([*path, child] for child in path[-1].children.values())
        return out


def _subtree_size(node: CPNode) -> int:
    return 1 + sum(_subtree_size(c) for c in node.children.values())
