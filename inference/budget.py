"""The per-round budget drafter: the heads' tree, optionally beside prompt-lookup branches, cut each round to the
nodes worth their verify time on this machine.

Each node is valued by its estimated chance of being accepted: heads nodes by the heads' own values (calibrated
against what this generation accepts, ``HeadsCalibration``), lookup nodes by the measured acceptance of branches with
the same matched n-gram length and rank (``LookupReliability``). The most valuable nodes are kept, up to the budget
that maximises expected tokens per second on the verify latency it is handed (``share_lists``). Heads that stop
paying for their proposing time and their nodes' verify time sit rounds out (``HeadsGate``, settings in
``GateConfig``). ``BudgetDrafter`` owns all of that state; with lookup it is the "hybrid" drafting mode, without it the
"heads" mode on a measured latency.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import torch

from tokenmaxx.heads.drafting import HEADS, LOOKUP, Draft, Outcome, Prefill, proposal_steps, run_alone
from tokenmaxx.heads.tree import TreeBuffers, host_tree

from .costs import Costs, VerifyLatency, interpolate
from .lookup import LookupConfig, NgramIndex, merge_lists


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
    path probabilities). ``share_lists`` multiplies heads values by it, so on text the heads guess badly (a
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


@dataclass(frozen=True)
class GateConfig:
    """When heads that do not pay sit rounds out (``HeadsGate``)."""

    min_yield: float = field(default=0.05, metadata={
        "help": "heads whose proposals lately add fewer accepted tokens per round than this, or than their proposing "
                "time and their nodes' verify time are worth, sit out rounds"})
    explore_every: int = field(default=8, metadata={
        "help": "heads that sit out still propose every this many rounds, to notice when they pay again"})
    decay: float = field(default=0.9, metadata={"help": "weight of the past in the gate's running means"})

    def __post_init__(self):
        if self.min_yield < 0 or self.explore_every < 1 or not 0 <= self.decay < 1:
            raise ValueError(f"gate settings: need min_yield >= 0, explore_every >= 1 and 0 <= decay < 1, got "
                             f"{self.min_yield}, {self.explore_every}, {self.decay}")


@dataclass
class HeadsGate:
    """Whether the heads are worth running this round. A round the heads run costs their proposing time and the verify
    time of the nodes only they drafted, accepted or not; on text the lookup branches copy (translation) or the heads
    guess badly, that is pure loss.

    Keeps decayed means of the tokens only the heads drafted that each proposing round accepted (``rate``) and of the
    extra verify seconds their nodes cost in that round (``extra``: latency with them minus latency without), and,
    over all rounds, of the other tokens a round yields (accepted lookup tokens and the bonus token) and of its verify
    seconds without the heads' nodes. The heads run while what they add pays for what they cost:
    rate >= (cost + extra) x (other tokens per round) / (seconds per round), i.e. tokens/s with them beats tokens/s
    without, and rate >= ``min_yield``. Below that they sit out all but every ``explore_every``-th round, whose
    outcome keeps the estimates current. Seconds come from the latency table and ``cost`` (one proposal) that the
    drafter is handed (``costs.Costs``), never a clock read: seeded sampling stays reproducible."""

    settings: GateConfig = field(default_factory=GateConfig)
    cost: float = 0.0  # seconds one proposal takes on this machine (0 and no extra: only min_yield counts)
    rate: float = 1.0  # decayed mean of heads-only accepted tokens per proposing round
    extra: float = 0.0  # decayed mean of the verify seconds the heads-only nodes added to a proposing round
    other_tokens: float = 1.0  # decayed mean, per round, of the tokens not drafted by the heads alone (bonus included)
    seconds: float = 0.0  # decayed mean of a round's verify seconds without the heads-only nodes (0: none seen yet)
    _skipped: int = 0
    _proposals: int = 0

    def __post_init__(self):
        if self.cost < 0:
            raise ValueError(f"the heads' proposing cost must be >= 0 seconds, got {self.cost}")

    @property
    def threshold(self) -> float:
        """Heads-only accepted tokens per proposing round below which the heads sit out."""
        pays = (self.cost + self.extra) * self.other_tokens / self.seconds if self.seconds > 0 else 0.0
        return max(self.settings.min_yield, pays)

    def propose(self) -> bool:
        """Run the heads this round?"""
        if self.rate >= self.threshold or self._skipped + 1 >= self.settings.explore_every:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def update(self, heads_only_accepted: int, extra_seconds: float = 0.0) -> None:
        """After a round in which the heads proposed: how many accepted tokens only they had drafted, and the verify
        seconds their own nodes added to the round."""
        decay = self.settings.decay
        self.rate = decay * self.rate + (1 - decay) * heads_only_accepted
        self.extra = extra_seconds if self._proposals == 0 else \
            decay * self.extra + (1 - decay) * extra_seconds  # the first proposing round sets the mean
        self._proposals += 1

    def record_round(self, other_tokens: int, seconds: float) -> None:
        """After every round: the tokens it yielded that the heads alone did not draft, and its verify seconds without
        the heads-only nodes."""
        decay = self.settings.decay if self.seconds else 0.0  # the first round sets the means
        self.other_tokens = decay * self.other_tokens + (1 - decay) * other_tokens
        self.seconds = decay * self.seconds + (1 - decay) * seconds


class SharedTree(NamedTuple):
    tokens: torch.Tensor  # [N] kept tree tokens, root first
    buffers: TreeBuffers
    sources: torch.Tensor  # [N] HEADS / LOOKUP bits
    heads_values: torch.Tensor  # [N] the heads' own (unscaled) value of each kept node; 0 for lookup-only nodes
    branch_nodes: list[list[int]]  # per branch: the kept nodes along it, from the root's child down
    values: torch.Tensor  # [N] each kept node's worth: max(calibrated heads value, lookup value); root 1
    source_list: list[int]  # ``sources`` as the host has them
    heads_total: float  # the sum of ``heads_values`` over the candidates (the heads' expected accepted tokens)


def read_tree(tokens: torch.Tensor, buffers: TreeBuffers, values: torch.Tensor
              ) -> tuple[list[int], list[int], list[float]]:
    """A drafted tree's tokens, parents and values as lists, in one read."""
    rows = torch.stack([tokens.double(), buffers.to(tokens.device).parents.double(), values.double()]).tolist()
    return [int(t) for t in rows[0]], [int(p) for p in rows[1]], rows[2]


