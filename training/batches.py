"""Self-distilled data -> examples -> deterministic per-rank micro-batches.

The dataset (``datasets.save_to_disk``) has columns ``prompt_ids`` and ``answer_ids`` (the backbone's own answer) and a
``provenance.json`` inside or beside its folder. An example is ``prompt_ids + answer_ids`` cut to ``seq_len``.

Only a *window* of each sequence is fed to the heads: head k at t trains when t+k+1 lies in the answer, so positions
before ``prompt_len - 1 - K`` never matter (``window_start``); the KL teacher positions t+k >= prompt_len - 1 lie inside
the window too. The data order is a pure function of (seed, epoch, step): a resumed run sees exactly the batches an
uninterrupted run would, with no iterator state to save.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator

import numpy as np
import torch

from .data_folder import PROVENANCE_NAME, load_saved_dataset

log = logging.getLogger(__name__)
EVAL_SPLITS = ("validation", "test")
# Batches are padded to a multiple of this many positions. Every new matrix shape costs the CPU's GEMM library a
# kernel build, and a batch meets dozens of shapes (docs/benchmarks.md); with widths in steps of 32 the few shapes
# recur and come from its cache, for about 16 padded positions per row (half a step, on average).
WIDTH_MULTIPLE = 32


@dataclass(frozen=True)
class Example:
    row: int  # row of the dataset (train rows first, then held-out rows of a DatasetDict): the feature cache's key
    ids: torch.Tensor  # [T] prompt + answer tokens, cut to seq_len
    prompt_len: int
    category: str | None = None  # the dataset's category column (make_data), when it has one


@dataclass
class SelfDistilledData:
    examples: dict[int, Example]  # usable examples by row
    train: list[int]  # rows
    eval: list[int]  # rows
    provenance: dict
    fingerprint: str  # sha256 of the token columns: the identity of the data a run or a feature cache was made from
    num_rows: int
    dropped: int  # rows whose prompt leaves no answer token inside seq_len

    def eval_by_category(self) -> dict[str, list[int]]:
        """category -> its held-out rows (sorted by category); empty when the data has no category column."""
        return self.by_category(self.eval)

    def by_category(self, rows: list[int]) -> dict[str, list[int]]:
        """category -> those of ``rows`` in it (sorted by category); empty when the data has no category column."""
        out: dict[str, list[int]] = {}
        for r in rows:
            if (category := self.examples[r].category) is not None:
                out.setdefault(category, []).append(r)
        return dict(sorted(out.items()))

    def window_lengths(self, num_heads: int) -> dict[int, int]:
        """row -> length of the window the heads are fed (``window_start``)."""
        return {r: len(e.ids) - window_start(e.prompt_len, num_heads) for r, e in self.examples.items()}


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, W] window tokens, right-padded with 0
    answer_start: torch.Tensor  # [B] first answer position inside the window
    lengths: torch.Tensor  # [B] window lengths
    rows: list[int]  # dataset rows
    starts: list[int]  # window start of each row inside its full sequence

    @property
    def positions(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device) -> "Batch":
        """The same batch with its tensors on ``device`` (the backbone's); built on the CPU by ``collate``."""
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.answer_start), move(self.lengths), self.rows, self.starts)


def window_start(prompt_len: int, num_heads: int) -> int:
    """First position any head or KL teacher reads: head K at t targets t+K+1 >= prompt_len."""
    return max(0, prompt_len - 1 - num_heads)


def read_provenance(data_dir: Path) -> dict:
    for path in (data_dir / PROVENANCE_NAME, data_dir.parent / PROVENANCE_NAME):
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"data provenance {path} is not valid JSON ({err})") from None
    log.warning("no %s in or beside %s: the exported heads will not record where their data came from",
                PROVENANCE_NAME, data_dir)
    return {}


def provenance_parts(provenance: dict) -> list[dict]:
    """The make_data records a dataset's provenance is made of, in row order (a merge lists its parts under ``parts``,
    each maybe a merge itself; make_data's own record has none)."""
    if isinstance(provenance.get("parts"), list) and provenance["parts"]:
        return [leaf for part in provenance["parts"] for leaf in provenance_parts(part)]
    return [provenance] if provenance else []


def part_digests(provenance: dict) -> list[str]:
    """The prompts digests (make_data's ``prompts_sha256``) of the parts a dataset was answered from: what identifies a
    part across copies and merges."""
    return [leaf["prompts_sha256"] for leaf in provenance_parts(provenance) if leaf.get("prompts_sha256")]


