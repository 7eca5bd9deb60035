"""Sampling at temperature > 0: table tests on hand-built logits, distribution tests (with teeth), determinism."""

import pytest
from helpers import (OracleHeads, broken_accept, chi2_pvalue, exact_pair, greedy_reference, random_heads,
                     prefilled, seeded_generator, tiny_model, tree_draft)
import torch
from transformers import GenerationConfig

import tokenmaxx.inference.generator as generator_module
from tokenmaxx.inference import SpeculativeGenerator, Tree, verify
from tokenmaxx.inference.sampling import (TypicalAcceptance, accept_sampling, accept_typical, build_warpers,
                                          target_probs)

TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
# nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0,0), 5 (0,1), 6 (1,0), 7 (0,0,0)


def _logits(probs_by_node, vocab=8):
    """Logits [N, V] whose softmax is the given distribution at each node (missing tokens get ~0)."""
    out = torch.full((len(probs_by_node), vocab), -1e4)
    for n, probs in enumerate(probs_by_node):
        for tok, p in probs.items():
            out[n, tok] = torch.log(torch.tensor(p))
    return out


NO_WARP = build_warpers(GenerationConfig(do_sample=True))


def _gen(seed):
    return seeded_generator(seed)


def test_perfect_match_accepts_the_whole_path():
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    one = [{1: 1.0}, {4: 1.0}, {0: 1.0}, {0: 1.0}, {7: 1.0}, {0: 1.0}, {0: 1.0}, {5: 1.0}]
    acc = accept_sampling(tokens, _logits(one), TREE.buffers, NO_WARP, _gen(0))
    assert acc.nodes.tolist() == [0, 1, 4, 7] and acc.tokens == [1, 4, 7, 5]


def test_early_mismatch_and_all_siblings_rejected():
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    # the root's distribution has no mass on any drafted child (1, 2, 3): every sibling is rejected
    probs = [{5: 0.5, 6: 0.5}] + [{0: 1.0}] * 7
    for seed in range(20):
        acc = accept_sampling(tokens, _logits(probs), TREE.buffers, NO_WARP, _gen(seed))
        assert acc.nodes.tolist() == [0] and acc.tokens[0] in (5, 6)
    # accepted at depth 1, then the child's drafts (4, 5) have no mass: bonus from node 1's distribution
    probs = [{1: 1.0}, {6: 1.0}] + [{0: 1.0}] * 6
    acc = accept_sampling(tokens, _logits(probs), TREE.buffers, NO_WARP, _gen(0))
    assert acc.nodes.tolist() == [0, 1] and acc.tokens == [1, 6]


def test_residual_sampling_frequencies():
    """p = {1: .5, 2: .25, 6: .25} at the root, drafts 1, 2, 3: emitted first tokens follow p exactly, and a rejected
    draft is never re-emitted as the bonus of the residual."""
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    probs = [{1: 0.5, 2: 0.25, 6: 0.25}] + [{0: 1.0}] * 7
    logits, n = _logits(probs), 8000
    gen = _gen(1)
    counts = torch.zeros(8)
    for _ in range(n):
        acc = accept_sampling(tokens, logits, TREE.buffers, NO_WARP, gen)
        counts[acc.tokens[0]] += 1
        if acc.nodes.tolist() == [0]:  # all drafts rejected -> residual: only token 6 is left
            assert acc.tokens == [6]
    freq = counts / n
    assert abs(freq[1] - 0.5) < 0.025 and abs(freq[2] - 0.25) < 0.025 and abs(freq[6] - 0.25) < 0.025


def test_typical_acceptance_thresholds():
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    probs = [{1: 0.6, 2: 0.4}, {4: 0.05, 5: 0.95}, {0: 1.0}, {0: 1.0}, {0: 1.0}, {0: 1.0}, {0: 1.0}, {0: 1.0}]
    acc = accept_typical(tokens, _logits(probs), TREE.buffers, NO_WARP, _gen(0), TypicalAcceptance(0.09, 0.3))
    assert acc.nodes.tolist() == [0, 1, 5]  # 1 passes at the root, 5 passes at node 1 (4 does not)
    with pytest.raises(ValueError, match="posterior_threshold"):
        TypicalAcceptance(posterior_threshold=0.0)


