"""``tree="auto"``: the heads' tree settings with the best expected tokens/s on this machine, measured once and cached.

    expected tokens/s = E[tau](settings) / (verify latency(nodes) + overhead(settings))

Dynamic trees (EAGLE-3 and MTP heads, the sequential kinds): E[tau] of each node budget from drafting along the
backbone's own greedy continuations of generic calibration prompts (``calibrate_dynamic``). Static trees (Medusa
heads): E[tau] from the ranks of those continuations in each head's top-k (``calibrate_ranks``), the tree from
``tree_search.choose_tree``. Latency from ``latency.py``, the loop's own overhead from short generations
(``measure_overheads``); records cached by ``store``. ``resolve_auto`` picks the calibration that fits the settings
type of the heads' kind.

Calibrating takes minutes on a CPU: it shows progress bars on stderr, then one line says what was chosen
and why (``describe_choice``: the expected tokens/s against a 1-node tree's, i.e. no drafting); a cached choice says
which file it was read from. ``tree="auto:prompts=N,tokens=T"`` (``Calibration``) calibrates on less text (sooner,
noisier).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from tokenmaxx.heads import DynamicTreeConfig, Tree
from tokenmaxx.heads.attention import shared_kv_kwargs
from tokenmaxx.heads.modeling import backbone_features

from ..decoding import accept_greedy
from ..loop import decode, eos_ids, greedy_root
from ..runner import Plan, Runner, plan_record
from .latency import cached_latency, drafts_along
from .store import cache_path, calibration_key, machine_fingerprint, write_record
from .tree_search import choose_tree, ordered_paths_from_ranks

CALIBRATION_PREFIX = 256  # cached tokens the calibration's verify latency is read at (``verify_latency``)

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


@dataclasses.dataclass(frozen=True)
class Calibration:
    """How much text ``tree="auto"`` calibrates on: the first ``prompts`` of ``CALIBRATION_PROMPTS`` (None: all),
    each continued greedily for ``tokens`` tokens; the decode loop's overhead is timed on generations of
    ``min(tokens, 48)`` tokens. Less text calibrates sooner and chooses on noisier estimates; the size is part of the
    cache key."""

    prompts: int | None = None
    tokens: int = 128

    def __post_init__(self):
        for name, low, high in (("prompts", 1, len(CALIBRATION_PROMPTS)), ("tokens", 8, 4096)):
            value = getattr(self, name)
            if name == "prompts" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"tree='auto' calibration: {name} must be an integer in [{low}, {high}], "
                                 f"got {value!r}")

    @property
    def texts(self) -> tuple[str, ...]:
        return CALIBRATION_PROMPTS[: self.prompts]

    @property
    def key(self) -> list[int]:
        """What the cache key holds: the number of prompts and tokens (the prompts themselves are fixed)."""
        return [len(self.texts), self.tokens]

    @property
    def loop_tokens(self) -> int:
        return min(self.tokens, LOOP_TIMING_TOKENS)

    @classmethod
    def parse(cls, tree) -> "Calibration | None":
        """The calibration a tree setting asks for: "auto" -> the default size, "auto:prompts=N,tokens=T" (either
        key optional) -> that size, a Calibration -> itself; any other setting -> None (not tree="auto")."""
        if isinstance(tree, cls):
            return tree
        if not isinstance(tree, str) or not (tree == "auto" or tree.startswith("auto:")):
            return None
        spec = tree.removeprefix("auto").removeprefix(":")
        values = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, eq, value = item.partition("=")
            name = name.strip()
            if not eq or name not in ("prompts", "tokens") or name in values:
                raise ValueError(f"tree={tree!r}: expected 'auto' or 'auto:prompts=N,tokens=T' (each key at most "
                                 f"once), got {item!r}")
            try:
                values[name] = int(value)
            except ValueError:
                raise ValueError(f"tree={tree!r}: {name} must be an integer, got {value.strip()!r}") from None
        return cls(**values)


LOOP_TIMING_TOKENS = 48  # tokens of each short generation that times the decode loop's overhead


def is_auto(tree) -> bool:
    """Whether a tree setting asks ``tree="auto"`` to choose (``Calibration.parse``; malformed "auto:..." raises)."""
    return Calibration.parse(tree) is not None


def continuations(model, tokenizer, prompts: Sequence[str], max_new_tokens: int,
                  feature_layers: Sequence[int] | None = None):
    """Per calibration prompt: its chat input_ids [1, P], the backbone's greedy continuation seq [T] (prompt
    included) and the states the heads read along it [T, F] (``backbone_features`` of ``feature_layers``: the
    final-normed last state by default), all on the backbone's device."""
    device = model.get_output_embeddings().weight.device
    for text in tqdm(prompts, desc="tree='auto': calibrating on prompts", unit="prompt", leave=False,
                     file=sys.stderr):
        ids = _chat_ids(tokenizer, text, device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)  # [1, T]
        yield ids, seq[0], backbone_features(model(seq, output_hidden_states=True).hidden_states, feature_layers)[0]


