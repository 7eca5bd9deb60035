"""Whole DeepSpeed training runs on tiny random backbones: export, bit-identical resume, metrics log, MTP and EAGLE-3
heads, the draft vocabulary, torchrun, the command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import head_state, make_cfg

from tokenmaxx.heads import DynamicTreeConfig, Eagle3Heads, MTPHeads, load_backbone, load_heads
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.training.batches import load_data
from tokenmaxx.training.checkpoints import CheckpointMismatchError, check_identity
from tokenmaxx.training.ds_setup import resolve_ds_config
from tokenmaxx.training.metrics import MetricsLogger
from tokenmaxx.training.train_config import TrainConfig
from tokenmaxx.training.trainer import train

# DeepSpeed runs, torchrun, subprocess scripts, dry runs: the slow tier (pytest -m "not slow" skips them)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

# ---- training runs ----------------------------------------------------------------------------------------------
def test_train_export_and_speculative_generation(tmp_path, backbone_dir, data_dir):
    model, _ = load_backbone(str(backbone_dir))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=24, lr=5e-2, warmup=3, save_every=0,
                   feature_cache=str(tmp_path / "features"), loss="ce+kl", draft_vocab_size=40)
    result = train(cfg, model=model)
    assert sum(result.losses[-4:]) < 0.8 * sum(result.losses[:4]), result.losses  # the loss goes down
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # backbone bit-identical
    assert result.metrics["tree_tau_empirical"] > 1.2, result.metrics  # heads learned the cycles of a random model
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 25))
    heads = load_heads(result.export_dir)
    extra = heads.config.extra
    assert extra["training"]["loss"] == "ce+kl" and extra["data"]["provenance"]["sampling"] == {"greedy": True}
    assert extra["metrics"] == result.metrics and extra["wall_seconds"] > 0
    assert heads.config.backbone == str(backbone_dir)
    # the draft vocabulary: the 40 most frequent training tokens, its held-out coverage recorded
    assert heads.draft_vocab.numel() == 40 == extra["draft_vocab"]["size"]
    assert 0.5 < extra["draft_vocab"]["heldout_token_coverage"] <= 1.0
    gen = SpeculativeGenerator(model, heads, draft="heads")
    data = load_data(data_dir, seq_len=48, eval_fraction=0.1, eval_max_examples=8, seed=0)
    accepted = 0
    for row in data.eval[:3]:
        prompt = data.examples[row].ids[: data.examples[row].prompt_len][None]  # [1, P]
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
        out = gen.generate(prompt, max_new_tokens=20)
        assert out.sequences.tolist() == expected.tolist()
        accepted += out.stats.new_tokens - 1 - out.stats.steps
    assert accepted > 0  # trained heads got drafts accepted


def test_resume_is_bit_identical_and_checks_identity(tmp_path, backbone_dir, data_dir):
    model, _ = load_backbone(str(backbone_dir))
    straight = train(make_cfg(data_dir, tmp_path / "a"), model=model)  # 6 steps, 4 per epoch: crosses an epoch
    first = train(make_cfg(data_dir, tmp_path / "b"), model=model, stop_after=3)
    assert first.losses == straight.losses[:3]
    with pytest.raises(FileExistsError, match="--resume"):
        train(make_cfg(data_dir, tmp_path / "b"), model=model)
    resumed = train(make_cfg(data_dir, tmp_path / "b", resume=True), model=model)
    assert resumed.steps == 6 and resumed.losses == straight.losses[3:]  # same loss at the step after resume
    a, b = head_state(straight.export_dir), head_state(resumed.export_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the exported record counts the time of both processes, not only the last one's
    once = load_heads(straight.export_dir).config.extra
    twice = load_heads(resumed.export_dir).config.extra
    assert once["processes"] == 1 and once["wall_seconds"] == pytest.approx(straight.wall_seconds, abs=0.5)
    assert twice["processes"] == 2 and twice["wall_seconds"] > resumed.wall_seconds and "time_note" not in twice
    with pytest.raises(CheckpointMismatchError, match=r"another head shape \(num_heads: checkpoint 4, this run 3"):
        train(make_cfg(data_dir, tmp_path / "b", resume=True, num_heads=3), model=model)


def test_resume_from_a_checkpoint_without_time_records_says_so(tmp_path, backbone_dir, data_dir, monkeypatch):
    from tokenmaxx.training import checkpoints

    model, _ = load_backbone(str(backbone_dir))
    save = checkpoints.save
    monkeypatch.setattr(checkpoints, "save", lambda *a, **k: save(*a[:5]))  # as checkpoints made before the record
    train(make_cfg(data_dir, tmp_path / "b"), model=model, stop_after=3)
    monkeypatch.setattr(checkpoints, "save", save)
    resumed = train(make_cfg(data_dir, tmp_path / "b", resume=True), model=model)
    extra = load_heads(resumed.export_dir).config.extra
    assert extra["processes"] == 1 and "later processes only" in extra["time_note"]


def _logged_steps(out: Path) -> list[tuple[str, int]]:
    return [(r["split"], r["step"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_metrics_log_rewinds_to_the_step_a_run_starts_after(tmp_path):
    records = [{"split": "train", "step": s} for s in (1, 2, 3)] + [{"split": "eval", "step": 3}]
    records += [{"split": "train", "step": s} for s in (4, 5)]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"split": "tr'  # the last line cut off by a kill

    def rewound(**kwargs) -> list[tuple[str, int]]:
        (tmp_path / "metrics.jsonl").write_text(text)
        MetricsLogger(tmp_path, **kwargs).close()
        return _logged_steps(tmp_path)

    assert rewound(start_step=3) == [("train", 1), ("train", 2), ("train", 3), ("eval", 3)]
    # resuming a finished run (step 3 its last) evaluates again: its final held-out record is dropped too
    assert rewound(start_step=3, last_step=True) == [("train", 1), ("train", 2), ("train", 3)]
    assert rewound(start_step=0) == []  # a fresh start where an earlier run never reached a checkpoint
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))  # rewritten under a temp name, then renamed


def test_resumed_run_logs_each_step_once(tmp_path, backbone_dir, data_dir):
    """A process killed at step 5 logged steps 4 and 5 after its step-3 checkpoint; the resumed run redoes them and
    logs them again, so it first drops them: metrics.jsonl reads as one run."""
    model, _ = load_backbone(str(backbone_dir))
    out = tmp_path / "run"
    train(make_cfg(data_dir, out), model=model, stop_after=3)
    log = out / "metrics.jsonl"
    last = json.loads(log.read_text().splitlines()[-1])
    with open(log, "a") as f:
        f.writelines(json.dumps({**last, "step": step}) + "\n" for step in (4, 5))
    train(make_cfg(data_dir, out, resume=True), model=model)
    one_run = [("train", step) for step in range(1, 7)] + [("eval", 6)]
    assert _logged_steps(out) == one_run
    train(make_cfg(data_dir, out, resume=True), model=model)  # resuming the finished run: its final evaluation again
    assert _logged_steps(out) == one_run


def test_train_mtp_heads_resume_and_export(tmp_path, backbone_dir, data_dir):
    model, _ = load_backbone(str(backbone_dir))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mtp = dict(kind="mtp", feature_cache=str(tmp_path / "features"))  # one cache, built by the first run
    straight = train(make_cfg(data_dir, tmp_path / "a", **mtp), model=model)
    assert sum(straight.losses[-3:]) < 0.9 * sum(straight.losses[:3]), straight.losses  # the loss goes down
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # backbone bit-identical
    assert len(straight.metrics["head_top1"]) == 4 and straight.metrics["eval_positions"] > 0  # held-out metrics
    first = train(make_cfg(data_dir, tmp_path / "b", **mtp), model=model, stop_after=3)
    # the serving tree is the export's alone: a resume may set it, and the weights stay bit-identical
    resumed = train(make_cfg(data_dir, tmp_path / "b", resume=True, dynamic_tree="dynamic:nodes=6,topk=3", **mtp),
                    model=model)
    assert first.losses + resumed.losses == straight.losses
    a, b = head_state(straight.export_dir), head_state(resumed.export_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_heads(straight.export_dir).config.dynamic_tree == DynamicTreeConfig()  # unset: the library's, recorded
    assert straight.metrics["tree_nodes"] == DynamicTreeConfig().nodes  # scored on the node budget it serves with
    heads = load_heads(resumed.export_dir)
    assert heads.config.dynamic_tree == DynamicTreeConfig(nodes=6, topk=3)
    assert heads.drafter(model).config == DynamicTreeConfig(nodes=6, topk=3)  # what generation drafts with
    assert isinstance(heads, MTPHeads) and heads.config.num_heads == 4 and heads.config.num_layers == 1
    assert heads.config.layer_config["model_type"] == model.config.model_type == "llama"
    assert heads.config.extra["training"]["kind"] == "mtp" and heads.config.backbone == str(backbone_dir)
    with pytest.raises(CheckpointMismatchError, match=r"another head shape \(kind: checkpoint 'mtp', this run 'medus"):
        train(make_cfg(data_dir, tmp_path / "b", resume=True), model=model)
    with pytest.raises(ValueError, match=r"--dynamic_tree is the serving tree of sequential heads \(kinds \['eagle3', "
                                         r"'mtp'\]\); --kind medusa drafts the static tree of its config"):
        make_cfg(data_dir, tmp_path / "c", kind="medusa", dynamic_tree="dynamic:8")
    with pytest.raises(ValueError, match=r"bad dynamic tree spec 'dynamic:nodes=8,width=2' \(width\): expected "):
        make_cfg(data_dir, tmp_path / "c", kind="mtp", dynamic_tree="dynamic:nodes=8,width=2")


def test_train_eagle3_heads_from_three_cached_layers(tmp_path, backbone_dir, data_dir):
    """kind eagle3: the feature cache holds the three layers' states, the loss goes down, the export is an eagle3
    kind reading the same layers, and it generates exactly what the backbone does."""
    model, _ = load_backbone(str(backbone_dir))
    cache = tmp_path / "features"
    eagle3 = dict(kind="eagle3", feature_layers=[0, 1, 2], feature_cache=str(cache), max_steps=8)
    result = train(make_cfg(data_dir, tmp_path / "run", **eagle3), model=model)
    assert sum(result.losses[-3:]) < 0.9 * sum(result.losses[:3]), result.losses
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["feature_layers"] == [0, 1, 2] and meta["hidden_size"] == 3 * model.config.hidden_size
    heads = load_heads(result.export_dir)
    assert isinstance(heads, Eagle3Heads) and heads.feature_layers == (0, 1, 2)
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    assert SpeculativeGenerator(model, heads, draft="heads").generate(prompt, max_new_tokens=16).sequences.tolist() \
        == expected.tolist()
    mtp_only = tmp_path / "final-state-only"
    train(make_cfg(data_dir, tmp_path / "mtp", kind="mtp", max_steps=1, warmup=1, feature_cache=str(mtp_only)),
          model=model)
    with pytest.raises(ValueError, match=r"feature_layers: cache has None, this run needs a cache storing \[0, 1, 2\]"):
        train(make_cfg(data_dir, tmp_path / "e3", **{**eagle3, "feature_cache": str(mtp_only)}), model=model)


def test_one_feature_cache_serves_every_kind_and_layer_set_it_stores(tmp_path, backbone_dir, data_dir):
    """--feature_cache_layers stores more hidden states than the first run reads; later runs of another kind (MTP
    reads the final-normed state, index num_hidden_layers) or other feature layers (in another order) read their own
    columns from it and train exactly as they do on the backbone's states; a run needing a layer it lacks, or stored
    layers that do not include the run's own, end in one error."""
    model, _ = load_backbone(str(backbone_dir))
    final = model.config.num_hidden_layers
    cache = str(tmp_path / "features")
    shared = dict(max_steps=3, warmup=1, save_every=0)
    train(make_cfg(data_dir, tmp_path / "first", kind="mtp", feature_cache=cache, feature_cache_layers=[0, 1, final],
                   **shared), model=model)
    meta = json.loads((tmp_path / "features" / "meta.json").read_text())
    assert meta["feature_layers"] == [0, 1, final] and meta["hidden_size"] == 3 * model.config.hidden_size
    built = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "features").glob("shard-*")}
    for name, run in (("mtp", dict(kind="mtp")), ("eagle3", dict(kind="eagle3", feature_layers=[final, 0]))):
        cached = train(make_cfg(data_dir, tmp_path / f"{name}-cached", feature_cache=cache, **run, **shared),
                       model=model)
        direct = train(make_cfg(data_dir, tmp_path / f"{name}-direct", **run, **shared), model=model)
        assert cached.losses == pytest.approx(direct.losses, rel=1e-5), name
        assert cached.metrics["head_top1"] == pytest.approx(direct.metrics["head_top1"], abs=1e-6), name
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "features").glob("shard-*")} == built  # not rebuilt
    with pytest.raises(ValueError, match=rf"store_layers must be distinct hidden-state indices in 0..{final} "):
        train(make_cfg(data_dir, tmp_path / "bad", kind="mtp", feature_cache=str(tmp_path / "other"),
                       feature_cache_layers=[0, final + 1], **shared), model=model)
    with pytest.raises(ValueError, match=rf"heads read hidden states \[0, 1\] but store_layers \[1, {final}\] "
                                         r"lacks \[0\]"):
        train(make_cfg(data_dir, tmp_path / "bad", kind="eagle3", feature_layers=[0, 1],
                       feature_cache=str(tmp_path / "other"), feature_cache_layers=[1, final], **shared), model=model)
    with pytest.raises(ValueError, match="--feature_cache_layers says which hidden states a feature cache stores"):
        make_cfg(data_dir, tmp_path / "bad", feature_cache_layers=[0, 1])
    with pytest.raises(ValueError, match=r"--feature_cache_layers must be distinct hidden-state indices >= 0, got \[1, 1\]"):
        make_cfg(data_dir, tmp_path / "bad", feature_cache=cache, feature_cache_layers=[1, 1])


