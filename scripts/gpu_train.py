#!/usr/bin/env python
"""The training stage of scripts/recipe_eagle3.py on one GPU, every kind at once, ended inside a time budget.

    python scripts/gpu_train.py OUT             on a CUDA machine: the committed parts of the mix (distilled/), every
                                                kind in --kinds trained at once on the one GPU, sized to --budget
    python scripts/gpu_train.py --smoke OUT     the same steps on a tiny random backbone and data (made in OUT/smoke),
                                                on --device: a minute, before the real run
    python scripts/gpu_train.py --dry-run OUT   the smoke run on the CPU (tests/test_gpu_train.py runs it)

Steps (the log, OUT/gpu_train.log, has each one's start):
  1. env       the versions the run needs: torch, transformers, DeepSpeed, datasets, pyarrow; the smoke run's tiny
               backbone and data
  2. merge     the parts -> one dataset in OUT/merged (scripts/merge_data.py), as the recipe's merge stage; --data
               names a dataset to train on instead
  3. probe     each kind --probe steps, all kinds at once, on the real runs' split (OUT/probe-KIND): seconds a step
               (median after the first two), the steps an epoch takes and the run's fixed cost (start, held-out eval,
               export)
  4. train     each kind for as many epochs as the budget leaves (at most --max_epochs, at least --min_epochs), all at
               once (OUT/run-KIND, its log OUT/run-KIND.log); the LR schedule is sized to that, so a run ends annealed;
               a run past the budget is stopped and its last checkpoint (every --save_every steps) is what is left
  5. summary   OUT/summary.json: each kind's steps, seconds, positions/s and held-out accuracy; its exported heads are
               in OUT/run-KIND/heads
Exit status 0 when every run exported its heads, 1 when one did not, 2 when a step before the runs failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmaxx.scripts.errors import run_script
from tokenmaxx.scripts.timed import REPO, Log, start, wait_all

PARTS = "distilled/smollm2-mix/part-*"  # the committed parts of the mix, from the repository root
DYNAMIC_TREE = "dynamic:nodes=8,topk=8,min_mass=0.5"  # the exported serving tree (the shipped heads')
ENV_CODE = ("import sys, torch, transformers, deepspeed, datasets, pyarrow; print('python', sys.version.split()[0], "
            "'| torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', "
            "deepspeed.__version__, '| datasets', datasets.__version__, '| pyarrow', pyarrow.__version__, '| cuda', "
            "torch.cuda.is_available() and torch.cuda.get_device_name(0))")
STOP_BEFORE = 15  # seconds before the budget at which the runs are stopped: the summary
SPARE = 45  # seconds the train step leaves: the summary, and the slack of concurrent runs


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: the real backbone's, or the tiny smoke backbone's. A flag given overrides either."""

    budget: float  # seconds from the start to the summary
    seq_len: int
    micro: int  # sequences a step, in one micro-batch
    draft_vocab: int
    probe: int  # probe steps
    warmup: int
    save_every: int
    max_epochs: float


REAL = Sizes(budget=500, seq_len=768, micro=32, draft_vocab=8192, probe=10, warmup=100, save_every=100, max_epochs=12)
# the tiny smoke backbone: 2 layers (eagle3 reads layers 0, 1, 2 of its hidden states), vocabulary 96
SMOKE = Sizes(budget=240, seq_len=48, micro=8, draft_vocab=64, probe=4, warmup=2, save_every=4, max_epochs=3)


class Failed(Exception):
    """A step before the runs failed: the run stops there (exit status 2)."""


def make_smoke(folder: Path) -> None:
    """The smoke run's backbone (a tiny random Llama, the tests' own) and one part of its greedy answers."""
    sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny model and tokenizer
    import torch
    from datasets import Dataset
    from helpers import greedy_answers, tiny_model
    from tiny_tokenizer import tiny_tokenizer

    model = tiny_model("llama", seed=1)
    model.save_pretrained(folder / "backbone")
    tiny_tokenizer().save_pretrained(folder / "backbone")
    gen, rows = torch.Generator().manual_seed(0), []
    for n, prompt_len in enumerate((3, 6, 9, 12) * 4):  # 16 groups of 8 prompts, two categories
        prompts = torch.randint(4, 96, (8, prompt_len), generator=gen)
        for p, a in zip(prompts.tolist(), greedy_answers(model, prompts, 24).tolist()):
            rows.append({"prompt": " ".join(map(str, p)), "prompt_ids": p, "answer_ids": a,
                         "category": ("chat", "math")[n % 2]})
    Dataset.from_list(rows).save_to_disk(str(folder / "part-000"))
    (folder / "part-000" / "provenance.json").write_text(json.dumps(
        {"backbone": str(folder / "backbone"), "backbone_revision": None, "sampling": {"greedy": True}}))


