"""Prompt-lookup drafts: n-gram continuations from the prompt and the text so far, as extra tree branches.

A lookup branch is a deterministic draft (like a head's top-k guess), so greedy acceptance and lossless sampling treat
it exactly like any other node. Branches are merged into the heads' tree token by token: where a branch starts with a
token the heads already proposed at that place, the node is shared (deduplicated) and the branch continues below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .tree import TreeBuffers, compile_buffers

HEADS, LOOKUP = 1, 2  # node source bits
SOURCE_NAMES = {HEADS: "heads", LOOKUP: "lookup", HEADS | LOOKUP: "both"}
DRAFT_MODES = ("heads", "lookup", "hybrid")


@dataclass(frozen=True)
class LookupConfig:
    """Lookup branch settings. The branch length adapts per generation: +2 after a fully accepted branch, -1 after a
    partly rejected one, within [min_len, max_len] (the rule transformers uses for its assistant's draft length)."""

    max_ngram: int = field(default=3, metadata={"help": "longest suffix n-gram matched"})
    min_ngram: int | None = field(default=None, metadata={
        "help": "shortest suffix n-gram matched; default 2 for lookup drafting (1 matches too eagerly for a chain "
                "nobody values), 1 for hybrid (each branch is valued by the measured acceptance of its match length)"})
    start_len: int = field(default=8, metadata={"help": "branch length at the start of a generation"})
    min_len: int = field(default=2, metadata={"help": "shortest branch"})
    max_len: int = field(default=16, metadata={"help": "longest branch"})
    branches: int = field(default=3, metadata={
        "help": "hybrid: distinct continuations offered as branches (earlier occurrences of the matched n-gram)"})
    heads_min_yield: float = field(default=0.05, metadata={
        "help": "hybrid: heads whose proposals lately add fewer accepted tokens per round than this sit out rounds "
                "(see HeadsGate); 0 keeps them always on"})
    heads_explore_every: int = field(default=8, metadata={
        "help": "hybrid: heads that sit out still propose every this many rounds, to notice when they pay again"})

    def __post_init__(self):
        if self.min_ngram is not None and not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.branches < 1:
            raise ValueError(f"need branches >= 1, got {self.branches}")
        if self.heads_min_yield < 0 or self.heads_explore_every < 1:
            raise ValueError(f"need heads_min_yield >= 0 and heads_explore_every >= 1, got {self.heads_min_yield}, "
                             f"{self.heads_explore_every}")
        if not 1 <= self.min_len <= self.start_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= start_len <= max_len, got {self.min_len}, {self.start_len}, "
                             f"{self.max_len}")

    def shortest_ngram(self, draft: str) -> int:
        """min_ngram, or the default of the draft mode."""
        if self.min_ngram is not None:
            return self.min_ngram
        return 1 if draft == "hybrid" else 2

    def next_len(self, length: int, proposed: int, accepted: int) -> int:
        grown = length + 2 if proposed and accepted >= proposed else length - 1
        return max(self.min_len, min(self.max_len, grown))


