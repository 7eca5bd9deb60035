"""Dynamic draft trees: grown level by level from a sequential draft's own log-probabilities.

A candidate's score is the cumulative log-probability of its path under the draft (the sum of the log-probs of its
tokens, each given its ancestors). One level:

1. the frontier is the ``topk`` best candidates of the previous level (level 1: the root's ``topk`` children);
2. each frontier node is expanded with its ``topk`` best children (one draft-module call for the whole frontier);
3. the ``topk * topk`` children become the next level's candidates.

Everything, the tree's buffers included (``tree.device_buffers``), is a tensor on the draft's device; whether growth
reads the frontier back to the host to stop early is ``tree_growth``'s ``stop_early``.

After ``depth`` levels the tree keeps the ``nodes - 1`` best candidates overall (plus the root). A child's score is at
most its parent's (log-probs are <= 0), and ties go to the shallower node, so the kept set always contains each kept
node's parent. Growth stops early once no frontier node can still enter the kept set, or once the frontier's total
draft probability (by the draft's own estimate, the chance that the backbone's path reaches a node the next level
would expand) is below ``min_mass``: each level costs one module pass and one vocabulary projection, more than a level
that is rarely reached gives back (docs/benchmarks.md).
The tree's buffers have the same fields as static trees' and are verified, accepted and committed by the same code.

``tree_growth`` is the pure algorithm (a generator sent each frontier's child log-probs; ``grow_tree`` drives it with
a function); the sequential kinds' drafter (``sequential.SequentialDrafter``, for EAGLE-3, the default kind, and MTP)
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Generator

import torch

from .drafting import drive
from .tree import TreeBuffers, device_buffers

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
    buffers: TreeBuffers  # built on that device too (``tree.device_buffers``)
    scores: torch.Tensor  # [N] cumulative draft log-prob (0 for the root); on the draft log-probs' device


@dataclass
class Frontier:
    """The nodes one level expands (one draft-module call), handed to ``grow_tree``'s ``expand``. F nodes, all at
    depth ``level``; every tensor on the draft's device."""

    level: int  # depth of these nodes (1: the root's children)
    tokens: torch.Tensor  # [F] long: each node's token id
    parent_slot: torch.Tensor  # [F] long: row of each node's parent in the previous level's frontier (-1: the root)
    ancestors: torch.Tensor  # [F, level-1] long: row of each node's ancestor in the frontiers of levels 1..level-1
    live: torch.Tensor  # [F] bool: nodes whose children can still be kept (the others' children are dropped)


def grow_tree(root: torch.Tensor | int, root_logprobs: torch.Tensor,
              expand: Callable[[Frontier], torch.Tensor], topk: int, depth: int, nodes: int,
              token_ids: torch.Tensor | None = None, min_mass: float = 0.0, stop_early: bool = True) -> DraftTree:
    """``tree_growth`` with each level's frontier expanded by ``expand(frontier)`` (its children's log-probs
    [F, V]) as it comes."""
    return drive(tree_growth(root, root_logprobs, topk, depth, nodes, token_ids, min_mass, stop_early), expand)


