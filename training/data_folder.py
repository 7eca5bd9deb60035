"""make_data's output folder: settings check, shards and the final dataset, each written under a temp name and renamed
(a killed run leaves only complete files and temp names, which the next run removes). merge_data writes the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:  # datasets (and pyarrow) are imported where a dataset is read or written: the rest of tokenmaxx, and
    import datasets  # its fast test tier, runs where they are not installed (the GPU machine's image lacks them)

TOKEN_DTYPES = {"int64": 2**63, "int32": 2**31, "uint16": 2**16}  # token id storage -> the ids it holds (below)
COLUMNS = ("prompt", "prompt_ids", "answer_ids")  # a self-distilled dataset's columns (their types: ``features``)


def features(token_dtype: str = "int64") -> datasets.Features:
    """The columns of a self-distilled dataset; token ids as int64 (what make_data writes), int32 (half the disk) or
    uint16 (a quarter, for vocabularies under 65,536: the copies kept in git, ``merge_data --token_dtype uint16``)."""
    import datasets

    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    return datasets.Features({"prompt": datasets.Value("string"),
                              "prompt_ids": datasets.List(datasets.Value(token_dtype)),
                              "answer_ids": datasets.List(datasets.Value(token_dtype))})


CATEGORY = "category"  # optional column (make_data writes it): what the records are counted and evaluated under
TMP_PREFIX = ".tmp-"  # anything named so in the output folder is unfinished and removed on the next run
SETTINGS_NAME, PROVENANCE_NAME, SHARDS_DIR = "settings.json", "provenance.json", "shards"
PARTIAL_PREFIX = "partial-"  # shards/partial-NNNNN/BBBBB: the answered batches of chunk NNNNN while it is unfinished


SAVED_DATASET = "a dataset folder written by make-data or merge-data (datasets.save_to_disk)"


def load_saved_dataset(path: str | Path, flag: str = "--data", expected: str = SAVED_DATASET):
    """``datasets.load_from_disk(path)``, or one error naming ``path`` (given as ``flag``) and what was ``expected``,
    saying so when it is make-data's unfinished output folder (not the datasets library's own message)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: {'not a folder' if path.exists() else 'no such folder'}; expected "
                                f"{expected}")
    dataset = (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
    if not dataset and not (path / "dataset_dict.json").is_file():
        if (path / SETTINGS_NAME).is_file():
            raise ValueError(f"{flag} {path} is make-data's output folder, but its dataset is not finished (no "
                             "state.json): re-run the same make-data command to finish it")
        raise ValueError(f"{flag} {path} is not a saved dataset (no dataset_info.json and state.json, nor "
                         f"dataset_dict.json); expected {expected}")
    import datasets

    return datasets.load_from_disk(str(path))


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def remove(path: Path) -> None:
    """Delete a file, or a folder after renaming it to a temp name (so a kill midway leaves only a temp folder)."""
    if path.is_dir() and not path.name.startswith(TMP_PREFIX):
        doomed = path.with_name(TMP_PREFIX + "del-" + path.name)
        os.replace(path, doomed)
        path = doomed
    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def prepare_output(out: Path, settings: dict, overwrite: bool) -> None:
    """Create ``out`` with settings.json, or check that it was made with the same settings; drop unfinished files."""
    settings_file = out / SETTINGS_NAME
    ours = settings_file.is_file()
    if out.is_dir() and not ours and any(not p.name.startswith(TMP_PREFIX) for p in out.iterdir()):
        raise ValueError(f"{out} exists but was not made by make_data (no {SETTINGS_NAME}); choose a new output_dir")
    if ours and overwrite:
        for part in [p for p in out.iterdir() if p != settings_file] + [settings_file]:  # settings.json last
            remove(part)
    elif ours:
        old = json.loads(settings_file.read_text())
        changes = [f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now" for k in sorted(set(old) | set(settings))
                   if old.get(k) != settings.get(k)]
        if changes:
            raise ValueError(f"{out} holds data made with other settings ({'; '.join(changes)}); resuming would mix "
                             "them. Use a new output_dir, or --overwrite to delete it and start again")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(TMP_PREFIX + "*"), *(out / SHARDS_DIR).glob(TMP_PREFIX + "*"),
                  *(out / SHARDS_DIR).glob(PARTIAL_PREFIX + "*/" + TMP_PREFIX + "*")]:
        remove(stale)
    if not settings_file.is_file():
        write_json(settings_file, settings)


@contextlib.contextmanager
def quiet_datasets():  # datasets' per-save progress bars would bury ours
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars() if was_enabled else None


def count_answer_tokens(dataset: datasets.Dataset) -> int:  # without materialising the column
    import pyarrow.compute as pc

    return pc.sum(pc.list_value_length(dataset.data.column("answer_ids"))).as_py() or 0


