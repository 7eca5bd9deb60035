"""Benchmark speculative generation against plain generate and transformers' peers, in one interleaved run.

Every method runs on the same backbone, dtype, threads and prompts; per prompt the methods run one after another
(rotating their order), after a warm-up. tau is tokens per backbone forward for every method (the prefill counts as a
forward that yields one token), counted by a forward hook on the backbone, so peers and tokenmaxx are comparable.

Two baselines: ``baseline`` is plain eager ``generate``; ``compiled`` (``compiled_method``, opt-in) is ``generate``
with transformers' static KV cache and its decode step through ``torch.compile``, what a speed-minded user runs on a
GPU. ``speedup`` is over the first; with a compiled method in the run, ``speedup_compiled`` is over it.

Output JSON shape (fixed): ``{"config", "machine", "methods": {name: {"overall": S, "categories": {cat: S}}}}`` with
``S = {"tokens", "seconds", "tokens_per_s", "speedup", "tau", "identical_rate", "prompts"}``; with a compiled method,
every S adds ``speedup_compiled``; tokenmaxx methods add ``accepted_share`` (accepted candidates per draft source),
``heads_round_share`` (rounds in which the heads proposed: the gate sits them out of the others) and, where the
rounds were timed, ``ms_per_round`` (mean milliseconds of each decode phase). Per-prompt rows (``prompt_rows``) go to
a separate jsonl, so that shape stays fixed. A run stopped early (``run_benchmark``'s deadline) is summarized over the
prompts it finished.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tokenmaxx.heads.machine import clock

COMPILED = "compiled"  # the method name (optionally compiled:BACKEND) of the compiled static-cache baseline
MT_BENCH_KINDS = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass
class Prompt:
    question_id: int | str
    category: str  # the column it is reported under
    input_ids: torch.Tensor  # [1, T]
    written: str | None = None  # the category its row names, where a grouping changed it (None: ``category``)

    def __post_init__(self):
        self.written = self.written or self.category


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forwards: int
    drafting: dict | None = None  # tokenmaxx: the generation's rounds, heads' rounds, phase seconds, accepted sources


@dataclass
class MethodResult:
    runs: dict[int, Run] = field(default_factory=dict)  # prompt index -> run
    warmup_seconds: float = 0.0  # its untimed warm-up (where a compiled or captured method compiles)


def load_prompts(path: str | Path, tokenizer, limit: int | None = None, group_mt_bench: bool = False) -> list[Prompt]:
    """Spec-Bench-style jsonl (question_id, category, turns): first turn through the chat template, each prompt under
    the category its row names ("all" where none), at most ``limit`` per category. ``group_mt_bench``: Spec-Bench's
    own grouping, its eight MT-bench categories (``MT_BENCH_KINDS``: writing, roleplay, ...) as one ``mt_bench``
    category, the limit applied to the group (``selection_note`` says what it kept of each)."""
    prompts, per_cat = [], {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "turns" not in row or not row["turns"]:
                raise ValueError(f"{path}:{line_no}: expected a Spec-Bench record with non-empty 'turns'")
            written = str(row.get("category", "all"))
            cat = "mt_bench" if group_mt_bench and written in MT_BENCH_KINDS else written
            if limit is not None and per_cat.get(cat, 0) >= limit:
                continue
            per_cat[cat] = per_cat.get(cat, 0) + 1
            ids = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                                add_generation_prompt=True, return_dict=True,
                                                return_tensors="pt")["input_ids"]
            prompts.append(Prompt(row.get("question_id", line_no), cat, ids, written))
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def selection_note(prompts: list[Prompt]) -> str:
    """What a bench runs, per category: "13 prompts: qa 1, mt_bench 2 (math 1, writing 1)"; a category that groups
    several written ones names how many it kept of each."""
    by_category: dict[str, dict[str, int]] = {}
    for prompt in prompts:
        kept = by_category.setdefault(prompt.category, {})
        kept[prompt.written] = kept.get(prompt.written, 0) + 1
    parts = [f"{cat} {sum(kept.values())}" + ("" if list(kept) == [cat] else
                                               " (" + ", ".join(f"{w} {n}" for w, n in sorted(kept.items())) + ")")
             for cat, kept in by_category.items()]
    return f"{len(prompts)} prompts: " + ", ".join(parts)


def interleave_categories(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts taken one category at a time in turn (each category's in their order): a run stopped early has
    covered every category about equally."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    queues = list(by_category.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


class ForwardCounter:
    """Counts calls of a module's forward (the backbone's), as a context manager."""

    def __init__(self, module):
        self.module, self.count, self.handle = module, 0, None

    def _hook(self, *_):
        self.count += 1

    def __enter__(self):
        self.count = 0
        self.handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def hf_method(model, **generate_kwargs) -> Callable[[torch.Tensor, int], tuple[list[int], None]]:
    """A method that calls model.generate greedily with extra kwargs (prompt lookup, assistant model)."""

    def run(input_ids, max_new_tokens):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **generate_kwargs)
        return out[0, input_ids.shape[1]:].tolist(), None

    return run


def compiled_method(model, max_cache_len: int, backend: str = "inductor") -> Callable[[torch.Tensor, int],
                                                                                      tuple[list[int], None]]:
    """Plain greedy ``generate`` as a speed-minded user runs it (gpt-fast's lever): transformers' static KV cache of
    ``max_cache_len`` positions for every call (one size, so the decode step compiles once; transformers keeps the
    largest size it was asked for) and the decode step through ``torch.compile`` (``CompileConfig``: inductor in
    "reduce-overhead" mode, CUDA graphs on a GPU). The first call compiles: run it in the warm-up. ``backend="eager"``
    traces the step without generating code (seconds, for tests and the CPU dry run)."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else "default")
    config._compile_all_devices = True  # transformers compiles by itself on a GPU; on a CPU it must be asked
    return hf_method(model, cache_implementation="static", max_cache_len=max_cache_len, compile_config=config)


def tokenmaxx_method(generator, record=None) -> Callable[[torch.Tensor, int], tuple[list[int], dict]]:
    """A benchmark method of ``generator`` (``record``: a folder every generation's traffic is recorded into)."""
    def run(input_ids, max_new_tokens):
        out = generator.generate(input_ids, max_new_tokens=max_new_tokens, record=record)
        stats = out.stats
        heads_rounds = 0 if generator.draft == "lookup" else stats.steps - stats.heads_skipped
        return out.new_tokens, {"sources": dict(stats.accepted_by_source), "rounds": stats.steps,
                                "heads_rounds": heads_rounds,
                                "phase_seconds": dict(stats.phase_seconds) if stats.phase_seconds is not None else None}

    return run


def run_benchmark(model, methods: dict[str, Callable], prompts: list[Prompt], max_new_tokens: int,
                  warmup: int = 2, progress: bool = True, after_prompt: Callable[[dict, int], None] | None = None,
                  deadline: float | None = None) -> dict[str, MethodResult]:
    """Interleaved per prompt, rotating the method order; ``baseline`` must be one of the methods. Prompts go to the
    backbone's device before the clock starts, and the clock waits for the device (``heads.machine.clock``).

    ``after_prompt(results, done)``: called after each method's warm-up and after the warm-up (``done`` 0), and once
    every method has run prompt ``done - 1`` (bench.py saves its report there, so a run killed later keeps what it
    finished). ``deadline`` (a ``time.perf_counter()`` value): no warm-up and no prompt is started after it, nor a
    prompt that would end after it, judged by the last prompt's time; the results then hold the prompts before it."""
    from tqdm.auto import tqdm

    if "baseline" not in methods:
        raise ValueError("the methods must include 'baseline' (speedups are relative to it)")
    names = list(methods)
    device = model.get_output_embeddings().weight.device
    results = {name: MethodResult() for name in names}
    with torch.inference_mode():
        for prompt in prompts[:warmup]:
            for name in names:
                if deadline is not None and time.perf_counter() > deadline:
                    break  # (no prompt will start either)
                start = clock(device)
                methods[name](prompt.input_ids.to(device), min(16, max_new_tokens))
                results[name].warmup_seconds += clock(device) - start
                if after_prompt is not None:  # each warm-up's seconds (where compiles go) saved as it ends
                    after_prompt(results, 0)
        if after_prompt is not None:  # (also when there was none, or the deadline cut it)
            after_prompt(results, 0)
        bar = tqdm(prompts, desc="bench", disable=not progress)
        last = 0.0  # seconds the last prompt took, every method
        for i, prompt in enumerate(bar):
            started = time.perf_counter()
            if deadline is not None and started + last > deadline:
                break
            order = names[i % len(names):] + names[: i % len(names)]
            input_ids = prompt.input_ids.to(device)  # [1, T]
            for name in order:
                with ForwardCounter(model) as counter:
                    start = clock(device)
                    tokens, drafting = methods[name](input_ids, max_new_tokens)
                    seconds = clock(device) - start
                results[name].runs[i] = Run(tokens, seconds, counter.count, drafting)
            last = time.perf_counter() - started
            if after_prompt is not None:
                after_prompt(results, i + 1)
    return results


def _tokens_per_s(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def _summary(runs: list[Run], base: list[Run], compiled: list[Run] | None = None) -> dict:
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    tps, base_tps = _tokens_per_s(runs), _tokens_per_s(base)
    out = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tps, 3),
           "speedup": round(tps / base_tps, 4) if base_tps else None,
           "tau": round(tokens / max(sum(r.forwards for r in runs), 1), 4),
           "identical_rate": round(sum(r.tokens == b.tokens for r, b in zip(runs, base)) / len(runs), 4),
           "prompts": len(runs)}
    if compiled is not None:  # the second baseline: compiled static-cache generate
        compiled_tps = _tokens_per_s(compiled)
        out["speedup_compiled"] = round(tps / compiled_tps, 4) if compiled_tps else None
    if runs and runs[0].drafting is not None:  # extra keys of tokenmaxx methods
        # share of accepted candidates per draft source
        totals = {k: sum(r.drafting["sources"][k] for r in runs) for k in runs[0].drafting["sources"]}
        accepted = sum(totals.values())
        out["accepted_share"] = {k: round(v / accepted, 4) if accepted else 0.0 for k, v in totals.items()}
        # how often the heads proposed (the rest: the gate sat them out, or lookup-only drafting), and the mean
        # milliseconds per round of each decode phase
        rounds = sum(r.drafting["rounds"] for r in runs)
        out["heads_round_share"] = round(sum(r.drafting["heads_rounds"] for r in runs) / rounds, 4) if rounds else 0.0
        if all(r.drafting["phase_seconds"] is not None for r in runs):  # (untimed rounds: an accelerator's default)
            out["ms_per_round"] = {k: round(1000 * sum(r.drafting["phase_seconds"][k] for r in runs) / rounds, 3)
                                   if rounds else 0.0 for k in runs[0].drafting["phase_seconds"]}
    return out


