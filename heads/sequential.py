"""Sequential draft heads: one small module unrolled over depths, each guess conditioned on the last (MTP, EAGLE).

Depth d of the module reads, for an *anchor* position a (a backbone position whose features are known), the state
before it and the embedding of the token at a+d. At d = 1 the state is the backbone's, lifted into the module
(``lift``: the final-normed last state as it is for MTP heads, a fusion of three layers for EAGLE-3 heads); after
that it is the module's own output at depth d-1, and the token is the one guessed at depth d-1. Depth d at anchor a
predicts the token at a+d+1, the same offset rule as Medusa head k = d. Logits: the module's final norm, then the
backbone's frozen lm_head (over the draft vocabulary when the heads have one).

Attention (the same at training and at inference): a depth-1 query at anchor a sees the depth-1 entries of anchors
<= a (ordinary causal attention, the module's own KV cache at inference); a depth-d query additionally sees the
depth-2..d entries of its own chain (a draft tree node sees its ancestors). Query position ids are a + d - 1.

A kind built on this (``mtp.py``, ``eagle3.py``) says how the module is made and what one pass does: ``lift``,
``step``, ``norm``. Everything else is shared here: the training-time unroll over all depths (``unrolled_states``),
the dynamic trees it drafts (``SequentialDrafter``), the kind's tree settings and checks.

Letters: B batch, T time, D depths, H hidden size, F backbone feature size, V vocabulary, n queries, C cached entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from .attention import UNROLLED, shared_kv_kwargs
from .draft_vocab import DraftVocab
from .drafting import EAGER, HEADS, Draft, Outcome, Pass, Prefill, run_alone
from .machine import reads_are_free
from .dynamic_tree import DynamicTreeConfig, Frontier, tree_growth
from .config import lookback
from .modeling import DraftHeads


class SequentialHeads(DraftHeads):
    """Base of the sequential kinds: a module unrolled over ``config.num_heads`` depths, weights shared across them.
    Subclasses build ``self.norm`` (the final norm) and implement ``lift`` and ``step``."""

    own_lm_head = False  # predicts through the backbone's frozen lm_head
    norm: nn.Module

    @property
    def dtype(self) -> torch.dtype:
        """The module's compute dtype (its weights')."""
        return self.norm.weight.dtype

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """Backbone features [..., F] (``backbone_features``) -> the depth-1 state the module reads [..., H]."""
        raise NotImplementedError

    def step(self, prev: torch.Tensor, tokens: torch.Tensor, embed: nn.Module, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache=None, **attention_kwargs) -> torch.Tensor:
        """One module pass. prev [B, n, H] states before (lifted backbone features or own output), tokens [B, n] the
        token each query is conditioned on, position_ids [B, n], attention_mask [B or 1, 1, n, C+n] additive (None:
        causal). Appends the queries' K/V to ``cache`` when given. ``attention_kwargs`` go to the attention function
        (``attention.shared_kv_kwargs``). Returns output states [B, n, H] (before ``norm``)."""
        raise NotImplementedError

    def logits(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Output states [..., H] -> logits [..., V] through the final norm and the backbone's lm_head."""
        return lm_head(self.norm(states))

    def _init_weights(self, fusion: nn.Linear, identity: slice, layers) -> None:
        """Fresh weights: every linear weight ~ N(0, the layer config's initializer_range) and biases zero; then the
        ``fusion`` projection passes its ``identity`` input columns through, and the ``layers``' residual branches
        start at zero (an untrained layer is the identity)."""
        std = float(getattr(self.layer_config, "initializer_range", 0.02))
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, std)
                    if module.bias is not None:
                        module.bias.zero_()
            fusion.weight[:, identity] += torch.eye(self.config.hidden_size)
            for layer in layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()

    # ---- training: the unroll over all D depths ------------------------------------------------------------------
    def unrolled_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module,
                        depths: int | None = None) -> torch.Tensor:
        """Training-time unroll at every anchor. hidden [B, T, F] backbone features, input_ids [B, T] (right-padded).

        Depth d at anchor a is conditioned on the true token at a+d and on the module's OWN depth d-1 output (the
        situation at inference along a correct draft path). Returns final-normed states [D, B, T, H]; row d-1 at a
        predicts the token at a+d+1 (positions whose inputs run past the sequence hold garbage: mask them).
        """
        return self._unroll(hidden, input_ids, embed, depths)[0]

    def training_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
        """The training unroll (``unrolled_states``), then the rows at the selected [B, T] positions: [D, n, H] (all:
        [D, B, T, H]). Depth 1 runs over all of [B, T] (its entries are every later query's keys); depths 2..D run
        at the selected anchors only (a prompt position or padding has no target at any depth, and its chain is read
        by nothing else), which is most of a step's unroll on prompts as long as their answers."""
        if embed is None or input_ids is None:
            raise ValueError(f"{self.kind!r} heads read tokens: pass input_ids [B, T] and the backbone's input "
                             "embedding as embed=model.get_input_embeddings()")
        states, kept = self._unroll(hidden, input_ids, embed, anchors=selected)
        return states if selected is None else states[:, kept]

    def _unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module, depths: int | None = None,
                anchors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unroll with depths 2..D at the ``anchors`` [B, T] bool only (None: all). Returns the final-normed
        states [D, B, M, H] at M anchor slots per row (the row's anchors in order, then filler) and which slots are
        anchors [B, M] (None when anchors is None: the slots are the T positions)."""
        depths = depths or self.config.num_heads
        bsz, seq, _ = hidden.shape
        cache = DynamicCache()
        where = torch.arange(seq, device=hidden.device)[None].expand(bsz, seq)  # [B, M] each slot's position
        prev = self.step(self.lift(hidden), _tokens_at(input_ids, where + 1), embed, where, None, cache,
                         **{UNROLLED: True})
        visible, kept = True, None
        if anchors is not None and depths > 1:
            counts = anchors.sum(1)
            # each row's anchors first, in order; filler slots (a row with fewer anchors) repeat real positions
            where = torch.argsort((~anchors).to(torch.uint8), dim=1, stable=True)[:, : max(int(counts.max()), 1)]
            kept = torch.arange(where.shape[1], device=where.device)[None] < counts[:, None]
            prev = prev.gather(1, where[..., None].expand(-1, -1, prev.shape[-1]))
            visible = torch.arange(seq, device=where.device)[None, None] <= where[..., None]  # [B, M, T]
        elif anchors is not None:
            kept = anchors
        outs = [self.norm(prev)]
        for d in range(2, depths + 1):
            # keys: the depth-1 causal prefix + the own chain's deeper entries (``attention.unrolled_attention``)
            prev = self.step(prev, _tokens_at(input_ids, where + d), embed, where + d - 1, None, cache,
                             **{UNROLLED: visible})
            outs.append(self.norm(prev))
        return torch.stack(outs), kept

    # ---- drafting -------------------------------------------------------------------------------------------------
    def drafter(self, model, tree: DynamicTreeConfig | None = None, draft_vocab: bool = True) -> "SequentialDrafter":
        return SequentialDrafter(self, model, self.parsed_settings(tree, DynamicTreeConfig), draft_vocab=draft_vocab)

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
        return {"tau_note": "", "tree_section": section, "unit": "depth",
                "accuracy_note": "Depth d is scored given the true tokens before it (the situation along a correct "
                                 "draft path)."}


class SequentialDrafter:
    """Drafts dynamic trees (``dynamic_tree.tree_growth``) with sequential heads; its module cache holds the depth-1
    entries of accepted anchors (its own, when its passes run as they are; the passes' own when they are captured).

    Use: ``start`` after the backbone's prefill, then per round ``propose`` -> (verify, accept, commit) -> ``observe``
    (whose accepted positions the module cache gains at the next proposal, ``_catch_up_steps``).
    """

    def __init__(self, heads: SequentialHeads, model, config: DynamicTreeConfig, draft_vocab: bool = True):
        self.heads, self.config = heads, config
        self.feature_layers = heads.feature_layers  # what the loop hands to start / observe as backbone states
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.device = self.lm_head.weight.device  # the backbone's and the heads': drafts and module cache live there
        self.use_vocab = bool(draft_vocab) and heads.draft_vocab is not None
        self.vocab: DraftVocab | None = None  # a DraftVocab, or None (all tokens)
        self.attention = shared_kv_kwargs(model)  # the module's layer is built from the backbone's config
        self.depth = config.depth or heads.config.num_heads
        self.passes = EAGER  # how its module passes run (``drafting.Eager``; the inference side may hand others)
        self.cache = DynamicCache()
        self.length = 0  # entries in the module cache that stay (accepted anchors)
        self.next_position = 0  # position id of the next anchor
        self.last_state: torch.Tensor | None = None  # [H] module output at the newest anchor (its depth-1 query)
        self.root_token: torch.Tensor | None = None  # [1] long: the next root on the device (from ``observe``)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # observed (hidden [n, F], tokens [n]) not read yet
        # whether tree growth reads the frontier back to stop early (``tree_growth``): where reads cost nothing
        self.stop_early = reads_are_free(self.device)

    @property
    def nodes(self) -> int:
        """The node budget of one round (root included)."""
        return self.config.nodes

    def describe(self) -> str:
        return f"dynamic tree, {self.config.nodes} nodes"

    @property
    def cached(self) -> int:
        return self.length

    def share_forward(self, rows: int) -> None:
        """(Its trees are as large whatever a forward verifies beside them.)"""

    def _run(self, prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             visible: torch.Tensor) -> torch.Tensor:
        """Module pass for n queries, appended to the cache after its first C + E entries. prev [n, H], tokens [n],
        positions [n] and visible [n, C+E+n] bool over (cache, queries), all on the device. Returns states [n, H]."""
        dtype = self.heads.dtype
        mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=self.device)  # [1, 1, n, C+E+n]
        mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
        return self.heads.step(prev[None], tokens[None], self.embed, positions[None], mask, self.cache,
                               **self.attention)[0]

    def start(self, prefill: Prefill) -> None:
        """After the prefill: the module reads the end of the prompt.

        Like training (whose windows start ``config.lookback`` positions before the prompt's last: K by default), the
        module's context starts at anchor max(0, P - 1 - lookback) rather than at the beginning of a long prompt.
        """
        self.vocab = DraftVocab.for_prompt(self.heads.draft_vocab, self.lm_head, prefill.input_ids) \
            if self.use_vocab else None
        input_ids, hidden = prefill.input_ids, prefill.hidden
        prompt_len = input_ids.shape[0]
        first = max(0, prompt_len - 1 - lookback(self.heads.config))
        self.cache = DynamicCache()
        self.length = 0
        self.next_position = first
        self.root_token = torch.tensor([prefill.root], dtype=torch.long, device=self.device)
        self._pending = []
        run_alone(self._advance_steps(hidden[first:], torch.cat([input_ids[first + 1:], self.root_token])))

    def observe(self, outcome: Outcome) -> None:
        """The round's last token is the next root; the module reads the accepted positions when it next proposes
        (``_catch_up``), so rounds that propose nothing (a batch whose load switched drafting off) cost no pass."""
        self._pending.append((outcome.hidden, outcome.token_ids))
        self.root_token = outcome.token_ids[-1:]

    def _catch_up_steps(self):
        """The module cache learns the accepted positions observed since the last proposal (one pass)."""
        if self._pending:
            hidden, tokens = (torch.cat(parts) for parts in zip(*self._pending))
            self._pending.clear()
            yield from self._advance_steps(hidden, tokens)

    def _advance_steps(self, hidden: torch.Tensor, next_tokens: torch.Tensor):
        """Add anchors: hidden [n, F] backbone features at the next n positions, next_tokens [n] the token after
        each (one ``ModulePass``)."""
        n, cached = hidden.shape[0], self.cached
        visible = torch.ones(n, cached + n, dtype=torch.bool, device=self.device)  # [n, C+n]
        visible[:, cached:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(self.next_position, self.next_position + n, device=self.device)  # [n]
        tokens = torch.as_tensor(next_tokens, dtype=torch.long, device=self.device)  # [n]
        # lift and step cast to the module dtype
        states = yield ModulePass(self, self.heads.lift(hidden), tokens, positions, visible)
        self.length += n
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
        """A dynamic tree below ``root`` at most ``room`` deep, grown on the device (``dynamic_tree.tree_growth``; the
        root token is the device copy ``observe`` kept). Leaves the module cache as it found it."""
        return run_alone(self.propose_steps(root, room))

    def propose_steps(self, root: int, room: int):
        """``propose`` as steps (``drafting.proposal_steps``): yields each module pass (``ModulePass``)."""
        depth = min(self.depth, room)
        if depth <= 0 or self.config.nodes <= 1:
            return Draft.root_only(root, self.device)
        yield from self._catch_up_steps()
        cached = self.cached
        anchor = self.next_position - 1  # the newest anchor's position: a depth-d node's query sits at anchor + d
        outputs: list[torch.Tensor] = []  # per expanded level: its frontier's output states [F, H]
        widths: list[int] = []  # per expanded level: its frontier's width (module cache entries appended)
        growth = tree_growth(self.root_token, self._logprobs(self.last_state), self.config.topk, depth,
                             self.config.nodes, token_ids=None if self.vocab is None else self.vocab.ids,
                             min_mass=self.config.min_mass, stop_early=self.stop_early)
        try:
            frontier = next(growth)
            while True:  # one pass a level: the frontier's queries see the anchors and their own ancestors
                f = frontier.tokens.shape[0]
                rows = torch.arange(f, device=self.device)
                visible = torch.zeros(f, cached + sum(widths) + f, dtype=torch.bool, device=self.device)  # [F, C+E+F]
                visible[:, :cached] = True  # accepted anchors (including this chain's depth-1 entry)
                offset = cached
                for level, width in enumerate(widths):  # each node's ancestor among the entries of each earlier level
                    visible[rows, offset + frontier.ancestors[:, level]] = True
                    offset += width
                visible[rows, offset + rows] = True
                prev = self.last_state.expand(f, -1) if not outputs else outputs[-1][frontier.parent_slot]  # [F, H]
                positions = torch.full((f,), anchor + frontier.level, device=self.device)  # [F]
                out = yield ModulePass(self, prev, frontier.tokens, positions, visible)  # [F, H]
                outputs.append(out)
                widths.append(f)
                frontier = growth.send(self._logprobs(out))  # [F, V or Vd]
        except StopIteration as stop:
            grown = stop.value
        finally:  # drop the tree's entries (captured passes keep their own cache, where the next pass writes over them)
            if self.cache.get_seq_length() > cached:  # (crop takes a negative count)
                self.cache.crop(cached - self.cache.get_seq_length())
        return Draft(tokens=grown.tokens, buffers=grown.buffers, sources=torch.full_like(grown.tokens, HEADS),
                     values=grown.scores.exp())


@dataclass(eq=False)
class ModulePass(Pass):
    """One pass of a ``SequentialDrafter``'s module over n queries, written after its cache's entries: ``run`` is
    the drafter's own pass; ``run_together`` computes the passes of several drafters of the same heads (a batch's
    rows, each with its own cache) in one module call."""

    drafter: SequentialDrafter
    prev: torch.Tensor  # [n, H] states before the queries (lifted backbone features or module outputs)
    tokens: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    visible: torch.Tensor  # [n, C+n] bool over (the drafter's cache, these queries)

    @property
    def batch_key(self):
        """Drafters of one heads module on one device batch together, where their passes may (``Eager.together``)."""
        drafter = self.drafter
        return (drafter.heads, drafter.embed, drafter.device) if drafter.passes.together else None

    def run(self) -> torch.Tensor:
        return self.drafter.passes.module_pass(self)

    def run_eager(self) -> torch.Tensor:
        return self.drafter._run(self.prev, self.tokens, self.positions, self.visible)

    @staticmethod
    def run_together(passes: list["ModulePass"]) -> list[torch.Tensor]:
        """The passes of R drafters in one module call: their caches stacked (right-padded to the longest, C), their
        queries padded to the most (n); each query sees its own row's entries and queries as its ``visible`` says, a
        padding query only itself. Each drafter's cache then gains its own queries' entries, as its own pass would
        have written them. Returns each pass's states [n_r, H]."""
        first = passes[0].drafter
        heads, device, dtype = first.heads, first.device, first.heads.dtype
        if any(not p.drafter.cache.layers or not all(layer.is_initialized for layer in p.drafter.cache.layers)
               for p in passes):
            return [p.run() for p in passes]  # (an empty cache: nothing to stack)
        counts = [p.tokens.shape[0] for p in passes]
        kept = [p.visible.shape[1] - k for p, k in zip(passes, counts)]
        rows, n, width = len(passes), max(counts), max(kept)
        prev = torch.zeros(rows, n, passes[0].prev.shape[-1], dtype=dtype, device=device)
        tokens = torch.zeros(rows, n, dtype=torch.long, device=device)
        positions = torch.zeros(rows, n, dtype=torch.long, device=device)
        visible = torch.zeros(rows, n, width + n, dtype=torch.bool, device=device)  # [R, n, C+n]
        own = torch.arange(n, device=device)
        visible[:, own, width + own] = True
        for r, (p, k, c) in enumerate(zip(passes, counts, kept)):
            prev[r, :k], tokens[r, :k], positions[r, :k] = p.prev.to(dtype), p.tokens, p.positions
            visible[r, :k, :c] = p.visible[:, :c]
            visible[r, :k, width: width + k] = p.visible[:, c:]
        mask = torch.zeros(rows, 1, n, width + n, dtype=dtype, device=device)
        mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
        cache = DynamicCache()
        for index, layers in enumerate(zip(*(p.drafter.cache.layers for p in passes))):
            _, heads_kv, _, key_dim = layers[0].keys.shape
            keys = layers[0].keys.new_zeros(rows, heads_kv, width, key_dim)
            values = layers[0].values.new_zeros(rows, heads_kv, width, layers[0].values.shape[-1])
            for r, (layer, c) in enumerate(zip(layers, kept)):
                keys[r, :, :c], values[r, :, :c] = layer.keys[0, :, :c], layer.values[0, :, :c]
            cache.update(keys, values, index)
        states = heads.step(prev, tokens, first.embed, positions, mask, cache)  # [R, n, H]
        for r, (p, k) in enumerate(zip(passes, counts)):  # each drafter keeps its own queries' entries
            for index, layer in enumerate(cache.layers):
                p.drafter.cache.update(layer.keys[r: r + 1, :, width: width + k],
                                       layer.values[r: r + 1, :, width: width + k], index)
        return [states[r, :k] for r, k in enumerate(counts)]


def _tokens_at(input_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T] at positions where [B, M]; 0 past the sequence's end."""
    inside = where < input_ids.shape[1]
    return input_ids.gather(1, where.clamp(max=input_ids.shape[1] - 1)).masked_fill(~inside, 0)
