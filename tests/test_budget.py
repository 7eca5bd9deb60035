"""The per-round budget drafter (``inference/budget.py``): the heads' tree and lookup branches valued and cut to the
nodes worth their verify time, the heads' gate, and the hybrid's output identical to greedy."""

import pytest
import torch
from helpers import repeating_prompts, OracleHeads, greedy_reference, random_heads, tiny_model

from tokenmaxx.heads.drafting import HEADS, LOOKUP
from tokenmaxx.inference import GateConfig, SpeculativeGenerator, Tree
from tokenmaxx.inference.lookup import LookupConfig


def test_hybrid_with_oracle_heads_matches_greedy():
    model = tiny_model("qwen2", seed=9)
    both = 0
    for i, (input_ids, max_new) in enumerate(repeating_prompts(model.config.vocab_size, seed=6)):
        expected = greedy_reference(model, input_ids, max_new)
        oracle = OracleHeads(model, greedy_reference(model, input_ids, max_new + 8), p_top=0.6, p_wrong=0.2, seed=i)
        out = SpeculativeGenerator(model, oracle, draft="hybrid", lookup=LookupConfig(min_ngram=1)).generate(
            input_ids, max_new_tokens=max_new)  # whole trees (costs=None)
        assert out.sequences.tolist() == expected.tolist()
        both += out.stats.accepted_by_source["both"]
    assert both > 0  # shared (deduplicated) nodes were accepted


def test_heads_gate_sits_out_unpaying_heads_and_explores():
    from tokenmaxx.inference.budget import HeadsGate

    gate = HeadsGate(GateConfig(min_yield=0.05, explore_every=4, decay=0.5))
    assert gate.propose()  # starts trusting the heads
    for _ in range(8):  # proposing rounds that add nothing
        gate.update(0)
    assert gate.rate < 0.05
    assert [gate.propose() for _ in range(8)] == [False, False, False, True] * 2  # out, but every 4th round in
    gate.update(1)  # an exploring round whose heads token was accepted: back on at once
    assert gate.rate >= 0.05 and all(gate.propose() for _ in range(4))
    with pytest.raises(ValueError, match="explore_every >= 1"):
        GateConfig(explore_every=0)
    with pytest.raises(ValueError, match="min_yield >= 0"):
        GateConfig(min_yield=-1)
    with pytest.raises(ValueError, match="must be >= 0 seconds"):
        HeadsGate(cost=-0.01)


def test_heads_gate_bar_is_what_the_heads_cost():
    """A proposal costing 15 ms whose own nodes add 25 ms of verify time, in rounds of 100 ms that yield 2 tokens without
    the heads (50 ms a token), must add 0.8 heads-only tokens a round: tokens/s with the heads, (2 + r) / 0.14, beats
    2 / 0.1 exactly when r > 0.8."""
    from tokenmaxx.inference.budget import HeadsGate

    gate = HeadsGate(GateConfig(min_yield=0.05, explore_every=4, decay=0.5), cost=0.015)
    assert gate.threshold == 0.05  # no round seen yet: only min_yield
    gate.record_round(2, 0.1)
    assert gate.threshold == pytest.approx(0.3)  # no proposing round yet: the proposing time alone
    gate.update(1, 0.025)  # the first proposing round sets the extra verify time; rate 0.5 * 1 + 0.5 * 1 = 1
    assert gate.extra == pytest.approx(0.025) and gate.threshold == pytest.approx(0.8) and gate.propose()
    gate.rate = 0.7
    assert [gate.propose() for _ in range(4)] == [False, False, False, True]
    gate.update(1, 0.005)  # rate 0.85; cheaper nodes (extra 0.015) lower the bar to 0.6
    assert gate.threshold == pytest.approx(0.6) and gate.propose()
    gate.record_round(6, 0.1)  # text the lookup copies: 4 tokens a round without the heads raise the bar to 1.2
    assert gate.threshold == pytest.approx(1.2) and not gate.propose()
    assert HeadsGate(GateConfig(min_yield=0.05), cost=0.0).threshold == 0.05  # free proposals and nodes: min_yield alone


