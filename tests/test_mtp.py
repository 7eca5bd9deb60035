"""MTP (sequential) heads and dynamic draft trees: training unroll == cached inference, greedy identity with random
and oracle MTP heads on tiny Llama / Qwen2, tree construction on hand-built log-probabilities, save/load, bad inputs."""

import math

import pytest
from helpers import (OracleMTP, assert_matches_greedy, chi2_pvalue, exact_pair, greedy_reference, oracle_tau, random_eagle3,
                     random_heads, random_mtp, random_prompts, tiny_model)
import torch
from transformers import DynamicCache, GenerationConfig

from tokenmaxx.heads import BackboneMismatchError, HeadsConfig, MTPHeads, load_heads
from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig, Frontier, grow_tree
from tokenmaxx.inference import Costs, VerifyLatency
from tokenmaxx.inference.sampling import build_warpers, target_probs


# ---- the module --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [random_mtp, random_eagle3], ids=["mtp", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_unroll_equals_cached_tree_inference(arch, make):
    """Depth d at anchor a in the training unroll == the same chain drafted through the KV cache with a tree mask
    that also holds a sibling branch (which must not leak into the chain). For every sequential kind."""
    model = tiny_model(arch)
    heads = make(model)
    embed = model.get_input_embeddings()
    ids = torch.randint(3, 96, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = backbone_features(model(ids, output_hidden_states=True).hidden_states, heads.feature_layers)
        unrolled = heads.unrolled_states(hidden, ids, embed)  # [3, 1, 14, H]
        a = 6
        cache = DynamicCache()
        s1 = heads.step(heads.lift(hidden[:, : a + 1]), ids[:, 1: a + 2], embed, torch.arange(a + 1)[None],
                        _causal(0, a + 1), cache)
        assert torch.allclose(heads.norm(s1[0, -1]), unrolled[0, 0, a], atol=1e-5)
        # depth 2: two siblings (the true token and a decoy) in one call, each seeing the cache and itself only
        toks = torch.tensor([[int(ids[0, a + 2]), 5]])
        visible = torch.ones(2, a + 3, dtype=torch.bool)
        visible[0, a + 2] = visible[1, a + 1] = False
        s2 = heads.step(s1[:, -1:].expand(1, 2, -1), toks, embed, torch.tensor([[a + 1, a + 1]]), _bias(visible),
                        cache)
        assert torch.allclose(heads.norm(s2[0, 0]), unrolled[1, 0, a], atol=1e-5)
        # depth 3 on the true branch: sees the cache, its depth-2 ancestor (entry a+1), not the decoy (a+2)
        visible = torch.ones(1, a + 4, dtype=torch.bool)
        visible[0, a + 2] = False
        s3 = heads.step(s2[:, :1], ids[:, a + 3: a + 4], embed, torch.tensor([[a + 2]]), _bias(visible), cache)
        assert torch.allclose(heads.norm(s3[0, 0]), unrolled[2, 0, a], atol=1e-5)


def _two_layer_mtp(model):
    heads = MTPHeads.for_backbone(model, num_heads=3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    return heads


@pytest.mark.parametrize("make", [random_mtp, _two_layer_mtp, random_eagle3], ids=["mtp", "mtp-2-layers", "eagle3"])
def test_training_states_at_selected_anchors_equal_the_whole_unroll(make):
    """training_states runs depths 2..D at the selected anchors only: the same states, and the same gradients in the
    module's weights, as the unroll over every position cut to those anchors. Rows with different anchor counts (one
    with none), a selection that runs to the last position, a two-layer MTP module."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    heads = make(model).train()
    embed = model.get_input_embeddings()
    ids = torch.randint(3, 96, (3, 17), generator=torch.Generator().manual_seed(2))
    selected = torch.zeros(3, 17, dtype=torch.bool)
    selected[0, 5:] = True  # a prompt of 5, then the answer to the end
    selected[1, [2, 3, 9, 10, 11]] = True
    with torch.no_grad():
        hidden = backbone_features(model(ids, output_hidden_states=True).hidden_states, heads.feature_layers)
    weights = [p for p in heads.parameters() if p.requires_grad]
    probe = torch.randn(heads.config.num_heads, int(selected.sum()), model.config.hidden_size)

    def run(states):
        grads = torch.autograd.grad((states * probe).sum(), weights)
        return states.detach(), grads

    whole, whole_grads = run(heads.unrolled_states(hidden, ids, embed)[:, selected])
    cut, cut_grads = run(heads.training_states(hidden, ids, embed, selected))
    assert cut.shape == whole.shape
    assert torch.allclose(cut, whole, atol=1e-5)
    for a, b in zip(cut_grads, whole_grads):  # gradients up to ~50: fp32 sums in another order differ by ~3e-5
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("share", [True, False], ids=["shared-kv-heads", "copied-kv-heads"])
@pytest.mark.parametrize("anchored", [True, False], ids=["anchors", "every-position"])
def test_unrolled_attention_is_prefix_and_own_chain_attention(share, anchored, monkeypatch):
    """One depth of the unroll == softmax attention over an explicit mask (the anchor's causal prefix of depth-1 keys,
    then the anchor's own key at each deeper depth), in fp64, for grouped-query heads shared by SDPA (the CPU) or
    copied (other devices), at selected anchors and at every position."""
    from tokenmaxx.heads import attention
    monkeypatch.setattr(attention, "sdpa_shares_kv_heads", lambda device: share)
    gen = torch.Generator().manual_seed(4)
    bsz, heads, kv_heads, dim, seq, depth = 2, 4, 2, 8, 9, 3
    where = torch.tensor([[2, 5, 6, 8], [0, 1, 7, 7]]) if anchored else torch.arange(seq)[None].expand(bsz, seq)
    anchors = where.shape[1]
    query = torch.randn(bsz, heads, anchors, dim, generator=gen, dtype=torch.float64)
    key, value = (torch.randn(bsz, kv_heads, seq + (depth - 1) * anchors, dim, generator=gen, dtype=torch.float64)
                  for _ in range(2))
    visible = torch.arange(seq)[None, None] <= where[..., None]  # [B, M, T]
    out = attention.unrolled_attention(query, key, value, None, visible if anchored else None)
    mask = torch.cat([visible, torch.eye(anchors, dtype=torch.bool).repeat(1, depth - 1).expand(bsz, -1, -1)], -1)
    k, v = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    scores = (query @ k.transpose(-1, -2) / math.sqrt(dim)).masked_fill(~mask[:, None], -math.inf)
    assert torch.allclose(out, (scores.softmax(-1) @ v).transpose(1, 2), atol=1e-10)
    with pytest.raises(ValueError, match="are not 9 depth-1 entries"):
        attention.unrolled_attention(query, key[:, :, :-1], value[:, :, :-1], None, visible)


def _bias(visible):
    bias = torch.zeros(1, 1, *visible.shape)
    return bias.masked_fill(~visible, torch.finfo(bias.dtype).min)


def _causal(cached, n):
    visible = torch.ones(n, cached + n, dtype=torch.bool)
    visible[:, cached:] = torch.ones(n, n, dtype=torch.bool).tril()
    return _bias(visible)


def test_untrained_module_starts_from_the_backbone_guess():
    """Zero-initialised residual branches + identity-dominated fuse: depth 1 of an untrained module is close to the
    backbone's own next-token guess (a sane starting point for training)."""
    model = tiny_model("llama")
    heads = MTPHeads.for_backbone(model, num_heads=2)
    assert all(float(layer.mlp.down_proj.weight.detach().abs().sum()) == 0 for layer in heads.layers)


def test_save_load_round_trip_and_checks(tmp_path):
    model = tiny_model("qwen2")
    heads = random_mtp(model, seed=3)
    heads.save_pretrained(tmp_path / "mtp")
    loaded = load_heads(tmp_path / "mtp")
    assert isinstance(loaded, MTPHeads) and loaded.config.layer_config["model_type"] == "qwen2"
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = tiny_model("qwen2", hidden_size=48)
    with pytest.raises(BackboneMismatchError, match="hidden size 32"):
        loaded.check_backbone(other)
    with pytest.raises(ValueError, match="layer_config"):
        MTPHeads(HeadsConfig(kind="mtp", hidden_size=32, vocab_size=96))


# ---- dynamic trees -------------------------------------------------------------------------------------------------
def _lp(pairs, vocab=10):
    """Log-probs [V] with the given {token: prob}; the rest share what is left."""
    probs = torch.full((vocab,), 0.0)
    for tok, p in pairs.items():
        probs[tok] = p
    rest = [t for t in range(vocab) if t not in pairs]
    probs[rest] = (1 - sum(pairs.values())) / len(rest)
    return probs.log()


def test_expand_tree_keeps_the_most_probable_paths():
    children = {  # (parent token) -> child distribution; node identity by token is enough here
        1: _lp({4: 0.9, 5: 0.05}), 2: _lp({6: 0.5, 7: 0.4}), 4: _lp({8: 0.8, 9: 0.1}), 6: _lp({8: 0.6}),
        7: _lp({9: 0.99}), 5: _lp({3: 0.9}),
    }
    calls = []

    def child_logprobs(frontier: Frontier):
        calls.append(frontier.tokens[frontier.live].tolist())
        return torch.stack([children.get(tok, _lp({})) for tok in frontier.tokens.tolist()])

    root_lp = _lp({1: 0.6, 2: 0.3, 3: 0.05})
    tree = grow_tree(0, root_lp, child_logprobs, topk=2, depth=3, nodes=6)
    # path probabilities: 1 .6, 1-4 .54, 1-4-8 .432, 2 .3, 2-6 .15, 2-7 .12, 2-7-9 .119, 1-4-9 .054 ...
    got = {tuple(_path(tree, i)): round(math.exp(float(tree.scores[i])), 3) for i in range(1, 6)}
    assert got == {(1,): 0.6, (1, 4): 0.54, (2,): 0.3, (1, 4, 8): 0.432, (2, 6): 0.15}
    assert tree.buffers.parents.tolist() == [0, 0, 0, 1, 2, 3]  # parents precede children, BFS order
    assert calls[0] == [1, 2]  # frontier of level 2: the two best level-1 nodes
    assert calls[1] == [4, 6]  # level 3: the two best level-2 nodes (1-4 .54, 2-6 .15 beat 2-7 .12)


def _path(tree, node):
    out = []
    parents = tree.buffers.parents.tolist()
    while node:
        out.append(int(tree.tokens[node]))
        node = parents[node]
    return out[::-1]


def test_expand_tree_stops_when_no_frontier_node_can_enter():
    calls = []

    def child_logprobs(frontier: Frontier):
        calls.append(int(frontier.live.sum()))
        return torch.stack([_lp({}) for _ in frontier.tokens])  # flat: every child is far less likely than level 1

    tree = grow_tree(0, _lp({1: 0.5, 2: 0.4}), child_logprobs, topk=2, depth=5, nodes=3)
    assert [_path(tree, i) for i in range(1, 3)] == [[1], [2]]
    # only node 1 (0.5) could still have a child above the 2nd best score (0.4); its flat children cannot, so the
    # next level is never drafted
    assert calls == [1]
    tree = grow_tree(0, _lp({1: 0.5, 2: 0.4}), child_logprobs, topk=2, depth=1, nodes=40)
    assert tree.buffers.num_nodes == 3 and calls == [1]


def test_expand_tree_stops_below_min_mass():
    calls = []
    children = {1: _lp({3: 0.5}), 2: _lp({4: 0.5})}

    def child_logprobs(frontier: Frontier):
        calls.append(frontier.tokens[frontier.live].tolist())
        return torch.stack([children.get(tok, _lp({})) for tok in frontier.tokens.tolist()])

    def grow(min_mass):
        calls.clear()
        return grow_tree(0, _lp({1: 0.5, 2: 0.4}), child_logprobs, topk=2, depth=3, nodes=40, min_mass=min_mass)

    # level 2's frontier (1, 2) holds 0.9 of the draft's probability, level 3's (1-3, 2-4) 0.25 + 0.2 = 0.45
    tree = grow(0.5)
    assert calls == [[1, 2]] and tree.buffers.depth == 2
    grow(0.4)
    assert calls == [[1, 2], [3, 4]]
    tree = grow(0.95)
    assert calls == [] and tree.buffers.num_nodes == 3
    grow(0.0)  # 0 drafts every level
    assert calls == [[1, 2], [3, 4]]


def test_dynamic_tree_specs():
    assert DynamicTreeConfig.parse("dynamic:48") == DynamicTreeConfig(nodes=48)
    assert DynamicTreeConfig.parse("dynamic:nodes=16,topk=4,depth=6") == DynamicTreeConfig(16, 4, 6)
    assert DynamicTreeConfig.parse("dynamic:nodes=12,min_mass=0.1") == DynamicTreeConfig(nodes=12, min_mass=0.1)
    for bad in ("dynamic:0", "dynamic:nodes=8,width=2", "dynamic:x", "dynamic:min_mass=1.5",
                "dynamic:min_mass=nan", "dynamic:min_mass=-0.1"):
        with pytest.raises(ValueError, match="dynamic"):
            DynamicTreeConfig.parse(bad)
    with pytest.raises(ValueError, match="min_mass must be a probability"):
        DynamicTreeConfig(min_mass=True)


# ---- greedy identity -----------------------------------------------------------------------------------------------
# min_mass=0: random heads' flat guesses would otherwise stop growth after level 1 (their frontier holds little mass)
@pytest.mark.parametrize("tree", ["dynamic", "dynamic:nodes=6,topk=3,depth=5,min_mass=0", "dynamic:2"])
def test_random_mtp_heads_match_greedy(model, tree):
    assert_matches_greedy(SpeculativeGenerator(model, random_mtp(model), tree=tree, draft="heads"), model, 6, seed=4)


@pytest.mark.parametrize("p_top", [1.0, 0.6])
def test_oracle_mtp_heads_match_greedy_with_long_acceptance(model, p_top):
    tau = oracle_tau(model, lambda reference, i: SpeculativeGenerator(  # whole trees: acceptance, not sizing
        model, OracleMTP(model, reference, p_top=p_top, seed=i), tree="dynamic:nodes=16,topk=3,depth=4", draft="heads"), 5, seed=5)
    assert tau > (4.0 if p_top == 1.0 else 2.5), tau


def test_heads_only_trees_are_cut_to_the_nodes_worth_their_verify_time(model):
    """draft="heads" on a latency table keeps, each round, the n nodes that maximise expected tokens per second: where
    every node past the root costs 100 plain steps none pays and each round verifies the root alone (tau 1); where a
    verify costs the same at any size the whole tree is kept (oracle heads: long acceptance). Output stays the
    backbone's either way."""
    def sized(latency):
        def make(reference, i):
            gen = SpeculativeGenerator(model, OracleMTP(model, reference, p_top=1.0, seed=i),
                                       tree="dynamic:nodes=16,topk=3,depth=4", draft="heads",
                                       costs=Costs(latency=VerifyLatency({0: latency})))  # as measured somewhere
            assert gen.describe().endswith("sized per round")
            return gen
        return make

    assert oracle_tau(model, sized({1: 1.0, 2: 100.0, 64: 6400.0}), 3, seed=5) == 1.0
    assert oracle_tau(model, sized({1: 1.0, 64: 1.0}), 3, seed=5) > 4.0
    fixed = SpeculativeGenerator(model, random_mtp(model), draft="heads")
    assert fixed.costs is None and not fixed.describe().endswith("sized per round")


def test_heads_only_drafting_sits_out_rounds_that_do_not_earn_the_proposing_time(model):
    """Sized heads-only drafting runs the heads only while the tokens only they find pay for their proposing time
    (``HeadsGate``): heads that guess badly and cost 100 verifies a proposal sit out all but every 8th round (a plain
    decode step each); oracle heads whose proposal costs half a verify always run and keep their acceptance."""
    flat = VerifyLatency({0: {1: 1.0, 64: 1.0}})  # every tree size verifies in 1 s: no node is ever cut for its cost

    def costing(propose_cost, steps=None):
        def make(reference, i):
            return SpeculativeGenerator(model, OracleMTP(model, reference, p_top=1.0, seed=i),
                                        tree="dynamic:nodes=16,topk=3,depth=4", draft="heads",
                                        costs=Costs(latency=flat, propose_seconds=propose_cost))
        return make

    assert oracle_tau(model, costing(0.5), 3, seed=5) > 4.0
    heads = random_mtp(model)
    gen = SpeculativeGenerator(model, heads, draft="heads", costs=Costs(latency=flat, propose_seconds=100.0))
    for input_ids, max_new in random_prompts(3, model.config.vocab_size, seed=9):
        max_new += 24
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == greedy_reference(model, input_ids, max_new).tolist()
        assert out.stats.heads_skipped >= (out.stats.steps - 1) * 7 // 8 - 1, out.stats
    # free proposals: random heads keep proposing while they stay above min_yield
    gen = SpeculativeGenerator(model, heads, draft="heads", costs=Costs(latency=flat, propose_seconds=0.0))
    assert gen.generate(input_ids, max_new_tokens=8).stats.heads_skipped == 0


def test_mtp_hybrid_and_sampling_run(model):
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    expected = greedy_reference(model, ids, 24)
    gen = SpeculativeGenerator(model, random_mtp(model), draft="hybrid")
    assert gen.generate(ids, max_new_tokens=24).sequences.tolist() == expected.tolist()
    a = gen.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, seed=7).new_tokens
    b = gen.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, seed=7).new_tokens
    assert a == b and len(a) == 16


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "teeth"])
def test_mtp_sampling_second_token_follows_the_backbone(monkeypatch, broken):
    """Seeded sampling through MTP dynamic trees: the 2nd generated token's frequencies match the backbone's exact
    joint of the 2nd and 3rd tokens (chi-square, as test_sampling does for static trees), so the dynamic tree path
    is lossless too; a deliberately broken acceptance rule fails."""
    if broken:
        import tokenmaxx.inference.generator as generator_module
        from helpers import broken_accept  # noqa: I001

        monkeypatch.setattr(generator_module, "accept_sampling", broken_accept)
    model = tiny_model("llama", seed=21, vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked (top token ~0.5): a wrong rule's bias on rejected drafts shows
    model.generation_config.eos_token_id = None
    prefix = torch.tensor([3, 4, 5])
    # drafts = the greedy continuation (likely tokens, often rejected at temperature 1): where a wrong rule shows
    oracle = OracleMTP(model, greedy_reference(model, prefix[None], 8), p_top=1.0)
    gen = SpeculativeGenerator(model, oracle, tree="dynamic:nodes=8,topk=3,depth=3", draft="heads")
    warpers = build_warpers(GenerationConfig(do_sample=True, temperature=1.0))
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(prefix[None]).logits[0, -1], warpers)  # [V]
    exact = sum(p1[a] * exact_pair(model, torch.cat([prefix, torch.tensor([a])]), warpers) for a in range(vocab))
    counts = torch.zeros(vocab * vocab)
    for seed in range(1500):
        new = gen.generate(prefix, max_new_tokens=3, do_sample=True, temperature=1.0, seed=seed).new_tokens
        counts[new[1] * vocab + new[2]] += 1
    pvalue = chi2_pvalue(counts, exact.flatten())
    assert (pvalue < 1e-3) if broken else (pvalue > 1e-3), pvalue


