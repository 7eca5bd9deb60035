"""DeepSpeed head training on tiny random backbones: objective, cache, metrics, resume, torchrun, export."""

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
from helpers import tiny_model
from datasets import Dataset
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import DraftHeads, MedusaHeads, MTPHeads, load_backbone
from tokenmaxx.inference import SpeculativeGenerator, Tree
from tokenmaxx.training.batches import collate, load_data
from tokenmaxx.training.checkpoints import CheckpointMismatchError, check_identity
from tokenmaxx.training.ds_setup import DeepSpeedConfigError, resolve_ds_config
from tokenmaxx.training.features import BackboneFeatures, FeatureCache
from tokenmaxx.training.losses import HeadsObjective, head_weights, shifted_targets, teacher_rows
from tokenmaxx.training.metrics import MetricsLogger, RankCounts
from tokenmaxx.training.train_config import TrainConfig
from tokenmaxx.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
ANSWER_LEN = 24


# ---- fixtures: a tiny backbone on disk and its own greedy answers ---------------------------------------------------
@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-backbone")
    tiny_model("llama", seed=1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@torch.no_grad()
def greedy_answers(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] (same length) -> the backbone's greedy continuation [B, new_tokens] (no EOS stop)."""
    ids = prompts
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1]:]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, backbone_dir) -> Path:
    model, _ = load_backbone(str(backbone_dir))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt_len in (3, 6, 9, 12):  # 4 groups of 10 prompts
        prompts = torch.randint(4, 96, (10, prompt_len), generator=gen)
        for p, a in zip(prompts.tolist(), greedy_answers(model, prompts, ANSWER_LEN).tolist()):
            rows.append({"prompt": " ".join(map(str, p)), "prompt_ids": p, "answer_ids": a})
    path = tmp_path_factory.mktemp("data") / "tiny"
    Dataset.from_list(rows).save_to_disk(str(path))
    ident, revision = str(backbone_dir), None
    (path / "provenance.json").write_text(json.dumps({"backbone": ident, "backbone_revision": revision,
                                                      "sampling": {"greedy": True}}))
    return path


def make_cfg(data_dir: Path, out: Path, **overrides) -> TrainConfig:
    values = dict(data=str(data_dir), backbone="unused", kind="medusa", dtype="float32", output_dir=str(out), seq_len=48,
                  max_steps=6, lr=3e-2, warmup=2, micro_batch_size=4, grad_accum=2, eval_fraction=0.1, save_every=3)
    return TrainConfig(**{**values, **overrides})


def head_state(export_dir: Path) -> dict[str, torch.Tensor]:
    return DraftHeads.from_pretrained(export_dir).state_dict()


# ---- objective --------------------------------------------------------------------------------------------------
def test_head_k_at_t_targets_token_t_plus_k_plus_1():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0]])  # prompt 10 11 12 | answer 13 14 15 | pad
    targets, valid = shifted_targets(ids, answer_start=torch.tensor([3]), lengths=torch.tensor([6]), num_heads=2)
    # head 1 at t targets t+2: t=0 -> 12 is in the prompt (not trained), t=1..3 -> 13..15, t=4 -> past the end
    assert targets[0, 0, :4].tolist() == [12, 13, 14, 15] and valid[0, 0].tolist() == [0, 1, 1, 1, 0, 0, 0]
    # head 2 at t targets t+3: t=0..2 -> 13..15
    assert targets[1, 0, :3].tolist() == [13, 14, 15] and valid[1, 0].tolist() == [1, 1, 1, 0, 0, 0, 0]
    # KL teacher of head k at t: the backbone's distribution at t+k (its prediction of the same token t+k+1)
    need, row = teacher_rows(valid)
    assert need[0].tolist() == [0, 0, 1, 1, 1, 0, 0]  # teacher rows: positions 2, 3, 4 -> 0, 1, 2
    assert row[0, 0, :4].tolist() == [-1, 0, 1, 2] and row[1, 0, :3].tolist() == [0, 1, 2]


