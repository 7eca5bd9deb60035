"""This machine's verify latency: seconds of one backbone forward of n tree nodes over a cache of P tokens; and the
heads' proposing time: seconds of one draft.

``measure_latency`` times the verify, ``fit_latency`` smooths it into a curve that never decreases in n, and
``cached_latency`` measures curves at a few cache lengths (a ``costs.VerifyLatency``) once per backbone and machine.
``measure_propose`` times the heads' drafter and ``cached_propose_cost`` measures it once per heads, tree settings and
machine; ``measure_propose_rows`` / ``cached_propose_rows`` the same for several rows proposing together (a batch's
round, ``drafting.propose_rows``). All end up in a ``costs.Costs`` (``measure_costs``): the budget drafter sizes its
trees from them and lets heads that do not earn their proposing time sit rounds out; ``tree="auto"``
(``autotune.py``) chooses the heads' trees from the latency.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Collection, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from tokenmaxx.heads import Outcome, Prefill, Tree
from tokenmaxx.heads.drafting import propose_rows
from tokenmaxx.heads.modeling import backbone_features

from ..costs import VerifyLatency
from ..runner import Plan, as_plan, plan_record
from tokenmaxx.heads.machine import clock
from .small_rows import VerifyTimer
from .store import CALIBRATION_VERSION, backbone_key, cache_path, calibration_key, machine_fingerprint, write_record

LATENCY_SIZES = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
PREFIX_LENS = (256, 1024)  # cached tokens the verify latency is measured over (attention grows with them)


@torch.inference_mode()
def measure_latency(model, sizes: Sequence[int] = LATENCY_SIZES, prefix_len: int = 256, repeats: int = 7,
                    statistic: str = "min", small_rows: Plan = 0) -> dict[int, float]:
    """Seconds of one backbone forward of n new tokens over a cache of ``prefix_len``: per size, the ``statistic``
    ("min" or "median") over ``repeats`` rounds that each go through every size (a slow spell of a shared machine then
    hits all sizes alike), timed by ``VerifyTimer``. Raw and still noisy: ``fit_latency`` turns it into the table the
    search uses. ``small_rows``: the plan of the verifies (``small_rows``): each forward computes the linear layers as
    a verify of its size does."""
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")
    timer = VerifyTimer(model, prefix_len, max(sizes))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in tqdm(range(repeats), desc=f"verify latency of {min(sizes)}-{max(sizes)} tokens over {prefix_len} cached",
                  unit="round", leave=False):
        for n in sizes:
            times[n].append(timer.seconds(timer.draw(n), small_rows))
    pick = min if statistic == "min" else statistics.median
    return {n: pick(ts) for n, ts in times.items()}


def fit_latency(measured: dict[int, float], exact: Collection[int] = ()) -> dict[int, float]:
    """The measured latencies smoothed into a curve that never decreases in n: one token as measured (attention runs
    a cheaper unmasked path for a single query, markedly so over a long cache), and from two tokens on a flat-then-
    linear ``a + b * max(0, n - knee)`` with b >= 0, fitted by least squares (the knee is the measured size that fits
    best). Forward cost is flat while the hardware has idle lanes and then grows with the tokens; a raw table instead
    carries the machine's noise (a shared CPU can time a larger forward faster than a smaller one), which would tell
    the tree search that extra nodes are free. Returns the curve at the measured sizes.

    ``exact``: sizes whose forwards take another, faster path (the verifies' small-row plan, ``small_rows``): they are
    left out of the curve and kept as measured where that is below it, and the table then holds every size from 1 to
    the largest measured (the others from the curve), so a search over node counts sees the dips at exactly those
    sizes and not a line drawn through them (which under-priced the sizes between)."""
    exact = {n for n in exact if n in measured and n >= 2}
    if len([n for n in measured if n >= 2 and n not in exact]) < 2:
        exact = set()  # too few other sizes for a curve: one curve through all
    if not exact:
        return _fit_curve(measured, sorted(measured))
    table = _fit_curve({n: s for n, s in measured.items() if n not in exact}, range(1, max(measured) + 1))
    for n in exact:
        table[n] = min(measured[n], table[n])
    return table


def _fit_curve(measured: dict[int, float], at: Iterable[int]) -> dict[int, float]:
    """``fit_latency``'s curve through ``measured`` (no exact sizes), at the sizes ``at`` (1 only where measured)."""
    sizes = sorted(n for n in measured if n >= 2)
    fitted: tuple[float, float, int] | None = None  # (a, b, knee); None: too few sizes to fit, as measured
    if len(sizes) >= 2:
        ys = [measured[n] for n in sizes]
        mean_y = sum(ys) / len(ys)
        best = (sum((y - mean_y) ** 2 for y in ys), mean_y, 0.0, sizes[-1])  # (error, a, b, knee): flat
        for knee in sizes[:-1]:
            xs = [max(0, n - knee) for n in sizes]
            mean_x = sum(xs) / len(xs)
            var = sum((x - mean_x) ** 2 for x in xs)
            b = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var)
            a = mean_y - b * mean_x
            error = sum((a + b * x - y) ** 2 for x, y in zip(xs, ys))
            if error < best[0]:
                best = (error, a, b, knee)
        fitted = best[1:]

    def curve(n: int) -> float:
        if fitted is None:
            return measured[n]
        a, b, knee = fitted
        return a + b * max(0, n - knee)
    out = {n: curve(n) for n in at if n >= 2}
    if 1 in measured:
        out[1] = min(measured[1], curve(sizes[0])) if sizes else measured[1]
    return dict(sorted(out.items()))