@torch.inference_mode()
def calibrate_ranks(model, heads, tokenizer, prompts: Sequence[str] | None = None,
                    max_new_tokens: int = 128, max_rank: int = 10) -> torch.Tensor:
    """Ranks [T, K] of the backbone's own greedy continuation in each head's top-``max_rank`` (max_rank = absent)."""
    lm_head = model.get_output_embeddings()
    rows = []
    for ids, seq, hidden in continuations(model, tokenizer, prompts or CALIBRATION_PROMPTS, max_new_tokens):
        start = ids.shape[1] - 1  # first position whose next token is generated
        top = heads.draft_logits(hidden[start:], lm_head).topk(max_rank, dim=-1).indices  # [K, T', R]
        k, t = (torch.arange(n, device=top.device) for n in top.shape[:2])
        targets = start + t + k[:, None] + 2  # [K, T']: head k+1 at position start+t targets start+t+k+2
        hits = (top == seq[targets.clamp(max=seq.numel() - 1)][..., None]) & (targets < seq.numel())[..., None]
        rows.append(torch.where(hits.any(-1), hits.int().argmax(-1), max_rank).T)  # [T', K]
    return torch.cat(rows).cpu()  # Python-side: the tree search reads it


def measure_overheads(model, heads, tokenizer, trees: dict, repeats: int = 3,
                      max_new_tokens: int = LOOP_TIMING_TOKENS) -> dict:
    """Seconds per speculative step spent outside the verify forward (propose, accept, commit, loop) of several tree
    settings (any key -> settings of the heads' kind): short generations drafted by the heads alone run interleaved,
    ``repeats`` rounds over all settings, the median per setting kept, so a shared machine's load drifting during
    calibration weighs on every setting alike instead of on whichever was measured then."""
    ids = _chat_ids(tokenizer, CALIBRATION_PROMPTS[0], model.get_output_embeddings().weight.device)
    eos = eos_ids(model.generation_config)
    runner = Runner(attention=shared_kv_kwargs(model))
    samples: dict = {key: [] for key in trees}
    rounds = [(key, tree) for _ in range(repeats) for key, tree in trees.items()]
    for key, tree in tqdm(rounds, desc="tree='auto': timing the decode loop", unit="run", leave=False,
                          file=sys.stderr):
        _, stats = decode(model, [heads.drafter(model, tree)], ids, max_new_tokens, accept_greedy, greedy_root, eos,
                          runner=runner, timed=True)
        s = stats.rows[0]
        samples[key].append(max(s.decode_seconds - s.phase_seconds["verify"], 0.0) / max(s.steps, 1))
    return {key: statistics.median(values) for key, values in samples.items()}


def verify_latency(model, small_rows: Plan = 0, cache_root: Path | None = None,
                   refresh: bool = False) -> dict[int, float]:
    """The verify latency the trees are weighed with: this machine's cached table (``latency.cached_latency``, the
    one the generator's per-round node budget reads, measured once per backbone, machine and small-row plan) at a
    cache of ``CALIBRATION_PREFIX`` tokens, about the calibration continuations' length. One table for both choices,
    and medians, not minima: sized on best-case timings, trees came out too big (``cached_latency``). ``refresh``
    measures it again (and the generator then reads the new table too)."""
    return cached_latency(model, cache_root, refresh, small_rows=small_rows).at(CALIBRATION_PREFIX)


