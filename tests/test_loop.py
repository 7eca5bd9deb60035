"""Speculative greedy output is token-identical to model.generate(do_sample=False) on tiny random backbones."""

import pytest
from helpers import (OracleHeads, assert_matches_greedy, greedy_reference, oracle_tau, random_heads, random_prompts,
                     tiny_model)
import torch

from tokenmaxx.inference import SpeculativeGenerator, chain, default_tree, Tree




@pytest.mark.parametrize("tree", [default_tree(), chain(4), Tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])],
                         ids=["default", "chain4", "small"])
def test_random_heads_match_greedy(model, tree):
    assert_matches_greedy(SpeculativeGenerator(model, random_heads(model), tree=tree, draft="heads"), model, 8, seed=1)


@pytest.mark.parametrize("p_top", [1.0, 0.6])
def test_oracle_heads_match_greedy_with_long_acceptance(model, p_top):
    # whole trees (adaptive_budget=False): the assertion is about acceptance, not about this machine's tree sizing
    tau = oracle_tau(model, lambda reference, i: SpeculativeGenerator(model, OracleHeads(
        model, reference, p_top=p_top, p_wrong=0.0 if p_top == 1.0 else 0.15, seed=i), draft="heads"), 6, seed=2)
    assert tau > (4.0 if p_top == 1.0 else 2.0), tau  # long paths (through side branches) were really accepted


def test_eos_stops_generation():
    model = tiny_model("llama", seed=3)
    input_ids = torch.tensor([[5, 6, 7, 8]])
    expected = greedy_reference(model, input_ids, 30)
    new = expected[0, 4:].tolist()
    eos = new[5]  # make the 6th generated token an EOS id: both must stop right after it
    model.generation_config.eos_token_id = [eos, 2]
    expected = greedy_reference(model, input_ids, 30)
    assert expected[0, -1].item() == eos and expected.shape[1] <= 4 + 6
    oracle = OracleHeads(model, greedy_reference(model, input_ids, 40), p_top=1.0, p_wrong=0.0)
    out = SpeculativeGenerator(model, oracle, draft="heads").generate(input_ids, max_new_tokens=30)
    assert out.sequences.tolist() == expected.tolist()


def test_eager_attention_matches_greedy():
    model = tiny_model("llama", seed=4, attn="eager")
    gen = SpeculativeGenerator(model, random_heads(model), draft="heads")
    for input_ids, max_new in random_prompts(4, model.config.vocab_size, seed=5):
        assert gen.generate(input_ids, max_new).sequences.tolist() == \
            greedy_reference(model, input_ids, max_new).tolist()


def test_stats_and_streamer(model):
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    input_ids = torch.tensor([[3, 4, 5]])
    model.generation_config.eos_token_id = None  # run the full length
    rec = Recorder()
    heads = random_heads(model)
    out = SpeculativeGenerator(model, heads, draft="heads").generate(input_ids, max_new_tokens=12, streamer=rec)
    assert rec.ended and rec.chunks[0] == [3, 4, 5]
    assert sum(rec.chunks[1:], []) == out.new_tokens
    s = out.stats
    assert s.steps == sum(s.accepted_hist.values())
    assert s.new_tokens == len(out.new_tokens) == 12
    # the rounds produced the 11 tokens after the prefill's (the last round may overshoot and be cut), each at most
    # the tree's depth + 1 (the bonus token)
    produced = sum(t * c for t, c in s.accepted_hist.items())
    assert 11 <= produced <= 11 + heads.tree_settings(heads.config).depth and s.mean_tau == produced / s.steps
    assert max(s.accepted_hist) <= heads.tree_settings(heads.config).depth + 1
    assert sum(s.accepted_by_source.values()) == produced - s.steps  # bonus tokens are nobody's draft
    assert 0 < sum(s.phase_seconds.values()) <= s.decode_seconds and s.wall_seconds == s.prefill_seconds + s.decode_seconds


def test_prefill_projects_only_the_last_prompt_position(model):
    """The prefill scores one position, not the whole prompt ([P, V] logits); a backbone whose forward takes no
    ``logits_to_keep`` is still served (every position), and both match greedy generate."""
    input_ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    expected = greedy_reference(model, input_ids, 10).tolist()
    rows = []
    hook = model.lm_head.register_forward_hook(lambda _, args, out: rows.append(out.shape[-2]))
    try:
        gen = SpeculativeGenerator(model, random_heads(model), draft="heads")
        assert gen.generate(input_ids, max_new_tokens=10).sequences.tolist() == expected
        assert rows[0] == 1  # the prefill; verify rounds follow
        forward = model.forward

        def without_logits_to_keep(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                                   use_cache=None, output_hidden_states=None, **attention):
            return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=use_cache,
                           output_hidden_states=output_hidden_states, **attention)

        model.forward = without_logits_to_keep
        rows.clear()
        assert gen.generate(input_ids, max_new_tokens=10).sequences.tolist() == expected
        assert rows[0] == 12
    finally:
        hook.remove()
        del model.forward
