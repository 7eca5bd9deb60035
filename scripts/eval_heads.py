#!/usr/bin/env python
"""Score trained heads on a self-distilled dataset: held-out accuracy per depth and per category.

    python scripts/eval_heads.py --heads DIR_OR_HUB_ID --data data/mix/merged [--out runs/eval.json]

Without --heads: the heads shipped for --backbone. The rows are those a training run on --data holds out (the same
split for the same --seq_len / --eval_fraction / --eval_max_examples / --seed as train_heads; by default the values
the heads' own run recorded, so that the rows it held out are scored, and one line says which split is scored), or
every row with --split all; with --unseen_by HEADS only rows of parts those heads never trained on are held out (the
split of a run started from them with train_heads --init_heads, which is the default for heads made by such a run).
Two sets of heads evaluated with the same flags are scored on the same rows: the way to compare kinds or recipes
without a bench. Bad input ends in one `error:` line and exit status 2 (--debug: the traceback).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields

import torch

from tokenmaxx.heads import load_backbone
from tokenmaxx.heads.io.backbones import DEVICE_HELP
from tokenmaxx.heads.io.pretrained import resolve_heads
from tokenmaxx.scripts.errors import flag_parser, run_script
from tokenmaxx.training.batches import trained_parts
from tokenmaxx.training.checkpoints import atomic_write_text
from tokenmaxx.training.evaluation import SPLIT_FIELDS, SPLITS, VOCABS, evaluate_heads, recorded_split
from tokenmaxx.training.train_config import THREADS_HELP, TrainConfig, default_threads

DTYPES = ("auto", "bfloat16", "float32")
SPLIT_HELP = "the one the heads' training run recorded, else train's default"


@dataclass
class EvalArgs:
    data: str = field(metadata={"help": "self-distilled dataset folder (scripts/make_data.py or merge_data.py)"})
    heads: str | None = field(default=None, metadata={
        "help": "heads folder or Hub id (default: the heads shipped for --backbone)"})
    backbone: str | None = field(default=None, metadata={
        "help": "backbone alias / folder / Hub id (default: the one the heads name, else smollm2-135m)"})
    split: str = field(default="held_out", metadata={"help": f"rows to score, one of {SPLITS}"})
    vocab: str = field(default="auto", metadata={
        "help": f"one of {VOCABS}: rank over the heads' draft vocabulary (a target outside it is a miss) or over "
                "every token; auto = draft when the heads have one"})
    seq_len: int | None = field(default=None, metadata={
        "help": f"as train_heads --seq_len (the split depends on it); default: {SPLIT_HELP}"})
    eval_fraction: float | None = field(default=None, metadata={
        "help": f"as train_heads --eval_fraction; default: {SPLIT_HELP}"})
    eval_max_examples: int | None = field(default=None, metadata={
        "help": f"as train_heads --eval_max_examples; default: {SPLIT_HELP}"})
    seed: int | None = field(default=None, metadata={"help": f"as train_heads --seed; default: {SPLIT_HELP}"})
    unseen_by: str | None = field(default=None, metadata={
        "help": "heads folder / Hub id: hold out only rows of parts those heads were not trained on, as train_heads "
                "--init_heads does with them (scores other heads on rows new to these). Default: for heads trained "
                "with --init_heads, the parts those had seen (their run's own split)"})
    micro_batch_size: int = field(default=4, metadata={"help": "sequences per backbone forward"})
    dtype: str = field(default="auto", metadata={
        "help": "backbone and heads dtype: auto (bfloat16 where it is native: a GPU, a CPU with AVX-512 BF16 / AMX; "
                "else float32, as in generate, make-data and train), bfloat16 or float32"})
    device: str = field(default="auto", metadata={"help": DEVICE_HELP})
    threads: int = field(default_factory=default_threads, metadata={"help": THREADS_HELP})
    out: str | None = field(default=None, metadata={"help": "also write the metrics to this JSON file"})

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"--split must be one of {SPLITS}, got {self.split!r}")
        if self.vocab not in VOCABS:
            raise ValueError(f"--vocab must be one of {VOCABS}, got {self.vocab!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("seq_len", "eval_max_examples", "micro_batch_size", "threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be > 0, got {getattr(self, name)!r}")
        if self.eval_fraction is not None and not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        if self.unseen_by and self.split != "held_out":
            raise ValueError(f"--unseen_by chooses the held-out rows; --split {self.split} scores every row")


def table(metrics: dict) -> str:
    """The record as a Markdown table: one row for all rows scored, then one per category."""
    rows = [("all", metrics)] + list(metrics.get("by_category", {}).items())
    lines = ["| rows | examples | positions | top-1 per depth | top-5 per depth | tree tau |", "|---|---|---|---|---|---|"]
    for name, m in rows:
        lines.append(f"| {name} | {m['examples']} | {m['eval_positions']} | "
                     f"{' / '.join(f'{v:.3f}' for v in m['head_top1'])} | "
                     f"{' / '.join(f'{v:.3f}' for v in m['head_top5'])} | {m['tree_tau_empirical']:.2f} |")
    return "\n".join(lines)


def split_settings(args: EvalArgs, heads_config) -> tuple[dict, str]:
    """The split to score (``SPLIT_FIELDS``): each value given on the command line, else the one the heads' run
    recorded, else train's default; and one line saying which."""
    recorded = recorded_split(heads_config)
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in SPLIT_FIELDS}
    split, origins = {}, {}  # origin -> the settings taken from it
    for name in SPLIT_FIELDS:
        if getattr(args, name) is not None:
            split[name], origin = getattr(args, name), "given"
        elif name in recorded:
            split[name], origin = recorded[name], "recorded with the heads"
        else:
            split[name], origin = defaults[name], "train's default, not recorded with the heads"
        origins.setdefault(origin, []).append(name)
    where = next(iter(origins)) if len(origins) == 1 else \
        "; ".join(f"{', '.join(names)}: {origin}" for origin, names in origins.items())
    rows = "held-out rows" if args.split == "held_out" else "every row"
    return split, f"split: {rows} of {', '.join(f'{n} {split[n]}' for n in SPLIT_FIELDS)} ({where})"


