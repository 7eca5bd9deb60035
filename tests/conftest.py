"""Fixtures: tiny random Llama / Qwen2 backbones built from a config (fp32, no download), oracle heads."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tokenmaxx.heads import DraftHeads, HeadsConfig, MedusaHeads

torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **overrides):
    torch.manual_seed(seed)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = cfg_cls(**{**TINY, **overrides}, attn_implementation=attn)
    model = model_cls(config).eval()
    # Spread the logits: random init gives near-flat distributions whose argmax ties are numerically fragile.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.requires_grad_(False)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


def random_heads(model, seed: int = 0, num_heads: int = 4, **kw) -> MedusaHeads:
    """Medusa heads with random (non-zero) residual weights: they guess badly, so acceptance is low."""
    heads = MedusaHeads.for_backbone(model, num_heads=num_heads, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return heads


class OracleHeads(DraftHeads):
    """Heads rigged to know the backbone's greedy continuation ``reference`` (prompt + new tokens).

    The position of a hidden state is found by nearest neighbour among the reference sequence's hidden states, and head
    k proposes the true token at t+k+1 at a random rank (rank 0 with probability ``p_top``), or, with probability
    ``p_wrong``, not at all; other ranks get random tokens. So accepted paths are long and run through side branches.
    """

    def __init__(self, model, reference: torch.Tensor, num_heads: int = 4, p_top: float = 0.7,
                 p_wrong: float = 0.1, seed: int = 0):
        hidden, vocab = model.lm_head.weight.shape[1], model.lm_head.weight.shape[0]
        super().__init__(HeadsConfig(kind="medusa", num_heads=num_heads, hidden_size=hidden, vocab_size=vocab))
        self.reference = reference[0]  # [T]
        with torch.no_grad():
            self.states = model(reference, output_hidden_states=True).hidden_states[-1][0]  # [T, H]
        self.vocab = vocab
        self.p_top, self.p_wrong = p_top, p_wrong
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, hidden, lm_head=None):  # hidden [H] -> logits [K, V]
        t = int((self.states - hidden.float()).norm(dim=-1).argmin())
        logits = torch.rand(self.config.num_heads, self.vocab, generator=self.gen)
        for k in range(1, self.config.num_heads + 1):
            if t + k + 1 >= self.reference.numel():
                continue
            u = float(torch.rand(1, generator=self.gen))
            if u < self.p_wrong:
                continue
            target = int(self.reference[t + k + 1])
            if u >= self.p_wrong + self.p_top:  # the truth at rank 1, behind a decoy
                logits[k - 1, int(torch.randint(self.vocab, (1,), generator=self.gen))] = 10.0
            logits[k - 1, target] = 10.0 if u < self.p_wrong + self.p_top else 5.0
        return logits


def greedy_reference(model, input_ids, max_new_tokens):
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          do_sample=False)
