"""scripts/recipe_eagle3.py across runs on different machines: the finished shards and answered batches of a part
still being answered are stashed in the kept folder (committed to git), and a later answers stage on a fresh machine
resumes the part from them; a part that finishes leaves no stash behind. The stages' Python is stood in for by a stub
(--python) that logs what it was asked to run."""

from pathlib import Path

import pytest

from tokenmaxx.scripts import recipe_eagle3
from tokenmaxx.scripts.errors import parse_flags

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
def recipe(tmp_path, monkeypatch, capsys):
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    mix, kept = tmp_path / "mix", tmp_path / "kept"
    mix.mkdir()
    kept.mkdir()
    (mix / "mix.json").write_text("{}")  # the prompts stage has run
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "log"))

    def run(stage: str, parts: int = 1, **flags: str) -> str:
        """The recipe up to ``stage``; what it printed."""
        flags = {"dtype": "auto", **flags}
        argv = ["--python", str(stub), "--mix", str(mix), "--kept", str(kept), "--stage", stage, "--parts", str(parts),
                "--jobs", "1", *(word for name, value in flags.items() for word in (f"--{name}", value))]
        assert recipe_eagle3.main(argv) == 0
        return capsys.readouterr().out

    return mix, kept, run


def _part(folder: Path, shards: list[str], finished: bool = False) -> None:
    (folder / "shards").mkdir(parents=True)
    (folder / "settings.json").write_text('{"num_prompts": 2048}')
    for name in shards:
        (folder / "shards" / name).mkdir(parents=True)
        (folder / "shards" / name / "data-00000-of-00001.arrow").write_text(name)
    if finished:
        (folder / "state.json").write_text("{}")