def share_lists(device: torch.device, tokens: list[int], parents: list[int], values: list[float],
                branches: list[list[int]], p_lookup: Sequence[float | Sequence[float]], budget: int,
                latency: dict[int, float] | None = None, heads_scale: float = 1.0,
                overhead: float = 0.0) -> SharedTree:
    """Merge lookup branches into a heads tree (the host's lists: ``tokens``, ``parents``, ``values``; node 0 the
    root), then keep the ``budget`` nodes (root included) most likely accepted.

    values [N]: each heads node's estimated probability that its path is accepted (root: 1), used times
    ``heads_scale`` (a ``HeadsCalibration``). A node at depth j of lookup branch b is worth p_lookup[b][j-1] (a
    ``LookupReliability.values`` list), or p_lookup[b]**j for a number (the best over the branches through it); a
    node also proposed by the heads is worth the larger. Values never grow along a path, so the kept set (best first,
    shallower first on ties) holds each kept node's parent. With ``latency`` (seconds of one verify forward per node
    count, measured on this machine) the budget itself is chosen per step: the n <= budget that maximises
    (1 + sum of the n-1 best values) / (latency(n) + overhead), i.e. expected tokens per second of a round that also
    spends ``overhead`` seconds drafting (the heads' proposing time when they ran: a dearer round makes extra nodes
    relatively cheaper).

    The heads' tree is read to the host once (``read_tree``: a few dozen numbers), merged and cut there, and the
    kept tree copied back once (``tree.host_tree``): the tensors returned are on ``device``.
    """
    if len(p_lookup) < len(branches):
        raise ValueError(f"{len(branches)} lookup branches but {len(p_lookup)} reliabilities")
    n_heads = len(tokens)
    merged, merged_parents, sources, paths = merge_lists(tokens, parents, branches)
    n = len(merged)
    depths = [0] * n
    for node in range(1, n):
        depths[node] = depths[merged_parents[node]] + 1
    own = [float(v) for v in values] + [0.0] * (n - n_heads)  # the heads' values, unscaled
    worth = [min(v * heads_scale, 1.0) for v in own]
    for path, p in zip(paths, p_lookup):  # per node: the best value of the branches through it
        if not path:
            continue
        if isinstance(p, (int, float)):
            branch_values = [float(p) ** j for j in range(1, len(path) + 1)]
        else:
            if len(p) < len(path):
                raise ValueError(f"a lookup branch of {len(path)} tokens has only {len(p)} values")
            branch_values = [float(v) for v in p[:len(path)]]
        for node, value in zip(path, branch_values):
            worth[node] = max(worth[node], value)
    kept_values = [1.0] + worth[1:]
    worth[0] = float("inf")  # the root always stays
    ranked = sorted(range(n), key=lambda i: (-worth[i], depths[i], i))
    if latency is not None:
        gains = list(itertools.accumulate(worth[i] for i in ranked[1:budget]))  # expected accepted tokens of n-1
        budget = max(range(1, min(budget, n) + 1),
                     key=lambda k: (1 + (gains[k - 2] if k > 1 else 0.0)) / (interpolate(latency, k) + overhead))
    keep = sorted(ranked[:budget])  # original order: parents before children
    new_index = {old: new for new, old in enumerate(keep)}
    kept_paths = []
    for path in paths:
        kept = []
        for node in path:
            if node not in new_index:
                break
            kept.append(new_index[node])
        kept_paths.append(kept)
    kept_sources = [sources[i] for i in keep]
    kept_own = [own[i] for i in keep]
    buffers, (out_tokens, out_sources, out_own, out_values) = host_tree(
        device, [0] + [new_index[merged_parents[i]] for i in keep[1:]], [merged[i] for i in keep], kept_sources,
        kept_own, [kept_values[i] for i in keep])
    return SharedTree(out_tokens.long(), buffers, out_sources.long(), out_own.float(), kept_paths, out_values.float(),
                      kept_sources, sum(kept_own[1:]))


