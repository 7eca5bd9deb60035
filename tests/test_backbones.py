"""The backbone loader (``heads/io/backbones.py``): unknown aliases, dtypes and folders are one clear error; a PEFT
LoRA adapter merged into the backbone is recorded by the heads, and heads refuse a backbone without it."""

import pytest
import torch
from helpers import greedy_reference, tiny_model
from peft import LoraConfig, get_peft_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import BackboneMismatchError, MedusaHeads, load_backbone, load_heads
from tokenmaxx.inference import SpeculativeGenerator


@pytest.fixture
def base_and_adapter(tmp_path):
    base = tmp_path / "base"
    tiny_model("llama", seed=31).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    torch.manual_seed(0)
    lora = get_peft_model(tiny_model("llama", seed=31),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    return str(base), str(tmp_path / "adapter")


def test_adapter_is_merged_recorded_and_checked(base_and_adapter, tmp_path):
    base, adapter = base_and_adapter
    merged, _ = load_backbone(base, adapter=adapter)
    plain, _ = load_backbone(base)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(merged(ids).logits, plain(ids).logits)  # the adapter really changed the model
    assert merged.config.tokenmaxx_adapter == adapter
    assert merged.config.tokenmaxx_adapter_revision.startswith("sha256:")
    assert not any("lora" in name for name, _ in merged.named_parameters())  # merged, not wrapped

    heads = MedusaHeads.for_backbone(merged)
    assert heads.config.adapter == adapter
    heads.save_pretrained(tmp_path / "heads")
    heads = load_heads(tmp_path / "heads")
    merged.generation_config.eos_token_id = None
    out = SpeculativeGenerator(merged, heads, draft="heads").generate(ids, max_new_tokens=12)
    assert out.sequences.tolist() == greedy_reference(merged, ids, 12).tolist()
    with pytest.raises(BackboneMismatchError, match="adapter"):
        SpeculativeGenerator(plain, heads, draft="heads")  # heads trained with the adapter on a backbone without it


def test_not_an_adapter_folder(base_and_adapter, tmp_path):
    base, _ = base_and_adapter
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter folder"):
        load_backbone(base, adapter=str(tmp_path / "empty"))
def test_unknown_alias():
    with pytest.raises(ValueError, match=r"unknown backbone 'gpt-9'.*'qwen2.5-coder-0.5b'.*'smollm2-135m'"):
        load_backbone("gpt-9")


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_backbone("smollm2-135m", dtype="float8")


def test_local_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_backbone(str(tmp_path))
