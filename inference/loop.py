"""The decode loop: prefill, then rounds of draft -> verify -> accept -> commit -> observe.

``speculative_decode`` drives any drafter (``drafting.Drafter``) with any acceptance rule (``decoding.accept_greedy``
or a sampling rule from ``sampling.py``) and returns the new tokens with the generation's statistics. It owns the
backbone's KV cache and rolls it back explicitly (``decoding.commit``). ``SpeculativeGenerator`` (``generator.py``)
is the user-facing wrapper: inputs, generation config, sampling, output.

Letters: P prompt tokens, N tree nodes, V vocabulary, H hidden size.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from tokenmaxx.heads.drafting import SOURCE_NAMES, Outcome, Prefill
from tokenmaxx.heads.modeling import backbone_features

from .decoding import Accepted, commit, verify
from .forward import ForwardContext
from .kv import StaticKV
from tokenmaxx.heads.machine import clock, reads_are_free

PHASES = ("propose", "verify", "accept", "commit")
STATIC_MARGIN = 512  # positions a static cache holds past the prompt and the new tokens: the largest padded tree


class Throughput:
    """``wall_seconds`` and ``tokens_per_s`` of statistics that count ``prefill_seconds``, ``decode_seconds`` and
    ``new_tokens``; None where those times were not measured (a batch's rows: the batch is timed as a whole)."""

    @property
    def wall_seconds(self) -> float | None:
        if self.prefill_seconds is None or self.decode_seconds is None:
            return None
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float | None:
        wall = self.wall_seconds
        if wall is None:
            return None
        return self.new_tokens / wall if wall else 0.0


@dataclass
class GenerationStats(Throughput):
    steps: int = 0  # speculative rounds (backbone forwards after the prefill)
    new_tokens: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tau -> number of rounds
    prefill_seconds: float | None = 0.0  # None: not measured (a batch's row; the batch's own stats time it)
    decode_seconds: float | None = 0.0
    phase_seconds: dict[str, float] | None = field(  # decode time by step; "commit" includes the drafter's observe;
        default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # None when the rounds were not timed
    accepted_by_source: dict[str, int] = field(  # accepted candidates by who drafted them (bonus tokens excluded)
        default_factory=lambda: dict.fromkeys(("heads", "lookup", "both"), 0))
    heads_skipped: int = 0  # rounds the heads sat out because they were not paying (budget.HeadsGate): lookup alone
    # drafted them (hybrid), or the root alone was verified (heads on measured costs)
    verified_nodes: int = 0  # tree nodes verified over the rounds (a round that drafted nothing: 1, the root)
    timed: bool = True  # whether ``phase_seconds`` were measured (``speculative_decode``'s ``timed``)
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
        return {"steps": self.steps, "new_tokens": self.new_tokens, "mean_tau": round(self.mean_tau, 4),
                "accepted_hist": dict(sorted(self.accepted_hist.items())), "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "wall_seconds": self.wall_seconds,
                "tokens_per_s": self.tokens_per_s, "phase_seconds": self.phase_seconds,
                "accepted_by_source": self.accepted_by_source, "heads_skipped": self.heads_skipped,
                "verified_nodes": self.verified_nodes}


Accept = Callable[[torch.Tensor, torch.Tensor, object], Accepted]  # (tokens [N], logits [N, V], buffers)


def greedy_root(logits: torch.Tensor) -> int:
    """The backbone's greedy choice from last-position logits [V]."""
    return int(logits.argmax())


def eos_ids(generation_config) -> set[int]:
    """The generation config's EOS ids as a set (it may hold one id, a list, or None)."""
    eos = generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


def speculative_decode(model, drafter, input_ids: torch.Tensor, max_new_tokens: int, accept: Accept,
                       choose_root: Callable[[torch.Tensor], int], eos: set[int], streamer=None,
                       forward: ForwardContext | None = None,
                       timed: bool | None = None) -> tuple[list[int], GenerationStats]:
    """Generate up to ``max_new_tokens`` after ``input_ids`` [1, P] (stopping after an EOS id); returns the new
    tokens and the statistics. ``choose_root`` picks the first token from the prefill's last logits [V];
    ``forward``: how the tree verifies run on this machine (``forward.ForwardContext``; None: as the model is). Runs
    on the backbone's device (``input_ids`` is moved there); every time in the statistics waits for it first
    (``heads.machine.clock``). ``timed``: whether each round's phases are timed (four waits for the device a
    round); None: where that costs nothing (``heads.machine.reads_are_free``). Prefill and decode are always timed.

    A greedy round reads back from the device once (its accepted length, path and tokens), plus what the drafter
    reads (none for the sequential kinds' trees on an accelerator; tests/test_round.py counts them)."""
    device = model.get_output_embeddings().weight.device
    timed = reads_are_free(device) if timed is None else timed
    stats = GenerationStats(timed=timed)
    if streamer is not None:  # a streamer gets CPU tensors, as from model.generate
        streamer.put(input_ids.cpu())
    input_ids = input_ids.to(device)
    start = clock(device)
    forward = forward or ForwardContext()
    kv = forward.static_cache(model, input_ids.shape[1] + max_new_tokens + STATIC_MARGIN) \
        if forward.cache == "static" else None
    cache, prefill = _prefill(model, input_ids, choose_root, drafter.feature_layers, kv)
    drafter.start(prefill)
    root, prefix_len, new_tokens = prefill.root, input_ids.shape[1], [prefill.root]
    stats.prefill_seconds = clock(device) - start
    if streamer is not None:
        streamer.put(torch.tensor([root], device="cpu"))

    start = clock(device)
    tick = (lambda times: times.append(clock(device))) if timed else (lambda times: None)
    while root not in eos and len(new_tokens) < max_new_tokens:
        times: list[float] = []
        tick(times)
        room = max_new_tokens - len(new_tokens) - 1  # a round emits at most depth + 1 tokens: no overshooting nodes
        draft = drafter.propose(root, room)
        tick(times)
        verified = verify(model, cache, draft.tokens, draft.buffers, prefix_len, forward, drafter.feature_layers)
        tick(times)
        accepted = accept(draft.tokens, verified.logits, draft.buffers)
        tick(times)
        prefix_len = commit(cache, prefix_len, accepted.nodes, accepted.path)
        emitted = _emitted(accepted.tokens, max_new_tokens - len(new_tokens), eos)
        outcome = Outcome(draft=draft, nodes=accepted.nodes, tokens=accepted.tokens,
                          hidden=verified.hidden[accepted.nodes], emitted=emitted, path=accepted.path,
                          token_ids=accepted.token_ids)
        drafter.observe(outcome)
        tick(times)
        stats.record(outcome, times)
        new_tokens.extend(emitted)
        root = emitted[-1]
        if streamer is not None:
            streamer.put(torch.tensor(emitted, device="cpu"))
    stats.decode_seconds = clock(device) - start
    stats.new_tokens = len(new_tokens)
    stats.finish()
    if streamer is not None:
        streamer.end()
    return new_tokens, stats


def _prefill(model, input_ids: torch.Tensor, choose_root, feature_layers: tuple[int, ...] | None,
             kv: StaticKV | None = None) -> tuple[DynamicCache | StaticKV, Prefill]:
    """One backbone forward over the prompt [1, P]: the cache (``kv``, else a new ``DynamicCache``) holds its P
    positions, the root is chosen from the last position's logits; the drafter gets the states it reads
    (``feature_layers``)."""
    cache = kv if kv is not None else DynamicCache(config=model.config)
    inputs = kv.prefill_inputs() if kv is not None else {"past_key_values": cache}
    out = model(input_ids=input_ids, use_cache=True, output_hidden_states=True, **inputs,
                **_last_logits_only(model, input_ids.shape[1]))
    if kv is not None:
        kv.write_at(input_ids.shape[1])  # the prompt is in place: write after it
    root = choose_root(out.logits[0, -1])  # from logits [V]
    hidden = backbone_features(out.hidden_states, feature_layers)[0]  # [P, F]
    return cache, Prefill(input_ids=input_ids[0], hidden=hidden, root=root)


def _emitted(tokens: list[int], room: int, eos: set[int]) -> list[int]:
    """What a round adds to the output: its tokens, cut at ``room`` and after the first EOS id."""
    emitted = tokens[:room]
    stop = next((i for i, tok in enumerate(emitted) if tok in eos), None)
    return emitted if stop is None else emitted[: stop + 1]


def _last_logits_only(model, prompt_len: int) -> dict:
    """Prefill keyword that has the backbone project only the last prompt position onto the vocabulary.

    The prefill needs the logits of the last position alone; all of them are [P, V], a large tensor for a long prompt.
    An index tensor rather than the int ``logits_to_keep=1``: the int slices a [1, 1, H] view with the prompt's batch
    stride, which torch on CPU projects through a slow path with frozen weights; indexing makes a fresh tensor
    (docs/benchmarks.md, "Why the defaults are what they are"). Models whose forward has no ``logits_to_keep`` get
    every position.
    """
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": torch.tensor([prompt_len - 1], device=model.get_output_embeddings().weight.device)}
