"""Property tests (hypothesis) for the CP-Tree: after any sequence of inserts, lookups and KV
evictions the node and root counts stay within their bounds and match what the tree holds, and a
lookup only ever returns a path that was inserted, edge by edge, with the same separators."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_sidecar.reuse.cptree import CPNode, CPTree, chain_digest

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def edge(separator: tuple[int, ...], chunk: tuple[int, ...]) -> str:
    """An edge label naming a chunk with the text before it, unambiguously (the pair, not the
    concatenation)."""
    return f"{separator}|{chunk}"


tokens = st.tuples(st.integers(0, 2)) | st.tuples(st.integers(0, 2), st.integers(0, 2))
pairs = st.lists(st.tuples(st.sampled_from([(), (9,), (8, 9)]), tokens), min_size=1, max_size=4)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 3), pairs, st.booleans()),
    st.tuples(st.just("match"), st.integers(0, 3), pairs),
    st.tuples(st.just("evict"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.integers(1, 500)),
    st.tuples(st.just("stale_insert"), st.integers(0, 50), tokens),
), max_size=40)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_tree(tree: CPTree, max_nodes: int, max_roots: int) -> list[tuple[str, list[CPNode]]]:
    paths = tree.walk()
    assert tree.nodes() == len(paths) <= max_nodes  # the count is what the tree holds
    assert tree.roots() <= max_roots
    for root_digest, path in paths:
        parent = root_digest
        for node in path:  # each node's KV name is the chain of its whole path
            assert node.path_digest == chain_digest(parent, node.chunk_digest)
            parent = node.path_digest
    return paths


@SETTINGS
@given(ops=ops, max_nodes=st.integers(1, 12), max_roots=st.integers(1, 3))
def test_cptree_bounds_and_lookups_hold_after_any_sequence(ops, max_nodes, max_roots):
    alive: set[str] = set()
    clock = Clock()
    tree = CPTree(lambda node: node.path_digest in alive, max_nodes=max_nodes, max_roots=max_roots,
                  pending_s=100.0, clock=clock)
    inserted: dict[str, set[tuple[str, ...]]] = {}  # root -> every edge sequence inserted under it
    kept: list[CPNode] = []  # nodes a caller still holds (a request between plan and commit)
    for op in ops:
        clock.now += 1
        if op[0] == "insert":
            _, r, seq, store_kv = op
            root = f"root{r}"
            parent = tree.root(root)
            labels = tuple(edge(s, c) for s, c in seq)
            for i, label in enumerate(labels):
                parent = tree.insert(parent, label)
                kept.append(parent)
                inserted.setdefault(root, set()).add(labels[: i + 1])
                if store_kv:  # the request's prefill stored the node's KV
                    alive.add(parent.path_digest)
        elif op[0] == "match":
            _, r, seq = op
            root = f"root{r}"
            labels = tuple(edge(s, c) for s, c in seq)
            path = tree.match(root, labels)
            got = tuple(node.chunk_digest for node in path)
            assert got == labels[: len(got)]
            if got:  # only what was inserted under this root, with these separators, edge by edge
                assert got in inserted.get(root, set())
                assert all(node.path_digest in alive for node in path)
                assert path[-1].path_digest == chain_digest(path[-2].path_digest if len(path) > 1 else root, got[-1])
        elif op[0] == "evict":
            if alive:
                alive.discard(sorted(alive)[op[1] % len(alive)])
        elif op[0] == "tick":
            clock.now += op[1]
        elif kept:  # insert under a node the tree may have swept since it was handed out
            node = tree.insert(kept[op[1] % len(kept)], edge((), op[2]))
            assert node.path_digest == chain_digest(node.parent.path_digest if node.parent else
                                                    kept[op[1] % len(kept)].path_digest, node.chunk_digest)
        check_tree(tree, max_nodes, max_roots)


def test_inserting_under_a_swept_node_is_not_counted():
    """Regression: a node kept by a request across a sweep (its root swept whole) took new
    children into the count although the tree no longer held them; the count then never came
    down and every later insert swept the whole tree."""
    alive: set[str] = set()
    tree = CPTree(lambda node: node.path_digest in alive, max_nodes=3, max_roots=2)
    held = tree.insert(tree.root("old"), "a")
    alive.add(held.path_digest)
    deep = tree.insert(held, "b")
    alive.add(deep.path_digest)
    for r in range(2):  # busier roots push "old" out whole
        alive.add(tree.insert(tree.root(f"new{r}"), "x").path_digest)
    assert tree.roots() == 2 and tree.nodes() == 2 and held.parent is None
    for parent in (held, deep):  # the request planned under "old" goes on extending its path
        child = tree.insert(parent, "c")
        assert child.path_digest == chain_digest(parent.path_digest, "c")
        assert tree.nodes() == 2 == len(tree.walk())
        tree.remove(child)
        tree.remove(parent)
        assert tree.nodes() == 2


def test_a_single_root_stays_within_the_node_bound():
    """Regression: the most recently used root was never swept, so with one system prompt (the
    common case) dead nodes stayed and the tree grew without bound. Now its dead nodes go once
    past the pending grace, then its least recently used paths."""
    clock = Clock()
    alive: set[str] = set()
    tree = CPTree(lambda node: node.path_digest in alive, max_nodes=20, pending_s=10.0, clock=clock)
    hot = tree.insert(tree.root("r"), "hot")
    alive.add(hot.path_digest)
    for i in range(200):
        clock.now += 1
        node = tree.insert(tree.root("r"), f"c{i}")
        if i % 2:
            alive.add(node.path_digest)
        tree.match("r", ["hot"])  # the path in use survives every sweep
        assert tree.nodes() <= 20
    assert [n.chunk_digest for n in tree.match("r", ["hot"])] == ["hot"]


def test_new_nodes_of_the_newest_root_are_spared_while_their_kv_is_pending():
    clock = Clock()
    tree = CPTree(lambda node: False, max_nodes=10, pending_s=10.0, clock=clock)
    old = [tree.insert(tree.root("r"), f"old{i}") for i in range(5)]  # their prefill failed: never stored
    clock.now = 100.0
    new = [tree.insert(tree.root("r"), f"new{i}") for i in range(6)]  # requests still prefilling
    assert tree.nodes() == 6
    assert all(n.parent is None for n in old) and all(n.parent is not None for n in new)
