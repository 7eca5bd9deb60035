"""The frozen backbone's hidden states that the heads read: computed per batch, or cached on disk once for all epochs.

What the heads read (``heads.modeling.backbone_features``): ``model(...).hidden_states[-1]`` (in transformers 5 the
final-normed state, so ``lm_head(hidden_states[-1]) == logits``), or for heads with ``feature_layers`` (EAGLE-3) the
hidden states at those indices, concatenated. Only each sequence's window (``batches.window_start``) is kept.

Cache layout (``--feature_cache DIR``)::

    DIR/meta.json                 backbone identity, dtype, feature layers, seq_len, lookback (heads), data fingerprint,
                                  shard size
    DIR/shard-00000.safetensors   hidden [sum W, F] (backbone dtype), rows [n], starts [n], offsets [n+1] (int64)

Rows are grouped into shards of ``shard_size`` consecutive dataset rows. Each shard is written under a temp name and
renamed, so a killed build leaves only complete shards and a rerun builds just the missing ones (resumable); with
several processes, rank r builds shards r, r+world, ... A cache made with more heads or depths (a longer lookback)
serves a run with fewer, and a cache that stores more layers (``store_layers``) serves every run whose heads read a
subset of them (index ``num_hidden_layers`` is the final-normed state that MTP and Medusa heads read; EAGLE-3 heads
read three earlier ones): one backbone pass over the data then serves an ablation of kinds and feature layers.
Anything else that differs is an error naming the field.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from tokenmaxx.heads.io.loading import write_atomic
from tokenmaxx.heads.modeling import backbone_features

from .batches import Batch, SelfDistilledData, window_start

log = logging.getLogger(__name__)
META = "meta.json"
FORMAT = 1


@torch.no_grad()
def backbone_hidden(model, sequences: list[torch.Tensor], layers=None) -> list[torch.Tensor]:
    """What the heads read of each sequence [T_i] -> [T_i, F] (``backbone_features`` at ``layers``; None: the
    final-normed last states, F = H), in one right-padded forward."""
    lengths = [len(s) for s in sequences]
    input_ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)  # [B, T] built on the CPU, then moved
    attention_mask = torch.zeros_like(input_ids)  # [B, T]
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = seq
        attention_mask[i, : len(seq)] = 1
    device = model.get_output_embeddings().weight.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                logits_to_keep=1)  # logits of the last position only: the heads need the states, not the logits
    hidden = backbone_features(out.hidden_states, layers)  # [B, T, F]
    return [hidden[i, :n] for i, n in enumerate(lengths)]


def _pad_windows(windows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[W_i, H] each -> [B, width, H] (the batch's width), zero-padded."""
    out = windows[0].new_zeros(len(windows), width, windows[0].shape[1])
    for i, w in enumerate(windows):
        out[i, : w.shape[0]] = w
    return out


class BackboneFeatures:
    """No cache: run the frozen backbone over each batch's full sequences and keep their windows."""

    def __init__(self, model, data: SelfDistilledData, layers=None):
        self.model, self.data, self.layers = model, data, layers

    def hidden(self, batch: Batch) -> torch.Tensor:  # -> [B, W, F]
        states = backbone_hidden(self.model, [self.data.examples[r].ids for r in batch.rows], self.layers)
        return _pad_windows([s[start:] for s, start in zip(states, batch.starts)], batch.input_ids.shape[1])


def cache_meta(model, data: SelfDistilledData, seq_len: int, lookback: int, shard_size: int, layers=None) -> dict:
    from tokenmaxx.heads import backbone_identity

    ident, revision = backbone_identity(model)
    hidden = model.get_output_embeddings().weight.shape[1]
    return {"format": FORMAT, "backbone": ident, "backbone_revision": revision,
            "adapter": getattr(model.config, "tokenmaxx_adapter", None),
            "adapter_revision": getattr(model.config, "tokenmaxx_adapter_revision", None),
            "dtype": str(model.get_output_embeddings().weight.dtype).removeprefix("torch."),
            "hidden_size": hidden * (len(layers) if layers else 1), "seq_len": seq_len, "lookback": lookback,
            "feature_layers": list(layers) if layers else None,
            "data_fingerprint": data.fingerprint, "num_rows": data.num_rows, "shard_size": shard_size}


