"""Draft trees as data, compiled once into the buffers the decode loop indexes with.

A tree is a set of paths; a path is a tuple of ranks ``(r1, ..., rd)``: the r1-th best token of head 1, then the r2-th
best of head 2, and so on. Node 0 is the root (the token the backbone already chose); every other node is one path, and
every prefix of a path must be in the tree too. Nodes are ordered by depth, then lexicographically.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import torch


_TENSOR_FIELDS = ("depths", "parents", "attn_mask", "token_index", "retrieve")  # what ``TreeBuffers.to`` moves


@dataclass(frozen=True)
class TreeBuffers:
    """Compiled tree. N nodes (root included), P paths, D = depth, k = top-k taken from each head.

    Two ways to build them: ``compile_buffers`` on the CPU from a Python list of parents (static trees, trees merged
    on the host), with one ``retrieve`` row per leaf; ``device_buffers`` on the device from a parents tensor (dynamic
    trees grown there), with one row per node, so that no shape depends on the tree's values and nothing is read
    back. The rows only list paths: acceptance takes the longest agreeing one either way. ``to(device)`` is the copy
    of CPU-built buffers that meets the backbone's tensors (made once per device, then kept with these buffers).
    """

    depths: torch.Tensor  # [N] long: 0 for the root; also the position offset of each node
    parents: torch.Tensor  # [N] long: parent node index (the root is its own parent)
    attn_mask: torch.Tensor  # [N, N] bool: node i may attend to node j (j is i or an ancestor of i)
    token_index: torch.Tensor  # [N] long: index into cat([root], head_topk[:D].flatten()) for each node's token
    retrieve: torch.Tensor  # [P, D+1] long: node indices along root-to-node paths (each leaf's, or each node's),
    # padded with -1
    topk: int  # candidates taken from each head (max rank + 1)
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> ``to``'s copy
    _children: list = field(default_factory=list, init=False, repr=False, compare=False)  # ``children``, once read

    def to(self, device: torch.device | str) -> "TreeBuffers":
        """These buffers with their tensors on ``device``: themselves where they already are, else a copy made on
        the first call for that device and kept."""
        device = torch.device(device)
        if device == self.depths.device:
            return self
        copy = self._copies.get(device)
        if copy is None:
            copy = dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in _TENSOR_FIELDS})
            if self.parents.device.type == "cpu":  # the children as the CPU reads them, not read back from the device
                copy._children.append(self.children)
            self._copies[device] = copy
        return copy

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Per node: its children's node indices in node order (static trees: best rank first). Read from
        ``parents`` on first use (a host read for device-built buffers: the sampling rule walks the tree in Python)."""
        if not self._children:
            parents = self.parents.tolist()
            kids: list[list[int]] = [[] for _ in parents]
            for node, parent in enumerate(parents[1:], start=1):
                kids[parent].append(node)
            self._children.append(tuple(map(tuple, kids)))
        return self._children[0]

    @property
    def depth(self) -> int:
        return self.retrieve.shape[1] - 1


class Tree:
    """An immutable draft tree. ``Tree([(0,), (1,), (0, 0)])`` is a root with two children, one with a child."""

    def __init__(self, paths: Iterable[Sequence[int]]):
        clean = set()
        for path in paths:
            if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or len(path) == 0:
                raise ValueError(f"a tree path must be a non-empty sequence of ranks, got {path!r}")
            for rank in path:
                if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                    raise ValueError(f"tree ranks must be integers >= 0, got {rank!r} in path {tuple(path)}")
            clean.add(tuple(path))
        for path in clean:
            if len(path) > 1 and path[:-1] not in clean:
                raise ValueError(f"tree path {path} has no parent path {path[:-1]} in the tree")
        self.paths: tuple[tuple[int, ...], ...] = tuple(sorted(clean, key=lambda p: (len(p), p)))

    # ---- description ------------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1

    def __len__(self) -> int:
        return self.num_nodes

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree(nodes={self.num_nodes}, depth={self.depth})"

    def to_json(self) -> str:
        return json.dumps([list(p) for p in self.paths])

    @classmethod
    def from_json(cls, text: str) -> "Tree":
        return cls(json.loads(text))

    @lru_cache(maxsize=64)
    def truncate(self, max_depth: int) -> "Tree":
        """The same tree without nodes deeper than ``max_depth``."""
        return Tree(p for p in self.paths if len(p) <= max_depth) if max_depth < self.depth else self

    # ---- compilation ------------------------------------------------------------------------------------------
    @cached_property
    def buffers(self) -> TreeBuffers:
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        topk = max((r for p in self.paths for r in p), default=-1) + 1
        parents = [0] + [index.get(p[:-1], 0) for p in self.paths]
        token_index = [0] + [1 + (len(p) - 1) * topk + p[-1] for p in self.paths]
        return compile_buffers(parents, token_index=token_index, topk=max(topk, 1))


