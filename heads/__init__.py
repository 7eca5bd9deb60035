"""Draft heads and backbones: what is trained and shipped."""

from .backbones import BACKBONES, DEFAULT_BACKBONE, BackboneSpec, backbone_identity, cache_dir, cpu_has_native_bf16, \
    import_gguf, load_backbone, register_backbone, resolve_device, resolve_dtype
from .config import HeadsConfig
from .drafting import Draft, Outcome, Prefill
from .dynamic_tree import DynamicTreeConfig
from .modeling import BackboneMismatchError, DraftHeads
from .registry import DEFAULT_HEAD_KIND, HEAD_KINDS, head_kind, register_head_kind
from .medusa import MedusaHeads  # noqa: E402  (registers the "medusa" kind)
from .mtp import MTPHeads  # noqa: E402  (registers the "mtp" kind)
from .eagle3 import Eagle3Heads  # noqa: E402  (registers the "eagle3" kind)
from .eagle3_export import export_eagle3, load_eagle3
from .pretrained import default_heads_path, resolve_heads
from .tree import Tree, TreeBuffers, chain, default_tree, parse_tree, sparse_tree

__all__ = ["BACKBONES", "DEFAULT_BACKBONE", "BackboneSpec", "backbone_identity", "cache_dir", "cpu_has_native_bf16",
           "import_gguf", "load_backbone", "register_backbone", "resolve_device", "resolve_dtype", "HeadsConfig",
           "Draft", "Outcome", "Prefill",
           "DynamicTreeConfig", "BackboneMismatchError", "DraftHeads", "DEFAULT_HEAD_KIND", "HEAD_KINDS",
           "head_kind", "register_head_kind", "MedusaHeads", "MTPHeads", "Eagle3Heads", "export_eagle3",
           "load_eagle3", "default_heads_path", "resolve_heads", "Tree", "TreeBuffers", "chain", "default_tree",
           "parse_tree", "sparse_tree"]