def final_state_index(model) -> int:
    """The hidden-state index of the final-normed state (what ``layers=None`` reads): the backbone's layer count."""
    layers = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ValueError(f"backbone config {type(model.config).__name__} has no num_hidden_layers: cannot tell which "
                         "hidden state is the final one")
    return layers


def _stored(meta: dict, final: int) -> list[int]:
    """The hidden-state indices a cache (meta) stores, in column order (None: the final-normed state alone)."""
    return list(meta["feature_layers"]) if meta.get("feature_layers") else [final]


def columns(stored: list[int], reads: list[int] | None, final: int) -> list[int] | None:
    """Which of the stored layers' column blocks a run reading ``reads`` (None: the final state) takes, in its
    order; None when it takes them all as stored. Raises ValueError when a layer it reads is not stored."""
    reads = list(reads) if reads else [final]
    missing = [i for i in reads if i not in stored]
    if missing:
        raise ValueError(f"the heads read hidden states {reads} but store_layers {stored} lacks {missing}")
    picked = [stored.index(i) for i in reads]
    return None if picked == list(range(len(stored))) else picked


def _check_meta(found: dict, wanted: dict, folder: Path, reads: list[int] | None, final: int) -> None:
    skip = ("lookback", "feature_layers", "hidden_size")
    bad = {k: (found.get(k), v) for k, v in wanted.items() if k not in skip and found.get(k) != v}
    if found.get("lookback", -1) < wanted["lookback"]:
        bad["lookback"] = (found.get("lookback"), f">= {wanted['lookback']}")
    stored = _stored(found, final)
    per_layer = wanted["hidden_size"] // len(_stored(wanted, final))
    if found.get("hidden_size") != per_layer * len(stored):
        bad["hidden_size"] = (found.get("hidden_size"), f"{per_layer} per stored layer")
    try:
        columns(stored, reads, final)
    except ValueError:
        bad["feature_layers"] = (found.get("feature_layers"), f"a cache storing {list(reads) if reads else [final]}")
    if bad:
        detail = "; ".join(f"{k}: cache has {a!r}, this run needs {b if isinstance(b, str) else repr(b)}"
                           for k, (a, b) in bad.items())
        raise ValueError(f"feature cache {folder} was made for another run ({detail}); delete it or pass another "
                         "--feature_cache folder")


