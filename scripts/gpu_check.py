#!/usr/bin/env python
"""The check on a CUDA machine: the same code on the GPU, every step below, judged in OUT/report.md.

    python scripts/gpu_check.py OUT                  on a CUDA machine where the project and its backbone are installed
                                                     (bash scripts/setup.sh); about 8 minutes
    python scripts/gpu_check.py OUT --budget 300     the whole check, the report included, in at most 300 s
    python scripts/gpu_check.py --dry-run OUT        on any machine: the same steps on the CPU at toy sizes, in fp32

Steps, in this order. Each runs as a subprocess under its time budget and is killed at it (scripts/timed.py); its exit
status, seconds and budget go into the report, and its results are copied to OUT as it ends (a check stopped later
still leaves what was done); a failed step does not stop the others. GPU budgets (480 s in all):
  1. env        device, driver, python, torch, transformers                                                        20 s
  2. bench      first: bf16 on up to 24 prompts, categories in turn, stopping in time by itself (the report says how
                many ran): eager `generate`, compiled static-cache `generate`, transformers' prompt lookup, our
                lookup, the default (EAGLE-3) heads with their own tree and tree="auto" (calibrated on 4 prompts of
                64 tokens), the hybrid with its own tree and "auto", the Medusa hybrid; tokens/s, speedup over both
                baselines, tau; compiling comes first and is untimed (the compiled baseline's decode step, our verify
                at 2-3 tree sizes, the heads' passes, through inductor), its seconds in the report                190 s
  3. fast_tier  the quick tier of the decoding tests (tiny random models built from a config) with every tensor on
                the device (TOKENMAXX_TEST_DEVICE): greedy identity, tree-verify logits vs per-path forwards on the
                device's SDPA kernels, per-round sampling distributions, MTP, lookup; CPU-only behaviour checked on
                the CPU (the on_cpu fixture)                                                                        90 s
  4. identity   greedy token identity vs plain `generate` on the real backbone in fp32, every drafting mode, on up
                to 6 prompts (stopping in time by itself, said so), its rounds captured as CUDA graphs of the eager
                kernels (--capture_backend cudagraphs: fp32 graphs are new compiles, seconds each)                  70 s
  5. latency    the verify-latency curve: one forward of 1..128 tree tokens over a 256-token cache, bf16            20 s
  6. twin       the sizes users run: random-weight Llama-3.1-8B and Qwen2.5-7B shapes made on the GPU in bf16,
                random EAGLE-3 heads: decode ms per token, the verify curve at caches of 256 and 1,024, and an
                oracle drafter (the backbone's own continuation, every node accepted) at depths 3, 5 and 7:
                speedup over eager decoding against tau                                                             50 s
  7. batch      batched generation (hybrid) against transformers' batched `generate` at 8, 16 and 64 rows of the
                12 prompts of --limit 2, bf16, one repeat, no batch started past its time budget                    40 s
  8. report     scripts/device_check.py report: OUT/report.md; exit 1 if a step failed or fp32 identity broke
--budget SECONDS scales every step's budget to fit (less REPORT_SECONDS for the report and the last kill) and cuts a
step to what is left of it; without it each step gets its own budget. The report can be made again from OUT:
python scripts/device_check.py report OUT OUT2.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tokenmaxx.scripts.errors import run_script
from tokenmaxx.scripts.timed import GRACE, REPO, Log, start, wait_all

STEPS = ("env", "bench", "fast_tier", "identity_fp32", "latency", "twin", "batch")  # in the order they run
REPORT_SECONDS = 35  # of --budget, kept for the last step's kill (GRACE) and the report
RESULTS = ("steps.tsv", "identity_fp32.json", "latency.json", "bench.json", "twin.json", "batch.json")  # copied to OUT
DEFAULT_PROMPTS = "../shared/bench/spec_bench_dev.jsonl"  # relative to the repository root
BENCH_METHODS = "baseline,{compiled},prompt_lookup,lookup,tokenmaxx,tokenmaxx:{auto},hybrid,hybrid:{auto},medusa_hybrid"
IDENTITY_METHODS = "baseline,tokenmaxx,hybrid,medusa,medusa_hybrid,lookup"
ENV_CODE = ("import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, "
            "'| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and "
            "torch.cuda.get_device_name(0))")


@dataclass(frozen=True)
class Plan:
    """What the steps run with: the GPU's sizes, or the dry run's toy ones on the CPU."""

    threads: int
    dtype: str  # the bench's, the latency curve's, the twins' and the batches'
    budgets: dict[str, int]  # step -> seconds
    fast_tier: tuple[str, ...]  # pytest's test files (and flags)
    bench: tuple[str, ...]
    identity: tuple[str, ...]
    latency: tuple[str, ...]
    twin: tuple[str, ...]
    batch: tuple[str, ...]
    compiled: str  # the compiled baseline's method name
    auto: str  # tree="auto"'s calibration

    def __post_init__(self):
        if list(self.budgets) != list(STEPS):
            raise ValueError(f"a plan budgets the steps {STEPS} in that order, not {tuple(self.budgets)}")


GPU = Plan(
    threads=8, dtype="bfloat16",
    budgets=dict(env=20, bench=190, fast_tier=90, identity_fp32=70, latency=20, twin=50, batch=40),
    fast_tier=("tests/test_loop.py", "tests/test_decoding.py", "tests/test_tree.py", "tests/test_mtp.py",
               "tests/test_lookup.py", "tests/test_budget.py", "tests/test_sampling.py", "tests/test_generator.py",
               "tests/test_round.py", "tests/test_kv.py", "tests/test_batch.py"),
    bench=("--limit", "4", "--max_new_tokens", "128", "--warmup", "1"),  # 24 prompts where the budget allows
    identity=("--limit", "1", "--max_new_tokens", "64", "--warmup", "1"),
    latency=("--sizes", "1,2,4,8,16,32,64,96,128", "--repeats", "10"),
    twin=(),
    # 8, 16 and 64 rows of the 12 prompts of --limit 2, one repeat
    batch=("--batch_sizes", "8,16,64", "--limit", "2", "--max_new_tokens", "128", "--repeats", "1"),
    # tree="auto" calibrated on half its text (4 of 8 prompts, 64 tokens): sooner, more prompts timed
    compiled="compiled", auto="auto:prompts=4,tokens=64")

# One dtype for every step, the identity step's: the costs and trees the bench measures serve it too (on a CPU with
# native bf16, "auto" would measure them all again for a second dtype: minutes). Budgets for a slow CPU.
DRY_RUN = Plan(
    threads=2, dtype="float32",
    budgets=dict(env=60, bench=1500, fast_tier=600, identity_fp32=600, latency=600, twin=600, batch=600),
    fast_tier=("tests/test_decoding.py", "tests/test_loop.py", "-x"),
    bench=("--limit", "1", "--max_new_tokens", "16", "--warmup", "1"),
    identity=("--limit", "1", "--max_new_tokens", "12", "--warmup", "1"),
    latency=("--sizes", "1,2,4,8", "--repeats", "2"),
    # the twins in fp32: a toy random model's near-flat logits tie in bf16, and a flipped argmax cuts the oracle's
    # chains (the dry run checks the oracle's code, not bf16 rounding)
    twin=("--tiny", "--sizes", "1,2,4,8", "--depths", "3,5", "--prompt_len", "32", "--new_tokens", "16",
          "--repeats", "2", "--dtype", "float32"),
    batch=("--batch_sizes", "1,2", "--limit", "1", "--max_new_tokens", "16", "--repeats", "1"),
    # the compiled baseline traced without code generation (inductor would compile for minutes on a CPU); tree="auto"
    # calibrated on toy text: the same steps, minutes sooner
    compiled="compiled:eager", auto="auto:prompts=2,tokens=16")


def step_budgets(budgets: dict[str, int], total: float | None) -> tuple[dict[str, int], float | None]:
    """Each step's seconds and the seconds after the start that the steps must end by (None: no deadline): with a
    ``total``, the budgets scaled to fill it less REPORT_SECONDS."""
    if total is None:
        return dict(budgets), None
    deadline = total - REPORT_SECONDS
    scale = deadline / sum(budgets.values())
    return {name: max(1, int(seconds * scale)) for name, seconds in budgets.items()}, deadline


class Check:
    """The steps' state: where they write, the budgets, the clock."""

    def __init__(self, plan: Plan, device: str, prompts: Path, out: Path, total: float | None):
        self.plan, self.device, self.prompts, self.out = plan, device, prompts, out
        self.budgets, self.deadline = step_budgets(plan.budgets, total)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check."))
        self.log = Log(out / "gpu_check.log")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def allowed(self, name: str, margin: int = 0) -> int:
        """The seconds step ``name`` may run now, less ``margin`` (at least 1): its budget, cut to what is left."""
        seconds = self.budgets[name]
        if self.deadline is not None:
            seconds = min(seconds, int(self.deadline - self.elapsed()))
        return max(seconds - margin, 1)

    def step(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        """Run ``cmd`` under its limit, its output also in WORK/NAME.log; record its exit status, seconds and limit (a
        step not started for want of time: status 124, limit 0); then copy the results so far to OUT."""
        limit, t0 = self.allowed(name), time.monotonic()
        if limit < 5:
            self.log.say(f"==== {name}: not started: the check's deadline ({self.deadline:.0f} s) has passed\n")
            status, limit = 124, 0
        else:
            self.log.say(f"==== {name} (budget {limit} s): {shlex.join(cmd)}\n")
            with (self.work / f"{name}.log").open("w") as own:
                proc = start(cmd, env={**self.env, **(env or {})})
                reader = threading.Thread(target=self._show, args=(proc, own), daemon=True)
                reader.start()
                (status,) = wait_all([proc], t0 + limit)
                reader.join(GRACE)  # (a process left behind by the step may hold its output open)
        seconds = round(time.monotonic() - t0)
        with (self.work / "steps.tsv").open("a") as tsv:
            tsv.write(f"{name}\t{status}\t{seconds}\t{limit}\n")
        self.log.say(f"==== {name}: exit {status} after {seconds} s (budget {limit} s)\n")
        for result in RESULTS:  # (fast_tier.log stays in WORK for the report: its output is in gpu_check.log too)
            if (self.work / result).is_file():
                shutil.copy(self.work / result, self.out / result)

    def _show(self, proc: subprocess.Popen, *more: IO) -> None:
        """The process's output, line by line, into the log (and ``more``) as it comes."""
        for line in proc.stdout:
            self.log.say(line.decode(errors="replace"), *more)

    def run(self) -> int:
        plan, dev, py, work = self.plan, self.device, sys.executable, self.work
        self.write_env()
        self.step("env", [py, "-c", ENV_CODE])
        with (work / "env.txt").open("a") as env_txt:
            env_txt.write((work / "env.log").read_text() if (work / "env.log").is_file() else "")
        bench = [py, "scripts/bench.py", "--device", dev, "--threads", str(plan.threads), "--prompts",
                 str(self.prompts), "--group_mt_bench", "--lookup_tokens", "10", "--draft", "heads"]
        # the bench and the identity run stop in time by themselves (--time_budget), short of the kill at their limit
        self.step("bench", [*bench, "--dtype", plan.dtype, "--out", str(work / "bench"), "--time_budget",
                            str(self.allowed("bench", 25)), "--methods",
                            BENCH_METHODS.format(compiled=plan.compiled, auto=plan.auto), *plan.bench])
        # the quick tier of those files: their slow tests (chi-square runs of 1,500 generations) do not fit
        self.step("fast_tier", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not real and not slow",
                                *plan.fast_tier], env={"TOKENMAXX_TEST_DEVICE": dev})
        self.step("identity_fp32", [*bench, "--dtype", "float32", "--out", str(work / "identity_fp32"),
                                    "--time_budget", str(self.allowed("identity_fp32", 10)), "--methods",
                                    IDENTITY_METHODS, *plan.identity, "--capture_backend", "cudagraphs"])
        on_device = ["--device", dev, "--dtype", plan.dtype, "--threads", str(plan.threads)]
        self.step("latency", [py, "scripts/device_check.py", "latency", *on_device, *plan.latency,
                              "--out", str(work / "latency.json")])
        self.step("twin", [py, "scripts/device_check.py", "twin", *on_device, "--out", str(work / "twin.json"),
                           *plan.twin])
        # batched generation against transformers' batched generate (stops starting batches at its time budget)
        self.step("batch", [py, "scripts/bench.py", *on_device, "--prompts", str(self.prompts), "--group_mt_bench",
                            "--draft", "hybrid", "--out", str(work / "batch"), "--time_budget",
                            str(self.allowed("batch", 10)), *plan.batch])
        report = start([py, "scripts/device_check.py", "report", str(work), str(self.out)], env=self.env)
        self._show(report)
        status = report.wait()
        shutil.rmtree(work, ignore_errors=True)
        self.log.say(f"gpu_check: report in {self.out / 'report.md'}; exit {status}\n")
        return status

    def write_env(self) -> None:
        """WORK/env.txt: the date, the system, the GPUs (nvidia-smi), the device and the mode."""
        lines = [time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()),
                 f"{platform.system()} {platform.release()} {platform.machine()}"]
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            lines += smi.stdout.strip().splitlines()
        lines.append(f"device {self.device}, dry run {int(self.plan is DRY_RUN)}")
        (self.work / "env.txt").write_text("\n".join(lines) + "\n")
        self.log.say((self.work / "env.txt").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for report.md, gpu_check.log and the steps' results")
    parser.add_argument("--dry-run", "--dry_run", action="store_true",
                        help="the same steps on the CPU at toy sizes (budgets for a slow CPU)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="seconds for the whole check, the report included: every step's budget scaled to fit, "
                             "and cut to what is left (default: each step its own budget, 480 s in all on a GPU)")
    parser.add_argument("--device", default="cuda", help="the GPU to check (the dry run: cpu)")
    parser.add_argument("--prompts", default=None, help="Spec-Bench-style jsonl of the bench, identity and batch "
                                                        f"steps (default: {DEFAULT_PROMPTS} beside the repo)")
    args = parser.parse_args(argv)
    prompts = Path(args.prompts).resolve() if args.prompts else (REPO / DEFAULT_PROMPTS).resolve()
    if not prompts.is_file():
        raise FileNotFoundError(f"no prompts file {prompts} (give --prompts)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan, device = (DRY_RUN, "cpu") if args.dry_run else (GPU, args.device)
    return Check(plan, device, prompts, out, args.budget).run()


if __name__ == "__main__":
    sys.exit(run_script(main))
