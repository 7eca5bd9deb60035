"""Verification through the public forward: tree logits equal per-path forwards; commit leaves the plain cache."""

import os

import pytest
import torch
from helpers import prefilled, tiny_model, tree_draft

from tokenmaxx.inference import Accepted, Tree, accept_greedy, commit, verify
from tokenmaxx.heads.attention import (IMPLEMENTATION, SHARE_KV_HEADS, shared_kv_kwargs, shares_kv_heads,
                                      use_shared_kv_attention)
from tokenmaxx.inference.kv import GrowingKV
from tokenmaxx.inference.runner import Runner

TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])


def _prefill(model, prefix):
    return prefilled(model, prefix)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_per_path_forwards(arch, attn):
    model = tiny_model(arch, seed=7, attn=attn)
    prefix = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    buffers = TREE.buffers
    tokens = torch.randint(3, 96, (buffers.num_nodes,), generator=torch.Generator().manual_seed(1))
    kv = _prefill(model, prefix)
    with torch.no_grad():
        verified = verify(model, kv, [tree_draft(tokens, buffers)])
    assert kv.cache.get_seq_length() == prefix.shape[1] + buffers.num_nodes
    verified.logits, verified.hidden = verified.logits[0], verified.hidden[0]
    for path in buffers.retrieve.tolist():
        nodes = [n for n in path if n >= 0]
        seq = torch.cat([prefix[0], tokens[nodes]])[None]
        with torch.no_grad():
            out = model(seq, output_hidden_states=True)
        ref_logits = out.logits[0, prefix.shape[1]:]
        torch.testing.assert_close(verified.logits[nodes], ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(verified.hidden[nodes], out.hidden_states[-1][0, prefix.shape[1]:],
                                   atol=1e-5, rtol=1e-5)


def test_attention_bias_layout():
    """A node sees the live prefix, its ancestors and itself; a padding node (a row's tree smaller than the largest)
    only itself; a row's holes (entries past its end that a longer row wrote) nothing."""
    kv = GrowingKV(2)
    kv.live, kv.ends, kv.positions = torch.tensor([[True, True, True], [True, True, False]]), [3, 2], [3, 2]
    buffers = Tree([(0,), (1,)]).buffers
    tokens = torch.tensor([[5, 6, 7], [5, 6, 0]])
    depths = torch.stack([buffers.depths, torch.tensor([0, 1, 0])])
    tree = torch.stack([buffers.attn_mask, torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)])
    inputs = kv.tree_inputs(tokens, depths, tree, torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool), torch.float32)
    assert inputs["attention_mask"].shape == (2, 1, 3, 6) and inputs["attention_mask"].dtype == torch.float32
    allowed = (inputs["attention_mask"][:, 0] == 0).tolist()
    assert allowed[0] == [[True, True, True, True, False, False],
                          [True, True, True, True, True, False],
                          [True, True, True, True, False, True]]
    assert allowed[1] == [[True, True, False, True, False, False],
                          [True, True, False, True, True, False],
                          [False, False, False, False, False, True]]
    assert inputs["position_ids"].tolist() == [[3, 4, 4], [2, 3, 2]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_commit_leaves_the_cache_of_a_plain_forward(arch):
    model = tiny_model(arch, seed=8)
    prefix = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    buffers = TREE.buffers
    tokens = torch.randint(3, 96, (buffers.num_nodes,), generator=torch.Generator().manual_seed(3))
    for accepted_nodes in ([0], [0, 2], [0, 1, 5, 8], [0, 1, 4, 7], [0, 2, 6]):
        kv = _prefill(model, prefix)
        with torch.no_grad():
            verify(model, kv, [tree_draft(tokens, buffers)])
        nodes = torch.tensor(accepted_nodes)
        commit(kv, [Accepted(nodes=nodes, tokens=[])])
        assert kv.end == kv.cache.get_seq_length() == prefix.shape[1] + len(accepted_nodes)
        plain = _prefill(model, torch.cat([prefix[0], tokens[nodes]])[None]).cache
        for got, want in zip(kv.cache.layers, plain.layers):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_accept_greedy_on_hand_built_logits():
    buffers = TREE.buffers  # nodes: 0 root,1 (0,),2 (1,),3 (2,),4 (0,0),5 (0,1),6 (1,0),7 (0,0,0),8 (0,1,0)
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18])
    logits = torch.zeros(9, 32)

    def says(node, token):
        logits[node] = 0
        logits[node, token] = 1

    says(0, 11)  # root -> backbone wants 11 = node 1 (rank 0)
    says(1, 15)  # after node 1 it wants 15 = node 5 (the side branch (0, 1))
    says(5, 18)  # after node 5 it wants 18 = node 8
    says(8, 30)  # bonus
    acc, = accept_greedy([tree_draft(tokens, buffers)], logits[None])
    assert acc.nodes.tolist() == [0, 1, 5, 8] and acc.tokens == [11, 15, 18, 30]
    says(0, 31)  # nothing agrees: only the bonus token
    acc, = accept_greedy([tree_draft(tokens, buffers)], logits[None])
    assert acc.nodes.tolist() == [0] and acc.tokens == [31]
    # beside a row of another tree (padded to the larger), each row accepts as alone, in one read
    chain = Tree([(0,), (0, 0)]).buffers
    other = torch.zeros(9, 32)
    other[0, 21], other[1, 22], other[2, 5] = 1, 1, 1
    rows = accept_greedy([tree_draft(tokens, buffers), tree_draft(torch.tensor([20, 21, 22]), chain)],
                         torch.stack([logits, other]))
    assert [r.tokens for r in rows] == [[31], [21, 22, 5]] and rows[1].path == [0, 1, 2]


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_lets_sdpa_group_the_kv_heads_with_the_same_logits(arch, monkeypatch):
    """On CPU a tree forward that asks for it (the forward keyword from ``shared_kv_kwargs``, once the backbone is on
    "tokenmaxx_sdpa": ``use_shared_kv_attention``) hands SDPA the shared
    key/value heads (enable_gqa) instead of transformers' per-layer copies of them; the logits are the same bit for
    bit. Forwards that do not ask, on the same model, run transformers' own SDPA path, and no environment variable is
    touched (the switch travels with the call)."""
    model = tiny_model(arch, seed=7)  # 4 query heads share 2 key/value heads
    prefix = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, 96, (TREE.buffers.num_nodes,), generator=torch.Generator().manual_seed(1))
    sdpa, grouped = torch.nn.functional.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    environment = dict(os.environ)
    with torch.no_grad():
        plain = verify(model, _prefill(model, prefix), [tree_draft(tokens, TREE.buffers)])
        assert grouped[-2:] == [False, False]  # transformers' SDPA: repeated key/value heads
        assert shared_kv_kwargs(model) == {}  # transformers' "sdpa": nothing to ask for, and nothing changed
        assert model.config._attn_implementation == "sdpa"
        assert use_shared_kv_attention(model) and model.config._attn_implementation == IMPLEMENTATION
        attention = shared_kv_kwargs(model)
        assert attention == {SHARE_KV_HEADS: True}
        fast = verify(model, _prefill(model, prefix), [tree_draft(tokens, TREE.buffers)], Runner(attention=attention))
        assert grouped[-2:] == [True, True]  # both layers of the tree forward
        again = verify(model, _prefill(model, prefix), [tree_draft(tokens, TREE.buffers)])  # not asked
        assert grouped[-2:] == [False, False]
    assert dict(os.environ) == environment
    assert torch.equal(fast.logits, plain.logits) and torch.equal(fast.hidden, plain.hidden)
    assert torch.equal(again.logits, plain.logits)


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
def test_kv_head_sharing_only_where_it_fits():
    """The switch is used for grouped-query models on CPU whose keys and values share one head size (<= 256)."""
    assert shares_kv_heads(tiny_model("llama")) and shares_kv_heads(tiny_model("qwen2"))
    assert not shares_kv_heads(tiny_model("llama", num_key_value_heads=4))  # one key/value head per query head
    assert not shares_kv_heads(tiny_model("llama", head_dim=512, hidden_size=64))  # beyond SDPA's GQA head sizes
    model = tiny_model("llama")
    model.config.v_head_dim = 4  # keys and values of different sizes (MLA-style)
    assert not shares_kv_heads(model)


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_backbone_moved_onto_the_shared_kv_attention_generates_as_before(arch):
    """``load_backbone`` moves an SDPA backbone onto "tokenmaxx_sdpa"; everything else the user runs on it is unchanged:
    transformers' greedy generate and its prompt-lookup generation (multi-token forwards over a cache, whose causal
    mask transformers builds for the implementation) give the same tokens before and after."""
    model = tiny_model(arch, seed=5)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 9, 3, 4, 5]])

    def runs():
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        return [model.generate(ids, **kwargs).tolist(), model.generate(ids, prompt_lookup_num_tokens=4, **kwargs).tolist()]

    before = runs()
    assert use_shared_kv_attention(model) and model.config._attn_implementation == IMPLEMENTATION
    assert runs() == before and before[0] == before[1]
