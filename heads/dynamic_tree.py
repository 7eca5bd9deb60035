"""Dynamic draft trees: grown level by level from a sequential draft's own log-probabilities.

A candidate's score is the cumulative log-probability of its path under the draft (the sum of the log-probs of its
tokens, each given its ancestors). One level:

1. the frontier is the ``topk`` best candidates of the previous level (level 1: the root's ``topk`` children);
2. each frontier node is expanded with its ``topk`` best children (one draft-module call for the whole frontier);
3. the ``topk * topk`` children become the next level's candidates.

After ``depth`` levels the tree keeps the ``nodes - 1`` best candidates overall (plus the root). A child's score is at
most its parent's (log-probs are <= 0), and ties go to the shallower node, so the kept set always contains each kept
node's parent. Growth stops early once no frontier node can still enter the kept set, or once the frontier's total
draft probability (by the draft's own estimate, the chance that the backbone's path reaches a node the next level
would expand) is below ``min_mass``: each level costs one module pass and one vocabulary projection, more than a level
that is rarely reached gives back (docs/benchmarks.md).
The tree is compiled into the same buffers as static trees (``tree.compile_buffers``) and verified, accepted and
committed by the same code.

``expand_tree`` is the pure algorithm (any child-log-prob function); the sequential kinds' drafter
(``sequential.SequentialDrafter``, for EAGLE-3, the default kind, and MTP) runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from .tree import TreeBuffers, compile_buffers

MIN_MASS = 0.5  # default min_mass, chosen on inference.measure.autotune.CALIBRATION_PROMPTS (smollm2-135m/RECIPE.md)


@dataclass(frozen=True)
class DynamicTreeConfig:
    nodes: int = 32  # kept nodes, root included (what one verify pass holds)
    topk: int = 8  # children per expanded node, and frontier width
    depth: int | None = None  # levels drafted; None: the heads' trained depth (config.num_heads)
    min_mass: float = MIN_MASS  # a level is drafted only while its frontier's total draft probability reaches this

    def __post_init__(self) -> None:
        for name in ("nodes", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dynamic tree {name} must be a positive integer, got {value!r}")
        if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 1):
            raise ValueError(f"dynamic tree depth must be a positive integer or None, got {self.depth!r}")
        if isinstance(self.min_mass, bool) or not isinstance(self.min_mass, (int, float)) \
                or not 0 <= self.min_mass <= 1:
            raise ValueError(f"dynamic tree min_mass must be a probability in [0, 1] (0 drafts every level), got "
                             f"{self.min_mass!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "DynamicTreeConfig":
        """From a saved config's dict; unknown keys are refused with the known ones named."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown dynamic tree settings {unknown}; known settings are {sorted(known)}")
        return cls(**data)

    def spec(self) -> str:
        """The command-line spec of these settings ('dynamic:nodes=N,topk=K,...')."""
        depth = f",depth={self.depth}" if self.depth is not None else ""
        return f"dynamic:nodes={self.nodes},topk={self.topk}{depth},min_mass={self.min_mass:g}"

    @classmethod
    def parse(cls, spec: str) -> "DynamicTreeConfig":
        """'dynamic', 'dynamic:NODES' or 'dynamic:nodes=N,topk=K,depth=D,min_mass=M' (any subset of the keys)."""
        if spec == "dynamic":
            return cls()
        if not spec.startswith("dynamic:"):
            raise ValueError(f"not a dynamic tree spec: {spec!r}")
        body = spec.split(":", 1)[1]
        try:
            if "=" not in body:
                return cls(nodes=int(body))
            kwargs = {}
            for part in body.split(","):
                key, value = part.split("=")
                if key not in ("nodes", "topk", "depth", "min_mass"):
                    raise ValueError(key)
                kwargs[key] = float(value) if key == "min_mass" else int(value)
            return cls(**kwargs)
        except ValueError as err:
            raise ValueError(f"bad dynamic tree spec {spec!r} ({err}): expected 'dynamic', 'dynamic:N' or "
                             "'dynamic:nodes=N,topk=K,depth=D,min_mass=M'") from None


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, node 0 = root; on the draft log-probs' device
    buffers: TreeBuffers  # compiled on the CPU (``TreeBuffers.to``)
    scores: torch.Tensor  # [N] cumulative draft log-prob (0 for the root); on the draft log-probs' device


@dataclass
class Candidates:
    """Every node drafted so far, by candidate index (creation order): level 1 first, then each expansion."""

    tokens: list[int]
    scores: list[float]  # cumulative draft log-prob of the path
    parent: list[int]  # candidate index of the parent, -1 = the root
    level: list[int]  # tree depth (1 = child of the root)


def expand_tree(root: int, root_logprobs: torch.Tensor,
                child_logprobs: Callable[[list[int], Candidates], torch.Tensor],
                topk: int, depth: int, nodes: int, token_ids: torch.Tensor | None = None,
                min_mass: float = 0.0) -> DraftTree:
    """Grow a draft tree (see the module docstring).

    root_logprobs [V]: draft log-probs of the root's children. ``child_logprobs(frontier, candidates)`` gets the
    frontier's candidate indices and all candidates so far, and returns the frontier's children's log-probs
    [len(frontier), V]. ``token_ids`` [V]: the token id of each log-prob column when they cover a draft vocabulary
    (default: column = token id). A level whose frontier's probabilities sum below ``min_mass`` is not drafted.
    Returns the tree, nodes ordered by depth, then score, its tensors on ``root_logprobs``' device.
    """
    device = root_logprobs.device
    ids = (lambda idx: token_ids[idx].tolist()) if token_ids is not None else (lambda idx: idx.tolist())
    top = root_logprobs.float().topk(min(topk, root_logprobs.numel()))
    cands = Candidates(tokens=ids(top.indices), scores=top.values.tolist(), parent=[-1] * top.indices.numel(),
                       level=[1] * top.indices.numel())
    scores = cands.scores
    frontier = list(range(len(scores)))
    budget = nodes - 1
    for d in range(2, depth + 1):
        if budget <= 0 or not frontier:
            break
        floor = sorted(scores, reverse=True)[budget - 1] if len(scores) >= budget else float("-inf")
        frontier = [c for c in frontier if scores[c] > floor]  # only these can still add kept nodes
        if not frontier:
            break
        if sum(math.exp(scores[c]) for c in frontier) < min_mass:
            break  # the draft itself expects too little of this level for what one more module pass costs
        logprobs = child_logprobs(frontier, cands).float()  # [F, V]
        top = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        child_scores = (torch.tensor([scores[c] for c in frontier], device=device)[:, None]
                        + top.values).tolist()  # [F, k]
        first = len(scores)
        for row, c in enumerate(frontier):
            cands.tokens.extend(ids(top.indices[row]))
            scores.extend(child_scores[row])
            cands.parent.extend([c] * top.indices.shape[1])
            cands.level.extend([d] * top.indices.shape[1])
        frontier = sorted(range(first, len(scores)), key=lambda c: -scores[c])[:topk]
    kept = sorted(range(len(scores)), key=lambda c: (-scores[c], cands.level[c], c))[:budget]
    kept.sort(key=lambda c: (cands.level[c], -scores[c], c))  # parents before children
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    parents = [0] + [node_of[cands.parent[c]] if cands.parent[c] >= 0 else 0 for c in kept]
    return DraftTree(tokens=torch.tensor([root] + [cands.tokens[c] for c in kept], dtype=torch.long, device=device),
                     buffers=compile_buffers(parents),
                     scores=torch.tensor([0.0] + [scores[c] for c in kept], device=device))