@dataclass
class NgramIndex:
    """Every occurrence of every n-gram (n = 1..max_ngram) of a growing token sequence."""

    max_ngram: int = 3
    tokens: list[int] = field(default_factory=list)
    _ends: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)  # [n-1]: n-gram -> end positions
    _indexed: int = 0  # n-grams ending before this position are in the index

    def __post_init__(self):
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram}")
        self._ends = [{} for _ in range(self.max_ngram)]

    def extend(self, new_tokens) -> None:
        self.tokens.extend(int(t) for t in new_tokens)

    def _catch_up(self) -> None:
        # index every n-gram that ends before the last token (the suffix being matched must not match itself)
        for end in range(self._indexed + 1, len(self.tokens)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends[n - 1].setdefault(tuple(self.tokens[end - n:end]), []).append(end)
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def continuations(self, max_len: int, min_ngram: int = 1, count: int = 1,
                      scan: int = 16) -> tuple[int, list[list[int]]]:
        """Up to ``count`` distinct continuations (each at most ``max_len`` tokens) of the longest suffix n-gram that
        occurred before, from its most recent occurrence backwards (the ``scan`` most recent ones), and that n (0 and
        [] when nothing matches)."""
        if max_len <= 0 or not self.tokens:
            return 0, []
        self._catch_up()
        for n in range(min(self.max_ngram, len(self.tokens)), min_ngram - 1, -1):
            ends = self._ends[n - 1].get(tuple(self.tokens[-n:]))
            if ends:
                found: list[list[int]] = []
                for end in reversed(ends[-scan:]):
                    cont = self.tokens[end:end + max_len]
                    if cont not in found:
                        found.append(cont)
                        if len(found) == count:
                            break
                return n, found
        return 0, []

    def continuation(self, max_len: int, min_ngram: int = 1) -> list[int]:
        """Tokens that followed the most recent earlier occurrence of the longest matching suffix (may be [])."""
        _, found = self.continuations(max_len, min_ngram)
        return found[0] if found else []


def merge_branches(tokens: torch.Tensor, buffers: TreeBuffers, branches: list[list[int]]
                   ) -> tuple[torch.Tensor, TreeBuffers, torch.Tensor, list[list[int]]]:
    """Add draft branches below the root of a tree, sharing nodes where the tokens coincide (with the tree or with
    an earlier branch).

    tokens: [N] tree tokens (node 0 = root). Returns (tokens [N'], buffers, sources [N'] of HEADS/LOOKUP bits, the
    node indices along each branch).
    """
    parents = buffers.parents.tolist()
    toks = tokens.tolist()
    sources = [HEADS] * len(toks)
    child_of = {(parents[i], toks[i]): i for i in range(1, len(toks))}
    paths = []
    for branch in branches:
        node, path = 0, []
        for tok in branch:
            nxt = child_of.get((node, tok))
            if nxt is None:
                nxt = len(toks)
                toks.append(tok)
                parents.append(node)
                sources.append(LOOKUP)
                child_of[(node, tok)] = nxt
            else:
                sources[nxt] |= LOOKUP
            node = nxt
            path.append(node)
        paths.append(path)
    if len(toks) == tokens.numel():  # every branch was already in the tree
        out_buffers = buffers
    else:
        out_buffers = compile_buffers(parents)
    return torch.tensor(toks), out_buffers, torch.tensor(sources), paths


def merge_branch(tokens: torch.Tensor, buffers: TreeBuffers, branch: list[int]) -> tuple[torch.Tensor, TreeBuffers,
                                                                                            torch.Tensor]:
    """``merge_branches`` with one branch: (tokens [N'], buffers, sources [N'])."""
    merged, out_buffers, sources, _ = merge_branches(tokens, buffers, [branch])
    return merged, out_buffers, sources


DEPTH_BUCKETS = (1, 2, 3, 5, 9, 17)  # depth groups that share an estimate: 1, 2, 3-4, 5-8, 9-16, 17+


@dataclass
class LookupReliability:
    """How often lookup tokens are accepted lately, by depth: a decayed Beta estimate per depth group of P(the lookup
    token at depth j is right | the ones above it were).

    Copying is bursty: once a continuation has matched a few tokens, the next one is likelier right than the first
    was, so one constant per-token rate (a geometric model) undervalues deep nodes of a good match and overvalues
    those of a poor one. Each group's estimate starts from the group above it (a prior worth ``prior_weight`` rounds,
    centred on that group's estimate; the first group from 1/2), so deep groups with few observations fall back on
    the shallower ones. A group forgets by ``decay`` per observation it gets.
    """

    decay: float = 0.8
    prior_weight: float = 2.0
    buckets: tuple[int, ...] = DEPTH_BUCKETS
    _counts: dict[int, tuple[float, float]] = field(default_factory=dict)  # group -> decayed (successes, failures)

    def _group(self, depth: int) -> int:
        return sum(1 for start in self.buckets[1:] if depth >= start)

    def rates(self, length: int) -> list[float]:
        """P(the token at depth j is right | the ones above it were), j = 1..length."""
        out, prior = [], 0.5
        for depth in range(1, length + 1):
            ok, bad = self._counts.get(self._group(depth), (0.0, 0.0))
            prior = (ok + self.prior_weight * prior) / (ok + bad + self.prior_weight)
            out.append(prior)
        return out

    def values(self, length: int) -> list[float]:
        """P(the first j tokens of a branch are all right), j = 1..length: never growing with depth."""
        out, value = [], 1.0
        for rate in self.rates(length):
            value *= rate
            out.append(value)
        return out

    @property
    def p(self) -> float:
        """The estimate for the first token."""
        return self.rates(1)[0]

    def update(self, proposed: int, accepted: int) -> None:
        """One round in which ``proposed`` tokens of a branch were verified and the first ``accepted`` were right:
        depths 1..accepted are successes, depth accepted + 1 (if it was verified) a failure, deeper ones untested."""
        for depth in range(1, min(accepted + 1, proposed) + 1):
            group = self._group(depth)
            ok, bad = self._counts.get(group, (0.0, 0.0))
            hit = depth <= accepted
            self._counts[group] = (self.decay * ok + hit, self.decay * bad + (not hit))

    def update_branch(self, kept: list[int], path: list[int]) -> None:
        """One round of a branch: ``kept`` its nodes in the verified tree, ``path`` the accepted nodes (root
        excluded); the branch's accepted tokens are their common prefix."""
        accepted = next((i for i, (a, b) in enumerate(zip(path, kept)) if a != b), min(len(path), len(kept)))
        self.update(len(kept), accepted)


@dataclass
class HeadsCalibration:
    """How the heads' acceptance estimates compare with what this generation accepts: a decayed ratio of accepted heads
    tokens to the tokens the kept heads nodes' values promised (their sum is the expected count when the values are
    path probabilities). ``share_budget`` multiplies heads values by it, so on text the heads guess badly (a
    translation the lookup branch copies) their nodes stop taking budget and verify time, and on text they guess well
    they win more. Starts at 1 (the values as given)."""

    decay: float = 0.8
    observed: float = 1.0
    expected: float = 1.0
    bounds: tuple[float, float] = (0.05, 3.0)

    @property
    def scale(self) -> float:
        return min(self.bounds[1], max(self.bounds[0], self.observed / max(self.expected, 1e-9)))

    def update(self, expected: float, observed: int) -> None:
        self.observed = self.decay * self.observed + observed
        self.expected = self.decay * self.expected + expected


@dataclass
class HeadsGate:
    """Whether the heads are worth running this round (hybrid drafting). Proposing costs a few ms per round even
    when no heads node ends up accepted (SmolLM2 bf16 on 2 CPU cores, ~60-90 ms rounds: ~4 ms for Medusa heads,
    ~6 ms for MTP heads, whose ~3 ms cache update runs every round either way); on text the lookup
    branches copy (translation: 2 heads tokens accepted in ~170 rounds) that is pure loss. Keeps a decayed mean of the
    tokens only the heads drafted that each proposing round accepted; below ``min_yield`` the heads sit out all but
    every ``explore_every``-th round, whose outcome keeps the estimate current. Counts rounds, not seconds, so seeded
    sampling stays reproducible."""

    min_yield: float = 0.05
    explore_every: int = 8
    decay: float = 0.9
    rate: float = 1.0  # decayed mean of heads-only accepted tokens per proposing round
    _skipped: int = 0

    def __post_init__(self):
        if self.min_yield < 0 or self.explore_every < 1 or not 0 <= self.decay < 1:
            raise ValueError(f"need min_yield >= 0, explore_every >= 1 and 0 <= decay < 1, got {self.min_yield}, "
                             f"{self.explore_every}, {self.decay}")

    def propose(self) -> bool:
        """Run the heads this round?"""
        if self.rate >= self.min_yield or self._skipped + 1 >= self.explore_every:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def update(self, heads_only_accepted: int) -> None:
        """After a round in which the heads proposed: how many accepted tokens only they had drafted."""
        self.rate = self.decay * self.rate + (1 - self.decay) * heads_only_accepted


class SharedTree(NamedTuple):
    tokens: torch.Tensor  # [N] kept tree tokens, root first
    buffers: TreeBuffers
    sources: torch.Tensor  # [N] HEADS / LOOKUP bits
    heads_values: torch.Tensor  # [N] the heads' own (unscaled) value of each kept node; 0 for lookup-only nodes
    branch_nodes: list[list[int]]  # per branch: the kept nodes along it, from the root's child down


def share_budget(tokens: torch.Tensor, buffers: TreeBuffers, values: torch.Tensor, branches: list[list[int]],
                 p_lookup: Sequence[float | Sequence[float]], budget: int, latency: dict[int, float] | None = None,
                 heads_scale: float = 1.0) -> SharedTree:
    """Merge lookup branches into a heads tree, then keep the ``budget`` nodes (root included) most likely accepted.

    values [N]: each heads node's estimated probability that its path is accepted (root: 1), used times
    ``heads_scale`` (a ``HeadsCalibration``). A node at depth j of lookup branch b is worth p_lookup[b][j-1] (a
    ``LookupReliability.values`` list), or p_lookup[b]**j for a number (the best over the branches through it); a
    node also proposed by the heads is worth the larger. Values never grow along a path, so the kept set (best first,
    shallower first on ties) holds each kept node's parent. With ``latency`` (seconds of one verify forward per node
    count, measured on this machine) the budget itself is chosen per step: the n <= budget that maximises
    (1 + sum of the n-1 best values) / latency(n), i.e. expected tokens per second.
    """
    if len(p_lookup) < len(branches):
        raise ValueError(f"{len(branches)} lookup branches but {len(p_lookup)} reliabilities")
    merged, merged_buffers, sources, paths = merge_branches(tokens, buffers, branches)
    n_heads = tokens.numel()
    depths = merged_buffers.depths.float()
    own = torch.cat([values.float(), torch.zeros(merged.numel() - n_heads)])  # the heads' values, unscaled
    worth = (own * heads_scale).clamp(max=1.0)
    lookup_worth = torch.zeros(merged.numel())  # per node: the best value of the branches through it
    for path, p in zip(paths, p_lookup):
        if path:
            index = torch.tensor(path)
            if isinstance(p, (int, float)):
                branch_values = torch.tensor(float(p)) ** torch.arange(1, len(path) + 1, dtype=torch.float)
            else:
                if len(p) < len(path):
                    raise ValueError(f"a lookup branch of {len(path)} tokens has only {len(p)} values")
                branch_values = torch.tensor([float(v) for v in p[:len(path)]])
            lookup_worth[index] = torch.maximum(lookup_worth[index], branch_values)
    worth = torch.maximum(worth, lookup_worth)
    worth[0] = float("inf")  # the root always stays
    worth_list, depth_list = worth.tolist(), depths.tolist()
    ranked = sorted(range(merged.numel()), key=lambda i: (-worth_list[i], depth_list[i], i))
    if latency is not None:
        from .tree_search import interpolate

        gains = worth[ranked[1:budget]].cumsum(0).tolist()  # expected accepted tokens of n-1 nodes
        budget = max(range(1, min(budget, merged.numel()) + 1),
                     key=lambda n: (1 + (gains[n - 2] if n > 1 else 0.0)) / interpolate(latency, n))
    if merged.numel() <= budget:
        return SharedTree(merged, merged_buffers, sources, own, paths)
    keep = sorted(ranked[:budget])  # original order: parents before children
    new_index = {old: new for new, old in enumerate(keep)}
    parents = merged_buffers.parents.tolist()
    out_buffers = compile_buffers([0] + [new_index[parents[i]] for i in keep[1:]])
    kept_paths = []
    for path in paths:
        kept = []
        for node in path:
            if node not in new_index:
                break
            kept.append(new_index[node])
        kept_paths.append(kept)
    keep_t = torch.tensor(keep)
    return SharedTree(merged[keep_t], out_buffers, sources[keep_t], own[keep_t], kept_paths)
