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

from .attention import IMPLEMENTATION, shared_kv_kwargs
from .draft_vocab import DraftVocab
from .drafting import HEADS, Draft, Outcome, Prefill
from .dynamic_tree import Candidates, DynamicTreeConfig, expand_tree
from .modeling import DraftHeads
from .registry import register_head_kind

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

    own_lm_head = False  # predicts through the backbone's frozen lm_head

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
             attention_mask: torch.Tensor | None, cache=None, **attention_kwargs) -> torch.Tensor:
        """One module pass. prev [B, n, H] states before (backbone hidden or own output), tokens [B, n] the token
        each query is conditioned on, position_ids [B, n], attention_mask [B or 1, 1, n, C+n] additive (None:
        causal). Appends the queries' K/V to ``cache`` when given. ``attention_kwargs`` go to the attention function
        (``attention.shared_kv_kwargs``). Returns output states [B, n, H] (before ``norm``)."""
        dtype = self.fuse.weight.dtype
        x = torch.cat([self.norm_hidden(prev.to(dtype)), self.norm_embed(embed(tokens).to(dtype))], dim=-1)
        x = self.fuse(x)  # [B, n, H]
        position_embeddings = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=position_embeddings, **attention_kwargs)
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

    def training_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
        """The training unroll (``unrolled_states``) over all of [B, T] (each depth attends over the sequence and
        reads the tokens), then the rows at the selected [B, T] positions: [D, n, H] (all: [D, B, T, H])."""
        if embed is None or input_ids is None:
            raise ValueError(f"{self.kind!r} heads read tokens: pass input_ids [B, T] and the backbone's input "
                             "embedding as embed=model.get_input_embeddings()")
        states = self.unrolled_states(hidden, input_ids, embed)
        return states if selected is None else states[:, selected]

    # ---- drafting -------------------------------------------------------------------------------------------------
    def drafter(self, model, tree=None, draft_vocab: bool = True) -> "MTPDrafter":
        return MTPDrafter(self, model, self.tree_settings(self.config, tree), draft_vocab=draft_vocab)

    @classmethod
    def tree_settings(cls, config, spec=None) -> DynamicTreeConfig:
        """Dynamic-tree settings from ``spec``: None (the config's, else the defaults), 'default', 'dynamic',
        'dynamic:N' (N nodes), 'dynamic:nodes=N,topk=K,depth=D,min_mass=M', a dict or a DynamicTreeConfig."""
        spec = spec if spec is not None else config.dynamic_tree
        if spec is None or spec == "default":
            return DynamicTreeConfig()
        if isinstance(spec, DynamicTreeConfig):
            return spec
        if isinstance(spec, dict):
            return DynamicTreeConfig.from_dict(spec)
        if isinstance(spec, str) and spec.startswith("dynamic"):
            return DynamicTreeConfig.parse(spec)
        raise ValueError(f"tree {spec!r}: {config.kind!r} heads draft dynamic trees; pass 'dynamic', 'dynamic:N' "
                         "(N nodes) or 'dynamic:nodes=N,topk=K,depth=D'")

    @classmethod
    def check_config(cls, config) -> None:
        if not config.share_lm_head:
            raise ValueError(f"{config.kind!r} heads predict through the backbone's frozen lm_head: share_lm_head "
                             "must be true")
        if config.tree is not None:
            raise ValueError(f"{config.kind!r} heads draft dynamic trees (HeadsConfig.dynamic_tree): tree must be None")

    @classmethod
    def card_sections(cls, config) -> dict[str, str]:
        dynamic = cls.tree_settings(config)
        section = (f"Dynamic: grown level by level (frontier = the {dynamic.topk} best nodes by cumulative "
                   f"log-probability, each\nexpanded with its {dynamic.topk} best children, at most "
                   f"{dynamic.depth or config.num_heads} levels, a level drafted only while its frontier holds at "
                   f"least\n{dynamic.min_mass} of the draft's probability), then the {dynamic.nodes} best nodes "
                   "(root included) are verified. `tree=\"auto\"` picks the node budget with the best measured "
                   "tokens/s on your machine.")
        return {"tau_note": "", "tree_section": section}