def trained_parts(heads_config) -> list[str]:
    """The prompts digests of every part trained heads have seen: what their run recorded (``seen_parts``: its data's
    parts and those of the heads it started from), else the parts of their data's provenance; empty when they record
    no data."""
    extra = heads_config.extra if isinstance(heads_config.extra, dict) else {}
    if isinstance(extra.get("seen_parts"), list):
        return list(extra["seen_parts"])
    data = extra.get("data") if isinstance(extra.get("data"), dict) else {}
    return part_digests(data.get("provenance") or {})


def _unseen_rows(path: Path, provenance: dict, rows: list[int], num_rows: int, contents: dict[int, bytes],
                 seen_parts: frozenset[str]) -> list[int]:
    """Those of ``rows`` from parts outside ``seen_parts`` whose tokens are not also a row of a seen part."""
    leaves = provenance_parts(provenance)
    counts = [leaf.get("num_records") for leaf in leaves]
    if not leaves or any(not isinstance(c, int) for c in counts) or sum(counts) != num_rows:
        raise ValueError(f"the held-out rows must come from parts of {path} that the initial heads did not train on, "
                         f"but its provenance does not say which rows came from which part ({len(leaves)} parts "
                         f"recording {sum(c for c in counts if isinstance(c, int))} rows; the data has {num_rows}). "
                         "Give data made by make_data / merge_data, or data with a validation split of unseen rows")
    seen_rows, unseen, start = set(), set(), 0
    for leaf, count in zip(leaves, counts):
        (seen_rows if leaf.get("prompts_sha256") in seen_parts else unseen).update(range(start, start + count))
        start += count
    seen_contents = {contents[r] for r in seen_rows}
    return [r for r in rows if r in unseen and contents[r] not in seen_contents]


def _rows(dataset) -> Iterator[tuple[list[int], list[int], str | None]]:
    missing = {"prompt_ids", "answer_ids"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"self-distilled data lacks columns {sorted(missing)}; it has {dataset.column_names} "
                         "(expected prompt, prompt_ids, answer_ids)")
    has_category = "category" in dataset.column_names
    columns = ["prompt_ids", "answer_ids"] + (["category"] if has_category else [])
    for chunk in dataset.select_columns(columns).iter(batch_size=1024):
        categories = chunk["category"] if has_category else [None] * len(chunk["prompt_ids"])
        yield from zip(chunk["prompt_ids"], chunk["answer_ids"], categories)


def load_data(path: str | Path, seq_len: int, eval_fraction: float, eval_max_examples: int,
              seed: int, seen_parts: Collection[str] = ()) -> SelfDistilledData:
    """Read the dataset, cut sequences to ``seq_len``, split train / held-out (seeded unless the data has a split).

    seen_parts: prompts digests (``part_digests``) of parts that the heads a run starts from were trained on: their
    rows, and rows with the same tokens, are never held out (they train; the held-out rows come from the other parts).
    Data that shares no part with them splits exactly as without. A split given by the data is used as it is.
    """
    from datasets import Dataset, DatasetDict

    path = Path(path)
    loaded = load_saved_dataset(path)
    if isinstance(loaded, DatasetDict):
        held = next((s for s in EVAL_SPLITS if s in loaded), None)
        if "train" not in loaded:
            raise ValueError(f"dataset {path} has splits {list(loaded)}; expected a 'train' split")
        parts: list[tuple[Dataset, bool]] = [(loaded["train"], False)] + ([(loaded[held], True)] if held else [])
    else:
        parts = [(loaded, False)]
    seen_parts = frozenset(seen_parts)
    examples, is_eval, contents, digest, row, dropped = {}, {}, {}, hashlib.sha256(), 0, 0
    for dataset, held_out in parts:
        for prompt_ids, answer_ids, category in _rows(dataset):
            tokens = np.asarray(list(prompt_ids) + list(answer_ids), dtype=np.int64)
            content = np.asarray([len(prompt_ids), len(answer_ids)], dtype=np.int64).tobytes() + tokens.tobytes()
            digest.update(content)
            if seen_parts:
                contents[row] = hashlib.sha256(content).digest()
            if len(prompt_ids) < seq_len and len(answer_ids) > 0:
                examples[row] = Example(row, torch.from_numpy(tokens[:seq_len]), len(prompt_ids), category)
                is_eval[row] = held_out
            else:
                dropped += 1
            row += 1
    if not examples:
        raise ValueError(f"no usable example in {path}: every prompt is at least seq_len={seq_len} tokens long "
                         "or has an empty answer")
    if dropped:
        log.warning("dropped %d of %d rows whose prompt leaves no answer token inside seq_len=%d",
                    dropped, row, seq_len)
    rows = sorted(examples)
    provenance = read_provenance(path)
    if any(is_eval.values()):
        train = [r for r in rows if not is_eval[r]]
        held = [r for r in rows if is_eval[r]][:eval_max_examples]
    else:
        eligible = rows
        if seen_parts and seen_parts & set(part_digests(provenance)):
            eligible = _unseen_rows(path, provenance, rows, row, contents, seen_parts)
            if len(eligible) < 2:
                raise ValueError(f"{len(eligible)} row(s) of {path} come from parts the initial heads were not "
                                 "trained on: too few to hold some out and train on the rest. Add parts they have not "
                                 "seen (or give data with a validation split)")
        # held out: eval_fraction of the eligible rows (all rows, or those new to the initial heads), capped
        n_eval = min(max(1, round(eval_fraction * len(eligible))), eval_max_examples, len(eligible) - 1)
        order = torch.randperm(len(eligible), generator=torch.Generator().manual_seed(seed)).tolist()
        held = sorted(eligible[i] for i in order[:n_eval])
        taken = set(held)
        train = [r for r in rows if r not in taken]
    if not train:
        raise ValueError(f"dataset {path} leaves no training examples after the held-out split")
    return SelfDistilledData(examples=examples, train=train, eval=held, provenance=provenance,
                             fingerprint=digest.hexdigest(), num_rows=row, dropped=dropped)


