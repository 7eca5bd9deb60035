"""The decode loop, one for one prompt and for many: prefill, then rounds of draft -> verify -> accept -> commit ->
observe over the rows still generating (one prompt is a batch of one row).

``decode`` drives one drafter per row (any ``drafting.Drafter``) with one acceptance rule for the batch
(``decoding.accept_greedy``, or a sampling rule per row through ``decoding.each_row``) and returns each row's new
tokens with the statistics. Every row drafts its own tree, ONE backbone forward verifies all of them, each row
accepts and commits its own length; each row's tokens are what it would get alone. The cache (``kv.open_kv``: growing
or static) holds the rows' layout; the runner (``runner.Runner``) how a forward runs on this machine; ``costs``
(``costs.Costs``) what was measured of it. A row that finishes (EOS, its ``max_new_tokens``) leaves the batch.

The prefill runs in groups of rows of similar prompt length where the measured latency says padding costs time
(``prefill_groups``). The rows' proposals run in lockstep (``drafting.propose_rows``): each tree level of every row's
draft is one module pass for the batch. With a measured latency the batch's load decides each round whether the rows
draft at all (``LoadGate``), and each row's drafter is told how many rows share its forwards (``share_forward``).
``SpeculativeGenerator`` (``generator.py``) is the user-facing wrapper: inputs, generation config, sampling, output.

Letters: B rows, T padded prompt length, N tree nodes, V vocabulary, F features the drafter reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tokenmaxx.heads.drafting import SOURCE_NAMES, Outcome, Prefill, propose_rows
from tokenmaxx.heads.machine import clock, reads_are_free

from .costs import Costs, VerifyLatency, interpolate
from .decoding import Accept, commit, verify
from .kv import open_kv
from .runner import Runner

PHASES = ("propose", "verify", "accept", "commit")
STATIC_MARGIN = 512  # positions a static cache holds past the prompt and the new tokens: the largest padded tree


class Throughput:
    """``wall_seconds`` and ``tokens_per_s`` of statistics that count ``prefill_seconds``, ``decode_seconds`` and
    ``new_tokens``."""

    @property
    def wall_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0


@dataclass
class GenerationStats(Throughput):
    """One row's statistics. Its times are those of the batch's rounds it took part in: ``prefill_seconds`` the
    batch's prefill, ``decode_seconds`` from the first round until the row finished."""

    steps: int = 0  # speculative rounds (backbone forwards after the prefill)
    new_tokens: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tau -> number of rounds
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    phase_seconds: dict[str, float] | None = field(  # decode time by step; "commit" includes the drafter's observe;
        default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # None when the rounds were not timed
    accepted_by_source: dict[str, int] = field(  # accepted candidates by who drafted them (bonus tokens excluded)
        default_factory=lambda: dict.fromkeys(("heads", "lookup", "both"), 0))
    heads_skipped: int = 0  # rounds the heads sat out because they were not paying (budget.HeadsGate): lookup alone
    # drafted them (hybrid), or the root alone was verified (heads on measured costs)
    verified_nodes: int = 0  # tree nodes verified over the rounds (a round that drafted nothing: 1, the root)
    timed: bool = True  # whether ``phase_seconds`` were measured (``decode``'s ``timed``)
    _by_source: torch.Tensor | None = field(default=None, repr=False)  # accepted candidates per source bits, counted
    # on the device until ``finish``

    def __post_init__(self):
        if not self.timed:
            self.phase_seconds = None

    @property
    def mean_tau(self) -> float:
        """Tokens per backbone forward over the speculative rounds (accepted candidates + bonus). A generation that
        ended before any round (its first token an EOS, or ``max_new_tokens`` 1) made its one token in one forward,
        the prefill: 1.0."""
        if not self.steps:
            return 1.0 if self.new_tokens else 0.0
        return sum(t * c for t, c in self.accepted_hist.items()) / self.steps

    def record(self, outcome: Outcome, times: list[float]) -> None:
        """One round: its accepted length, who drafted the accepted candidates (counted on the device), and the time
        of each phase (``times``: the phases' boundaries; empty when untimed)."""
        self.steps += 1
        self.verified_nodes += outcome.draft.num_nodes
        tau = len(outcome.tokens)
        self.accepted_hist[tau] = self.accepted_hist.get(tau, 0) + 1
        sources = outcome.draft.sources[outcome.nodes[1:]]
        if self._by_source is None:
            self._by_source = torch.zeros(max(SOURCE_NAMES) + 1, dtype=torch.long, device=sources.device)
        self._by_source.index_add_(0, sources, torch.ones_like(sources))
        self.heads_skipped += not outcome.draft.heads_ran
        for phase, start, end in zip(PHASES, times, times[1:]):
            self.phase_seconds[phase] += end - start

    def finish(self) -> None:
        """After the last round: the device's counts into ``accepted_by_source`` (one read)."""
        if self._by_source is not None:
            counts = self._by_source.tolist()
            for bits, name in SOURCE_NAMES.items():
                self.accepted_by_source[name] += counts[bits]
            self._by_source = None

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in ("steps", "new_tokens", "mean_tau", "accepted_hist",
               "prefill_seconds", "decode_seconds", "wall_seconds", "tokens_per_s", "phase_seconds",
               "accepted_by_source", "heads_skipped", "verified_nodes")}
        return out | {"mean_tau": round(self.mean_tau, 4), "accepted_hist": dict(sorted(self.accepted_hist.items()))}


