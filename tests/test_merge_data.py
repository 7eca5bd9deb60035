"""merge_data: make_data outputs of one backbone -> one dataset the trainer reads, with a merged provenance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from tiny_tokenizer import tiny_tokenizer
from tokenmaxx.training.batches import load_data
from tokenmaxx.training.data import DataConfig, make_data
from tokenmaxx.training.merge_data import merge_data

datasets = pytest.importorskip("datasets", reason="the datasets library (training data) is not installed here")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Two make_data outputs of the same tiny backbone: short prompts, then long ones (as in the recipe)."""
    root = tmp_path_factory.mktemp("merge")
    model, tokenizer = tiny_model(), tiny_tokenizer()
    out = []
    for name, lengths, bounds in [("short", (3, 5, 7), dict(max_prompt_tokens=12)),
                                  ("long", (3, 14, 20), dict(min_prompt_tokens=13))]:
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"prompt": "b" * n}) + "\n" for n in lengths))
        make_data(DataConfig(output_dir=str(root / name), data=[str(source)], exclude=[], dtype="float32",
                             max_new_tokens=6, batch_size=2, chunk_size=4, **bounds), model, tokenizer)
        out.append(root / name)
    return out


def test_merge_keeps_rows_in_order_and_merges_provenance(parts, tmp_path):
    short, long = (datasets.load_from_disk(str(p)) for p in parts)
    merged = merge_data(parts, tmp_path / "mix")
    assert list(merged["prompt"]) == list(short["prompt"]) + list(long["prompt"]) == \
        ["bbb", "bbbbb", "bbbbbbb", "b" * 14, "b" * 20]
    assert list(merged["answer_ids"]) == list(short["answer_ids"]) + list(long["answer_ids"])
    prov = json.loads((tmp_path / "mix" / "provenance.json").read_text())
    assert prov == json.loads(merged.info.description)
    own = [json.loads((p / "provenance.json").read_text()) for p in parts]
    assert prov["num_records"] == 5 and prov["answer_tokens"] == sum(o["answer_tokens"] for o in own)
    assert prov["sources"] == [own[0]["sources"][0], own[1]["sources"][0]]
    assert prov["backbone_revision"] == own[0]["backbone_revision"] and prov["sampling"] == {"greedy": True}
    assert "min_prompt_tokens" not in prov  # the parts differ there: kept only in their own records
    assert [p["min_prompt_tokens"] for p in prov["parts"]] == [0, 13]
    assert [p["path"] for p in prov["parts"]] == [str(p) for p in parts]
    assert merged["category"] == ["short"] * 3 + ["long"] * 2  # each part's file name (make_data's category)
    assert prov["categories"] == {name: {"records": o["num_records"], "answer_tokens": o["answer_tokens"]}
                                  for name, o in zip(("short", "long"), own)}
    data = load_data(tmp_path / "mix", seq_len=64, eval_fraction=0.2, eval_max_examples=8, seed=0)
    assert data.num_rows == 5 and data.provenance == prov  # what the trainer records with the heads
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_part_without_categories_drops_the_column_with_a_warning(parts, tmp_path, caplog):
    old = tmp_path / "old"
    datasets.load_from_disk(str(parts[1])).remove_columns("category").save_to_disk(str(old))
    prov = json.loads((parts[1] / "provenance.json").read_text())
    (old / "provenance.json").write_text(json.dumps({k: v for k, v in prov.items() if k != "categories"}))
    merged = merge_data([parts[0], old], tmp_path / "mix")
    assert merged.column_names == ["prompt", "prompt_ids", "answer_ids"] and len(merged) == 5
    assert "categories" not in json.loads((tmp_path / "mix" / "provenance.json").read_text())
    assert f"parts ['{old}'] have no category column" in caplog.text


