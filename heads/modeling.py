"""Draft heads: the common base of all head kinds (contract, save, backbone checks).

A head kind is one module that subclasses ``DraftHeads``, registers its name (``registry.register_head_kind``) and
says what it does: its training-time outputs (``training_states`` / ``project``), which tree settings it drafts with
(``tree_settings``) and the drafter that proposes its trees at inference (``drafter``). Nothing outside the kind's
module asks which kind it holds.

Loading saved heads (a folder or a Hub repo id) and pushing them to the Hub live in ``heads.io`` (``load_heads``,
``push_heads``): this module is the model alone.
"""

from __future__ import annotations

import os
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig, backbone_identity


class BackboneMismatchError(ValueError):
    """Heads were made for a different backbone than the one they are attached to."""


class BackboneIdentityWarning(UserWarning):
    """Heads name the backbone they were made for, but the model they are attached to carries no name to check."""


# model -> the heads' backbone names already warned about for it (each warning once per model and name)
_UNNAMED_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warn_unnamed_backbone(model, backbone: str, revision: str | None) -> None:
    """Warn (once per model object and heads backbone) that only the shapes of ``model`` could be checked."""
    warned = _UNNAMED_WARNED.setdefault(model, set())
    if backbone in warned:
        return
    warned.add(backbone)
    warnings.warn(f"heads were made for backbone {backbone!r} (revision {revision}), but this model carries no "
                  "identity (neither config.tokenmaxx_backbone nor config.name_or_path), so whether it is that "
                  "backbone could not be checked: only its hidden size and vocabulary match. Load it with "
                  "load_backbone(...) or from_pretrained(...), which record it; strict_identity=False skips this "
                  "check knowingly", BackboneIdentityWarning, stacklevel=3)


