#!/usr/bin/env python
"""Where acceptance is lost: the heads' accepted length per category, per draft depth and per tree size, and the share
of the backbone's tokens their draft vocabulary cannot guess, on benchmark prompts and on held-out rows of a
training dataset, so the gap between the two is explained in numbers.

    python scripts/acceptance.py --prompts ../shared/bench/spec_bench_dev.jsonl --group_mt_bench --limit 2 \
        --data data/mix/merged --dtype float32 --out runs/acceptance

Every generation is greedy, drafted by the heads alone with their whole dynamic tree of N nodes every round
(``dynamic:nodes=N,min_mass=0``, no measured costs: speed plays no part), so tau depends on the heads and the tree
size only. Per category: tau at each ``--nodes`` size; at the heads' own size, the acceptance at depth d (the share of
rounds that accepted d candidates among those that accepted d-1); the share of emitted tokens outside the draft
vocabulary, and outside it and the prompt (drafting guesses over both); with --data, the same share for draft
vocabularies of other sizes made from its training rows (``--vocab_sizes``). Held-out rows (``--data``): the rows a
training run on that folder holds out, with the split the heads' run recorded; their prompts are generated from as
the benchmark's are, one category per dataset category ("data: NAME"). Writes OUT.json and OUT.md (the table).
Bad input ends in one ``error: ...`` line and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tokenmaxx.heads import DEFAULT_BACKBONE, load_backbone, resolve_heads
from tokenmaxx.heads.io.backbones import DEVICE_HELP
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.scripts.benchmark import load_prompts, machine_info
from tokenmaxx.scripts.errors import flag_parser, run_script

DATA_PREFIX = "data: "  # the categories of held-out training rows


@dataclass
class AcceptanceArgs:
    prompts: str | None = field(default=None, metadata={"help": "Spec-Bench-style jsonl of benchmark prompts"})
    data: str | None = field(default=None, metadata={
        "help": "self-distilled dataset folder: its held-out rows (the split the heads' run recorded) as categories"})
    data_rows: int = field(default=2, metadata={"help": "held-out rows per dataset category"})
    limit: int | None = field(default=None, metadata={"help": "benchmark prompts per category"})
    group_mt_bench: bool = field(default=False, metadata={"help": "as bench: MT-bench's categories as one"})
    backbone: str = field(default=DEFAULT_BACKBONE, metadata={"help": "backbone alias, folder or Hub id"})
    heads: str | None = field(default=None, metadata={"help": "heads folder or Hub id (default: the shipped ones)"})
    nodes: str = field(default="4,8,16,32,64", metadata={"help": "tree sizes (nodes) to draft with, comma list"})
    vocab_sizes: str = field(default="8192,16384,32768", metadata={
        "help": "with --data: draft vocabularies of these sizes (the most frequent tokens of its training rows, as "
                "train --draft_vocab_size makes them) whose coverage of the emitted tokens is reported"})
    vocab_tau: bool = field(default=False, metadata={
        "help": "with --data, for heads that score through the backbone's lm_head (eagle3, mtp): also draft with each "
                "--vocab_sizes vocabulary at the heads' own tree size, for tau per category and the seconds of one "
                "proposal on this machine (the median of --propose_repeats interleaved measurements): the cost and "
                "the gain of a larger vocabulary side by side"})
    propose_repeats: int = field(default=3, metadata={"help": "with --vocab_tau: proposal timings per vocabulary"})
    coverage_rows: int = field(default=64, metadata={
        "help": "with --data: held-out rows per category whose every answer position the backbone reads (one forward "
                "each), for the share of its own next tokens there that each --vocab_sizes vocabulary and the "
                "prompt cannot guess: what the backbone emits on the data, over far more tokens than generation "
                "gives; 0: skip"})
    max_new_tokens: int = field(default=128, metadata={"help": "new tokens per prompt"})
    dtype: str = field(default="float32", metadata={"help": "float32 (exact greedy), bfloat16 or auto"})
    device: str = field(default="cpu", metadata={"help": DEVICE_HELP})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    out: str = field(default="runs/acceptance", metadata={"help": "output path prefix (.json, .md)"})

    def __post_init__(self):
        if self.prompts is None and self.data is None:
            raise ValueError("nothing to measure: give --prompts (benchmark prompts) and/or --data (a dataset folder)")
        try:
            sizes = [int(n) for n in self.nodes.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--nodes {self.nodes!r}: expected positive integers such as 4,8,16")
        try:
            bad = min(int(n) for n in self.vocab_sizes.split(",") if n.strip()) < 1
        except ValueError:
            bad = True
        if bad:
            raise ValueError(f"--vocab_sizes {self.vocab_sizes!r}: expected positive integers such as 8192,16384")
        if self.vocab_tau and self.data is None:
            raise ValueError("--vocab_tau drafts with vocabularies made from --data's training rows: give --data")
        if self.coverage_rows < 0:
            raise ValueError(f"--coverage_rows must be >= 0, got {self.coverage_rows}")
        for name in ("max_new_tokens", "threads", "data_rows", "propose_repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")

    @property
    def sizes(self) -> list[int]:
        return [int(n) for n in self.nodes.split(",")]

    @property
    def vocabularies(self) -> list[int]:
        return [int(n) for n in self.vocab_sizes.split(",") if n.strip()]


def depth_acceptance(hist: dict[int, int], depth: int) -> list[float | None]:
    """From an accepted-length histogram (tau -> rounds; tau = accepted candidates + 1): at each depth d = 1..depth,
    the rounds that accepted d candidates or more over those that accepted d-1 or more (None where none reached
    d-1)."""
    reached = [sum(c for t, c in hist.items() if t - 1 >= d) for d in range(depth + 1)]
    return [reached[d] / reached[d - 1] if reached[d - 1] else None for d in range(1, depth + 1)]


def outside_share(tokens: list[int], vocab: set[int], prompt: set[int] | None = None) -> tuple[int, int]:
    """(emitted tokens outside ``vocab`` (and outside ``prompt`` when given), emitted tokens)."""
    allowed = vocab | (prompt or set())
    return sum(t not in allowed for t in tokens), len(tokens)


def held_out_prompts(path: str, heads, limit: int) -> tuple[list[tuple[str, torch.Tensor]], object]:
    """(category, prompt ids [1, P]) of the rows a training run on ``path`` holds out, with the split the heads' run
    recorded (train's defaults where it recorded none), at most ``limit`` per dataset category; and the data."""
    from tokenmaxx.training.batches import load_data
    from tokenmaxx.training.evaluation import SPLIT_FIELDS, recorded_split
    from tokenmaxx.training.train_config import TrainConfig

    split = {f: getattr(TrainConfig, f, None) for f in SPLIT_FIELDS} | recorded_split(heads.config)
    data = load_data(path, split["seq_len"], split["eval_fraction"], split["eval_max_examples"], split["seed"])
    groups = data.by_category(data.eval) or {"rows": list(data.eval)}
    return [(DATA_PREFIX + category, data.examples[r].ids[: data.examples[r].prompt_len][None].long())
            for category, rows in groups.items() for r in rows[:limit]], data


def measure(args: AcceptanceArgs) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    heads = resolve_heads(args.heads, model, args.backbone)
    prompts = []
    if args.prompts:
        prompts += [(p.category, p.input_ids) for p in load_prompts(args.prompts, tokenizer, limit=args.limit,
                                                                     group_mt_bench=args.group_mt_bench)]
    vocabularies, ranked, data = {}, [], None  # size -> the data's top tokens (train --draft_vocab_size SIZE's)
    if args.data:
        rows, data = held_out_prompts(args.data, heads, args.data_rows)
        prompts += rows
        counts = torch.zeros(model.get_output_embeddings().weight.shape[0], dtype=torch.long)
        for r in data.train:
            counts += torch.bincount(data.examples[r].ids.long(), minlength=counts.numel())
        order = torch.argsort(-counts, stable=True)  # by count, ties by token id: as frequent_tokens
        ranked = order[:int((counts > 0).sum())].tolist()
        vocabularies = {size: set(ranked[:size]) for size in args.vocabularies}
    vocab = set(heads.draft_vocab.tolist()) if heads.draft_vocab is not None else None
    own = heads.tree_settings(heads.config, None).nodes
    sizes = sorted(set(args.sizes) | {own})
    depth = heads.config.num_heads
    gens = {n: SpeculativeGenerator(model, heads, tokenizer=tokenizer, draft="heads",
                                    tree=f"dynamic:nodes={n},min_mass=0", costs=None) for n in sizes}
    cats: dict[str, dict] = {}
    for category, ids in tqdm(prompts, desc="acceptance", unit="prompt", file=sys.stderr):
        entry = cats.setdefault(category, {"prompts": 0, "hist": {n: {} for n in sizes}, "outside": [0, 0],
                                           "outside_prompt": [0, 0], "by_size": {v: [0, 0] for v in vocabularies}})
        entry["prompts"] += 1
        for n in sizes:
            out = gens[n].generate(ids, max_new_tokens=args.max_new_tokens)
            for tau, count in out.stats.accepted_hist.items():
                entry["hist"][n][tau] = entry["hist"][n].get(tau, 0) + count
            if n != own:  # (the same tokens at every size: greedy)
                continue
            shown = set(ids[0].tolist())
            tallies = [(entry["by_size"][v], ranked_vocab, shown) for v, ranked_vocab in vocabularies.items()]
            if vocab is not None:
                tallies += [(entry["outside"], vocab, None), (entry["outside_prompt"], vocab, shown)]
            for into, allowed, extra in tallies:
                miss, total = outside_share(out.new_tokens, allowed, extra)
                into[0] += miss
                into[1] += total
    by_vocab, propose = vocab_tau(args, model, tokenizer, heads, prompts, ranked, own) if args.vocab_tau else ({}, {})
    coverage = emitted_coverage(model, data, ranked, args.vocabularies, args.coverage_rows) \
        if args.data and args.coverage_rows else {}
    table = {}
    for category, entry in cats.items():
        hist = entry["hist"]
        table[category] = {
            "prompts": entry["prompts"],
            "tau": {n: round(sum(t * c for t, c in hist[n].items()) / max(sum(hist[n].values()), 1), 3)
                    for n in sizes},
            "depth_acceptance": [None if a is None else round(a, 3) for a in depth_acceptance(hist[own], depth)],
            "outside_draft_vocab": round(entry["outside"][0] / entry["outside"][1], 4) if entry["outside"][1] else None,
            "outside_vocab_and_prompt": round(entry["outside_prompt"][0] / entry["outside_prompt"][1], 4)
            if entry["outside_prompt"][1] else None,
            "outside_data_vocab_and_prompt": {v: round(m / t, 4) if t else None for v, (m, t) in
                                              entry["by_size"].items()},
            **({"tau_by_vocab": by_vocab[category]} if by_vocab else {})}
    return {"config": {**asdict(args), "own_nodes": own, "sizes": sizes, "draft_vocab": len(vocab) if vocab else None},
            **({"propose_seconds_by_vocab": propose} if propose else {}),
            **({"emitted_coverage": coverage} if coverage else {}),
            "machine": machine_info(args.threads, str(model.dtype).removeprefix("torch."),
                                    model.get_output_embeddings().weight.device),
            "categories": table}


@torch.inference_mode()
def emitted_coverage(model, data, ranked: list[int], sizes: list[int], rows: int) -> dict[str, dict]:
    """Per category of the data's held-out rows (at most ``rows`` each): the backbone's own next token at every answer
    position of the row's text (one forward), and the share of them outside each top-N vocabulary and the row's
    prompt: {category: {"rows", "tokens", "outside_vocab_and_prompt": {N: share}}}."""
    device = model.get_output_embeddings().weight.device
    rank = torch.full((model.get_output_embeddings().weight.shape[0],), len(ranked), dtype=torch.long)
    rank[torch.tensor(ranked, dtype=torch.long)] = torch.arange(len(ranked))  # token -> its place in the ranking
    out = {}
    groups = data.by_category(data.eval) or {"rows": list(data.eval)}
    for category, members in tqdm(groups.items(), desc="coverage", unit="category", file=sys.stderr):
        misses, total = Counter(), 0
        for r in members[:rows]:
            example = data.examples[r]
            ids = example.ids.long()
            logits = model(ids[None].to(device)).logits[0, example.prompt_len - 1:-1]  # [A, V]: each answer token
            emitted = logits.argmax(-1).cpu()
            unseen = ~torch.isin(emitted, ids[:example.prompt_len])
            total += emitted.numel()
            for size in sizes:
                misses[size] += int((unseen & (rank[emitted] >= size)).sum())
        out[DATA_PREFIX + category] = {"rows": min(rows, len(members)), "tokens": total,
                                       "outside_vocab_and_prompt": {v: round(misses[v] / max(total, 1), 4)
                                                                    for v in sizes}}
    return out


def vocab_tau(args: AcceptanceArgs, model, tokenizer, heads, prompts: list, ranked: list[int],
              own: int) -> tuple[dict[str, dict[int, float]], dict[int, float]]:
    """({category: {vocabulary size: tau}}, {vocabulary size: seconds of one proposal}) drafting with each of the
    data's top-N vocabularies in turn (the heads' own is put back after)."""
    from tokenmaxx.inference.measure.latency import measure_propose

    if not heads.config.share_lm_head:
        raise ValueError(f"--vocab_tau: {heads.config.kind!r} heads project with their own lm_head copies, so a draft "
                         "vocabulary cannot be swapped after training")
    saved = None if heads.draft_vocab is None else heads.draft_vocab.tolist()
    tree = heads.tree_settings(heads.config, None)
    hist, seconds = {}, {v: [] for v in args.vocabularies}
    try:
        for v in args.vocabularies:
            heads.set_draft_vocab(ranked[:v])
            gen = SpeculativeGenerator(model, heads, tokenizer=tokenizer, draft="heads",
                                       tree=f"dynamic:nodes={own},min_mass=0", costs=None)
            for category, ids in tqdm(prompts, desc=f"vocabulary {_size(v)}", unit="prompt", file=sys.stderr):
                into = hist.setdefault(category, {}).setdefault(v, Counter())
                into.update(gen.generate(ids, max_new_tokens=args.max_new_tokens).stats.accepted_hist)
        for _ in range(args.propose_repeats):  # interleaved: a machine's drift falls on every size alike
            for v in args.vocabularies:
                heads.set_draft_vocab(ranked[:v])
                seconds[v].append(measure_propose(model, heads.drafter(model, tree=tree, draft_vocab=True)))
    finally:
        heads.set_draft_vocab(saved)
    taus = {c: {v: round(sum(t * n for t, n in h.items()) / max(sum(h.values()), 1), 3) for v, h in by.items()}
            for c, by in hist.items()}
    return taus, {v: round(sorted(s)[len(s) // 2], 6) for v, s in seconds.items()}


def markdown(report: dict) -> str:
    """The report (as its JSON reads back) as one table: a row per category."""
    cfg, rows = report["config"], report["categories"]
    sizes, own = cfg["sizes"], cfg["own_nodes"]
    depth = max((len(r["depth_acceptance"]) for r in rows.values()), default=0)
    head = (["category", "prompts"] + [f"tau @{n}" for n in sizes] + [f"accept d{d} @{own}" for d in range(1, depth + 1)]
            + [f"outside draft vocab ({cfg['draft_vocab']})", "outside vocab + prompt"]
            + [f"outside top {_size(int(v))} + prompt" for v in cfg["vocab_sizes"].split(",") if cfg["data"]]
            + [f"tau @{own}, top {_size(int(v))}" for v in cfg["vocab_sizes"].split(",") if cfg.get("vocab_tau")])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(value, percent: bool = False) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%" if percent else f"{value:.2f}"

    for category, r in rows.items():
        cells = [category, str(r["prompts"])] + [cell(r["tau"][str(n)]) for n in sizes]
        cells += [cell(a, percent=True) for a in r["depth_acceptance"]]
        cells += [cell(r["outside_draft_vocab"], True), cell(r["outside_vocab_and_prompt"], True)]
        cells += [cell(share, True) for share in r["outside_data_vocab_and_prompt"].values()]
        cells += [cell(tau) for tau in r.get("tau_by_vocab", {}).values()]
        lines.append("| " + " | ".join(cells) + " |")
    if coverage := report.get("emitted_coverage"):
        sizes_ = list(next(iter(coverage.values()))["outside_vocab_and_prompt"])
        lines += ["", "The backbone's own next token at every answer position of held-out rows (teacher-forced), outside "
                  "the data's top-N tokens and the row's prompt:", "",
                  "| category | rows | tokens | " + " | ".join(f"outside top {_size(int(v))} + prompt" for v in sizes_)
                  + " |", "|" + "---|" * (3 + len(sizes_))]
        lines += [f"| {c} | {r['rows']} | {r['tokens']} | " + " | ".join(
            cell(s, True) for s in r["outside_vocab_and_prompt"].values()) + " |" for c, r in coverage.items()]
    if propose := report.get("propose_seconds_by_vocab"):
        lines += ["", "One proposal at the heads' own tree size: " + ", ".join(
            f"top {_size(int(v))} {1000 * s:.2f} ms" for v, s in propose.items()) + "."]
    return "\n".join(lines) + "\n"


def _size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    (args,) = flag_parser(AcceptanceArgs, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    report = measure(args)
    report["config"]["command"] = "tokenmaxx acceptance " + shlex.join(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    table = markdown(json.loads(out.with_suffix(".json").read_text()))
    out.with_suffix(".md").write_text(f"`{report['config']['command']}`\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