@dataclass
class BatchStats(Throughput):
    """Statistics of a generation: per row (``rows``, a ``GenerationStats`` each), and the batch's own forwards and
    time."""

    rows: list[GenerationStats]
    forwards: int = 0  # backbone forwards after the prefill (each verifies every active row's tree)
    drafting_forwards: int = 0  # of those, the rounds in which some row verified a tree (others: plain decoding)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    active_per_forward: list[int] = field(default_factory=list)  # rows still generating at each forward
    nodes_per_forward: list[int] = field(default_factory=list)  # each forward's tree size per row (the largest row's)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "forwards": self.forwards,
                "drafting_forwards": self.drafting_forwards, "new_tokens": self.new_tokens,
                "mean_nodes": sum(self.nodes_per_forward) / max(self.forwards, 1),
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "wall_seconds": self.wall_seconds, "tokens_per_s": self.tokens_per_s}


@dataclass
class LoadGate:
    """Whether a round of the batch drafts at all, on the measured costs.

    A drafting round of R rows verifies about ``nodes`` nodes a row and runs the rows' proposals (together,
    ``drafting.propose_rows``): it yields R x tau tokens in verify(R x nodes) + propose(R) seconds; a plain round
    yields R tokens in verify(R). Drafting goes on while it is the faster of the two by these running means (decayed,
    from the batch's drafting rounds; an optimistic start drafts the first rounds); otherwise the round is plain
    batched decoding, except one that drafts to keep the means current: ``explore_every`` plain rounds after drafting
    last won, then twice as many after each exploration that did not win it back, up to ``max_interval``. One row
    always drafts: its drafter's per-round budget weighs the same costs node by node (``budget.BudgetDrafter``, down
    to the root alone). The time of a round comes from the latency table, never a clock, so a seeded generation
    repeats itself."""

    latency: VerifyLatency
    # seconds of a round's proposals by rows (``Costs.propose_time``)
    propose: Callable[[int], float] = lambda rows: 0.0
    decay: float = 0.8
    explore_every: int = 8
    max_interval: int = 64
    tau: float = 2.0  # decayed mean tokens a row per drafting round
    nodes: float = 4.0  # decayed mean nodes a row per drafting round (the forward's: every row padded to the largest)
    _plain: int = 0  # plain rounds since the last drafting one
    _interval: int = 0  # plain rounds before the next exploration (0: explore_every)

    def draft(self, rows: int, prefix_len: int) -> bool:
        if rows == 1:
            return True
        table = self.latency.at(prefix_len)
        drafting = rows * self.tau / (interpolate(table, rows * self.nodes) + self.propose(rows))
        plain = rows / interpolate(table, rows)
        interval = self._interval or self.explore_every
        if drafting >= plain:
            self._plain, self._interval = 0, self.explore_every
            return True
        if self._plain + 1 >= interval:  # an exploration; the next one waits longer unless drafting wins meanwhile
            self._plain, self._interval = 0, min(2 * interval, max(self.max_interval, self.explore_every))
            return True
        self._plain += 1
        return False

    def update(self, tau: float, nodes: float) -> None:
        """After a drafting round: its tokens a row and the nodes it verified a row (the largest row's)."""
        self.tau = self.decay * self.tau + (1 - self.decay) * tau
        self.nodes = self.decay * self.nodes + (1 - self.decay) * nodes


