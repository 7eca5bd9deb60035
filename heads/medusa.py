"""Medusa heads: K independent heads on the backbone's last hidden state.

Head k (k = 1..K) is L residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so an untrained head starts as the
identity) followed by a projection to the vocabulary: the backbone's frozen lm_head (``share_lm_head``, checkpoints of a
few MB) or the head's own copy of it. Head k reading the hidden state at position t targets the token at t+k+1.

Drafting (``MedusaDrafter``): a *static* tree (``tree.py``: paths of ranks, compiled once) is filled with each head's
top-k guesses at the last accepted position; every head guesses the same tokens whatever the parent node.
"""

from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from torch import nn

from .draft_vocab import DraftVocab
from .drafting import EAGER, HEADS, Draft, Outcome, Prefill
from .dynamic_tree import DynamicTreeConfig
from .modeling import DraftHeads
from .registry import register_head_kind
from .tree import TYPICAL_RANK_ACCURACY, Tree, parse_tree, path_probability


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return x + F.silu(self.linear(x))


@register_head_kind("medusa")
class MedusaHeads(DraftHeads):
    def __init__(self, config):
        super().__init__(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(config.num_layers))) for _ in range(config.num_heads))
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            nn.Linear(hidden, vocab, bias=False) for _ in range(config.num_heads))

    def init_from_backbone(self, model) -> None:
        if self.lm_heads is not None:
            weight = model.get_output_embeddings().weight
            for head in self.lm_heads:
                head.weight.data.copy_(weight.detach().to(head.weight.dtype))

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> per-head states before the vocabulary projection [K, ..., H]."""
        return torch.stack([blocks(hidden) for blocks in self.blocks])

    def project(self, states: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
        """states [K, ..., H] -> logits [K, ..., V]: one matmul with the shared lm_head, or each head's own."""
        if self.lm_heads is None:
            if lm_head is None:
                raise ValueError("these heads share the backbone's lm_head: pass it as lm_head=")
            return lm_head(states)
        return torch.stack([proj(s) for proj, s in zip(self.lm_heads, states)])

    def training_states(self, hidden: torch.Tensor, input_ids: torch.Tensor | None, embed: nn.Module | None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] -> [K, n, H] at the selected [B, T] positions (all: [K, B, T, H]); each position on its
        own, so only the selected ones are computed (the tokens are not read)."""
        return self.head_states(hidden if selected is None else hidden[selected])

    def draft_logits(self, hidden: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
        """hidden [..., H] (the backbone state at t) -> logits [K, ..., V]; row k-1 targets the token at t+k+1."""
        return self.project(self.head_states(hidden), lm_head)

    # ---- drafting -------------------------------------------------------------------------------------------------
    def drafter(self, model, tree: Tree | None = None, draft_vocab: bool = True) -> "MedusaDrafter":
        return MedusaDrafter(self, model, self.parsed_settings(tree, Tree), draft_vocab=draft_vocab)

    @classmethod
    def tree_settings(cls, config, spec=None) -> Tree:
        """A static tree: ``spec`` ('default', 'chain:K', a list of paths, a JSON list or file; None: the config's
        tree, else the library's default), at most ``num_heads`` deep."""
        if isinstance(spec, DynamicTreeConfig) or (isinstance(spec, str) and spec.startswith("dynamic")):
            raise ValueError(f"tree {spec!r}: dynamic trees are drafted by sequential heads (such as kind 'mtp'); "
                             f"these heads are {config.kind!r}: use a static tree ('default', 'chain:K', 'auto' or a "
                             "list of paths)")
        tree = parse_tree(spec if spec is not None else config.tree, config.num_heads)
        if tree.depth > config.num_heads:
            raise ValueError(f"tree depth {tree.depth} exceeds the number of heads ({config.num_heads})")
        return tree

    @classmethod
    def check_config(cls, config) -> None:
        if config.feature_layers is not None:
            raise ValueError(f"{config.kind!r} heads read the backbone's final state: feature_layers must be None")
        if config.dynamic_tree is not None:
            raise ValueError(f"{config.kind!r} heads draft static trees (HeadsConfig.tree): dynamic_tree must be None")

    @classmethod
    def card_sections(cls, config) -> dict[str, str]:
        tree = cls.tree_settings(config)
        metrics = (config.extra or {}).get("metrics") or {}
        tau, nodes, product = (metrics.get(k) for k in ("tree_tau_empirical", "tree_nodes", "tree_tau_product"))
        which = f"the {nodes}-node tree the training run evaluated (not the tree below)" \
            if isinstance(nodes, int) and nodes != tree.num_nodes else "the tree below"
        tau_note = (f" Expected tokens per backbone\nforward with {which} (tau): "
                    f"{tau if isinstance(tau, (int, float)) else 'not recorded'} measured on the\nheld-out data"
                    + (f", {product} from the per-head accuracies alone" if isinstance(product, (int, float)) else "")
                    + ".")
        own = "The heads' own tree" if config.tree is not None else "The library's default tree"
        section = (f"{own}: {tree.num_nodes} nodes (root included),\ndepth {tree.depth}. Each path lists ranks: the "
                   "r1-th best guess of head 1, then the r2-th best of head 2, ...\n\n```json\n"
                   f"{json.dumps([list(p) for p in tree.paths])}\n```")
        return {"tau_note": tau_note, "tree_section": section, "unit": "head", "accuracy_note": "",
                "summary": f"{config.num_heads} Medusa heads",
                "how": "Head k reads the backbone's last hidden state at position t and guesses the token at t+k+1; "
                       "the heads' top guesses fill a static tree (below).",
                "rows": [("heads (K)", str(config.num_heads)), ("residual blocks per head", str(config.num_layers))]}


@functools.lru_cache(maxsize=64)
def static_values(tree: Tree, device: torch.device) -> torch.Tensor:
    """Estimated acceptance probability [N] of each node of a static tree (root first) on ``device``: the product of
    typical per-rank head accuracies along its path (``tree.TYPICAL_RANK_ACCURACY``, what the default tree is grown
    from)."""
    return torch.tensor([1.0] + [path_probability(TYPICAL_RANK_ACCURACY, path) for path in tree.paths], device=device)


class MedusaDrafter:
    """Static-tree drafting: each head's top-k at the last accepted position, laid on the tree's paths.

    ``propose(root, room)`` fills the tree cut to ``room`` levels; ``observe`` keeps the backbone state at the last
    accepted node for the next round. With a draft vocabulary the guesses project onto it (plus the prompt's tokens)
    instead of the whole vocabulary.
    """

    def __init__(self, heads: MedusaHeads, model, tree: Tree, draft_vocab: bool = True):
        self.heads, self.tree = heads, tree
        self.passes = EAGER  # how the heads' calls run (``drafting.Eager``; the inference side may hand others)
        self.feature_layers = heads.feature_layers  # None: the final-normed last state
        self.lm_head = model.get_output_embeddings()
        self.device = self.lm_head.weight.device  # the backbone's: drafts live there
        self.use_vocab = bool(draft_vocab) and heads.draft_vocab is not None and heads.config.share_lm_head
        self.vocab: DraftVocab | None = None
        self.hidden: torch.Tensor | None = None  # [H] backbone state at the last accepted position
        self.root_token: torch.Tensor | None = None  # [1] long: the next root on the device (from ``observe``)

    @property
    def nodes(self) -> int:
        """The node budget of one round (root included)."""
        return self.tree.num_nodes

    def describe(self) -> str:
        return f"static tree, {self.tree.num_nodes} nodes"

    def start(self, prefill: Prefill) -> None:
        self.vocab = DraftVocab.for_prompt(self.heads.draft_vocab, self.lm_head, prefill.input_ids) \
            if self.use_vocab else None
        self.hidden = prefill.hidden[-1]
        self.root_token = torch.tensor([prefill.root], dtype=torch.long, device=self.device)

    def propose(self, root: int, room: int) -> Draft:
        tree = self.tree.truncate(room)
        buffers = tree.buffers
        if buffers.num_nodes == 1:
            return Draft.root_only(root, self.device)
        if self.vocab is not None:
            logits = self.vocab.logits(self._call("head_states", self.hidden)[: buffers.depth])  # [D, Vd]
            topk = self.vocab.ids[logits.topk(min(buffers.topk, logits.shape[-1]), dim=-1).indices]  # [D, k]
        else:
            logits = self._call("draft_logits", self.hidden, self.lm_head)[: buffers.depth]  # [D, V]
            topk = logits.topk(buffers.topk, dim=-1).indices  # [D, k]
        flat = torch.cat([self.root_token, topk.flatten()])  # [1 + D*k]
        tokens = flat[buffers.to(self.device).token_index]  # [N]
        return Draft(tokens=tokens, buffers=buffers, sources=torch.full_like(tokens, HEADS),
                     values=static_values(tree, self.device))

    def _call(self, name: str, *args):
        """The heads' ``name`` method on ``args``, as this drafter's passes run."""
        return self.passes.call(self.heads, name, getattr(self.heads, name), *args)

    def share_forward(self, rows: int) -> None:
        """(Its tree is as large whatever a forward verifies beside it.)"""

    def observe(self, outcome: Outcome) -> None:
        self.hidden = outcome.hidden[-1]
        self.root_token = outcome.token_ids[-1:]