def test_hybrid_with_heads_sitting_out_matches_greedy(model):
    # heads that never pay enough (min_yield above any possible yield) sit out 7 rounds of 8: still exact
    gen = SpeculativeGenerator(model, random_heads(model), draft="hybrid",
                               gate=GateConfig(min_yield=100.0, explore_every=8))
    # min_yield 0 on whole trees (no latency, so no proposing time to earn): the heads always run
    always = SpeculativeGenerator(model, random_heads(model), draft="hybrid", gate=GateConfig(min_yield=0))
    for input_ids, max_new in repeating_prompts(model.config.vocab_size, seed=11):
        expected = greedy_reference(model, input_ids, max_new).tolist()
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == expected
        assert out.stats.heads_skipped > 0 and out.stats.heads_skipped <= out.stats.steps * 7 / 8 + 1
        out = always.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == expected and out.stats.heads_skipped == 0


def test_hybrid_sampling_runs_and_is_seeded(model):
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, random_heads(model), draft="hybrid")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    a = gen.generate(ids, 16, do_sample=True, temperature=0.8, seed=1).new_tokens
    assert a == gen.generate(ids, 16, do_sample=True, temperature=0.8, seed=1).new_tokens and len(a) == 16


def share_budget(tokens, buffers, values, *args, **kwargs):
    """``share_lists`` on a heads tree of tensors, as the drafter calls it."""
    from tokenmaxx.inference.budget import read_tree, share_lists
    return share_lists(tokens.device, *read_tree(tokens, buffers, values), *args, **kwargs)


def test_share_budget_gives_nodes_to_the_likelier_source():
    from tokenmaxx.inference.budget import LookupReliability

    # heads tree (token: value): root 9 -> 10 (0.5) -> 13 (0.3); root -> 12 (0.2); root -> 11 (0.05)
    tree = Tree([(0,), (0, 0), (1,), (2,)])
    tokens = torch.tensor([9, 10, 12, 11, 13])  # node order: (0,), (1,), (2,), (0, 0)
    values = torch.tensor([1.0, 0.5, 0.2, 0.05, 0.3])
    branch = [20, 21, 22]
    # reliable lookup: 0.9, 0.81, 0.73 beat every heads node but a (0.5): budget 5 keeps root, 3 lookup nodes, a
    out, buffers, sources, *_ = share_budget(tokens, tree.buffers, values, [branch], p_lookup=[0.9], budget=5)
    assert sorted(out.tolist()) == [9, 10, 20, 21, 22]
    assert (sources == LOOKUP).sum() == 3 and buffers.num_nodes == 5
    # unreliable lookup: 0.1, 0.01, ...: only its first node beats the weakest heads node (11: 0.05)
    out, buffers, sources, *_ = share_budget(tokens, tree.buffers, values, [branch], p_lookup=[0.1], budget=5)
    assert sorted(out.tolist()) == [9, 10, 12, 13, 20]
    parents = buffers.parents.tolist()
    assert all(parents[i] < i for i in range(1, len(parents)))  # prefix-closed, parents first
    # a branch that starts with a heads token shares that node (worth the larger value) and continues below it
    out, buffers, sources, *_ = share_budget(tokens, tree.buffers, values, [[10, 12, 30]], p_lookup=[0.9], budget=4)
    assert out.tolist() == [9, 10, 12, 30] and sources.tolist() == [HEADS, HEADS | LOOKUP, LOOKUP, LOOKUP]
    # the reliability estimate moves with what was accepted
    rel = LookupReliability()
    for _ in range(5):
        rel.update(proposed=4, accepted=4)
    high = rel.p
    for _ in range(10):
        rel.update(proposed=4, accepted=0)
    assert high > 0.75 and rel.p < 0.3
    # per-depth values instead of one rate: the branch's nodes are worth exactly the values given
    out, buffers, sources, *_ = share_budget(tokens, tree.buffers, values, [branch], p_lookup=[[0.45, 0.4, 0.25]],
                                             budget=5)
    assert sorted(out.tolist()) == [9, 10, 13, 20, 21]  # 0.5, 0.45, 0.4, 0.3 beat 0.25
    with pytest.raises(ValueError, match="3 tokens has only 2 values"):
        share_budget(tokens, tree.buffers, values, [branch], p_lookup=[[0.45, 0.4]], budget=5)


