"""What a drafter hands the decode loop, and what the loop tells it back (``tokenmaxx.inference.drafting``).

A round: the drafter proposes a ``Draft`` (tree tokens, their compiled buffers, and per node who drafted it and how
likely its path is accepted); the backbone verifies it; the drafter then observes the ``Outcome``. Head kinds build
their own drafters (``DraftHeads.drafter``), so these plain records live beside the heads; the protocol, the lookup
drafter and the budget drafter that sizes the heads' trees (with or without lookup branches) are in
``tokenmaxx.inference``.

Letters: N tree nodes, P prompt tokens, H hidden size, m accepted candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TreeBuffers, compile_buffers

HEADS, LOOKUP = 1, 2  # node source bits: drafted by the heads, by prompt lookup (both: the node was merged)
SOURCE_NAMES = {HEADS: "heads", LOOKUP: "lookup", HEADS | LOOKUP: "both"}


@dataclass
class Draft:
    """One round's draft tree. Its tensors live on the backbone's device (the loop indexes them with the accepted
    nodes, which come from the backbone's logits); the buffers are compiled on the CPU (``TreeBuffers.to``)."""

    tokens: torch.Tensor  # [N] long: node 0 is the root (the token the backbone already chose)
    buffers: TreeBuffers  # the tree compiled: mask, depths, retrieve indices
    sources: torch.Tensor  # [N] long: HEADS / LOOKUP bits of each node (the root counts as the heads')
    values: torch.Tensor  # [N] float: estimated probability that each node's path is accepted (root: 1)
    heads_ran: bool = True  # False when the budget drafter let the heads sit this round out

    @classmethod
    def root_only(cls, root: int, device: torch.device) -> "Draft":
        """No candidates: the round verifies the root alone (and yields the bonus token)."""
        return cls(tokens=torch.tensor([root], dtype=torch.long, device=device), buffers=compile_buffers([0]),
                   sources=torch.tensor([HEADS], device=device), values=torch.ones(1, device=device))

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Prefill:
    """What the backbone's prefill left: the start of every drafter's state."""

    input_ids: torch.Tensor  # [P] the prompt
    hidden: torch.Tensor  # [P, F] backbone states of the prompt as the drafter reads them (``Drafter.feature_layers``;
    # default: [P, H] final-normed last states)
    root: int  # the first new token (chosen from the last prompt position)


@dataclass
class Outcome:
    """How a round ended."""

    draft: Draft
    nodes: torch.Tensor  # [m+1] long: the accepted path's node indices, root first
    tokens: list[int]  # the m accepted candidates and the bonus token
    hidden: torch.Tensor  # [m+1, F] backbone states at the accepted nodes, as in Prefill (the next round reads the
    # last)
    emitted: list[int]  # what the round added to the output (``tokens`` cut at EOS / max_new_tokens)
    path: list[int]  # ``nodes`` as a list
    token_ids: torch.Tensor  # [m+1] long: ``tokens`` on the backbone's device (its last: the next round's root)
