"""EAGLE-3 heads: the checkpoint layout, one pass against a plain-torch reference of the EAGLE-3 forward (as vLLM and
SGLang compute it), greedy identity with random heads on tiny Llama / Qwen2, training and save/load."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_greedy, random_eagle3, tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tokenmaxx.heads import BackboneMismatchError, Eagle3Heads, HeadsConfig, load_heads
from tokenmaxx.heads.eagle3 import default_feature_layers
from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.training.features import backbone_hidden
from tokenmaxx.training.losses import HeadsObjective, shifted_targets, teacher_rows


def test_the_weights_have_the_eagle3_names_and_shapes():
    model = tiny_model("qwen2")  # a Qwen2 backbone still gets a Llama draft layer, without biases (as EAGLE-3's)
    heads = random_eagle3(model)
    hidden, heads_n, kv, head_dim, inter = 32, 4, 2, 8, 64
    assert {k: tuple(v.shape) for k, v in heads.state_dict().items()} == {
        "fc.weight": (hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (heads_n * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads_n * head_dim),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,)}


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_pass(heads, features, tokens, embed, positions):
    """EAGLE-3's draft forward written out (vLLM llama_eagle3.py: embeds first, residual = the un-normed state):
    features [T, 3H], tokens [T], positions [T] -> the layer's output [T, H], causal over the T queries."""
    sd = {k: v.float() for k, v in heads.state_dict().items()}
    cfg = heads.layer_config
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    h = features @ sd["fc.weight"].T  # [T, H]
    x = torch.cat([_rms(embed(tokens), sd["midlayer.input_layernorm.weight"], eps),
                   _rms(h, sd["midlayer.hidden_norm.weight"], eps)], dim=-1)  # [T, 2H]
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(-1, nh, hd).transpose(0, 1)[None]  # [1, nh, T, hd]
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)[None]
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(-1, nkv, hd).transpose(0, 1)[None]
    cos, sin = heads.rotary(h[None], positions[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(len(tokens), -1)
    h = h + attn @ sd["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, sd["midlayer.post_attention_layernorm.weight"], eps)
    m = (F.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (m @ sd["midlayer.mlp.up_proj.weight"].T))
    return h + m @ sd["midlayer.mlp.down_proj.weight"].T


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_pass_is_the_eagle3_forward(arch):
    model = tiny_model(arch)
    heads = random_eagle3(model, seed=2)
    embed = model.get_input_embeddings()
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        features = backbone_features(model(ids, output_hidden_states=True).hidden_states, heads.feature_layers)
        positions = torch.arange(9)
        got = heads.step(heads.lift(features), ids, embed, positions[None], None)[0]  # None: causal
        expected = _reference_pass(heads, features[0], ids[0], embed, positions)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, heads.lift(features)[0], atol=1e-3)  # the layer did something


@pytest.mark.parametrize("draft", ["heads", "hybrid"])
@pytest.mark.parametrize("tree", [None, "dynamic:nodes=12,topk=3,depth=3"])
def test_random_eagle3_heads_match_greedy(model, draft, tree):
    heads = random_eagle3(model, seed=5)
    assert_matches_greedy(SpeculativeGenerator(model, heads, tree=tree, draft=draft), model, 6, seed=3)


def test_default_feature_layers_and_bad_configs():
    assert default_feature_layers(30) == [2, 15, 27]  # SmolLM2-135M: inputs of layers 2, 15 and 27
    with pytest.raises(ValueError, match="too shallow"):
        default_feature_layers(4)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="too shallow"):
        Eagle3Heads.for_backbone(model)  # 2 layers: the caller must choose
    heads = random_eagle3(model)
    with pytest.raises(ValueError, match="one decoder layer"):
        HeadsConfig.from_dict({**heads.config.to_dict(), "num_layers": 2})
    with pytest.raises(ValueError, match="feature_layers must list them"):
        HeadsConfig.from_dict({**heads.config.to_dict(), "feature_layers": None})
    with pytest.raises(ValueError, match="distinct hidden-state indices"):
        HeadsConfig.from_dict({**heads.config.to_dict(), "feature_layers": [1, 1, 2]})
    deep = random_eagle3(model, feature_layers=(0, 1, 5))
    with pytest.raises(BackboneMismatchError, match=r"hidden states \[0, 1, 5\], but the backbone has 2 layers"):
        deep.check_backbone(model)


@pytest.mark.parametrize("loss", ["kl", "ce+kl"])
def test_kl_reads_the_backbones_own_distribution_from_the_final_state_appended_to_the_features(loss):
    """EAGLE-3 heads read earlier hidden states, so the KL teacher's final-normed state comes after them in the
    features: the teacher is the backbone's own next-token distribution and the heads see exactly what they read."""
    model = tiny_model("llama")
    heads = random_eagle3(model)
    final = model.config.num_hidden_layers
    objective, plain = HeadsObjective(heads, loss=loss), HeadsObjective(heads, loss="ce")
    assert objective.feature_layers(final) == [0, 1, 2, final] and plain.feature_layers(final) == [0, 1, 2]
    ids = torch.randint(3, 96, (2, 10))
    starts, lengths = torch.tensor([4, 6]), torch.tensor([10, 8])
    features = torch.nn.utils.rnn.pad_sequence(backbone_hidden(model, list(ids), objective.feature_layers(final)),
                                               batch_first=True)  # [B, T, 4H]
    sel = objective.select(features, ids, starts, lengths, model.lm_head)
    _, valid = shifted_targets(ids, starts, lengths, heads.config.num_heads)
    need, _ = teacher_rows(valid)
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[need].float(), dim=-1)
    torch.testing.assert_close(sel.teacher, expected, rtol=1e-4, atol=1e-5)
    size = heads.config.hidden_size
    torch.testing.assert_close(objective.head_states(features, ids, sel.selected, model.get_input_embeddings()),
                               plain.head_states(features[..., :-size], ids, sel.selected,
                                                 model.get_input_embeddings()))
    loss_value, stats = objective(features, ids, starts, lengths, model.lm_head, model.get_input_embeddings())
    assert loss_value > 0 and (stats[1] > 0).all()  # a KL term on every depth