class BudgetDrafter:
    """The heads' drafter with a per-round node budget, and optionally prompt-lookup branches (see the module
    docstring): wraps any heads drafter.

    Per round: the gate decides whether the heads propose; with ``lookup`` settings, up to ``lookup.branches``
    continuations of the longest matched suffix are merged into the heads' tree; ``share_lists`` keeps the most
    valuable nodes, as many as pay for their verify time on ``costs.latency`` (None: the whole budget). ``observe``
    updates the reliabilities, the calibration and the gate, then passes the outcome on to the heads' drafter.
    ``costs.propose_seconds``: seconds one proposal of the heads takes on this machine; with the latency it sizes the
    trees of the rounds the heads run and sets the gate's bar (None: neither); ``costs.propose_rows``: several rows'
    proposals together, which a row of a batch is charged its share of. Without lookup, a round whose heads sit out
    verifies the root alone (a plain decode step).
    """

    def __init__(self, heads_drafter, lookup: LookupConfig | None = None, gate: GateConfig | None = None,
                 nodes: int = 1, costs: Costs | None = None):
        self.heads = heads_drafter
        self.lookup = lookup  # None: the heads' tree alone
        self.gate_settings = gate or GateConfig()
        self.costs = costs or Costs()  # this machine's: verify latency, proposing seconds (one row's, several rows')
        self.latency = self.costs.latency  # verify seconds per node count (None: keep the whole budget)
        self.feature_layers = heads_drafter.feature_layers  # the states are the heads drafter's
        self.nodes = nodes  # the heads' own node budget: the shared budget is at least this
        self.device = heads_drafter.device  # where the drafts live (the backbone's)
        self.rows = 1  # rows whose trees one forward verifies (``share_forward``)
        self.min_ngram = lookup.shortest_ngram(1) if lookup is not None else 1
        self._reset()

    def _reset(self) -> None:
        self.index = NgramIndex(self.lookup.max_ngram if self.lookup is not None else 1)
        # one acceptance estimate per (matched n-gram length, branch rank): a continuation of a matched trigram is
        # surer than one of a single token, the most recent occurrence surer than older ones
        self.reliability: dict[tuple[int, int], LookupReliability] = {}
        self.calibration = HeadsCalibration()  # how the heads' values compare with what is accepted here
        self.gate = HeadsGate(self.gate_settings, cost=self.propose_cost if self.latency is not None else 0.0)
        self.prefix_len = 0  # tokens in the backbone's cache (all but the root)
        self._drafting = True  # whether the last round had room to draft
        self._round: tuple[list, SharedTree, tuple[float, float]] | None = None  # branch estimates, shared tree,
        # and verify seconds without / with the heads-only nodes

    @property
    def propose_cost(self) -> float:
        """Seconds of this row's proposal: its share of the proposals of the rows it drafts beside."""
        return self.costs.propose_time(self.rows) / self.rows

    def share_forward(self, rows: int) -> None:
        """From now on this drafter's trees are verified in one forward with those of ``rows`` rows in all
        (``loop.decode``): its nodes are priced at that load (``VerifyLatency.at``), its proposal at its
        share of the rows' proposals run together."""
        self.rows = rows
        self.gate.cost = self.propose_cost if self.latency is not None else 0.0

    def describe(self) -> str:
        if self.lookup is not None:
            return f"{self.heads.describe()} + prompt lookup"
        return f"{self.heads.describe()}, sized per round" if self.latency is not None else self.heads.describe()

    def start(self, prefill: Prefill) -> None:
        self._reset()
        if self.lookup is not None:
            self.index.extend(prefill.input_ids.tolist() + [prefill.root])
        self.prefix_len = prefill.input_ids.shape[0]
        self.heads.start(prefill)

    def propose(self, root: int, room: int) -> Draft:
        return run_alone(self.propose_steps(root, room))

    def propose_steps(self, root: int, room: int):
        """``propose`` as steps (``drafting.proposal_steps``): yields the heads' module passes."""
        # no room: a round that drafts nothing (the generation's end, or a batch drafting nothing this round); the gate
        # neither decides nor learns from it
        self._drafting = room > 0
        heads_ran = self.gate.propose() if self._drafting else True
        if heads_ran:  # the heads' tree, read to the host once (``share_lists``)
            own = yield from proposal_steps(self.heads, root, room)
            tokens, parents, values = read_tree(own.tokens, own.buffers, own.values)
        else:
            tokens, parents, values = [root], [0], [1.0]
        # the branch is offered whole and the shared budget decides how much of it is kept
        matched, branches = self.index.continuations(min(self.lookup.max_len, room), self.min_ngram,
                                                     self.lookup.branches) if self.lookup is not None else (0, [])
        rels = [self.reliability.setdefault((matched, rank), LookupReliability()) for rank in range(len(branches))]
        budget = max(self.nodes, max((len(b) for b in branches), default=0) + 1)
        # sized from the cached latency table only (no wall-clock input): a seeded generation picks the same trees,
        # hence the same samples, every time
        latency = self.latency.at(self.prefix_len, self.rows) if self.latency is not None else None
        shared = share_lists(self.device, tokens, parents, values, branches,
                             [rel.values(len(b)) for rel, b in zip(rels, branches)], budget, latency,
                             self.calibration.scale, overhead=self.propose_cost if heads_ran else 0.0)
        # verify seconds of the round without and with the nodes only the heads drafted (the gate charges the
        # difference to the heads)
        if latency is not None:
            without = 1 + sum(1 for src in shared.source_list[1:] if src & LOOKUP)
            seconds = (interpolate(latency, without), interpolate(latency, len(shared.source_list)))
        else:
            seconds = (0.0, 0.0)
        self._round = (rels, shared, seconds)
        return Draft(tokens=shared.tokens, buffers=shared.buffers, sources=shared.sources, values=shared.values,
                     heads_ran=heads_ran)

    def observe(self, outcome: Outcome) -> None:
        rels, shared, seconds = self._round
        path = outcome.path[1:]
        path_sources = [shared.source_list[i] for i in path]
        for rel, nodes in zip(rels, shared.branch_nodes):
            if nodes:
                rel.update_branch(nodes, path)
        heads_only = sum(1 for src in path_sources if src == HEADS)
        if outcome.draft.heads_ran and self._drafting:
            self.calibration.update(shared.heads_total,
                                    sum(1 for src in path_sources if src & HEADS))
            # (never below 0: with a small-row plan a larger tree can verify faster than a smaller one, which is no
            # earning of the heads)
            self.gate.update(heads_only, max(0.0, seconds[1] - seconds[0]))
        if self.latency is not None and self._drafting:
            self.gate.record_round(len(outcome.tokens) - heads_only, seconds[0])
        if self.lookup is not None:
            self.index.extend(outcome.emitted)
        self.prefix_len += len(outcome.path)
        self.heads.observe(outcome)

