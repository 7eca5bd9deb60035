"""Online adaptation: the heads learn from the traffic while they serve (``SpeculativeGenerator(online=...)``; off by
default).

Every generate call's traffic (the rows ``record.Recorder`` collects: the backbone's states at the committed positions
and its tokens) goes into a bounded replay buffer (a uniform reservoir over all the traffic seen, so old text keeps
its share); every ``every`` recorded tokens, ``steps`` optimizer steps of the heads' training loss (cross-entropy on
the backbone's tokens, ``tokenmaxx.training.losses.HeadsObjective``) run on random rows of the buffer, between calls.
Only what the heads propose changes: every token is still verified by the backbone, so the output is exactly what it
was. A lock keeps two updates apart; a call running in another thread meanwhile drafts with weights being updated,
which changes its proposals only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tokenmaxx.heads.config import lookback


@dataclass
class OnlineAdapt:
    """How the heads adapt while serving: ``steps`` AdamW steps at ``lr`` over ``batch_rows`` rows of a replay buffer
    of ``buffer_rows`` rows, every ``every`` recorded tokens; ``seed`` draws the rows."""

    every: int = 4096
    steps: int = 4
    lr: float = 1e-5
    batch_rows: int = 8
    buffer_rows: int = 512
    seed: int = 0

    def __post_init__(self):
        for name in ("every", "steps", "batch_rows", "buffer_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"OnlineAdapt.{name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"OnlineAdapt.lr must be > 0, got {self.lr!r}")


class OnlineLearner:
    """The state of online adaptation for one generator's heads: buffer, optimizer, counts (``updates``: updates run,
    ``seen_tokens``: traffic tokens added)."""

    def __init__(self, cfg: OnlineAdapt, heads, model):
        from tokenmaxx.training.evaluation import recorded_training
        from tokenmaxx.training.losses import HeadsObjective

        self.cfg, self.heads, self.model = cfg, heads, model
        training = recorded_training(heads.config)
        vocab = heads.draft_vocab if training.get("loss_vocab") == "draft" else None
        self.objective = HeadsObjective(heads, "ce", training.get("head_decay", 0.8), vocab=vocab)
        # fp32 master weights: the heads may serve in bf16, where a small step rounds away
        self.params = list(heads.parameters())
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=cfg.lr, weight_decay=0.0)
        self.buffer: list = []
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.seen_rows = self.seen_tokens = self.pending = self.updates = 0
        self.lock = threading.Lock()

    def add(self, rows) -> None:
        """A call's traffic rows (``traffic.TrafficRow``); runs an update once ``every`` tokens have come in."""
        with self.lock:
            for row in rows:
                row = row.cut(lookback(self.heads.config))  # what the heads read of its prompt, and no more
                self.seen_rows += 1
                if len(self.buffer) < self.cfg.buffer_rows:
                    self.buffer.append(row)
                else:  # reservoir: every row seen so far is in the buffer with the same chance
                    slot = int(torch.randint(self.seen_rows, (1,), generator=self.rng))
                    if slot < self.cfg.buffer_rows:
                        self.buffer[slot] = row
                new = row.ids.shape[0] - row.prompt_len
                self.seen_tokens += new
                self.pending += new
            if self.pending >= self.cfg.every:
                self._update()
                self.pending = 0

    def _update(self) -> None:
        lm_head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        device = lm_head.weight.device
        with torch.inference_mode(False), torch.enable_grad():
            self.heads.train()
            self.heads.requires_grad_(True)
            for _ in range(self.cfg.steps):
                picked = torch.randperm(len(self.buffer), generator=self.rng)[: self.cfg.batch_rows].tolist()
                hidden, input_ids, answer_start, lengths = _batch([self.buffer[i] for i in picked], device)
                loss, _ = self.objective(hidden, input_ids, answer_start, lengths, lm_head=lm_head, embed=embed)
                for p in self.params:
                    p.grad = None
                loss.backward()
                for p, m in zip(self.params, self.master):
                    m.grad = None if p.grad is None else p.grad.float()
                self.optimizer.step()
                with torch.no_grad():
                    for p, m in zip(self.params, self.master):
                        p.copy_(m)
            for p in self.params:
                p.grad = None
            self.heads.requires_grad_(False)
            self.heads.eval()
        self.updates += 1


def _batch(rows, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded training tensors of traffic rows (fresh tensors, usable by autograd): features [B, T, F] (each
    row's last position zero: no state was computed there), ids [B, T], answer starts and lengths [B]."""
    width = max(r.ids.shape[0] for r in rows)
    features = torch.zeros(len(rows), width, rows[0].features.shape[1], dtype=rows[0].features.dtype)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : r.ids.shape[0]] = r.ids
        features[i, : r.features.shape[0]] = r.features
    answer_start = torch.tensor([r.prompt_len for r in rows])
    lengths = torch.tensor([r.ids.shape[0] for r in rows])
    return features.to(device), input_ids.to(device), answer_start.to(device), lengths.to(device)
