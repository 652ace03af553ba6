"""CA-Table and CP-Tree as plain data structures."""

from __future__ import annotations

from engine_sidecar.request.reorder import ChunkAccessTable
from engine_sidecar.reuse.cptree import CPTree


def test_ca_table_counts_and_window_expiry():
    table = ChunkAccessTable(window=3)
    table.record(["a", "b"])
    table.record(["a", "c"])
    table.record(["a", "a"])  # a request counts a chunk once
    assert (table.count("a"), table.count("b"), table.count("c")) == (3, 1, 1)
    table.record(["d"])  # pushes out the first request
    assert (table.count("a"), table.count("b"), table.count("d")) == (2, 0, 1)
    assert "b" not in table._counts  # bounded memory: expired ids are forgotten
    for _ in range(3):
        table.record(["z"])
    assert len(table) == 1 and table.count("z") == 3


def test_frequency_order_is_deterministic_and_aligns_similar_sets():
    table = ChunkAccessTable(window=100)
    for ids in (["x", "y"], ["y", "z"], ["y", "x"], ["w"]):
        table.record(ids)
    first = table.sort(["w", "z", "x", "y"], key_of=lambda c: c)
    second = table.sort(["x", "w", "y", "z"], key_of=lambda c: c)
    assert first == second == ["y", "x", "w", "z"]  # y:3, x:2, then ties by id


def make_tree(alive: set[str], threshold: int = 2) -> CPTree:
    return CPTree(lambda node: node.path_digest in alive, threshold)


def test_cptree_insert_match_and_prefix_slicing():
    alive: set[str] = set()
    tree = make_tree(alive)
    root = tree.root("r")
    n1 = tree.insert(root, "c1")
    n2 = tree.insert(n1, "c2")
    n3 = tree.insert(n2, "c3")
    alive.update({n1.path_digest, n2.path_digest, n3.path_digest})
    assert tree.match("r", ["c1", "c2", "c3", "c4"]) == [n1, n2, n3]
    assert tree.match("r", ["c1"]) == [n1]  # a stored [c1,c2,c3] serves [c1] ...
    assert tree.match("r", ["c1", "c2"]) == [n1, n2]  # ... and [c1,c2]
    assert tree.match("r", ["c2", "c1"]) == []  # order matters: it is a prefix tree
    assert tree.match("other-root", ["c1"]) == []
    assert n3.depth == 3 and tree.nodes() == 3
    assert tree.insert(n1, "c2") is n2  # inserting an existing child returns it


def test_cptree_promotion_threshold_and_extension():
    tree = make_tree(set(), threshold=2)
    assert not tree.should_promote([])
    assert not tree.should_promote([2, 1])
    assert tree.should_promote([2, 5])
    assert make_tree(set(), threshold=1).should_promote([1])


def test_cptree_evicted_node_is_cut_with_its_subtree():
    alive: set[str] = set()
    tree = make_tree(alive)
    root = tree.root("r")
    n1 = tree.insert(root, "c1")
    n2 = tree.insert(n1, "c2")
    n3 = tree.insert(n2, "c3")
    alive.update({n1.path_digest, n3.path_digest})  # c2's KV was evicted from the store
    assert tree.match("r", ["c1", "c2", "c3"]) == [n1]
    assert "c2" not in n1.children and tree.nodes() == 1  # n3 went with n2: never used again


def test_cptree_path_digest_depends_on_the_whole_path():
    tree = make_tree(set())
    a = tree.insert(tree.insert(tree.root("r"), "c1"), "c3")
    b = tree.insert(tree.insert(tree.root("r"), "c2"), "c3")
    assert a.path_digest != b.path_digest


def test_tree_stays_within_its_node_and_root_bounds():
    alive: set[str] = set()
    tree = CPTree(lambda node: node.path_digest in alive, max_nodes=10, max_roots=4)
    for r in range(20):  # many tenants / system prompts, each with a short path
        parent = tree.root(f"root-{r}", tenant=f"t{r}")
        for c in range(3):
            parent = tree.insert(parent, f"c{c}")
            alive.add(parent.path_digest)
        # (the root being planned under is never swept: its new nodes get their KV afterwards)
        assert tree.nodes() <= 10 + 3 and tree.roots() <= 4
    # the newest paths survive; evicted KV is swept out, and empty roots with it
    assert [n.chunk_digest for n in tree.match("root-19", ["c0", "c1", "c2"], "t19")] == ["c0", "c1", "c2"]
    alive.clear()
    for r in range(6):
        tree.root(f"x{r}", "t")
    assert tree.nodes() <= 3 and tree.roots() <= 4
