"""What a drafter hands the decode loop, and what the loop tells it back (``tokenmaxx.inference.drafting``).

A round: the drafter proposes a ``Draft`` (tree tokens, their compiled buffers, and per node who drafted it and how
likely its path is accepted); the backbone verifies it; the drafter then observes the ``Outcome``. Head kinds build
their own drafters (``DraftHeads.drafter``), so these plain records live beside the heads; the protocol, the lookup
drafter and the budget drafter that sizes the heads' trees (with or without lookup branches) are in
``tokenmaxx.inference``. A proposal can also run as steps (``proposal_steps``): a generator yielding the draft-module
passes it needs, so a batch computes the passes of all its rows in one call (``run_passes``).

Letters: N tree nodes, P prompt tokens, H hidden size, m accepted candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

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
    logits: torch.Tensor | None = None  # [V] the backbone's logits at the last prompt position (what chose root)


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
    logits: torch.Tensor | None = None  # [N, V] the verify's logits at the draft's N nodes (a view; ``logits[nodes]``
    # chose ``tokens``)


class Eager:
    """How a drafter's module calls run: as they are. A heads drafter holds one as ``passes`` (this, ``EAGER``, by
    default), the only thing about how its calls run on a machine that it is handed: the inference side may hand it
    others (``inference.runner.CapturedPasses``: compiled at fixed shapes)."""

    together = True  # passes of several rows may run as one call (``run_passes``)

    def call(self, module, name: str, fn: Callable, *args):
        """``module``'s method ``name`` (``fn``) on ``args``."""
        return fn(*args)

    def module_pass(self, request: "Pass") -> torch.Tensor:
        """A module pass of a sequential drafter (``sequential.ModulePass``)."""
        return request.run_eager()


EAGER = Eager()


class Pass:
    """One draft-module pass a proposal asks for (``proposal_steps``): ``run()`` computes it alone; passes of several
    rows' proposals whose ``batch_key`` is the same (not None) can be computed together in one batched call
    (``run_passes``; ``sequential.ModulePass`` is one)."""

    batch_key = None

    def run(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def run_together(passes: list["Pass"]) -> list[torch.Tensor]:
        """The results of several passes of one ``batch_key``: here each alone; kinds that batch override it."""
        return [p.run() for p in passes]


def run_passes(passes: list[Pass]) -> list[torch.Tensor]:
    """Each pass's result; those of a common ``batch_key`` computed together (``Pass.run_together``)."""
    results: list[torch.Tensor | None] = [None] * len(passes)
    groups: dict[object, list[int]] = {}
    for i, request in enumerate(passes):
        key = request.batch_key
        if key is None:
            results[i] = request.run()
        else:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        outs = passes[members[0]].run_together([passes[i] for i in members]) if len(members) > 1 \
            else [passes[members[0]].run()]
        for i, out in zip(members, outs):
            results[i] = out
    return results


def proposal_steps(drafter, root: int, room: int) -> Generator[Pass, torch.Tensor, Draft]:
    """A drafter's ``propose(root, room)`` as steps: a generator that yields each module ``Pass`` it needs and is sent
    the pass's result, returning the draft. A drafter with ``propose_steps`` yields its passes (so a batch runs the
    passes of all its rows at once); any other proposes in one call."""
    steps = getattr(drafter, "propose_steps", None)
    if steps is None:
        return drafter.propose(root, room)
    return (yield from steps(root, room))


def drive(steps: Generator, answer: Callable):
    """Run the generator ``steps`` to its result, sending each value it yields back through ``answer``."""
    try:
        request = next(steps)
        while True:
            request = steps.send(answer(request))
    except StopIteration as stop:
        return stop.value


def run_alone(steps: Generator[Pass, torch.Tensor, Draft]):
    """Drive ``steps`` (a generator of ``Pass``) to its result, computing each pass alone."""
    return drive(steps, lambda request: request.run())


def propose_rows(drafters: Sequence, roots: Sequence[int], rooms: Sequence[int]) -> list[Draft]:
    """Every row's ``propose(root, room)``, run as steps (``proposal_steps``) in lockstep: each time every row still
    drafting waits on a module pass, the passes are computed together (``run_passes``: one module
    call for the rows of one heads module, e.g. one EAGLE-3 pass a tree level for the whole batch)."""
    steps = [proposal_steps(d, root, room) for d, root, room in zip(drafters, roots, rooms)]
    drafts: list[Draft | None] = [None] * len(steps)
    sends = dict.fromkeys(range(len(steps)))  # what each row still drafting is sent next (None starts a generator)
    while sends:
        waiting = {}
        for i, value in sends.items():
            try:
                waiting[i] = steps[i].send(value)
            except StopIteration as stop:
                drafts[i] = stop.value
        sends = dict(zip(waiting, run_passes(list(waiting.values()))))
    return drafts