def test_held_out_metrics_per_category(tmp_path, backbone_dir, data_dir):
    """Data with make_data's category column: the final held-out metrics also come per category, over a partition of
    the held-out rows (their examples and positions add up to the whole), and go into the export."""
    tagged = _tagged(data_dir, tmp_path / "tagged")
    model, _ = load_backbone(str(backbone_dir))
    result = train(make_cfg(tagged, tmp_path / "run", max_steps=3, save_every=0, eval_fraction=0.3), model=model)
    data = load_data(tagged, seq_len=48, eval_fraction=0.3, eval_max_examples=64, seed=0)
    by_category = result.metrics["by_category"]
    assert set(by_category) == {"short", "long"}
    assert {c: m["eval_examples"] for c, m in by_category.items()} == \
        {c: sum(data.examples[r].category == c for r in data.eval) for c in ("short", "long")}
    assert sum(m["eval_positions"] for m in by_category.values()) == result.metrics["eval_positions"]
    assert by_category["short"]["head_top1"] != by_category["long"]["head_top1"]  # measured apart, not copied
    assert load_heads(result.export_dir).config.extra["metrics"]["by_category"] == by_category
    untagged = train(make_cfg(data_dir, tmp_path / "plain", max_steps=1, warmup=1, save_every=0), model=model)
    assert "by_category" not in untagged.metrics


