"""The backbone's KV cache for the rows of a generation: one interface (``KV``), a growing and a preallocated layout,
chosen in one place (``open_kv``).

Layout: the prompts are left-padded, so after the prefill every row's entries end at the same index W; from then on
each row keeps its own length L_b. A round writes every row's tree at the common end W = max L_b, then each row
gathers its accepted path to L_b..L_b+m_b and the end moves to the new max L_b. A row that accepted less than the
longest holds stale entries between its L_b and W ("holes"): ``live`` [R, W] marks each row's live entries, and the
verify mask lets a node see exactly its row's live prefix and its ancestors. Position ids are per row (its tokens so
far plus the node's depth), so a row computes what it would alone. Holes cost nothing but mask columns (at most the
spread of the rows' accepted lengths), where compacting the rows would copy the cache every round. One row has none.
The padding rule, for every layout: trees are padded to a common node count (a static cache's bucket), and a padding
node sees only itself, so it changes no real node's logits.

- ``GrowingKV`` (transformers' ``DynamicCache``): a verify appends, the commit crops back; a finished row is dropped.
  Every forward has new shapes: fine eagerly, the CPU's default.
- ``StaticKV`` (transformers' ``StaticCache``, allocated once for ``max_len`` positions at fixed addresses): trees
  padded to ``bucket(N, buckets)``, the mask over the whole cache, the write position set instead of cropping; a
  finished row stays as a padding row. A verify has one of len(buckets) shapes, which a captured forward
  (``runner.Runner``) compiles once each: the accelerator's default.

Letters: B rows of the cache, R active rows, N tree nodes, W the common end, F features the drafter reads.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from transformers import DynamicCache, StaticCache

from tokenmaxx.heads.modeling import backbone_features

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tree sizes a static cache's verify is padded to (then multiples)
# ... when the verify is captured: each size is one more compile, while a GPU forward of a few dozen tokens is bound by
# its launches rather than its arithmetic, so coarse padding costs little (the device check measures the curve)
CAPTURE_BUCKETS = (16, 64, 256)
MIN_STATIC = 1024  # the smallest static cache (positions): most generations fit it, so one shape serves them
MIN_CAPTURED = 4096  # ... when its forwards are captured: each cache length is another graph per bucket (a compile),
# and prompts of a few thousand tokens are common; the price is each verify attending over the whole cache
CACHES = ("dynamic", "static")
_POOL = threading.local()  # .static: this thread's static caches (``open_kv``)
POOLED = 4  # static caches a thread keeps (the most recently used)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The size ``n`` rows (tree nodes, queries) are padded to: the smallest of ``sizes`` (increasing) that holds
    them; past the largest, the next multiple of the largest. Each size is one graph of a captured call."""
    for size in sizes:
        if n <= size:
            return size
    return -(-n // sizes[-1]) * sizes[-1]


def last_logits_only(model, prompt_len: int) -> dict:
    """Prefill keyword that has the backbone project only the last prompt position onto the vocabulary.

    An index tensor rather than the int ``logits_to_keep=1``: the int slices a [1, 1, H] view with the prompt's batch
    stride, which torch on CPU projects through a slow path with frozen weights; indexing makes a fresh tensor
    (docs/benchmarks.md, "Why the defaults are what they are"). Models without ``logits_to_keep`` get every position.
    """
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": torch.tensor([prompt_len - 1], device=model.get_output_embeddings().weight.device)}


class KV:
    """The cache of one generation's B rows (see the module docstring): ``prefill``, ``tree_inputs`` of a round's
    trees, ``commit`` of the accepted paths, ``drop`` of finished rows. ``end``: W, the longest row's length."""

    buckets: tuple[int, ...] | None = None  # sizes a verify's trees are padded to (None: their own)

    def __init__(self, rows: int):
        self.rows = rows
        self.active = list(range(rows))  # the cache row of each row still generating
        self._index: torch.Tensor | None = None  # ``active`` on the device; None: every cache row, in order
        self.live: torch.Tensor | None = None  # [R, W] bool: each active row's live entries
        self.ends: list[int] = []  # per active row: L_b
        self.positions: list[int] = []  # per active row: the position id of its root (its tokens so far)
        self.cache = None

    @property
    def end(self) -> int:
        return max(self.ends)

    def prefill(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]],
                feature_layers) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' forwards: input_ids and attention_mask [B, T] left-padded, in ``groups`` of rows (one
        forward each, padded to its own longest prompt; ``loop.prefill_groups``), stored left-padded to the longest
        prompt W. Returns the features [B, W, F] and the last position's logits [B, V]."""
        rows, total = input_ids.shape
        lengths = attention_mask.sum(1)
        width = int(lengths.max())
        parts = []
        for group in groups:
            index = torch.tensor(group, device=input_ids.device)
            own = int(lengths[index].max())  # the group's longest prompt
            ids, mask = input_ids[index, total - own:], attention_mask[index, total - own:]
            padded = {} if bool(mask.all()) else {  # (an unpadded group: the backbone's own causal forward)
                "attention_mask": mask.long(), "position_ids": (mask.long().cumsum(1) - 1).clamp(min=0)}
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True, **padded,
                        **last_logits_only(model, own))
            parts.append((index, own, cache, backbone_features(out.hidden_states, feature_layers), out.logits[:, -1]))
        self._store(model, parts, width)
        self.live = attention_mask[:, total - width:].bool()
        self.ends, self.positions = [width] * rows, lengths.tolist()
        if len(parts) == 1:
            return parts[0][3], parts[0][4]
        hidden = parts[0][3].new_zeros(rows, width, parts[0][3].shape[-1])
        logits = parts[0][4].new_empty(rows, parts[0][4].shape[-1])
        for index, own, _, features, last in parts:
            hidden[index, width - own:], logits[index] = features, last
        return hidden, logits

    def _store(self, model, parts: list, width: int) -> None:
        """The groups' caches as this cache's first W entries (zeros in the padding: masked, never read)."""
        for layer_idx, layer in enumerate(self._allocate(model, parts, width)):
            for index, own, part, _, _ in parts:
                done = part.layers[layer_idx]
                layer.keys[index, :, width - own: width] = done.keys
                layer.values[index, :, width - own: width] = done.values
        self._set_end(width)

    def tree_inputs(self, tokens: torch.Tensor, depths: torch.Tensor, tree: torch.Tensor, real: torch.Tensor | None,
                    dtype: torch.dtype) -> dict:
        """Keywords of the verify forward of the active rows' trees (``decoding.layout``: tokens and depths [R, N],
        tree [R, N, N] bool, a node's ancestors and itself, ``real`` [R, N] bool its real nodes, None: all), written at
        the end W: input_ids and position_ids [B, N'], an additive attention_mask [B, 1, N', C], the cache; N' the
        padded node count, C the columns the cache attends over. Copies nothing from the host for one row."""
        rows, n = tokens.shape
        size = n if self.buckets is None else bucket(n, self.buckets)
        common, device = self.end, tokens.device
        columns = self._columns(common + size)
        active = slice(None) if self._index is None else self._index
        visible = torch.zeros(self.cache_rows, size, columns, dtype=torch.bool, device=device)
        own = torch.arange(size, device=device)
        visible[:, own, common + own] = True  # every node sees itself (a padding node: only itself)
        prefix = self.live[:, None, :]  # [R, 1, W]
        visible[active, :n, :common] = prefix if real is None else prefix & real[..., None]
        visible[active, :n, common: common + n] |= tree
        ids = torch.zeros(self.cache_rows, size, dtype=torch.long, device=device)
        ids[active, :n] = tokens
        position_ids = torch.zeros_like(ids)
        position_ids[active, :n] = (self.positions[0] + depths if rows == 1 else  # (one row: no copy from the host)
                                    torch.tensor(self.positions, device=device)[:, None] + depths)
        mask = torch.zeros(self.cache_rows, 1, size, columns, dtype=dtype, device=device)
        mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
        self._write_at(common)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "past_key_values": self.cache}

    def select(self, out: torch.Tensor) -> torch.Tensor:
        """A verify's output [B, ...] at the active rows [R, ...]."""
        return out if self._index is None else out.index_select(0, self._index)

    def commit(self, paths: list[list[int]], nodes: list[torch.Tensor]) -> None:
        """Each active row keeps its accepted path (``paths``: node indices root first, ``nodes`` the same on the
        device) from its tree at W to its own end L_b, in one copy for all rows and layers' entries."""
        common, device = self.end, self.live.device
        new_ends = [end + len(path) for end, path in zip(self.ends, paths)]
        moved = [i for i, (end, path) in enumerate(zip(self.ends, paths)) if end != common or path != list(
            range(len(path)))]  # (a chain prefix at the end is already in place)
        if moved:
            rows = torch.cat([torch.full((len(paths[i]),), self.active[i], device=device) for i in moved])
            dst = torch.cat([torch.arange(self.ends[i], new_ends[i], device=device) for i in moved])
            src = torch.cat([common + nodes[i] for i in moved])
            for layer in self.cache.layers:
                layer.keys[rows, :, dst] = layer.keys[rows, :, src]  # (the right side is gathered before it is written)
                layer.values[rows, :, dst] = layer.values[rows, :, src]
        longest = max(new_ends)
        live = torch.zeros(len(paths), longest, dtype=torch.bool, device=device)
        live[:, :min(common, longest)] = self.live[:, :longest]
        for i, (end, new_end) in enumerate(zip(self.ends, new_ends)):
            live[i, end:new_end] = True
        self.live, self.ends = live, new_ends
        self.positions = [p + len(path) for p, path in zip(self.positions, paths)]
        self._set_end(longest)

    def drop(self, keep: list[int]) -> None:
        """Only the active rows ``keep`` (indices among the active rows) go on."""
        self.ends, self.positions = [self.ends[i] for i in keep], [self.positions[i] for i in keep]
        self.live = self.live[torch.tensor(keep, device=self.live.device), :self.end]
        self._drop(keep)
        self._set_end(self.end)

    @property
    def cache_rows(self) -> int:
        return len(self.active)

    # the layout's own: the layers the prefill fills, the columns a verify attends over, where the next forward writes,
    # the end after a commit, the rows after a drop
    def _allocate(self, model, parts: list, width: int): ...
    def _columns(self, needed: int) -> int: ...
    def _write_at(self, position: int) -> None: ...
    def _set_end(self, end: int) -> None: ...
    def _drop(self, keep: list[int]) -> None: ...


