"""Drafting: who proposes each round's tree. One protocol, one object per drafting mode.

A drafter is made fresh for each generation (it holds that generation's state) and is driven by the decode loop
(``loop.decode``, one drafter per row):

    drafter.start(prefill)                     after the backbone's prefill
    draft = drafter.propose(root, room)        a tree below the root, at most ``room`` levels deep
    ... verify -> accept -> commit ...
    drafter.observe(outcome)                   what was accepted; the drafter updates its state

Drafting modes (``DRAFT_MODES``, a registry of builders):
- "heads":  the heads' own drafter; each head kind builds it (``DraftHeads.drafter``): static trees for Medusa
  heads (``heads/medusa.py``), dynamic trees grown from the draft's probabilities for the sequential kinds, EAGLE-3
  (the shipped default) and MTP (``heads/sequential.py``); on a measured latency (``costs.Costs``), cut per round to
  the nodes worth their verify time and sitting out rounds in which they would not earn their proposing time
  (``budget.BudgetDrafter`` without lookup).
- "lookup": prompt lookup alone (``lookup.LookupDrafter``): n-gram continuations from the prompt and the output.
- "hybrid": both, sharing one node budget sized per round (``budget.BudgetDrafter`` with lookup): the default.

The loop never asks which drafter or head kind it holds. Records exchanged: ``tokenmaxx.heads.drafting`` (``Draft``,
``Prefill``, ``Outcome``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from tokenmaxx.heads.drafting import Draft, Outcome, Prefill

from .budget import BudgetDrafter, GateConfig
from .costs import Costs
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

    def share_forward(self, rows: int) -> None:
        """From now on its trees are verified in one forward with those of ``rows`` rows in all (a batch's load,
        which a drafter that prices its nodes prices them at; others ignore it)."""


@dataclass(frozen=True)
class DraftSettings:
    """What a drafting mode is built from, besides the backbone and the heads (each builder reads what it needs)."""

    tree: object = None  # the heads' tree settings, parsed by their kind (``DraftHeads.tree_settings``); None: own
    lookup: LookupConfig = field(default_factory=LookupConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    draft_vocab: bool = True  # heads with a draft vocabulary guess over it
    costs: Costs | None = None  # this machine's measured costs (None: whole trees)
    passes: object = None  # how the heads' calls run (``runner.Runner.passes``; None: as they are)


def _own(model, heads, settings: DraftSettings):
    """The heads' own drafter, its passes run as the settings say."""
    own = heads.drafter(model, settings.tree, draft_vocab=settings.draft_vocab)
    if settings.passes is not None:
        own.passes = settings.passes
    return own


def _heads(model, heads, settings: DraftSettings) -> Drafter:
    own = _own(model, heads, settings)
    if settings.costs is None or settings.costs.latency is None:
        return own
    # on a measured latency the tree is cut per round to the nodes that pay for their verify time
    return BudgetDrafter(own, lookup=None, gate=settings.gate, nodes=own.nodes, costs=settings.costs)


def _lookup(model, heads, settings: DraftSettings) -> Drafter:
    return LookupDrafter(settings.lookup)


def _hybrid(model, heads, settings: DraftSettings) -> Drafter:
    own = _own(model, heads, settings)
    return BudgetDrafter(own, lookup=settings.lookup, gate=settings.gate, nodes=own.nodes, costs=settings.costs)


DRAFT_MODES: dict[str, Callable[..., Drafter]] = {"heads": _heads, "lookup": _lookup, "hybrid": _hybrid}
NEEDS_HEADS = ("heads", "hybrid")


def check_draft_mode(mode: str, heads) -> None:
    """ValueError for an unknown mode (the known ones named) or a mode that needs heads without them."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {mode!r}: expected one of {tuple(DRAFT_MODES)}")
    if heads is None and mode in NEEDS_HEADS:
        raise ValueError(f"draft={mode!r} needs heads; only draft='lookup' runs without them")


def make_drafter(mode: str, model, heads=None, settings: DraftSettings | None = None) -> Drafter:
    """A fresh drafter of ``mode`` for one generation on ``model`` (``settings``: see ``DraftSettings``)."""
    check_draft_mode(mode, heads)
    return DRAFT_MODES[mode](model, heads, settings or DraftSettings())