def _tagged(data_dir: Path, out: Path) -> Path:
    """The tiny data with a category column (short / long prompts), as make_data writes one."""
    import datasets

    rows = datasets.load_from_disk(str(data_dir))
    rows.add_column("category", ["short" if len(p) <= 6 else "long" for p in rows["prompt_ids"]]).save_to_disk(out)
    (out / "provenance.json").write_text((data_dir / "provenance.json").read_text())
    return out


@pytest.mark.parametrize("loss_vocab,loss", [("draft", "ce"), ("full", "ce"), ("draft", "kl")])
def test_evaluating_exported_heads_reproduces_the_runs_held_out_metrics(tmp_path, backbone_dir, data_dir, capsys,
                                                                        loss_vocab, loss):
    """evaluate_heads / scripts/eval_heads.py on a run's export and data, with the run's split flags: the same rows
    and the same figures as the trainer's final held-out record (overall and per category), both ranked over the
    draft vocabulary the heads draft over, whether the run's loss was over it or over every token (then both records
    say "vocab": "draft", and the loss is the run's); --split all scores every row; bad flags end in one error."""
    from tokenmaxx.scripts import eval_heads
    from tokenmaxx.training.evaluation import evaluate_heads

    tagged = _tagged(data_dir, tmp_path / "tagged")
    model, _ = load_backbone(str(backbone_dir))
    run = dict(kind="eagle3", feature_layers=[0, 1, 2], draft_vocab_size=40, loss_vocab=loss_vocab, eval_fraction=0.3,
               max_steps=4, save_every=0, loss=loss)  # kl: the features carry the backbone's final state too
    result = train(make_cfg(tagged, tmp_path / "run", **run), model=model)
    heads = load_heads(result.export_dir)
    split = dict(seq_len=48, eval_fraction=0.3, eval_max_examples=256, seed=0)
    found = evaluate_heads(heads, model, tagged, **split)
    assert found["split"] == "held_out"
    for got, want in [(found, result.metrics)] + [(found["by_category"][c], m)
                                                 for c, m in result.metrics["by_category"].items()]:
        assert got["eval_positions"] == want["eval_positions"]
        for key in ("head_top1", "head_top5", "tree_tau_empirical", "eval_loss"):
            assert got[key] == pytest.approx(want[key], abs=2e-4), key
    assert found["vocab"] == result.metrics["vocab"] == "draft"  # both records say what they ranked over
    assert set(found["by_category"]) == {"short", "long"}
    everything = evaluate_heads(heads, model, tagged, split="all", vocab="full", **split)
    assert everything["examples"] == len(load_data(tagged, **split).examples) > found["examples"]
    assert everything["eval_positions"] > found["eval_positions"]

    out = tmp_path / "eval.json"
    argv = ["--heads", str(result.export_dir), "--data", str(tagged), "--backbone", str(backbone_dir), "--dtype",
            "float32", "--seq_len", "48", "--eval_fraction", "0.3", "--out", str(out)]
    assert eval_heads.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| all | " in printed and "| short | " in printed and "| long | " in printed
    written = json.loads(out.read_text())
    assert written["kind"] == "eagle3" and written["head_top1"] == pytest.approx(found["head_top1"], abs=1e-4)
    heads.set_draft_vocab(None)
    with pytest.raises(ValueError, match="these heads have none; use vocab='full'"):
        evaluate_heads(heads, model, tagged, vocab="draft", **split)
    with pytest.raises(ValueError, match=r"--split must be one of \('held_out', 'all'\), got 'test'"):
        eval_heads.main(argv + ["--split", "test"])


