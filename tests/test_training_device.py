"""Training follows the backbone's device, checked on a CPU-only machine.

A training step's objective (Medusa and MTP heads, CE and KL, full and draft vocabulary, fused and unfused scoring),
its backward pass and the held-out metrics run under ``torch.device("meta")`` as the default device: any tensor made
without naming its device lands on meta and fails against the real CPU tensors, so what passes here makes its tensors
where the batch is, as it must on a GPU. The device flag's errors and the process-group choice are checked too.
"""

import pytest
import torch
from helpers import random_heads, random_mtp, tiny_model

from tokenmaxx.heads import Tree
from tokenmaxx.training import ds_setup, linear_ce
from tokenmaxx.training.batches import Batch
from tokenmaxx.training.losses import HeadsObjective
from tokenmaxx.training.metrics import RankCounts
from tokenmaxx.training.train_config import TrainConfig

META = torch.device("meta")


def _batch(vocab: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (2, 12), generator=gen)  # [B, T]
    input_ids[1, 10:] = 0  # right padding
    return Batch(input_ids=input_ids, answer_start=torch.tensor([4, 5]), lengths=torch.tensor([12, 10]), rows=[0, 1],
                 starts=[0, 0])


def _step(objective: HeadsObjective, model, batch: Batch):
    hidden = model(batch.input_ids, output_hidden_states=True).hidden_states[-1]  # [B, T, H]
    loss, stats = objective(hidden, batch.input_ids, batch.answer_start, batch.lengths,
                            lm_head=model.get_output_embeddings(), embed=model.get_input_embeddings())
    loss.backward()
    grads = [p.grad.clone() for p in objective.heads.parameters() if p.grad is not None]
    objective.heads.zero_grad()
    return loss.detach(), stats, grads


@pytest.mark.parametrize("kind,share_lm_head", [("medusa", True), ("medusa", False), ("mtp", True)])
@pytest.mark.parametrize("loss,vocab", [("ce", None), ("ce+kl", [0, 3, 5, 7, 9, 11, 20, 40])])
def test_a_training_step_makes_every_tensor_where_the_batch_is(kind, share_lm_head, loss, vocab):
    model = tiny_model("llama", seed=1)
    builder = {"medusa": random_heads, "mtp": random_mtp}[kind]
    heads = builder(model) if share_lm_head else type(builder(model)).for_backbone(model, num_heads=3,
                                                                                   share_lm_head=False)
    heads.train().requires_grad_(True)
    objective = HeadsObjective(heads, loss=loss, vocab=vocab)
    batch = _batch(model.config.vocab_size)
    expected = _step(objective, model, batch)
    with torch.device(META):  # a tensor made without the batch's device would land here, and fail
        got = _step(objective, model, batch)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert len(got[2]) == len(expected[2]) > 0 and all(torch.equal(a, b) for a, b in zip(got[2], expected[2]))


def test_held_out_rank_counts_stay_on_the_device_of_the_ranks():
    tree = Tree([(0,), (1,), (0, 0)])
    ranks = torch.tensor([[0, 1, 3], [0, 0, 9]])  # [K, n]
    valid = torch.tensor([[True, True, True], [True, False, True]])
    expected = RankCounts(2, tree)
    expected.add(ranks, valid)
    with torch.device(META):
        counts = RankCounts(2, tree, device="cpu")
        counts.add(ranks, valid)
    assert counts.summary() == expected.summary()
    # tree nodes matched: (0,) and (0, 0) at the first position, (1,) at the second, none at the third
    assert counts.summary()["tree_tau_empirical"] == 2.0


def test_batches_move_to_the_device_once():
    batch = _batch(96)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(META)
    assert {moved.input_ids.device, moved.answer_start.device, moved.lengths.device} == {META}
    assert (moved.rows, moved.starts) == (batch.rows, batch.starts)


def test_the_device_flag_refuses_what_the_machine_lacks(tmp_path):
    with pytest.raises(ValueError, match="device 'cuda:0' is not available on this machine"):
        TrainConfig(data=str(tmp_path), output_dir=str(tmp_path / "run"), device="cuda:0")
    with pytest.raises(ValueError, match="unknown device 'gpu': expected auto, cpu, cuda or cuda:N"):
        TrainConfig(data=str(tmp_path), output_dir=str(tmp_path / "run"), device="gpu")
    assert TrainConfig(data=str(tmp_path), output_dir=str(tmp_path / "run")).device == "auto"


def test_training_device_and_process_group(monkeypatch):
    assert ds_setup.training_device("auto") == torch.device("cpu")  # no GPU here
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="DS_ACCELERATOR=cuda but the run's device is cpu"):
        ds_setup.init_distributed(torch.device("cpu"))
    assert ds_setup.comm_device() == torch.device("cpu")


def test_the_loss_chunking_changes_nothing_but_the_buffer_size(monkeypatch):
    """CPU and accelerators score different numbers of rows at once (``chunk_rows``); per-row results and gradients
    are the same whatever the chunk."""
    assert linear_ce.chunk_rows(torch.device("cpu")) == linear_ce.CHUNK_ROWS
    assert linear_ce.chunk_rows(META) == linear_ce.DEVICE_CHUNK_ROWS > linear_ce.CHUNK_ROWS
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen)  # [V, H]
    targets = torch.randint(50, (37,), generator=gen)
    teacher = torch.randn(37, 50, generator=gen).log_softmax(-1)
    results = []
    for rows in (1, 5, 37, 128):
        monkeypatch.setattr(linear_ce, "CHUNK_ROWS", rows)
        states = torch.randn(37, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        ce, kl, hit = linear_ce.linear_cross_entropy(states, weight, targets, teacher, torch.arange(37))
        (ce.sum() + kl.sum()).backward()
        results.append((ce.detach(), kl.detach(), hit, states.grad))
    for got in results[1:]:
        assert all(torch.allclose(a, b, atol=1e-6) if a.is_floating_point() else torch.equal(a, b)
                   for a, b in zip(got, results[0]))