def backbone_features(hidden_states, layers) -> torch.Tensor:
    """What heads read of a backbone forward run with ``output_hidden_states=True``.

    hidden_states: the forward's tuple (index i: the input of layer i; 0 the embeddings, the last the final-normed
    output), each [..., H]. layers: None -> the final-normed last state [..., H]; indices -> those states concatenated
    in the given order [..., len(layers) * H] (``HeadsConfig.feature_layers``).
    """
    if layers is None:
        return hidden_states[-1]
    if max(layers) >= len(hidden_states):
        raise ValueError(f"feature layers {list(layers)} need hidden states up to index {max(layers)}, but the "
                         f"backbone returns {len(hidden_states)} (indices 0..{len(hidden_states) - 1})")
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def _backbone_shapes(model) -> tuple[int, int]:
    """(hidden size, vocabulary size) as the backbone's lm_head actually has them."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    return hidden, vocab


class DraftHeads(nn.Module):
    """Base of all head kinds.

    The contract every kind keeps (head offset rule: head k reading position t targets the token at t+k+1; K is the
    number of heads for Medusa and the draft depth for the sequential kinds, EAGLE-3 and MTP, whose depth d plays
    head k = d):

    - ``forward(hidden [B, T, H], input_ids [B, T], *, lm_head, embed=None)`` -> logits ``[K, B, T, V]``: what the
      heads predict at every position of a sequence the backbone has read (training and evaluation);
    - ``training_states(hidden, input_ids, embed, selected [B, T] bool)`` -> ``[K, n, H]``: the same before the
      vocabulary projection, at the selected positions only (the loss projects them, possibly fused);
    - ``project(states [K, ..., H], lm_head)`` -> ``[K, ..., V]``: the heads' vocabulary projection;
    - ``drafter(model, tree, draft_vocab)``: a fresh drafter for one generation (``tokenmaxx.inference.drafting``);
    - ``tree_settings(config, spec)`` / ``check_config(config)`` / ``card_sections(config)``: the kind's draft tree
      settings, parsed, validated and described.
    """

    kind: str = ""
    own_lm_head: bool = True  # the kind can train a vocabulary projection of its own (share_lm_head=False)

    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        # which backbone hidden states the heads read (``backbone_features``): None, the final-normed last one
        self.feature_layers: tuple[int, ...] | None = \
            None if config.feature_layers is None else tuple(config.feature_layers)
        # [Vd] long token ids drafting projects onto (None: all); saved with the weights when set
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    # ---- draft vocabulary ---------------------------------------------------------------------------------------
    def set_draft_vocab(self, token_ids) -> None:
        """Restrict drafting to these token ids (plus each prompt's own tokens at generation time); None: all.

        Drafting then projects onto a [Vd, H] slice of the lm_head instead of [V, H]: guesses cost a fraction of the
        time, and a token outside the slice (and outside the prompt) can no longer be guessed. Verification is
        untouched, so the output is the backbone's either way.
        """
        if token_ids is None:
            self.draft_vocab, self.config.draft_vocab_size = None, None
            return
        ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.long))
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be non-empty and within [0, {self.config.vocab_size})")
        self.draft_vocab = ids
        self.config.draft_vocab_size = int(ids.numel())

    # ---- backbone compatibility -------------------------------------------------------------------------------
    def check_backbone(self, model, strict_identity: bool = True) -> None:
        """Raise BackboneMismatchError if these heads cannot run on ``model``; warn (BackboneIdentityWarning, once
        per model) when the heads name their backbone but ``model`` has no name to check it against."""
        hidden, vocab = _backbone_shapes(model)
        cfg = self.config
        if (hidden, vocab) != (cfg.hidden_size, cfg.vocab_size):
            raise BackboneMismatchError(
                f"heads expect hidden size {cfg.hidden_size} and vocabulary {cfg.vocab_size} "
                f"(made for backbone {cfg.backbone!r}), but the backbone has hidden size {hidden} and vocabulary {vocab}")
        depth = getattr(model.config, "num_hidden_layers", None)
        if self.feature_layers and depth is not None and max(self.feature_layers) > depth:
            raise BackboneMismatchError(
                f"heads read backbone hidden states {list(self.feature_layers)}, but the backbone has {depth} layers "
                f"(hidden-state indices 0..{depth})")
        ident, revision = backbone_identity(model)
        if strict_identity and cfg.backbone and not ident:
            _warn_unnamed_backbone(model, cfg.backbone, cfg.backbone_revision)
        if strict_identity and cfg.backbone and ident and cfg.backbone != ident:
            raise BackboneMismatchError(
                f"heads were made for backbone {cfg.backbone!r} (revision {cfg.backbone_revision}), "
                f"not {ident!r} (revision {revision}); pass strict_identity=False if they really are the same model")
        if strict_identity and cfg.backbone_revision and revision and cfg.backbone_revision != revision \
                and cfg.backbone == ident:
            raise BackboneMismatchError(
                f"heads were made for {cfg.backbone!r} at revision {cfg.backbone_revision}, "
                f"but the backbone is at revision {revision}")
        adapter = getattr(model.config, "tokenmaxx_adapter", None)
        adapter_revision = getattr(model.config, "tokenmaxx_adapter_revision", None)
        if strict_identity and (cfg.adapter is not None or adapter is not None):
            # revisions (content hashes / commits) when both have one: paths may differ per machine
            if (cfg.adapter_revision != adapter_revision if cfg.adapter_revision and adapter_revision
                    else cfg.adapter != adapter):
                raise BackboneMismatchError(
                    f"heads were made for the backbone with adapter {cfg.adapter!r} (revision {cfg.adapter_revision}) "
                    f"merged in, but this backbone has adapter {adapter!r} (revision {adapter_revision}); "
                    "load it with load_backbone(..., adapter=...)")

    @classmethod
    def for_backbone(cls, model, **config_kwargs) -> "DraftHeads":
        """New (untrained) heads sized for ``model`` and initialised from it."""
        hidden, vocab = _backbone_shapes(model)
        ident, revision = backbone_identity(model)
        config = HeadsConfig(kind=cls.kind, hidden_size=hidden, vocab_size=vocab, backbone=ident,
                             backbone_revision=revision, adapter=getattr(model.config, "tokenmaxx_adapter", None),
                             adapter_revision=getattr(model.config, "tokenmaxx_adapter_revision", None),
                             **config_kwargs)
        heads = cls(config)
        heads.init_from_backbone(model)
        return heads

    def init_from_backbone(self, model) -> None:
        """Initialise weights that start as copies of the backbone's (e.g. per-head lm_heads)."""

    # ---- what each kind implements ----------------------------------------------------------------------------
    def training_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: nn.Module | None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H], input_ids [B, T] -> states [K, n, H] at the ``selected`` [B, T] positions (all: [K, B,
        T, H]), ready for ``project``."""
        raise NotImplementedError

    def project(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """states [K, ..., H] -> logits [K, ..., V] (the backbone's frozen lm_head unless the kind has its own)."""
        return lm_head(states)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, *, lm_head: nn.Module,
                embed: nn.Module | None = None) -> torch.Tensor:
        """hidden [B, T, H] final-normed backbone states, input_ids [B, T] -> logits [K, B, T, V]; row k-1 at t
        targets the token at t+k+1."""
        return self.project(self.training_states(hidden, input_ids, embed), lm_head)

    def drafter(self, model, tree=None, draft_vocab: bool = True):
        """A fresh drafter for one generation on ``model``, with the protocol's ``feature_layers``, ``describe``,
        ``start``, ``propose`` (or ``propose_steps``), ``observe`` and ``share_forward`` (``inference.drafting``,
        ``Drafter``), and ``passes``, how its module calls run (``drafting.Eager``); ``tree``: this kind's tree
        settings as ``tree_settings`` parsed them (None: the config's own); ``draft_vocab``: guess over the heads'
        draft vocabulary."""
        raise NotImplementedError

    def parsed_settings(self, settings, expected: type):
        """``settings`` if they are parsed tree settings of this kind (an ``expected``), the config's own for None;
        a TypeError for a spec (a spec is parsed once, by ``tree_settings``, where the generator is built)."""
        if settings is None:
            return self.tree_settings(self.config)
        if not isinstance(settings, expected):
            raise TypeError(f"{self.kind!r} heads draft with parsed {expected.__name__} settings, got "
                            f"{settings!r}: parse a spec with tree_settings(config, spec) first")
        return settings

    @classmethod
    def tree_settings(cls, config: HeadsConfig, spec=None):
        """This kind's draft tree settings from ``spec`` (None: the config's own), validated."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, config: HeadsConfig) -> None:
        """Raise ValueError for settings this kind cannot use."""

    @classmethod
    def card_sections(cls, config: HeadsConfig) -> dict[str, str]:
        """Markdown for the model card: ``summary`` (what the heads are: the noun phrase of the card's opening),
        ``how`` (what a draft reads and which tree it fills), ``rows`` ((what, value) rows of the card's "Heads"
        table), ``tree_section`` (how the kind drafts its trees), ``tau_note`` (a sentence after the held-out
        accuracies; may be empty), ``unit`` (what the accuracy table's rows are: "head" or "depth") and
        ``accuracy_note`` (a sentence before that table; may be empty)."""
        raise NotImplementedError

    # ---- save (loading: heads.io.load_heads) --------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write config.json + model.safetensors. Each file is written under a temp name then renamed."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        for name, write in ((WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"})),
                            (CONFIG_NAME, lambda p: Path(p).write_text(self.config.to_json_string()))):
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
            os.close(fd)
            try:
                write(tmp)
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; keep the usual permissions
                os.replace(tmp, out / name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
