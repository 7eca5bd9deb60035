"""MTP-style sequential draft heads: one small decoder block, unrolled over depths, each guess conditioned on the last.

Depth d of the module reads two things for an *anchor* position a (a backbone position whose final-normed hidden state
h_a is known): the state before it (h_a at d = 1, the module's own output at depth d-1 after that) and the embedding of
the token at a+d (the backbone's own next token at d = 1, the token guessed at depth d-1 after that). Both are
RMS-normalised, concatenated and projected to the hidden size, run through ``num_layers`` decoder layers of the
backbone's own family (built by transformers from the backbone's config), normalised, and projected with the backbone's
frozen lm_head. Depth d at anchor a predicts the token at a+d+1, the same offset rule as Medusa head k = d.

Attention (the same at training and at inference): a depth-1 query at anchor a sees the depth-1 entries of anchors
<= a (ordinary causal attention, the module's own KV cache at inference); a depth-d query additionally sees the
depth-2..d entries of its own chain (a draft tree node sees its ancestors). Query position ids are a + d - 1.

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
from transformers import AutoConfig, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .modeling import DraftHeads, register_head_kind

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
class MTPHeads(DraftHeads):
    """Sequential draft module (DeepSeek-V3 MTP / EAGLE style), weights shared across depths."""

    def __init__(self, config):
        super().__init__(config)
        if not config.layer_config:
            raise ValueError("mtp heads need config.layer_config (the backbone config the decoder layers are built "
                             "from); make them with MTPHeads.for_backbone(model)")
        if not config.share_lm_head:
            raise ValueError("mtp heads predict through the backbone's frozen lm_head: share_lm_head must be true")
        if config.num_layers < 1:
            raise ValueError(f"mtp heads need num_layers >= 1 decoder layers, got {config.num_layers}")
        data = dict(config.layer_config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ValueError("config.layer_config has no model_type")
        layer_cls, rotary_cls = _family_classes(model_type)
        cfg = AutoConfig.for_model(model_type, **data)
        cfg._attn_implementation = "sdpa"  # tree masks are 4D float masks; sdpa and eager both take them
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
        self._init_weights()

    def _init_weights(self) -> None:
        std = float(getattr(self.layer_config, "initializer_range", 0.02))
        with torch.no_grad():
            eye = torch.eye(self.config.hidden_size)
            # Start as "the previous state plus a little of the token": depth 1 begins near the backbone's own guess.
            self.fuse.weight.normal_(0.0, std)
            self.fuse.weight[:, : self.config.hidden_size] += eye
            for layer in self.layers:
                for module in layer.modules():
                    if isinstance(module, nn.Linear):
                        module.weight.normal_(0.0, std)
                        if module.bias is not None:
                            module.bias.zero_()
                # The residual branches start at zero: an untrained layer is the identity.
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    @classmethod
    def for_backbone(cls, model, **config_kwargs) -> "MTPHeads":
        config_kwargs.setdefault("num_layers", 1)
        config_kwargs.setdefault("layer_config", layer_config_from(model.config, config_kwargs["num_layers"]))
        return super().for_backbone(model, **config_kwargs)

    # ---- one depth -----------------------------------------------------------------------------------------------
    def step(self, prev: torch.Tensor, tokens: torch.Tensor, embed: nn.Module, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """One module pass. prev [B, n, H] states before (backbone hidden or own output), tokens [B, n] the token
        each query is conditioned on, position_ids [B, n], attention_mask [B or 1, 1, n, C+n] additive (None:
        causal). Appends the queries' K/V to ``cache`` when given. Returns output states [B, n, H] (before ``norm``)."""
        dtype = self.fuse.weight.dtype
        x = torch.cat([self.norm_hidden(prev.to(dtype)), self.norm_embed(embed(tokens).to(dtype))], dim=-1)
        x = self.fuse(x)  # [B, n, H]
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=position_embeddings)
        return x

    def logits(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Output states [..., H] -> logits [..., V] through the final norm and the backbone's lm_head."""
        return lm_head(self.norm(states))

    # ---- training: all D depths at every anchor ------------------------------------------------------------------
    def unrolled_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module,
                        depths: int | None = None) -> torch.Tensor:
        """Training-time unroll. hidden [B, T, H] backbone states, input_ids [B, T] (right-padded).

        Depth d at anchor a is conditioned on the true token at a+d and on the module's OWN depth d-1 output (the
        situation at inference along a correct draft path). Returns final-normed states [D, B, T, H]; row d-1 at a
        predicts the token at a+d+1 (positions whose inputs run past the sequence hold garbage: mask them).
        """
        depths = depths or self.config.num_heads
        bsz, seq, _ = hidden.shape
        cache = DynamicCache()
        anchors = torch.arange(seq, device=hidden.device)
        causal = anchors[None, :] <= anchors[:, None]  # [T, T]
        diagonal = torch.eye(seq, dtype=torch.bool, device=hidden.device)
        dtype = self.fuse.weight.dtype
        prev, outs = hidden, []
        for d in range(1, depths + 1):
            shifted = torch.zeros_like(input_ids)
            if d < seq:
                shifted[:, : seq - d] = input_ids[:, d:]  # token at a+d
            visible = torch.cat([causal] + [diagonal] * (d - 1), dim=1)  # [T, d*T]: depth-1 causal + own chain
            mask = torch.zeros(visible.shape, dtype=dtype, device=hidden.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            prev = self.step(prev, shifted, embed, (anchors + d - 1)[None].expand(bsz, seq), mask[None, None], cache)
            outs.append(self.norm(prev))
        return torch.stack(outs)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None, *, input_ids: torch.Tensor | None = None,
                embed: nn.Module | None = None) -> torch.Tensor:
        """Logits [D, B, T, V] of the training unroll (``input_ids`` and ``embed`` are required: unlike Medusa
        heads, each depth reads the token before it)."""
        if input_ids is None or embed is None or lm_head is None:
            raise ValueError("mtp heads read tokens: call heads(hidden [B, T, H], lm_head, input_ids=[B, T], "
                             "embed=model.get_input_embeddings())")
        return lm_head(self.unrolled_states(hidden, input_ids, embed))
