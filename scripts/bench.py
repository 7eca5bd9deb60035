#!/usr/bin/env python
"""Benchmark tokenmaxx against plain generate, prompt lookup and assisted generation in one interleaved run.

    python scripts/bench.py --prompts spec_bench_dev.jsonl --limit 5 \
        --methods baseline,prompt_lookup,tokenmaxx,hybrid,lookup --out runs/bench

Writes OUT.json (config, machine, methods -> overall/categories), OUT.md (table), OUT.png (plot) and
OUT.prompts.jsonl (one row per prompt and method, every prompt-lookup setting included: for paired comparisons). All
but the plot are written again after every prompt, so a run killed midway keeps what it finished; ``--time_budget``
ends it in time by itself (config.prompt_count: the prompts done, of config.prompts_planned).
Bad input ends in one ``error: ...`` line and exit status 2; ``--debug`` (or ``TOKENMAXX_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tokenmaxx.heads import DEFAULT_BACKBONE, load_backbone, resolve_heads
from tokenmaxx.heads.io.backbones import DEVICE_HELP, resolve_device
from tokenmaxx.inference.runner import BACKENDS, CaptureFallbackWarning, capture_backend, set_capture_backend
from tokenmaxx.heads.machine import clock
from tokenmaxx.inference import DEFAULT_DRAFT, DEFAULT_DTYPE, DRAFT_MODES, Costs, SpeculativeGenerator, measure_costs
from tokenmaxx.scripts.bench_report import batch_table, markdown_table, plot, report_header
from tokenmaxx.scripts.benchmark import (COMPILED, compiled_method, hf_method, interleave_categories, load_prompts,
                                           machine_info, prompt_rows, run_batch_benchmark, run_benchmark,
                                           selection_note, summarize, tokenmaxx_method)
from tokenmaxx.inference.drafting import NEEDS_HEADS
from tokenmaxx.inference.runner import plan_record
from tokenmaxx.scripts.errors import parse_flags, run_script

TOKENMAXX_METHODS = ("tokenmaxx", "hybrid", "lookup", "medusa", "mtp", "medusa_hybrid", "mtp_hybrid")


@dataclass
class BenchArgs:
    prompts: str = field(metadata={
        "help": "Spec-Bench-style jsonl (question_id, category, turns): the benchmark prompts (required)"})
    backbone: str = field(default=DEFAULT_BACKBONE, metadata={"help": "backbone alias, folder or Hub id"})
    heads: str | None = field(default=None, metadata={
        "help": "heads of the tokenmaxx/hybrid methods: folder or Hub id (default: the shipped heads; 'untrained')"})
    medusa_heads: str | None = field(default=None, metadata={
        "help": "heads of the medusa[_hybrid] methods (default: the shipped Medusa heads)"})
    heads_as: str | None = field(default=None, metadata={
        "help": "more heads under names of their own, NAME=PATH[,NAME=PATH]: method NAME[:<tree>][@fixed] drafts as "
                "tokenmaxx does with those heads (to compare heads in one interleaved run, e.g. adapted=runs/a/heads)"})
    mtp_heads: str | None = field(default=None, metadata={
        "help": "heads of the mtp[_hybrid] methods (default: the shipped MTP heads, where some ship)"})
    dtype: str = field(default=DEFAULT_DTYPE, metadata={
        "help": "auto (bfloat16 where it is native: a GPU, a CPU with AVX-512 BF16 / AMX; else float32) | float32 | "
                "bfloat16 | float16"})
    device: str = field(default="auto", metadata={"help": DEVICE_HELP})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt"})
    methods: str = field(default="baseline,prompt_lookup,assisted,tokenmaxx,lookup", metadata={
        "help": "comma list of: baseline, compiled[:BACKEND] (opt-in second baseline: generate with transformers' "
                "static cache, its decode step through torch.compile; BACKEND default inductor, 'eager' traces without "
                "generating code; compiling takes a minute or more, on a CPU several), prompt_lookup, assisted, "
                "tokenmaxx[:<tree>] (drafted as --draft says), "
                "hybrid[:<tree>] (heads + lookup branches), lookup (our loop, lookup branches only); "
                "medusa[:<tree>], mtp[:<tree>], medusa_hybrid, mtp_hybrid (the same with heads of that kind, to "
                "compare kinds in one run); tree = default | chain:K | auto | JSON file (Medusa), dynamic[:N], "
                "dynamic:nodes=N,topk=K,depth=D,min_mass=M or auto (MTP); a method ending in @fixed verifies its "
                "whole tree every round (default: trees are cut per round to the nodes worth their verify time); "
                "@usual: verifies compute the linear layers as the model does (default: as measured fastest on this "
                "CPU for a few rows); a last @record records the method's traffic (into OUT-traffic/<method>: what "
                "recording costs)"})
    draft: str = field(default=DEFAULT_DRAFT, metadata={
        "help": "heads | lookup | hybrid: drafting of the tokenmaxx methods"})
    limit: int | None = field(default=None, metadata={
        "help": "at most this many prompts per category (each category as the file names it, or the mt_bench group "
                "with --group_mt_bench)"})
    group_mt_bench: bool = field(default=False, metadata={
        "help": "Spec-Bench's grouping: its eight MT-bench categories (writing, roleplay, reasoning, math, coding, "
                "extraction, stem, humanities) reported as one mt_bench column, --limit applied to the group; "
                "default: every category as the file names it"})
    lookup_tokens: str = field(default="3,10", metadata={
        "help": "prompt_lookup_num_tokens settings to try; the best overall is reported as prompt_lookup"})
    draft_model: str | None = field(default=None, metadata={
        "help": "draft model for 'assisted' (alias/folder); default: qwen2.5-coder-0.5b for qwen2.5-coder-1.5b"})
    warmup: int = field(default=2, metadata={"help": "prompts run (short) by every method before timing"})
    out: str = field(default="runs/bench", metadata={"help": "output path prefix (.json, .md, .png)"})
    time_budget: float | None = field(default=None, metadata={
        "help": "seconds for the whole run, loading and warm-up included: no prompt is started that would end after "
                "it (judged by the last prompt's time), and the prompts take their categories in turn, so a run cut "
                "short covers each about equally. The report says how many prompts ran"})

    capture_backend: str | None = field(default=None, metadata={
        "help": "how captured rounds (on an accelerator) compile: inductor (the default: generated kernels, the "
                "fastest rounds, the longest compiles) or cudagraphs (the eager kernels recorded, no code generated); "
                "default: TOKENMAXX_CAPTURE_BACKEND, else inductor"})

    batch_sizes: str | None = field(default=None, metadata={
        "help": "comma list of batch sizes (e.g. 1,2,4,8,16): instead of the per-prompt methods, batched "
                "generation (--draft drafting, the shipped or --heads heads) against transformers' batched greedy "
                "generate on the same left-padded rows, interleaved; prompt lookup at batch 1"})
    repeats: int = field(default=2, metadata={"help": "--batch_sizes: rounds over the sizes"})

    def __post_init__(self):
        resolve_device(self.device)  # refuses a device this machine does not have
        if self.batch_sizes is not None:
            try:
                sizes = [int(x) for x in self.batch_sizes.split(",")]
            except ValueError:
                sizes = []
            if not sizes or min(sizes) < 1:
                raise ValueError(f"--batch_sizes {self.batch_sizes!r}: expected positive integers such as 1,2,4,8,16")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be positive, got {self.repeats}")
        if self.max_new_tokens <= 0 or self.threads <= 0:
            raise ValueError("--max_new_tokens and --threads must be positive")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--time_budget must be positive, got {self.time_budget}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"--limit must be positive, got {self.limit}")
        if not Path(self.prompts).is_file():
            raise ValueError(f"--prompts {self.prompts}: no such file (a Spec-Bench-style .jsonl of prompts)")
        if self.capture_backend is not None and self.capture_backend not in BACKENDS:
            raise ValueError(f"unknown --capture_backend {self.capture_backend!r}: expected one of "
                             f"{', '.join(BACKENDS)}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"unknown --draft {self.draft!r}: expected one of {', '.join(DRAFT_MODES)}")
        named_heads(self.heads_as)  # refuses a malformed list before anything loads


def split_methods(spec: str) -> list[str]:
    """The comma list of --methods; a part like 'min_mass=0' (a key=value with no ':') continues the dynamic tree
    spec before it, so 'mtp:dynamic:nodes=8,min_mass=0,medusa' is two methods."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if "=" in part and ":" not in part and names:
            names[-1] += "," + part
        elif part:
            names.append(part)
    return names


