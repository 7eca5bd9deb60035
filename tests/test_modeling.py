"""Heads config validation, strict save/load, corrupt files, backbone mismatch, the head-kind registry."""

import json

import pytest
import torch
from helpers import random_heads, tiny_model

from tokenmaxx.heads import BackboneMismatchError, DraftHeads, HeadsConfig, MedusaHeads, load_heads, register_head_kind
from tokenmaxx.inference import SpeculativeGenerator
import warnings
from pathlib import Path


from tokenmaxx.heads import modeling

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "heads" / "pretrained"


@pytest.mark.parametrize("share", [True, False])
def test_save_load_round_trip(tmp_path, share):
    model = tiny_model("llama")
    heads = random_heads(model, share_lm_head=share, num_layers=2, tree=[[0], [1], [0, 0]])
    heads.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert all(p.stat().st_mode & 0o044 for p in tmp_path.iterdir())  # readable by others (not mkstemp's 0600)
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, MedusaHeads) and loaded.config == heads.config
    for (k, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    hidden = torch.randn(32)
    torch.testing.assert_close(loaded.draft_logits(hidden, model.lm_head), heads.draft_logits(hidden, model.lm_head))
    assert ("lm_heads.0.weight" in loaded.state_dict()) == (not share)


def test_untrained_heads_start_as_the_backbone_projection():
    model = tiny_model("qwen2")
    hidden = torch.randn(32)
    for share in (True, False):
        heads = MedusaHeads.for_backbone(model, share_lm_head=share)
        logits = heads.draft_logits(hidden, model.lm_head)  # [K, V]
        assert logits.shape == (4, 96)
        for k in range(4):  # zero-initialised residual blocks: identity
            torch.testing.assert_close(logits[k], model.lm_head(hidden))
    blocks = [id(b) for b in heads.blocks]
    assert len(set(blocks)) == 4  # distinct modules per head


@pytest.mark.parametrize("bad, msg", [
    (dict(num_heads=0), "num_heads must be a positive integer"),
    (dict(hidden_size=-3), "hidden_size must be a positive integer"),
    (dict(num_layers=-1), "num_layers must be an integer >= 0"),
    (dict(kind="hydra"), r"unknown head kind 'hydra': known kinds are \['eagle3', 'medusa'"),
    (dict(tree=[[0], [0, 0], [0, 0, 0]], num_heads=2), "tree depth 3 exceeds num_heads 2"),
    (dict(tree=[[1, 0]]), "no parent path"),
])
def test_config_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        HeadsConfig(**{"hidden_size": 8, "vocab_size": 10, **bad})


def test_missing_corrupt_and_truncated_files(tmp_path):
    model = tiny_model("llama")
    heads = random_heads(model)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_heads(tmp_path)
    heads.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_heads(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors are missing"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_heads(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"kind": "medusa", "hidden_size": 8, "vocab_size": 9, "x": 1}))
    with pytest.raises(ValueError, match=r"unknown HeadsConfig fields \['x'\]"):
        load_heads(tmp_path)


def test_weights_of_another_shape_are_refused(tmp_path):
    model = tiny_model("llama")
    random_heads(model, num_layers=1).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_heads(tmp_path)
    cfg["num_layers"], cfg["hidden_size"] = 1, 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"has shape \(32,\), the config expects \(16,\)"):
        load_heads(tmp_path)


def test_heads_for_another_backbone_are_refused():
    small, wide = tiny_model("llama"), tiny_model("llama", hidden_size=48)
    heads = random_heads(small)
    with pytest.raises(BackboneMismatchError, match="hidden size 32 and vocabulary 96.*hidden size 48 and vocabulary 96"):
        SpeculativeGenerator(wide, heads, draft="heads")
    other = tiny_model("llama", vocab_size=100)
    with pytest.raises(BackboneMismatchError, match="vocabulary 100"):
        SpeculativeGenerator(other, heads, draft="heads")
    # same shapes, but recorded for another backbone id
    heads.config.backbone, heads.config.backbone_revision = "smollm2-135m", "abc"
    small.config.tokenmaxx_backbone = "qwen2.5-coder-0.5b"
    with pytest.raises(BackboneMismatchError, match="made for backbone 'smollm2-135m'"):
        SpeculativeGenerator(small, heads, draft="heads")
    SpeculativeGenerator(small, heads, strict_identity=False, draft="heads")  # explicit override


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_head_kind("medusa")(type("Again", (DraftHeads,), {}))
def _identity_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, modeling.BackboneIdentityWarning)]


def test_heads_naming_a_backbone_warn_once_on_a_model_without_identity():
    model = tiny_model("llama")  # built from a config: no name_or_path, no tokenmaxx_backbone
    heads = random_heads(model)
    heads.config.backbone, heads.config.backbone_revision = "smollm2-135m", "b179c95"
    with pytest.warns(modeling.BackboneIdentityWarning,
                      match=r"made for backbone 'smollm2-135m' \(revision b179c95\).*could not be checked"):
        SpeculativeGenerator(model, heads, draft="heads")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeculativeGenerator(model, heads, draft="heads")  # the same model again: warned already
        heads.check_backbone(tiny_model("llama"), strict_identity=False)  # identity checks skipped knowingly
        random_heads(model).check_backbone(model)  # heads that name no backbone: nothing to check
        named = tiny_model("llama")
        named.config.tokenmaxx_backbone = "smollm2-135m"
        heads.check_backbone(named)  # a model with a name: checked, no warning
    assert _identity_warnings(caught) == []
    with pytest.warns(modeling.BackboneIdentityWarning):
        heads.check_backbone(tiny_model("llama"))  # another unnamed model object: warned again



