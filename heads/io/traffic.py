"""Recorded traffic: what the backbone computed while it served, kept for the heads to learn from (``tokenmaxx adapt``).

Every speculative round verifies the drafted tree with one backbone forward, and the states it computes at the
accepted positions are exactly what the heads read in training (their feature layers), beside the backbone's own
tokens there. A recording keeps them, so that adapting the heads to the traffic needs no backbone forward at all.

Folder layout (append-only; one shard per ``generate`` call, each written under a temp name and renamed, so a killed
process leaves only whole shards, and several processes may record into one folder)::

    FOLDER/meta.json                      backbone identity and revision, feature layers, feature size and dtype,
                                          lookback (the prompt positions kept before the answer)
    FOLDER/traffic-<ns>-<pid>.safetensors ids [sum T] (each row's prompt tail + new tokens), offsets [n+1],
                                          prompt_lens [n] (the prompt tokens kept in each row), features
                                          [sum (T - 1), F] (the backbone's states at every position but each row's
                                          last, whose state no forward computed), sampled [n] (1: the row's tokens
                                          were sampled, not greedy); where recorded (``topk`` in the shard's
                                          metadata), topk_ids and topk_logprobs [sum (T - prompt_len), k]: the
                                          backbone's k most likely tokens and their log-probabilities at each row's
                                          answer positions (the prompt's last on), its own distribution

A row keeps the prompt's last ``lookback + 1`` tokens (training reads at most that much before the answer:
``window_start``), so a long prompt costs no more than that.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import backbone_identity
from .loading import write_atomic

META = "meta.json"
FORMAT = 1
PREFIX, SUFFIX = "traffic-", ".safetensors"
IDENTITY = ("backbone", "backbone_revision", "adapter", "feature_layers", "feature_size", "dtype")


@dataclass
class TrafficRow:
    """One generation as recorded: ``ids`` [T] (the prompt's kept tail, then the new tokens), the number of those that
    are prompt, the backbone's features at positions 0..T-2 [T-1, F], and whether the tokens were sampled."""

    ids: torch.Tensor
    prompt_len: int
    features: torch.Tensor
    sampled: bool = False
    topk_ids: torch.Tensor | None = None  # [T - prompt_len, k] int32: the backbone's top tokens at answer positions
    topk_logprobs: torch.Tensor | None = None  # [T - prompt_len, k] their log-probabilities

    def cut(self, lookback: int) -> "TrafficRow":
        """The row from ``lookback`` positions before the prompt's last on (what heads of that lookback read)."""
        skip = max(0, self.prompt_len - 1 - lookback)
        return TrafficRow(self.ids[skip:], self.prompt_len - skip, self.features[skip:], self.sampled,
                          self.topk_ids, self.topk_logprobs)

    def __post_init__(self):
        if self.features.shape[0] != self.ids.shape[0] - 1:
            raise ValueError(f"a traffic row of {self.ids.shape[0]} tokens needs features at its first "
                             f"{self.ids.shape[0] - 1} positions, got {self.features.shape[0]}")
        answer = self.ids.shape[0] - self.prompt_len
        if (self.topk_ids is None) != (self.topk_logprobs is None):
            raise ValueError("a traffic row's top-k needs both topk_ids and topk_logprobs, or neither")
        if self.topk_ids is not None and (self.topk_ids.shape[0] != answer
                                          or self.topk_logprobs.shape != self.topk_ids.shape):
            raise ValueError(f"a traffic row with {answer} answer positions needs top-k [{answer}, k] ids and "
                             f"log-probabilities, got {tuple(self.topk_ids.shape)} and "
                             f"{tuple(self.topk_logprobs.shape)}")


def store_meta(model, feature_layers, feature_size: int, dtype: torch.dtype, lookback: int) -> dict:
    """What a recording's rows were computed by and hold (``meta.json``)."""
    ident, revision = backbone_identity(model)
    return {"format": FORMAT, "backbone": ident, "backbone_revision": revision,
            "adapter": getattr(model.config, "tokenmaxx_adapter", None),
            "feature_layers": list(feature_layers) if feature_layers else None, "feature_size": int(feature_size),
            "dtype": str(dtype).removeprefix("torch."), "lookback": int(lookback)}


def read_meta(folder: str | Path) -> dict:
    """A recording's ``meta.json``, or one error saying what ``folder`` is not."""
    folder = Path(folder)
    path = folder / META
    if not path.is_file():
        what = "no such folder" if not folder.exists() else f"no {META} in it"
        raise FileNotFoundError(f"traffic folder {folder}: {what}; expected a folder written by "
                                "generate(..., record=FOLDER) or `tokenmaxx generate --record FOLDER`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"traffic folder {folder} has format {meta.get('format')!r}; this tokenmaxx reads {FORMAT}")
    return meta


def open_store(folder: str | Path, meta: dict) -> Path:
    """The folder, made and given ``meta`` when new; an existing recording must match it (one error naming each field
    that differs)."""
    folder = Path(folder)
    if (folder / META).is_file():
        found = read_meta(folder)
        differ = [f"{k}: recorded {found.get(k)!r}, now {meta[k]!r}" for k in IDENTITY if found.get(k) != meta[k]]
        if found.get("lookback", -1) < meta["lookback"]:
            differ.append(f"lookback: recorded {found.get('lookback')!r}, now {meta['lookback']!r}")
        if differ:
            raise ValueError(f"traffic folder {folder} was recorded by other heads or another backbone "
                             f"({'; '.join(differ)}): record into a new folder")
        return folder
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"traffic folder {folder} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / META, lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))
    return folder


def append(folder: str | Path, rows: list[TrafficRow]) -> Path | None:
    """Write ``rows`` as one new shard of ``folder`` (an opened store); returns its path (None: no rows)."""
    if not rows:
        return None
    lengths = torch.tensor([0] + [r.ids.shape[0] for r in rows])
    tensors = {"ids": torch.cat([r.ids.to("cpu", torch.long) for r in rows]), "offsets": lengths.cumsum(0),
               "prompt_lens": torch.tensor([r.prompt_len for r in rows]),
               "features": torch.cat([r.features.to("cpu") for r in rows]).contiguous(),
               "sampled": torch.tensor([int(r.sampled) for r in rows])}
    metadata = {"format": str(FORMAT)}
    widths = {None if r.topk_ids is None else r.topk_ids.shape[1] for r in rows}
    if len(widths) == 1 and None not in widths:  # every row has its top-k, all of one k
        tensors["topk_ids"] = torch.cat([r.topk_ids.to("cpu", torch.int32) for r in rows])
        tensors["topk_logprobs"] = torch.cat([r.topk_logprobs.to("cpu", torch.float32) for r in rows])
        metadata["topk"] = str(widths.pop())
    path = Path(folder) / f"{PREFIX}{time.time_ns():020d}-{os.getpid()}{SUFFIX}"
    write_atomic(path, lambda p: save_file(tensors, p, metadata=metadata))
    return path


def shards(folder: str | Path) -> list[Path]:
    """The recording's whole shards, oldest first."""
    return sorted(p for p in Path(folder).glob(f"{PREFIX}*{SUFFIX}") if not p.name.startswith("."))


class TrafficReader:
    """The rows of a recording (every whole shard, oldest first): ``ids(i)`` [T] and ``features(i, start)``
    [T - 1 - start, F], read from the memory-mapped shards on demand."""

    def __init__(self, folder: str | Path):
        self.folder, self.meta = Path(folder), read_meta(folder)
        self._handles: dict[Path, object] = {}
        self.index = []  # per row: (shard, ids begin, ids end, prompt_len, sampled, features begin, top-k begin)
        for path in shards(folder):
            with safe_open(path, framework="pt") as f:
                offsets, prompts = f.get_tensor("offsets"), f.get_tensor("prompt_lens")
                sampled, has_topk = f.get_tensor("sampled"), "topk" in (f.metadata() or {})
            # each row holds one feature fewer than its tokens: row i's features begin at its ids' begin - i; its
            # top-k (answer positions only) at its ids' begin less the prompt tokens of the rows before it
            before = torch.cat([torch.zeros(1, dtype=torch.long), prompts.cumsum(0)]).tolist()
            self.index += [(path, int(offsets[i]), int(offsets[i + 1]), p, bool(sampled[i]), int(offsets[i]) - i,
                            int(offsets[i]) - before[i] if has_topk else None)
                           for i, p in enumerate(prompts.tolist())]

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def prompt_len(self, i: int) -> int:
        return self.index[i][3]

    def row_len(self, i: int) -> int:
        """Tokens of row i (prompt and answer), from the index: nothing is read."""
        return self.index[i][2] - self.index[i][1]

    def sampled(self, i: int) -> bool:
        return self.index[i][4]

    def ids(self, i: int) -> torch.Tensor:
        path, begin, end = self.index[i][:3]
        return self._handle(path).get_slice("ids")[begin:end]

    def features(self, i: int, start: int = 0) -> torch.Tensor:
        """Row i's features from position ``start`` on: [T - 1 - start, F]."""
        path, begin, end, _, _, first, _ = self.index[i]
        return self._handle(path).get_slice("features")[first + start: first + end - begin - 1]

    def has_topk(self, i: int) -> bool:
        """Whether row i was recorded with the backbone's top-k (from the index: nothing is read)."""
        return self.index[i][6] is not None

    def topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row i's top-k at its answer positions (the prompt's last on): ids [T - prompt_len, k] int32 and
        log-probabilities [T - prompt_len, k]; None for rows recorded without them."""
        path, begin, end, prompt, _, _, first = self.index[i]
        if first is None:
            return None
        handle, answer = self._handle(path), end - begin - prompt
        return (handle.get_slice("topk_ids")[first: first + answer],
                handle.get_slice("topk_logprobs")[first: first + answer])
