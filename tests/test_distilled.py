"""The self-distilled data kept in git (distilled/): it loads as the trainer reads it, says where it came from, is
compact, and holds no benchmark prompt."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tokenmaxx.heads import BACKBONES
from tokenmaxx.training.batches import load_data
from tokenmaxx.training.data import load_exclusions, normalize
from tokenmaxx.training.data_folder import category_counts, count_answer_tokens, features

datasets = pytest.importorskip("datasets", reason="the datasets library (training data) is not installed here")

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "distilled"
PARTS = sorted(KEPT.glob("*/part-*"))
LIMIT = 30 * 1024 * 1024  # what the repository may hold of it (every clone downloads it)


def test_the_kept_data_is_small_enough():
    assert PARTS, f"no data parts under {KEPT}"
    size = sum(f.stat().st_size for f in KEPT.rglob("*") if f.is_file())
    assert size <= LIMIT, f"distilled/ holds {size / 2**20:.1f} MiB, over {LIMIT / 2**20:.0f} MiB"


def _assert_answered_by_the_recipe(record: dict) -> None:
    """A part's provenance (or an unfinished part's settings): greedy answers of smollm2-135m at its revision, in bf16
    or (the recipe's choice on CPUs without native bf16) fp32, never fp16."""
    spec = BACKBONES["smollm2-135m"]
    assert (record["backbone"], record["backbone_revision"]) == ("smollm2-135m", spec.sha256)
    assert record["sampling"] == {"greedy": True} and record["dtype"] in ("bfloat16", "float32")


@pytest.mark.parametrize("part", PARTS, ids=[p.name for p in PARTS])
def test_each_part_loads_with_its_provenance(part):
    provenance = json.loads((part / "provenance.json").read_text())
    _assert_answered_by_the_recipe(provenance)
    # benchmark prompts were excluded when it was made (checked against the files again below where they exist)
    assert provenance["exclude"] and all(f.endswith(".jsonl") for f in provenance["exclude"])
    dataset = datasets.load_from_disk(str(part))
    assert dataset.features["answer_ids"].feature.dtype == "uint16"  # the compact copy (2 bytes a token)
    assert provenance["num_records"] == len(dataset) and provenance["answer_tokens"] == count_answer_tokens(dataset)
    assert provenance["categories"] == category_counts(dataset)  # the mix's sources: chat, math, rag, ...
    assert set(provenance["categories"]) == {"chat", "math", "rag", "summarize", "translate"}
    data = load_data(part, seq_len=768, eval_fraction=0.05, eval_max_examples=64, seed=0)
    assert data.num_rows == len(dataset) and len(data.train) > 0.9 * len(dataset)


@pytest.mark.parametrize("part", PARTS, ids=[p.name for p in PARTS])
def test_no_benchmark_prompt_was_answered(part):
    bench = REPO.parent / "shared" / "bench"
    if not bench.is_dir():
        pytest.skip(f"{bench} is not on this machine")
    excluded = load_exclusions([str(bench)])
    prompts = datasets.load_from_disk(str(part))["prompt"]
    assert not [p for p in prompts if normalize(p) in excluded]


UNFINISHED = sorted(KEPT.glob("*/unfinished/part-*"))  # recipe_eagle3.py --stage stash: shards of unfinished parts


@pytest.mark.parametrize("part", UNFINISHED, ids=[p.name for p in UNFINISHED])
def test_each_unfinished_part_resumes_from_whole_shards_of_the_right_run(part):
    """Finished shards (datasets) and the answered batches of unfinished chunks (make_data's partial-NNNNN folders),
    nothing half-written; the batches are those make_data would read back (rows of the chunk in its batch order)."""
    settings = json.loads((part / "settings.json").read_text())
    _assert_answered_by_the_recipe(settings)
    entries = sorted((part / "shards").iterdir())
    shards = [s for s in entries if s.name.isdigit() and len(s.name) == 5]
    partials = [s for s in entries if s.name.startswith("partial-")]
    assert entries and sorted(shards + partials) == entries  # no half-written temp shard
    chunks = -(-settings["num_prompts"] // settings["chunk_size"])
    assert len(shards) < chunks  # else the part would be finished and kept as a part
    for partial in partials:
        chunk = int(partial.name.removeprefix("partial-"))
        assert chunk < chunks and partial.with_name(f"{chunk:05d}") not in shards
        batches = sorted(partial.iterdir())
        assert [b.name for b in batches] == [f"{i:05d}" for i in range(len(batches))]  # an unbroken run, no temp
        seen = set()
        for batch in batches:
            saved = json.loads((batch / "answers.json").read_text())
            assert 0 < len(saved["rows"]) == len(saved["answers"]) <= settings["batch_size"]
            assert all(0 <= r < settings["chunk_size"] for r in saved["rows"]) and not seen & set(saved["rows"])
            seen |= set(saved["rows"])
            assert all(answer and len(answer) <= settings["max_new_tokens"] for answer in saved["answers"])
            assert set(load_file(str(batch / "rng.safetensors"))) >= {"cpu"}
    bench = REPO.parent / "shared" / "bench"
    excluded = load_exclusions([str(bench)]) if bench.is_dir() else set()
    for shard in shards:
        rows = datasets.load_from_disk(str(shard))
        assert rows.features == features() and int(shard.name) < chunks
        last = int(shard.name) == chunks - 1
        assert len(rows) == (settings["num_prompts"] - (chunks - 1) * settings["chunk_size"] if last
                             else settings["chunk_size"])
        assert not [p for p in rows["prompt"] if normalize(p) in excluded]


def test_the_shipped_heads_name_the_kept_parts_they_were_trained_on():
    """What train_heads --init_heads reads to keep held-out rows new to the shipped heads: the prompts digests of their
    data's parts, which are the eight kept parts (a later run that adds parts holds out rows of the new ones only)."""
    from tokenmaxx.heads import HeadsConfig
    from tokenmaxx.training.batches import trained_parts

    config = HeadsConfig.from_dict(json.loads((REPO / "heads" / "pretrained" / "smollm2-135m" / "config.json")
                                              .read_text()))
    kept = [json.loads((KEPT / "smollm2-mix" / f"part-{i:03d}" / "provenance.json").read_text())["prompts_sha256"]
            for i in range(8)]
    assert sorted(trained_parts(config)) == sorted(kept) and len(set(kept)) == 8