def test_the_step_profile_accounts_for_every_phase(tmp_path, backbone_dir, data_dir, capsys):
    from tokenmaxx.scripts import profile_training

    argv = ["--data", str(data_dir), "--backbone", str(backbone_dir), "--kind", "eagle3", "--feature_layers", "0", "1",
            "2", "--dtype", "float32", "--num_heads", "2", "--seq_len", "48", "--micro_batch_size", "4",
            "--grad_accum", "2", "--draft_vocab_size", "40", "--steps", "2", "--warmup", "1",
            "--feature_cache", str(tmp_path / "features")]
    assert profile_training.main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record["share"]) == set(profile_training.PHASES) and abs(sum(record["share"].values()) - 1) < 0.01
    assert record["positions_per_s"] > 0 and record["positions_per_step"] > 0
    assert (tmp_path / "features" / "meta.json").is_file()


def test_train_over_the_draft_vocabulary(tmp_path, backbone_dir, data_dir):
    """--loss_vocab draft: trains (loss falls), exports the same vocabulary it trained on, resumes bit-identically,
    and a checkpoint made over the whole vocabulary is refused."""
    model, _ = load_backbone(str(backbone_dir))
    mtp = dict(kind="mtp", feature_cache=str(tmp_path / "features"), draft_vocab_size=24, loss_vocab="draft")
    straight = train(make_cfg(data_dir, tmp_path / "a", **mtp), model=model)
    assert sum(straight.losses[-3:]) < 0.9 * sum(straight.losses[:3]), straight.losses
    heads = load_heads(straight.export_dir)
    record = heads.config.extra["draft_vocab"]
    assert record["loss"] is True and record["size"] == heads.draft_vocab.numel() == 24
    first = train(make_cfg(data_dir, tmp_path / "b", **mtp), model=model, stop_after=3)
    resumed = train(make_cfg(data_dir, tmp_path / "b", resume=True, **mtp), model=model)
    assert first.losses + resumed.losses == straight.losses
    full = dict(mtp, loss_vocab="full")
    train(make_cfg(data_dir, tmp_path / "c", **full), model=model, stop_after=3)
    with pytest.raises(CheckpointMismatchError, match=r"other training settings \(loss_vocab: checkpoint None, this run 24"):
        train(make_cfg(data_dir, tmp_path / "c", resume=True, **mtp), model=model)
    with pytest.raises(ValueError, match="--loss_vocab draft .* --draft_vocab_size"):
        make_cfg(data_dir, tmp_path / "d", loss_vocab="draft")
    with pytest.raises(ValueError, match=r"--loss_vocab must be one of \('full', 'draft'\), got 'some'"):
        make_cfg(data_dir, tmp_path / "d", loss_vocab="some", draft_vocab_size=24)