def compiled_name(names) -> str | None:
    """The run's compiled static-cache baseline (``compiled`` or ``compiled:BACKEND``), if it has one."""
    return next((n for n in names if n.partition(":")[0] == COMPILED), None)


def summarize(results: dict[str, MethodResult], prompts: list[Prompt]) -> dict:
    """Per method: overall and per category summaries (speedup and identity vs 'baseline'; speedup_compiled vs the
    compiled baseline when the run has one), over the prompts every method finished."""
    base = results["baseline"].runs
    second = compiled_name(results)
    compiled = results[second].runs if second is not None else None
    done = sorted(set.intersection(*(set(res.runs) for res in results.values())))
    cats = sorted({prompts[i].category for i in done})

    def summary(runs: dict[int, Run], idx: list[int]) -> dict:
        return _summary([runs[i] for i in idx], [base[i] for i in idx],
                        [compiled[i] for i in idx] if compiled is not None else None)

    return {name: {"overall": summary(res.runs, done),
                   "categories": {c: summary(res.runs, [i for i in done if prompts[i].category == c]) for c in cats},
                   "warmup_seconds": round(res.warmup_seconds, 3)}
            for name, res in results.items()}


def prompt_rows(results: dict[str, MethodResult], prompts: list[Prompt]) -> list[dict]:
    """One row per (prompt, method), every setting of every method, for paired comparisons that the per-category
    sums hide: question_id, category, method, tokens, seconds, forwards, tau, identical (to baseline), and
    accepted_by_source for tokenmaxx methods."""
    base = results["baseline"].runs
    rows = []
    for i, prompt in enumerate(prompts):
        if i not in base:  # not reached (a run stopped at its deadline)
            continue
        for name, res in results.items():  # run_benchmark runs every method on every prompt it reaches
            run = res.runs[i]
            row = {"question_id": prompt.question_id, "category": prompt.category, "method": name,
                   "tokens": len(run.tokens), "seconds": round(run.seconds, 4), "forwards": run.forwards,
                   "tau": round(len(run.tokens) / max(run.forwards, 1), 4), "identical": run.tokens == base[i].tokens}
            if run.drafting is not None:
                row["accepted_by_source"] = run.drafting["sources"]
                row["rounds"], row["heads_rounds"] = run.drafting["rounds"], run.drafting["heads_rounds"]
            rows.append(row)
    return rows


