"""EAGLE-3 checkpoints that serving engines load: export tokenmaxx's eagle3 heads, and read such a checkpoint back.

The layout is the one vLLM (``vllm/model_executor/models/llama_eagle3.py``, ``--speculative-config
'{"method": "eagle3", "model": DIR, "num_speculative_tokens": N}'``) and SGLang (``--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR``) read, checked in ``tests/test_eagle3_export.py`` against the names, shapes and
config keys of vLLM's loader at a pinned commit. Files::

    config.json         a one-layer Llama config: architectures ["LlamaForCausalLMEagle3"], the draft's sizes,
                        vocab_size (the backbone's V), draft_vocab_size (Vd), target_hidden_size,
                        tie_word_embeddings false, norm_before_residual false, the rope settings the draft was trained
                        with (rope_theta and rope_parameters), dtype and torch_dtype, the aux-layer ids in both
                        engines' conventions (always: a loader's default is right only for the default layers);
                        "tokenmaxx": what a round trip needs
    model.safetensors   fc.weight [H, 3H], midlayer.* (q/k/v read 2H), norm.weight, lm_head.weight [Vd, H] (the
                        backbone's lm_head rows at the draft vocabulary: the heads predict through it), d2t [Vd] int64
                        (target id = draft id + d2t[draft id]), t2d [V] bool. No embed_tokens: the engines share the
                        target's embedding (the draft was trained with it, frozen).

The draft vocabulary is the heads' frequency-ranked one, sorted by token id (EAGLE-3's d2t convention); heads without
one export the whole vocabulary (d2t all zero). At generation tokenmaxx also drafts the prompt's own tokens; a static
export cannot, so an engine drafts over the frequent tokens alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import CONFIG_NAME, WEIGHTS_NAME
from ..eagle3 import Eagle3Heads, default_feature_layers
from ..modeling import _umask

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "initializer_range")


class ExportError(ValueError):
    """The heads cannot be written in the asked format, or a folder is not a checkpoint of it."""


def rope_fields(layer_config) -> dict:
    """Rope keys in both spellings: ``rope_theta`` / ``rope_scaling`` (what vLLM and SGLang read) and transformers 5's
    ``rope_parameters``."""
    params = dict(getattr(layer_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(layer_config, "rope_theta", 10000.0))
    scaling = None if params.get("rope_type", "default") == "default" else \
        {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": float(theta), "rope_scaling": scaling,
            "rope_parameters": {**params, "rope_theta": float(theta)} if params else None}


def eagle3_config(heads: Eagle3Heads, dtype: str) -> dict:
    """config.json of the export: the draft layer's Llama config, the vocabularies, the fused layers in every engine's
    convention, ``dtype`` in both spellings (``torch_dtype`` is what transformers 4 and older loaders read), the rope
    settings in both spellings, and what a round trip to tokenmaxx needs."""
    cfg, hc = heads.layer_config, heads.config
    vocab = heads.draft_vocab
    out = {"architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
           **{k: getattr(cfg, k) for k in LAYER_KEYS},
           "vocab_size": hc.vocab_size, "draft_vocab_size": hc.vocab_size if vocab is None else int(vocab.numel()),
           "target_hidden_size": cfg.hidden_size,  # the backbone's (the draft layer's is the same size)
           "tie_word_embeddings": False, "norm_before_residual": False, "attention_bias": False, "mlp_bias": False,
           "dtype": dtype, "torch_dtype": dtype,
           **{k: v for k, v in rope_fields(cfg).items() if v is not None or k == "rope_scaling"}}
    layers = list(heads.feature_layers)
    # the fused layers in each engine's convention, always (a loader that falls back to its own default when they are
    # absent would be right only for the default layers): vLLM and speculators, the input of layer i (HF
    # hidden_states[i]); SGLang, the output of layer i (it adds one)
    out["eagle_aux_hidden_state_layer_ids"] = layers
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True}
    out["tokenmaxx"] = {"num_heads": hc.num_heads, "feature_layers": layers, "backbone": hc.backbone,
                        "backbone_revision": hc.backbone_revision,
                        "dynamic_tree": None if hc.dynamic_tree is None else dataclasses.asdict(hc.dynamic_tree)}
    return out


def export_eagle3(heads: Eagle3Heads, model, output_dir: str | os.PathLike, dtype: str = "bfloat16",
                  overwrite: bool = False) -> Path:
    """Write ``heads`` (attached to backbone ``model``) as an EAGLE-3 checkpoint into ``output_dir``; returns it.

    The folder is written under a temp name and renamed, so a failed export leaves nothing half-written. An existing
    non-empty ``output_dir`` is refused unless ``overwrite``.
    """
    check_export(heads, model, output_dir, dtype, overwrite, "eagle3")
    return write_checkpoint(output_dir, draft_tensors(heads, model, dtype), eagle3_config(heads, dtype))


def check_export(heads, model, output_dir: str | os.PathLike, dtype: str, overwrite: bool, format_name: str) -> None:
    """ExportError, before anything is written, for heads that are not EAGLE-3 heads of ``model``, a dtype no engine
    loads, or an existing non-empty ``output_dir`` without ``overwrite``."""
    if not isinstance(heads, Eagle3Heads):
        raise ExportError(f"only eagle3 heads export to the {format_name} format; these are {heads.config.kind!r} "
                          "heads (train --kind eagle3)")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ExportError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    heads.check_backbone(model)
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ExportError(f"{out} exists and is not an empty folder; pass overwrite=True (--overwrite) to replace it")


def draft_tensors(heads: Eagle3Heads, model, dtype: str) -> dict[str, torch.Tensor]:
    """The draft's tensors in the engines' names, on the CPU in ``dtype``: the heads' own (``fc``, ``midlayer.*``,
    ``norm``), ``lm_head.weight`` [Vd, H] (the backbone's rows at the draft vocabulary, sorted by id), ``d2t`` [Vd]
    int64 (target id = draft id + d2t[draft id]) and ``t2d`` [V] bool."""
    torch_dtype = getattr(torch, dtype)
    weight = model.get_output_embeddings().weight
    ids = heads.draft_vocab if heads.draft_vocab is not None else torch.arange(heads.config.vocab_size)
    ids = ids.to(weight.device).sort().values  # [Vd] ascending target ids
    state = {k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in heads.state_dict().items()
             if k != "draft_vocab"}
    state["lm_head.weight"] = weight.detach()[ids].to("cpu", torch_dtype).contiguous()  # [Vd, H]
    ids = ids.cpu()
    state["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)  # [Vd]
    t2d = torch.zeros(heads.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d  # [V]
    return state


def write_checkpoint(output_dir: str | os.PathLike, state: dict[str, torch.Tensor], config: dict) -> Path:
    """``config.json`` and ``model.safetensors`` written under a temp name, then renamed into ``output_dir``
    (replacing it): a failed export leaves nothing half-written. Readable by other users
    as the umask allows (an engine may run as another user)."""
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        mask = _umask()  # mkdtemp makes a 0700 folder: an engine running as another user could not read the export
        for path in tmp.iterdir():
            os.chmod(path, 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_eagle3(folder: str | os.PathLike, model) -> Eagle3Heads:
    """tokenmaxx eagle3 heads from an EAGLE-3 checkpoint folder (an export, or a checkpoint in the same layout) for
    backbone ``model``. The checkpoint's lm_head must be the backbone's rows at its draft vocabulary (tokenmaxx's
    heads predict through the backbone's lm_head); a separately trained lm_head is refused."""
    folder = Path(folder)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise ExportError(f"{folder} is not an EAGLE-3 checkpoint: {name} is missing")
    config = json.loads((folder / CONFIG_NAME).read_text())
    if config.get("architectures") != [ARCHITECTURE] or config.get("num_hidden_layers") != 1:
        raise ExportError(f"{folder}: expected architectures {[ARCHITECTURE]} with num_hidden_layers 1, got "
                          f"{config.get('architectures')} with {config.get('num_hidden_layers')}")
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    own = config.get("tokenmaxx", {})
    layers = own.get("feature_layers") or config.get("eagle_aux_hidden_state_layer_ids") \
        or default_feature_layers(model.config.num_hidden_layers)
    weight = model.get_output_embeddings().weight
    if (config.get("hidden_size"), config.get("vocab_size")) != (weight.shape[1], weight.shape[0]):
        raise ExportError(f"{folder}: hidden size {config.get('hidden_size')} and vocabulary "
                          f"{config.get('vocab_size')} do not fit the backbone's {weight.shape[1]} and {weight.shape[0]}")
    kwargs = {"num_heads": own.get("num_heads", 4), "feature_layers": list(layers)}
    if own.get("dynamic_tree"):
        kwargs["dynamic_tree"] = own["dynamic_tree"]
    heads = Eagle3Heads.for_backbone(model, **kwargs)
    if own.get("backbone") is not None:  # the identity the exported heads were made for, checked as usual
        heads.config.backbone, heads.config.backbone_revision = own["backbone"], own.get("backbone_revision")
        heads.check_backbone(model)
    d2t, lm_head = state.pop("d2t", None), state.pop("lm_head.weight", None)
    state.pop("t2d", None)
    if lm_head is None:
        raise ExportError(f"{folder}: lm_head.weight is missing")
    draft_size = int(config.get("draft_vocab_size") or config["vocab_size"])
    ids = torch.arange(draft_size) + (d2t if d2t is not None else 0)  # [Vd] target ids
    if not torch.equal(lm_head, weight.detach()[ids.to(weight.device)].to("cpu", lm_head.dtype)):
        raise ExportError(f"{folder}: its lm_head is not the backbone's rows at its draft vocabulary; tokenmaxx heads "
                          "predict through the backbone's own lm_head, so a separately trained one cannot be imported")
    expected = {k for k in heads.state_dict() if k != "draft_vocab"}
    if set(state) != expected:
        raise ExportError(f"{folder}: weights {sorted(set(state) ^ expected)} are missing or unexpected")
    try:
        heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as err:  # shapes
        raise ExportError(f"{folder}: weights do not fit the EAGLE-3 layer ({err})") from None
    heads.set_draft_vocab(ids if d2t is not None and draft_size < heads.config.vocab_size else None)
    return heads.eval()