def tree_note(settings) -> dict | list | None:
    """The tree a method drafts, as JSON: a dynamic tree's settings (mtp heads), a static tree's paths (medusa heads),
    None for lookup-only drafting."""
    if settings is None:
        return None
    return asdict(settings) if dataclasses.is_dataclass(settings) else json.loads(settings.to_json())


METHOD_FLAGS = ("@fixed", "@usual")
RECORD_FLAG = "@record"  # last in a method's name: it records its traffic under OUT-traffic/<method>


def tokenmaxx_method_spec(name: str, default_draft: str) -> tuple[str, str | None, str | None, bool, bool] | None:
    """A tokenmaxx method name -> (draft mode, head kind or None for --heads, tree spec or None, fixed, usual); None
    for a name that is not one. ``NAME[:TREE][@fixed][@usual]``: @fixed verifies whole trees every round (no per-round
    sizing: the measured costs without the latency); @usual verifies with the backbone's linear layers as the model
    computes them (the costs measured with an empty small-row plan, to measure what the transposed products are
    worth)."""
    base, flags = name, set()
    while base.endswith(METHOD_FLAGS):
        flag = next(f for f in METHOD_FLAGS if base.endswith(f))
        flags.add(flag)
        base = base.removesuffix(flag)
    fixed, usual = "@fixed" in flags, "@usual" in flags
    prefix, _, tree = base.partition(":")
    if prefix not in TOKENMAXX_METHODS:
        return None
    draft = "lookup" if prefix == "lookup" else "hybrid" if prefix.endswith("hybrid") else \
        default_draft if prefix == "tokenmaxx" else "heads"
    if fixed and draft == "lookup":
        raise ValueError(f"method {name!r}: lookup drafting has no heads' tree to keep whole; drop @fixed")
    kind = prefix.split("_")[0] if prefix.startswith(("medusa", "mtp")) else None
    return draft, kind, tree or None, fixed, usual