def latency_path(model, small_rows: Plan = 0, prefix_lens: Sequence[int] = PREFIX_LENS,
                 cache_root: Path | None = None) -> Path:
    """Where this backbone's verify latency on this machine (verifies computed as ``small_rows`` says) is cached."""
    key = backbone_key(model, machine_fingerprint(model), "latency", list(prefix_lens), CALIBRATION_VERSION, "median",
                       plan_record(small_rows))
    return cache_path(f"latency-{key}", cache_root)


def cached_latency(model, cache_root: Path | None = None, refresh: bool = False,
                   prefix_lens: Sequence[int] = PREFIX_LENS, small_rows: Plan = 0) -> VerifyLatency:
    """The fitted verify latency (``fit_latency`` of the median ``measure_latency``) of this backbone on this machine
    at a few cache lengths, measured once and cached; ``small_rows``: as the verifies compute their linear layers
    (``runner.transposed_linears``), part of the cache key."""
    machine = machine_fingerprint(model)
    path = latency_path(model, small_rows, prefix_lens, cache_root)
    if path.is_file() and not refresh:
        record = json.loads(path.read_text())
        return VerifyLatency({int(p): {int(n): s for n, s in table.items()} for p, table in record["tables"].items()})
    context = getattr(model.config, "max_position_embeddings", None) or max(prefix_lens) + max(LATENCY_SIZES)
    lengths = sorted({max(1, min(p, context - max(LATENCY_SIZES))) for p in prefix_lens})
    # the median, not the best case: in the decode loop a multi-token forward costs what the medians say, not the
    # minima; sized on minima, hybrid trees came out too big (docs/benchmarks.md, "Figures moved from the code")
    planned = set(as_plan(small_rows))  # sizes the plan verifies another way: measured each, kept as measured
    sizes = sorted(set(LATENCY_SIZES) | planned)
    measured = {p: measure_latency(model, sizes=sizes, prefix_len=p, statistic="median", small_rows=small_rows)
                for p in lengths}
    tables = {p: fit_latency(m, exact=planned) for p, m in measured.items()}
    write_record(path, {"tables": tables, "measured": measured, "machine": machine})
    return VerifyLatency(tables)


def drafts_along(drafter, seq: torch.Tensor, hidden: torch.Tensor, start: int):
    """Walk ``drafter`` along a backbone continuation: seq [T] tokens (the prompt is seq[:start]) and hidden [T, F]
    the states it reads. At each position t from ``start`` on, the root is seq[t]; yields (t, the draft below it,
    seconds its proposal took), then tells the drafter that only the backbone's next token seq[t + 1] was accepted.
    The clock waits for the device (``heads.machine.clock``)."""
    device = hidden.device
    drafter.start(Prefill(input_ids=seq[:start], hidden=hidden[:start], root=int(seq[start])))
    for t in range(start, seq.numel() - 1):
        t0 = clock(device)
        draft = drafter.propose(int(seq[t]), seq.numel() - 1 - t)
        yield t, draft, clock(device) - t0
        nxt = seq[t + 1: t + 2].tolist()
        drafter.observe(Outcome(draft=draft, nodes=torch.zeros(1, dtype=torch.long, device=device), tokens=nxt,
                                hidden=hidden[t: t + 1], emitted=nxt, path=[0], token_ids=seq[t + 1: t + 2]))


