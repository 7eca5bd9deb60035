"""Hardware-aware draft trees: choose the tree that maximises expected tokens per second on this machine.

    expected tokens/s (tree) = E[tau](tree) / (verify_latency(N) + overhead)

E[tau] = 1 (bonus token) + sum over the tree's nodes of P(the path to that node is accepted). With Medusa heads every
head proposes the same top-k whatever the parent, so a path (r1..rd) is accepted exactly when, at that position, the
true token t+k+1 sits at rank r_k of head k for every k <= d. Calibration records, per position, the rank of the true
token in each head (``ranks [T, K]``), so P(path) is an empirical joint frequency, with no independence assumption.
Because P(prefix) >= P(path), the best tree of each size N takes the N-1 most frequent paths (prefix-closed by
construction); the search then only has to pick N, using the measured verify latency of N tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import DynamicCache

from .tree import Tree

# Generic calibration prompts (never benchmark prompts): a mix of chat, code, math, rewriting and summarising.
CALIBRATION_PROMPTS = (
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "A train travels 180 km in 2.5 hours. What is its average speed? Show your reasoning.",
    "Give me five tips for writing a clear email to a busy colleague.",
    "Summarize the plot of a story in which a lighthouse keeper finds a message in a bottle.",
    "Translate to French: 'The weather is nice today, so we will walk to the market.'",
    "What are the differences between a list and a tuple in Python?",
    "Describe the water cycle for a ten-year-old.",
)
LATENCY_SIZES = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
CALIBRATION_VERSION = 4  # bumped when the calibration method or what it times changes (4: GQA verify), so stale
# cached choices and latency tables are not reused


def ordered_paths_from_ranks(ranks: torch.Tensor, max_rank: int = 10) -> list[tuple[tuple[int, ...], float]]:
    """All paths seen in calibration with their acceptance probability, most probable first.

    ranks: [T, K] rank of the true token t+k+1 in head k's distribution at position t (>= max_rank: not in a tree).
    """
    total = ranks.shape[0]
    counts: Counter = Counter()
    for row in ranks.tolist():
        path = []
        for r in row:
            if r >= max_rank:
                break
            path.append(r)
            counts[tuple(path)] += 1
    return sorted(((p, c / total) for p, c in counts.items()), key=lambda pv: (-pv[1], len(pv[0]), pv[0]))


def ordered_paths_from_accuracy(rank_accuracy: Sequence[Sequence[float]],
                                max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Paths by the product of per-head rank accuracies (Medusa's model), most probable first."""
    from .tree import path_probability, sparse_tree

    tree = sparse_tree(rank_accuracy, max_nodes)
    values = {path: path_probability(rank_accuracy, path) for path in tree.paths}
    return sorted(values.items(), key=lambda pv: (-pv[1], len(pv[0]), pv[0]))


def interpolate(latency: dict[int, float], n: int) -> float:
    """Verify latency of n tokens, linearly interpolated between measured sizes (extrapolated past the ends)."""
    sizes = sorted(latency)
    if n in latency:
        return latency[n]
    lo = max([s for s in sizes if s < n], default=sizes[0])
    hi = min([s for s in sizes if s > n], default=sizes[-1])
    if lo == hi:  # outside the measured range: extend the nearest segment
        a, b = (sizes[-2], sizes[-1]) if n > sizes[-1] else (sizes[0], sizes[1])
        lo, hi = a, b
    return latency[lo] + (latency[hi] - latency[lo]) * (n - lo) / (hi - lo)


def choose_tree(ordered: list[tuple[tuple[int, ...], float]], latency: dict[int, float], overhead: float,
                max_nodes: int = 64, max_depth: int | None = None) -> tuple[Tree, list[dict]]:
    """Best tree over sizes N = 1..max_nodes: maximise (1 + sum of node probabilities) / (latency(N) + overhead).

    ``ordered``: (path, probability) most probable first. Returns the tree and the table of every size considered.
    """
    paths = [(p, v) for p, v in ordered if max_depth is None or len(p) <= max_depth][: max_nodes - 1]
    table, expected = [], 1.0
    for n in range(1, len(paths) + 2):
        if n > 1:
            expected += paths[n - 2][1]
        seconds = interpolate(latency, n) + overhead
        table.append({"nodes": n, "expected_tau": expected, "step_seconds": seconds,
                      "tokens_per_s": expected / seconds})
    best = max(table, key=lambda row: row["tokens_per_s"])
    return Tree([p for p, _ in paths[: best["nodes"] - 1]]), table


