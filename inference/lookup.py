"""Prompt-lookup drafts: n-gram continuations from the prompt and the text so far, as extra tree branches.

A lookup branch is a deterministic draft (like a head's top-k guess), so greedy acceptance and lossless sampling treat
it exactly like any other node. Branches are merged into the heads' tree token by token: where a branch starts with a
token the heads already proposed at that place, the node is shared (deduplicated) and the branch continues below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmaxx.heads.drafting import HEADS, LOOKUP, Draft, Outcome, Prefill
from tokenmaxx.heads.tree import host_tree


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

    def __post_init__(self):
        if self.min_ngram is not None and not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.branches < 1:
            raise ValueError(f"need branches >= 1, got {self.branches}")
        if not 1 <= self.min_len <= self.start_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= start_len <= max_len, got {self.min_len}, {self.start_len}, "
                             f"{self.max_len}")

    def shortest_ngram(self, default: int) -> int:
        """min_ngram, or the drafter's default (lookup drafting 2, hybrid 1)."""
        return self.min_ngram if self.min_ngram is not None else default

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


def merge_lists(tokens: list[int], parents: list[int], branches: list[list[int]]
                ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Add draft branches below the root of a tree given as lists (node 0 = root; ``parents[0]`` = 0), sharing nodes
    where the tokens coincide (with the tree or with an earlier branch). Returns new lists (tokens, parents, sources of
    HEADS/LOOKUP bits) and the node indices along each branch."""
    toks, parents = list(tokens), list(parents)
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
    return toks, parents, sources, paths


class LookupDrafter:
    """Prompt-lookup drafting alone: one branch, the continuation of the longest suffix n-gram (at least 2 tokens by
    default) that occurred before, its length adapting per generation (``LookupConfig.next_len``)."""

    def __init__(self, config: LookupConfig | None = None):
        self.config = config or LookupConfig()
        self.feature_layers = None  # reads no backbone states
        self.min_ngram = self.config.shortest_ngram(2)
        self.index = NgramIndex(self.config.max_ngram)
        self.length = self.config.start_len
        self._branch = 0  # tokens of this round's branch
        self.device: torch.device | None = None  # where drafts live: the prompt's (the backbone's), from ``start``

    def describe(self) -> str:
        return "prompt lookup"

    def share_forward(self, rows: int) -> None:
        """(Its branches are as long whatever a forward verifies beside them.)"""

    def start(self, prefill: Prefill) -> None:
        self.index = NgramIndex(self.config.max_ngram)
        self.index.extend(prefill.input_ids.tolist() + [prefill.root])
        self.length = self.config.start_len
        self.device = prefill.input_ids.device

    def propose(self, root: int, room: int) -> Draft:
        branch = self.index.continuation(min(self.length, room), self.min_ngram)
        self._branch = len(branch)
        # the root and the branch as a chain, copied to the device at once
        n = len(branch) + 1
        buffers, (tokens, sources) = host_tree(self.device, [0] + list(range(n - 1)), [root] + branch,
                                               [HEADS] + [LOOKUP] * (n - 1))
        return Draft(tokens=tokens.long(), buffers=buffers, sources=sources.long(), values=torch.ones_like(tokens))

    def observe(self, outcome: Outcome) -> None:
        if self._branch:  # a round without a branch says nothing about the branch length
            from_lookup = len(outcome.path) - 1  # every candidate was the branch's
            self.length = self.config.next_len(self.length, self._branch, from_lookup)
        self.index.extend(outcome.emitted)

