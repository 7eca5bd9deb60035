"""HeadsConfig: what a set of draft heads is, and which backbone it was made for. Saved as config.json.

``backbone_identity`` reads the same identity off a loaded backbone, for the heads to be compared against."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .dynamic_tree import DynamicTreeConfig
from .registry import DEFAULT_HEAD_KIND, head_kind
from .tree import Tree

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class HeadsConfig:
    kind: str = field(default=DEFAULT_HEAD_KIND, metadata={
        "help": "head kind, a registered name: 'eagle3' (the default, registry.DEFAULT_HEAD_KIND: the kind of the "
                "shipped default heads and the one `export` writes), 'mtp' or 'medusa'"})
    num_heads: int = field(default=4, metadata={
        "help": "number of heads (Medusa) or draft depth (sequential kinds: EAGLE-3, MTP): head k, or depth d = k, "
                "predicts the token k+1 positions after the current one"})
    num_layers: int = field(default=1, metadata={
        "help": "residual blocks per head (Medusa) or decoder layers of the draft module (MTP; EAGLE-3: always 1)"})
    hidden_size: int = field(default=0, metadata={"help": "backbone hidden size H"})
    vocab_size: int = field(default=0, metadata={"help": "backbone vocabulary size V"})
    share_lm_head: bool = field(default=True, metadata={
        "help": "project with the backbone's frozen lm_head (small checkpoint) instead of a trained copy per head "
                "(Medusa only; the sequential kinds always share it)"})
    backbone: str | None = field(default=None, metadata={"help": "backbone alias / path / Hub id the heads were made for"})
    backbone_revision: str | None = field(default=None, metadata={"help": "backbone revision (GGUF sha256 or commit)"})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter merged into the backbone, if any"})
    adapter_revision: str | None = field(default=None, metadata={"help": "revision of that adapter"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "drafting projects onto this many frequent tokens (weights buffer 'draft_vocab') plus the prompt's "
                "tokens instead of the whole vocabulary: far cheaper guesses; None = the whole vocabulary"})
    layer_config: dict[str, Any] | None = field(default=None, metadata={
        "help": "kinds 'mtp', 'eagle3': the config (model_type and sizes) their decoder layers are built from"})
    feature_layers: list[int] | None = field(default=None, metadata={
        "help": "what the heads read of the backbone: None = its final-normed last hidden state (kinds 'medusa', "
                "'mtp'); a list = its hidden_states at these indices (i: the input of layer i, 0 the embeddings, L "
                "the final-normed output), concatenated (kind 'eagle3': a low, a middle and a high layer)"})
    tree: list[list[int]] | None = field(default=None, metadata={
        "help": "kinds that draft static trees (medusa): the tree as paths of ranks; None: the library's default"})
    dynamic_tree: DynamicTreeConfig | None = field(default=None, metadata={
        "help": "kinds that draft dynamic trees (the sequential kinds: eagle3, mtp): node budget, top-k, depth, "
                "min_mass; None: the defaults"})
    prompt_context: int | None = field(default=None, metadata={
        "help": "sequential kinds: how many of the prompt's last positions the module reads before the answer, in "
                "training and drafting alike (its attention's context); None: num_heads + 1, the fewest that every "
                "depth's target needs"})
    extra: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "provenance: training config, data, metrics (free-form, JSON-serialisable)"})

    def __post_init__(self) -> None:
        kind = head_kind(self.kind)  # ValueError listing the known kinds
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"HeadsConfig.{name} must be a positive integer, got {value!r}")
        if self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or not 0 < self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"HeadsConfig.draft_vocab_size must be None or an integer in [1, vocab_size "
                             f"{self.vocab_size}], got {self.draft_vocab_size!r}")
        if self.prompt_context is not None and (isinstance(self.prompt_context, bool) or not isinstance(
                self.prompt_context, int) or self.prompt_context < self.num_heads + 1):
            raise ValueError(f"HeadsConfig.prompt_context must be None or an integer >= num_heads + 1 = "
                             f"{self.num_heads + 1} (every depth's target needs that many), got "
                             f"{self.prompt_context!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(f"HeadsConfig.num_layers must be an integer >= 0, got {self.num_layers!r}")
        if self.tree is not None:
            tree = Tree(self.tree)  # validates paths
            if tree.depth > self.num_heads:
                raise ValueError(f"tree depth {tree.depth} exceeds num_heads {self.num_heads}")
            self.tree = [list(p) for p in tree.paths]
        if self.feature_layers is not None:
            layers = list(self.feature_layers)
            if not layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers) \
                    or len(set(layers)) != len(layers):
                raise ValueError(f"HeadsConfig.feature_layers must be None or distinct hidden-state indices >= 0, "
                                 f"got {self.feature_layers!r}")
            self.feature_layers = layers
        if isinstance(self.dynamic_tree, dict):
            self.dynamic_tree = DynamicTreeConfig.from_dict(self.dynamic_tree)
        elif self.dynamic_tree is not None and not isinstance(self.dynamic_tree, DynamicTreeConfig):
            raise ValueError(f"HeadsConfig.dynamic_tree must be a DynamicTreeConfig, a dict of its fields or None, "
                             f"got {self.dynamic_tree!r}")
        kind.check_config(self)  # what only this kind knows (which tree settings it drafts with, ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadsConfig":
        known = {f.name for f in fields(cls)}
        extra = data.get("extra")
        if "dynamic_tree" not in data and isinstance(extra, dict) and isinstance(extra.get("dynamic_tree"), dict):
            # configs saved before the typed field kept the dynamic tree in the free-form provenance
            extra = dict(extra)
            data = {**data, "dynamic_tree": extra.pop("dynamic_tree"), "extra": extra}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown HeadsConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "HeadsConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"heads config {path} is missing")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"heads config {path} is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"heads config {path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)


def lookback(config) -> int:
    """Prompt positions before the last one that the heads read (training windows, ``batches.window_start``, and the
    drafter's start): ``prompt_context - 1``, or ``num_heads`` (every depth's target) when it is not set."""
    return config.prompt_context - 1 if getattr(config, "prompt_context", None) else config.num_heads


def backbone_identity(model) -> tuple[str, str | None]:
    """(backbone id, revision) of a loaded model: the alias and GGUF sha256 for aliases (``config.json``'s
    ``tokenmaxx_backbone`` / ``tokenmaxx_revision``, written by ``io.backbones``), else its path/Hub id."""
    cfg = model.config
    ident = getattr(cfg, "tokenmaxx_backbone", None) or cfg.name_or_path
    revision = getattr(cfg, "tokenmaxx_revision", None) or getattr(cfg, "_commit_hash", None)
    return ident, revision