# ---- distribution tests --------------------------------------------------------------------------------------------


def _sampling_model():
    model = tiny_model("llama", seed=21, vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # entropy ~2 nats: many drafts are tried and some rejected
    model.generation_config.eos_token_id = None
    return model


SETTINGS = {"t0.7": dict(temperature=0.7), "t1.0": dict(temperature=1.0), "top_p0.8": dict(temperature=1.0, top_p=0.8)}


def _round_pvalue(accept, settings, n=12000):
    """One speculative round from real tree logits: the first two emitted tokens vs the exact joint."""
    model = _sampling_model()
    warpers = build_warpers(GenerationConfig(do_sample=True, **settings))
    prefix = torch.tensor([3, 4, 5, 6, 7])
    root = 8
    exact = exact_pair(model, torch.cat([prefix, torch.tensor([root])]), warpers)  # [V, V]
    p_root = exact.sum(1)
    drafts = p_root.argsort(descending=True)  # draft the likeliest tokens so many are accepted, some rejected
    tokens = torch.tensor([root, drafts[0], drafts[1], drafts[2], drafts[1], drafts[0], drafts[0], drafts[3]])
    buffers = TREE.buffers
    with torch.no_grad():
        logits = verify(model, prefilled(model, prefix[None]), [tree_draft(tokens, buffers)]).logits[0]  # [N, V]
    vocab = model.config.vocab_size
    cond = exact / exact.sum(1, keepdim=True)  # [V, V] p(t2 | t1)
    gen = _gen(123)
    counts = torch.zeros(vocab * vocab)
    for _ in range(n):
        out = accept(tokens, logits, buffers, warpers, gen).tokens
        if len(out) < 2:  # the next round would start fresh: complete by plain sampling
            out = out + [int(torch.multinomial(cond[out[0]], 1, generator=gen))]
        counts[out[0] * vocab + out[1]] += 1
    return chi2_pvalue(counts, exact.flatten())


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_round_distribution_matches_plain_sampling(settings):
    assert _round_pvalue(accept_sampling, settings) > 1e-3


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_round_distribution_test_has_teeth(settings):
    assert _round_pvalue(broken_accept, settings) < 1e-6


def _generator_pvalue(monkeypatch, broken: bool, n=1500, draft="heads"):
    """End to end through SpeculativeGenerator: the 2nd and 3rd generated tokens over seeded runs vs exact."""
    model = _sampling_model()
    if broken:
        monkeypatch.setattr(generator_module, "accept_sampling", broken_accept)
    # adaptive_budget=False: the hybrid node budget must not hang on this machine's measured (load-dependent) latency
    gen = SpeculativeGenerator(model, random_heads(model, seed=3), tree=TREE, draft=draft)
    warpers = build_warpers(GenerationConfig(do_sample=True, temperature=1.0))
    prefix = torch.tensor([3, 4, 5, 3, 4])  # repeats: hybrid drafting finds lookup branches (5, 3 after 4, ...)
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(prefix[None]).logits[0, -1], warpers)  # [V]
    exact = sum(p1[a] * exact_pair(model, torch.cat([prefix, torch.tensor([a])]), warpers) for a in range(vocab))
    counts = torch.zeros(vocab * vocab)
    from_lookup = 0
    for seed in range(n):
        out = gen.generate(prefix, max_new_tokens=3, do_sample=True, temperature=1.0, seed=seed)
        new = out.new_tokens
        counts[new[1] * vocab + new[2]] += 1
        from_lookup += out.stats.accepted_by_source["lookup"] + out.stats.accepted_by_source["both"]
    if draft == "hybrid":
        assert from_lookup >= 25  # lookup branches were really drafted and accepted (49 of 1500, on any machine)
    return chi2_pvalue(counts, exact.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["heads", "hybrid"])
