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


def test_a_raw_text_prompt_that_ends_at_once_on_a_chat_backbone_is_warned_about_once(gen):
    """A string is raw text; on a backbone with a chat template, a text prompt that ends at once with no answer gets
    one RawTextPromptWarning naming the fix (chat messages); a chat prompt, a text that answers, and a tokenizer
    without a chat template get none."""
    import warnings

    from tokenmaxx.inference import RawTextPromptWarning

    gen.tokenizer = tokenizer = tiny_tokenizer()
    first = gen.generate("a b c", max_new_tokens=1).new_tokens[0]  # what the tiny backbone says first
    chat = [{"role": "user", "content": "a b c"}]
    assert gen.generate(chat, max_new_tokens=1).new_tokens[0] != first  # (so the chat does not end at once)
    gen.model.generation_config.eos_token_id = first  # the raw text now ends at once, as an instruct model's does

    def said(prompt, times: int = 1) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's own: a warning shown once per place
            for _ in range(times):
                gen.generate(prompt, max_new_tokens=8)
        return [str(w.message) for w in caught if issubclass(w.category, RawTextPromptWarning)]

    [message] = said("a b c", times=3)  # once, however often
    assert "a string is raw text" in message and "[{'role': 'user', 'content': text}]" in message
    assert len(said(["a b c", "a b c"])) == 1  # a batch of texts: the same warning
    assert said(chat) == [] and said([chat, chat]) == []
    gen.model.generation_config.eos_token_id = None
    assert said("a b c") == []  # it answered
    gen.model.generation_config.eos_token_id = first
    tokenizer.chat_template = None
    assert said("a b c") == []  # a base model: raw text is what it takes


def test_a_batch_rows_stats_time_the_rounds_they_ran_and_tau_follows_its_definition(gen):
    """A batch's row is timed as a single prompt is: the batch's prefill, then its rounds until it finished (a row
    that made its one token in the prefill ran none); a row that made its one token in the prefill has tau 1.0 (one
    token per forward), as a single prompt's does."""
    out = gen.generate([[3, 4, 5], [6, 7, 8]], max_new_tokens=[1, 8])
    first, second = (row.stats for row in out.rows)
    assert first.prefill_seconds == second.prefill_seconds == out.stats.prefill_seconds > 0
    assert first.decode_seconds <= second.decode_seconds == out.stats.decode_seconds
    assert sum(first.phase_seconds.values()) == 0 < sum(second.phase_seconds.values()) <= second.decode_seconds
    assert out.rows[0].stats.steps == 0 and out.rows[0].stats.mean_tau == 1.0
    assert out.rows[1].stats.mean_tau >= 1.0 and out.stats.wall_seconds > 0 and out.stats.tokens_per_s > 0
    alone = gen.generate([3, 4, 5], max_new_tokens=1).stats
    assert alone.steps == 0 and alone.mean_tau == 1.0 and alone.wall_seconds > 0


def test_a_seeded_sampled_batch_is_the_same_run_to_run(gen):
    """What the README promises of a sampled batch: the same seed, the same rows, every time (a row need not equal its
    prompt sampled alone with that seed: the rows share one random stream)."""
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]

    def sampled(seed: int) -> list[list[int]]:
        return gen.generate(prompts, max_new_tokens=12, do_sample=True, temperature=1.5, seed=seed).new_tokens

    assert sampled(1) == sampled(1) and sampled(1) != sampled(2)