def compile_buffers(parents: Sequence[int], token_index: Sequence[int] | None = None, topk: int = 1) -> TreeBuffers:
    """Buffers of a tree given each node's parent (node 0 is the root; a parent always precedes its children).

    Siblings keep their order here (for static trees: best rank first).
    """
    n = len(parents)
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    attn_mask = torch.eye(n, dtype=torch.bool, device="cpu")
    for i in range(1, n):
        parent = parents[i]
        if not 0 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede their children")
        depths[i] = depths[parent] + 1
        children[parent].append(i)
        attn_mask[i] |= attn_mask[parent]
    leaves = [i for i in range(n) if not children[i] and i > 0] or [0]
    retrieve = torch.full((len(leaves), max(depths) + 1), -1, dtype=torch.long, device="cpu")
    for row, leaf in enumerate(leaves):
        node = leaf
        for d in range(depths[leaf], -1, -1):
            retrieve[row, d] = node
            node = parents[node]
    return TreeBuffers(depths=torch.tensor(depths, device="cpu"), parents=torch.tensor(list(parents), device="cpu"),
                       attn_mask=attn_mask, retrieve=retrieve, topk=topk,
                       token_index=torch.tensor(list(token_index) if token_index is not None else range(n),
                                                device="cpu"))


def device_buffers(parents: torch.Tensor, depth: int) -> TreeBuffers:
    """Buffers of a tree from its parents tensor [N] (node 0 the root, its own parent; a parent precedes its
    children), built where ``parents`` lives without reading it: ``depth`` (at least the tree's depth) bounds the
    walks up the tree and sets ``retrieve``'s width, which holds one row per node."""
    n, device = parents.shape[0], parents.device
    nodes = torch.arange(n, device=device)
    up = nodes.clone()
    attn_mask = torch.eye(n, dtype=torch.bool, device=device)
    depths = torch.zeros(n, dtype=torch.long, device=device)
    for _ in range(depth):  # after step s, ``up`` is each node's ancestor s levels up (the root once it is reached)
        depths += up != 0
        up = parents[up]
        attn_mask[nodes, up] = True
    retrieve = torch.full((n, depth + 1), -1, dtype=torch.long, device=device)
    up = nodes.clone()
    for _ in range(depth + 1):  # each node's path, written at its ancestors' depths (the root's row stays [0])
        retrieve.scatter_(1, depths[up][:, None], up[:, None])
        up = parents[up]
    return TreeBuffers(depths=depths, parents=parents, attn_mask=attn_mask, retrieve=retrieve, topk=1,
                       token_index=nodes)


def chain(k: int) -> Tree:
    """A single path of k top-1 guesses: head 1's best, then head 2's best, ..."""
    if k < 0:
        raise ValueError(f"chain length must be >= 0, got {k}")
    return Tree([(0,) * d for d in range(1, k + 1)])


