"""train_heads --init_heads on tiny random backbones: a run that starts from trained heads, the held-out rows it may
use (only rows new to those heads), what its export records, and eval_heads reproducing its split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_cfg

from tokenmaxx.heads import DynamicTreeConfig, load_backbone, load_heads
from tokenmaxx.heads.io.card import render_model_card
from tokenmaxx.training.batches import load_data
from tokenmaxx.training.checkpoints import CheckpointMismatchError
from tokenmaxx.training.trainer import train

# DeepSpeed runs, torchrun, subprocess scripts, dry runs: the slow tier (pytest -m "not slow" skips them)
pytestmark = pytest.mark.slow


def _two_parts(data_dir: Path, out: Path) -> tuple[Path, Path]:
    """The tiny data as two make_data parts (rows 0-19; rows 20-39 plus a copy of row 0, as a prompt answered in two
    parts would be), merged as the recipe does: the first part alone, and both."""
    import datasets

    from tokenmaxx.training.merge_data import merge_data

    rows = datasets.load_from_disk(str(data_dir))
    provenance = json.loads((data_dir / "provenance.json").read_text())
    parts = []
    for name, index in (("first", list(range(20))), ("second", list(range(20, 40)) + [0])):
        path = out / name
        rows.select(index).save_to_disk(str(path))
        (path / "provenance.json").write_text(json.dumps({**provenance, "num_records": len(index),
                                                          "prompts_sha256": name * 8}))
        parts.append(path)
    merge_data(parts[:1], out / "a")
    merge_data(parts, out / "ab")
    return out / "a", out / "ab"


def test_heads_continue_training_from_trained_ones_and_hold_out_only_rows_new_to_them(tmp_path, backbone_dir,
                                                                                      data_dir, capsys):
    """--init_heads: the run starts from the trained heads' weights (its first loss is theirs, well below a fresh
    start's); it holds out eval_fraction of the rows of the part those heads never trained on, never a copy of a row
    they saw, and trains on the rest; the export records what it started from and every part seen (a later run from
    it has nothing new to hold out) and keeps the serving tree of the heads it started from ('default' drops it);
    evaluate_heads / eval_heads reproduce the run's held-out record; a resume must start from heads that saw the same
    parts; heads of another kind or shape, or data with nothing new, are one error each."""
    from tokenmaxx.scripts import eval_heads
    from tokenmaxx.training.batches import trained_parts
    from tokenmaxx.training.evaluation import evaluate_heads

    data_a, data_ab = _two_parts(data_dir, tmp_path)
    model, _ = load_backbone(str(backbone_dir))
    run = dict(kind="mtp", eval_fraction=0.5, max_steps=6, save_every=0)
    first = train(make_cfg(data_a, tmp_path / "first", dynamic_tree="dynamic:nodes=6,topk=3", **run), model=model)
    first_heads = load_heads(first.export_dir)
    assert trained_parts(first_heads.config) == ["first" * 8]

    split = dict(seq_len=48, eval_fraction=0.5, eval_max_examples=256, seed=0)
    plain = load_data(data_ab, **split)
    assert any(r < 20 for r in plain.eval)  # a fresh run would hold out rows the first heads trained on
    warm_data = load_data(data_ab, **split, seen_parts=["first" * 8])
    assert len(warm_data.eval) == 10 and set(warm_data.eval) < set(range(20, 40))  # half the new part, not row 40
    assert warm_data.train == sorted(set(range(41)) - set(warm_data.eval))  # the rest trains, row 40 too
    assert warm_data.fingerprint == plain.fingerprint
    assert load_data(data_ab, **split, seen_parts=["other"]).eval == plain.eval  # no shared part: the usual split

    warm = train(make_cfg(data_ab, tmp_path / "warm", init_heads=str(first.export_dir), **run), model=model)
    fresh = train(make_cfg(data_ab, tmp_path / "fresh", **run), model=model)
    assert warm.losses[0] < 0.9 * fresh.losses[0], (warm.losses, fresh.losses)
    warm_heads = load_heads(warm.export_dir)
    extra = warm_heads.config.extra
    assert extra["init_heads"]["source"] == str(first.export_dir) and extra["init_heads"]["seen_parts"] == ["first" * 8]
    assert extra["seen_parts"] == sorted(["first" * 8, "second" * 8]) and extra["data"]["eval_examples"] == 10
    theirs = first_heads.config.extra  # the init heads' own run, for the card's "started from" row
    assert extra["init_heads"]["run"]["steps"] == theirs["steps"]
    assert "parts" in theirs["data"]["provenance"] and "parts" not in extra["init_heads"]["run"]["data"]["provenance"]
    assert extra["init_heads"]["run"]["data"]["fingerprint"] == theirs["data"]["fingerprint"]
    assert "| started from | heads trained on " in render_model_card(warm_heads.config, "org/x").text
    assert warm_heads.config.dynamic_tree == DynamicTreeConfig(nodes=6, topk=3)  # the serving tree it started with
    found = evaluate_heads(warm_heads, model, data_ab, **split, seen_parts=trained_parts(first_heads.config))
    assert found["examples"] == 10 and found["eval_positions"] == warm.metrics["eval_positions"]
    assert found["head_top1"] == pytest.approx(warm.metrics["head_top1"], abs=2e-4)
    out = tmp_path / "eval.json"  # the command: heads made from others are scored on their run's held-out rows
    argv = ["--heads", str(warm.export_dir), "--data", str(data_ab), "--dtype", "float32", "--seq_len", "48",
            "--eval_fraction", "0.5", "--out", str(out)]
    assert eval_heads.main(argv) == 0
    assert json.loads(out.read_text())["eval_positions"] == warm.metrics["eval_positions"]
    assert eval_heads.main(argv + ["--unseen_by", str(first.export_dir)]) == 0  # the same rows, named
    assert json.loads(out.read_text())["eval_positions"] == warm.metrics["eval_positions"]
    assert eval_heads.main(argv[:6] + ["--out", str(out)]) == 0  # no split flags: the split its run recorded
    assert json.loads(out.read_text())["eval_positions"] == warm.metrics["eval_positions"]
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"--unseen_by chooses the held-out rows; --split all scores every row"):
        eval_heads.main(argv + ["--unseen_by", str(first.export_dir), "--split", "all"])

    resumable = dict(run, max_steps=4, save_every=2)
    train(make_cfg(data_ab, tmp_path / "stopped", init_heads=str(first.export_dir), **resumable), model=model,
          stop_after=2)
    with pytest.raises(CheckpointMismatchError, match=r"seen_parts: checkpoint \['firstfirst.*resume with the same"):
        train(make_cfg(data_ab, tmp_path / "stopped", resume=True, **resumable), model=model)
    resumed = train(make_cfg(data_ab, tmp_path / "stopped", resume=True, init_heads=str(first.export_dir),
                             dynamic_tree="default", **resumable), model=model)
    assert resumed.steps == 4 and load_heads(resumed.export_dir).config.dynamic_tree == DynamicTreeConfig()
    with pytest.raises(ValueError, match=r"0 row\(s\) of .*ab come from parts the initial heads were not trained on"):
        train(make_cfg(data_ab, tmp_path / "again", init_heads=str(warm.export_dir), **run), model=model)
    with pytest.raises(ValueError, match=r"do not fit this run \(num_heads: theirs 4, this run 3\): give the flags"):
        train(make_cfg(data_ab, tmp_path / "shape", init_heads=str(first.export_dir), **{**run, "num_heads": 3}),
              model=model)
    with pytest.raises(ValueError, match=r"do not fit this run \(kind: theirs 'mtp', this run 'eagle3'\)"):
        train(make_cfg(data_ab, tmp_path / "kind", init_heads=str(first.export_dir), **{**run, "kind": "eagle3"}),
              model=model)


def test_medusa_warm_start_keeps_the_static_tree_of_the_heads_it_started_from(tmp_path, backbone_dir, data_dir):
    """Static-tree kinds: a warm start's export serves with the tree the init heads were given (as tune_tree writes
    it into their config), not the library's default, and the run scores its held-out rows with that tree."""
    data_a, data_ab = _two_parts(data_dir, tmp_path)
    model, _ = load_backbone(str(backbone_dir))
    run = dict(kind="medusa", num_heads=3, eval_fraction=0.5, max_steps=2, save_every=0)
    first = train(make_cfg(data_a, tmp_path / "first", **run), model=model)
    assert load_heads(first.export_dir).config.tree is None  # the library's default
    tuned = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    config_path = first.export_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tree": tuned}))

    warm = train(make_cfg(data_ab, tmp_path / "warm", init_heads=str(first.export_dir), **run), model=model)
    assert load_heads(warm.export_dir).config.tree == tuned
    assert warm.metrics["tree_nodes"] == len(tuned) + 1  # held-out tau is the tuned tree's (root + 5 paths)
