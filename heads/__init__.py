"""Draft heads and backbones: what is trained and shipped.

The model: ``modeling`` (the ``DraftHeads`` base) and the head kinds (medusa, mtp, eagle3), their config, trees and
drafting. Its distribution, which the model never imports: ``io`` (backbone loader, ``load_heads`` / ``push_heads``,
model cards, shipped heads, EAGLE-3 export). What machine this is: ``machine``.
"""

from .config import HeadsConfig, backbone_identity
from .drafting import Draft, Outcome, Prefill
from .dynamic_tree import DynamicTreeConfig
from .machine import cpu_has_native_bf16
from .modeling import BackboneMismatchError, DraftHeads
from .registry import DEFAULT_HEAD_KIND, HEAD_KINDS, head_kind, register_head_kind
from .medusa import MedusaHeads  # noqa: E402  (registers the "medusa" kind)
from .mtp import MTPHeads  # noqa: E402  (registers the "mtp" kind)
from .eagle3 import Eagle3Heads  # noqa: E402  (registers the "eagle3" kind)
from .tree import Tree, TreeBuffers, chain, default_tree, parse_tree, sparse_tree
from .io import BACKBONES, DEFAULT_BACKBONE, BackboneSpec, cache_dir, default_heads_path, export_eagle3, import_gguf, \
    export_speculators, load_backbone, load_eagle3, load_heads, push_heads, register_backbone, resolve_device, \
    resolve_dtype, resolve_heads

__all__ = ["BACKBONES", "DEFAULT_BACKBONE", "BackboneSpec", "backbone_identity", "cache_dir", "cpu_has_native_bf16",
           "import_gguf", "load_backbone", "register_backbone", "resolve_device", "resolve_dtype", "HeadsConfig",
           "Draft", "Outcome", "Prefill", "DynamicTreeConfig", "BackboneMismatchError", "DraftHeads",
           "DEFAULT_HEAD_KIND", "HEAD_KINDS", "head_kind", "register_head_kind", "MedusaHeads", "MTPHeads",
           "Eagle3Heads", "export_eagle3", "export_speculators", "load_eagle3", "default_heads_path",
           "resolve_heads", "load_heads", "push_heads", "Tree", "TreeBuffers", "chain", "default_tree", "parse_tree",
           "sparse_tree"]