def auto_tree(model, heads, tokenizer, max_nodes: int = 64, cache_root: Path | None = None,
              refresh: bool = False, small_rows: Plan = 0, calibration: Calibration = Calibration()) -> Tree:
    """Calibrate (or read the cached calibration) and return the tree with the best expected tokens/s. ``small_rows``:
    the verifies' small-row plan (``small_rows.cached_small_rows``): the latency is measured as they will run.
    ``calibration``: how much text to calibrate on."""
    machine = _machine(model, small_rows, calibration)
    path = cache_path(calibration_key(model, heads, machine), cache_root)
    if path.is_file() and not refresh:
        record = json.loads(path.read_text())
        tree = Tree(record["tree"])
        _say(f"read from cache {path}: " + describe_choice(record["table"], tree.num_nodes, record["table"][0]))
        return tree
    start = time.perf_counter()
    ranks = calibrate_ranks(model, heads, tokenizer, calibration.texts, calibration.tokens)
    latency = verify_latency(model, small_rows, cache_root, refresh)
    overhead = measure_overheads(model, heads, tokenizer, {1: Tree([(0,)])}, max_new_tokens=calibration.loop_tokens)[1]
    tree, table = choose_tree(ordered_paths_from_ranks(ranks), latency, overhead, max_nodes=max_nodes,
                              max_depth=heads.config.num_heads)
    write_record(path, {"tree": [list(p) for p in tree.paths], "machine": machine, "latency": latency,
                         "latency_prefix": CALIBRATION_PREFIX, "overhead": overhead, "positions": ranks.shape[0],
                         "table": table})
    _say(describe_choice(table, tree.num_nodes, table[0])
         + f" (calibrated in {time.perf_counter() - start:.0f} s, cached in {path})")
    return tree


# ---- dynamic trees (sequential heads): the node budget ------------------------------------------------------------
DYNAMIC_BUDGETS = (4, 8, 12, 16, 24, 32, 48, 64)
# a budget's decode loop is timed when its bound (tau / verify latency) reaches this share of the tokens/s of the budget
# timed first: the margin covers the noise of that first, single timing
TIMING_MARGIN = 0.9


@torch.inference_mode()
def calibrate_dynamic(model, heads, tokenizer, config, budgets: Sequence[int] = DYNAMIC_BUDGETS,
                      prompts: Sequence[str] | None = None, max_new_tokens: int = 128) -> tuple[dict, float]:
    """Expected tau of each node budget, and seconds per draft, along the backbone's own greedy continuations.

    At every position of a continuation the drafter grows one tree with the largest budget; the tree of budget n is
    its n-1 best nodes by score (what ``tree_growth`` keeps), and its accepted length is that of the deepest node in
    them whose path equals the continuation. Returns ({budget: mean tau}, mean propose seconds).
    """
    drafter = heads.drafter(model, tree=dataclasses.replace(config, nodes=max(budgets)))
    totals = dict.fromkeys(budgets, 0.0)
    positions, propose_s = 0, 0.0
    for ids, seq, hidden in continuations(model, tokenizer, prompts or CALIBRATION_PROMPTS, max_new_tokens,
                                          drafter.feature_layers):
        # the drafter guesses over the same vocabulary as in generation (the draft vocabulary + this prompt's tokens)
        for t, tree, seconds in drafts_along(drafter, seq, hidden, ids.shape[1]):  # root = seq[t]
            propose_s += seconds
            depths, parents = tree.buffers.depths.tolist(), tree.buffers.parents.tolist()
            tokens, scores = tree.tokens.tolist(), tree.values.tolist()  # values: exp(cumulative draft log-prob)
            correct = [True] + [False] * (len(tokens) - 1)
            for i in range(1, len(tokens)):
                correct[i] = correct[parents[i]] and tokens[i] == int(seq[t + depths[i]])
            by_score = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))
            for n in budgets:
                totals[n] += 1 + max((depths[i] for i in by_score[: n - 1] if correct[i]), default=0)
            positions += 1
    return {n: totals[n] / max(positions, 1) for n in budgets}, propose_s / max(positions, 1)