def epochs_for(probe: Path, left: float, micro: int, most: float, least: float) -> tuple[float, str]:
    """The epochs a run fits in ``left`` seconds, from its probe's seconds a step and fixed cost; and a line saying
    how they were found."""
    from tokenmaxx.training.ds_setup import steps_per_epoch

    steps = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in steps if r["split"] == "train"]
    step_s = statistics.median(r["step_s"] for r in train if r["step"] > 2)
    extra = json.loads((probe / "heads" / "config.json").read_text())["extra"]
    fixed = extra["wall_seconds"] - sum(r["step_s"] for r in train)
    per_epoch = steps_per_epoch(extra["data"]["train_examples"], 1, micro, 1)
    epochs = max(least, min(most, (left - 1.5 * fixed) / (step_s * per_epoch)))
    return epochs, (f"probe: {step_s:.3f} s a step, fixed {fixed:.0f} s, {per_epoch} steps an epoch, {left:.0f} s "
                    f"left -> {epochs:.2f} epochs")


def summary(out: Path, kinds: list[str]) -> dict:
    """Each kind's run, from its exported heads' record (``exported: False`` where it exported none)."""
    runs = {}
    for kind in kinds:
        config = out / f"run-{kind}" / "heads" / "config.json"
        if not config.exists():
            runs[kind] = {"exported": False}
            continue
        extra = json.loads(config.read_text())["extra"]
        runs[kind] = {"exported": True, "steps": extra["steps"], "wall_seconds": extra["wall_seconds"],
                      "train_positions_per_s": extra["train_positions_per_s"], "device": extra["machine"]["device"],
                      "epochs": extra["requested"].get("epochs"), "data_rows": extra["data"]["rows"],
                      **{k: extra["metrics"][k] for k in ("head_top1", "head_top5", "eval_examples")
                         if k in extra["metrics"]}}
    return runs


