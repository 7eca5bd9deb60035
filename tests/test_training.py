"""Head training on tiny random backbones, the parts: objective, loss vocabulary, feature cache, metrics, DeepSpeed
config. Whole runs (export, resume, torchrun, the command line): test_training_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_cfg, tiny_model

from tokenmaxx.heads import HEAD_KINDS, MedusaHeads, MTPHeads, load_backbone, load_heads
from tokenmaxx.heads.tree import default_tree
from tokenmaxx.inference import Tree
from tokenmaxx.training.batches import collate, group_by_length, load_data, step_micro_batches
from tokenmaxx.training.ds_setup import DeepSpeedConfigError, resolve_ds_config
from tokenmaxx.training.features import BackboneFeatures, FeatureCache
from tokenmaxx.training.losses import HeadsObjective, head_weights, shifted_targets, sparse_teacher, teacher_rows
from tokenmaxx.training.metrics import RankCounts, scoring_tree
from tokenmaxx.training.train_config import TrainConfig
from tokenmaxx.training.trainer import serving_tree

REPO = Path(__file__).resolve().parents[1]

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


@pytest.mark.parametrize("vocab", [None, list(range(3, 60))])
def test_step_normalisation_weighs_every_target_of_a_step_the_same(vocab):
    """Two micro-batches with the step's norm, averaged (gradient accumulation), are the one batch of both rows: a
    row's weight does not depend on which (length-grouped) micro-batch it fell in. Without the norm they differ."""
    model = tiny_model("llama")
    heads = MedusaHeads.for_backbone(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    objective = HeadsObjective(heads, loss="ce", head_decay=0.8, vocab=vocab)
    ids = torch.randint(3, 96, (3, 12))
    starts, lengths = torch.tensor([3, 8, 5]), torch.tensor([12, 11, 9])  # answers of 9, 3 and 4 tokens
    hidden = model(ids, output_hidden_states=True).hidden_states[-1].detach()
    whole, _ = objective(hidden, ids, starts, lengths, model.lm_head)
    parts = [slice(0, 1), slice(1, 3)]
    counts = [objective.target_counts(ids[p], starts[p], lengths[p], model.lm_head) for p in parts]
    assert (counts[0] + counts[1]).tolist() == objective(hidden, ids, starts, lengths, model.lm_head)[1][3].tolist()
    norm = (counts[0] + counts[1]).double() / 2
    accumulated = sum(objective(hidden[p], ids[p], starts[p], lengths[p], model.lm_head, norm=norm)[0]
                      for p in parts) / 2
    torch.testing.assert_close(accumulated, whole)
    plain = sum(objective(hidden[p], ids[p], starts[p], lengths[p], model.lm_head)[0] for p in parts) / 2
    assert not torch.allclose(plain, whole)


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


def test_a_given_top_k_teacher_is_renormalised_over_the_vocabulary_and_a_missing_one_is_the_token_itself():
    """``given_teacher`` (adapt's recorded top-k): the teacher at a position is its top-k inside the loss vocabulary,
    renormalised, zero elsewhere; where none is given (or none of it is in the vocabulary) it is the position's next
    token, so that the KL is the cross-entropy there, value and gradients."""
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    need = torch.tensor([[False, True, True, True, False]])
    top_ids = torch.tensor([[[0, 0], [7, 3], [1, 2], [4, 5], [0, 0]]])
    top_logp = torch.tensor([[[-9.0, -9.0], [-0.5, -1.5], [-0.1, -3.0], [-1.0, float("-inf")], [-9.0, -9.0]]])
    teacher = sparse_teacher((top_ids, top_logp), need, ids, size=10)  # every token in the vocabulary
    assert teacher.shape == (3, 10)
    torch.testing.assert_close(teacher.exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(teacher[0, [7, 3]], torch.tensor([-0.5, -1.5]).log_softmax(-1))
    assert teacher[2, 4] == 0.0 and (teacher[2].exp() > 0).sum() == 1  # the -inf slot is no token
    index = torch.full((10,), -1)
    index[torch.tensor([3, 7, 8, 9])] = torch.arange(4)  # a 4-token vocabulary: 3 7 8 9
    over = sparse_teacher((top_ids, top_logp), need, ids, size=4, index=index)
    torch.testing.assert_close(over[0], torch.tensor([-1e4, 0.0, -1e4, -1e4]).index_put(
        (torch.tensor([0, 1]),), torch.tensor([-1.5, -0.5]).log_softmax(-1)))  # 7 and 3, renormalised
    assert over[1].argmax() == 2 and over[1].max() == 0.0  # 1 and 2 are outside: the next token, 8, itself
    assert over[2].argmax() == 3 and over[2].max() == 0.0  # 4 is outside: 9
    alone = sparse_teacher(None, need, ids, size=10)  # nothing given: one-hot at the next tokens 7, 8, 9
    assert alone.argmax(-1).tolist() == [7, 8, 9] and alone.max(-1).values.tolist() == [0.0, 0.0, 0.0]

    model = tiny_model("llama")
    lm_head, embed = model.lm_head, model.get_input_embeddings()
    heads = MTPHeads.for_backbone(model, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    answer_start, lengths = torch.tensor([4, 6]), torch.tensor([10, 8])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1]
    results = []
    for loss, given in (("ce", False), ("kl", True)):
        objective = HeadsObjective(heads, loss=loss, given_teacher=given)
        heads.zero_grad()
        value, stats = objective(hidden, ids, answer_start, lengths, lm_head, embed=embed)
        value.backward()
        results.append((value.detach(), [p.grad.clone() for p in heads.parameters()]))
    (ce, g_ce), (kl, g_kl) = results
    torch.testing.assert_close(kl, ce)
    for a, b in zip(g_ce, g_kl):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # a soft teacher moves the loss and its gradient: head k at t is pulled towards the top-k at t+k
    soft_ids = torch.randint(3, 96, (2, 10, 4), generator=torch.Generator().manual_seed(3))
    soft = (soft_ids, torch.randn(2, 10, 4).log_softmax(-1))
    objective = HeadsObjective(heads, loss="kl", given_teacher=True)
    value, stats = objective(hidden, ids, answer_start, lengths, lm_head, embed=embed, given=soft)
    assert not torch.allclose(value, ce) and (stats[1] > 0).all()


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
    # ranked over a vocabulary the objective does not score over (train's held-out record with --loss_vocab full,
    # `tokenmaxx eval` on its heads): the ranks of an objective over that vocabulary, the loss the objective's own
    half = torch.arange(0, 96, 2)
    over = evaluate(HeadsObjective(heads, vocab=half), model.lm_head, features, data, chain(2), 4, 0, 1)
    ranked = evaluate(HeadsObjective(heads), model.lm_head, features, data, chain(2), 4, 0, 1, rank_vocab=half)
    assert ranked.pop("eval_loss") == results["all"]["eval_loss"]  # the objective's loss, over every token
    assert over.pop("eval_loss") != results["all"]["eval_loss"]
    assert ranked == over and over["vocab"] == "draft" and max(over["head_top1"]) > 0
    assert over["head_top1"] != results["all"]["head_top1"]  # (the vocabulary matters: the comparison can fail)
    with pytest.raises(ValueError, match="rank_vocab is for an objective over the whole vocabulary"):
        evaluate(HeadsObjective(heads, vocab=half), model.lm_head, features, data, chain(2), 4, 0, 1, rank_vocab=half)
    # the whole vocabulary in another order: the same metrics (the loss up to the softmax's summation order)
    assert (results["everything"].pop("vocab"), results["all"].pop("vocab")) == ("draft", "full")
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


def test_batch_width_padding_changes_no_loss_and_no_gradient(backbone_dir, data_dir, monkeypatch):
    """Batches are padded to a multiple of WIDTH_MULTIPLE positions (stable GEMM shapes); the padding is never attended
    to nor scored: the same rows give the same loss, stats and gradients at any width (eagle3: unrolled attention,
    three cached layers)."""
    from tokenmaxx.heads import Eagle3Heads
    from tokenmaxx.training import batches

    model, _ = load_backbone(str(backbone_dir))
    data = load_data(data_dir, 48, 0.2, 8, 0)
    heads = Eagle3Heads.for_backbone(model, num_heads=3, feature_layers=[0, 1, 2])
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    objective = HeadsObjective(heads, loss="ce")
    features = BackboneFeatures(model, data, heads.feature_layers)
    results = []
    for multiple in (1, 64):
        monkeypatch.setattr(batches, "WIDTH_MULTIPLE", multiple)
        batch = collate(data, data.train[:4], num_heads=3)
        assert batch.input_ids.shape[1] % multiple == 0
        heads.zero_grad()
        loss, stats = objective(features.hidden(batch), batch.input_ids, batch.answer_start, batch.lengths,
                                model.lm_head, embed=model.get_input_embeddings())
        loss.backward()
        results.append((batch.input_ids.shape[1], loss.detach(), stats, [p.grad.clone() for p in heads.parameters()]))
    (w1, l1, s1, g1), (w2, l2, s2, g2) = results
    assert w2 > w1
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(s1, s2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_length_grouping_keeps_each_steps_rows_and_cuts_padding():
    rows = list(range(100, 164))
    drawn = torch.randint(5, 300, (64,), generator=torch.Generator().manual_seed(1))
    lengths = {r: int(n) for r, n in zip(rows, drawn)}
    args = (rows, 3, 4, 2, 7, 0, 1, 4)  # from step 3, 4 steps an epoch, 2 micro-batches of 4 a step, seed 7
    plain, grouped = step_micro_batches(*args), step_micro_batches(*args, lengths=lengths)
    padded = {"plain": 0, "grouped": 0}
    for _ in range(6):  # across an epoch boundary
        a, b = next(plain), next(grouped)
        assert [len(x) for x in a] == [len(x) for x in b] and sorted(sum(a, [])) == sorted(sum(b, []))
        flat = sum(b, [])
        assert [lengths[r] for r in flat] == sorted(lengths[r] for r in flat)
        for name, batches in (("plain", a), ("grouped", b)):
            padded[name] += sum(len(x) * max(lengths[r] for r in x) for x in batches)
    assert padded["grouped"] < padded["plain"]
    again = step_micro_batches(*args, lengths=lengths)
    assert [next(again) for _ in range(2)] == [group_by_length(next(step_micro_batches(*args)), lengths),
                                               group_by_length(next(step_micro_batches(*args[:1], 4, *args[2:])),
                                                               lengths)]


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


# ---- defaults shared with the other commands, the serving tree the metrics score -----------------------------------
@pytest.mark.parametrize("native", [False, True])
def test_dtype_auto_is_bf16_only_where_native_and_threads_default_as_the_other_commands(tmp_path, data_dir,
                                                                                         monkeypatch, native):
    """Unset --dtype is auto (as generate and make-data): float32 on a CPU without native bf16 (emulated bf16 is slow
    there), bfloat16 where it is native; --dtype auto says the same and is compared with a concrete JSON value.
    --kind is eagle3 (the shipped heads', what export writes); --threads is 2 as in generate, or a launcher's
    OMP_NUM_THREADS."""
    from tokenmaxx.heads import DEFAULT_HEAD_KIND

    monkeypatch.setattr("tokenmaxx.heads.io.backbones.cpu_has_native_bf16", lambda: native)
    want = "bfloat16" if native else "float32"
    for given in (None, "auto"):
        cfg, ds = resolve_ds_config(make_cfg(data_dir, tmp_path, dtype=given, device="cpu"), 1, 36)
        assert cfg.dtype == want and ds["bf16"]["enabled"] is native
    custom = json.loads((REPO / "training" / "ds_config.json").read_text())
    custom["bf16"]["enabled"] = not native
    (path := tmp_path / "ds.json").write_text(json.dumps(custom))
    cfg, _ = resolve_ds_config(make_cfg(data_dir, tmp_path, dtype=None, device="cpu", ds_config=str(path)), 1, 36)
    assert cfg.dtype == ("float32" if native else "bfloat16")  # unset: the JSON's concrete value
    with pytest.raises(DeepSpeedConfigError, match=rf"--dtype auto \(= dtype '{want}'\) disagrees with bf16.enabled"):
        resolve_ds_config(make_cfg(data_dir, tmp_path, dtype="auto", device="cpu", ds_config=str(path)), 1, 36)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plain = TrainConfig(data=str(data_dir), output_dir=str(tmp_path))
    assert (plain.kind, plain.dtype, plain.threads) == (DEFAULT_HEAD_KIND, None, 2) and DEFAULT_HEAD_KIND == "eagle3"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun with several processes
    assert TrainConfig(data=str(data_dir), output_dir=str(tmp_path)).threads == 1
    with pytest.raises(ValueError, match="--threads must be a positive integer, got 0"):
        make_cfg(data_dir, tmp_path, threads=0)


def test_sequential_heads_record_their_serving_tree_and_are_scored_on_its_node_budget(data_dir, tmp_path):
    """The export of a run records the tree its heads generate with (unset: the library's default, written out), and
    the held-out tau is scored on a tree of that many nodes: tree_nodes is what they serve (32, or 8 as the shipped
    heads), never the 24-node Medusa default; static-tree heads are scored on their own tree."""
    model = tiny_model()
    for spec, nodes in ((None, 32), ("default", 32), ("dynamic:nodes=8,topk=8", 8), ("dynamic:nodes=6,depth=2", 6)):
        for kind, layers in (("mtp", None), ("eagle3", [0, 1, 2])):
            cfg = make_cfg(data_dir, tmp_path, kind=kind, dynamic_tree=spec, feature_layers=layers)
            settings = serving_tree(cfg, None)
            heads = HEAD_KINDS[kind].for_backbone(model, num_heads=4, feature_layers=layers, **settings)
            assert heads.config.dynamic_tree is not None and heads.config.dynamic_tree.nodes == nodes
            tree = scoring_tree(heads)
            assert tree.num_nodes == nodes and tree.depth <= (2 if "depth=2" in (spec or "") else 4), spec
            assert heads.drafter(model).nodes == nodes  # what generation drafts with: the same budget
    shipped = load_heads(REPO / "heads" / "pretrained" / "smollm2-135m")
    assert shipped.config.dynamic_tree.nodes == 8 and scoring_tree(shipped).num_nodes == 8
    medusa = MedusaHeads.for_backbone(model, num_heads=3, **serving_tree(make_cfg(data_dir, tmp_path), None))
    assert medusa.config.tree is None and scoring_tree(medusa) == default_tree(3)  # what Medusa heads serve
    own = Tree([(0,), (1,), (0, 0)])
    assert scoring_tree(MedusaHeads.for_backbone(model, num_heads=3, tree=[list(p) for p in own.paths])) == own


def _heads_with_a_record(backbone_dir: Path, folder: Path, record: dict | None) -> Path:
    model, _ = load_backbone(str(backbone_dir))
    heads = MTPHeads.for_backbone(model, num_heads=2)
    if record is not None:
        heads.config.extra = {"training": {**record, "kind": "mtp", "lr": 0.01}}
    heads.save_pretrained(folder)
    return folder


def test_eval_scores_the_split_recorded_with_the_heads_and_says_which(tmp_path, backbone_dir, data_dir, capsys):
    """Without split flags eval scores the held-out rows of the split the heads' run recorded (not its own defaults,
    which would score other rows, some trained on), and prints one line saying so; a flag given overrides its value
    and the line says which; heads recording no run get train's defaults, said so."""
    from tokenmaxx.scripts import eval_heads

    record = {"seq_len": 48, "eval_fraction": 0.3, "eval_max_examples": 256, "seed": 1}
    heads = _heads_with_a_record(backbone_dir, tmp_path / "heads", record)
    out = tmp_path / "eval.json"

    def run(folder: Path, *flags: str) -> tuple[str, dict]:
        assert eval_heads.main(["--heads", str(folder), "--data", str(data_dir), "--backbone", str(backbone_dir),
                                "--threads", "1", "--out", str(out), *flags]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("split: ")]
        assert len(lines) == 1, lines
        return lines[0], json.loads(out.read_text())

    line, metrics = run(heads)
    assert line == ("split: held-out rows of seq_len 48, eval_fraction 0.3, eval_max_examples 256, seed 1 (recorded "
                    "with the heads)")
    assert metrics["examples"] == len(load_data(data_dir, **record).eval) == 12  # 0.3 of 40 rows
    assert metrics["split_settings"] == record
    line, metrics = run(heads, "--eval_fraction", "0.1")
    assert line == ("split: held-out rows of seq_len 48, eval_fraction 0.1, eval_max_examples 256, seed 1 "
                    "(seq_len, eval_max_examples, seed: recorded with the heads; eval_fraction: given)")
    assert metrics["examples"] == len(load_data(data_dir, **{**record, "eval_fraction": 0.1}).eval) == 4
    line, metrics = run(_heads_with_a_record(backbone_dir, tmp_path / "bare", None), "--split", "all")
    assert line == ("split: every row of seq_len 512, eval_fraction 0.05, eval_max_examples 256, seed 0 (train's "
                    "default, not recorded with the heads)")
    assert metrics["examples"] == 40