def tree_growth(root: torch.Tensor | int, root_logprobs: torch.Tensor, topk: int, depth: int, nodes: int,
                token_ids: torch.Tensor | None = None, min_mass: float = 0.0,
                stop_early: bool = True) -> Generator[Frontier, torch.Tensor, DraftTree]:
    """Grow a draft tree (see the module docstring) with tensors on ``root_logprobs``' device: a generator that yields
    each level's frontier and is sent its children's log-probs [F, V] (so the module passes of several trees can be
    run together: ``drafting.run_passes``); it returns the tree.

    root: the root token ([1] long tensor on that device, or an int). root_logprobs [V]: draft log-probs of the root's
    children. ``token_ids`` [V]: the token id of each log-prob column when they cover a draft vocabulary (default:
    column = token id).

    ``stop_early``: each level first asks whether any frontier node can still enter the kept set and whether the
    frontier holds ``min_mass`` of the draft's probability, and stops if not (one host read per level), and
    expands only the nodes that can (the frontier's width then depends on the draft's values). Without it (a device
    where a read waits for the queue to drain) every level is drafted at the full width and nothing is read: a node
    that cannot enter is computed but its children are dropped, so the kept set is the one the checks give with
    ``min_mass`` = 0, and no shape depends on the draft's values. Returns the tree, nodes ordered by depth, then
    score (ties: creation order), its tensors and buffers on the device.
    """
    device = root_logprobs.device
    ids = (lambda idx: token_ids[idx]) if token_ids is not None else (lambda idx: idx)
    if not isinstance(root, torch.Tensor):
        root = torch.tensor([root], dtype=torch.long, device=device)
    top = root_logprobs.float().topk(min(topk, root_logprobs.numel()))
    width = top.indices.numel()
    tokens, scores = [ids(top.indices)], [top.values]  # per block: level 1, then each expansion's children
    parents = [top.indices.new_full((width,), -1)]  # candidate index of each candidate's parent (-1: the root)
    levels = [top.indices.new_full((width,), 1)]
    frontier = Frontier(level=1, tokens=tokens[0], parent_slot=parents[0], ancestors=parents[0][:, None][:, :0],
                        live=torch.ones(width, dtype=torch.bool, device=device))
    slots, front_scores = torch.arange(width, device=device), top.values  # the frontier's candidate indices, scores
    count, budget, drafted = width, nodes - 1, 1  # candidates so far; nodes kept beside the root; levels drafted
    for d in range(2, depth + 1):
        if budget <= 0:
            break
        floor = torch.cat(scores).topk(budget).values[-1] if count >= budget else None
        live = front_scores > floor if floor is not None else torch.ones_like(front_scores, dtype=torch.bool)
        if stop_early:
            mass = torch.where(live, front_scores.exp(), 0.0).sum()
            if not bool(live.any() & (mass >= min_mass)):
                break  # nothing left to enter, or the draft expects too little of this level for one more pass
            # where reads are free, so is a shape that depends on them: only the live nodes are computed
            rows = live.nonzero().flatten()
            frontier = Frontier(level=frontier.level, tokens=frontier.tokens[rows],
                                parent_slot=frontier.parent_slot[rows], ancestors=frontier.ancestors[rows], live=live)
            slots, front_scores, live = slots[rows], front_scores[rows], live[rows]
        frontier.live = live
        logprobs = (yield frontier).float()  # [F, V]: the frontier's children
        top = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        child_scores = (front_scores[:, None] + top.values).masked_fill(~live[:, None], float("-inf"))  # [F, k]
        fanout = top.indices.shape[1]
        block_scores = child_scores.flatten()
        tokens.append(ids(top.indices).flatten())
        scores.append(block_scores)
        parents.append(slots.repeat_interleave(fanout))
        levels.append(torch.full_like(block_scores, d, dtype=torch.long))
        # the next frontier: the best children (ties: creation order)
        order = torch.sort(block_scores, descending=True, stable=True).indices[:topk]
        parent_slot = order // fanout
        frontier = Frontier(level=d, tokens=tokens[-1][order], parent_slot=parent_slot,
                            ancestors=torch.cat([frontier.ancestors[parent_slot], parent_slot[:, None]], dim=1),
                            live=live)
        slots, front_scores = count + order, block_scores[order]
        count += block_scores.numel()
        drafted = d
    all_scores = torch.cat(scores)
    # the best nodes overall (ties: shallower, then created first), then ordered by depth: parents before children
    kept = torch.sort(all_scores, descending=True, stable=True).indices[:budget]
    kept = kept[torch.sort(torch.cat(levels)[kept], stable=True).indices]
    node_of = torch.zeros(count + 1, dtype=torch.long, device=device)  # candidate index + 1 -> node (0: the root)
    node_of[kept + 1] = torch.arange(1, kept.numel() + 1, device=device)
    tree_parents = torch.cat([node_of[:1], node_of[torch.cat(parents)[kept] + 1]])
    return DraftTree(tokens=torch.cat([root.to(torch.long), torch.cat(tokens)[kept]]),
                     buffers=device_buffers(tree_parents, drafted),
                     scores=torch.cat([all_scores[:1] * 0, all_scores[kept]]))