def prefill_groups(lengths: Sequence[int], latency: dict[int, float] | None) -> list[list[int]]:
    """The rows' prefills as groups of rows, each one left-padded forward: the grouping of the rows sorted by length
    whose forwards cost least on ``latency`` (seconds per token count, ``VerifyLatency.at``; a group of g rows padded
    to its longest prompt L costs what g x L tokens cost, extrapolated past the measured sizes). Where a forward's
    cost grows with its tokens (a CPU), rows of very different lengths get their own forwards instead of paying for
    the padding; where it stays flat (a GPU's small batches), one forward holds them all. None: one forward for all
    rows, as the model computes a batch."""
    if latency is None or len(lengths) == 1:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    ordered = [lengths[b] for b in order]
    best, cut = [0.0], [0]  # best[i]: the cheapest prefill of the i shortest rows; cut[i]: where its last group starts
    for i in range(1, len(order) + 1):
        choice = min(range(i), key=lambda j: best[j] + interpolate(latency, (i - j) * ordered[i - 1]))
        best.append(best[choice] + interpolate(latency, (i - choice) * ordered[i - 1]))
        cut.append(choice)
    groups, end = [], len(order)
    while end:
        groups.append(sorted(order[cut[end]:end]))
        end = cut[end]
    return groups[::-1]


def greedy_root(logits: torch.Tensor, row: int = 0) -> int:
    """The backbone's greedy choice from a row's last-position logits [V]."""
    return int(logits.argmax())


def eos_ids(generation_config) -> set[int]:
    """The generation config's EOS ids as a set (it may hold one id, a list, or None)."""
    eos = generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