@pytest.mark.slow
def test_unfinished_parts_are_stashed_and_resumed_on_a_fresh_machine(recipe):
    mix, kept, run = recipe
    # shards 0-1 finished; shard 2 being answered: batches 0-1 saved, batch 2 being saved
    _part(mix / "part-000",
          ["00000", "00001", "partial-00002/00000", "partial-00002/00001", "partial-00002/.tmp-00002"])
    out = run("stash")
    stash = kept / "unfinished" / "part-000"
    assert "stashed part 000: 2 finished shards and 2 answered batches" in out
    assert sorted(p.name for p in (stash / "shards").iterdir()) == ["00000", "00001", "partial-00002"]
    assert sorted(p.name for p in (stash / "shards" / "partial-00002").iterdir()) == ["00000", "00001"]  # no temp
    assert (stash / "settings.json").read_text() == '{"num_prompts": 2048}'
    assert (stash / "shards" / "00001" / "data-00000-of-00001.arrow").read_text() == "00001"
    batch = stash / "shards" / "partial-00002" / "00001"
    assert (batch / "data-00000-of-00001.arrow").read_text() == "partial-00002/00001"

    # a later run: a fresh machine has the committed folder but no working copy of the part
    for f in sorted((mix / "part-000").rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    (mix / "part-000").rmdir()
    out = run("answers")
    assert "part 000 resumes from 2 stashed shards and 2 answered batches" in out
    assert (mix / "part-000.started_from").read_text().split() == ["00000", "00001", "partial-00002"]
    assert (kept / "part-000" / "provenance.json").is_file()
    assert not (kept / "unfinished").exists()  # the finished part's stash is gone


@pytest.mark.slow
def test_stash_skips_finished_and_kept_parts_and_never_overwrites_a_working_copy(recipe):
    mix, kept, run = recipe
    _part(mix / "part-000", ["00000"], finished=True)  # assembled: nothing to stash
    _part(mix / "part-001", ["00000"])
    (kept / "part-001").mkdir()
    (kept / "part-001" / "provenance.json").write_text("{}")  # already kept
    _part(mix / "part-002", [])  # started, no shard finished yet
    out = run("stash", parts=3)
    assert "stashed" not in out and not (kept / "unfinished").exists()
    _part(mix / "part-003", ["partial-00000/00000"])  # only a batch of its first shard answered: stashed too
    _part(mix / "part-004", ["partial-00000/.tmp-00000"])  # its first batch still being saved: nothing to stash
    out = run("stash", parts=5)
    assert "stashed part 003: 0 finished shards and 1 answered batches" in out
    assert "part 004" not in out and not (kept / "unfinished" / "part-004").exists()
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


@pytest.mark.slow
def test_new_parts_are_answered_in_the_machines_dtype_and_started_parts_keep_their_own(recipe):
    mix, kept, run = recipe
    _part(mix / "part-000", ["00000"])
    (mix / "part-000" / "settings.json").write_text('{\n  "chunk_size": 256,\n  "dtype": "bfloat16",\n  "seed": 0\n}')
    run("answers", parts=2)
    log = (mix.parent / "log").read_text().splitlines()
    assert f"scripts/make_data.py {mix}/part-000 bfloat16" in log  # make_data would refuse other settings
    assert f"scripts/make_data.py {mix}/part-001 auto" in log  # make_data: bf16 where it is native, else fp32
    run("answers", parts=3, dtype="bfloat16")  # chosen by hand
    assert f"scripts/make_data.py {mix}/part-002 bfloat16" in (mix.parent / "log").read_text().splitlines()


@pytest.mark.slow
def test_a_stash_of_a_part_that_finished_meanwhile_is_dropped(recipe):
    """A stash copied beside an answers stage just as its part finished would otherwise outlive the part."""
    mix, kept, run = recipe
    _part(kept / "unfinished" / "part-000", ["00000"])
    (kept / "part-000").mkdir()
    (kept / "part-000" / "provenance.json").write_text("{}")  # the part is kept: finished
    run("stash")
    assert not (kept / "unfinished").exists()


@pytest.mark.slow
def test_the_training_stage_exports_the_shipped_serving_tree_and_can_start_from_trained_heads(recipe):
    """The exported heads hold the node budget the shipped ones have (--dynamic_tree; empty: the library default), so
    shipping a run's heads needs no hand edit of its config; --init_heads / --epochs / --lr continue from trained
    heads."""
    mix, kept, run = recipe
    train = mix.parent / "log.train"
    run("train", train_dtype="float32", kind="mtp")
    flags = train.read_text().split()
    assert flags[flags.index("--dynamic_tree") + 1] == "dynamic:nodes=8,topk=8,min_mass=0.5"
    assert flags[flags.index("--kind") + 1] == "mtp" and "--resume" not in flags and "--init_heads" not in flags
    assert (float(flags[flags.index("--epochs") + 1]), float(flags[flags.index("--lr") + 1])) == (3, 1e-3)
    run("train", train_dtype="float32", init_heads="heads/pretrained/smollm2-135m", epochs="1", lr="3e-4")
    flags = train.read_text().split()  # more parts on top of the shipped heads
    assert flags[flags.index("--init_heads") + 1] == "heads/pretrained/smollm2-135m"
    assert (float(flags[flags.index("--epochs") + 1]), float(flags[flags.index("--lr") + 1])) == (1, 3e-4)
    run("train", train_dtype="float32", dynamic_tree="dynamic:nodes=4")
    flags = train.read_text().split()
    assert flags[flags.index("--dynamic_tree") + 1] == "dynamic:nodes=4"
    run("train", train_dtype="float32", dynamic_tree="")
    assert "--dynamic_tree" not in train.read_text().split()


def test_the_recipe_refuses_an_unknown_stage_and_answers_two_parts_at_once_only_on_a_small_cpu():
    with pytest.raises(SystemExit) as stopped:
        parse_flags(recipe_eagle3.RecipeArgs, ["--stage", "nope"])
    assert stopped.value.code == 2
    assert [recipe_eagle3.default_jobs(d, c) for d, c in (("auto", 2), ("cpu", 4), ("cpu", 8), ("cuda", 2))] == [
        2, 2, 1, 1]
    args = parse_flags(recipe_eagle3.RecipeArgs, ["--kind", "mtp", "--jobs", "2"])
    assert (args.run, args.export, args.nproc) == ("runs/smollm2-mtp", "runs/smollm2-mtp/heads", 2)
