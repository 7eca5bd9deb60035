"""scripts/recipe_eagle3.sh across sessions: the finished shards and answered batches of a part still being answered
are stashed in the kept folder (committed to git), and a later session on a fresh machine resumes the part from them;
a part that finishes leaves no stash behind. Python is stood in for by a stub that logs what it was asked to run."""

import os
import subprocess
from pathlib import Path

import pytest

# DeepSpeed runs, torchrun, subprocess scripts, bash dry runs: the slow tier (pytest -m "not slow" skips them)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "scripts" / "recipe_eagle3.sh"

STUB = r"""#!/usr/bin/env bash
# python stand-in: logs the script (and the dtype asked for; train_heads: all its flags); make_data notes the shards it
# starts from, merge_data writes a finished part
script=$1; shift
[ "$script" = scripts/train_heads.py ] && echo "$*" > "$STUB_LOG.train"
out= dtype=
while [ $# -gt 0 ]; do [ "$1" = --output_dir ] && out=$2; [ "$1" = --dtype ] && dtype=$2; shift; done
echo "$script $out $dtype" >> "$STUB_LOG"
case "$script" in
  scripts/make_data.py) mkdir -p "$out/shards" && ls "$out/shards" > "$out.started_from" ;;
  scripts/merge_data.py) mkdir -p "$out" && echo '{}' > "$out/provenance.json" ;;
  scripts/train_heads.py) ;;
  *) exit 3 ;;
esac
"""


