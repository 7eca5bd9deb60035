"""The EAGLE-3 export against what vLLM's and SGLang's loaders read, and back into tokenmaxx with identical drafts.

No serving engine runs on these machines (they need GPUs), so the loaders' rules are written out here from their
source at pinned commits and applied to the export: every tensor must land on a parameter of the engine's draft model
with that parameter's shape, every parameter the engine needs must be filled (vLLM at this commit does not report a
missing one itself: its load_weights returns nothing, so the loader's own check never runs), and the config keys the
engines read must be there with usable values.
"""

import json
import os
import stat

import pytest
import torch
from helpers import random_eagle3, random_mtp, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import DynamicTreeConfig, Eagle3Heads, export_eagle3, load_backbone, load_eagle3
from tokenmaxx.heads.io.eagle3_export import ExportError
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.heads.io.speculators_export import SPECULATORS_VERSION, export_speculators
from tokenmaxx.scripts import export_heads

# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at this commit (>= v0.16 development, 2026):
# Eagle3LlamaForCausalLM.load_weights / LlamaModel.load_weights / the modules' parameters.
VLLM_COMMIT = "00bd1493b3e82d6c13c68ee8a0e1c5a96707e190"
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py at this commit: LlamaForCausalLMEagle3.load_weights.
SGLANG_COMMIT = "03d5a7771f6082e7737a5f19cae7d1e863087013"
STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


def vllm_parameters(cfg: dict) -> dict[str, tuple]:
    """The draft model's parameters in vLLM (name -> shape), from the config as vLLM builds the modules."""
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, inter = cfg.get("head_dim") or hidden // heads, cfg["intermediate_size"]
    fc_in = cfg.get("target_hidden_size", hidden) * 3
    layer = "model.layers.0."
    return {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.fc.weight": (hidden, fc_in),
            layer + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, 2 * hidden),
            layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            layer + "mlp.gate_up_proj.weight": (2 * inter, hidden), layer + "mlp.down_proj.weight": (hidden, inter),
            layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
            layer + "hidden_norm.weight": (hidden,), "model.norm.weight": (hidden,),
            "lm_head.weight": (cfg["draft_vocab_size"], hidden), "draft_id_to_target_id": (cfg["draft_vocab_size"],)}


def vllm_load(state: dict, cfg: dict) -> dict[str, tuple]:
    """vLLM's renaming of the checkpoint's tensors (t2d skipped, d2t -> draft_id_to_target_id, "model." before all
    but lm_head, "midlayer." -> "layers.0.", q/k/v and gate/up stacked into shards); returns parameter -> the shape
    the loaded shards fill, raising KeyError on a tensor with no parameter (as vLLM's params_dict[name] does)."""
    params, filled = vllm_parameters(cfg), {}
    for name, tensor in state.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for param, shard, _ in STACKED:
            if shard in name:
                name = name.replace(shard, param)
                rows = filled.get(name, (0,) + tuple(tensor.shape[1:]))
                filled[name] = (rows[0] + tensor.shape[0],) + tuple(tensor.shape[1:])
                break
        else:
            filled[name] = tuple(tensor.shape)
        if name not in params:
            raise KeyError(f"vLLM has no parameter {name}")
    return filled


def sglang_load(state: dict) -> set[str]:
    """SGLang's mapping: d2t -> hot_token_id, t2d skipped, a name not found gets "model." (unknown ones are silently
    dropped, so the test checks that everything was used)."""
    used = set()
    for name in state:
        if name in ("d2t", "t2d"):
            used.add(name)
            continue
        for param, shard, _ in STACKED:
            name = name.replace(shard, param)
        used.add(name if name == "lm_head.weight" else f"model.{name}")
    return used


def _export(tmp_path, vocab=range(3, 70), dtype="float32"):
    model = tiny_model("llama", num_hidden_layers=8)  # deep enough for EAGLE-3's default layers (2, 4, 5)
    heads = Eagle3Heads.for_backbone(model, num_heads=3)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    if vocab is not None:
        heads.set_draft_vocab(vocab)
    return model, heads.eval(), export_eagle3(heads, model, tmp_path / "export", dtype=dtype)


