"""Drafting: who proposes each round's tree. One protocol, one object per drafting mode.

A drafter is made fresh for each generation (it holds that generation's state) and is driven by the decode loop
(``loop.speculative_decode``):

    drafter.start(prefill)                     after the backbone's prefill
    draft = drafter.propose(root, room)        a tree below the root, at most ``room`` levels deep
    ... verify -> accept -> commit ...
    drafter.observe(outcome)                   what was accepted; the drafter updates its state

Drafting modes (``DRAFT_MODES``, a registry of builders):
- "heads":  the heads' own drafter; each head kind builds it (``DraftHeads.drafter``): static trees for Medusa
  heads (``heads/medusa.py``), dynamic trees grown from the draft's log-probabilities for MTP heads (``heads/mtp.py``);
  with a latency table, cut per round to the nodes worth their verify time, and sitting out rounds in which they
  would not earn their proposing time (``hybrid.HybridDrafter``, lookup off).
- "lookup": prompt lookup alone (``lookup.LookupDrafter``): n-gram continuations from the prompt and the output.
- "hybrid": both, sharing one node budget sized per round (``hybrid.HybridDrafter``): measured fastest, the default.

The loop never asks which drafter or head kind it holds. Records exchanged: ``tokenmaxx.heads.drafting`` (``Draft``,
``Prefill``, ``Outcome``).
"""

from __future__ import annotations

from typing import Callable, Protocol

from tokenmaxx.heads.drafting import Draft, Outcome, Prefill

from .hybrid import HybridDrafter
from .latency import VerifyLatency
from .lookup import LookupConfig, LookupDrafter

DEFAULT_DRAFT = "hybrid"  # fastest measured on unseen prompts (docs/benchmarks.md)


class Drafter(Protocol):
    # which backbone hidden states ``Prefill.hidden`` / ``Outcome.hidden`` hold for it (``backbone_features``):
    # None, the final-normed last state; hidden-state indices for heads that read several layers (EAGLE-3)
    feature_layers: tuple[int, ...] | None

    def describe(self) -> str:
        """A few words for logs: what drafts and how large its trees are."""

    def start(self, prefill: Prefill) -> None:
        """Begin a generation: the prompt, its backbone states, the first new token."""

    def propose(self, root: int, room: int) -> Draft:
        """This round's draft below ``root``, at most ``room`` levels deep (0: the root alone)."""

    def observe(self, outcome: Outcome) -> None:
        """What the backbone accepted of the last draft."""


def _heads(model, heads, tree, lookup, draft_vocab, latency, propose_cost) -> Drafter:
    own = heads.drafter(model, tree=tree, draft_vocab=draft_vocab)
    # on a measured latency the tree is cut per round to the nodes that pay for their verify time (share_budget)
    return own if latency is None else HybridDrafter(own, config=lookup, nodes=own.nodes, latency=latency,
                                                     lookup=False, propose_cost=propose_cost)


def _lookup(model, heads, tree, lookup, draft_vocab, latency, propose_cost) -> Drafter:
    return LookupDrafter(lookup)


def _hybrid(model, heads, tree, lookup, draft_vocab, latency, propose_cost) -> Drafter:
    own = heads.drafter(model, tree=tree, draft_vocab=draft_vocab)
    return HybridDrafter(own, lookup, nodes=own.nodes, latency=latency, propose_cost=propose_cost)


DRAFT_MODES: dict[str, Callable[..., Drafter]] = {"heads": _heads, "lookup": _lookup, "hybrid": _hybrid}
NEEDS_HEADS = ("heads", "hybrid")


def check_draft_mode(mode: str, heads) -> None:
    """ValueError for an unknown mode (the known ones named) or a mode that needs heads without them."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {mode!r}: expected one of {tuple(DRAFT_MODES)}")
    if heads is None and mode in NEEDS_HEADS:
        raise ValueError(f"draft={mode!r} needs heads; only draft='lookup' runs without them")


def make_drafter(mode: str, model, heads=None, tree=None, lookup: LookupConfig | None = None,
                 draft_vocab: bool = True, latency: VerifyLatency | None = None,
                 propose_cost: float | None = None) -> Drafter:
    """A fresh drafter of ``mode`` for one generation on ``model``. ``tree``: the heads' tree settings (a spec of
    their kind, None: their own); ``lookup``: prompt-lookup settings; ``latency``: this machine's verify latency per
    node count (heads and hybrid: the budget is sized per round from it; None keeps the whole budget);
    ``propose_cost``: seconds one proposal of the heads takes here (with ``latency``: heads that do not earn it sit
    rounds out)."""
    check_draft_mode(mode, heads)
    return DRAFT_MODES[mode](model, heads, tree, lookup, draft_vocab, latency, propose_cost)