# ---- order ------------------------------------------------------------------------------------------------------
def epoch_micro_batches(rows: list[int], epoch: int, seed: int, rank: int, world: int,
                        micro_batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of one epoch: a seeded permutation shared by all ranks, dealt round-robin."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(rows), generator=gen).tolist()
    per_rank = len(perm) // world
    mine = [rows[i] for i in perm[: per_rank * world][rank::world]]
    return [mine[i: i + micro_batch_size] for i in range(0, per_rank - micro_batch_size + 1, micro_batch_size)]


def group_by_length(micro_batches: list[list[int]], lengths: dict[int, int]) -> list[list[int]]:
    """The same rows and micro-batch sizes, regrouped so that each micro-batch holds rows of similar window length
    (``lengths``: row -> window length): a batch is padded to its longest row, so mixed lengths waste compute, and
    grouping a step's rows cuts that padding by more than half on the self-distilled mix (docs/benchmarks.md).
    Shortest first; ties keep their order, so the result is a pure function of the input."""
    ordered = sorted((r for batch in micro_batches for r in batch), key=lambda r: lengths[r])
    grouped, at = [], 0
    for batch in micro_batches:
        grouped.append(ordered[at: at + len(batch)])
        at += len(batch)
    return grouped


def step_micro_batches(rows: list[int], step: int, steps_per_epoch: int, grad_accum: int, seed: int, rank: int,
                       world: int, micro_batch_size: int,
                       lengths: dict[int, int] | None = None) -> Iterator[list[list[int]]]:
    """From optimizer step ``step`` on, forever: each item is the ``grad_accum`` micro-batches of one step, their
    rows regrouped by window length when ``lengths`` is given (``group_by_length``; a step's rows stay its own)."""
    while True:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        batches = epoch_micro_batches(rows, epoch, seed, rank, world, micro_batch_size)
        for s in range(in_epoch, steps_per_epoch):
            micro = batches[s * grad_accum: (s + 1) * grad_accum]
            yield group_by_length(micro, lengths) if lengths is not None else micro
        step = (epoch + 1) * steps_per_epoch


def eval_micro_batches(rows: list[int], rank: int, world: int, micro_batch_size: int) -> list[list[int]]:
    """Held-out rows of this rank in a fixed order (every row is evaluated by exactly one rank)."""
    mine = rows[rank::world]
    return [mine[i: i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def padded_width(longest: int, multiple: int | None = None) -> int:
    """A batch's width: its longest window rounded up to ``multiple`` (default ``WIDTH_MULTIPLE``)."""
    multiple = multiple or WIDTH_MULTIPLE
    return -(-longest // multiple) * multiple


def collate(data: SelfDistilledData, rows: list[int], num_heads: int) -> Batch:
    """Windows of the given rows, right-padded into one batch (``padded_width`` wide)."""
    examples = [data.examples[r] for r in rows]
    starts = [window_start(e.prompt_len, num_heads) for e in examples]
    lengths = [len(e.ids) - s for e, s in zip(examples, starts)]
    input_ids = torch.zeros(len(rows), padded_width(max(lengths)), dtype=torch.long)  # [B, W]
    for i, (e, s, n) in enumerate(zip(examples, starts, lengths)):
        input_ids[i, :n] = e.ids[s:]
    return Batch(input_ids=input_ids, answer_start=torch.tensor([e.prompt_len - s for e, s in zip(examples, starts)]),
                 lengths=torch.tensor(lengths), rows=list(rows), starts=starts)