def test_merge_refuses_bad_parts_and_outputs(parts, tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        merge_data([], tmp_path / "none")
    with pytest.raises(ValueError, match="token_dtype must be one of int64, int32, uint16"):
        merge_data(parts, tmp_path / "x", token_dtype="int8")
    with pytest.raises(FileNotFoundError, match="do not exist"):
        merge_data([parts[0], tmp_path / "nowhere"], tmp_path / "x")
    with pytest.raises(ValueError, match="is one of the parts"):
        merge_data(parts, parts[0])
    (tmp_path / "plain").mkdir()
    datasets.Dataset.from_dict({"prompt_ids": [[1]], "answer_ids": [[2]]}).save_to_disk(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="no provenance.json"):
        merge_data([parts[0], tmp_path / "plain"], tmp_path / "x")
    other = tmp_path / "other"
    datasets.load_from_disk(str(parts[1])).save_to_disk(str(other))
    prov = json.loads((parts[1] / "provenance.json").read_text())
    (other / "provenance.json").write_text(json.dumps({**prov, "backbone_revision": "another"}))
    with pytest.raises(ValueError, match="disagree on backbone_revision"):
        merge_data([parts[0], other], tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".tmp-*"))  # nothing half-written
    merge_data(parts, tmp_path / "mix")
    with pytest.raises(FileExistsError, match="exists"):
        merge_data(parts, tmp_path / "mix")
    assert len(merge_data(parts[::-1], tmp_path / "mix", overwrite=True)) == 5


def test_a_compact_copy_of_one_part_trains_the_same(parts, tmp_path):
    """int32 / uint16 token ids: the same rows, the same data fingerprint (what checkpoints are tied to), fewer
    bytes."""
    copy = merge_data(parts[1:], tmp_path / "compact", token_dtype="int32")
    assert copy.features["answer_ids"].feature.dtype == "int32"
    original = datasets.load_from_disk(str(parts[1]))
    assert list(copy["answer_ids"]) == list(original["answer_ids"])
    a = load_data(parts[1], seq_len=64, eval_fraction=0.2, eval_max_examples=8, seed=0)
    b = load_data(tmp_path / "compact", seq_len=64, eval_fraction=0.2, eval_max_examples=8, seed=0)
    assert a.fingerprint == b.fingerprint and all(torch.equal(a.examples[r].ids, b.examples[r].ids) for r in a.examples)
    merged = merge_data([tmp_path / "compact", parts[0]], tmp_path / "back")  # int32 parts merge back to int64
    assert merged.features["prompt_ids"].feature.dtype == "int64" and len(merged) == 5
    smallest = merge_data([tmp_path / "compact"], tmp_path / "uint16", token_dtype="uint16")  # a copy of a copy
    assert smallest.features["answer_ids"].feature.dtype == "uint16"
    c = load_data(tmp_path / "uint16", seq_len=64, eval_fraction=0.2, eval_max_examples=8, seed=0)
    assert c.fingerprint == a.fingerprint and all(torch.equal(a.examples[r].ids, c.examples[r].ids) for r in a.examples)
    assert sum(f.stat().st_size for f in (tmp_path / "uint16").glob("*.arrow")) \
        < sum(f.stat().st_size for f in (tmp_path / "compact").glob("*.arrow"))


def test_a_storage_type_too_small_for_the_ids_is_refused(parts, tmp_path):
    """uint16 holds ids 0..65,535: a vocabulary beyond it is one error naming the id, and nothing is written."""
    rows = datasets.load_from_disk(str(parts[0])).to_list()
    rows[0]["answer_ids"] = rows[0]["answer_ids"][:-1] + [70_000]
    big = tmp_path / "big"
    datasets.Dataset.from_list(rows, features=datasets.load_from_disk(str(parts[0])).features).save_to_disk(str(big))
    (big / "provenance.json").write_text((parts[0] / "provenance.json").read_text())
    with pytest.raises(ValueError, match=r"answer_ids holds token id 70000, which --token_dtype uint16 cannot store "
                                         r"\(ids 0..65535\); use int32"):
        merge_data([big], tmp_path / "out", token_dtype="uint16")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))
    assert len(merge_data([big], tmp_path / "out", token_dtype="int32")) == len(rows)


def test_merge_script(parts, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import merge_data as script
    finally:
        sys.path.remove(str(REPO / "scripts"))
    script.main([*map(str, parts), "--output_dir", str(tmp_path / "mix")])
    assert "5 records from 2 datasets" in capsys.readouterr().out


@pytest.mark.slow
def test_merge_script_bad_input_is_one_error_line(parts, tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "merge_data.py"), str(parts[0]), str(tmp_path / "nowhere"),
               "--output_dir", str(tmp_path / "mix")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: ") and "do not exist" in out.stderr, out.stderr