def own_continuation(model, feature_layers, prompt_len: int, new_tokens: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The backbone's own greedy continuation, ``new_tokens`` long, of a seeded random prompt (the same every call):
    its own text gives drafts as deep and as confident as in generation; random tokens alone would give shallow, cheap
    ones. Returns (P: ``prompt_len``, cut where the prompt and its continuation would not fit in the context; seq
    [P + new_tokens]; the states drafters read along it [P + new_tokens, F], ``backbone_features`` of
    ``feature_layers``)."""
    weight = model.get_output_embeddings().weight
    vocab, device = weight.shape[0], weight.device
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:  # the prompt and its continuation stay inside the context
        prompt_len = max(1, min(prompt_len, context - new_tokens - 1))
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(vocab, (1, prompt_len), generator=gen, device="cpu").to(device)  # [1, P]
    seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)  # [1, P + new_tokens]
    hidden = backbone_features(model(seq, output_hidden_states=True).hidden_states, feature_layers)[0]
    return prompt_len, seq[0], hidden


@torch.inference_mode()
def measure_propose(model, drafter, prompt_len: int = 128, positions: int = 24) -> float:
    """Median seconds of one ``drafter.propose`` at ``positions`` positions of the backbone's own greedy continuation
    of a random prompt (``own_continuation``), each with room for ``positions`` more tokens (``drafts_along``)."""
    prompt_len, seq, hidden = own_continuation(model, drafter.feature_layers, prompt_len, 2 * positions)
    times = [seconds for t, _, seconds in drafts_along(drafter, seq, hidden, prompt_len)
             if t < prompt_len + positions]
    return statistics.median(times)


PROPOSE_ROWS = (4, 16)  # batches whose proposals (run together) are timed beside one row's


@torch.inference_mode()
def measure_propose_rows(model, make_drafter, rows: int, prompt_len: int = 128, positions: int = 12) -> float:
    """Median seconds of ``rows`` drafters' proposals run together (``drafting.propose_rows``: their module passes
    batched) along the backbone's own continuation of a random prompt, as ``measure_propose`` times one; each row
    starts ``rows`` positions further into it, so the rows' trees differ as a batch's do."""
    device = model.get_output_embeddings().weight.device
    drafters = [make_drafter() for _ in range(rows)]  # (making a drafter draws nothing random)
    prompt_len, seq, hidden = own_continuation(model, drafters[0].feature_layers, prompt_len, 2 * positions + rows)
    starts = [prompt_len + r for r in range(rows)]
    for drafter, start in zip(drafters, starts):
        drafter.start(Prefill(input_ids=seq[:start], hidden=hidden[:start], root=int(seq[start])))
    times = []
    for step in range(positions):
        at = [start + step for start in starts]
        t0 = clock(device)
        drafts = propose_rows(drafters, [int(seq[t]) for t in at], [seq.numel() - 1 - t for t in at])
        times.append(clock(device) - t0)
        for drafter, draft, t in zip(drafters, drafts, at):
            nxt = seq[t + 1: t + 2]
            drafter.observe(Outcome(draft=draft, nodes=torch.zeros(1, dtype=torch.long, device=device),
                                    tokens=nxt.tolist(), hidden=hidden[t: t + 1], emitted=nxt.tolist(), path=[0],
                                    token_ids=nxt))
    return statistics.median(times)


def settings_key(tree) -> object:
    """The heads' tree settings as JSON-able data for a cache key (a Tree's paths, a dataclass's fields)."""
    if isinstance(tree, Tree):
        return [list(path) for path in tree.paths]
    if dataclasses.is_dataclass(tree):
        return dataclasses.asdict(tree)
    return tree if tree is None or isinstance(tree, (str, int, float)) else repr(tree)


def propose_path(model, heads, tree=None, draft_vocab: bool = True, cache_root: Path | None = None,
                 rows: bool = False) -> Path:
    """Where the proposing time of these heads, tree settings and draft vocabulary on this machine is cached (``rows``:
    that of several rows together)."""
    machine = machine_fingerprint(model)
    key = calibration_key(model, heads, {**machine, "propose": settings_key(tree), "draft_vocab": bool(draft_vocab)})
    return cache_path(f"propose-{'rows-' if rows else ''}{key}", cache_root)


def cached_propose_cost(model, heads, tree=None, draft_vocab: bool = True, cache_root: Path | None = None,
                        refresh: bool = False) -> float:
    """Seconds the heads' drafter (``heads.drafter(model, tree, draft_vocab)``) takes to propose one tree on this
    machine (``measure_propose``), measured once per heads, tree settings and machine and cached. A cached number,
    not a clock read during generation: a seeded generation sized by it picks the same trees, hence the same samples,
    every time."""
    machine = machine_fingerprint(model)
    path = propose_path(model, heads, tree, draft_vocab, cache_root)
    if path.is_file() and not refresh:
        return float(json.loads(path.read_text())["propose_seconds"])
    seconds = measure_propose(model, heads.drafter(model, tree=tree, draft_vocab=draft_vocab))
    write_record(path, {"propose_seconds": seconds, "tree": settings_key(tree), "draft_vocab": bool(draft_vocab),
                        "machine": machine})
    return seconds


def cached_propose_rows(model, heads, tree=None, draft_vocab: bool = True, cache_root: Path | None = None,
                        refresh: bool = False) -> dict[int, float]:
    """Seconds of ``PROPOSE_ROWS`` rows' proposals run together (``measure_propose_rows``; ``Costs.propose_rows``),
    measured once per heads, tree settings and machine and cached beside one row's."""
    machine = machine_fingerprint(model)
    path = propose_path(model, heads, tree, draft_vocab, cache_root, rows=True)
    if path.is_file() and not refresh:
        return {int(r): float(s) for r, s in json.loads(path.read_text())["propose_rows"].items()}
    seconds = {rows: measure_propose_rows(model, lambda: heads.drafter(model, tree=tree, draft_vocab=draft_vocab),
                                          rows) for rows in PROPOSE_ROWS}
    write_record(path, {"propose_rows": seconds, "tree": settings_key(tree), "draft_vocab": bool(draft_vocab),
                        "machine": machine})
    return seconds
