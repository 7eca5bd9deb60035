"""Draft heads and backbones: what is trained and shipped."""

from .backbones import BACKBONES, DEFAULT_BACKBONE, BackboneSpec, backbone_identity, cache_dir, load_backbone, \
    register_backbone
from .config import HeadsConfig
from .modeling import HEAD_KINDS, BackboneMismatchError, DraftHeads, register_head_kind
from .medusa import MedusaHeads  # noqa: F401  (registers the "medusa" kind)
from .mtp import MTPHeads  # noqa: F401  (registers the "mtp" kind)
from .pretrained import default_heads_path, resolve_heads

__all__ = ["BACKBONES", "DEFAULT_BACKBONE", "BackboneSpec", "backbone_identity", "cache_dir", "load_backbone",
           "register_backbone", "HeadsConfig", "HEAD_KINDS", "BackboneMismatchError", "DraftHeads",
           "register_head_kind", "MedusaHeads", "MTPHeads", "default_heads_path", "resolve_heads"]
