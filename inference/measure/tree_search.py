"""Hardware-aware draft trees: choose the tree that maximises expected tokens per second on this machine.

    expected tokens/s (tree) = E[tau](tree) / (verify_latency(N) + overhead)

E[tau] = 1 (bonus token) + sum over the tree's nodes of P(the path to that node is accepted). With Medusa heads every
head proposes the same top-k whatever the parent, so a path (r1..rd) is accepted exactly when, at that position, the
true token t+k+1 sits at rank r_k of head k for every k <= d. Calibration records, per position, the rank of the true
token in each head (``ranks [T, K]``), so P(path) is an empirical joint frequency, with no independence assumption.
Because P(prefix) >= P(path), the best tree of each size N takes the N-1 most frequent paths (prefix-closed by
construction); the search then only has to pick N, using the measured verify latency of N tokens.

This module is the search alone (pure functions of ranks and latencies); ``autotune.py`` measures and caches.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from tokenmaxx.heads.tree import Tree

from ..costs import interpolate


def ordered_paths_from_ranks(ranks: torch.Tensor, max_rank: int = 10) -> list[tuple[tuple[int, ...], float]]:
    """All paths seen in calibration with their acceptance probability, most probable first.

    ranks: [T, K] rank of the true token t+k+1 in head k's distribution at position t (>= max_rank: not in a tree).
    """
    total = ranks.shape[0]
    counts: Counter = Counter()
    for row in ranks.tolist():
        path = []
        for r in row:
            if r >= max_rank:
                break
            path.append(r)
            counts[tuple(path)] += 1
    return sorted(((p, c / total) for p, c in counts.items()), key=lambda pv: (-pv[1], len(pv[0]), pv[0]))


def choose_tree(ordered: list[tuple[tuple[int, ...], float]], latency: dict[int, float], overhead: float,
                max_nodes: int = 64, max_depth: int | None = None) -> tuple[Tree, list[dict]]:
    """Best tree over sizes N = 1..max_nodes: maximise (1 + sum of node probabilities) / (latency(N) + overhead).

    ``ordered``: (path, probability) most probable first. Returns the tree and the table of every size considered.
    """
    paths = [(p, v) for p, v in ordered if max_depth is None or len(p) <= max_depth][: max_nodes - 1]
    table = []
    for n, expected in enumerate(itertools.accumulate((v for _, v in paths), initial=1.0), start=1):
        seconds = interpolate(latency, n) + overhead
        table.append({"nodes": n, "expected_tau": expected, "step_seconds": seconds,
                      "tokens_per_s": expected / seconds})
    best = max(table, key=lambda row: row["tokens_per_s"])
    return Tree([p for p, _ in paths[: best["nodes"] - 1]]), table
