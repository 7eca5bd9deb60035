"""Held-out accuracy of any trained heads on any self-distilled dataset: the trainer's metrics, outside a run.

``evaluate_heads(heads, model, data)`` scores heads (of any kind) on the rows a training run on ``data`` holds out
(the same seeded split as ``load_data`` with the same seq_len / eval_fraction / eval_max_examples / seed), or on every
row, per category too when the data has one. It answers questions a run's own record cannot: how do the shipped heads
do on a new mix, do two kinds differ on the same rows, did a change of data help on text like X. Depth d is scored
given the true tokens before it, as in training; tau is the scored tree's (``metrics.scoring_tree``: the heads' static
tree, or one of their dynamic tree's node budget). ``recorded_split`` reads the split a run recorded with its heads.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Collection

import torch

from .batches import SelfDistilledData, load_data
from .features import BackboneFeatures, final_state_index
from .losses import HeadsObjective, gives_teacher
from .metrics import evaluate, scoring_tree

SPLITS = ("held_out", "all")
VOCABS = ("auto", "draft", "full")


def evaluate_heads(heads, model, data: str | Path | SelfDistilledData, *, split: str = "held_out",
                   vocab: str = "auto", seq_len: int = 512, eval_fraction: float = 0.05, eval_max_examples: int = 256,
                   seed: int = 0, micro_batch_size: int = 4, by_category: bool = True,
                   seen_parts: Collection[str] = (), features=None) -> dict:
    """Metrics of ``heads`` on ``model`` (the frozen backbone they were made for) over ``data``'s rows.

    split: 'held_out' (a run's held-out rows, given the same split arguments) or 'all'. vocab: 'draft' ranks over the
    heads' draft vocabulary (what drafting ranks, less each prompt's own tokens; a target outside it is a miss),
    'full' over every token, 'auto' = 'draft' when the heads have one. seen_parts: as ``load_data``'s (the split of a
    run with --init_heads: ``trained_parts`` of those heads). features: where the rows' backbone states come from
    (``hidden(batch)``; None: a backbone forward per batch). Returns the trainer's held-out record
    (``metrics.evaluate``) plus ``examples``, ``split``, ``vocab`` and ``by_category`` {category: record}.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS}, got {vocab!r}")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size!r}")
    heads.check_backbone(model)
    if vocab == "auto":
        vocab = "draft" if heads.draft_vocab is not None else "full"
    if vocab == "draft" and heads.draft_vocab is None:
        raise ValueError("vocab='draft' ranks over the heads' draft vocabulary, but these heads have none; use "
                         "vocab='full'")
    if not isinstance(data, SelfDistilledData):
        data = load_data(data, seq_len, eval_fraction, eval_max_examples, seed, seen_parts=seen_parts)
    rows = data.eval if split == "held_out" else sorted(data.examples)
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    device = lm_head.weight.device
    heads = copy.deepcopy(heads).to(device=device, dtype=lm_head.weight.dtype).eval()  # the caller's stay as they are
    # the loss the heads' run trained with (recorded beside them; hand-made heads: cross-entropy, every token), so
    # that this and the run's last held-out record are one computation on the same rows
    training = recorded_training(heads.config)
    draft = heads.draft_vocab.cpu() if heads.draft_vocab is not None else None
    loss_over_draft = training.get("loss_vocab") == "draft" and vocab == "draft"
    objective = HeadsObjective(heads, training.get("loss", "ce"), training.get("head_decay", 0.8),
                               vocab=draft if loss_over_draft else None,
                               given_teacher=gives_teacher(features))
    rank_vocab = draft if vocab == "draft" and not loss_over_draft else None
    if features is None:
        features = BackboneFeatures(model, data, objective.feature_layers(final_state_index(model)))
    tree = scoring_tree(heads)

    def run(selected: list[int]) -> dict:
        return evaluate(objective, lm_head, features, data, tree, micro_batch_size, rank=0, world=1, embed=embed,
                        rows=selected, rank_vocab=rank_vocab)

    with torch.inference_mode():
        metrics = {"examples": len(rows), "split": split, "vocab": vocab, **run(rows)}
        groups = data.by_category(rows) if by_category else {}
        if len(groups) > 1:
            metrics["by_category"] = {c: {"examples": len(g), **run(g)} for c, g in groups.items()}
    return metrics


SPLIT_FIELDS = ("seq_len", "eval_fraction", "eval_max_examples", "seed")  # what decides a run's held-out rows


def recorded_training(heads_config) -> dict:
    """The TrainConfig the training run of these heads recorded in ``extra["training"]`` (empty for untrained or
    hand-made heads)."""
    extra = heads_config.extra if isinstance(heads_config.extra, dict) else {}
    return extra.get("training") if isinstance(extra.get("training"), dict) else {}


def recorded_split(heads_config) -> dict:
    """The split settings (``SPLIT_FIELDS``) the training run of these heads recorded in ``extra["training"]`` (its
    TrainConfig); those it does not record are left out (untrained or hand-made heads: none)."""
    training = recorded_training(heads_config)
    return {name: training[name] for name in SPLIT_FIELDS
            if isinstance(training.get(name), (int, float)) and not isinstance(training.get(name), bool)}
