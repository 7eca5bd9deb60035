"""A preallocated KV cache for speculative rounds: trees padded to a few sizes, the accepted path committed in place.

With transformers' ``DynamicCache`` (``decoding.verify`` / ``decoding.commit`` on it) every verify appends N entries
and the commit crops back, so each round's forward sees new shapes: fine in eager mode, and the CPU's default. A
captured forward (a CUDA graph: one launch for the ~1,000 kernels of a small backbone's forward) needs fixed shapes
and fixed addresses instead. ``StaticKV`` gives both:

- the cache is transformers' ``StaticCache`` (its layers' key/value tensors allocated once for ``max_len``
  positions, written where each layer's ``cumulative_length`` points);
- a tree of N nodes is verified padded to ``bucket(N, BUCKETS)``, the smallest of a few sizes: the padding nodes see
  only the prefix and themselves and no real node sees them, so the real nodes' logits are those of the unpadded
  tree; the attention mask spans the whole cache ([1, 1, B, max_len]), hiding every position past the tree;
- ``commit`` gathers the accepted path's entries to the positions after the prefix and sets the write position
  there; stale entries past it stay, masked, until the next verify overwrites them.

A forward over a ``StaticKV`` is then one of len(BUCKETS) shapes, which ``forward.ForwardContext(capture=True)``
compiles once each (``torch.compile(mode="reduce-overhead")``: CUDA graphs).
"""

from __future__ import annotations

import weakref

import torch
from transformers import StaticCache

from tokenmaxx.heads.capture import bucket

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tree sizes a verify is padded to (a multiple of the last past it)
# ... when the verify is captured: each size is one more compile, while a GPU forward of a few dozen tokens is bound by
# its launches rather than its arithmetic, so coarse padding costs little (the device check measures the curve)
CAPTURE_BUCKETS = (16, 64, 256)


class StaticKV:
    """The backbone's KV cache for one generation, preallocated (see the module docstring).

    ``max_len``: positions it holds: the prompt, the new tokens and the largest padded tree beyond them."""

    def __init__(self, model, max_len: int, buckets: tuple[int, ...] = BUCKETS):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets!r}")
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.max_len, self.buckets = max_len, tuple(buckets)
        self.model_ref = weakref.ref(model)  # which backbone's cache this is

    def write_at(self, position: int) -> None:
        """Where the next forward writes its keys and values (every layer); after the prefill, the prompt's
        length."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(position)

    def prefill_inputs(self) -> dict:
        """Keywords of the prompt's forward (the model builds its causal mask over the whole cache)."""
        self.write_at(0)
        return {"past_key_values": self.cache}

    def tree_inputs(self, tokens: torch.Tensor, depths: torch.Tensor, attn_mask: torch.Tensor, prefix_len: int,
                    dtype: torch.dtype) -> dict:
        """Keywords of the verify forward of a tree of N nodes after ``prefix_len`` cached positions, padded to its
        bucket B: input_ids [1, B], attention_mask [1, 1, B, max_len] additive, position_ids [1, B], the cache.
        tokens, depths [N] and attn_mask [N, N] on the cache's device."""
        n = tokens.shape[0]
        size = bucket(n, self.buckets)
        if prefix_len + size > self.max_len:
            raise ValueError(f"a tree of {n} nodes (verified as {size}) after {prefix_len} positions overruns the "
                             f"static cache of {self.max_len}")
        device = tokens.device
        pad = size - n
        mask = torch.full((1, 1, size, self.max_len), torch.finfo(dtype).min, dtype=dtype, device=device)
        mask[..., :prefix_len] = 0.0
        tree = mask[0, 0, :, prefix_len: prefix_len + size]  # [B, B] a view: the tree's own block
        tree[:n, :n].masked_fill_(attn_mask, 0.0)
        if pad:  # padding nodes see the prefix and themselves
            tree[n:, n:].masked_fill_(torch.eye(pad, dtype=torch.bool, device=device), 0.0)
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            depths = torch.cat([depths, depths.new_zeros(pad)])
        self.write_at(prefix_len)
        return {"input_ids": tokens[None], "attention_mask": mask, "position_ids": (prefix_len + depths)[None],
                "past_key_values": self.cache}

    def commit(self, prefix_len: int, nodes: torch.Tensor, path: list[int]) -> int:
        """Keep the accepted path's entries: gather them to positions P..P+m and write from there next. nodes [m+1]
        on the cache's device, ``path`` the same as a list. Returns P + m + 1."""
        keep = prefix_len + len(path)
        if path != list(range(len(path))):  # a chain prefix is already in place
            src = prefix_len + nodes
            for layer in self.cache.layers:
                layer.keys[:, :, prefix_len:keep] = layer.keys.index_select(2, src)
                layer.values[:, :, prefix_len:keep] = layer.values.index_select(2, src)
        self.write_at(keep)
        return keep