def auto_dynamic(model, heads, tokenizer, config=None, cache_root: Path | None = None, refresh: bool = False,
                 small_rows: Plan = 0, calibration: Calibration = Calibration()):
    """The dynamic-tree node budget with the best expected tokens/s on this machine (cached like ``auto_tree``):
    argmax over budgets n of tau(n) / (verify latency(n) + overhead(n)), where tau(n) comes from drafting along the
    backbone's own continuations and overhead(n) (drafting, acceptance, cache commit) from short generations with
    budget n (``timed_overheads``: only of the budgets that can still win). ``small_rows``, ``calibration``: as in
    ``auto_tree``."""
    config = config or DynamicTreeConfig()
    machine = _machine(model, small_rows, calibration)
    key = calibration_key(model, heads, {**machine, "dynamic": [config.topk, config.depth, config.min_mass]})
    path = cache_path(key, cache_root)
    if path.is_file() and not refresh:
        record = json.loads(path.read_text())
        chosen = DynamicTreeConfig(**record["dynamic_tree"])
        _say(f"read from cache {path}: " + describe_choice(record["table"], chosen.nodes,
                                                            _plain_row(record["latency"]["1"]), "dynamic tree"))
        return chosen
    start = time.perf_counter()
    taus, propose_s = calibrate_dynamic(model, heads, tokenizer, config, prompts=calibration.texts,
                                        max_new_tokens=calibration.tokens)
    latency = verify_latency(model, small_rows, cache_root, refresh)
    # drafting cost grows with the budget (more levels survive the pruning): keep the overhead curve never decreasing,
    # as the latency's (a larger budget never drafts less; dips are noise)
    measured_loop, untimed = timed_overheads(model, heads, tokenizer, config, taus, latency,
                                             max_new_tokens=calibration.loop_tokens)
    sizes = sorted(measured_loop)
    loop = dict(zip(sizes, itertools.accumulate((measured_loop[n] for n in sizes), max)))
    table = [{"nodes": n, "expected_tau": taus[n], "step_seconds": latency[n] + loop[n],
              "tokens_per_s": taus[n] / (latency[n] + loop[n])} for n in sizes]
    best = max(table, key=lambda row: row["tokens_per_s"])
    chosen = dataclasses.replace(config, nodes=best["nodes"])
    write_record(path, {"dynamic_tree": dataclasses.asdict(chosen),
                         "machine": machine, "latency": latency, "latency_prefix": CALIBRATION_PREFIX, "overhead": loop,
                         "measured_overhead": measured_loop, "propose_seconds": propose_s, "table": table,
                         "untimed": untimed})
    skipped = f"; {len(untimed)} of {len(taus)} budgets could not win and were not timed" if untimed else ""
    _say(describe_choice(table, chosen.nodes, _plain_row(latency[1]), "dynamic tree")
         + f" (calibrated in {time.perf_counter() - start:.0f} s{skipped}, cached in {path})")
    return chosen


def timed_overheads(model, heads, tokenizer, config, taus: dict, latency: dict, margin: float = TIMING_MARGIN,
                    max_new_tokens: int = LOOP_TIMING_TOKENS) -> tuple[dict, list[dict]]:
    """The decode loop's overhead of the budgets that can still be chosen, and the rows of those that cannot.

    Timing a budget runs short generations, and on a slow CPU their verify forwards of up to 64 tokens cost most of a
    calibration. Since an overhead is never negative, tau(n) / latency(n) bounds the tokens/s budget n can reach: the
    budget with the best bound is timed first (once), and only the budgets whose bound reaches ``margin`` times its
    tokens/s are then timed (interleaved, as ``measure_overheads`` does). Returns ({budget: overhead seconds} of the
    timed budgets, [{nodes, expected_tau, bound_tokens_per_s}] of the others)."""
    bound = {n: tau / latency[n] for n, tau in taus.items()}
    first = max(bound, key=bound.get)
    settings = {n: dataclasses.replace(config, nodes=n) for n in taus}
    first_loop = measure_overheads(model, heads, tokenizer, {first: settings[first]}, repeats=1,
                                   max_new_tokens=max_new_tokens)[first]
    reach = taus[first] / (latency[first] + first_loop)
    timed = [n for n in sorted(taus) if bound[n] >= margin * reach]
    untimed = [{"nodes": n, "expected_tau": taus[n], "bound_tokens_per_s": bound[n]} for n in sorted(taus)
               if n not in timed]
    return measure_overheads(model, heads, tokenizer, {n: settings[n] for n in timed},
                             max_new_tokens=max_new_tokens), untimed