# ---- measurements on this machine ------------------------------------------------------------------------------
@torch.inference_mode()
def measure_latency(model, sizes: Sequence[int] = LATENCY_SIZES, prefix_len: int = 256, repeats: int = 7,
                    statistic: str = "min") -> dict[int, float]:
    """Seconds of one backbone forward of n new tokens over a cache of ``prefix_len``: per size, the ``statistic``
    ("min" or "median") over ``repeats`` rounds that each go through every size (a slow spell of a shared machine then
    hits all sizes alike). Raw and still noisy: ``fit_latency`` turns it into the table the search uses."""
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', got {statistic!r}")
    vocab = model.get_output_embeddings().weight.shape[0]
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:  # stay inside the backbone's context
        prefix_len = max(1, min(prefix_len, context - max(sizes)))
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(vocab, (1, prefix_len), generator=gen), past_key_values=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            ids = torch.randint(vocab, (1, n), generator=gen)
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
            times[n].append(time.perf_counter() - start)
            cache.crop(-n)
    pick = min if statistic == "min" else statistics.median
    return {n: pick(ts) for n, ts in times.items()}


def fit_latency(measured: dict[int, float]) -> dict[int, float]:
    """The measured latencies smoothed into a curve that never decreases in n: one token as measured (attention runs
    a cheaper unmasked path for a single query, markedly so over a long cache), and from two tokens on a flat-then-
    linear ``a + b * max(0, n - knee)`` with b >= 0, fitted by least squares (the knee is the measured size that fits
    best). Forward cost is flat while the hardware has idle lanes and then grows with the tokens; a raw table instead
    carries the machine's noise (on a shared 2-core CPU one run measured 12 tokens faster than 1), which would tell
    the tree search that extra nodes are free. Returns the curve at the measured sizes."""
    sizes = sorted(n for n in measured if n >= 2)
    out = {n: measured[n] for n in sizes}  # too few sizes to fit a curve: as measured
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
        _, a, b, knee = best
        out = {n: a + b * max(0, n - knee) for n in sizes}
    if 1 in measured:
        out[1] = min(measured[1], out[sizes[0]]) if sizes else measured[1]
    return dict(sorted(out.items()))


def continuations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int):
    """Per calibration prompt: its chat input_ids [1, P], the backbone's greedy continuation seq [T] (prompt
    included) and the final-normed hidden states along it [T, H]."""
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"]
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)  # [1, T]
        yield ids, seq[0], model(seq, output_hidden_states=True).hidden_states[-1][0]


@torch.inference_mode()
def calibrate_ranks(model, heads, tokenizer, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                    max_new_tokens: int = 128, max_rank: int = 10) -> torch.Tensor:
    """Ranks [T, K] of the backbone's own greedy continuation in each head's top-``max_rank`` (max_rank = absent)."""
    lm_head = model.get_output_embeddings()
    rows = []
    for ids, seq, hidden in continuations(model, tokenizer, prompts, max_new_tokens):
        start = ids.shape[1] - 1  # first position whose next token is generated
        logits = heads(hidden[start:], lm_head)  # [K, T', V]
        top = logits.topk(max_rank, dim=-1).indices  # [K, T', R]
        num_heads, length = top.shape[0], top.shape[1]
        for t in range(length):
            pos = start + t
            row = []
            for k in range(1, num_heads + 1):
                target = pos + k + 1  # head k at position t targets t+k+1
                if target >= seq.numel():
                    row.append(max_rank)
                    continue
                hit = (top[k - 1, t] == seq[target]).nonzero()
                row.append(int(hit[0, 0]) if hit.numel() else max_rank)
            rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def measure_overhead(model, heads, tokenizer, tree: Tree) -> float:
    """Seconds per speculative step spent outside the verify forward (propose, accept, commit, loop)."""
    return measure_overheads(model, heads, tokenizer, {0: tree})[0]


def measure_overheads(model, heads, tokenizer, trees: dict, repeats: int = 3) -> dict:
    """``measure_overhead`` of several trees (any key -> a tree or dynamic-tree config): short generations run
    interleaved, ``repeats`` rounds over all trees, the median per tree kept, so a shared machine's load drifting
    during calibration weighs on every tree alike instead of on whichever was measured then."""
    from .generator import SpeculativeGenerator

    gens = {key: SpeculativeGenerator(model, heads, tokenizer=tokenizer, tree=tree, strict_identity=False)
            for key, tree in trees.items()}
    samples: dict = {key: [] for key in trees}
    for _ in range(repeats):
        for key, gen in gens.items():
            s = gen.generate([{"role": "user", "content": CALIBRATION_PROMPTS[0]}], max_new_tokens=48).stats
            samples[key].append(max(s.decode_seconds - s.phase_seconds["verify"], 0.0) / max(s.steps, 1))
    return {key: statistics.median(values) for key, values in samples.items()}


