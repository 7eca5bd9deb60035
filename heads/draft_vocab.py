"""Draft vocabularies: project the heads' guesses onto frequent tokens + the prompt's tokens, not the whole vocabulary.

A head's guess costs one [rows, H] x [H, V] product with the lm_head: over a vocabulary as large as SmolLM2's
(V = 49,152) that is the largest part of drafting on a CPU. Restricted to the few thousand tokens the backbone actually
writes in its self-distilled answers (``frequent_tokens``) plus the tokens of the current prompt (names, code
identifiers, numbers that answers copy), the product shrinks with the vocabulary (timings: docs/benchmarks.md). Guesses
outside that set are impossible, which costs a little acceptance; verification always uses the full vocabulary, so the
output is the backbone's either way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class DraftVocab:
    ids: torch.Tensor  # [Vd] long, sorted token ids, on the lm_head's device
    weight: torch.Tensor  # [Vd, H] the lm_head rows of those ids

    @classmethod
    def for_prompt(cls, base: torch.Tensor, lm_head, prompt_ids: torch.Tensor) -> "DraftVocab":
        """The heads' draft vocabulary ``base`` [Vd] joined with the prompt's tokens [T], on the lm_head's device."""
        device = lm_head.weight.device
        ids = torch.unique(torch.cat([base.to(device=device, dtype=torch.long),
                                      prompt_ids.flatten().to(device=device, dtype=torch.long)]))
        return cls(ids=ids, weight=lm_head.weight.detach()[ids])

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., H] -> logits over the draft vocabulary [..., Vd] (positions map back through ``ids``)."""
        return states.to(self.weight.dtype) @ self.weight.T


def frequent_tokens(sequences: Iterable[Iterable[int]], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids over ``sequences`` (ties: lower id first), plus ``always`` (e.g. EOS)."""
    if size <= 0:
        raise ValueError(f"draft vocabulary size must be positive, got {size}")
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    top = [tok for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    return torch.unique(torch.tensor(top + [int(t) for t in always], dtype=torch.long))
