"""Masked attention that lets SDPA share the key/value heads, switched on per forward (thread-safe).

Given a mask, transformers' SDPA attention repeats each key/value head for the query heads that share it (a copy of
the layer's whole cache, every layer, every forward) instead of letting SDPA broadcast them (``enable_gqa``), because
on CUDA a mask with ``enable_gqa`` falls back to the slow math kernel. On CPU SDPA takes both: with 2+ queries the
result is the same bit for bit (checked on SmolLM2 in bf16 and fp32, and on the tiny models of the tests), and a tree
verify forward is faster without the copies (docs/benchmarks.md, "Figures moved from the code"). A single query
differs at rounding level from transformers' own single-query layout, as any two attention kernels do; greedy output
stays identical to ``generate`` in fp32 (tested).

How it is switched: ``sdpa_sharing_kv_heads`` is registered through transformers' public ``AttentionInterface`` as
``"tokenmaxx_sdpa"``. It is transformers' own SDPA attention for every call, except a masked call that carries the
keyword ``tokenmaxx_share_kv_heads=True``, which only tokenmaxx's tree forwards pass (``shared_kv_kwargs``, which
only reads the model). The keyword travels with the forward call, so nothing process-wide changes and two threads
generating at once each get what they asked for. Whoever builds the backbone moves it from transformers' "sdpa" onto
"tokenmaxx_sdpa" (``use_shared_kv_attention``, called by ``io.backbones.load_backbone``): its other forwards compute
exactly what they did (the same attention function and the same masks, ``sdpa_mask``; tested with transformers' own
prompt-lookup generation). On CUDA the keyword is never passed (there it would be slower).

The same function serves the sequential heads' training-time unroll (keyword ``tokenmaxx_unrolled``, computed by
``unrolled_attention``): each depth's queries attend to the depth-1 causal prefix and their own chain only.
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
UNROLLED = "tokenmaxx_unrolled"  # forward keyword: a depth of the training unroll (True or visible: unrolled_attention)


def sdpa_shares_kv_heads(device: torch.device) -> bool:
    """Whether SDPA with a mask should broadcast grouped-query key/value heads itself (``enable_gqa``) on ``device``:
    on the CPU yes; on CUDA a mask with ``enable_gqa`` falls back to the math kernel, so the heads are copied."""
    return device.type == "cpu"


def unrolled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one depth d of the sequential heads' training unroll (``SequentialHeads.unrolled_states``).

    query [B, Hq, M, D]: depth d at M anchors; key/value [B, Hkv, T + (d-1)*M, D]: the depth-1 entries of all T
    positions, then those of depths 2..d (M each, one per anchor, in the cache's order). A query sees the depth-1 keys
    that ``visible`` [B, M, T] allows (its anchor's causal prefix) and, at each depth 2..d, the key of its own anchor
    (its chain). ``visible`` None: the anchors are all T positions (M = T) and the prefix is the causal one.
    One fused SDPA call (causal at depth 1, else a boolean mask over the prefix and the chains), which neither keeps
    the [B, Hq, M, T] scores for the backward nor copies them to fp32 for the softmax. On the CPU SDPA shares the
    key/value heads of grouped-query layers (``enable_gqa``); elsewhere, where a mask with ``enable_gqa`` takes the
    slow math kernel, they are copied. Returns [B, M, Hq, D] like transformers' attention functions.
    """
    anchors = query.shape[2]
    seq = anchors if visible is None else visible.shape[-1]
    if key.shape[2] < seq or (key.shape[2] - seq) % anchors:
        raise ValueError(f"unrolled attention: {key.shape[2]} keys are not {seq} depth-1 entries and whole depths of "
                         f"{anchors} anchors")
    groups = query.shape[1] // key.shape[1]
    share = groups > 1 and sdpa_shares_kv_heads(query.device)
    if groups > 1 and not share:  # grouped-query layers: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if visible is None and key.shape[2] == seq:  # depth 1: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=share)
        return out.transpose(1, 2).contiguous()
    if visible is None:
        visible = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()[None]  # [1, M, T]
    depths = (key.shape[2] - seq) // anchors + 1
    chains = torch.eye(anchors, dtype=torch.bool, device=query.device).repeat(1, depths - 1)  # [M, (d-1)*M]
    mask = torch.cat([visible, chains.expand(visible.shape[0], -1, -1)], dim=-1)[:, None]  # [B or 1, 1, M, keys]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=share)
    return out.transpose(1, 2).contiguous()


def sdpa_sharing_kv_heads(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with ``tokenmaxx_share_kv_heads=True`` and a mask, SDPA's ``enable_gqa`` instead
    of copied key/value heads; with ``tokenmaxx_unrolled`` (True, or the anchors' visible depth-1 prefixes [B, M, T]),
    ``unrolled_attention`` (no mask). query [B, Hq, n, d], key/value [B, Hkv, C+n, d], mask [B or 1, 1, n, C+n]
    additive. Returns ([B, n, Hq, d], None) like transformers' attention functions."""
    share = kwargs.pop(SHARE_KV_HEADS, False)
    unrolled = kwargs.pop(UNROLLED, False)
    if unrolled is not False:
        return unrolled_attention(query, key, value, scaling, None if unrolled is True else unrolled), None
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


def use_shared_kv_attention(model) -> bool:
    """Move ``model`` from transformers' "sdpa" onto the equivalent "tokenmaxx_sdpa" where its tree forwards can share
    the key/value heads (``shares_kv_heads``); returns whether it is on it now. Its other forwards compute exactly what
    they did. Changes the model: called by whoever builds it (``load_backbone``), never by a generator."""
    forward = inspect.signature(model.forward).parameters.values()
    if not shares_kv_heads(model) or not any(p.kind is p.VAR_KEYWORD for p in forward):
        return False  # no grouped-query layers here, or a forward that cannot pass the keyword on
    current = getattr(model.config, "_attn_implementation", None)
    if current == "sdpa":
        model.set_attn_implementation(IMPLEMENTATION)
        current = IMPLEMENTATION
    return current == IMPLEMENTATION


def shared_kv_kwargs(model) -> dict:
    """The forward keywords with which ``model``'s masked tree forwards share the key/value heads: {} unless it is on
    "tokenmaxx_sdpa" (``use_shared_kv_attention``) and its layers can share them. Reads the model, changes nothing."""
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION or not shares_kv_heads(model):
        return {}
    forward = inspect.signature(model.forward).parameters.values()
    return {SHARE_KV_HEADS: True} if any(p.kind is p.VAR_KEYWORD for p in forward) else {}