def build_methods(args: BenchArgs, model, tokenizer, max_cache_len: int) -> tuple[dict, dict]:
    """name -> callable(input_ids, max_new_tokens) -> new tokens; plus notes (skipped methods, choices).
    ``max_cache_len``: the compiled baseline's static cache (the longest prompt plus --max_new_tokens)."""
    methods, notes = {"baseline": hf_method(model)}, {}
    heads = {}  # (kind, spec) -> loaded heads, shared by the methods that use them
    named = named_heads(args.heads_as)
    for name in split_methods(args.methods):
        if name == "baseline":
            continue
        own = name.partition("@")[0].partition(":")[0]
        spec_of = {None: args.heads, "medusa": args.medusa_heads, "mtp": args.mtp_heads}
        name_as = "tokenmaxx" + name[len(own):] if own in named else name  # named heads draft as tokenmaxx does
        if own in named:
            spec_of[None] = named[own]
        record = name_as.endswith(RECORD_FLAG)  # the same method, recording its traffic (what recording costs)
        name_as = name_as.removesuffix(RECORD_FLAG)
        if name.partition(":")[0] == COMPILED:
            backend = name.partition(":")[2] or "inductor"
            methods[name] = compiled_method(model, max_cache_len, backend=backend)
            notes[name] = f"generate with a static cache of {max_cache_len} positions, torch.compile backend {backend}"
            continue
        if name == "prompt_lookup":
            for k in [int(x) for x in args.lookup_tokens.split(",")]:
                methods[f"prompt_lookup:{k}"] = hf_method(model, prompt_lookup_num_tokens=k)
        elif name == "assisted":
            draft = args.draft_model or ("qwen2.5-coder-0.5b" if args.backbone == "qwen2.5-coder-1.5b" else None)
            if draft is None:
                notes["assisted"] = f"skipped: no draft model known for {args.backbone} (pass --draft_model)"
                continue
            try:
                draft_model, _ = load_backbone(draft, dtype=args.dtype, device=model.device)
            except FileNotFoundError as err:
                notes["assisted"] = f"skipped: draft model {draft} is not installed ({err})"
                continue
            methods["assisted"] = hf_method(model, assistant_model=draft_model)
        elif (method := tokenmaxx_method_spec(name_as, args.draft)) is not None:
            draft, kind, tree, fixed, usual = method
            spec = spec_of[kind]
            if (kind, spec) not in heads and draft != "lookup":
                heads[kind, spec] = resolve_heads(spec, model, args.backbone, kind=kind)
            gen = SpeculativeGenerator.create(model, heads[kind, spec] if draft != "lookup" else None,
                                              tokenizer=tokenizer, tree=tree, draft=draft)
            if fixed or usual:
                costs = measure_costs(model, gen.heads if draft in NEEDS_HEADS else None, gen.tree_settings,
                                      small_rows={}) if usual else gen.costs
                costs = Costs(small_rows=costs.small_rows) if fixed else costs
                gen = SpeculativeGenerator(model, gen.heads, tokenizer=tokenizer, tree=gen.tree_settings, draft=draft,
                                           costs=costs)
            notes[f"{name} tree"] = tree_note(gen.tree_settings)
            if gen.costs is not None and gen.costs.small_rows:
                notes[f"{name} small rows"] = plan_record(gen.costs.small_rows)
            if record and draft == "lookup":
                raise ValueError(f"method {name!r}: recording keeps the states the heads read; lookup has no heads")
            methods[name] = tokenmaxx_method(gen, record=f"{args.out}-traffic/{name}" if record else None)
        else:
            raise ValueError(f"unknown method {name!r}: expected baseline, compiled[:BACKEND], prompt_lookup, assisted, "
                             f"or one of {TOKENMAXX_METHODS} (optionally :<tree>, @fixed, @usual)")
    return methods, notes