def test_a_draft_vocabulary_larger_than_the_data_shrinks_with_one_note(tmp_path, backbone_dir, data_dir, capsys):
    """--draft_vocab_size above the distinct tokens of the training sequences: the vocabulary is what the data has,
    and one note says so and why (it used to shrink without a word)."""
    model, _ = load_backbone(str(backbone_dir))
    result = train(make_cfg(data_dir, tmp_path / "run", kind="mtp", draft_vocab_size=4096, max_steps=1, warmup=1,
                            save_every=0),
                   model=model)
    size = load_heads(result.export_dir).draft_vocab.numel()
    assert size < 96  # the tiny vocabulary's tokens the data holds
    notes = [line for line in capsys.readouterr().err.splitlines() if "--draft_vocab_size" in line]
    assert notes == [f"note: --draft_vocab_size 4096 shrank to {size}: the training sequences hold only {size} "
                     "distinct tokens (more data gives a larger draft vocabulary)"]
    train(make_cfg(data_dir, tmp_path / "fits", kind="mtp", draft_vocab_size=24, max_steps=1, warmup=1, save_every=0),
          model=model)
    assert "shrank" not in capsys.readouterr().err


def _train_heads_main():
    spec = importlib.util.spec_from_file_location("train_heads", REPO / "scripts" / "train_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_kind_flag_is_checked(data_dir):
    main = _train_heads_main()
    with pytest.raises(ValueError, match=r"--kind must be a registered head kind, one of \[.*'mtp'.*\]; got 'bogus'"):
        main(["--data", str(data_dir), "--output_dir", "unused", "--kind", "bogus"])
    with pytest.raises(ValueError, match="--kind mtp always projects with the backbone's frozen lm_head"):
        main(["--data", str(data_dir), "--output_dir", "unused", "--kind", "mtp", "--share_lm_head", "false"])
    assert TrainConfig(data=str(data_dir), output_dir="unused", kind="mtp").kind == "mtp"


def test_warmup_longer_than_the_run_is_refused(tmp_path, data_dir, capsys):
    with pytest.raises(ValueError, match=r"--warmup 7 is more than --max_steps 6"):
        make_cfg(data_dir, tmp_path, warmup=7)
    assert make_cfg(data_dir, tmp_path, warmup=6).warmup == 6  # warming up over the whole run is allowed
    # nobody asked for the default warm-up (20 steps), longer than one epoch here (36 examples, 4 steps): the run
    # warms up over its first half instead, and says so
    cfg, ds = resolve_ds_config(make_cfg(data_dir, tmp_path, warmup=None, max_steps=None), 1, 36)
    assert (cfg.max_steps, cfg.warmup, ds["scheduler"]["params"]["warmup_num_steps"]) == (4, 2, 2)
    assert "default warm-up of 20 steps is longer than this run's 4 steps" in capsys.readouterr().err


def test_output_dir_is_required(tmp_path, data_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="output_dir"):
        TrainConfig(data=str(data_dir))
    with pytest.raises(ValueError, match="--output_dir is required"):
        TrainConfig(data=str(data_dir), output_dir="")
    with pytest.raises(SystemExit) as exit_:
        _train_heads_main()(["--data", str(data_dir), "--max_steps", "1"])
    assert exit_.value.code == 2 and "required: --output_dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written under the current folder


def test_bad_input_ends_in_one_error_line(tmp_path, data_dir):
    cmd = [sys.executable, str(REPO / "scripts" / "train_heads.py"), "--data", str(data_dir), "--output_dir",
           str(tmp_path / "run"), "--max_steps", "6", "--warmup", "7"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: --warmup 7 is more than --max_steps 6"), out.stderr


def test_generation_does_not_import_deepspeed(backbone_dir):
    """Only training imports DeepSpeed (whose import prints "Setting accelerator to CPU"): loading a backbone folder
    and generating leave it out. (transformers' save_pretrained imports it through accelerate when it is installed.)"""
    code = ("import sys, torch\n"
            "from tokenmaxx.heads import MedusaHeads, load_backbone\n"
            "from tokenmaxx.inference import SpeculativeGenerator\n"
            f"model, _ = load_backbone({str(backbone_dir)!r})\n"
            "gen = SpeculativeGenerator(model, MedusaHeads.for_backbone(model, num_heads=2), draft='heads')\n"
            "gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]" and "Setting accelerator" not in out.stderr, out.stderr


def test_checkpoint_of_another_backbone_is_refused(tmp_path):
    found = {"backbone": "smollm2-135m", "backbone_revision": "b179", "num_heads": 4}
    with pytest.raises(CheckpointMismatchError, match="another backbone .*backbone: checkpoint 'smollm2-135m'"):
        check_identity(found, {**found, "backbone": "qwen2.5-coder-0.5b", "backbone_revision": "1d96"}, tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_agree(tmp_path, backbone_dir, data_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "scripts" / "train_heads.py"), "--data", str(data_dir), "--backbone", str(backbone_dir),
           "--kind", "mtp", "--dtype", "float32", "--output_dir", str(tmp_path / "run"), "--seq_len", "48",
           "--max_steps", "3",
           "--micro_batch_size", "2", "--grad_accum", "2", "--warmup", "1", "--lr", "0.01", "--zero_stage", "2",
           "--feature_cache", str(tmp_path / "features")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout ends the workers too
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-5000:]
    extra = load_heads(tmp_path / "run" / "heads").config.extra
    digests = extra["rank_weight_digests"]
    assert extra["world_size"] == 2 and len(digests) == 2 and digests[0] == digests[1]
    assert len(list((tmp_path / "features").glob("shard-*.safetensors"))) == 1  # 40 rows, one 256-row shard


def test_cli_help_explains_every_flag():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "train_heads.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the help text
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"--{f.name} has no help text"
        assert f"--{f.name}" in out.stdout and " ".join(f.metadata["help"].split()[:4]) in text, f.name


def test_train_prints_only_its_json_on_stdout_and_the_tree_nodes_its_heads_serve(tmp_path, backbone_dir, data_dir):
    """`train ... | jq` works: DeepSpeed's log lines go to stderr, stdout is the result's JSON alone. The tree_nodes it
    reports are the node budget of the serving tree the exported heads record (8 here, as the shipped heads), and the
    run used --threads."""
    cmd = [sys.executable, str(REPO / "scripts" / "train_heads.py"), "--data", str(data_dir), "--backbone",
           str(backbone_dir), "--feature_layers", "0", "1", "2", "--dtype", "float32", "--output_dir",
           str(tmp_path / "run"), "--seq_len", "48", "--max_steps", "2", "--warmup", "1", "--micro_batch_size", "4",
           "--grad_accum", "1", "--dynamic_tree", "dynamic:nodes=8", "--threads", "1"]
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # this process's group: not the child's
    env = {k: v for k, v in os.environ.items() if k not in dist}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**env, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)  # the whole of stdout: one JSON object
    heads = load_heads(result["export_dir"])
    assert heads.config.kind == "eagle3" and heads.config.dynamic_tree == DynamicTreeConfig(nodes=8)
    assert result["tree_nodes"] == heads.config.extra["metrics"]["tree_nodes"] == 8
    assert heads.config.extra["machine"]["threads"] == 1 and heads.config.extra["training"]["threads"] == 1
