"""EAGLE-3 draft heads: sequential drafting (``sequential.py``) from a fusion of the backbone's low, middle and high
layers, in the checkpoint layout that vLLM and SGLang serve (``io/eagle3_export.py`` writes and reads it).

One pass of the module (EAGLE-3, Li et al. 2025; the same forward as vLLM's and SGLang's ``llama_eagle3.py``):

    depth 1:  prev = fc(h_low ++ h_mid ++ h_high)       backbone hidden_states at ``feature_layers`` [.., 3H] -> [.., H]
    x        = input_layernorm(embed(token)) ++ hidden_norm(prev)       [.., 2H]: embedding first
    h        = prev + self_attn(x)                       q/k/v read 2H; residual = prev, un-normed
    out      = h + mlp(post_attention_layernorm(h))      the next depth's prev (before the final norm)
    logits   = lm_head(norm(out))                        the backbone's frozen lm_head, over the draft vocabulary

``feature_layers`` are hidden-state indices (i: the input of backbone layer i), by default (2, L//2, L-3) as EAGLE-3,
vLLM and SGLang choose them. The decoder layer is always a Llama layer (as EAGLE-3 drafts are) sized like the
backbone: its attention and MLP are transformers' own Llama modules, with q/k/v widened to read 2H.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from .attention import IMPLEMENTATION
from .mtp import layer_config_from
from .registry import register_head_kind
from .sequential import SequentialHeads


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice for a backbone of ``num_layers`` layers: the inputs of layers 2, L//2 and L-3."""
    layers = [2, num_layers // 2, num_layers - 3]
    if not layers[0] < layers[1] < layers[2]:
        raise ValueError(f"a backbone of {num_layers} layers is too shallow for EAGLE-3's default feature layers "
                         f"(2, L//2, L-3) = {tuple(layers)}; pass feature_layers=[i, j, k] (hidden-state indices)")
    return layers


def eagle3_layer_config(model_config) -> dict:
    """The backbone's sizes as a one-layer Llama config (EAGLE-3 drafts are Llama layers, whatever the backbone)."""
    data = layer_config_from(model_config, 1)
    data.update(model_type="llama", attention_bias=False, mlp_bias=False)
    return data


class Eagle3Layer(nn.Module):
    """The draft's decoder layer (``midlayer`` in the checkpoint): a Llama decoder layer whose attention reads the
    normed token embedding beside the normed state [.., 2H], with the un-normed state as its residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        base = LlamaDecoderLayer(config, layer_idx=0)  # transformers' modules, q/k/v widened below
        hidden, attn = config.hidden_size, base.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, proj.out_features, bias=False))
        self.input_layernorm = base.input_layernorm  # the token embedding's norm
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)  # the state's norm
        self.self_attn = attn
        self.post_attention_layernorm = base.post_attention_layernorm
        self.mlp = base.mlp

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask,
                cache=None, **attention_kwargs) -> torch.Tensor:
        """embeds, hidden [B, n, H] -> the layer's output [B, n, H] (before the heads' final norm)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, n, 2H]
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                 past_key_values=cache, **attention_kwargs)
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h))


@register_head_kind("eagle3")
class Eagle3Heads(SequentialHeads):
    """EAGLE-3 draft: ``fc`` over three backbone layers, one ``midlayer``, ``norm``; unrolled over num_heads depths."""

    def __init__(self, config):
        super().__init__(config)
        if not config.layer_config:
            raise ValueError("eagle3 heads need config.layer_config (the one-layer Llama config of the draft); make "
                             "them with Eagle3Heads.for_backbone(model)")
        cfg = LlamaConfig(**{k: v for k, v in config.layer_config.items() if k != "model_type"})
        cfg._attn_implementation = IMPLEMENTATION  # SDPA (4D float tree masks), sharing KV heads when asked
        hidden = config.hidden_size
        if cfg.hidden_size != hidden:
            raise ValueError(f"layer_config hidden size {cfg.hidden_size} != heads hidden size {hidden}")
        self.layer_config = cfg
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(cfg)
        # Start from the highest feature layer's state (the nearest to the backbone's own next-token state) and an
        # identity layer (zero residual branches): depth 1 begins near a guess the backbone could make.
        self._init_weights(self.fc, slice(-hidden, None), [self.midlayer])

    @classmethod
    def for_backbone(cls, model, **config_kwargs) -> "Eagle3Heads":
        config_kwargs.setdefault("num_layers", 1)
        config_kwargs.setdefault("layer_config", eagle3_layer_config(model.config))
        if config_kwargs.get("feature_layers") is None:
            config_kwargs["feature_layers"] = default_feature_layers(model.config.num_hidden_layers)
        return super().for_backbone(model, **config_kwargs)

    # ---- one depth -----------------------------------------------------------------------------------------------
    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated feature layers: [..., 3H] -> [..., H]."""
        return self.fc(features.to(self.dtype))

    def step(self, prev: torch.Tensor, tokens: torch.Tensor, embed: nn.Module, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache=None, **attention_kwargs) -> torch.Tensor:
        """``SequentialHeads.step``: the EAGLE-3 layer on (embed(tokens), prev)."""
        prev = prev.to(self.dtype)
        position_embeddings = self.rotary(prev, position_ids)
        return self.midlayer(embed(tokens).to(self.dtype), prev, position_embeddings, attention_mask, cache,
                             position_ids=position_ids, **attention_kwargs)

    # ---- what the kind accepts -------------------------------------------------------------------------------------
    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if not config.feature_layers:
            raise ValueError("eagle3 heads read several backbone layers: config.feature_layers must list them "
                             "(Eagle3Heads.for_backbone sets EAGLE-3's default, (2, L//2, L-3))")
        if config.num_layers != 1:
            raise ValueError(f"eagle3 heads have one decoder layer (the layout vLLM and SGLang load), got "
                             f"num_layers={config.num_layers}")

    @classmethod
    def card_sections(cls, config) -> dict:
        layers = list(config.feature_layers or [])
        named = ", ".join(map(str, layers[:-1])) + f" and {layers[-1]}" if len(layers) > 1 else ", ".join(map(str, layers))
        vocab = (f" over a draft vocabulary (its {config.draft_vocab_size} most frequent tokens plus the prompt's)"
                 if config.draft_vocab_size else "")
        return {**super().card_sections(config),
                "summary": f"an EAGLE-3 draft module (one Llama decoder layer reading a fusion of {len(layers)} "
                           f"backbone layers' hidden states and the token embedding, unrolled over {config.num_heads} "
                           "draft depths)",
                "how": f"At depth d the module reads its previous state (at d = 1 `fc`, a trained fusion of the "
                       f"backbone's hidden states {named}, the inputs of those layers) and the embedding of the token "
                       f"guessed before, and guesses the next token through the backbone's frozen lm_head{vocab}; "
                       "drafting grows a dynamic tree from the module's own log-probabilities.",
                "rows": [("draft depths", str(config.num_heads)),
                         ("decoder layers", (f"{config.num_layers} (a Llama layer, EAGLE-3's layout: `tokenmaxx export "
                                             "--format eagle3` writes the checkpoint of vLLM's and SGLang's EAGLE-3 "
                                             "drafts)")),
                         ("feature layers", (f"{', '.join(map(str, layers))} (backbone hidden-state indices, i: the "
                                             "input of layer i; fused by `fc`)"))]}