def named_heads(value: str | None) -> dict[str, str]:
    """--heads_as NAME=PATH[,NAME=PATH] -> {NAME: PATH}; a name may not be a built-in method's."""
    out = {}
    for item in filter(None, (value or "").split(",")):
        name, eq, path = item.partition("=")
        name = name.strip()
        if not eq or not name or not path.strip() or not name.isidentifier():
            raise ValueError(f"--heads_as {item!r}: expected NAME=PATH (NAME a word)")
        if name in TOKENMAXX_METHODS or name in ("baseline", "prompt_lookup", "assisted", COMPILED):
            raise ValueError(f"--heads_as name {name!r} is a built-in method's: choose another")
        out[name] = path.strip()
    return out


def parse_args(argv: list[str] | None = None) -> BenchArgs:
    """BenchArgs from the command line; a bad value exits with one ``error:`` line (status 2), like argparse."""
    args = parse_flags(BenchArgs, argv, description=__doc__.split("\n\n")[0])
    return args


def probe_compiled(methods: dict, notes: dict, prompt, model) -> None:
    """Compile the compiled baselines now, on four tokens of ``prompt``: one that fails to compile on this machine is
    left out of the run, its error in the notes (a peer's baseline failing must not cost the whole run, which on a GPU
    may have no second try)."""
    device = model.get_output_embeddings().weight.device
    for name in [n for n in methods if n.partition(":")[0] == COMPILED]:
        try:
            start = clock(device)
            with torch.inference_mode():
                methods[name](prompt.input_ids.to(device), 4)  # compiled, then captured (CUDA graphs)
            notes.setdefault("compile_seconds", {})[name] = round(clock(device) - start, 2)
        except Exception as err:  # noqa: BLE001 (said in the report, and on stderr)
            del methods[name]
            notes[name] = f"left out: compiling failed here: {type(err).__name__}: {str(err)[:300]}"
            print(f"{name}: {notes[name]}", file=sys.stderr)


def build_report(args: BenchArgs, model, prompts, results, notes: dict, command: str = "") -> dict:
    """The report of the prompts every method has run (all of them, or those done before the run ended; none: each
    method's warm-up seconds alone, where its compiles went)."""
    done = len(results["baseline"].runs)
    summary = summarize(results, prompts) if done else {}
    notes = dict(notes)
    if not done:
        notes["warmup_seconds"] = {name: round(res.warmup_seconds, 3) for name, res in results.items()}
    lookups = {k: v for k, v in summary.items() if k.startswith("prompt_lookup:")}
    if lookups:  # report the best setting as prompt_lookup
        best = max(lookups, key=lambda k: lookups[k]["overall"]["tokens_per_s"])
        notes["prompt_lookup"] = {"best": best, "overall_by_setting": {k: v["overall"] for k, v in lookups.items()}}
        summary = {("prompt_lookup" if k == best else k): v for k, v in summary.items() if k == best or k not in lookups}
    return {"config": {**asdict(args), "prompt_count": done, "prompts_planned": len(prompts),
                       "selection": selection_note(prompts), "command": command, "notes": notes},
            "machine": machine_info(args.threads, args.dtype, model.get_output_embeddings().weight.device),
            "methods": summary}


