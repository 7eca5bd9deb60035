"""Every bad input of the generator gets one clear error."""

import pytest
import torch
from helpers import random_heads, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import load_backbone
from tokenmaxx.inference import SpeculativeGenerator, chain


@pytest.fixture
def gen():
    model = tiny_model("llama")
    return SpeculativeGenerator(model, random_heads(model), draft="heads")


def test_empty_prompt(gen):
    with pytest.raises(ValueError, match="empty"):
        gen.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], max_new_tokens=4)
    for text, why in (("", "no text"), (" \n\t", "only whitespace")):  # said before any tokenizer is needed
        with pytest.raises(ValueError, match=rf"the prompt is empty \({why}\)"):
            gen.generate(text, max_new_tokens=4)


@pytest.mark.parametrize("n", [0, -5, 2.5])
def test_bad_max_new_tokens(gen, n):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        gen.generate(torch.tensor([[3, 4]]), max_new_tokens=n)


def test_context_overflow(gen):
    with pytest.raises(ValueError, match=r"prompt \(250 tokens\) \+ max_new_tokens \(10\) = 260 exceeds .* 256"):
        gen.generate(torch.full((1, 250), 5), max_new_tokens=10)
    gen.model.generation_config.eos_token_id = None  # run the full length
    out = gen.generate(torch.full((1, 250), 5), max_new_tokens=6)  # exactly up to the limit is fine
    assert out.sequences.shape[1] == 256


def test_batch_larger_than_one(gen):
    with pytest.raises(ValueError, match="only batch size 1 is supported, got a batch of 2"):
        gen.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("prompts", [["a", "b"], ("one", "two", "three"), [[{"role": "user", "content": "a"}],
                                                                        [{"role": "user", "content": "b"}]]])
def test_a_list_of_prompts_is_refused_as_a_batch(gen, prompts):
    gen.tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match=rf"batches are not supported yet: one prompt per call \(got a list of "
                                         rf"{len(prompts)} prompts\)"):
        gen.generate(prompts, max_new_tokens=4)
    with pytest.raises(ValueError, match="only batch size 1 is supported, got a batch of 2"):  # token rows too
        gen.generate([[3, 4], [5, 6]], max_new_tokens=4)


@pytest.mark.parametrize("messages, index", [
    ([{"role": "user", "content": ""}], 0),
    ([{"role": "user", "content": " \n\t"}], 0),
    ([{"role": "system", "content": "be brief."}, {"role": "user", "content": "  "}], 1),
    ([{"role": "user"}], 0),
])
def test_empty_chat_message(gen, messages, index):
    gen.tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match=rf"chat message {index} \({messages[index]['role']}\) is empty"):
        gen.generate(messages, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty"):  # no messages at all
        gen.generate([], max_new_tokens=4)


@pytest.mark.parametrize("ids, bad", [([1, 2, 999999], "999999"), ([-1, 5], "-1"), (torch.tensor([[5, 96, 97]]),
                                                                                      "96, 97")])
def test_token_ids_outside_the_vocabulary(gen, ids, bad):
    with pytest.raises(ValueError, match=rf"token ids out of the vocabulary: {bad} \(the backbone's vocabulary has "
                                         r"96 ids, 0\.\.95\)"):
        gen.generate(ids, max_new_tokens=4)
    assert gen.generate([0, 95], max_new_tokens=2).sequences[0, :2].tolist() == [0, 95]  # both ends are in it


def test_text_without_tokenizer(gen):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate("hello", max_new_tokens=4)


def test_tree_deeper_than_heads():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="tree depth 5 exceeds the number of heads \\(4\\)"):
        SpeculativeGenerator(model, random_heads(model), tree=chain(5), draft="heads")


def test_unknown_alias():
    with pytest.raises(ValueError, match=r"unknown backbone 'gpt-9'.*'qwen2.5-coder-0.5b'.*'smollm2-135m'"):
        load_backbone("gpt-9")


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_backbone("smollm2-135m", dtype="float8")


def test_local_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_backbone(str(tmp_path))