@dataclass
class VerifyLatency:
    """Verify latency per node count at a few cache lengths: attention over the cache makes each extra node dearer in
    a long context (SmolLM2 bf16 on 2 cores: ~0.8 ms a node over 256 cached tokens, ~1.5 ms over 1,500)."""

    tables: dict[int, dict[int, float]]  # cached tokens -> {nodes: seconds} (fitted: never decreasing in nodes)

    def at(self, prefix_len: int) -> dict[int, float]:
        """The table for a cache of ``prefix_len`` tokens: linear in the cache length between the measured lengths,
        extended along the last segment past the longest, and the shortest's table below it."""
        lengths = sorted(self.tables)
        if prefix_len <= lengths[0] or len(lengths) == 1:
            return self.tables[lengths[0]]
        hi = next((length for length in lengths if length >= prefix_len), lengths[-1])
        lo = lengths[lengths.index(hi) - 1]
        w = (prefix_len - lo) / (hi - lo)
        table, floor = {}, 0.0
        for n in sorted(self.tables[lo]):
            floor = max(floor, (1 - w) * self.tables[lo][n] + w * self.tables[hi][n])
            table[n] = floor
        return table


def cached_latency(model, cache_root: Path | None = None, refresh: bool = False,
                   prefix_lens: Sequence[int] = (256, 1024)) -> VerifyLatency:
    """The fitted verify latency (``fit_latency`` of the median ``measure_latency``) of this backbone on this machine
    at a few cache lengths, measured once and cached (~20 s on a 2-core CPU)."""
    from tokenmaxx.heads import backbone_identity

    machine = machine_fingerprint(model)
    shape = {k: getattr(model.config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                          "vocab_size", "intermediate_size")}
    key = hashlib.sha256(json.dumps([backbone_identity(model), shape, machine, "latency", list(prefix_lens),
                                     CALIBRATION_VERSION, "median"], sort_keys=True, default=str).encode()
                         ).hexdigest()[:24]
    path = _cache_path(f"latency-{key}", cache_root)
    if path.is_file() and not refresh:
        record = json.loads(path.read_text())
        return VerifyLatency({int(p): {int(n): s for n, s in table.items()} for p, table in record["tables"].items()})
    context = getattr(model.config, "max_position_embeddings", None) or max(prefix_lens) + max(LATENCY_SIZES)
    lengths = sorted({max(1, min(p, context - max(LATENCY_SIZES))) for p in prefix_lens})
    # the median, not the best case: in the decode loop a multi-token forward runs ~15 ms over a single token's at the
    # median (SmolLM2 bf16, 2 shared cores) while the minima differ by ~4 ms; sized on minima, hybrid trees came out
    # too big (held-out summarization 1.53x with minima vs 1.76x with medians, one interleaved run)
    measured = {p: measure_latency(model, prefix_len=p, statistic="median") for p in lengths}
    tables = {p: fit_latency(m) for p, m in measured.items()}
    _write_record(path, {"tables": tables, "measured": measured, "machine": machine})
    return VerifyLatency(tables)


# ---- caching ------------------------------------------------------------------------------------------------------
def _cache_path(key: str, cache_root: Path | None) -> Path:
    """Where a calibration record lives: CACHE/calibration/KEY.json (``tokenmaxx.heads.cache_dir``)."""
    from tokenmaxx.heads import cache_dir

    return (cache_root or cache_dir() / "calibration") / f"{key}.json"


def _write_record(path: Path, record: dict) -> None:
    """Write a calibration record under a temp name, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def machine_fingerprint(model) -> dict:
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "dtype": str(model.get_output_embeddings().weight.dtype)}


def calibration_key(model, heads, machine: dict) -> str:
    """Cache key over backbone identity, the heads' weights and the machine fingerprint."""
    from tokenmaxx.heads import backbone_identity

    digest = hashlib.sha256()
    digest.update(json.dumps([backbone_identity(model), machine, CALIBRATION_VERSION], sort_keys=True,
                             default=str).encode())
    for name, tensor in sorted(heads.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]


def auto_tree(model, heads, tokenizer, max_nodes: int = 64, cache_root: Path | None = None,
              refresh: bool = False) -> Tree:
    """Calibrate (or read the cached calibration) and return the tree with the best expected tokens/s."""
    machine = machine_fingerprint(model)
    path = _cache_path(calibration_key(model, heads, machine), cache_root)
    if path.is_file() and not refresh:
        return Tree(json.loads(path.read_text())["tree"])
    ranks = calibrate_ranks(model, heads, tokenizer)
    measured = measure_latency(model)
    latency = fit_latency(measured)
    overhead = measure_overhead(model, heads, tokenizer, Tree([(0,)]))
    tree, table = choose_tree(ordered_paths_from_ranks(ranks), latency, overhead, max_nodes=max_nodes,
                              max_depth=heads.config.num_heads)
    _write_record(path, {"tree": [list(p) for p in tree.paths], "machine": machine, "latency": latency,
                         "measured_latency": measured, "overhead": overhead, "positions": ranks.shape[0],
                         "table": table})
    return tree


