"""Medusa heads: K independent heads on the backbone's last hidden state.

Head k (k = 1..K) is L residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so an untrained head starts as the
identity) followed by a projection to the vocabulary: the backbone's frozen lm_head (``share_lm_head``, checkpoints of a
few MB) or the head's own copy of it. Head k reading the hidden state at position t targets the token at t+k+1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modeling import DraftHeads, register_head_kind


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return x + F.silu(self.linear(x))


@register_head_kind("medusa")
class MedusaHeads(DraftHeads):
    def __init__(self, config):
        super().__init__(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(config.num_layers))) for _ in range(config.num_heads))
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            nn.Linear(hidden, vocab, bias=False) for _ in range(config.num_heads))

    def init_from_backbone(self, model) -> None:
        if self.lm_heads is not None:
            weight = model.get_output_embeddings().weight
            for head in self.lm_heads:
                head.weight.data.copy_(weight.detach().to(head.weight.dtype))

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> per-head states before the vocabulary projection [K, ..., H]."""
        return torch.stack([blocks(hidden) for blocks in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden [..., H] (final-normed backbone state at t) -> logits [K, ..., V]; row k-1 targets token t+k+1."""
        states = self.head_states(hidden)  # [K, ..., H]
        if self.lm_heads is None:
            if lm_head is None:
                raise ValueError("these heads share the backbone's lm_head: pass it as lm_head=")
            return lm_head(states)  # one matmul for all K heads
        return torch.stack([proj(s) for proj, s in zip(self.lm_heads, states)])