def write_atomic(path: Path, text: str) -> None:
    """Written under a temp name, then renamed: a run killed while writing leaves the previous version whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(out: Path, report: dict, rows: list[dict]) -> str:
    """OUT.json, OUT.prompts.jsonl and OUT.md (returned) of a report so far."""
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=2))
    write_atomic(out.with_suffix(".prompts.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    table = markdown_table(report)
    write_atomic(out.with_suffix(".md"), table)
    return table


@contextmanager
def recording_fallbacks(into: list[str]):
    """Inside: each ``CaptureFallbackWarning`` said is appended to ``into`` (the report's notes) and still shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", CaptureFallbackWarning)
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if issubclass(category, CaptureFallbackWarning):
                into.append(str(message))
            shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def main(argv=None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = "tokenmaxx bench " + shlex.join(argv)  # (the report's header says it)
    torch.set_num_threads(args.threads)
    set_capture_backend(args.capture_backend)
    args.capture_backend = capture_backend()  # (the record says what ran, the environment's choice too)
    fallbacks: list[str] = []
    with recording_fallbacks(fallbacks):
        return bench(args, started, fallbacks, command)


def bench(args: BenchArgs, started: float, fallbacks: list[str], command: str = "") -> int:
    """main's run: the batch bench, or the per-prompt methods; ``fallbacks`` collects the captured calls that fell
    back to eager, for the report."""
    model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    args.dtype = str(model.dtype).removeprefix("torch.")  # "auto" resolved: the record says what ran
    prompts = load_prompts(args.prompts, tokenizer, limit=args.limit, group_mt_bench=args.group_mt_bench)
    print(f"bench: {args.prompts}: {selection_note(prompts)}", file=sys.stderr)
    if args.batch_sizes is not None:
        return batch_main(args, model, tokenizer, prompts, started, command)
    if args.time_budget is not None:  # a run cut short covers every category
        prompts = interleave_categories(prompts)
    longest = max(p.input_ids.shape[1] for p in prompts) + args.max_new_tokens
    methods, notes = build_methods(args, model, tokenizer, max_cache_len=longest)
    notes["capture_fallbacks"] = fallbacks  # (filled as they are said)
    for name, note in notes.items():
        if isinstance(note, str):
            print(f"{name}: {note}", file=sys.stderr)
    probe_compiled(methods, notes, prompts[0], model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def after_prompt(results, done):  # saved after every prompt: a killed run keeps what it finished
        save(out, build_report(args, model, prompts, results, notes, command), prompt_rows(results, prompts))

    deadline = started + args.time_budget if args.time_budget is not None else None
    results = run_benchmark(model, methods, prompts, args.max_new_tokens, warmup=args.warmup,
                            after_prompt=after_prompt, deadline=deadline)
    done = len(results["baseline"].runs)
    if not done:  # (its report holds the warm-up's seconds)
        raise ValueError(f"--time_budget {args.time_budget:g} s ended the run before its first prompt (loading, "
                         "measuring and the warm-up took it): give it more time")
    if done < len(prompts):
        print(f"bench: {done} of {len(prompts)} prompts within --time_budget {args.time_budget:g} s", file=sys.stderr)
    report = build_report(args, model, prompts, results, notes, command)
    table = save(out, report, prompt_rows(results, prompts))
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(table)
    return 0


def batch_main(args: BenchArgs, model, tokenizer, prompts, started: float, command: str = "") -> int:
    """--batch_sizes: batched generation against transformers' batched generate (``run_batch_benchmark``); with
    --time_budget no batch starts after it (the sizes that did not run are left out, and the config says so)."""
    heads = resolve_heads(args.heads, model, args.backbone) if args.draft != "lookup" else None
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tokenizer, draft=args.draft)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    deadline = started + args.time_budget if args.time_budget is not None else None
    batch = run_batch_benchmark(model, gen, interleave_categories(prompts), sizes, args.max_new_tokens,
                                repeats=args.repeats, deadline=deadline)
    if not batch:
        raise ValueError(f"--time_budget {args.time_budget:g} s ended the run before its first batch (loading, "
                         "measuring and the warm-up took it): give it more time")
    report = {"config": {"backbone": args.backbone, "dtype": args.dtype, "draft": args.draft,
                         "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "repeats": args.repeats,
                         "drafter": gen.describe(), "batch_sizes": sizes,
                         "selection": selection_note(prompts), "command": command},
              "machine": machine_info(args.threads, args.dtype, model.get_output_embeddings().weight.device),
              "batch": batch}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = batch_table(report["batch"])
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=1))
    header = report_header({"config": {**report["config"], "prompts": args.prompts}, "machine": report["machine"]})
    write_atomic(out.with_suffix(".md"), header + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