class GrowingKV(KV):
    """``DynamicCache`` rows: a verify appends its nodes, a commit crops back, a finished row leaves the cache."""

    def _allocate(self, model, parts: list, width: int):
        if len(parts) == 1:  # one forward for every row: its cache is this one
            self.cache = parts[0][2]
            return []
        self.cache = DynamicCache(config=model.config)
        for layer_idx, layer in enumerate(parts[0][2].layers):
            keys, values = layer.keys, layer.values
            self.cache.update(keys.new_zeros(self.rows, keys.shape[1], width, keys.shape[-1]),
                              values.new_zeros(self.rows, values.shape[1], width, values.shape[-1]), layer_idx)
        return self.cache.layers

    def _columns(self, needed: int) -> int:
        return needed

    def _set_end(self, end: int) -> None:
        if self.cache.get_seq_length() > end:  # (crop takes a negative count)
            self.cache.crop(end - self.cache.get_seq_length())

    def _drop(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.live.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.active = list(range(len(keep)))


class StaticKV(KV):
    """``StaticCache`` rows, preallocated for ``max_len`` positions: trees padded to ``buckets``, finished rows kept as
    padding rows, so a verify has one of a few shapes."""

    def __init__(self, rows: int, cache: StaticCache, buckets: tuple[int, ...] = BUCKETS):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets!r}")
        super().__init__(rows)
        self.cache, self.buckets = cache, tuple(buckets)
        self.max_len = cache.layers[0].max_cache_len

    @property
    def cache_rows(self) -> int:
        return self.rows

    def _allocate(self, model, parts: list, width: int):
        return self.cache.layers

    def _columns(self, needed: int) -> int:
        if needed > self.max_len:
            raise ValueError(f"a verify of {needed - self.end} nodes after {self.end} positions overruns the static "
                             f"cache of {self.max_len}")
        return self.max_len

    def _write_at(self, position: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(position)

    def _set_end(self, end: int) -> None:
        self._write_at(end)

    def _drop(self, keep: list[int]) -> None:
        self.active = [self.active[i] for i in keep]
        self._index = torch.tensor(self.active, device=self.live.device)


def open_kv(model, kind: str, rows: int, positions: int, captured: bool = False) -> KV:
    """The cache of a generation of ``rows`` rows of up to ``positions`` positions each (prompt, new tokens, the
    largest padded tree): the one place a layout is chosen. ``kind``: "dynamic" (``GrowingKV``) or "static"
    (``StaticKV``); ``captured``: its verifies are captured (a static cache, padded to ``CAPTURE_BUCKETS``).

    A static cache is the one this thread last used for ``model``, as many rows and these tree sizes, when it is large
    enough (whichever generator made it: a thread runs one generation at a time; the ``POOLED`` most recently used
    are kept), else a new one of the next power of two positions (at least ``MIN_STATIC``, ``MIN_CAPTURED`` when
    captured; at most the one that holds the model's context): one address and one mask width, so a captured forward
    is recorded once, not per prompt length, nor again when one prompt and batches take turns."""
    if kind not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {kind!r}")
    if captured and kind != "static":
        raise ValueError("a captured verify needs cache='static': a captured forward runs at fixed shapes")
    if kind == "dynamic":
        return GrowingKV(rows)
    buckets = CAPTURE_BUCKETS if captured else BUCKETS
    pool = _POOL.__dict__.setdefault("static", {})  # (id(model), rows, buckets) -> (model ref, cache), oldest first
    key = (id(model), rows, buckets)
    ref, cache = pool.pop(key, (None, None))
    if ref is None or ref() is not model or cache.layers[0].max_cache_len < positions:
        weight = model.get_output_embeddings().weight
        ref, cache = weakref.ref(model), static_cache(model.config, rows, static_length(model, positions, captured),
                                                       weight.dtype, weight.device)
    pool[key] = ref, cache  # (the most recently used last)
    for stale in [k for k, (r, _) in pool.items() if r() is None]:
        del pool[stale]  # (a backbone that is gone)
    while len(pool) > POOLED:
        del pool[next(iter(pool))]
    return StaticKV(rows, cache, buckets)


def static_length(model, positions: int, captured: bool = False) -> int:
    """The positions of a new static cache for a generation of ``positions`` (``open_kv``)."""
    length = max(MIN_CAPTURED if captured else MIN_STATIC, 1 << (positions - 1).bit_length())  # (powers of two)
    context = getattr(model.config, "max_position_embeddings", None)  # (no generation needs more)
    return min(length, 1 << (max(context, positions) - 1).bit_length()) if context else length


def static_cache(config, rows: int, length: int, dtype: torch.dtype, device: torch.device) -> StaticCache:
    """A ``StaticCache`` of ``rows`` rows and ``length`` positions for the layers ``config`` describes, allocated on
    ``device`` in ``dtype``."""
    cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(rows, *kv_heads(config), dtype, device)
    return cache


def kv_heads(config) -> tuple[int, int]:
    """The key/value heads of a layer of ``config``'s model and their size."""
    heads = config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or \
        config.hidden_size // heads
