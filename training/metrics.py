"""Held-out metrics of the heads and the run's metric log (jsonl, TensorBoard when installed).

Per head k: top-1 / top-5 accuracy, and the rank table ``rank_acc[k-1][r]`` = how often the target token is the r-th
best of head k (r < 8). From the table, the expected accepted length of the scored tree (``scoring_tree``: the heads'
own static tree, or for heads that grow dynamic trees the static tree of their node budget; ``tree_nodes`` is its
size) under an independence assumption: tau = 1 (bonus token) + sum over tree nodes of the product of rank accuracies
along the node's path.
Deeper heads are more often right when their parents were (see DESIGN.md), so the product underestimates; the
empirical tau (``tree_tau_empirical``: per position, the depth of the deepest tree path whose every rank matches the
targets, + 1) is reported beside it, as is the chain-conditioned table ``rank_acc_given_prev_top1``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig
from tokenmaxx.heads.tree import TYPICAL_RANK_ACCURACY, Tree, sparse_tree

from tokenmaxx.heads.config import lookback

from .batches import SelfDistilledData, collate, eval_micro_batches
from .checkpoints import atomic_write_text
from .losses import logits_cross_entropy

log = logging.getLogger(__name__)
RANKS = 8


def scoring_tree(heads) -> Tree:
    """The static tree whose tau the held-out metrics report for ``heads``: the tree they serve with
    (``tree_settings`` of their config) when it is static; for a dynamic tree (``DynamicTreeConfig``), the sparse tree
    of its node budget and depth grown from typical rank accuracies (``tree.sparse_tree``, as the default static tree
    is), so ``tree_nodes`` is the node budget the heads generate with."""
    config = heads.config
    settings = heads.tree_settings(config)
    if not isinstance(settings, DynamicTreeConfig):
        return settings
    depth = min(settings.depth or config.num_heads, config.num_heads)
    return sparse_tree(TYPICAL_RANK_ACCURACY[:depth], settings.nodes)


def target_ranks(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [K, n, V], targets [K, n] -> rank of each target among its head's logits [K, n] (0 = best)."""
    target_logit = logits.gather(-1, targets[..., None])  # [K, n, 1]
    return (logits > target_logit).sum(-1)


class RankCounts:
    """Sums over held-out positions; ``tensor()`` flattens them for one all_reduce across ranks."""

    def __init__(self, num_heads: int, tree: Tree, device: torch.device | str = "cpu"):
        self.tree = tree
        ranks = max(RANKS, tree.buffers.topk)
        f64 = dict(dtype=torch.float64, device=device)  # counted where the ranks are (the backbone's device)
        self.hits = torch.zeros(num_heads, ranks, **f64)  # [K, R] target at rank r of head k
        self.total = torch.zeros(num_heads, **f64)  # [K] positions where head k has a target
        self.cond_hits = torch.zeros(num_heads, ranks, **f64)  # [K, R] same, heads < k all top-1
        self.cond_total = torch.zeros(num_heads, **f64)  # [K]
        self.node_hits = torch.zeros(len(tree.paths), **f64)  # [N-1] positions where a path matched
        self.tree_total = torch.zeros(1, **f64)  # positions with a head-1 target

    def add(self, ranks: torch.Tensor, valid: torch.Tensor) -> None:
        """ranks, valid: [K, n] rank of each head's target and whether it exists."""
        num_heads, num_ranks = self.hits.shape
        ranks = torch.where(valid, ranks, -1)  # [K, n]; -1 never matches a tree rank
        prev_top1 = torch.ones(ranks.shape[1], dtype=torch.bool, device=ranks.device)  # [n]
        for k in range(num_heads):
            in_table = valid[k] & (ranks[k] < num_ranks)
            self.hits[k] += torch.bincount(ranks[k][in_table], minlength=num_ranks).double()
            self.total[k] += valid[k].sum()
            cond = in_table & prev_top1
            self.cond_hits[k] += torch.bincount(ranks[k][cond], minlength=num_ranks).double()
            self.cond_total[k] += (valid[k] & prev_top1).sum()
            prev_top1 = prev_top1 & (ranks[k] == 0)
        self.tree_total += valid[0].sum()
        for i, path in enumerate(self.tree.paths):
            match = valid[0].clone()
            for depth, rank in enumerate(path):
                match &= ranks[depth] == rank
            self.node_hits[i] += match.sum()

    def tensor(self) -> torch.Tensor:
        sums = (self.hits, self.total, self.cond_hits, self.cond_total, self.node_hits, self.tree_total)
        return torch.cat([t.flatten() for t in sums])

    def load(self, flat: torch.Tensor) -> None:
        sums = (self.hits, self.total, self.cond_hits, self.cond_total, self.node_hits, self.tree_total)
        for t, part in zip(sums, flat.split([t.numel() for t in sums])):
            t.copy_(part.view_as(t))

    def summary(self) -> dict:
        acc = self.hits / self.total.clamp(min=1)[:, None]  # [K, R]
        cond = self.cond_hits / self.cond_total.clamp(min=1)[:, None]  # [K, R]
        product = sum(_path_product(acc, path) for path in self.tree.paths)
        return {
            "head_top1": _round(acc[:, 0]), "head_top5": _round(acc[:, :5].sum(1)),
            "rank_acc": [_round(row[:RANKS]) for row in acc],
            "rank_acc_given_prev_top1": [_round(row[:RANKS]) for row in cond],
            "tree_nodes": self.tree.num_nodes,
            "tree_tau_product": round(1.0 + float(product), 4),
            "tree_tau_empirical": round(1.0 + float(self.node_hits.sum() / self.tree_total.clamp(min=1)), 4),
            "eval_positions": int(self.tree_total),
        }