def category_counts(dataset: datasets.Dataset) -> dict[str, dict[str, int]] | None:
    """category -> {"records", "answer_tokens"} (sorted by category); None when the data has no category column."""
    import pyarrow.compute as pc

    if CATEGORY not in dataset.column_names:
        return None
    lengths = pc.list_value_length(dataset.data.column("answer_ids")).to_pylist()
    counts: dict[str, dict[str, int]] = {}
    for category, n in zip(dataset.data.column(CATEGORY).to_pylist(), lengths):
        entry = counts.setdefault(category, {"records": 0, "answer_tokens": 0})
        entry["records"] += 1
        entry["answer_tokens"] += n or 0
    return dict(sorted(counts.items()))


def write_shard(path: Path, rows: dict[str, list]) -> None:
    """Save one chunk's records under a temp name, then rename: the shard exists whole or not at all."""
    import datasets

    tmp = path.with_name(TMP_PREFIX + path.name)
    with quiet_datasets():
        datasets.Dataset.from_dict(rows, features=features()).save_to_disk(str(tmp))
    os.replace(tmp, path)


def partial_dir(out: Path, chunk: int) -> Path:
    return out / SHARDS_DIR / f"{PARTIAL_PREFIX}{chunk:05d}"


def write_batch(path: Path, rows: list[int], answers: list[list[int]], device: torch.device) -> None:
    """One answered batch of an unfinished chunk (temp name, then rename): its rows (indices in the chunk), their
    answers (JSON) and the RNG state generation left (safetensors), so a resumed run samples what an uninterrupted
    run would have."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    if tmp.exists():
        remove(tmp)
    tmp.mkdir(parents=True)
    saved = {"rows": rows, "answers": answers, "device": device.type}
    (tmp / "answers.json").write_text(json.dumps(saved) + "\n")
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    save_file(rng, str(tmp / "rng.safetensors"))
    if path.exists():  # a batch after a missing one, answered again
        remove(path)
    os.replace(tmp, path)


def read_batch(path: Path, rows: list[int], device: torch.device, sampled: bool) -> list[list[int]]:
    """The answers of a batch saved by ``write_batch``, after restoring the RNG state it saved. ``sampled``: the
    answers were sampled, so the rest of the chunk must draw from the same device's generator to match an
    uninterrupted run."""
    saved = json.loads((path / "answers.json").read_text())
    if saved["rows"] != rows:
        raise ValueError(f"{path} holds the answers of rows {saved['rows']}, expected rows {rows}: the folder was "
                         "changed by hand; delete that partial-* folder to answer its chunk again")
    where = saved.get("device", "cpu")  # (batches saved before the field existed were all answered on a CPU)
    if sampled and where != device.type:
        raise ValueError(f"{path} was sampled on {where}, this run is on {device.type}: the rest of its chunk would "
                         f"draw from another random generator than an uninterrupted run. Resume on {where}, or delete "
                         f"{path.parent} to answer the chunk again")
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)
    return saved["answers"]


def assemble(out: Path, num_shards: int, provenance: dict, categories: list[str] | None = None) -> datasets.Dataset:
    """Concatenate the shards into the final dataset in ``out`` (state.json moved in last), then drop the shards.
    ``categories``: one per record, in order, added as the ``category`` column (not kept in the shards: a folder
    whose shards were written before the column existed resumes the same)."""
    import datasets

    shards = [datasets.load_from_disk(str(out / SHARDS_DIR / f"{i:05d}")) for i in range(num_shards)]
    dataset = datasets.concatenate_datasets(shards)
    if categories is not None:
        if len(categories) != len(dataset):
            raise ValueError(f"{len(categories)} categories for {len(dataset)} records in {out}")
        dataset = dataset.add_column(CATEGORY, categories)
    provenance = {**provenance, "num_records": len(dataset), "answer_tokens": count_answer_tokens(dataset),
                  **({"categories": category_counts(dataset)} if categories is not None else {})}
    dataset.info.description = json.dumps(provenance, sort_keys=True)
    tmp = out / (TMP_PREFIX + "final")
    with quiet_datasets():
        dataset.save_to_disk(str(tmp))
    for stale in out.glob("data-*.arrow"):  # from an assembly that was killed before its state.json
        stale.unlink()
    for part in sorted(tmp.iterdir(), key=lambda p: p.name == "state.json"):
        if part.name == "state.json":
            write_json(out / PROVENANCE_NAME, provenance)
        os.replace(part, out / part.name)
    remove(tmp)
    remove(out / SHARDS_DIR)
    return datasets.load_from_disk(str(out))
