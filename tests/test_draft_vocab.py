"""Draft vocabularies: guesses restricted to frequent tokens + the prompt's, output still the backbone's own."""

import pytest
import torch
from helpers import greedy_reference, random_heads, random_mtp

import tokenmaxx.inference.loop as loop_module
from tokenmaxx.heads import load_heads
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.heads.draft_vocab import frequent_tokens


def test_frequent_tokens():
    ids = frequent_tokens([[5, 5, 7, 9], [7, 5, 3]], size=2, always=[2])
    assert ids.tolist() == [2, 5, 7]  # 5 x3, 7 x2 (then 3 and 9 tie at 1: cut), EOS always in
    with pytest.raises(ValueError, match="positive"):
        frequent_tokens([[1]], size=0)


@pytest.mark.parametrize("kind", ["medusa", "mtp"])
def test_draft_vocab_guesses_stay_inside_and_output_is_identical(model, kind, monkeypatch, tmp_path):
    heads = random_heads(model) if kind == "medusa" else random_mtp(model)
    allowed = torch.arange(3, 96, 3)  # a third of the vocabulary
    heads.set_draft_vocab(allowed)
    heads.save_pretrained(tmp_path / "h")
    heads = load_heads(tmp_path / "h")
    assert heads.draft_vocab.tolist() == allowed.tolist() and heads.config.draft_vocab_size == allowed.numel()
    seen = []
    real_verify = loop_module.verify

    def spy(model_, kv, drafts, *args):
        seen.extend(drafts[0].tokens[1:].tolist())  # drafted nodes (the root is the backbone's own token)
        return real_verify(model_, kv, drafts, *args)

    monkeypatch.setattr(loop_module, "verify", spy)
    gen = SpeculativeGenerator(model, heads, draft="heads")
    prompt = torch.tensor([[4, 5, 7, 8, 10]])  # tokens outside the draft vocabulary: allowed as guesses too
    for max_new in (5, 23):
        assert gen.generate(prompt, max_new_tokens=max_new).sequences.tolist() == \
            greedy_reference(model, prompt, max_new).tolist()
    assert seen and set(seen) <= set(allowed.tolist()) | set(prompt[0].tolist())
    seen.clear()
    SpeculativeGenerator(model, heads, draft_vocab=False, draft="heads").generate(prompt, max_new_tokens=23)
    assert not set(seen) <= set(allowed.tolist()) | set(prompt[0].tolist())  # the switch really widens guesses


def test_set_draft_vocab_checks_and_removal(model):
    heads = random_heads(model)
    with pytest.raises(ValueError, match="within"):
        heads.set_draft_vocab([0, 96])
    heads.set_draft_vocab([1, 2])
    heads.set_draft_vocab(None)
    assert heads.draft_vocab is None and "draft_vocab" not in heads.state_dict()


@pytest.mark.slow
def test_draft_vocab_script_adds_and_removes(tmp_path, model):
    import subprocess
    import sys
    from pathlib import Path

    from datasets import Dataset

    Dataset.from_dict({"prompt": ["a", "b", "c"], "prompt_ids": [[3, 4], [3, 5], [4, 4]],
                       "answer_ids": [[7, 7, 8], [7, 9], [7, 2]]}).save_to_disk(str(tmp_path / "data"))
    random_heads(model).save_pretrained(tmp_path / "h")
    script = Path(__file__).resolve().parents[1] / "scripts" / "draft_vocab.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), "--heads", str(tmp_path / "h"), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    proc = run("--data", str(tmp_path / "data"), "--size", "3", "--eval_fraction", "0.34")
    assert proc.returncode == 0, proc.stderr[-2000:]
    heads = load_heads(tmp_path / "h")
    assert heads.draft_vocab.numel() == 3 and 7 in heads.draft_vocab.tolist()  # 7 is the most frequent token
    assert heads.config.extra["draft_vocab"]["size"] == 3
    assert run("--remove").returncode == 0
    assert load_heads(tmp_path / "h").draft_vocab is None
    assert "--data is required" in run().stderr
