"""Prompt-lookup branches: suffix matching, merging into the heads' tree, hybrid output identical to greedy."""

import pytest
import torch
from helpers import OracleHeads, greedy_reference, random_heads, tiny_model

from tokenmaxx.inference import SpeculativeGenerator, Tree
from tokenmaxx.heads.drafting import HEADS, LOOKUP
from tokenmaxx.inference.hybrid import HybridDrafter
from tokenmaxx.inference.lookup import LookupConfig, LookupDrafter, NgramIndex, merge_branch


def _index(tokens, max_ngram=3):
    index = NgramIndex(max_ngram)
    index.extend(tokens)
    return index


def test_longest_suffix_wins_and_most_recent_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    seq = [5, 6, 7, 1, 9, 6, 7, 2, 4, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0..2 -> continuation from 3; (6, 7) more recently at 5..6 -> would give [2, 4]
    assert _index(seq).continuation(3) == [1, 9, 6]
    assert _index(seq, max_ngram=2).continuation(2) == [2, 4]  # only bigrams: most recent (6, 7)


def test_no_match_and_min_ngram():
    assert _index([1, 2, 3, 4]).continuation(4) == []
    seq = [8, 3, 9, 3]  # unigram (3,) occurred at 1 -> [9, 3]; bigram (9, 3) never before
    assert _index(seq).continuation(2, min_ngram=1) == [9, 3]
    assert _index(seq).continuation(2, min_ngram=2) == []


def test_index_grows_incrementally():
    index = _index([1, 2, 3])
    assert index.continuation(2) == []
    index.extend([1, 2])
    assert index.continuation(2) == [3, 1]  # (1, 2) at 0..1 -> 3, then 1
    index.extend([3])
    assert index.continuation(5) == [1, 2, 3]  # (1, 2, 3) at 0..2 -> the rest


def test_distinct_continuations_most_recent_first():
    #      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    seq = [5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 1, 2, 5, 6]
    # (5, 6) ended at 2, 6, 10 (and is the suffix): continuations from 10 ([1, 2]), 6 ([3, 4]); 2 repeats [1, 2]
    assert _index(seq, max_ngram=2).continuations(2, count=3) == (2, [[1, 2], [3, 4]])
    assert _index(seq, max_ngram=2).continuations(2, count=1) == (2, [[1, 2]])
    assert _index(seq, max_ngram=2).continuations(3, count=3) == (2, [[1, 2, 5], [3, 4, 5]])
    # the longest matching n-gram decides, its occurrences only: the suffix trigram (2, 5, 6) occurred once, at 3..5
    assert _index(seq, max_ngram=3).continuations(2, count=3) == (3, [[3, 4]])
    assert _index([1, 2, 3]).continuations(2, count=3) == (0, [])
    assert _index([1, 2, 3, 2]).continuations(2, count=3) == (1, [[3, 2]])  # unigram (2,) at 1


def test_suffix_never_matches_itself():
    assert _index([4, 4]).continuation(3, min_ngram=1) == [4]  # (4,) at 0 -> next is 4
    assert _index([7]).continuation(3, min_ngram=1) == []


def test_merge_dedupes_a_branch_that_coincides_with_a_head_path():
    tree = Tree([(0,), (1,), (0, 0)])  # nodes: 0 root, 1 (0,), 2 (1,), 3 (0, 0)
    tokens = torch.tensor([50, 10, 11, 20])  # (0,)=10, (1,)=11, (0,0)=20
    merged, buffers, sources = merge_branch(tokens, tree.buffers, [10, 20, 30])
    assert merged.tolist() == [50, 10, 11, 20, 30]  # shares 10 -> 20, adds 30 below node 3
    assert buffers.parents.tolist() == [0, 0, 0, 1, 3]
    assert sources.tolist() == [HEADS, HEADS | LOOKUP, HEADS, HEADS | LOOKUP, LOOKUP]
    assert buffers.depths.tolist() == [0, 1, 1, 2, 3]
    assert buffers.attn_mask[4].tolist() == [True, True, False, True, True]
    # a branch entirely inside the tree adds nothing
    same, same_buffers, sources = merge_branch(tokens, tree.buffers, [11])
    assert same.tolist() == tokens.tolist() and same_buffers is tree.buffers
    # a branch that departs at the root becomes a new child of the root
    _, buffers, _ = merge_branch(tokens, tree.buffers, [12, 13])
    assert buffers.parents.tolist() == [0, 0, 0, 1, 0, 4]
    assert buffers.children[0] == (1, 2, 4)


def _repeating_prompts(vocab, seed, n=5):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen)
        reps = int(torch.randint(2, 5, (1,), generator=gen))
        yield torch.cat([motif] * reps)[None], int(torch.randint(8, 40, (1,), generator=gen))