def machine_info(threads: int, dtype: str, device: torch.device) -> dict:
    """What ran the benchmark: host CPU (name, family/model/stepping, vector ISA, native bf16), threads, versions,
    dtype, and the device the backbone ran on by name."""
    import transformers

    from tokenmaxx.heads.machine import cpu_has_native_bf16, cpu_info, device_name

    return {**cpu_info(), "native_bf16": cpu_has_native_bf16(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "dtype": dtype,
            "platform": platform.platform(), "device": device_name(device)}


def run_batch_benchmark(model, generator, prompts: list[Prompt], batch_sizes: list[int], max_new_tokens: int,
                        repeats: int = 1, progress: bool = True, lookup_tokens: int = 10,
                        deadline: float | None = None) -> dict:
    """Batched generation against transformers' batched greedy ``generate`` on the same left-padded rows, one
    interleaved run: for each repeat and batch size B, every prompt in batches of B (the prompts in order, cycled to
    fill the last batch), both methods on each batch in turn (order alternating), and at B = 1 transformers' prompt
    lookup too (it takes one row). Every size sees every prompt, so sizes differ by their load only. After one
    warm-up of each at B = 1.

    Per size: total new tokens / s of each, the speedup, per-token latency (seconds per new token of a row: wall time
    over the mean row length), our prefill's share of our time, the mean tree a row verified per round (1:
    speculation off), the mean tau, the share of rows whose tokens equal transformers' batched rows, and the rows
    that ran. ``deadline`` (a ``time.perf_counter()`` value): no batch starts after it, and a size none of whose batches
    ran is left out."""
    from tqdm.auto import tqdm

    device = model.get_output_embeddings().weight.device
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos if isinstance(eos, int) else (eos or [0])[0]

    def batches_of(size: int) -> list[list[list[int]]]:
        count = -(-len(prompts) // size)
        return [[prompts[(b * size + i) % len(prompts)].input_ids[0].tolist() for i in range(size)]
                for b in range(count)]

    def hf(rows: list[list[int]], **kwargs) -> tuple[list[list[int]], float]:
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        start = clock(device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, **kwargs)
        seconds = clock(device) - start
        return [_until_eos(out[i, width:].tolist(), model.generation_config) for i in range(len(rows))], seconds

    def ours(rows: list[list[int]]) -> tuple[list[list[int]], float, object]:
        start = clock(device)
        out = generator.generate(rows, max_new_tokens=max_new_tokens)
        return out.new_tokens, clock(device) - start, out.stats

    sizes: dict[int, dict] = {b: {"hf_seconds": 0.0, "hf_tokens": 0, "seconds": 0.0, "tokens": 0, "forwards": 0,
                                  "nodes": 0, "tau": [], "identical": [], "row_tokens": 0, "drafting": 0,
                                  "row_rounds": 0, "prefill": 0.0} for b in batch_sizes}
    with torch.inference_mode():
        hf(batches_of(1)[0])  # warm-up
        ours(batches_of(1)[0])
        lookup = {"seconds": 0.0, "tokens": 0}
        steps = [(r, b, rows) for r in range(repeats) for b in batch_sizes for rows in batches_of(b)]
        for i, (repeat, size, rows) in enumerate(tqdm(steps, desc="batch bench", disable=not progress)):
            if deadline is not None and time.perf_counter() > deadline:
                break
            entry = sizes[size]
            first, second = ("hf", "ours") if i % 2 == 0 else ("ours", "hf")
            for which in (first, second):
                if which == "hf":
                    hf_rows, seconds = hf(rows)
                    entry["hf_seconds"] += seconds
                    entry["hf_tokens"] += sum(map(len, hf_rows))
                else:
                    our_rows, seconds, stats = ours(rows)
                    entry["seconds"] += seconds
                    entry["prefill"] += stats.prefill_seconds
                    entry["tokens"] += sum(map(len, our_rows))
                    entry["forwards"] += stats.forwards
                    entry["drafting"] += stats.drafting_forwards
                    entry["nodes"] += sum(r.verified_nodes for r in stats.rows)
                    entry["row_rounds"] += sum(r.steps for r in stats.rows)
                    entry["tau"].extend(r.mean_tau for r in stats.rows)
            entry["identical"].extend(a == b for a, b in zip(our_rows, hf_rows))
            entry["row_tokens"] += sum(map(len, our_rows)) / size
            if size == 1:
                start = clock(device)
                out = model.generate(torch.tensor(rows, device=device), max_new_tokens=max_new_tokens,
                                     do_sample=False, prompt_lookup_num_tokens=lookup_tokens,
                                     attention_mask=torch.ones(1, len(rows[0]), dtype=torch.long, device=device))
                lookup["seconds"] += clock(device) - start
                lookup["tokens"] += len(_until_eos(out[0, len(rows[0]):].tolist(), model.generation_config))
    report = {}
    for size, e in sizes.items():
        if not e["seconds"]:
            continue  # (past the deadline)
        tps, hf_tps = e["tokens"] / e["seconds"], e["hf_tokens"] / e["hf_seconds"]
        report[size] = {"tokens_per_s": round(tps, 2), "hf_tokens_per_s": round(hf_tps, 2),
                        "speedup": round(tps / hf_tps, 3),
                        "ms_per_token": round(1000 * e["seconds"] / e["row_tokens"], 2),
                        "hf_ms_per_token": round(1000 * e["hf_seconds"] / e["row_tokens"], 2),
                        "prefill_share": round(e["prefill"] / e["seconds"], 3),
                        "nodes_per_row": round(e["nodes"] / max(e["row_rounds"], 1), 2),
                        "drafting_rounds": round(e["drafting"] / max(e["forwards"], 1), 3),
                        "tau": round(sum(e["tau"]) / len(e["tau"]), 3),
                        "identical": round(sum(e["identical"]) / len(e["identical"]), 3),
                        "rows": len(e["identical"])}
        if size == 1 and lookup["seconds"]:
            report[size]["hf_prompt_lookup_tokens_per_s"] = round(lookup["tokens"] / lookup["seconds"], 2)
    return report


def _until_eos(tokens: list[int], generation_config) -> list[int]:
    """A row of transformers' batched output as its own: cut after its first EOS (the rest is padding)."""
    eos = generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    stop = next((i for i, tok in enumerate(tokens) if tok in eos), None)
    return tokens if stop is None else tokens[: stop + 1]