def _fused_equals_unfused(objective, call):
    """Run the objective fused (linear_cross_entropy) and unfused (materialised logits): same loss, stats and
    gradients. Returns the fused run's (loss, stats, gradients)."""
    results = []
    for fused in (True, False):
        objective.fused = fused
        objective.heads.zero_grad()
        value, stats = call()
        value.backward()
        results.append((value.detach(), stats, [p.grad.clone() for p in objective.heads.parameters()]))
    (v1, s1, g1), (v2, s2, g2) = results
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(s1, s2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    return v1, s1, g1


@pytest.mark.parametrize("loss", ["ce", "kl", "ce+kl"])
def test_objective_fused_matches_logits_path(loss):
    model = tiny_model("llama")
    heads = MedusaHeads.for_backbone(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    objective = HeadsObjective(heads, loss=loss, head_decay=0.8)
    ids = torch.randint(3, 96, (2, 10))
    hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [B, T, H]
    v1, s1, _ = _fused_equals_unfused(objective, lambda: objective(hidden, ids, torch.tensor([4, 6]),
                                                                   torch.tensor([10, 8]), model.lm_head))
    assert v1 > 0 and model.lm_head.weight.grad is None  # the shared lm_head stays frozen
    assert s1[3].tolist() == [8, 8, 8]  # (10 - 4) + (8 - 6) targets inside the answers, for every head
    assert (s1[0] > 0).all() and ((s1[1] > 0).all() if loss != "ce" else (s1[1] == 0).all())


@pytest.mark.parametrize("loss", ["ce", "ce+kl"])
def test_objective_mtp_scores_each_depth_of_the_unroll(loss):
    model = tiny_model("llama")
    lm_head, embed = model.lm_head, model.get_input_embeddings()
    heads = MTPHeads.for_backbone(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():  # leave the identity start: o_proj / down_proj are zero-initialised
            p.add_(torch.randn(p.shape) * 0.05)
    objective = HeadsObjective(heads, loss=loss, head_decay=0.8)
    ids = torch.randint(3, 96, (2, 10))
    answer_start, lengths = torch.tensor([4, 6]), torch.tensor([10, 8])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [B, T, H]
    v1, s1, g1 = _fused_equals_unfused(objective, lambda: objective(hidden, ids, answer_start, lengths, lm_head,
                                                                    embed=embed))
    assert all(g.abs().sum() > 0 for g in g1)  # the loss reaches every weight (depth d reads depth d-1's output)
    assert lm_head.weight.grad is None and embed.weight.grad is None  # backbone modules stay frozen
    # Reference: the module's own logits of the whole unroll [D, B, T, V], scored where depth d = head k has a target.
    with torch.no_grad():
        logits = heads(hidden, ids, lm_head=lm_head, embed=embed)
    targets, valid = shifted_targets(ids, answer_start, lengths, num_heads=3)  # [D, B, T]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none")
    ce = ce.view(valid.shape)
    per_depth = torch.stack([ce[d][valid[d]].mean() for d in range(3)])  # [D]
    torch.testing.assert_close(s1[0], per_depth)
    assert s1[3].tolist() == [8, 8, 8]
    if loss == "ce":
        weights = torch.tensor(head_weights(3, 0.8))
        torch.testing.assert_close(v1, (weights * per_depth).sum() / weights.sum())
    else:
        assert (s1[1] > 0).all()
    with pytest.raises(ValueError, match="embed=model.get_input_embeddings"):
        objective(hidden, ids, answer_start, lengths, lm_head)


@pytest.mark.parametrize("kind", ["medusa", "mtp"])
@pytest.mark.parametrize("loss", ["ce", "ce+kl"])
def test_objective_over_a_loss_vocabulary(kind, loss):
    """vocab=: the softmax is over those tokens only, targets outside are not trained, and the fused path agrees."""
    model = tiny_model("llama")
    lm_head, embed = model.lm_head, model.get_input_embeddings()
    heads = (MTPHeads if kind == "mtp" else MedusaHeads).for_backbone(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    answer_start, lengths = torch.tensor([4, 6]), torch.tensor([10, 8])
    targets, valid = shifted_targets(ids, answer_start, lengths, num_heads=3)  # [D, B, T]
    answer_tokens = sorted(set(targets[valid].tolist()))
    vocab = torch.tensor(answer_tokens[::2] + [0, 1, 2])  # about half of the targets, and some tokens never a target
    objective = HeadsObjective(heads, loss=loss, head_decay=0.8, vocab=vocab)
    hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [B, T, H]
    v1, s1, g1 = _fused_equals_unfused(objective, lambda: objective(hidden, ids, answer_start, lengths, lm_head,
                                                                    embed=embed))
    assert lm_head.weight.grad is None and all(g.abs().sum() > 0 for g in g1)
    # Reference: full-vocabulary logits, restricted to the vocabulary's columns, scored on in-vocabulary targets.
    with torch.no_grad():
        logits = heads(hidden, ids, lm_head=lm_head, embed=embed)  # one contract for every kind
    sub = torch.log_softmax(logits[..., vocab].float(), dim=-1)  # [D, B, T, Vd]
    inside = torch.isin(targets, vocab) & valid
    position = {int(t): i for i, t in enumerate(vocab)}
    for d in range(3):
        want = torch.tensor([position[int(t)] for t in targets[d][inside[d]]])
        ce = -sub[d][inside[d]].gather(1, want[:, None]).squeeze(1)
        torch.testing.assert_close(s1[0, d], ce.mean(), atol=1e-5, rtol=1e-5)
        assert s1[3, d] == inside[d].sum() < valid[d].sum()  # out-of-vocabulary targets are not counted
    with pytest.raises(ValueError, match="distinct token ids"):
        HeadsObjective(heads, vocab=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="token id 500, but the lm_head has only 96 rows"):
        HeadsObjective(heads, vocab=torch.tensor([3, 500]))(hidden, ids, answer_start, lengths, lm_head, embed=embed)


def test_heldout_metrics_count_targets_outside_the_loss_vocabulary_as_misses(backbone_dir, data_dir):
    from tokenmaxx.heads.tree import chain
    from tokenmaxx.training.metrics import evaluate

    model, _ = load_backbone(str(backbone_dir))
    data = load_data(str(data_dir), 48, 0.3, 64, 0)
    features = BackboneFeatures(model, data)
    heads = MedusaHeads.for_backbone(model, num_heads=2)  # untrained: every head repeats the backbone's guess
    answers = {t for r in data.eval for t in data.examples[r].ids[data.examples[r].prompt_len:].tolist()}
    never = torch.tensor(sorted(set(range(96)) - answers))  # tokens no held-out target is
    assert never.numel() > 0
    results = {}
    for name, vocab in (("all", None), ("never", never), ("everything", torch.arange(96).flip(0))):
        objective = HeadsObjective(heads, vocab=vocab)
        results[name] = evaluate(objective, model.lm_head, features, data, chain(2), 4, 0, 1)
    # the whole vocabulary in another order: the same metrics (the loss up to the softmax's summation order)
    assert results["everything"].pop("eval_loss") == pytest.approx(results["all"].pop("eval_loss"), rel=1e-5)
    assert results["everything"] == results["all"]
    assert max(results["all"]["head_top5"]) > 0
    # no target can be guessed: every rank misses, yet every position still counts
    assert results["never"]["head_top5"] == [0.0, 0.0] and results["never"]["tree_tau_empirical"] == 1.0
    assert results["never"]["eval_positions"] == results["all"]["eval_positions"]


# ---- features and metrics ----------------------------------------------------------------------------------------
def test_feature_cache_matches_backbone_and_resumes(tmp_path, backbone_dir, data_dir):
    model, _ = load_backbone(str(backbone_dir))
    data = load_data(data_dir, seq_len=48, eval_fraction=0.1, eval_max_examples=8, seed=0)
    cache = FeatureCache.build_or_open(tmp_path / "cache", model, data, 48, num_heads=4, shard_size=16)
    shards = sorted((tmp_path / "cache").glob("shard-*.safetensors"))
    assert len(shards) == 3
    batch = collate(data, data.train[:5], num_heads=3)  # fewer heads than the cache's lookback: a shorter window
    torch.testing.assert_close(cache.hidden(batch), BackboneFeatures(model, data).hidden(batch), atol=1e-5, rtol=1e-5)
    kept = shards[0].stat().st_mtime_ns
    shards[1].unlink()  # as if the build was killed before that shard was renamed into place
    FeatureCache.build_or_open(tmp_path / "cache", model, data, 48, num_heads=4, shard_size=16)
    assert shards[1].is_file() and shards[0].stat().st_mtime_ns == kept
    with pytest.raises(ValueError, match="seq_len"):
        FeatureCache.build_or_open(tmp_path / "cache", model, data, 40, num_heads=4, shard_size=16)


def test_rank_table_and_tree_tau():
    tree = Tree([(0,), (1,), (0, 0)])
    counts = RankCounts(num_heads=2, tree=tree)
    ranks = torch.tensor([[0, 0, 1, 3], [0, 2, 0, 0]])  # [K, n]
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    counts.add(ranks, valid)
    s = counts.summary()
    approx = lambda v: pytest.approx(v, abs=1e-4)  # noqa: E731  (summaries are rounded to 4 digits)
    assert s["rank_acc"][0][:4] == approx([0.5, 0.25, 0.0, 0.25]) and s["rank_acc"][1][:3] == approx([2 / 3, 0, 1 / 3])
    assert s["head_top1"] == approx([0.5, 2 / 3])
    assert s["rank_acc_given_prev_top1"][1][:3] == [0.5, 0.0, 0.5]  # head 2 where head 1 was right (positions 0, 1)
    # product: 1 + acc1[0] + acc1[1] + acc1[0] * acc2[0]; empirical: (0,) at 0,1; (1,) at 2; (0,0) at 0
    assert s["tree_tau_product"] == approx(1 + 0.5 + 0.25 + 0.5 * 2 / 3)
    assert s["tree_tau_empirical"] == 1 + 4 / 4


# ---- DeepSpeed config ---------------------------------------------------------------------------------------------
def test_ds_config_flags_fill_auto_and_conflicts_fail(tmp_path, data_dir):
    cfg, ds = resolve_ds_config(make_cfg(data_dir, tmp_path, lr=None, epochs=None, max_steps=None), 1, 36)
    assert ds["optimizer"]["params"]["lr"] == cfg.lr == 1e-3 and ds["bf16"]["enabled"] is False
    assert ds["scheduler"]["params"]["total_num_steps"] == cfg.max_steps == 4  # one epoch: 36 // 4 // 2
    assert ds["train_batch_size"] == 8 and ds["optimizer"]["params"]["torch_adam"] is True
    custom = json.loads((REPO / "training" / "ds_config.json").read_text())
    custom["optimizer"]["params"]["lr"] = 0.5
    custom["gradient_accumulation_steps"] = 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(custom))
    cfg, ds = resolve_ds_config(make_cfg(data_dir, tmp_path, ds_config=str(path), lr=None), 1, 36)
    assert cfg.lr == 0.5  # the JSON's concrete value where the flag is not given
    with pytest.raises(DeepSpeedConfigError, match=r"--lr 0.001 disagrees with optimizer.params.lr = 0.5"):
        resolve_ds_config(make_cfg(data_dir, tmp_path, ds_config=str(path), lr=1e-3), 1, 36)
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps"):
        resolve_ds_config(make_cfg(data_dir, tmp_path, ds_config=str(path), lr=None, grad_accum=4), 1, 36)
    cfg, _ = resolve_ds_config(make_cfg(data_dir, tmp_path, max_steps=None, epochs=2.0), 1, 36)
    assert cfg.max_steps == 8 and cfg.epochs is None  # --epochs becomes a step count: 2 x 4 steps per epoch
    custom["scheduler"]["params"]["total_num_steps"] = 5
    path.write_text(json.dumps(custom))
    with pytest.raises(DeepSpeedConfigError, match=r"--epochs 2.0 \(= max_steps 8\) disagrees with .*total_num_steps"):
        resolve_ds_config(make_cfg(data_dir, tmp_path, ds_config=str(path), lr=None, max_steps=None, epochs=2.0), 1, 36)
    custom["optimizer"]["params"]["torch_adam"] = False
    path.write_text(json.dumps(custom))
    with pytest.raises(DeepSpeedConfigError, match="torch_adam"):
        resolve_ds_config(make_cfg(data_dir, tmp_path, ds_config=str(path), lr=None), 1, 36)


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
    heads = DraftHeads.from_pretrained(result.export_dir)
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
    once = DraftHeads.from_pretrained(straight.export_dir).config.extra
    twice = DraftHeads.from_pretrained(resumed.export_dir).config.extra
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
    extra = DraftHeads.from_pretrained(resumed.export_dir).config.extra
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
    resumed = train(make_cfg(data_dir, tmp_path / "b", resume=True, **mtp), model=model)
    assert first.losses + resumed.losses == straight.losses
    a, b = head_state(straight.export_dir), head_state(resumed.export_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    heads = DraftHeads.from_pretrained(resumed.export_dir)
    assert isinstance(heads, MTPHeads) and heads.config.num_heads == 4 and heads.config.num_layers == 1
    assert heads.config.layer_config["model_type"] == model.config.model_type == "llama"
    assert heads.config.extra["training"]["kind"] == "mtp" and heads.config.backbone == str(backbone_dir)
    with pytest.raises(CheckpointMismatchError, match=r"another head shape \(kind: checkpoint 'mtp', this run 'medus"):
        train(make_cfg(data_dir, tmp_path / "b", resume=True), model=model)


def test_train_over_the_draft_vocabulary(tmp_path, backbone_dir, data_dir):
    """--loss_vocab draft: trains (loss falls), exports the same vocabulary it trained on, resumes bit-identically,
    and a checkpoint made over the whole vocabulary is refused."""
    model, _ = load_backbone(str(backbone_dir))
    mtp = dict(kind="mtp", feature_cache=str(tmp_path / "features"), draft_vocab_size=24, loss_vocab="draft")
    straight = train(make_cfg(data_dir, tmp_path / "a", **mtp), model=model)
    assert sum(straight.losses[-3:]) < 0.9 * sum(straight.losses[:3]), straight.losses
    heads = DraftHeads.from_pretrained(straight.export_dir)
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
           "--dtype", "float32", "--output_dir", str(tmp_path / "run"), "--seq_len", "48", "--max_steps", "3",
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
    extra = DraftHeads.from_pretrained(tmp_path / "run" / "heads").config.extra
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