def sparse_tree(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> Tree:
    """Medusa-style sparse tree: grow greedily by the path whose product of per-head rank accuracies is largest.

    ``rank_accuracy[k-1][r]`` estimates how often the r-th best token of head k is the right one (given the path to it
    was right). A node's value is the product along its path, i.e. the chance the whole path is accepted, and the
    expected accepted length of a tree is the sum of its nodes' values; adding the best frontier node each time keeps
    the tree prefix-closed and maximises that sum for every size (values only shrink along a path).
    """
    if num_nodes < 1:
        raise ValueError(f"a tree has at least its root: num_nodes must be >= 1, got {num_nodes}")
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): acc for r, acc in enumerate(rank_accuracy[0])} if rank_accuracy else {}
    while len(chosen) + 1 < num_nodes and frontier:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-r for r in p)))
        value = frontier.pop(path)
        chosen[path] = value
        if len(path) < len(rank_accuracy):
            for r, acc in enumerate(rank_accuracy[len(path)]):
                frontier[path + (r,)] = value * acc
    return Tree(chosen)


def path_probability(rank_accuracy: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """Product of per-head rank accuracies along a path: the chance it is accepted under Medusa's model. Heads deeper
    than the table use its last row; ranks past a row's end decay from its last entry."""
    value = 1.0
    for k, r in enumerate(path):
        row = rank_accuracy[min(k, len(rank_accuracy) - 1)]
        value *= row[r] if r < len(row) else row[-1] / (r - len(row) + 2)
    return value


# Per-rank accuracies of typical Medusa heads on a small backbone (head 1's top-1 about 0.3; deeper heads are judged
# given their parent was right, which is why they are higher). The default tree is grown from this table.
TYPICAL_RANK_ACCURACY = (
    (0.32, 0.10, 0.06, 0.04, 0.03, 0.02, 0.02, 0.015),
    (0.40, 0.10, 0.06, 0.04, 0.03),
    (0.50, 0.10, 0.05, 0.03),
    (0.55, 0.10, 0.05),
)
DEFAULT_TREE_NODES = 24


def default_tree(num_heads: int = 4) -> Tree:
    """The library's default sparse tree for Medusa heads: 24 nodes, a size whose verify costs a fraction of decoding
    that many tokens one by one on a CPU in bf16 (docs/benchmarks.md)."""
    return sparse_tree(TYPICAL_RANK_ACCURACY[:num_heads], DEFAULT_TREE_NODES)


def parse_tree(spec: str | Tree | Sequence[Sequence[int]] | None, num_heads: int) -> Tree:
    """Tree from a spec: a Tree, a list of paths, 'default', 'chain:K', a JSON list, or a path to a JSON file."""
    if spec is None or spec == "default":
        return default_tree(num_heads)
    if isinstance(spec, Tree):
        return spec
    if isinstance(spec, str):
        if spec.startswith("chain:"):
            try:
                return chain(int(spec.split(":", 1)[1]))
            except ValueError:
                raise ValueError(f"bad tree spec {spec!r}: expected chain:<int>") from None
        if spec.lstrip().startswith("["):
            return Tree.from_json(spec)
        if Path(spec).is_file():
            return Tree.from_json(Path(spec).read_text())
        raise ValueError(f"unknown tree spec {spec!r}: expected 'default', 'chain:K', a JSON list of paths, "
                         "or a JSON file of paths")
    return Tree(spec)


def host_tree(device: torch.device, parents: Sequence[int], *rows: Sequence[float]
              ) -> tuple[TreeBuffers, list[torch.Tensor]]:
    """A tree made on the host (Python lists: ``parents`` and per-node ``rows`` such as tokens, sources, values) on
    ``device`` in ONE copy: the buffers (``device_buffers``, their ``children`` known without a read) and each row
    as a float64 tensor [N] (integers below 2**53 are exact; cast them with ``.long()``)."""
    depths = [0] * len(parents)
    kids: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
        kids[parents[node]].append(node)
    packed = torch.tensor([list(parents), *map(list, rows)], dtype=torch.float64, device=device)  # [1 + R, N]
    buffers = device_buffers(packed[0].long(), max(depths))
    buffers._children.append(tuple(map(tuple, kids)))
    return buffers, list(packed[1:])