@pytest.mark.parametrize("draft", ["hybrid", "lookup"])
def test_lookup_drafting_matches_greedy_with_random_heads(model, draft):
    heads = random_heads(model) if draft == "hybrid" else None
    # adaptive_budget=False: sized from a latency table measured on a loaded machine, the hybrid trimmed every lookup
    # branch of the qwen2 model (seen beside a data run); the assertion is about the branches, not the sizing
    gen = SpeculativeGenerator(model, heads, draft=draft, lookup=LookupConfig(min_ngram=1, start_len=4),
                               adaptive_budget=False)
    fired = 0
    for input_ids, max_new in _repeating_prompts(model.config.vocab_size, seed=4):
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == greedy_reference(model, input_ids, max_new).tolist()
        fired += out.stats.accepted_by_source["lookup"] + out.stats.accepted_by_source["both"]
    assert fired > 0  # lookup branches were really accepted


def test_hybrid_with_oracle_heads_matches_greedy():
    model = tiny_model("qwen2", seed=9)
    both = 0
    for i, (input_ids, max_new) in enumerate(_repeating_prompts(model.config.vocab_size, seed=6)):
        expected = greedy_reference(model, input_ids, max_new)
        oracle = OracleHeads(model, greedy_reference(model, input_ids, max_new + 8), p_top=0.6, p_wrong=0.2, seed=i)
        out = SpeculativeGenerator(model, oracle, draft="hybrid", lookup=LookupConfig(min_ngram=1),
                                   adaptive_budget=False).generate(input_ids, max_new_tokens=max_new)  # whole trees
        assert out.sequences.tolist() == expected.tolist()
        both += out.stats.accepted_by_source["both"]
    assert both > 0  # shared (deduplicated) nodes were accepted


def test_heads_gate_sits_out_unpaying_heads_and_explores():
    from tokenmaxx.inference.hybrid import HeadsGate

    gate = HeadsGate(min_yield=0.05, explore_every=4, decay=0.5)
    assert gate.propose()  # starts trusting the heads
    for _ in range(8):  # proposing rounds that add nothing
        gate.update(0)
    assert gate.rate < 0.05
    assert [gate.propose() for _ in range(8)] == [False, False, False, True] * 2  # out, but every 4th round in
    gate.update(1)  # an exploring round whose heads token was accepted: back on at once
    assert gate.rate >= 0.05 and all(gate.propose() for _ in range(4))
    with pytest.raises(ValueError, match="explore_every >= 1"):
        HeadsGate(explore_every=0)
    with pytest.raises(ValueError, match="cost >= 0"):
        HeadsGate(cost=-0.01)
    with pytest.raises(ValueError, match="heads_min_yield >= 0"):
        LookupConfig(heads_min_yield=-1)


def test_heads_gate_bar_is_what_the_heads_cost():
    """A proposal costing 15 ms whose own nodes add 25 ms of verify time, in rounds of 100 ms that yield 2 tokens without
    the heads (50 ms a token), must add 0.8 heads-only tokens a round: tokens/s with the heads, (2 + r) / 0.14, beats
    2 / 0.1 exactly when r > 0.8."""
    from tokenmaxx.inference.hybrid import HeadsGate

    gate = HeadsGate(min_yield=0.05, explore_every=4, decay=0.5, cost=0.015)
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
    assert HeadsGate(min_yield=0.05, cost=0.0).threshold == 0.05  # free proposals and nodes: min_yield alone


