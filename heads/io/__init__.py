"""Distribution of draft heads and backbones: everything that reads or writes outside the process.

backbones       backbone loader: registered aliases (GGUF from PyPI wheels, converted into ``cache_dir()``), HF folders,
                Hub ids (``load_backbone``; ``python -m tokenmaxx.heads.io.backbones --import`` for a copied GGUF)
loading         strict loading of a saved heads folder (``load_folder``); which specs are paths, which Hub ids
hub             ``load_heads`` (a folder or a Hub repo id), ``push_heads`` (one commit with a model card)
card            the Hub model card (rendered offline from ``model_cards/heads_card.md.jinja``)
pretrained      the heads shipped in ``heads/pretrained/`` (``default_heads_path``, ``resolve_heads``)
eagle3_export   EAGLE-3 checkpoints for vLLM / SGLang (``export_eagle3``, ``load_eagle3``)
speculators_export  the same heads in the vLLM project's speculators layout (``export_speculators``)

The model code (``heads.modeling`` and the head kinds) imports nothing from here.
"""

from .backbones import BACKBONES, CACHE_ENV, DEFAULT_BACKBONE, DEVICE_HELP, DTYPES, BackboneSpec, cache_dir, \
    import_gguf, load_backbone, register_backbone, resolve_backbone, resolve_device, resolve_dtype
from .eagle3_export import ExportError, export_eagle3, load_eagle3
from .speculators_export import export_speculators
from .hub import HubAuthError, HubUnreachableError, download_heads, load_heads, push_heads
from .loading import load_folder
from .pretrained import default_heads_path, resolve_heads, shipped_heads

__all__ = ["BACKBONES", "CACHE_ENV", "DEFAULT_BACKBONE", "DEVICE_HELP", "DTYPES", "BackboneSpec", "cache_dir",
           "import_gguf", "load_backbone", "register_backbone", "resolve_backbone", "resolve_device",
           "resolve_dtype", "ExportError", "export_eagle3", "load_eagle3", "export_speculators", "HubAuthError",
           "HubUnreachableError", "download_heads", "load_heads", "push_heads", "load_folder", "default_heads_path",
           "resolve_heads", "shipped_heads"]
