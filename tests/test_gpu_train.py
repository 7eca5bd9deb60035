"""scripts/gpu_train.sh: the training stage for a lent GPU, run end to end on the CPU (its dry run) on the tiny smoke
backbone: probe, runs sized to the budget, every kind exported, packed in pieces a device call can bring back."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tokenmaxx.heads import Eagle3Heads, MTPHeads, load_heads

# DeepSpeed runs, torchrun, subprocess scripts, bash dry runs: the slow tier (pytest -m "not slow" skips them)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PIECE_LIMIT = 16 * 1024 * 1024  # a device call brings back at most 8 files of 16 MiB


def test_the_dry_run_trains_every_kind_inside_its_budget_and_packs_them(tmp_path):
    env = {**os.environ, "GPU_TRAIN_PYTHON": sys.executable, "GPU_TRAIN_SMOKE": str(tmp_path / "smoke"),
           "GPU_TRAIN_WORK": str(tmp_path / "work"), "GPU_TRAIN_SMOKE_BUDGET": "600",
           "LOSS": "kl"}  # KL to the backbone, as text data trains (eagle3 then reads the final state too)
    made = subprocess.run(["bash", "scripts/gpu_train.sh", "--make-smoke", str(tmp_path / "smoke")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_train.sh", "--dry-run", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    log = (out / "gpu_train.log").read_text()
    for phase in ("setup", "merge", "probe", "train", "pack", "done"):
        assert f"==== {phase} at " in log
    assert "mtp: 3.00 epochs" in log and "eagle3: 3.00 epochs" in log  # the smoke's cap: a tiny step is fast
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"mtp", "eagle3"}
    for kind, run in summary.items():
        assert run["exported"] and run["epochs"] == 3.0 and run["steps"] == 45, (kind, run)  # 3 x 15 steps of 8
        assert len(run["head_top1"]) == 4 and run["data_rows"] == 128
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size <= PIECE_LIMIT for f in files)
    joined = tmp_path / "runs.tgz"
    joined.write_bytes(b"".join((out / f).read_bytes() for f in files if f.startswith("runs.tgz.")))
    with tarfile.open(joined) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.11.4+; Debian's 3.11.2 lacks it
        tar.extractall(tmp_path / "runs", **safe)
        assert not any("checkpoints" in name for name in tar.getnames())  # the heads travel, not the optimizer
    assert isinstance(load_heads(tmp_path / "runs" / "run-mtp" / "heads"), MTPHeads)
    assert isinstance(load_heads(tmp_path / "runs" / "run-eagle3" / "heads"), Eagle3Heads)
    for kind in ("mtp", "eagle3"):
        steps = [json.loads(line) for line in (tmp_path / "runs" / f"run-{kind}" / "metrics.jsonl").open()]
        assert [r["step"] for r in steps if r["split"] == "train"] == list(range(1, 46))