def main(argv=None) -> int:
    (args,) = flag_parser(EvalArgs, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(argv)
    torch.set_num_threads(args.threads)
    from tokenmaxx.heads import load_heads

    heads = load_heads(args.heads) if args.heads and args.heads != "untrained" else None
    seen = trained_parts(load_heads(args.unseen_by).config) if args.unseen_by else None
    if args.unseen_by and not seen:
        raise ValueError(f"--unseen_by {args.unseen_by}: those heads record no training data, so no row can be "
                         "known to be new to them")
    backbone = args.backbone or (heads.config.backbone if heads is not None else None) or "smollm2-135m"
    model, _ = load_backbone(backbone, dtype=args.dtype, device=args.device)
    if heads is None:
        heads = resolve_heads(args.heads, model, backbone)
    if seen is None:  # heads trained from others: their run's split held out rows new to those
        seen = ((heads.config.extra or {}).get("init_heads") or {}).get("seen_parts") or ()
    split, split_line = split_settings(args, heads.config)
    print(split_line, flush=True)
    metrics = evaluate_heads(heads, model, args.data, split=args.split, vocab=args.vocab,
                             micro_batch_size=args.micro_batch_size, seen_parts=seen, **split)
    metrics = {"heads": args.heads or f"shipped ({backbone})", "kind": heads.config.kind, "data": args.data,
               "split_settings": split, **metrics}
    print(f"{metrics['kind']} heads {metrics['heads']} on {args.data} ({args.split} rows, {metrics['vocab']} "
          f"vocabulary; depth d scored given the true tokens before it):")
    print(table(metrics))
    if args.out:
        atomic_write_text(args.out, json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