def test_save_load_round_trip(tmp_path):
    model = tiny_model("llama")
    heads = random_eagle3(model, seed=7)
    heads.set_draft_vocab(range(3, 60))
    heads.save_pretrained(tmp_path / "e3")
    loaded = load_heads(tmp_path / "e3")
    assert isinstance(loaded, Eagle3Heads) and loaded.feature_layers == (0, 1, 2)
    assert heads.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, loaded.state_dict()[k]) for k, a in heads.state_dict().items())


def test_training_step_learns(model):
    """CE through the frozen lm_head over the unrolled depths: a few optimizer steps lower the loss."""
    heads = random_eagle3(model, seed=1).train().requires_grad_(True)
    objective = HeadsObjective(heads, loss="ce")
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = backbone_features(model(ids, output_hidden_states=True).hidden_states, heads.feature_layers)
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss, stats = objective(features, ids, torch.tensor([2, 2]), torch.tensor([16, 16]),
                                lm_head=model.get_output_embeddings(), embed=model.get_input_embeddings())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert stats.shape == (4, 3) and losses[-1] < 0.8 * losses[0]


@pytest.mark.slow
def test_auto_budget_calibrates_eagle3_heads_on_their_feature_layers(tmp_path, monkeypatch):
    """tree='auto' calibrates along the backbone's continuations with the states the heads read (three layers for
    EAGLE-3, not the final state alone: that once failed with a shape error), then generates greedy-identically."""
    from tiny_tokenizer import tiny_tokenizer

    from tokenmaxx.inference.measure import autotune

    model, tok = tiny_model("llama", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.",))
    heads = random_eagle3(model, seed=4)
    seen = []
    start = heads.drafter(model).__class__.start
    monkeypatch.setattr(type(heads.drafter(model)), "start",
                        lambda self, prefill: (seen.append(prefill.hidden.shape[-1]), start(self, prefill))[1])
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto", draft="heads")
    assert seen and set(seen) == {3 * model.config.hidden_size}
    assert gen.tree_settings.nodes in autotune.DYNAMIC_BUDGETS
    cached = sorted(f.name.rsplit("-", 1)[0] for f in (tmp_path / "calibration").glob("*.json") if "-" in f.name)
    # what heads-only trees are sized by: verify latency, proposing time (one row's, several rows' together); and how
    # verifies multiply a few rows
    assert cached == ["latency", "propose", "propose-rows", "small-rows"]
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 5  # and the tree='auto' record
    assert_matches_greedy(gen, model, 4, seed=8)
