#!/usr/bin/env python
"""Heads v2 for the default backbone (smollm2-135m): EAGLE-3 heads distilled on the prompt mix, in resumable stages.

    python scripts/recipe_eagle3.py --parts 8                       every stage, up to training and export
    python scripts/recipe_eagle3.py --stage answers --device cuda   the data alone, on a GPU
    python scripts/recipe_eagle3.py --stage stash                   beside (or after) a stopped answers stage

Stages, in order (--stage runs up to that one; run again, each resumes where it stopped):
  1. prompts   scripts/make_prompts.py: the mix (every ShareGPT user turn in its real context + summarise / translate
               / answer-from-passages / word-problem prompts), in parts of 2,048 (MIX/prompts-NNN)
  2. answers   make_data per part, in order, until --parts parts are done (each part resumes where it stopped; finished
               parts are never redone); a finished part's compact copy (uint16 token ids) goes to KEPT/part-NNN
               (committed to git; parts found there are not answered again). --jobs parts are answered at once, each
               process on its share of the cores (batched generation's small matmuls scale poorly across threads:
               one-thread processes answered faster; docs/benchmarks.md)
     stash     (--stage stash, run beside or after a stopped answers stage) copies the finished shards of every
               unfinished part (and the answered batches of its unfinished shard) to KEPT/unfinished/part-NNN
               (committed): a later answers stage, on a fresh machine, starts from them instead of from nothing
  3. merge     merge_data of the finished parts -> MIX/merged
  4. train     train_heads --kind eagle3 with a feature cache (three layers' states), --resume when a checkpoint
               exists; export to --export. The held-out metrics come per category of the mix too (chat, math, rag,
               summarize, translate: make_data keeps each prompt's source as the record's category)

Paths are relative to the repository root. The answers stage is the long one (the mix's prompts are long: multi-turn
context, passages): hours a part on a CPU, minutes in all on a GPU (--device cuda). What each stage took, and on which
machine: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tokenmaxx.scripts.errors import parse_flags, run_script

REPO = Path(__file__).resolve().parents[1]
STAGES = ("prompts", "answers", "merge", "train", "stash")
SHARD = "[0-9][0-9][0-9][0-9][0-9]"  # a finished shard's folder (a temp one is .tmp-NNNNN)


@dataclass
class RecipeArgs:
    parts: int = field(default=6, metadata={"help": "parts of the mix to answer (2,048 prompts each)"})
    stage: str = field(default="train", metadata={"help": f"run up to this stage: {' | '.join(STAGES)}"})
    device: str = field(default="auto", metadata={"help": "where the answers and the training run: auto | cpu | cuda"})
    dtype: str = field(default="auto", metadata={
        "help": "the answers' dtype: auto (bfloat16 on a GPU or a CPU with native bf16, float32 on a CPU without); "
                "a started part keeps the dtype it was started with"})
    train_dtype: str | None = field(default=None, metadata={
        "help": "the training's dtype, bfloat16 | float32; default the same rule as --dtype auto (a CPU without "
                "native bf16 emulates it several times slower)"})
    kind: str = field(default="eagle3", metadata={
        "help": "eagle3, or mtp: the same data and recipe for the MTP kind (docs/benchmarks.md compares them)"})
    exclude: str = field(default="../shared/bench", metadata={"help": "benchmark prompts never trained on"})
    mix: str = field(default="data/mix", metadata={"help": "the prompts and the parts' working folders"})
    kept: str = field(default="distilled/smollm2-mix", metadata={"help": "the finished parts' compact copies"})
    run: str | None = field(default=None, metadata={"help": "the training run's folder (default runs/smollm2-KIND)"})
    export: str | None = field(default=None, metadata={"help": "the exported heads (default RUN/heads)"})
    jobs: int | None = field(default=None, metadata={
        "help": "parts answered at once (default 2 on a CPU of <= 4 cores, else 1)"})
    nproc: int | None = field(default=None, metadata={"help": "training processes, 1, 2 or 4 (default --jobs)"})
    draft_vocab: int = field(default=16384, metadata={
        "help": "the heads' draft vocabulary, also the loss's (a smaller one trains faster: RECIPE.md)"})
    save_every: int = field(default=50, metadata={
        "help": "steps between checkpoints (a checkpoint every few minutes of CPU training)"})
    dynamic_tree: str = field(default="dynamic:nodes=8,topk=8,min_mass=0.5", metadata={
        "help": "the serving tree written into the exported config (the shipped heads' node budget; tree='auto' "
                "re-tunes per machine); '': --init_heads' tree, else the library default (32 nodes)"})
    epochs: float = field(default=3, metadata={"help": "training epochs (fewer from trained heads)"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate, after --warmup steps, then cosine"})
    warmup: int = field(default=100, metadata={"help": "warm-up steps"})
    init_heads: str | None = field(default=None, metadata={
        "help": "start from these trained heads (folder or Hub id; held-out rows only from parts they never saw), "
                "e.g. the shipped ones on more parts, with fewer --epochs and a lower --lr"})
    python: str = field(default=sys.executable, metadata={"help": "the Python that runs the stages' scripts"})

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"--stage {self.stage!r}: expected one of {', '.join(STAGES)}")
        if self.parts < 1 or (self.jobs is not None and self.jobs < 1):
            raise ValueError(f"--parts ({self.parts}) and --jobs ({self.jobs}) must be at least 1")
        if self.nproc is not None and self.nproc not in (1, 2, 4):
            raise ValueError(f"--nproc {self.nproc}: expected 1, 2 or 4 (4 micro-batches a step are shared out)")
        self.run = self.run or f"runs/smollm2-{self.kind}"
        self.export = self.export or f"{self.run}/heads"
        cores = len(os.sched_getaffinity(0))
        self.jobs = self.jobs or default_jobs(self.device, cores)
        self.nproc = self.nproc or self.jobs


def default_jobs(device: str, cores: int) -> int:
    """Parts answered at once: on a small CPU, one one-thread process per core (two beat one of two threads)."""
    return 2 if device in ("cpu", "auto") and cores <= 4 else 1


class Recipe:
    """The stages over the recipe's folders (``mix``, ``kept``; relative paths from the repository root)."""

    def __init__(self, args: RecipeArgs):
        self.args = args
        self.mix, self.kept = REPO / args.mix, REPO / args.kept
        self.unfinished = self.kept / "unfinished"
        self.threads = max(len(os.sched_getaffinity(0)) // args.jobs, 1)

    def run(self) -> int:
        args = self.args
        # 1. prompts (deterministic: the same parts on every machine)
        if not (self.mix / "mix.json").is_file():
            self.call(["scripts/make_prompts.py", "--output_dir", str(self.mix), "--exclude", args.exclude])
        if args.stage == "prompts":
            return 0
        # 2. answers, part by part
        names = [f"{p:03d}" for p in range(args.parts)]
        todo = []
        for p in names:
            if (self.kept / f"part-{p}" / "provenance.json").is_file():
                shutil.rmtree(self.unfinished / f"part-{p}", ignore_errors=True)  # stashed while it was finishing
            else:
                todo.append(p)
        self.drop_empty_unfinished()
        if args.stage == "stash":
            for p in todo:
                self.stash_part(p)
            return 0
        for i in range(0, len(todo), args.jobs):  # a failed part stops the recipe; run it again to resume the part
            group = todo[i:i + args.jobs]
            for p in group:
                self.restore_part(p)
                print(f"answering part {p} (log: {self.mix}/part-{p}.log)", flush=True)
            with ThreadPoolExecutor(len(group)) as pool:
                statuses = list(pool.map(self.answer_part, group))
            failed = [(p, s) for p, s in zip(group, statuses) if s != 0]
            if failed:
                for p, status in failed:
                    print(f"recipe: part {p} failed (exit {status}; log {self.mix}/part-{p}.log)", file=sys.stderr)
                return 1
        if args.stage == "answers":
            return 0
        # 3. merge the finished parts
        self.call(["scripts/merge_data.py", *(str(self.kept / f"part-{p}") for p in names), "--output_dir",
                   str(self.mix / "merged"), "--overwrite"])
        if args.stage == "merge":
            return 0
        return self.train()

    def call(self, cmd: list[str], **kwargs) -> None:
        """One of the project's scripts, with ``--python``, from the repository root; its failure ends the recipe."""
        subprocess.run([self.args.python, *cmd], cwd=REPO, check=True, **kwargs)

    # ---- answers ---------------------------------------------------------------------------------------------------
    def answer_part(self, p: str) -> int:
        """make_data on the part (resuming at its first unanswered batch of 32 prompts), then its compact copy in
        KEPT; the exit status of the first that failed, else 0."""
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        make = ["scripts/make_data.py", "--output_dir", str(self.mix / f"part-{p}"), "--sources",
                str(self.mix / f"prompts-{p}.jsonl"), "--whole_conversation", "true", "--exclude", self.args.exclude,
                "--backbone", "smollm2-135m", "--dtype", self.part_dtype(p), "--device", self.args.device,
                "--max_new_tokens", "256", "--batch_size", "32"]
        keep = ["scripts/merge_data.py", str(self.mix / f"part-{p}"), "--output_dir", str(self.kept / f"part-{p}"),
                "--token_dtype", "uint16"]
        with (self.mix / f"part-{p}.log").open("w") as log:
            for cmd in (make, keep):
                try:
                    self.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                except subprocess.CalledProcessError as err:
                    return err.returncode
        shutil.rmtree(self.unfinished / f"part-{p}", ignore_errors=True)
        self.drop_empty_unfinished()
        return 0

    def part_dtype(self, p: str) -> str:
        """A started part resumes in the dtype it was started with (make_data refuses other settings); a new one:
        --dtype."""
        settings = self.mix / f"part-{p}" / "settings.json"
        if settings.is_file():
            return json.loads(settings.read_text()).get("dtype", self.args.dtype)
        return self.args.dtype

    def drop_empty_unfinished(self) -> None:
        if self.unfinished.is_dir() and not any(self.unfinished.iterdir()):
            self.unfinished.rmdir()

    def stash_part(self, p: str) -> None:
        """Copy the finished shards and answered batches (each written under a temp name, then renamed) of a part
        still being answered to KEPT/unfinished/part-NNN. Safe beside a running answers stage: an item that vanishes
        while it is copied (a chunk finished, its batches folded into a shard) is left out, and a part that finished
        meanwhile is not stashed."""
        src, dst = self.mix / f"part-{p}", self.unfinished / f"part-{p}"
        if not (src / "settings.json").is_file() or not (src / "shards").is_dir() or (src / "state.json").is_file():
            return
        shards, batches = _saved(src)
        if not shards and not batches:
            return
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "shards").mkdir(parents=True)
        shutil.copy(src / "settings.json", tmp)
        copied = {"shards": 0, "batches": 0}
        for what, items in (("shards", shards), ("batches", batches)):
            for item in items:
                into = tmp / "shards" / item.relative_to(src / "shards")
                into.parent.mkdir(parents=True, exist_ok=True)
                try:
                    if item.is_dir():
                        shutil.copytree(item, into)
                    else:
                        shutil.copy(item, into)
                except OSError:  # it vanished while it was copied
                    shutil.rmtree(into, ignore_errors=True)
                    continue
                copied[what] += 1
        finished = (src / "state.json").is_file() or (self.kept / f"part-{p}" / "provenance.json").is_file()
        if finished or not any(copied.values()):
            shutil.rmtree(tmp)
            return
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        print(f"stashed part {p}: {copied['shards']} finished shards and {copied['batches']} answered batches -> {dst}",
              flush=True)

    def restore_part(self, p: str) -> None:
        """A stash from an earlier answers stage, on a machine that has no working copy of the part."""
        src, dst = self.unfinished / f"part-{p}", self.mix / f"part-{p}"
        if (src / "settings.json").is_file() and not dst.exists():
            dst.mkdir(parents=True)
            shutil.copy(src / "settings.json", dst)
            shutil.copytree(src / "shards", dst / "shards")
            shards, batches = _saved(src)
            print(f"part {p} resumes from {len(shards)} stashed shards and {len(batches)} answered batches", flush=True)

    # ---- train -----------------------------------------------------------------------------------------------------
    def train(self) -> int:
        """Train and export (--resume continues bit-identically from the newest checkpoint). 32 sequences a step in
        all: 8 per micro-batch, 4 micro-batches shared out over the --nproc processes."""
        args = self.args
        train_dtype = args.train_dtype
        if not train_dtype:
            from tokenmaxx.heads.io.backbones import resolve_device, resolve_dtype

            train_dtype = str(resolve_dtype("auto", resolve_device(args.device))).removeprefix("torch.")
        resume = ["--resume"] if (REPO / args.run / "checkpoints" / "latest").is_file() else []
        flags = ["--data", str(self.mix / "merged"), "--backbone", "smollm2-135m", "--dtype", train_dtype,
                 "--device", args.device, "--kind", args.kind, "--num_heads", "4", "--seq_len", "768",
                 "--micro_batch_size", "8", "--grad_accum", str(4 // args.nproc), "--epochs", f"{args.epochs:g}",
                 "--lr", f"{args.lr:g}", "--warmup", str(args.warmup), "--loss", "ce", "--head_decay", "0.8",
                 "--draft_vocab_size", str(args.draft_vocab), "--loss_vocab", "draft",
                 "--feature_cache", f"{args.run}/features", "--save_every", str(args.save_every),
                 "--eval_every", "1000", "--output_dir", args.run, "--export_dir", args.export,
                 *(["--dynamic_tree", args.dynamic_tree] if args.dynamic_tree else []),
                 *(["--init_heads", args.init_heads] if args.init_heads else []), *resume]
        if args.nproc > 1:
            env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
            self.call(["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "scripts/train_heads.py",
                       *flags], env=env)
        else:
            self.call(["scripts/train_heads.py", *flags])
        print(f"heads exported to {args.export}; metrics in {args.run}/metrics.jsonl", flush=True)
        return 0


def _saved(part: Path) -> tuple[list[Path], list[Path]]:
    """A part's finished shards and the answered batches of its unfinished shards (partial-NNNNN/NNNNN)."""
    return sorted((part / "shards").glob(SHARD)), sorted((part / "shards").glob(f"partial-*/{SHARD}"))


def main(argv: list[str] | None = None) -> int:
    args = parse_flags(RecipeArgs, argv, description=__doc__.split("\n\n")[0])
    try:
        return Recipe(args).run()
    except subprocess.CalledProcessError as err:  # (its output said why)
        print(f"recipe: {' '.join(err.cmd)} failed (exit {err.returncode}); run again to resume", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_script(main))
