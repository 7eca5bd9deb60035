"""Heads shipped inside the package (heads/pretrained/<backbone alias>/)."""

from __future__ import annotations

from pathlib import Path

PRETRAINED_DIR = Path(__file__).parent / "pretrained"


def default_heads_path(backbone: str) -> Path | None:
    """Folder of the shipped heads for a backbone alias, or None when none are shipped."""
    path = PRETRAINED_DIR / backbone
    return path if (path / "config.json").is_file() else None