def test_lookup_reliability_learns_per_depth():
    from tokenmaxx.inference.budget import LookupReliability

    # nothing seen yet: every depth falls back on the one above it, 1/2 each
    assert LookupReliability().values(4) == pytest.approx([0.5, 0.25, 0.125, 0.0625])
    # bursty copying: a continuation is either wrong at once or right all along. The first token is a coin flip, the
    # deeper ones almost sure once the first was right: an 8-token branch keeps ~1/2 of its value at the bottom
    # (one constant per-token rate would give it 0.5**8)
    bursty = LookupReliability()
    for _ in range(10):
        bursty.update(proposed=8, accepted=0)
        bursty.update(proposed=8, accepted=8)
    rates, values = bursty.rates(8), bursty.values(8)
    assert rates[0] == pytest.approx(0.5, abs=0.1) and min(rates[1:]) > 0.8
    assert values[-1] > 0.25 and all(a >= b for a, b in zip(values, values[1:]))
    # the opposite: the first token is usually right, the next ones rarely: value falls fast below depth 1
    fading = LookupReliability()
    for _ in range(10):
        fading.update(proposed=8, accepted=1)
    assert fading.rates(2)[0] > 0.8 and fading.values(3)[2] < 0.1
    # only verified depths are observed: a branch cut to 2 nodes says nothing about depth 3 and below
    cut = LookupReliability()
    for _ in range(10):
        cut.update(proposed=2, accepted=2)
    assert cut._counts.keys() == {0, 1}
    # update_branch: the accepted tokens of a branch are the common prefix of its kept nodes and the accepted path
    rel = LookupReliability()
    rel.update_branch(kept=[3, 4, 5], path=[3, 4, 9])
    assert rel._counts == {0: (1.0, 0.0), 1: (1.0, 0.0), 2: (0.0, 1.0)}


def test_share_budget_with_several_branches():

    tree = Tree([(0,)])
    tokens = torch.tensor([9, 10])
    values = torch.tensor([1.0, 0.3])
    # branch 0 (reliable) and branch 1 (less so) share their first token 20, then part; branch 2 starts like the heads
    branches = [[20, 21, 22], [20, 30, 31], [10, 40]]
    out, buffers, sources, _, kept, *_ = share_budget(tokens, tree.buffers, values, branches, [0.9, 0.5, 0.6], budget=6)
    # worth: 20: max(0.9, 0.5) = 0.9, 21: 0.81, 22: 0.73, 10: max(0.3, 0.6) = 0.6, 30: 0.25, 40: 0.36, 31: 0.125
    assert out.tolist() == [9, 10, 20, 21, 22, 40]
    assert sources.tolist() == [HEADS, HEADS | LOOKUP, LOOKUP, LOOKUP, LOOKUP, LOOKUP]
    assert kept == [[2, 3, 4], [2], [1, 5]]  # per branch, the kept nodes along it (new numbering)
    assert buffers.parents.tolist() == [0, 0, 0, 2, 3, 1]
    with pytest.raises(ValueError, match="3 lookup branches but 1 reliabilities"):
        share_budget(tokens, tree.buffers, values, branches, [0.9], budget=6)