class Training:
    """The steps' state: the settings, OUT, the backbone and data the runs read, the clock."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, out: Path):
        self.args, self.sizes, self.out = args, sizes, out
        self.smoke = args.smoke or args.dry_run
        self.device, self.dtype = ("cpu", "float32") if args.dry_run else (args.device, "bfloat16")
        self.backbone, self.data = "smollm2-135m", out / "merged"
        self.log = Log(out / "gpu_train.log")
        self.started = time.monotonic()
        self.deadline = self.started + sizes.budget - STOP_BEFORE  # the runs are stopped then

    def run(self) -> int:
        """The steps in order; 1 when a run exported no heads."""
        self.phase("env")
        self.check_env()
        self.phase("merge")
        self.merge()
        self.phase("probe")
        self.probe()
        self.phase("train")
        failed = self.train()
        self.phase("summary")
        text = json.dumps(summary(self.out, self.args.kinds), indent=2) + "\n"
        (self.out / "summary.json").write_text(text)
        self.log.say(text)
        self.phase("done")
        return failed

    def phase(self, name: str) -> None:
        self.log.say(f"==== {name} at {time.monotonic() - self.started:.0f} s\n")

    def check_env(self) -> None:
        """The versions the runs need (an import that fails stops the run); the smoke run's backbone and data."""
        env = subprocess.run([sys.executable, "-c", ENV_CODE], cwd=REPO, capture_output=True, text=True)
        self.log.say("".join(line + "\n" for line in (env.stdout + env.stderr).splitlines() if "WARNING" not in line))
        if env.returncode != 0:
            raise Failed("the environment is incomplete")
        if self.smoke:
            make_smoke(self.out / "smoke")
            self.backbone = str(self.out / "smoke" / "backbone")

    def merge(self) -> None:
        """The parts -> OUT/merged (unless --data names the dataset)."""
        if self.args.data:
            self.data = Path(self.args.data).resolve()
            if not self.data.is_dir():
                raise Failed(f"--data {self.data} is no folder")
            return
        if self.smoke:
            parts = [self.out / "smoke" / "part-000"]
        else:
            parts = [Path(p).resolve() for p in self.args.parts] or sorted(REPO.glob(PARTS))
        merge = subprocess.run([sys.executable, "scripts/merge_data.py", *map(str, parts), "--output_dir",
                                str(self.data), "--overwrite", "--token_dtype", "uint16"], cwd=REPO,
                               capture_output=True, text=True)
        self.log.say(merge.stdout + merge.stderr)
        if merge.returncode != 0:
            raise Failed(f"merging {' '.join(map(str, parts))} failed")

    def probe(self) -> None:
        """Every kind at once, as the real runs will share the GPU: --probe steps on the real runs' split and eval."""
        probes = [self.start_run(kind, f"probe-{kind}", "--max_steps", str(self.sizes.probe), "--warmup", "2",
                                 "--save_every", "0") for kind in self.args.kinds]
        for kind, status in zip(self.args.kinds, wait_all(probes, self.deadline)):
            if status != 0:
                self.log.say(self.tail(f"probe-{kind}.log", 20))
                raise Failed(f"the {kind} probe failed (exit {status})")

    def train(self) -> int:
        """Every kind at once, for the epochs its probe says fit the time left; 1 when a run failed."""
        sizes, began = self.sizes, time.monotonic()
        left, runs = sizes.budget - (began - self.started) - SPARE, []
        for kind in self.args.kinds:
            epochs, note = epochs_for(self.out / f"probe-{kind}", left, sizes.micro, sizes.max_epochs,
                                      self.args.min_epochs)
            self.log.say(f"{note}\n{kind}: {epochs:.2f} epochs\n")
            runs.append(self.start_run(kind, f"run-{kind}", "--epochs", f"{epochs:.2f}", "--warmup",
                                       str(sizes.warmup), "--save_every", str(sizes.save_every)))
        failed = 0
        for kind, status in zip(self.args.kinds, wait_all(runs, self.deadline)):
            self.log.say(f"run-{kind}: exit {status} after {time.monotonic() - began:.0f} s\n")
            if status != 0:
                self.log.say(self.tail(f"run-{kind}.log", 5))
                failed = 1
        return failed

    def start_run(self, kind: str, name: str, *more: str) -> subprocess.Popen:
        """One scripts/train_heads.py run in the background, into OUT/NAME, its output in OUT/NAME.log."""
        args, sizes, folder = self.args, self.sizes, self.out / name
        layers = ["--feature_layers", "0", "1", "2"] if self.smoke and kind == "eagle3" else []
        cmd = [sys.executable, "scripts/train_heads.py", "--data", str(self.data), "--backbone", self.backbone,
               "--device", self.device, "--dtype", self.dtype, "--kind", kind, "--num_heads", "4", *layers,
               "--seq_len", str(sizes.seq_len), "--micro_batch_size", str(sizes.micro), "--grad_accum", "1",
               "--lr", f"{args.lr:g}", "--loss", args.loss, "--head_decay", "0.8",
               "--draft_vocab_size", str(sizes.draft_vocab), "--loss_vocab", "draft", "--output_dir", str(folder),
               "--export_dir", str(folder / "heads"),
               *(["--dynamic_tree", args.dynamic_tree] if args.dynamic_tree else []),
               *(["--init_heads", args.init_heads] if args.init_heads else []), *more]
        with (self.out / f"{name}.log").open("w") as log:
            return start(cmd, output=log)

    def tail(self, name: str, lines: int) -> str:
        return "".join(line + "\n" for line in (self.out / name).read_text().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a new (or empty) folder: the runs, their logs, summary.json, gpu_train.log")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="a tiny random backbone and data, on --device")
    mode.add_argument("--dry-run", "--dry_run", action="store_true", help="the smoke run on the CPU, in fp32")
    parser.add_argument("--kinds", nargs="+", default=["mtp", "eagle3"], help="head kinds, trained at once")
    parser.add_argument("--device", default="cuda", help="the GPU to train on (the dry run: cpu)")
    parser.add_argument("--parts", nargs="*", default=[], help=f"the parts to train on (default: all of {PARTS})")
    parser.add_argument("--data", help="a dataset folder to train on instead of the merged parts (make-text-data's)")
    parser.add_argument("--loss", default="ce", help="ce; kl for text the backbone did not write")
    parser.add_argument("--init_heads", help="start from these heads (folder or Hub id)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--min_epochs", type=float, default=0.5, help="epochs a run gets however short the time")
    parser.add_argument("--dynamic_tree", default=DYNAMIC_TREE, help="the exported serving tree ('': the library's)")
    for name, kind in ((f.name, f.type) for f in dataclasses.fields(Sizes)):
        parser.add_argument(f"--{name}", type=float if kind == "float" else int, default=None,
                            help=f"default {getattr(REAL, name)}, the smoke run {getattr(SMOKE, name)}"
                                 + (" (seconds from the start to the summary)" if name == "budget" else ""))
    args = parser.parse_args(argv)
    base = SMOKE if args.smoke or args.dry_run else REAL
    sizes = dataclasses.replace(base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                                         if getattr(args, f.name) is not None})
    out = Path(args.out).resolve()
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: name a new folder")
    out.mkdir(parents=True, exist_ok=True)
    training = Training(args, sizes, out)
    try:
        return training.run()
    except Failed as err:
        training.log.say(f"gpu_train: {err}\n")
        return 2


if __name__ == "__main__":
    sys.exit(run_script(main))
