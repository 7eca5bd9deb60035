"""Tree buffers for small hand-built trees, tree validation and JSON, the sparse-tree builder."""

import pytest
import torch

from tokenmaxx.inference import Tree, chain, default_tree, parse_tree, sparse_tree


def test_three_node_tree_buffers_by_hand():
    # root -> (0,) -> (0, 0); root -> (1,)
    b = Tree([(1,), (0, 0), (0,)]).buffers
    # node order: 0 root, 1 (0,), 2 (1,), 3 (0, 0)
    assert b.depths.tolist() == [0, 1, 1, 2]
    assert b.parents.tolist() == [0, 0, 0, 1]
    assert b.attn_mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert b.topk == 2
    # cat([root], top2(head1), top2(head2)): (0,) -> 1, (1,) -> 2, (0, 0) -> 1 + 2 + 0 = 3
    assert b.token_index.tolist() == [0, 1, 2, 3]
    assert b.retrieve.tolist() == [[0, 2, -1], [0, 1, 3]]  # leaves (1,) and (0, 0)
    assert b.children == ((1, 2), (3,), (), ())


def test_chain_buffers():
    b = chain(3).buffers
    assert b.depths.tolist() == [0, 1, 2, 3]
    assert b.attn_mask.tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()
    assert b.token_index.tolist() == [0, 1, 2, 3]  # top-1 of heads 1, 2, 3
    assert b.retrieve.tolist() == [[0, 1, 2, 3]]


def test_root_only_tree():
    b = chain(0).buffers
    assert b.num_nodes == 1 and b.retrieve.tolist() == [[0]]


def test_token_index_uses_rank_and_depth():
    b = Tree([(0,), (2,), (2, 1)]).buffers  # topk 3
    assert b.topk == 3
    assert b.token_index.tolist() == [0, 1, 3, 1 + 3 + 1]


@pytest.mark.parametrize("paths, msg", [
    ([(0, 0)], "no parent path"),
    ([(0,), (-1,)], "integers >= 0"),
    ([()], "non-empty"),
    (["ab"], "non-empty sequence"),
    ([(0,), (0.5,)], "integers >= 0"),
])
def test_invalid_trees(paths, msg):
    with pytest.raises(ValueError, match=msg):
        Tree(paths)


def test_json_round_trip_and_parse():
    tree = default_tree()
    assert Tree.from_json(tree.to_json()) == tree
    assert parse_tree("chain:3", 4) == chain(3)
    assert parse_tree(tree.to_json(), 4) == tree
    assert parse_tree(None, 4) == tree
    with pytest.raises(ValueError, match="unknown tree spec"):
        parse_tree("bushy", 4)


def test_truncate():
    tree = Tree([(0,), (1,), (0, 0), (0, 0, 0)])
    assert tree.truncate(1) == Tree([(0,), (1,)])
    assert tree.truncate(0) == chain(0)
    assert tree.truncate(5) is tree


def test_sparse_tree_picks_highest_products():
    acc = [[0.5, 0.2], [0.6, 0.1]]
    # values: (0,)=.5, (1,)=.2, (0,0)=.3, (0,1)=.05, (1,0)=.12
    assert sparse_tree(acc, 4) == Tree([(0,), (0, 0), (1,)])
    assert sparse_tree(acc, 5) == Tree([(0,), (0, 0), (1,), (1, 0)])
    assert sparse_tree(acc, 100).num_nodes == 7  # root + 2 + 4: everything reachable


def test_default_tree_shape():
    tree = default_tree()
    assert tree.num_nodes == 24 and tree.depth == 4


def test_buffers_built_on_the_device_match_the_compiled_ones():
    from tokenmaxx.heads.tree import compile_buffers, device_buffers, host_tree

    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 20, (), generator=gen))
        parents = [0] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
        compiled = compile_buffers(parents)
        built = device_buffers(torch.tensor(parents), compiled.depth + 2)  # a bound above the depth is fine
        assert torch.equal(compiled.depths, built.depths) and torch.equal(compiled.attn_mask, built.attn_mask)
        assert compiled.children == built.children
        paths = {tuple(x for x in row if x >= 0) for row in built.retrieve.tolist()}  # one row per node
        assert len(paths) == n and {tuple(x for x in row if x >= 0) for row in compiled.retrieve.tolist()} <= paths
        hosted, (values,) = host_tree(torch.device("cpu"), parents, list(range(n)))
        assert torch.equal(hosted.attn_mask, compiled.attn_mask) and values.tolist() == list(range(n))