@pytest.fixture
def recipe(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    mix, kept = tmp_path / "mix", tmp_path / "kept"
    mix.mkdir()
    kept.mkdir()
    (mix / "mix.json").write_text("{}")  # the prompts stage has run

    def run(stage: str, parts: int = 1, **knobs: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PY": str(stub), "MIX": str(mix), "KEPT": str(kept), "STAGE": stage,
               "PARTS": str(parts), "JOBS": "1", "STUB_LOG": str(tmp_path / "log"),
               "DTYPE": "auto", **knobs}
        out = subprocess.run(["bash", str(RECIPE)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out

    return mix, kept, run


def _part(folder: Path, shards: list[str], finished: bool = False) -> None:
    (folder / "shards").mkdir(parents=True)
    (folder / "settings.json").write_text('{"num_prompts": 2048}')
    for name in shards:
        (folder / "shards" / name).mkdir(parents=True)
        (folder / "shards" / name / "data-00000-of-00001.arrow").write_text(name)
    if finished:
        (folder / "state.json").write_text("{}")


def test_unfinished_parts_are_stashed_and_resumed_on_a_fresh_machine(recipe):
    mix, kept, run = recipe
    # shards 0-1 finished; shard 2 being answered: batches 0-1 saved, batch 2 being saved
    _part(mix / "part-000", ["00000", "00001", "partial-00002/00000", "partial-00002/00001", "partial-00002/.tmp-00002"])
    out = run("stash")
    stash = kept / "unfinished" / "part-000"
    assert "stashed part 000: 2 finished shards and 2 answered batches" in out.stdout
    assert sorted(p.name for p in (stash / "shards").iterdir()) == ["00000", "00001", "partial-00002"]
    assert sorted(p.name for p in (stash / "shards" / "partial-00002").iterdir()) == ["00000", "00001"]  # no temp
    assert (stash / "settings.json").read_text() == '{"num_prompts": 2048}'
    assert (stash / "shards" / "00001" / "data-00000-of-00001.arrow").read_text() == "00001"
    batch = stash / "shards" / "partial-00002" / "00001"
    assert (batch / "data-00000-of-00001.arrow").read_text() == "partial-00002/00001"

    # a later session: a fresh machine has the committed folder but no working copy of the part
    for f in sorted((mix / "part-000").rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    (mix / "part-000").rmdir()
    out = run("answers")
    assert "part 000 resumes from 2 stashed shards and 2 answered batches" in out.stdout
    assert (mix / "part-000.started_from").read_text().split() == ["00000", "00001", "partial-00002"]
    assert (kept / "part-000" / "provenance.json").is_file()
    assert not (kept / "unfinished").exists()  # the finished part's stash is gone


def test_stash_skips_finished_and_kept_parts_and_never_overwrites_a_working_copy(recipe):
    mix, kept, run = recipe
    _part(mix / "part-000", ["00000"], finished=True)  # assembled: nothing to stash
    _part(mix / "part-001", ["00000"])
    (kept / "part-001").mkdir()
    (kept / "part-001" / "provenance.json").write_text("{}")  # already kept
    _part(mix / "part-002", [])  # started, no shard finished yet
    out = run("stash", parts=3)
    assert "stashed" not in out.stdout and not (kept / "unfinished").exists()
    _part(mix / "part-003", ["partial-00000/00000"])  # only a batch of its first shard answered: stashed too
    _part(mix / "part-004", ["partial-00000/.tmp-00000"])  # its first batch still being saved: nothing to stash
    out = run("stash", parts=5)
    assert "stashed part 003: 0 finished shards and 1 answered batches" in out.stdout
    assert "part 004" not in out.stdout and not (kept / "unfinished" / "part-004").exists()
    (kept / "unfinished" / "part-003").rename(mix.parent / "stash-003")  # (out of the way of the answers stage)

    # a working copy that is further along than an old stash is not replaced by it
    _part(kept / "unfinished" / "part-002", ["00000"])
    (mix / "part-002" / "shards" / "00000").mkdir()
    (mix / "part-002" / "shards" / "00001").mkdir()
    run("answers", parts=3)
    assert (mix / "part-002.started_from").read_text().split() == ["00000", "00001"]
    log = (mix.parent / "log").read_text()
    assert "part-001" not in log  # kept parts are never answered again
    assert not (kept / "unfinished").exists()


def test_new_parts_are_answered_in_the_machines_dtype_and_started_parts_keep_their_own(recipe):
    mix, kept, run = recipe
    _part(mix / "part-000", ["00000"])
    (mix / "part-000" / "settings.json").write_text('{\n  "chunk_size": 256,\n  "dtype": "bfloat16",\n  "seed": 0\n}')
    run("answers", parts=2)
    log = (mix.parent / "log").read_text().splitlines()
    assert f"scripts/make_data.py {mix}/part-000 bfloat16" in log  # make_data would refuse other settings
    assert f"scripts/make_data.py {mix}/part-001 auto" in log  # make_data: bf16 where it is native, else fp32
    run("answers", parts=3, DTYPE="bfloat16")  # chosen by hand
    assert f"scripts/make_data.py {mix}/part-002 bfloat16" in (mix.parent / "log").read_text().splitlines()


def test_a_stash_of_a_part_that_finished_meanwhile_is_dropped(recipe):
    """A stash copied beside an answers stage just as its part finished would otherwise outlive the part."""
    mix, kept, run = recipe
    _part(kept / "unfinished" / "part-000", ["00000"])
    (kept / "part-000").mkdir()
    (kept / "part-000" / "provenance.json").write_text("{}")  # the part is kept: finished
    run("stash")
    assert not (kept / "unfinished").exists()


def test_the_training_stage_exports_the_shipped_serving_tree_and_can_start_from_trained_heads(recipe):
    """The exported heads carry the node budget the shipped ones have (DYNAMIC_TREE; empty: the library default), so
    shipping a run's heads needs no hand edit of its config; INIT_HEADS / EPOCHS / LR continue from trained heads."""
    mix, kept, run = recipe
    train = mix.parent / "log.train"
    run("train", TRAIN_DTYPE="float32", KIND="mtp")
    flags = train.read_text().split()
    assert flags[flags.index("--dynamic_tree") + 1] == "dynamic:nodes=8,topk=8,min_mass=0.5"
    assert flags[flags.index("--kind") + 1] == "mtp" and "--resume" not in flags and "--init_heads" not in flags
    assert (flags[flags.index("--epochs") + 1], flags[flags.index("--lr") + 1]) == ("3", "1e-3")
    run("train", TRAIN_DTYPE="float32", INIT_HEADS="heads/pretrained/smollm2-135m", EPOCHS="1", LR="3e-4")
    flags = train.read_text().split()  # more parts on top of the shipped heads
    assert flags[flags.index("--init_heads") + 1] == "heads/pretrained/smollm2-135m"
    assert (flags[flags.index("--epochs") + 1], flags[flags.index("--lr") + 1]) == ("1", "3e-4")
    run("train", TRAIN_DTYPE="float32", DYNAMIC_TREE="dynamic:nodes=4")
    flags = train.read_text().split()
    assert flags[flags.index("--dynamic_tree") + 1] == "dynamic:nodes=4"
    run("train", TRAIN_DTYPE="float32", DYNAMIC_TREE="")
    assert "--dynamic_tree" not in train.read_text().split()
