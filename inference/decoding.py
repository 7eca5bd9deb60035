"""The backbone's steps of one speculative round (verify -> accept -> commit), as plain functions over explicit state.

Terms (used throughout tokenmaxx):
- root: the last token the backbone chose; it is not in the KV cache yet and is node 0 of the tree.
- node: one drafted token placed in the tree (a path of ranks, see ``tree.py``); depth d = path length.
- path: root-to-leaf chain of nodes; a path is *accepted* up to its first candidate the backbone disagrees with.
- accepted: candidates on the chosen path that equal what the backbone itself would have produced.
- bonus token: the backbone's own next token after the last accepted node (it comes for free from the same forward).
- tau (accepted length): tokens produced per backbone forward = accepted candidates + 1 bonus token.
- head offset rule: head k reading the hidden state at position t targets the token at t+k+1; with the root at
  t+1, head k's guesses sit at tree depth k. The sequential kinds (EAGLE-3, the default, and MTP) follow it with
  their draft depth d as head k = d.

One round: a drafter's ``propose`` (``drafting.py``: tree tokens) -> ``verify`` (one backbone forward over the tree,
4D mask) -> ``accept_greedy`` (longest agreeing path + bonus; ``sampling.py`` for temperature > 0) -> ``commit`` (keep
only the accepted path in the KV cache) -> the drafter's ``observe``. The loop is ``loop.speculative_decode``.

Devices: the tree tokens, the backbone's outputs and the accepted nodes live on the backbone's device; so do the
buffers of trees grown there (dynamic trees), while static and host-merged trees are compiled on the CPU and each step
takes their device copy (``TreeBuffers.to``, made once per tree). A greedy round reads back to Python once: the
accepted length, path and tokens in one small tensor (``accept_greedy``); commit and the next draft take their
indices from the device.

Letters: N tree nodes, P cached prefix length, K heads (or draft depths), V vocabulary, H hidden size, D tree depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.heads.tree import TreeBuffers

from .forward import ForwardContext
from .kv import StaticKV


@dataclass
class Verified:
    logits: torch.Tensor  # [N, V] backbone logits at each tree node
    hidden: torch.Tensor  # [N, F] what the drafter reads at each tree node (``backbone_features``; default: [N, H]
    # final-normed last hidden state)


@dataclass
class Accepted:
    nodes: torch.Tensor  # [m+1] long: tree node indices of the accepted path, root first (on the logits' device)
    tokens: list[int]  # the m accepted candidates followed by the bonus token (what this round emits)
    path: list[int] | None = None  # ``nodes`` as a list (None: read from ``nodes``)
    token_ids: torch.Tensor | None = None  # [m+1] long ``tokens`` on the logits' device (None: copied from ``tokens``)

    def __post_init__(self):
        if self.path is None:
            self.path = self.nodes.tolist()
        if self.token_ids is None:
            self.token_ids = torch.tensor(self.tokens, dtype=torch.long, device=self.nodes.device)


def tree_attention_bias(buffers: TreeBuffers, prefix_len: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, P+N] of ``dtype`` on ``device``: the cached prefix is visible to all nodes; a node
    sees its ancestors and itself."""
    n = buffers.num_nodes
    bias = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=device)
    bias[0, 0, :, prefix_len:].masked_fill_(~buffers.to(device).attn_mask, torch.finfo(dtype).min)
    return bias


def verify(model, cache, tokens: torch.Tensor, buffers: TreeBuffers, prefix_len: int,
           forward: ForwardContext | None = None, feature_layers: tuple[int, ...] | None = None) -> Verified:
    """ONE backbone forward over all tree nodes through the public forward (4D mask, position_ids, Cache).

    tokens: [N] on the backbone's device; a transformers cache holds ``prefix_len`` entries before the call and
    ``prefix_len + N`` after it; a ``kv.StaticKV`` is written at ``prefix_len`` on, the tree padded to its bucket. ``forward``: how the forward runs on this machine (``forward.ForwardContext``; None: as the model is).
    ``feature_layers``: which hidden states ``Verified.hidden`` holds (the drafter's; None: the final-normed last).
    """
    weight = model.get_output_embeddings().weight
    on_device = buffers.to(weight.device)
    if isinstance(cache, StaticKV):  # padded to its bucket, the mask over the whole preallocated cache
        inputs = cache.tree_inputs(tokens, on_device.depths, on_device.attn_mask, prefix_len, weight.dtype)
    else:
        inputs = dict(input_ids=tokens[None],  # [1, N]
                      attention_mask=tree_attention_bias(buffers, prefix_len, weight.dtype, weight.device),  # [1,1,N,P+N]
                      position_ids=(prefix_len + on_device.depths)[None],  # [1, N]
                      past_key_values=cache)
    out = (forward or ForwardContext())(model, **inputs, use_cache=True, output_hidden_states=True)
    n = tokens.shape[0]  # (a padded tree's extra rows are dropped)
    return Verified(logits=out.logits[0, :n], hidden=backbone_features(out.hidden_states, feature_layers)[0, :n])


def accept_greedy(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers) -> Accepted:
    """Longest path whose every candidate equals the backbone's argmax at its parent, plus the bonus token.

    tokens: [N] tree tokens; logits: [N, V] backbone logits at each node (both on one device).
    """
    # [N]: the backbone's choice after each node (max(dim): argmax with the same first-index ties, faster than argmax
    # over bf16 rows on CPU)
    predicted = logits.max(dim=-1).indices
    retrieve = buffers.to(logits.device).retrieve  # [P, D+1]
    safe = retrieve.clamp(min=0)
    correct = (tokens[safe[:, 1:]] == predicted[safe[:, :-1]]) & (retrieve[:, 1:] >= 0)  # [P, D]
    accepted_len = correct.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = accepted_len.argmax(dim=0, keepdim=True)  # [1] (tensor indices throughout: nothing is read yet)
    row, m = safe.index_select(0, best)[0], accepted_len.index_select(0, best)[0]  # [D+1], []
    bonus = predicted.index_select(0, row.gather(0, m[None]))  # [1]
    candidates = tokens[row[1:]]  # [D]
    # one read: the accepted length, the row's nodes and tokens, the bonus token
    read = torch.cat([m[None], row, candidates, bonus]).tolist()
    m, width = read[0], row.numel()
    return Accepted(nodes=row[: m + 1], tokens=read[1 + width: 1 + width + m] + read[-1:],
                    path=read[1: 2 + m], token_ids=torch.cat([candidates[:m], bonus]))


def commit(cache, prefix_len: int, nodes: torch.Tensor, path: list[int] | None = None) -> int:
    """Keep exactly the accepted path's KV entries: gather them to positions P..P+m, then crop the rest.

    nodes: [m+1] accepted node indices (root first) on the cache's device; ``path``: the same as a list where the
    caller has it (None: read from ``nodes``). Returns the new cache length P + m + 1.
    """
    path = nodes.tolist() if path is None else path
    if isinstance(cache, StaticKV):
        return cache.commit(prefix_len, nodes, path)
    keep = prefix_len + len(path)
    contiguous = path == list(range(len(path)))  # a chain prefix: nothing to gather
    for layer in cache.layers:
        if not contiguous:
            src = prefix_len + nodes
            layer.keys[..., prefix_len:keep, :] = layer.keys[..., src, :]
            layer.values[..., prefix_len:keep, :] = layer.values[..., src, :]
    cache.crop(keep - cache.get_seq_length())
    return keep