def decode(model, drafters: Sequence, input_ids: torch.Tensor, max_new_tokens: int | Sequence[int], accept: Accept,
           choose_root: Callable[[torch.Tensor, int], int], eos: set[int], attention_mask: torch.Tensor | None = None,
           runner: Runner | None = None, cache: str = "dynamic", costs: Costs | None = None, streamer=None,
           timed: bool | None = None) -> tuple[list[list[int]], BatchStats]:
    """Generate for B prompts at once: input_ids [B, T] (left-padded where ``attention_mask`` [B, T] marks each row's
    tokens; None: every token), one drafter per row, each row's ``max_new_tokens`` (or one for all);
    ``choose_root(logits [V], row)`` picks a row's first token. Stops a row after an EOS id. Returns each row's new
    tokens and the statistics. ``runner``: how forwards run here (None: as the model is); ``cache``: the KV layout
    ("dynamic" or "static", ``kv.open_kv``); ``costs``: this machine's measured costs (the batch's load gate, the
    prefill's groups; None: every round drafts, one prefill forward). A ``streamer`` takes one row: the prompt, then
    each round's tokens, as from ``model.generate``. ``timed``: whether each round's phases are timed (four waits for
    the device a round); None: where that costs nothing (``heads.machine.reads_are_free``). Prefill and decode are
    always timed.

    A greedy round reads back from the device once for all rows (their accepted lengths, paths and tokens), plus what
    the drafters read (none for the sequential kinds' trees on an accelerator; tests/test_round.py counts them)."""
    rows = input_ids.shape[0]
    news = [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(drafters) != rows or len(news) != rows:
        raise ValueError(f"{rows} rows need {rows} drafters and max_new_tokens, got {len(drafters)} and {len(news)}")
    if streamer is not None and rows != 1:
        raise ValueError(f"a streamer takes one prompt; this generation has {rows} rows")
    device = model.get_output_embeddings().weight.device
    timed = reads_are_free(device) if timed is None else timed
    runner = runner or Runner()
    stats = BatchStats(rows=[GenerationStats(timed=timed) for _ in range(rows)])
    if streamer is not None:  # a streamer gets CPU tensors, as from model.generate
        streamer.put(input_ids.cpu())
    input_ids = input_ids.to(device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    feature_layers = drafters[0].feature_layers

    start = clock(device)
    lengths = mask.sum(1).tolist()  # real prompt tokens per row
    table = costs.latency.at(0) if costs is not None and costs.latency else None
    kv = open_kv(model, cache, rows, max(lengths) + max(news) + STATIC_MARGIN, captured=runner.capture)
    hidden, last = kv.prefill(model, input_ids, mask, prefill_groups(lengths, table), feature_layers)
    roots = [choose_root(last[b], b) for b in range(rows)]
    width, total = hidden.shape[1], input_ids.shape[1]
    for b, drafter in enumerate(drafters):
        drafter.start(Prefill(input_ids=input_ids[b, total - lengths[b]:], hidden=hidden[b, width - lengths[b]:],
                              root=roots[b], logits=last[b]))
    stats.prefill_seconds = clock(device) - start
    if streamer is not None:
        streamer.put(torch.tensor(roots, device="cpu"))

    new_tokens = [[root] for root in roots]
    active, load = list(range(rows)), 0  # the rows still generating (by their index in the inputs); their count
    gate = LoadGate(costs.latency, costs.propose_time) if costs is not None and costs.latency else None
    tick = (lambda times: times.append(clock(device))) if timed else (lambda times: None)
    start = clock(device)
    while True:
        keep = [i for i, row in enumerate(active)
                if new_tokens[row][-1] not in eos and len(new_tokens[row]) < news[row]]
        if len(keep) < len(active):  # finished rows leave the batch
            now = clock(device) - start
            for row in set(active) - {active[i] for i in keep}:
                stats.rows[row].decode_seconds = now
            active = [active[i] for i in keep]
            if not active:
                break
            kv.drop(keep)
        if len(active) != load:  # the load each row's trees are priced at (drafters that price them)
            load = len(active)
            for row in active:
                drafters[row].share_forward(load)
        times: list[float] = []
        tick(times)
        drafting = gate is None or gate.draft(load, kv.end)
        # a plain round proposes nothing (room 0: the root alone); a round emits at most depth + 1 tokens: no
        # overshooting nodes
        drafts = propose_rows([drafters[row] for row in active], [new_tokens[row][-1] for row in active],
                              [news[row] - len(new_tokens[row]) - 1 if drafting else 0 for row in active])
        tick(times)
        verified = verify(model, kv, drafts, runner, feature_layers)
        tick(times)
        results = accept(drafts, verified.logits)
        tick(times)
        commit(kv, results)
        stats.forwards += 1
        stats.drafting_forwards += any(draft.num_nodes > 1 for draft in drafts)
        stats.active_per_forward.append(load)
        stats.nodes_per_forward.append(verified.logits.shape[1])
        if drafting and gate is not None:
            gate.update(sum(len(a.path) for a in results) / load, verified.logits.shape[1])
        outcomes = []
        for i, row in enumerate(active):
            accepted, draft = results[i], drafts[i]
            emitted = _emitted(accepted.tokens, news[row] - len(new_tokens[row]), eos)
            outcomes.append(Outcome(draft=draft, nodes=accepted.nodes, tokens=accepted.tokens,
                                    hidden=verified.hidden[i, accepted.nodes], emitted=emitted, path=accepted.path,
                                    token_ids=accepted.token_ids, logits=verified.logits[i]))
            drafters[row].observe(outcomes[-1])
            new_tokens[row].extend(emitted)
            if streamer is not None:
                streamer.put(torch.tensor(emitted, device="cpu"))
        tick(times)
        for row, outcome in zip(active, outcomes):
            stats.rows[row].record(outcome, times)
    stats.decode_seconds = now
    for row, tokens in zip(stats.rows, new_tokens):
        row.prefill_seconds, row.new_tokens = stats.prefill_seconds, len(tokens)
        row.finish()
    if streamer is not None:
        streamer.end()
    return new_tokens, stats


def _emitted(tokens: list[int], room: int, eos: set[int]) -> list[int]:
    """What a round adds to the output: its tokens, cut at ``room`` and after the first EOS id."""
    emitted = tokens[:room]
    stop = next((i for i, tok in enumerate(emitted) if tok in eos), None)
    return emitted if stop is None else emitted[: stop + 1]