class FeatureCache:
    """Hidden-state windows stored on disk; ``hidden(batch)`` reads them (memory-mapped) instead of the backbone."""

    def __init__(self, folder: str | Path, meta: dict, device: torch.device | str = "cpu",
                 select: list[int] | None = None):
        self.folder, self.meta, self.device = Path(folder), meta, torch.device(device)  # where hidden() delivers
        self.select = select  # which stored layers' column blocks hidden() returns, in order (None: all)
        self._index: dict[int, tuple[int, int, int, int]] | None = None  # row -> (shard, begin, end, window start)
        self._handles: dict[int, object] = {}

    def _load_index(self) -> dict[int, tuple[int, int, int, int]]:
        index = {}
        for shard in range(self.num_shards):
            with safe_open(self._shard_path(shard), framework="pt") as f:
                rows, starts, offsets = f.get_tensor("rows"), f.get_tensor("starts"), f.get_tensor("offsets")
            for i, row in enumerate(rows.tolist()):
                index[row] = (shard, int(offsets[i]), int(offsets[i + 1]), int(starts[i]))
        return index

    @property
    def num_shards(self) -> int:
        return -(-self.meta["num_rows"] // self.meta["shard_size"])

    def _shard_path(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:05d}.safetensors"

    # ---- build ----------------------------------------------------------------------------------------------------
    @classmethod
    def build_or_open(cls, folder: str | Path, model, data: SelfDistilledData, seq_len: int, num_heads: int,
                      shard_size: int = 256, batch_size: int = 8, rank: int = 0, world: int = 1,
                      barrier: Callable[[], None] = lambda: None, layers=None,
                      store_layers=None) -> "FeatureCache":
        """Open the cache at ``folder``, first building whatever shards are missing (this rank's share of them).
        ``layers``: the heads' feature layers (None: the final-normed last states). ``store_layers``: the hidden-state
        indices a new cache stores (a superset of ``layers``; default: ``layers`` exactly), so that runs reading other
        layers can share it; an existing cache serves any run whose layers it stores."""
        folder = Path(folder)
        final = final_state_index(model)
        if store_layers is not None:
            store_layers = list(store_layers)
            if len(set(store_layers)) != len(store_layers) or any(i < 0 or i > final for i in store_layers):
                raise ValueError(f"store_layers must be distinct hidden-state indices in 0..{final} (the backbone has "
                                 f"{final} layers; {final} is the final-normed state), got {store_layers}")
            columns(store_layers, layers, final)  # the heads' own layers must be among them
        wanted = cache_meta(model, data, seq_len, num_heads, shard_size,
                            store_layers if store_layers is not None else layers)
        meta_path = folder / META
        if meta_path.is_file():
            _check_meta(json.loads(meta_path.read_text()), wanted, folder, layers, final)
        elif rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(meta_path, lambda p: Path(p).write_text(json.dumps(wanted, indent=2) + "\n"))
        barrier()
        # the cache's own (maybe longer) lookback and shard size; windows are delivered on the backbone's device
        meta = json.loads(meta_path.read_text())
        cache = cls(folder, meta, model.get_output_embeddings().weight.device,
                    columns(_stored(meta, final), layers, final))
        todo = [s for s in range(rank, cache.num_shards, world) if not cache._shard_path(s).is_file()]
        for shard in tqdm(todo, desc="feature cache", unit="shard", disable=rank != 0 or not todo):
            cache._build_shard(shard, model, data, batch_size)
        barrier()
        return cache

    def _build_shard(self, shard: int, model, data: SelfDistilledData, batch_size: int) -> None:
        size, lookback = self.meta["shard_size"], self.meta["lookback"]
        rows = [r for r in range(shard * size, (shard + 1) * size) if r in data.examples]
        windows: dict[int, torch.Tensor] = {}
        by_length = sorted(rows, key=lambda r: len(data.examples[r].ids))  # less padding per forward
        for i in range(0, len(by_length), batch_size):
            chunk = by_length[i: i + batch_size]
            states = backbone_hidden(model, [data.examples[r].ids for r in chunk], self.meta.get("feature_layers"))
            for r, s in zip(chunk, states):  # stored from the CPU
                windows[r] = s[window_start(data.examples[r].prompt_len, lookback):].to("cpu").contiguous()
        hidden_size = self.meta["hidden_size"]
        dtype = getattr(torch, self.meta["dtype"])
        tensors = {
            "hidden": torch.cat([windows[r] for r in rows]) if rows else torch.zeros(0, hidden_size, dtype=dtype),
            "rows": torch.tensor(rows, dtype=torch.long),
            "starts": torch.tensor([window_start(data.examples[r].prompt_len, lookback) for r in rows],
                                   dtype=torch.long),
            "offsets": torch.tensor([0] + [len(windows[r]) for r in rows], dtype=torch.long).cumsum(0),
        }
        write_atomic(self._shard_path(shard), lambda p: save_file(tensors, p, metadata={"format": "pt"}))

    # ---- read -----------------------------------------------------------------------------------------------------
    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(self._shard_path(shard), framework="pt")
        return self._handles[shard]

    def window(self, row: int, start: int) -> torch.Tensor:
        """Cached states of ``row`` from sequence position ``start`` on: [T - start, H]."""
        if self._index is None:
            self._index = self._load_index()
        if row not in self._index:
            raise KeyError(f"row {row} is not in the feature cache {self.folder}")
        shard, begin, end, cached_start = self._index[row]
        if start < cached_start:
            raise ValueError(f"row {row}: the cache holds positions from {cached_start}, asked for {start}")
        states = self._handle(shard).get_slice("hidden")[begin + start - cached_start: end]  # [T - start, n * H]
        if self.select is None:
            return states
        blocks = states.view(states.shape[0], -1, self.meta["hidden_size"] // len(self.meta["feature_layers"]))
        return blocks[:, self.select].reshape(states.shape[0], -1)  # [T - start, len(select) * H]

    def hidden(self, batch: Batch) -> torch.Tensor:  # -> [B, W, H] on the backbone's device
        windows = [self.window(r, s) for r, s in zip(batch.rows, batch.starts)]
        return _pad_windows(windows, batch.input_ids.shape[1]).to(self.device)
