"""Heads shipped inside the package (heads/pretrained/<backbone alias>/)."""

from __future__ import annotations

from pathlib import Path

PRETRAINED_DIR = Path(__file__).parent / "pretrained"


def default_heads_path(backbone: str) -> Path | None:
    """Folder of the shipped heads for a backbone alias, or None when none are shipped."""
    path = PRETRAINED_DIR / backbone
    return path if (path / "config.json").is_file() else None


def resolve_heads(spec: str | None, model, backbone: str, fallback_untrained: bool = False):
    """Heads for a command line's ``--heads``: a folder / Hub id, 'untrained' (fresh heads), or None for the heads
    shipped for ``backbone`` (untrained ones, with a note on stderr, when ``fallback_untrained`` and none ship)."""
    import sys

    from .medusa import MedusaHeads
    from .modeling import DraftHeads

    if spec == "untrained":
        return MedusaHeads.for_backbone(model)
    path = spec or default_heads_path(backbone)
    if path is None:
        if not fallback_untrained:
            raise FileNotFoundError(f"no heads are shipped for {backbone!r}: pass --heads PATH_OR_REPO (or 'untrained')")
        print(f"note: no trained heads are shipped for {backbone!r}; using untrained heads (expect no speedup). "
              "Pass --heads PATH_OR_REPO.", file=sys.stderr)
        return MedusaHeads.for_backbone(model)
    return DraftHeads.from_pretrained(path)