class MTPDrafter:
    """Drafts dynamic trees (``dynamic_tree.expand_tree``) with ``MTPHeads``; owns the module's KV cache (depth-1
    entries of accepted anchors).

    Use: ``start`` after the backbone's prefill, then per round ``propose`` -> (verify, accept, commit) -> ``observe``
    (which adds the accepted positions to the module cache through ``advance``).
    """

    def __init__(self, heads: MTPHeads, model, config: DynamicTreeConfig, draft_vocab: bool = True):
        self.heads, self.config = heads, config
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.device = self.lm_head.weight.device  # the backbone's and the heads': drafts and module cache live there
        self.use_vocab = bool(draft_vocab) and heads.draft_vocab is not None
        self.vocab: DraftVocab | None = None  # a DraftVocab, or None (all tokens)
        self.attention = shared_kv_kwargs(model)  # the module's layer is built from the backbone's config
        self.depth = config.depth or heads.config.num_heads
        self.cache = DynamicCache()
        self.next_position = 0  # position id of the next anchor
        self.last_state: torch.Tensor | None = None  # [H] module output at the newest anchor (its depth-1 query)

    @property
    def nodes(self) -> int:
        """The node budget of one round (root included)."""
        return self.config.nodes

    def describe(self) -> str:
        return f"dynamic tree, {self.config.nodes} nodes"

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def _run(self, prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             visible: torch.Tensor) -> torch.Tensor:
        """Module pass for n queries. prev [n, H], tokens [n] and positions [n] on the device; visible [n, C+n] bool
        over (cache, queries), built on the CPU. Returns states [n, H]."""
        dtype = self.heads.fuse.weight.dtype
        mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=self.device)  # [1, 1, n, C+n]
        mask[0, 0].masked_fill_(~visible.to(self.device), torch.finfo(dtype).min)
        return self.heads.step(prev[None], tokens[None], self.embed, positions[None], mask, self.cache,
                               **self.attention)[0]

    def start(self, prefill: Prefill) -> None:
        """After the prefill: the module reads the end of the prompt.

        Like training (whose windows start K+1 positions before the answer), the module's context starts at anchor
        max(0, P - 1 - K) rather than at the beginning of a long prompt.
        """
        self.vocab = DraftVocab.for_prompt(self.heads.draft_vocab, self.lm_head, prefill.input_ids) \
            if self.use_vocab else None
        input_ids, hidden = prefill.input_ids, prefill.hidden
        prompt_len = input_ids.shape[0]
        first = max(0, prompt_len - 1 - self.heads.config.num_heads)
        self.cache = DynamicCache()
        self.next_position = first
        nxt = torch.cat([input_ids[first + 1:], torch.tensor([prefill.root], dtype=torch.long, device=self.device)])
        self.advance(hidden[first:], nxt)

    def observe(self, outcome: Outcome) -> None:
        """The module cache learns the accepted positions."""
        self.advance(outcome.hidden, torch.tensor(outcome.tokens, device=self.device))

    def advance(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Add anchors: hidden [n, H] backbone states at the next n positions, next_tokens [n] the token after each."""
        n, cached = hidden.shape[0], self.cached
        visible = torch.ones(n, cached + n, dtype=torch.bool, device="cpu")  # [n, C+n]
        visible[:, cached:] = torch.ones(n, n, dtype=torch.bool, device="cpu").tril()
        positions = torch.arange(self.next_position, self.next_position + n, device=self.device)  # [n]
        states = self._run(hidden, torch.as_tensor(next_tokens, dtype=torch.long, device=self.device), positions,
                           visible)
        self.next_position += n
        self.last_state = states[-1]

    def _logprobs(self, states: torch.Tensor) -> torch.Tensor:
        """Draft log-probs [..., V] (or [..., Vd] over the draft vocabulary) of module output states [..., H]."""
        if self.vocab is None:
            logits = self.heads.logits(states, self.lm_head)
        else:
            logits = self.vocab.logits(self.heads.norm(states))
        return torch.log_softmax(logits.float(), dim=-1)

    def propose(self, root: int, room: int) -> Draft:
        """A dynamic tree below ``root`` at most ``room`` deep. Leaves the module cache as it found it."""
        depth = min(self.depth, room)
        if depth <= 0 or self.config.nodes <= 1:
            return Draft.root_only(root, self.device)
        cached = self.cached
        anchor = self.next_position - 1  # the newest anchor's position: a depth-d node's query sits at anchor + d
        entry: dict[int, int] = {}  # expanded candidate -> its module cache entry (counted from ``cached``)
        output: dict[int, torch.Tensor] = {}  # expanded candidate -> output state of its query [H]

        def child_logprobs(frontier: list[int], cands: Candidates) -> torch.Tensor:
            entries, f = len(entry), len(frontier)
            visible = torch.zeros(f, cached + entries + f, dtype=torch.bool, device="cpu")  # [F, C+E+F]
            visible[:, :cached] = True  # accepted anchors (including this chain's depth-1 entry)
            for row, c in enumerate(frontier):
                p = cands.parent[c]
                while p >= 0:  # ancestors' entries: every ancestor of a frontier node was expanded
                    visible[row, cached + entry[p]] = True
                    p = cands.parent[p]
                visible[row, cached + entries + row] = True
            prev = torch.stack([output[cands.parent[c]] if cands.parent[c] >= 0 else self.last_state
                                for c in frontier])  # [F, H]
            toks = torch.tensor([cands.tokens[c] for c in frontier], dtype=torch.long, device=self.device)  # [F]
            positions = torch.tensor([anchor + cands.level[c] for c in frontier], device=self.device)  # [F]
            out = self._run(prev, toks, positions, visible)  # [F, H]
            for row, c in enumerate(frontier):
                entry[c] = entries + row
                output[c] = out[row]
            return self._logprobs(out)  # [F, V or Vd]

        try:
            grown = expand_tree(root, self._logprobs(self.last_state), child_logprobs, self.config.topk, depth,
                                self.config.nodes, token_ids=None if self.vocab is None else self.vocab.ids,
                                min_mass=self.config.min_mass)
        finally:
            if self.cached > cached:  # drop the tree's entries (crop takes a negative count in transformers 5)
                self.cache.crop(cached - self.cached)
        return Draft(tokens=grown.tokens, buffers=grown.buffers, sources=torch.full_like(grown.tokens, HEADS),
                     values=grown.scores.exp())