def _read(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    return state, json.loads((folder / "config.json").read_text())


def test_the_export_fills_every_parameter_vllm_and_sglang_load(tmp_path):
    model, heads, out = _export(tmp_path)
    state, cfg = _read(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    filled = vllm_load(state, cfg)
    params = vllm_parameters(cfg)
    assert set(params) - set(filled) == {"model.embed_tokens.weight"}  # shared from the target, by design
    assert all(filled[name] == params[name] for name in filled), {n: (filled[n], params[n]) for n in filled}
    assert sglang_load(state) == {"d2t", "t2d", "lm_head.weight", "model.fc.weight", "model.norm.weight",
                                  *(f"model.midlayer.{n}" for n in (
                                      "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                                      "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_up_proj.weight", "mlp.down_proj.weight"))}
    # the vocabulary map: target id = draft id + d2t (vLLM draft_id_to_target_id, SGLang hot_token_id, EAGLE)
    d2t, t2d = state["d2t"], state["t2d"]
    ids = torch.arange(d2t.numel()) + d2t
    assert d2t.dtype == torch.int64 and torch.equal(ids, torch.arange(3, 70))
    assert t2d.dtype == torch.bool and t2d.shape == (96,) and int(t2d.sum()) == 67 and bool(t2d[ids].all())
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight[ids])


def test_the_config_has_what_the_engines_read(tmp_path):
    model, heads, out = _export(tmp_path)
    _, cfg = _read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang's class; vLLM keeps names ending in Eagle3
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["draft_vocab_size"]) == \
        ("llama", 1, 96, 67)
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False  # SGLang ties if true
    assert cfg["max_position_embeddings"] == model.config.max_position_embeddings  # drafts the whole context
    assert cfg["rope_theta"] == model.config.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "hidden_act", "rms_norm_eps")} == \
        {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": model.config.rms_norm_eps}
    # even the default layers (2, L//2, L-3) are written, in both conventions: no loader has to guess them
    layers = list(heads.feature_layers)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == layers == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["target_hidden_size"] == 32 and cfg["dtype"] == cfg["torch_dtype"] == "float32"


def test_every_field_a_loader_reads_survives_a_transformers_5_read(tmp_path):
    """The export's config read back as the engines read it under transformers 5 (``AutoConfig``), and as the raw
    JSON that older loaders and transformers 4 keep as attributes: each field named with the loader that reads it."""
    from transformers import AutoConfig

    model, heads, out = _export(tmp_path)
    raw = json.loads((out / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(out)
    theta = model.config.rope_parameters["rope_theta"]
    read = {  # loader: field -> (value as read, expected)
        "vLLM llama_eagle3: draft_vocab_size": (loaded.draft_vocab_size, 67),
        "vLLM llama_eagle3: target_hidden_size": (loaded.target_hidden_size, 32),
        "vLLM llama_eagle3: eagle_aux_hidden_state_layer_ids": (loaded.eagle_aux_hidden_state_layer_ids, [2, 4, 5]),
        "vLLM llama_eagle3: norm_before_residual": (loaded.norm_before_residual, False),
        "vLLM (transformers 5): rope_parameters.rope_theta": (loaded.rope_parameters["rope_theta"], theta),
        "vLLM / transformers 5: dtype": (loaded.dtype, torch.float32),
        "SGLang: eagle_config.eagle_aux_hidden_state_layer_ids": (
            loaded.eagle_config["eagle_aux_hidden_state_layer_ids"], [1, 3, 4]),
        "SGLang / transformers 4: rope_theta (top level)": (raw["rope_theta"], theta),
        "SGLang / transformers 4: torch_dtype": (raw["torch_dtype"], "float32"),
        "both: tie_word_embeddings": (loaded.tie_word_embeddings, False),
        "both: vocab_size": (loaded.vocab_size, 96),
    }
    wrong = {field: got for field, (got, want) in read.items() if got != want}
    assert not wrong, wrong
    # what the export cannot fix: transformers 5 keeps theta only in rope_parameters, so a loader that reads
    # getattr(config, "rope_theta", 10000) (SGLang's Llama code) falls back there; the README says so
    assert getattr(loaded, "rope_theta", "absent") == "absent"


def test_other_feature_layers_are_written_in_both_engines_conventions(tmp_path):
    model = tiny_model("llama")
    heads = random_eagle3(model)  # layers (0, 1, 2): not the default
    _, cfg = _read(export_eagle3(heads, model, tmp_path / "e"))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # vLLM: the input of layer i
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 0, 1], "use_aux_hidden_state": True}


@pytest.mark.parametrize("vocab", [range(3, 70), None], ids=["draft_vocab", "full_vocab"])
def test_the_export_imports_back_with_identical_drafts(tmp_path, vocab):
    model, heads, out = _export(tmp_path, vocab=vocab)
    back = load_eagle3(out, model)
    assert back.state_dict().keys() == heads.state_dict().keys()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in heads.state_dict().items())
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 10, 11]])
    runs = []
    for h in (heads, back):
        gen = SpeculativeGenerator(model, h, draft="heads")
        drafter = gen.make_drafter()
        out_ = gen.generate(prompt, max_new_tokens=20)
        runs.append((out_.new_tokens, out_.stats.accepted_hist, drafter.feature_layers))
    assert runs[0] == runs[1] and runs[0][2] == (2, 4, 5)


