"""The user-facing generator (``inference/generator.py``): every bad input gets one clear error; one backbone serves
two threads at once, each getting exactly what it gets alone (every generation has its own drafter, caches and
statistics, and what changes a forward travels with each call)."""

import os
import threading

import pytest
import torch
from helpers import greedy_reference, random_heads, random_mtp, tiny_model
from tiny_tokenizer import tiny_tokenizer

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


def test_ids_of_several_rows_are_a_batch(gen):
    out = gen.generate(torch.tensor([[3, 4, 5], [6, 7, 8]]), max_new_tokens=4)
    assert [row.sequences.tolist() for row in out.rows] == [
        gen.generate(torch.tensor([ids]), max_new_tokens=4).sequences.tolist() for ids in ([3, 4, 5], [6, 7, 8])]


@pytest.mark.parametrize("prompts", [["a", "b"], ("one", "two", "three"), [[{"role": "user", "content": "a"}],
                                                                        [{"role": "user", "content": "b"}]]])
def test_a_list_of_prompts_is_a_batch(gen, prompts):
    """Texts, chats and token lists: one result per row, each what its prompt gives alone."""
    gen.tokenizer = tiny_tokenizer()
    out = gen.generate(prompts, max_new_tokens=4)
    assert [row.new_tokens for row in out.rows] == [gen.generate(p, max_new_tokens=4).new_tokens for p in prompts]
    assert out.texts == [row.text for row in out.rows] and all(isinstance(t, str) for t in out.texts)
    assert [row.new_tokens for row in gen.generate([[3, 4], [5, 6]], max_new_tokens=4).rows] == \
        [gen.generate(p, max_new_tokens=4).new_tokens for p in ([3, 4], [5, 6])]


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


@pytest.mark.parametrize("draft", ["hybrid", "heads"])
def test_two_threads_on_one_backbone_give_the_sequential_outputs(draft):
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None  # full length: the threads overlap for the whole generation
    gen = SpeculativeGenerator(model, random_mtp(model), draft=draft)
    prompts = [torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5]]), torch.tensor([[9, 10, 11, 12]])]
    sequential = [gen.generate(p, max_new_tokens=40).new_tokens for p in prompts]
    for p, tokens in zip(prompts, sequential):  # fp32: the backbone's own greedy output
        assert torch.equal(greedy_reference(model, p, 40)[0, p.shape[1]:], torch.tensor(tokens))
    environment = dict(os.environ)
    for _ in range(3):
        results: list = [None, None]
        barrier = threading.Barrier(2)

        def run(i):
            barrier.wait()
            results[i] = gen.generate(prompts[i], max_new_tokens=40).new_tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == sequential
    assert dict(os.environ) == environment
