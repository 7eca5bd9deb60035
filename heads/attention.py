"""Masked attention that lets SDPA share the key/value heads, switched on per forward (thread-safe).

Given a mask, transformers' SDPA attention repeats each key/value head for the query heads that share it (a copy of
the layer's whole cache, every layer, every forward) instead of letting SDPA broadcast them (``enable_gqa``), because
on CUDA a mask with ``enable_gqa`` falls back to the slow math kernel. On CPU SDPA takes both: with 2+ queries the
result is the same bit for bit (SmolLM2 bf16 and fp32 at 37-777 cached tokens, 2-16 nodes; tiny models in the tests),
and a tree verify forward is ~5-8% faster (SmolLM2-135M, 9 nodes, 400 cached tokens). A single query differs at
rounding level from transformers' own single-query layout (fp32: 1e-5), as any two attention kernels do; greedy output
stays identical to ``generate`` in fp32 (tested).

How it is switched: ``sdpa_sharing_kv_heads`` is registered through transformers' public ``AttentionInterface`` as
``"tokenmaxx_sdpa"``. It is transformers' own SDPA attention for every call, except a masked call that carries the
keyword ``tokenmaxx_share_kv_heads=True``, which only tokenmaxx's tree forwards pass (``shared_kv_kwargs``). The
keyword travels with the forward call, so nothing process-wide changes and two threads generating at once each get
what they asked for. A backbone on transformers' "sdpa" is moved onto it once (``shared_kv_kwargs``): its other
forwards compute exactly what they did (the same attention function and the same masks, ``sdpa_mask``; tested with
transformers' own prompt-lookup generation). On CUDA the keyword is never passed (there it would be slower).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "tokenmaxx_sdpa"
SHARE_KV_HEADS = "tokenmaxx_share_kv_heads"  # forward keyword: this masked call may let SDPA share the KV heads


def sdpa_sharing_kv_heads(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with ``tokenmaxx_share_kv_heads=True`` and a mask, SDPA's ``enable_gqa`` instead
    of copied key/value heads. query [B, Hq, n, d], key/value [B, Hkv, C+n, d], mask [B or 1, 1, n, C+n] additive.
    Returns ([B, n, Hq, d], None) like transformers' attention functions."""
    share = kwargs.pop(SHARE_KV_HEADS, False)
    if not share or attention_mask is None or getattr(module, "num_key_value_groups", 1) <= 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, sdpa_sharing_kv_heads)
# the masks transformers builds for it are SDPA's: without this, transformers builds none for an unknown
# implementation, and a multi-token forward over a cache (assisted / prompt-lookup verification) loses its causal mask
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def shares_kv_heads(model) -> bool:
    """Whether SDPA may share the key/value heads of (layers built from) this model's config: on CPU, fewer key/value
    heads than query heads, and keys and values of one head size of at most 256 (what SDPA's GQA asks).

    Off the CPU never: on CUDA a mask with ``enable_gqa`` falls back to SDPA's math kernel, slower than copying heads.
    """
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads or next(model.parameters()).device.type != "cpu":
        return False
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    key_dim, value_dim = getattr(config, "qk_head_dim", head_dim), getattr(config, "v_head_dim", head_dim)
    return (getattr(config, "num_key_value_heads", None) or heads) < heads and key_dim == value_dim <= 256


def shared_kv_kwargs(model) -> dict:
    """The forward keywords with which ``model``'s masked tree forwards share the key/value heads ({} where that does
    not apply). Moves a backbone from transformers' "sdpa" onto the equivalent "tokenmaxx_sdpa" the first time."""
    forward = inspect.signature(model.forward).parameters.values()
    if not shares_kv_heads(model) or not any(p.kind is p.VAR_KEYWORD for p in forward):
        return {}  # no grouped-query layers here, or a forward that cannot pass the keyword on
    current = getattr(model.config, "_attn_implementation", None)
    if current == "sdpa":
        model.set_attn_implementation(IMPLEMENTATION)
    elif current != IMPLEMENTATION:
        return {}  # eager, flash, ...: their own attention, untouched
    return {SHARE_KV_HEADS: True}