# ---- dynamic trees (sequential heads): the node budget ------------------------------------------------------------
DYNAMIC_BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)


@torch.inference_mode()
def calibrate_dynamic(model, heads, tokenizer, config, budgets: Sequence[int] = DYNAMIC_BUDGETS,
                      prompts: Sequence[str] | None = None, max_new_tokens: int = 128) -> tuple[dict, float]:
    """Expected tau of each node budget, and seconds per draft, along the backbone's own greedy continuations.

    At every position of a continuation the drafter grows one tree with the largest budget; the tree of budget n is
    its n-1 best nodes by score (what ``expand_tree`` keeps), and its accepted length is that of the deepest node in
    them whose path equals the continuation. Returns ({budget: mean tau}, mean propose seconds).
    """
    from .draft_vocab import DraftVocab
    from .dynamic_tree import MTPDrafter

    drafter = MTPDrafter(heads, model, dataclasses.replace(config, nodes=max(budgets)))
    totals = dict.fromkeys(budgets, 0.0)
    positions, propose_s = 0, 0.0
    for ids, seq, hidden in continuations(model, tokenizer, prompts or CALIBRATION_PROMPTS, max_new_tokens):
        start = ids.shape[1]
        if getattr(heads, "draft_vocab", None) is not None:  # guess over the same vocabulary as generation does
            drafter.vocab = DraftVocab.for_prompt(heads.draft_vocab, model.get_output_embeddings(), ids)
        drafter.start(hidden[:start], seq[:start], int(seq[start]))
        for t in range(start, seq.numel() - 1):  # root = seq[t]
            t0 = time.perf_counter()
            tree = drafter.propose(int(seq[t]), seq.numel() - 1 - t)
            propose_s += time.perf_counter() - t0
            depths, parents = tree.buffers.depths.tolist(), tree.buffers.parents.tolist()
            tokens, scores = tree.tokens.tolist(), tree.scores.tolist()
            correct = [True] + [False] * (len(tokens) - 1)
            for i in range(1, len(tokens)):
                correct[i] = correct[parents[i]] and tokens[i] == int(seq[t + depths[i]])
            by_score = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))
            for n in budgets:
                totals[n] += 1 + max((depths[i] for i in by_score[: n - 1] if correct[i]), default=0)
            positions += 1
            drafter.advance(hidden[t: t + 1], seq[t + 1: t + 2])
    return {n: totals[n] / max(positions, 1) for n in budgets}, propose_s / max(positions, 1)


def auto_dynamic(model, heads, tokenizer, config=None, cache_root: Path | None = None, refresh: bool = False):
    """The dynamic-tree node budget with the best expected tokens/s on this machine (cached like ``auto_tree``):
    argmax over budgets n of tau(n) / (verify latency(n) + overhead(n)), where tau(n) comes from drafting along the
    backbone's own continuations and overhead(n) (drafting, acceptance, cache commit) from a short generation with
    budget n."""
    from .dynamic_tree import DynamicTreeConfig

    config = config or DynamicTreeConfig()
    machine = machine_fingerprint(model)
    key = calibration_key(model, heads, {**machine, "dynamic": [config.topk, config.depth, config.min_mass]})
    path = _cache_path(key, cache_root)
    if path.is_file() and not refresh:
        return DynamicTreeConfig(**json.loads(path.read_text())["dynamic_tree"])
    taus, propose_s = calibrate_dynamic(model, heads, tokenizer, config)
    measured = measure_latency(model, sizes=sorted(set(LATENCY_SIZES) | set(taus)))
    latency = fit_latency(measured)
    # drafting cost grows with the budget (more levels survive the pruning): measure the overhead of each one, and
    # keep the curve never decreasing, as the latency's (a larger budget never drafts less; dips are noise)
    measured_loop = measure_overheads(model, heads, tokenizer,
                                      {n: dataclasses.replace(config, nodes=n) for n in taus})
    sizes = sorted(measured_loop)
    loop = dict(zip(sizes, itertools.accumulate((measured_loop[n] for n in sizes), max)))
    table = [{"nodes": n, "expected_tau": tau, "step_seconds": latency[n] + loop[n],
              "tokens_per_s": tau / (latency[n] + loop[n])} for n, tau in sorted(taus.items())]
    best = max(table, key=lambda row: row["tokens_per_s"])
    chosen = dataclasses.replace(config, nodes=best["nodes"])
    _write_record(path, {"dynamic_tree": dataclasses.asdict(chosen),
                         "machine": machine, "latency": latency, "measured_latency": measured, "overhead": loop,
                         "measured_overhead": measured_loop, "propose_seconds": propose_s, "table": table})
    return chosen