def test_generator_distribution_matches_plain_sampling(monkeypatch, draft):
    assert _generator_pvalue(monkeypatch, broken=False, draft=draft) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["heads", "hybrid"])
def test_generator_distribution_test_has_teeth(monkeypatch, draft):
    assert _generator_pvalue(monkeypatch, broken=True, draft=draft) < 1e-3


# ---- determinism and configuration ---------------------------------------------------------------------------------
def test_seeded_determinism_and_generation_config(model):
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, random_heads(model), draft="heads")
    ids = torch.tensor([[4, 5, 6, 7]])
    a = gen.generate(ids, 20, do_sample=True, temperature=0.8, top_p=0.9, seed=7).new_tokens
    b = gen.generate(ids, 20, do_sample=True, temperature=0.8, top_p=0.9, seed=7).new_tokens
    c = gen.generate(ids, 20, generation_config=GenerationConfig(do_sample=True, temperature=0.8, top_p=0.9),
                     seed=7).new_tokens
    assert a == b == c and len(a) == 20
    runs = {tuple(gen.generate(ids, 20, do_sample=True, temperature=1.0, seed=s).new_tokens) for s in range(5)}
    assert len(runs) > 1  # it really samples


def test_temperature_zero_is_exact_greedy(model):
    from helpers import greedy_reference

    gen = SpeculativeGenerator(model, random_heads(model), draft="heads")
    ids = torch.tensor([[4, 5, 6, 7]])
    ref = greedy_reference(model, ids, 15).tolist()
    assert gen.generate(ids, 15, do_sample=True, temperature=0.0).sequences.tolist() == ref
    assert gen.generate(ids, 15, do_sample=False, temperature=0.9).sequences.tolist() == ref


@pytest.mark.parametrize("kw, msg", [
    (dict(do_sample=True, temperature=-1.0), "temperature must be > 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_k=-2), "top_k must be >= 0"),
    (dict(typical=TypicalAcceptance()), "typical acceptance is a sampling rule"),
    (dict(do_sample=True, seed=1, generator=torch.Generator()), "either seed= or generator="),
])
def test_bad_sampling_arguments(model, kw, msg):
    gen = SpeculativeGenerator(model, random_heads(model), draft="heads")
    with pytest.raises(ValueError, match=msg):
        gen.generate(torch.tensor([[4, 5]]), 4, **kw)


def test_typical_acceptance_accepts_what_the_backbone_is_sure_of(model):
    """Typical acceptance takes a candidate whose probability clears the entropy-adaptive threshold: at a temperature
    that makes the backbone near-certain, oracle drafts of its greedy continuation are accepted (long rounds) and the
    output is that continuation; drafts the backbone finds unlikely are all rejected (one token per round)."""
    input_ids = torch.tensor([[4, 5, 6]])
    model.generation_config.eos_token_id = None
    reference = greedy_reference(model, input_ids, 40)
    oracle = OracleHeads(model, reference, p_top=1.0, p_wrong=0.0)
    out = SpeculativeGenerator(model, oracle, draft="heads").generate(  # whole trees
        input_ids, 30, do_sample=True, temperature=1e-3, seed=0, typical=TypicalAcceptance())
    assert out.sequences.tolist() == reference[:, :33].tolist() and out.stats.mean_tau > 2.5
    out = SpeculativeGenerator(model, random_heads(model), draft="heads").generate(
        input_ids, 30, do_sample=True, temperature=1e-3, seed=0, typical=TypicalAcceptance(posterior_threshold=1.0,
                                                                                         posterior_alpha=1.0))
    assert out.sequences.tolist() == reference[:, :33].tolist()
    assert sum(out.stats.accepted_by_source.values()) <= 2  # near-greedy, and random drafts rarely agree