def test_heads_calibration_moves_budget_between_sources():
    from tokenmaxx.inference.budget import HeadsCalibration

    tree = Tree([(0,), (0, 0), (1,), (2,)])
    tokens = torch.tensor([9, 10, 12, 11, 13])
    values = torch.tensor([1.0, 0.5, 0.2, 0.05, 0.3])
    branch = [20, 21, 22]  # p = 0.4: 0.4, 0.16, 0.064
    out, _, sources, heads_values, *_ = share_budget(tokens, tree.buffers, values, [branch], p_lookup=[0.4], budget=4)
    assert out.tolist() == [9, 10, 13, 20]  # heads as promised: 0.5, 0.3 beat 0.16
    assert heads_values.tolist() == pytest.approx([1.0, 0.5, 0.3, 0.0])  # the heads' own values, unscaled
    # heads that deliver a tenth of what their values promise: their nodes are worth 0.05, 0.03, ...
    calibration = HeadsCalibration()
    for _ in range(20):
        calibration.update(expected=1.0, observed=0)
    assert calibration.scale == pytest.approx(0.05)  # clamped at the lower bound
    out, _, sources, *_ = share_budget(tokens, tree.buffers, values, [branch], [0.4], budget=4,
                                      heads_scale=calibration.scale)
    assert out.tolist() == [9, 20, 21, 22] and (sources == LOOKUP).sum() == 3
    for _ in range(20):
        calibration.update(expected=1.0, observed=2)
    assert calibration.scale == pytest.approx(2.0, abs=0.05)


def test_share_budget_sizes_the_tree_from_the_latency_table():

    tree = Tree([(0,), (0, 0), (1,), (2,)])
    tokens = torch.tensor([9, 10, 12, 11, 13])
    values = torch.tensor([1.0, 0.5, 0.2, 0.05, 0.3])
    branch = [20, 21]  # with p = 0.9: 0.9, 0.81
    flat = {1: 0.10, 8: 0.10}  # verifying more nodes is free: keep the whole budget
    out, *_ = share_budget(tokens, tree.buffers, values, [branch], [0.9], budget=7, latency=flat)
    assert out.numel() == 7
    steep = {1: 0.10, 2: 0.10, 3: 0.10, 4: 0.30}  # a 4th node triples the cost: 3 nodes (root + 0.9 + 0.81)
    out, _, sources, *_ = share_budget(tokens, tree.buffers, values, [branch], [0.9], budget=7, latency=steep)
    assert out.tolist() == [9, 20, 21] and (sources == LOOKUP).sum() == 2
    # no branch: the heads tree alone, trimmed the same way
    out, buffers, sources, *_ = share_budget(tokens, tree.buffers, values, [], [], budget=7, latency=steep)
    assert out.tolist() == [9, 10, 13] and (sources == HEADS).all() and buffers.parents.tolist() == [0, 0, 1]
    # a round that also spends 10 s proposing: extra nodes cost little beside it, 6 nodes give the most tokens per second
    # ((1 + 0.9 + 0.81 + 0.5 + 0.3 + 0.2) / (0.7 + 10) against 2.71 / 10.1 for 3 nodes)
    out, *_ = share_budget(tokens, tree.buffers, values, [branch], [0.9], budget=7, latency=steep, overhead=10.0)
    assert out.numel() == 6


def test_a_row_of_a_batch_is_charged_its_share_of_the_rows_proposals():
    """Alone a proposal costs one row's measured seconds; beside 3 other rows, a quarter of what 4 rows' proposals
    together were measured to take (their module passes run as one), and the heads' gate weighs that."""
    from tokenmaxx.inference.budget import BudgetDrafter
    from tokenmaxx.inference.costs import Costs, VerifyLatency

    model = tiny_model("llama", seed=1)
    own = random_heads(model).drafter(model)
    drafter = BudgetDrafter(own, costs=Costs(latency=VerifyLatency({0: {1: 0.01, 8: 0.02}}), propose_seconds=0.01,
                                             propose_rows={4: 0.016}))
    assert drafter.propose_cost == 0.01 and drafter.gate.cost == 0.01
    drafter.share_forward(4)
    assert drafter.propose_cost == pytest.approx(0.004) and drafter.gate.cost == pytest.approx(0.004)
    unmeasured = BudgetDrafter(own, costs=Costs(latency=VerifyLatency({0: {1: 0.01}}), propose_seconds=0.01))
    unmeasured.share_forward(4)
    assert unmeasured.propose_cost == pytest.approx(0.01)  # rows x one row's, shared by the rows
