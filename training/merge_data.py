"""Several self-distilled datasets -> one, for training on a mix (e.g. short chat prompts + long-document prompts).

The parts must be answers of the same backbone at the same revision (the heads learn what that backbone says). Rows are
concatenated in the order given (``datasets.concatenate_datasets``). The merged ``provenance.json`` keeps every part's
own record under ``parts`` and, at the top, what the trainer and the model card read: the settings all parts share,
the sources (in order, without repeats), the summed counts and the counts per category (when every part has make_data's
``category`` column, which the merge then keeps). The output is written under a temp name and renamed:
it exists whole or not at all.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .batches import read_provenance
from .data_folder import (CATEGORY, COLUMNS, PROVENANCE_NAME, TMP_PREFIX, TOKEN_DTYPES, category_counts,
                          count_answer_tokens, features, load_saved_dataset, quiet_datasets, remove, write_json)

if TYPE_CHECKING:  # imported where a dataset is read (data_folder.py says why)
    import datasets

log = logging.getLogger(__name__)

MUST_AGREE = ("backbone", "backbone_revision", "eos_token_id")  # answers of another backbone are another target
COUNTED = ("num_records", "answer_tokens")  # counted on the merged rows


def _read_part(path: Path) -> tuple[datasets.Dataset, dict]:
    import datasets

    dataset = load_saved_dataset(path, "part")
    if not (path / PROVENANCE_NAME).is_file():
        raise FileNotFoundError(f"{path} has no {PROVENANCE_NAME}: expected a folder written by make_data "
                                "(scripts/make_data.py)")
    provenance = read_provenance(path)
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{path} holds splits {list(dataset)}; merge_data takes make_data outputs (one Dataset each)")
    if missing := sorted(set(COLUMNS) - set(dataset.column_names)):
        raise ValueError(f"{path} lacks columns {missing}; it has {dataset.column_names}")
    return dataset, provenance


def _conform(dataset: datasets.Dataset, wanted: datasets.Features) -> datasets.Dataset:
    dataset = dataset.select_columns(list(wanted))
    if dataset.features != wanted:
        with quiet_datasets():
            dataset = dataset.cast(wanted, keep_in_memory=True)  # no cache-*.arrow written into the part's folder
    return dataset


def _check_ids_fit(paths: Sequence[Path], datasets_: Sequence[datasets.Dataset], token_dtype: str) -> None:
    """Refuse a storage type too small for the token ids (a cast would fail midway, or wrap)."""
    import pyarrow.compute as pc

    limit = TOKEN_DTYPES[token_dtype]
    for path, dataset in zip(paths, datasets_):
        for column in ("prompt_ids", "answer_ids"):
            ids = pc.list_flatten(dataset.data.column(column))
            top, low = pc.max(ids).as_py(), pc.min(ids).as_py()
            if top is not None and (top >= limit or (token_dtype == "uint16" and low < 0)):
                wider = {"uint16": "int32", "int32": "int64"}[token_dtype]
                raise ValueError(f"{path}: {column} holds token id {top if top >= limit else low}, which "
                                 f"--token_dtype {token_dtype} cannot store (ids 0..{limit - 1}); use {wider}")


def merged_provenance(parts: Sequence[tuple[str, dict]], dataset: datasets.Dataset) -> dict:
    """The top-level record of a merge: shared settings, ordered sources, counts, and each part's own record."""
    records = [p for _, p in parts]
    for key in MUST_AGREE:
        if any(r.get(key) != records[0].get(key) for r in records[1:]):
            found = ", ".join(f"{path}: {r.get(key)!r}" for path, r in parts)
            raise ValueError(f"the parts disagree on {key} ({found}); merge only data answered by one backbone")
    shared = {k: v for k, v in records[0].items() if k not in COUNTED and all(r.get(k) == v for r in records[1:])}
    shared.pop("categories", None)  # counted on the merged rows, when they have the column
    categories = category_counts(dataset)
    return {**shared, "sources": list(dict.fromkeys(s for r in records for s in r.get("sources") or [])),
            "records_read": sum(int(r.get("records_read") or 0) for r in records),
            "num_records": len(dataset), "answer_tokens": count_answer_tokens(dataset),
            **({"categories": categories} if categories is not None else {}),
            "parts": [{"path": path, **r} for path, r in parts]}


def merge_data(parts: Sequence[str | Path], output_dir: str | Path, overwrite: bool = False,
               token_dtype: str = "int64") -> datasets.Dataset:
    """Concatenate make_data outputs ``parts`` into ``output_dir`` (refused if it exists, unless ``overwrite``).

    One part is a copy (with ``token_dtype="uint16"`` or ``"int32"``: a compact copy, e.g. to keep finished parts in
    git; ids a type cannot store are refused)."""
    import datasets

    wanted = features(token_dtype)
    if not parts:
        raise ValueError("merge_data needs at least one dataset")
    out = Path(output_dir)
    paths = [Path(p) for p in parts]
    if missing := [str(p) for p in paths if not p.is_dir()]:
        raise FileNotFoundError(f"datasets {missing} do not exist (expected folders written by make_data)")
    if any(out.resolve() == p.resolve() for p in paths):
        raise ValueError(f"the output {out} is one of the parts; choose a new folder")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new folder or pass --overwrite")
    loaded = [_read_part(p) for p in paths]
    without = [str(p) for p, (d, _) in zip(paths, loaded) if CATEGORY not in d.column_names]
    if len(without) < len(paths):  # the category column is kept when every part has it
        if without:
            log.warning("parts %s have no %s column (made before make_data wrote it): the merge has none", without,
                        CATEGORY)
        else:
            wanted = datasets.Features({**wanted, CATEGORY: datasets.Value("string")})
    _check_ids_fit(paths, [d for d, _ in loaded], token_dtype)
    loaded = [(_conform(d, wanted), prov) for d, prov in loaded]
    dataset = datasets.concatenate_datasets([d for d, _ in loaded])
    provenance = merged_provenance([(str(p), prov) for p, (_, prov) in zip(paths, loaded)], dataset)
    dataset.info.description = json.dumps(provenance, sort_keys=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(TMP_PREFIX + out.name)
    if tmp.exists():
        remove(tmp)  # left by a killed merge
    with quiet_datasets():
        dataset.save_to_disk(str(tmp))
    write_json(tmp / PROVENANCE_NAME, provenance)
    if out.exists():
        remove(out)
    tmp.rename(out)
    return datasets.load_from_disk(str(out))