def test_hybrid_with_heads_sitting_out_matches_greedy(model):
    # heads that never pay enough (min_yield above any possible yield) sit out 7 rounds of 8: still exact
    gen = SpeculativeGenerator(model, random_heads(model), draft="hybrid",
                               lookup=LookupConfig(heads_min_yield=100.0, heads_explore_every=8))
    # min_yield 0 on whole trees (no latency, so no proposing time to earn): the heads always run
    always = SpeculativeGenerator(model, random_heads(model), draft="hybrid", lookup=LookupConfig(heads_min_yield=0),
                                  adaptive_budget=False)
    for input_ids, max_new in _repeating_prompts(model.config.vocab_size, seed=11):
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


def test_bad_draft_settings(model):
    with pytest.raises(ValueError, match="unknown draft mode 'both'"):
        SpeculativeGenerator(model, random_heads(model), draft="both")
    with pytest.raises(ValueError, match="needs heads"):
        SpeculativeGenerator(model, None, draft="hybrid")
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        LookupConfig(min_ngram=4, max_ngram=3)
    # each drafter's default shortest n-gram: 1 for hybrid (valued per match length), 2 for lookup alone
    assert HybridDrafter(random_heads(model).drafter(model)).min_ngram == 1 and LookupDrafter().min_ngram == 2
    assert LookupDrafter(LookupConfig(min_ngram=3)).min_ngram == 3
    assert LookupConfig(min_ngram=3).shortest_ngram("hybrid") == 3


def test_branch_length_rule():
    cfg = LookupConfig(start_len=8, min_len=2, max_len=16)
    assert cfg.next_len(8, proposed=8, accepted=8) == 10
    assert cfg.next_len(16, proposed=16, accepted=16) == 16
    assert cfg.next_len(8, proposed=8, accepted=3) == 7
    assert cfg.next_len(2, proposed=2, accepted=0) == 2


def test_share_budget_gives_nodes_to_the_likelier_source():
    from tokenmaxx.inference.hybrid import LookupReliability, share_budget

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
    from tokenmaxx.inference.hybrid import LookupReliability

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
    from tokenmaxx.inference.hybrid import share_budget

    tree = Tree([(0,)])
    tokens = torch.tensor([9, 10])
    values = torch.tensor([1.0, 0.3])
    # branch 0 (reliable) and branch 1 (less so) share their first token 20, then part; branch 2 starts like the heads
    branches = [[20, 21, 22], [20, 30, 31], [10, 40]]
    out, buffers, sources, _, kept, _ = share_budget(tokens, tree.buffers, values, branches, [0.9, 0.5, 0.6], budget=6)
    # worth: 20: max(0.9, 0.5) = 0.9, 21: 0.81, 22: 0.73, 10: max(0.3, 0.6) = 0.6, 30: 0.25, 40: 0.36, 31: 0.125
    assert out.tolist() == [9, 10, 20, 21, 22, 40]
    assert sources.tolist() == [HEADS, HEADS | LOOKUP, LOOKUP, LOOKUP, LOOKUP, LOOKUP]
    assert kept == [[2, 3, 4], [2], [1, 5]]  # per branch, the kept nodes along it (new numbering)
    assert buffers.parents.tolist() == [0, 0, 0, 2, 3, 1]
    with pytest.raises(ValueError, match="3 lookup branches but 1 reliabilities"):
        share_budget(tokens, tree.buffers, values, branches, [0.9], budget=6)


def test_heads_calibration_moves_budget_between_sources():
    from tokenmaxx.inference.hybrid import HeadsCalibration, share_budget

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
    from tokenmaxx.inference.hybrid import share_budget

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
