"""The backbone's steps of one speculative round over the rows of a batch (one prompt: a batch of one row), as plain
functions: ``layout`` (the rows' trees as batch tensors) -> ``verify`` (one backbone forward over every row's tree,
4D mask) -> ``accept_greedy`` (each row's longest agreeing path + bonus; ``sampling.py`` for temperature > 0) ->
``commit`` (each row keeps only its accepted path in the KV cache). Where the trees go in the cache, and how they are
padded, is the cache's (``kv.KV``); how the forward runs on this machine is the runner's (``runner.Runner``). The loop
is ``loop.decode``.

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

Devices: the tree tokens, the backbone's outputs and the accepted nodes live on the backbone's device; so do the
buffers of trees grown there (dynamic trees), while static and host-merged trees are compiled on the CPU and each step
takes their device copy (``TreeBuffers.to``, made once per tree). A greedy round reads back to Python once: every
row's accepted length, path and tokens in one small tensor (``accept_greedy``); commit and the next draft take their
indices from the device.

Letters: R rows, N tree nodes (the largest row's), V vocabulary, F features the drafter reads, D tree depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tokenmaxx.heads.drafting import Draft
from tokenmaxx.heads.modeling import backbone_features

from .runner import Runner


@dataclass
class Verified:
    logits: torch.Tensor  # [R, N, V] backbone logits at each row's tree nodes (padding nodes: never read)
    hidden: torch.Tensor  # [R, N, F] what the drafter reads at each node (``backbone_features``; default: [.., H]
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


# a batch's acceptance: the rows' drafts and the forward's logits [R, N, V] -> each row's ``Accepted``
Accept = Callable[[list[Draft], torch.Tensor], list[Accepted]]


def layout(drafts: list[Draft], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor | None]:
    """The rows' trees as batch tensors, padded to the largest: tokens and depths [R, N], the tree mask [R, N, N]
    (a node sees its ancestors and itself; padding nodes are left to the cache's padding rule, ``kv.KV.tree_inputs``)
    and the real nodes [R, N] (None: no padding)."""
    counts = [d.num_nodes for d in drafts]
    if len(drafts) == 1:
        buffers = drafts[0].buffers.to(device)
        return drafts[0].tokens[None], buffers.depths[None], buffers.attn_mask[None], None
    rows, n = len(drafts), max(counts)
    tokens = torch.zeros(rows, n, dtype=torch.long, device=device)
    depths = torch.zeros(rows, n, dtype=torch.long, device=device)
    tree = torch.zeros(rows, n, n, dtype=torch.bool, device=device)
    real = torch.zeros(rows, n, dtype=torch.bool, device=device)
    for i, (draft, k) in enumerate(zip(drafts, counts)):
        buffers = draft.buffers.to(device)
        tokens[i, :k], depths[i, :k], tree[i, :k, :k], real[i, :k] = draft.tokens, buffers.depths, \
            buffers.attn_mask, True
    return tokens, depths, tree, real


def verify(model, kv, drafts: list[Draft], runner=None, feature_layers: tuple[int, ...] | None = None) -> Verified:
    """ONE backbone forward over every active row's tree through the public forward (4D mask, position_ids, Cache),
    written at the cache's end (``kv.KV.tree_inputs``). ``runner``: how the forward runs on this machine
    (``runner.Runner``; None: as the model is). ``feature_layers``: which hidden states ``Verified.hidden`` holds (the
    drafter's; None: the final-normed last)."""
    weight = model.get_output_embeddings().weight
    tokens, depths, tree, real = layout(drafts, weight.device)
    inputs = kv.tree_inputs(tokens, depths, tree, real, weight.dtype)
    out = (runner or Runner())(model, **inputs)
    n = tokens.shape[1]  # (a padded tree's extra nodes are dropped)
    return Verified(logits=kv.select(out.logits[:, :n]),
                    hidden=kv.select(backbone_features(out.hidden_states, feature_layers)[:, :n]))


def accept_greedy(drafts: list[Draft], logits: torch.Tensor) -> list[Accepted]:
    """Each row's longest path whose every candidate equals the backbone's argmax at its parent, plus the bonus token,
    read back in one read for all rows. logits: [R, N, V] at each row's nodes (a row's trees padded to N)."""
    device = logits.device
    rows = len(drafts)
    if rows == 1:
        retrieve, tokens = drafts[0].buffers.to(device).retrieve[None], drafts[0].tokens[None]  # [1, P, D+1], [1, N]
    else:
        depth = max(d.buffers.depth for d in drafts)
        paths = max(d.buffers.retrieve.shape[0] for d in drafts)
        retrieve = torch.full((rows, paths, depth + 1), -1, dtype=torch.long, device=device)  # [R, P, D+1]
        tokens = torch.zeros(rows, logits.shape[1], dtype=torch.long, device=device)  # [R, N]
        for i, draft in enumerate(drafts):
            own = draft.buffers.to(device).retrieve
            retrieve[i, : own.shape[0], : own.shape[1]] = own
            tokens[i, : draft.num_nodes] = draft.tokens
    # [R, N]: the backbone's choice after each node (max(dim): argmax with the same first-index ties, faster than
    # argmax over bf16 rows on CPU)
    predicted = logits.max(dim=-1).indices
    safe = retrieve.clamp(min=0)
    flat = safe.flatten(1)  # [R, P*(D+1)]
    nodes_tok = tokens.gather(1, flat).view_as(safe)  # [R, P, D+1]
    nodes_pred = predicted.gather(1, flat).view_as(safe)
    correct = (nodes_tok[..., 1:] == nodes_pred[..., :-1]) & (retrieve[..., 1:] >= 0)  # [R, P, D]
    accepted_len = correct.long().cumprod(dim=-1).sum(dim=-1)  # [R, P]
    best = accepted_len.argmax(dim=1)  # [R] (tensor indices throughout: nothing is read yet)
    index = torch.arange(rows, device=device)
    row, m = safe[index, best], accepted_len[index, best]  # [R, D+1], [R]
    bonus = predicted.gather(1, row.gather(1, m[:, None]))  # [R, 1]
    candidates = tokens.gather(1, row[:, 1:])  # [R, D]
    read = torch.cat([m[:, None], row, candidates, bonus], dim=1).tolist()  # one read: [R, 1 + D+1 + D + 1]
    width = row.shape[1]
    out = []
    for i, values in enumerate(read):
        length = values[0]
        out.append(Accepted(nodes=row[i, : length + 1], tokens=values[1 + width: 1 + width + length] + values[-1:],
                            path=values[1: 2 + length], token_ids=torch.cat([candidates[i, :length], bonus[i]])))
    return out


def each_row(rule: Callable) -> Accept:
    """A batch's acceptance from a rule for one tree (``rule(tokens [N], logits [N, V], buffers) -> Accepted``, as the
    sampling rules are): applied to each row in turn."""
    def accept(drafts: list[Draft], logits: torch.Tensor) -> list[Accepted]:
        return [rule(d.tokens, logits[i, : d.num_nodes], d.buffers) for i, d in enumerate(drafts)]
    return accept


def commit(kv, accepted: list[Accepted]) -> None:
    """Each row keeps exactly its accepted path's entries in the cache (``kv.KV.commit``)."""
    kv.commit([a.path for a in accepted], [a.nodes for a in accepted])
