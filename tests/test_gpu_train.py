"""scripts/gpu_train.py: the training stage on one GPU, run end to end on the CPU (its dry run) on the tiny smoke
backbone: probe, runs sized to the budget, every kind exported into OUT; and the sizing rule on a hand-made probe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmaxx.heads import Eagle3Heads, MTPHeads, load_heads
from tokenmaxx.scripts.gpu_train import epochs_for

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_trains_every_kind_inside_its_budget_and_exports_them(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/gpu_train.py", "--dry-run", str(out), "--budget", "600",
                           "--loss", "kl"],  # KL to the backbone, as text data trains (eagle3 reads the final state)
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    log = (out / "gpu_train.log").read_text()
    for phase in ("env", "merge", "probe", "train", "summary", "done"):
        assert f"==== {phase} at " in log
    assert "mtp: 3.00 epochs" in log and "eagle3: 3.00 epochs" in log  # the smoke's cap: a tiny step is fast
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"mtp", "eagle3"}
    for kind, run in summary.items():
        assert run["exported"] and run["epochs"] == 3.0 and run["steps"] == 45, (kind, run)  # 3 x 15 steps of 8
        assert len(run["head_top1"]) == 4 and run["data_rows"] == 128
    assert isinstance(load_heads(out / "run-mtp" / "heads"), MTPHeads)
    assert isinstance(load_heads(out / "run-eagle3" / "heads"), Eagle3Heads)
    for kind in ("mtp", "eagle3"):
        steps = [json.loads(line) for line in (out / f"run-{kind}" / "metrics.jsonl").open()]
        assert [r["step"] for r in steps if r["split"] == "train"] == list(range(1, 46))
        assert (out / f"run-{kind}.log").is_file() and (out / f"probe-{kind}.log").is_file()
    again = subprocess.run([sys.executable, "scripts/gpu_train.py", "--dry-run", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "is not empty" in again.stderr  # a finished run is never overwritten


def test_the_epochs_fill_the_time_left_after_the_fixed_cost_within_their_bounds(tmp_path):
    """Seconds a step: the median after the first two (compiles, warm-up); the fixed cost (start, eval, export) counts
    1.5 times; an epoch of 320 examples in micro-batches of 32 is 10 steps."""
    probe = tmp_path / "probe"
    (probe / "heads").mkdir(parents=True)
    seconds = [5.0, 3.0] + [1.0] * 8
    (probe / "metrics.jsonl").write_text("".join(json.dumps({"split": "train", "step": i + 1, "step_s": s}) + "\n"
                                                 for i, s in enumerate(seconds)))
    extra = {"wall_seconds": sum(seconds) + 20, "data": {"train_examples": 320}}
    (probe / "heads" / "config.json").write_text(json.dumps({"extra": extra}))
    epochs, note = epochs_for(probe, left=100, micro=32, most=12, least=0.5)
    assert epochs == pytest.approx(7.0) and "1.000 s a step, fixed 20 s, 10 steps an epoch" in note
    assert epochs_for(probe, left=10, micro=32, most=12, least=0.5)[0] == 0.5
    assert epochs_for(probe, left=1000, micro=32, most=12, least=0.5)[0] == 12
