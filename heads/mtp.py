"""MTP-style sequential draft heads (DeepSeek-V3 MTP): one small decoder block, unrolled over depths.

The shared machinery (training unroll, attention pattern, dynamic-tree drafter) is ``sequential.py``. What this kind
does in one pass: the state before (the backbone's final-normed last state at depth 1, the module's own output after
that) and the embedding of the token each query is conditioned on are RMS-normalised, concatenated and projected to
the hidden size (``fuse``), then run through ``num_layers`` decoder layers of the backbone's own family (built by
transformers from the backbone's config).

The checkpoint holds only the module (fuse projection, norms, decoder layers: ~4.2M parameters for SmolLM2-135M);
token embeddings and lm_head are the backbone's, passed in per call. ``config.num_heads`` is the number of depths the
module is trained to unroll (and the default drafting depth); ``config.layer_config`` is the backbone config the
decoder layers are built from.

Letters: B batch, T time, D depths, H hidden size, V vocabulary, n queries, C cached entries.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .attention import IMPLEMENTATION
from .registry import register_head_kind
from .sequential import SequentialHeads

# Backbone config keys that say nothing about one decoder layer (or name this particular checkpoint).
_DROP_KEYS = ("architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "auto_map",
              "_commit_hash", "id2label", "label2id")


def layer_config_from(model_config, num_layers: int) -> dict:
    """The backbone config as a JSON-able dict for rebuilding ``num_layers`` decoder layers of its family."""
    data = {k: v for k, v in model_config.to_dict().items()
            if k not in _DROP_KEYS and not k.startswith("tokenmaxx_")}
    data["num_hidden_layers"] = num_layers
    data.pop("layer_types", None)  # rebuilt from num_hidden_layers by configs that have it
    return data


def _family_classes(model_type: str) -> tuple[type, type]:
    """(decoder layer class, rotary embedding class) of a transformers model family, found by its public names."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"backbone family {model_type!r} has no causal-LM class in transformers: MTP heads need one")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    model_cls = getattr(module, name)
    layer_names = [n for n in (model_cls._no_split_modules or []) if n.endswith("DecoderLayer")]
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    if not layer_names or not rotary:
        raise ValueError(f"backbone family {model_type!r}: could not find its decoder layer / rotary embedding "
                         "classes in transformers; MTP heads support Llama-like families (llama, qwen2, mistral, ...)")
    return getattr(module, layer_names[0]), rotary[0]


@register_head_kind("mtp")
class MTPHeads(SequentialHeads):
    """Sequential draft module (DeepSeek-V3 MTP style), weights shared across depths."""

    def __init__(self, config):
        super().__init__(config)
        if not config.layer_config:
            raise ValueError("mtp heads need config.layer_config (the backbone config the decoder layers are built "
                             "from); make them with MTPHeads.for_backbone(model)")
        if config.num_layers < 1:
            raise ValueError(f"mtp heads need num_layers >= 1 decoder layers, got {config.num_layers}")
        data = dict(config.layer_config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError("config.layer_config has no model_type")
        layer_cls, rotary_cls = _family_classes(model_type)
        cfg = AutoConfig.for_model(model_type, **data)
        cfg._attn_implementation = IMPLEMENTATION  # SDPA (4D float tree masks), sharing KV heads when asked
        if cfg.hidden_size != config.hidden_size:
            raise ValueError(f"layer_config hidden size {cfg.hidden_size} != heads hidden size {config.hidden_size}")
        hidden = config.hidden_size
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.layer_config = cfg
        self.norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.norm_embed = nn.RMSNorm(hidden, eps=eps)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(layer_cls(cfg, layer_idx=i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.rotary = rotary_cls(cfg)
        # Start as "the previous state plus a little of the token": depth 1 begins near the backbone's own guess.
        self._init_weights(self.fuse, slice(None, hidden), self.layers)

    @classmethod
    def for_backbone(cls, model, **config_kwargs) -> "MTPHeads":
        config_kwargs.setdefault("num_layers", 1)
        config_kwargs.setdefault("layer_config", layer_config_from(model.config, config_kwargs["num_layers"]))
        return super().for_backbone(model, **config_kwargs)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.feature_layers is not None:
            raise ValueError(f"{config.kind!r} heads read the backbone's final state: feature_layers must be None "
                             "(kind 'eagle3' reads several layers)")

    @classmethod
    def card_sections(cls, config) -> dict:
        family = (config.layer_config or {}).get("model_type", "not recorded")
        return {**super().card_sections(config),
                "summary": f"an MTP-style sequential draft module ({config.num_layers} decoder layer(s) of the "
                           f"backbone's own family, unrolled over {config.num_heads} trained depths)",
                "how": "At depth d the module reads its previous state (the backbone's last hidden state at d = 1) and "
                       "the embedding of the token guessed before, and guesses the next token through the backbone's "
                       "frozen lm_head; drafting grows a dynamic tree from the module's own log-probabilities.",
                "rows": [("trained depths", str(config.num_heads)),
                         ("decoder layers", f"{config.num_layers} (`{family}` family, built by transformers)")]}

    # ---- one depth -----------------------------------------------------------------------------------------------
    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The backbone's final-normed last state is the depth-1 state as it is: [..., H] -> [..., H]."""
        return features

    def step(self, prev: torch.Tensor, tokens: torch.Tensor, embed: nn.Module, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache=None, **attention_kwargs) -> torch.Tensor:
        """``SequentialHeads.step``: fuse(norm(prev) ++ norm(embed(tokens))), then the decoder layers."""
        dtype = self.dtype
        x = torch.cat([self.norm_hidden(prev.to(dtype)), self.norm_embed(embed(tokens).to(dtype))], dim=-1)
        x = self.fuse(x)  # [B, n, H]
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=position_embeddings, **attention_kwargs)
        return x