# ---- what tree="auto" says ------------------------------------------------------------------------------------------
def describe_choice(table: list[dict], nodes: int, plain: dict, what: str = "tree") -> str:
    """One line on the choice and why: the chosen size's expected tokens/s against ``plain``'s, the row of a 1-node
    tree (no drafting: the backbone's next token only). A 1-node choice says drafting is off, with the best drafted
    tree's numbers. ``table``: rows {nodes, expected_tau, step_seconds, tokens_per_s} of the sizes considered."""
    baseline = f"{plain['tokens_per_s']:.1f} tok/s with 1 node ({plain['step_seconds'] * 1e3:.1f} ms a step)"
    drafted = [row for row in table if row["nodes"] > 1]
    if nodes == 1:
        best = max(drafted, key=lambda row: row["tokens_per_s"], default=None)
        why = (f"the best drafted tree ({best['nodes']} nodes) expects {best['tokens_per_s']:.1f} tok/s (tau "
               f"{best['expected_tau']:.2f}, {best['step_seconds'] * 1e3:.1f} ms a step)" if best is not None else
               "the heads' guesses were never right in calibration")
        return (f"drafting disabled (1-node tree): no tree beat plain decoding on this machine's measured latency: "
                f"{why} vs {baseline}")
    row = next(row for row in table if row["nodes"] == nodes)
    note = "; slower than plain decoding on this machine's measured latency" \
        if row["tokens_per_s"] < plain["tokens_per_s"] else ""
    return (f"chose a {what} of {nodes} nodes: {row['tokens_per_s']:.1f} tok/s expected (tau "
            f"{row['expected_tau']:.2f}, {row['step_seconds'] * 1e3:.1f} ms a step) vs {baseline}{note}")


def _plain_row(latency_1: float) -> dict:
    """The table row of plain decoding: one backbone token per one-token forward."""
    return {"nodes": 1, "expected_tau": 1.0, "step_seconds": latency_1, "tokens_per_s": 1.0 / latency_1}


def _say(message: str) -> None:
    print(f"tree='auto': {message}", file=sys.stderr)


# ---- tree="auto": the calibration that fits the heads' kind ---------------------------------------------------------
def resolve_auto(model, heads, tokenizer, small_rows: Plan = 0, calibration: Calibration = Calibration(),
                 settings=None):
    """The heads' tree settings chosen for this machine (calibrated once, then read from the cache); ``small_rows``:
    the verifies' small-row plan (``small_rows.cached_small_rows``); ``calibration``: how much text to calibrate on;
    ``settings``: the heads' own tree settings, parsed (None: their config's), whose type says what to calibrate."""
    if tokenizer is None:
        raise ValueError("tree='auto' calibrates on chat prompts: it needs the tokenizer")
    own = settings if settings is not None else heads.tree_settings(heads.config)
    if isinstance(own, Tree):
        return auto_tree(model, heads, tokenizer, small_rows=small_rows, calibration=calibration)
    if isinstance(own, DynamicTreeConfig):
        return auto_dynamic(model, heads, tokenizer, own, small_rows=small_rows, calibration=calibration)
    raise ValueError(f"tree='auto' cannot calibrate tree settings of type {type(own).__name__} "
                     f"(heads of kind {heads.config.kind!r})")


def _machine(model, small_rows: Plan, calibration: Calibration) -> dict:
    """What a calibration record is keyed by besides the backbone and heads: the machine, the verifies' small-row plan
    (the latency is measured as they will run) and the calibration's size."""
    machine = machine_fingerprint(model)
    if small_rows:
        machine = {**machine, "small_rows": plan_record(small_rows)}
    return {**machine, "calibration": calibration.key}


def _chat_ids(tokenizer, text: str, device: torch.device) -> torch.Tensor:
    """input_ids [1, P] on ``device`` of one user message through the chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True, return_tensors="pt")["input_ids"].to(device)