@pytest.mark.slow
def test_heads_with_their_own_serving_tree_export_and_import_back_with_it(tmp_path):
    """Trained heads carry the dynamic tree they were exported with (train_heads --dynamic_tree, as the shipped ones
    do): the export keeps it in its tokenmaxx block and the import drafts with it again."""
    model = tiny_model("llama", num_hidden_layers=8)
    heads = Eagle3Heads.for_backbone(model, num_heads=3)
    heads.config.dynamic_tree = DynamicTreeConfig(nodes=6, topk=3, min_mass=0.25)
    out = export_eagle3(heads, model, tmp_path / "export")
    assert _read(out)[1]["tokenmaxx"]["dynamic_tree"] == {"nodes": 6, "topk": 3, "depth": None, "min_mass": 0.25}
    back = load_eagle3(out, model)
    assert back.config.dynamic_tree == DynamicTreeConfig(nodes=6, topk=3, min_mass=0.25)
    assert back.drafter(model).config == DynamicTreeConfig(nodes=6, topk=3, min_mass=0.25)


def test_the_export_has_the_usual_file_permissions(tmp_path):
    """A serving engine often runs as another user: the export is readable as any folder written under the umask."""
    mask = os.umask(0o022)
    try:
        _, _, out = _export(tmp_path)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == \
        {"config.json": 0o644, "model.safetensors": 0o644}