def test_tree_kinds_must_match_head_kinds(model):
    with pytest.raises(ValueError, match="sequential heads"):
        SpeculativeGenerator(model, random_heads(model), tree="dynamic:16", draft="heads")
    with pytest.raises(ValueError, match="dynamic trees"):
        SpeculativeGenerator(model, random_mtp(model), tree="chain:3", draft="heads")
    with pytest.raises(ValueError, match="nodes"):
        SpeculativeGenerator(model, random_mtp(model), tree="dynamic:0", draft="heads")


@pytest.mark.parametrize("make", [random_mtp, random_eagle3], ids=["mtp", "eagle3"])
def test_prompt_context_sets_what_the_module_reads_of_the_prompt_in_drafting_and_training(make, tmp_path):
    from tokenmaxx.heads.config import lookback
    from tokenmaxx.heads.drafting import Prefill
    from tokenmaxx.training.batches import Example, SelfDistilledData, collate

    model = tiny_model("llama")
    heads = make(model)  # 3 depths: by default the module reads the prompt's last 4 positions
    ids = torch.randint(3, 96, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = backbone_features(model(ids[None], output_hidden_states=True).hidden_states, heads.feature_layers)[0]
    data = SelfDistilledData({0: Example(0, torch.cat([ids, ids[:6]]), 20)}, [0], [], {}, "x", 1, 0)
    for context, read in [(None, 4), (12, 12), (64, 20)]:
        heads.config.prompt_context = context
        drafter = heads.drafter(model)
        drafter.start(Prefill(input_ids=ids, hidden=hidden, root=7))
        assert drafter.length == read  # module cache entries after the prompt
        assert collate(data, [0], lookback(heads.config)).starts == [20 - read]  # the training window: the same
    heads.save_pretrained(tmp_path)
    assert load_heads(str(tmp_path)).config.prompt_context == 64
    assert_matches_greedy(SpeculativeGenerator(model, heads, draft="heads", costs=None), model, n=3, seed=4)
    with pytest.raises(ValueError, match=r"prompt_context must be None or an integer >= num_heads \+ 1 = 4"):
        HeadsConfig(kind="mtp", num_heads=3, hidden_size=32, vocab_size=96, prompt_context=3)