def _path_product(acc: torch.Tensor, path: tuple[int, ...]) -> float:
    value = 1.0
    for depth, rank in enumerate(path):
        value *= float(acc[depth, rank]) if depth < acc.shape[0] and rank < acc.shape[1] else 0.0
    return value


def _round(values: torch.Tensor) -> list[float]:
    return [round(float(v), 4) for v in values]


@torch.no_grad()
def evaluate(objective, lm_head, features, data: SelfDistilledData, tree: Tree, micro_batch_size: int, rank: int,
             world: int, all_reduce=None, embed=None, rows: list[int] | None = None,
             rank_vocab: torch.Tensor | None = None) -> dict:
    """Held-out loss and accuracy metrics of ``objective.heads``; every rank evaluates its share, then all_reduce.
    ``embed``: the backbone's input embedding, for heads that read tokens (the sequential kinds, EAGLE-3 and MTP).
    ``rows``: these held-out rows only (default: all of ``data.eval``). The loss is the objective's; the ranks are
    over the objective's vocabulary, or over ``rank_vocab`` (token ids: a draft vocabulary the objective does not
    score over; a target outside it is a miss). ``vocab`` in the result says which: "draft" or "full"."""
    num_heads = objective.heads.config.num_heads
    device = lm_head.weight.device
    if rank_vocab is not None and objective.vocab is not None:
        raise ValueError("rank_vocab is for an objective over the whole vocabulary; this one has its own")
    ranked = None
    if rank_vocab is not None:  # [V] True at the tokens ranked
        ranked = torch.zeros(lm_head.weight.shape[0], dtype=torch.bool, device=device)
        ranked[rank_vocab.to(device)] = True
    counts = RankCounts(num_heads, tree, device)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # [weighted loss * positions, positions]
    was_training = objective.training
    objective.eval()
    micro_batches = eval_micro_batches(data.eval if rows is None else rows, rank, world, micro_batch_size)
    for batch_rows in tqdm(micro_batches, desc="held-out evaluation", unit="batch", leave=False, disable=rank != 0):
        batch = collate(data, batch_rows, lookback(objective.heads.config)).to(device)
        hidden = features.hidden(batch)  # [B, W, H]
        given = features.teacher(batch) if objective.given_teacher else None
        sel = objective.select(hidden, batch.input_ids, batch.answer_start, batch.lengths, lm_head, given)
        logits = objective.head_logits(hidden, batch.input_ids, sel.selected, lm_head, embed)  # [K, n, V]
        targets, valid, trained = sel.targets, sel.valid, sel.trained  # [K, n]
        num_heads, n = targets.shape
        ce, kl, hit = logits_cross_entropy(logits.reshape(num_heads * n, -1),
                                           torch.where(trained, targets, 0).flatten(),
                                           sel.teacher, None if sel.row is None else sel.row.clamp(min=0).flatten())
        loss, _ = objective.loss(ce.view(num_heads, n), kl.view(num_heads, n), hit.view(num_heads, n), trained)
        in_vocab = sel.in_vocab
        if ranked is not None:  # ranked over the draft vocabulary alone
            logits = logits.masked_fill(~ranked, float("-inf"))
            in_vocab = ranked[targets]
        ranks = target_ranks(logits, targets)
        if in_vocab is not None:  # a target outside the ranked vocabulary can never be guessed: a miss at every rank
            ranks = torch.where(in_vocab, ranks, torch.iinfo(ranks.dtype).max)
        counts.add(ranks, valid)
        n = valid.any(0).sum().double()
        loss_sum += torch.stack([loss.detach().double() * n, n])
    objective.train(was_training)
    flat = torch.cat([counts.tensor(), loss_sum])
    if all_reduce is not None:
        all_reduce(flat)
    counts.load(flat[:-2])
    vocab = "draft" if objective.vocab is not None or rank_vocab is not None else "full"
    return {"eval_loss": round(float(flat[-2] / flat[-1].clamp(min=1)), 5), "vocab": vocab, **counts.summary()}


class MetricsLogger:
    """Appends one JSON object per line to OUTPUT_DIR/metrics.jsonl (rank 0 only); mirrors scalars to TensorBoard
    when ``tensorboard`` is installed (optional dependency).

    The file reads as one run: a run starting after step ``start_step`` (a resume: its checkpoint's step; a fresh
    run: 0) first drops what an earlier process logged beyond that step, which this run logs again (``rewind``).
    """

    def __init__(self, output_dir: str | Path, enabled: bool = True, start_step: int = 0, last_step: bool = False):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.rewind(start_step, last_step)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:  # purge_step hides the earlier process's events from that step on, as rewind does here
                self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)

    def rewind(self, step: int, last_step: bool = False) -> int:
        """Drop the records of steps after ``step`` and lines cut off by a kill (and, when ``last_step``: the run is
        already at its final step, whose held-out record is written again, that record too); the file is rewritten
        under a temp name, then renamed. Returns how many lines were dropped."""
        if not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if _keep(line, step, last_step)]
        if len(kept) < len(lines):
            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
            log.info("%s: dropped %d records after step %d (this run logs those steps again)", self.path,
                     len(lines) - len(kept), step)
        return len(lines) - len(kept)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record.get('split', 'train')}/{key}", value, step)
                elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                    for k, v in enumerate(value, start=1):
                        self.tb.add_scalar(f"{record.get('split', 'train')}/{key}/head{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _keep(line: str, step: int, last_step: bool) -> bool:
    try:
        record = json.loads(line)
        at = int(record["step"])
    except (ValueError, TypeError, KeyError):  # a line cut off mid-write, or not a record
        return False
    return at < step or (at == step and not (last_step and record.get("split") == "eval"))