def test_bad_exports_and_imports_are_refused(tmp_path):
    model, heads, out = _export(tmp_path)
    with pytest.raises(ExportError, match="exists and is not an empty folder"):
        export_eagle3(heads, model, out)
    assert export_eagle3(heads, model, out, overwrite=True) == out
    mtp_model = tiny_model("llama")
    with pytest.raises(ExportError, match="only eagle3 heads export to the eagle3 format; these are 'mtp' heads"):
        export_eagle3(random_mtp(mtp_model), mtp_model, tmp_path / "mtp")
    assert not (tmp_path / "mtp").exists()
    state, cfg = _read(out)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match="expected architectures"):
        load_eagle3(bad, model)
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file({**state, "lm_head.weight": state["lm_head.weight"] * 2}, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match="a separately trained one cannot be imported"):
        load_eagle3(bad, model)
    save_file({k: v for k, v in state.items() if k != "norm.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match=r"\['norm.weight'\] are missing or unexpected"):
        load_eagle3(bad, model)


def test_the_export_command(tmp_path, capsys):
    path = tmp_path / "backbone"
    tiny_model("llama", num_hidden_layers=8).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model, _ = load_backbone(str(path), device="cpu")
    heads = Eagle3Heads.for_backbone(model, num_heads=2)
    heads.save_pretrained(tmp_path / "heads")
    assert export_heads.main(["--heads", str(tmp_path / "heads"), "--output_dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.splitlines()
    printed = printed[next(i for i, line in enumerate(printed) if line.startswith("wrote")):]  # (after any library's)
    assert printed[0].startswith(f"wrote eagle3 checkpoint {tmp_path / 'out'} (bfloat16): ")
    # what a user needs to serve it: the backbone folder, and each engine's command for this export
    assert printed[1] == f"backbone to serve (the weights the heads were trained on): {path}"
    config = json.dumps({"method": "eagle3", "model": str(tmp_path / "out"), "num_speculative_tokens": 2})
    assert printed[2] == f"serve with vLLM: vllm serve {path} --speculative-config '{config}'"
    assert printed[3].startswith(f"serve with SGLang: python -m sglang.launch_server --model-path {path} "
                                 "--speculative-algorithm EAGLE3 --speculative-draft-model-path "
                                 f"{tmp_path / 'out'} --speculative-num-steps 2 --speculative-eagle-topk ")
    assert printed[4].startswith(f"convert for speculators: speculators convert {tmp_path / 'out'} --algorithm eagle3 "
                                 f"--verifier {path} --algorithm-kwargs "
                                 "'{\"eagle_aux_hidden_state_layer_ids\": [2, 4, 5], \"norm_before_residual\": false}'")
    state, cfg = _read(tmp_path / "out")
    assert cfg["torch_dtype"] == "bfloat16" and state["fc.weight"].dtype == torch.bfloat16
    argv = ["--heads", str(tmp_path / "heads"), "--output_dir", str(tmp_path / "spec"), "--format", "speculators"]
    assert export_heads.main(argv + ["--verifier", "org/backbone"]) == 0
    printed = capsys.readouterr().out.splitlines()
    printed = printed[next(i for i, line in enumerate(printed) if line.startswith("wrote")):]
    assert printed[1:] == ["verifier named in it: org/backbone", f"serve with vLLM: vllm serve {tmp_path / 'spec'}",
                           f"load with speculators: SpeculatorModel.from_pretrained('{tmp_path / 'spec'}')"]
    assert _read(tmp_path / "spec")[1]["speculators_config"]["verifier"]["name_or_path"] == "org/backbone"
    with pytest.raises(ValueError, match="--verifier names the backbone inside a --format speculators export"):
        export_heads.main(["--heads", str(tmp_path / "heads"), "--output_dir", str(tmp_path / "o3"), "--verifier", "x"])
    with pytest.raises(ValueError, match="unknown --format 'gguf'"):
        export_heads.main(["--heads", str(tmp_path / "heads"), "--output_dir", str(tmp_path / "o2"),
                           "--format", "gguf"])


def test_a_large_vocabulary_without_a_draft_vocabulary_gets_one_note_with_the_size(tmp_path, capsys):
    """A backbone of more than 65,536 tokens and heads drafting over all of them (a 151,936-token backbone: a 310 MB
    draft): one note on stderr with the size about to be written and --draft_vocab_size; none with a draft
    vocabulary. The default dtype, auto, is bfloat16: what serving engines run the draft in."""
    path = tmp_path / "backbone"
    tiny_model("llama", num_hidden_layers=8, vocab_size=70000).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model, _ = load_backbone(str(path), device="cpu")
    heads = Eagle3Heads.for_backbone(model, num_heads=2)
    heads.save_pretrained(tmp_path / "heads")
    capsys.readouterr()
    assert export_heads.main(["--heads", str(tmp_path / "heads"), "--output_dir", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "whole 70,000-token vocabulary" in notes[0] and "--draft_vocab_size" in notes[0], notes
    written = (tmp_path / "out" / "model.safetensors").stat().st_size / 1e6
    assert f"about {written:,.0f} MB" in notes[0], (notes, written)
    assert "(bfloat16)" in captured.out and _read(tmp_path / "out")[1]["torch_dtype"] == "bfloat16"
    heads.set_draft_vocab(range(3, 500))
    heads.save_pretrained(tmp_path / "small")
    assert export_heads.main(["--heads", str(tmp_path / "small"), "--output_dir", str(tmp_path / "o2")]) == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("vocab", [range(3, 70), None], ids=["draft_vocab", "full_vocab"])
def test_the_speculators_export_has_the_layout_speculators_and_vllm_read(tmp_path, vocab):
    """What ``speculators`` (Eagle3SpeculatorConfig, Eagle3DraftModel) and vLLM's speculators adapter read; run
    against speculators itself in tests/test_interop.py."""
    model, heads, _ = _export(tmp_path, vocab=vocab)
    state, cfg = _read(export_speculators(heads, model, tmp_path / "spec", verifier="org/backbone"))
    assert "model_type" not in cfg  # vLLM recognises the layout by its absence and speculators_config
    assert (cfg["speculators_model_type"], cfg["speculators_version"]) == ("eagle3", SPECULATORS_VERSION)
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "org/backbone", "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["head_dim"]) == \
        ("llama", 1, 96, 8)
    assert layer["rope_parameters"]["rope_theta"] == layer["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["norm_before_residual"] is False
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (67 if vocab else 96, 32)
    layers = {k.removeprefix("layers.0.") for k in state if k.startswith("layers.0.")}
    assert layers == {k.removeprefix("midlayer.") for k in heads.state_dict() if k.startswith("midlayer.")}
    assert not any(k.startswith("midlayer.") for k in state)
    assert torch.equal(state["embed_tokens.weight"], model.get_input_embeddings().weight.to(torch.bfloat16))
    assert ("t2d" in state) == (vocab is not None)  # no draft vocabulary: nothing to map
    assert state["lm_head.weight"].shape == (67 if vocab else 96, 32) and state["d2t"].dtype == torch.int64
    with pytest.raises(ExportError, match="exists and is not an empty folder"):  # refused before anything is written
        export_speculators(heads, model, tmp_path / "spec", verifier="org/backbone")
    with pytest.raises(ExportError, match="only eagle3 heads export to the speculators format; these are 'mtp'"):
        export_speculators(random_mtp(model), model, tmp_path / "mtp", verifier="org/backbone")
    assert not (tmp_path / "mtp").exists()
