"""The four steps of one speculative round, as plain functions over explicit state.

Terms (used throughout tokenmaxx):
- root: the last token the backbone chose; it is not in the KV cache yet and is node 0 of the tree.
- node: one drafted token placed in the tree (a path of ranks, see ``tree.py``); depth d = path length.
- path: root-to-leaf chain of nodes; a path is *accepted* up to its first candidate the backbone disagrees with.
- accepted: candidates on the chosen path that equal what the backbone itself would have produced.
- bonus token: the backbone's own next token after the last accepted node (it comes for free from the same forward).
- tau (accepted length): tokens produced per backbone forward = accepted candidates + 1 bonus token.
- head offset rule: head k reading the hidden state at position t targets the token at t+k+1; with the root at
  t+1, head k's guesses sit at tree depth k.

One round: ``propose`` (heads -> tree tokens) -> ``verify`` (one backbone forward over the tree, 4D mask) ->
``accept_greedy`` (longest agreeing path + bonus) -> ``commit`` (keep only the accepted path in the KV cache).

Letters: N tree nodes, P cached prefix length, K heads, V vocabulary, H hidden size, D tree depth.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from .tree import TreeBuffers


@dataclass
class Verified:
    logits: torch.Tensor  # [N, V] backbone logits at each tree node
    hidden: torch.Tensor  # [N, H] final-normed last hidden state at each tree node


@dataclass
class Accepted:
    nodes: torch.Tensor  # [m+1] long: tree node indices of the accepted path, root first
    tokens: list[int]  # the m accepted candidates followed by the bonus token (what this round emits)


def propose(heads, lm_head, hidden: torch.Tensor, root: int, buffers: TreeBuffers, vocab=None) -> torch.Tensor:
    """Heads' top-k guesses laid on the tree.

    hidden: [H] backbone state at the position before the root; vocab: a ``DraftVocab`` to project onto instead of
    the whole vocabulary (heads with ``head_states`` only). Returns tree tokens [N] (node 0 = root).
    """
    if buffers.num_nodes == 1:
        return torch.tensor([root], dtype=torch.long)
    if vocab is not None:
        logits = vocab.logits(heads.head_states(hidden)[: buffers.depth])  # [D, Vd]
        topk = vocab.ids[logits.topk(min(buffers.topk, logits.shape[-1]), dim=-1).indices]  # [D, k]
    else:
        logits = heads(hidden, lm_head)[: buffers.depth]  # [D, V]
        topk = logits.topk(buffers.topk, dim=-1).indices  # [D, k]
    flat = torch.cat([torch.tensor([root], dtype=torch.long), topk.flatten()])  # [1 + D*k]
    return flat[buffers.token_index]  # [N]


def tree_attention_bias(buffers: TreeBuffers, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, P+N]: the cached prefix is visible to all nodes; a node sees its ancestors and itself."""
    n = buffers.num_nodes
    bias = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype)
    bias[0, 0, :, prefix_len:].masked_fill_(~buffers.attn_mask, torch.finfo(dtype).min)
    return bias


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' own switch for SDPA's grouped-query attention


def shares_kv_heads(model) -> bool:
    """Whether ``grouped_query_sdpa`` applies to (layers built from) this model's config: on CPU, fewer key/value heads
    than query heads, and keys and values of one head size of at most 256 (what transformers asks of SDPA's GQA)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not heads or next(model.parameters()).device.type != "cpu":
        return False
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    key_dim, value_dim = getattr(config, "qk_head_dim", head_dim), getattr(config, "v_head_dim", head_dim)
    return (getattr(config, "num_key_value_heads", None) or heads) < heads and key_dim == value_dim <= 256


@contextlib.contextmanager
def grouped_query_sdpa(enabled: bool = True):
    """Masked attention without copying the KV cache per layer, for models that ``shares_kv_heads`` says it fits.

    Given a mask, transformers' SDPA attention repeats each key/value head for the query heads that share it (a copy
    of the layer's whole cache, every layer, every forward) instead of letting SDPA broadcast them (``enable_gqa``),
    because on CUDA a mask with ``enable_gqa`` falls back to the slow math kernel. On CPU SDPA takes both: with 2+
    queries the result is the same bit for bit (SmolLM2 bf16 and fp32 at 37-777 cached tokens, 2-16 nodes; tiny
    models in the tests), and a tree verify forward is ~5-8% faster (SmolLM2-135M, 9 nodes, 400 cached tokens). A
    single query differs at rounding level from transformers' own single-query layout (fp32: 1e-5), as any two
    attention kernels do; greedy output stays identical to ``generate`` in fp32 (tested). Within this context
    ``TRANSFORMERS_SDPA_FORCE_GQA`` is set; a value the user set is left alone. The switch is process-wide: a forward
    another thread runs meanwhile gets it too (on CPU, the same attention).
    """
    if not enabled or GQA_SWITCH in os.environ:
        yield
        return
    os.environ[GQA_SWITCH] = "1"
    try:
        yield
    finally:
        os.environ.pop(GQA_SWITCH, None)


def verify(model, cache, tokens: torch.Tensor, buffers: TreeBuffers, prefix_len: int) -> Verified:
    """ONE backbone forward over all tree nodes through the public forward (4D mask, position_ids, Cache).

    tokens: [N]; the cache holds ``prefix_len`` entries before the call and ``prefix_len + N`` after it.
    """
    dtype = model.get_output_embeddings().weight.dtype
    with grouped_query_sdpa(shares_kv_heads(model)):
        out = model(
            input_ids=tokens[None],  # [1, N]
            attention_mask=tree_attention_bias(buffers, prefix_len, dtype),  # [1, 1, N, P+N]
            position_ids=(prefix_len + buffers.depths)[None],  # [1, N]
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
    return Verified(logits=out.logits[0], hidden=out.hidden_states[-1][0])


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> Accepted:
    """Longest path whose every candidate equals the backbone's argmax at its parent, plus the bonus token.

    tokens: [N] tree tokens; logits: [N, V] backbone logits at each node.
    """
    # [N]: the backbone's choice after each node (max(dim) = argmax with the same first-index ties, ~2.5x faster
    # than argmax over bf16 rows on CPU)
    predicted = logits.max(dim=-1).indices
    retrieve = buffers.retrieve  # [P, D+1]
    safe = retrieve.clamp(min=0)
    correct = (tokens[safe[:, 1:]] == predicted[safe[:, :-1]]) & (retrieve[:, 1:] >= 0)  # [P, D]
    accepted_len = correct.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = int(accepted_len.argmax())
    m = int(accepted_len[best])
    nodes = retrieve[best, : m + 1]  # [m+1]
    return Accepted(nodes=nodes, tokens=tokens[nodes[1:]].tolist() + [int(predicted[nodes[-1]])])


def commit(cache, prefix_len: int, nodes: torch.Tensor) -> int:
    """Keep exactly the accepted path's KV entries: gather them to positions P..P+m, then crop the rest.

    nodes: [m+1] accepted node indices (root first). Returns the new cache length P + m + 1.
    """
    keep = prefix_len + nodes.numel()
    contiguous = bool((nodes == torch.arange(nodes.numel())).all())  # a chain prefix needs no gather
    for layer in cache.layers:
        if not contiguous:
            src = prefix_len + nodes
            layer.keys[..., prefix_len:keep, :] = layer.keys[..., src, :]
            layer.values[..., prefix_len:keep, :] = layer.values[..., src, :]
    cache.crop(keep - cache.get_seq_length())
    return keep
