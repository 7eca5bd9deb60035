"""EAGLE-3 heads as a checkpoint of the vLLM project's ``speculators`` library, which ``speculators`` loads with no
flag (``SpeculatorModel.from_pretrained(folder)``) and vLLM serves by the folder alone (``vllm serve FOLDER``: the
verifier is named in its config).

The layout is the one ``speculators`` writes (checked against its own code by ``tests/test_interop.py``)::

    config.json         speculators_model_type "eagle3"; speculators_config: algorithm, one greedy proposal method of
                        the heads' depth, the verifier (the backbone's folder or Hub id, and its architectures);
                        transformer_layer_config: the draft layer's Llama config (vocab_size V, rope settings);
                        draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids (the fused layers, the
                        input of layer i), norm_before_residual (false: vLLM assumes true where it is absent)
    model.safetensors   fc.weight, layers.0.* (the draft layer), norm.weight, lm_head.weight [Vd, H], d2t [Vd], t2d [V]
                        (where Vd < V), embed_tokens.weight [V, H]: the backbone's embedding. speculators reads the
                        embedding from the checkpoint (it leaves it at zeros when it is absent); vLLM's loader takes
                        it, the same weights as the target's.

No ``model_type`` at the top level: vLLM recognises a speculators config by its absence and ``speculators_config``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..eagle3 import Eagle3Heads
from .eagle3_export import LAYER_KEYS, check_export, draft_tensors, rope_fields, write_checkpoint

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout this writes (tests/test_interop.py checks it)
ARCHITECTURE = "Eagle3DraftModel"  # speculators' model class for the layout
DRAFT_LAYER = "midlayer."  # the draft layer's prefix in tokenmaxx's heads and the EAGLE-3 layout ...
SPECULATORS_LAYER = "layers.0."  # ... and in speculators'


def speculators_config(heads: Eagle3Heads, model, verifier: str, dtype: str) -> dict:
    """config.json: what ``Eagle3SpeculatorConfig`` and vLLM's speculators adapter read (``verifier``: the backbone's
    folder or Hub id, as the serving machine will find it)."""
    layer, hc = heads.layer_config, heads.config
    vocab = heads.draft_vocab
    architectures = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    transformer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": hc.vocab_size,
                   "num_hidden_layers": 1, **{k: getattr(layer, k) for k in LAYER_KEYS}, "attention_bias": False,
                   "mlp_bias": False, "tie_word_embeddings": False, "use_cache": True, "dtype": dtype,
                   **{k: v for k, v in rope_fields(layer).items() if v is not None}}
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": hc.num_heads,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": architectures},
        },
        "transformer_layer_config": transformer,
        "draft_vocab_size": hc.vocab_size if vocab is None else int(vocab.numel()),
        "target_hidden_size": model.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(heads.feature_layers),
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False, "tie_word_embeddings": False,
        "dtype": dtype, "torch_dtype": dtype,
        "tokenmaxx": {"num_heads": hc.num_heads, "feature_layers": list(heads.feature_layers),
                      "backbone": hc.backbone, "backbone_revision": hc.backbone_revision},
    }


def export_speculators(heads: Eagle3Heads, model, output_dir: str | os.PathLike, verifier: str,
                       dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Write ``heads`` (attached to backbone ``model``) as a speculators checkpoint into ``output_dir``; returns it.
    ``verifier``: the backbone as the serving machine names it (a folder or Hub id; it goes into the config). Written
    under a temp name and renamed; an existing non-empty ``output_dir`` is refused unless ``overwrite``."""
    check_export(heads, model, output_dir, dtype, overwrite, "speculators")
    state = {(SPECULATORS_LAYER + k.removeprefix(DRAFT_LAYER) if k.startswith(DRAFT_LAYER) else k): v
             for k, v in draft_tensors(heads, model, dtype).items()}
    if bool(state["t2d"].all()):  # no draft vocabulary: speculators maps nothing
        del state["t2d"]
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().to(
        "cpu", getattr(torch, dtype)).contiguous()  # [V, H]
    return write_checkpoint(output_dir, state, speculators_config(heads, model, verifier, dtype))
