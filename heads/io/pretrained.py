"""Heads shipped inside the package (heads/pretrained/<backbone alias>/)."""

from __future__ import annotations

from pathlib import Path

from ..registry import DEFAULT_HEAD_KIND, head_kind
from .hub import load_heads

PRETRAINED_DIR = Path(__file__).parent.parent / "pretrained"


def default_heads_path(backbone: str, kind: str | None = None) -> Path | None:
    """Folder of the shipped heads for a backbone alias (the default ones, or those of head ``kind``), or None.

    The default heads live in ``pretrained/<alias>/``; other kinds shipped beside them in ``pretrained/<alias>-<kind>/``.
    A folder or a Hub id (anything with a path separator) has none: heads ship for aliases only.
    """
    if not backbone or "/" in backbone or "\\" in backbone or backbone in (".", ".."):
        return None
    if kind is None:
        path = PRETRAINED_DIR / backbone
        return path if (path / "config.json").is_file() else None
    return shipped_heads(backbone).get(kind)


def shipped_heads(backbone: str) -> dict[str, Path]:
    """Head kind -> folder, for every set of heads shipped for ``backbone``."""
    import json

    found: dict[str, Path] = {}
    for path in sorted(PRETRAINED_DIR.iterdir()):  # the alias folder sorts first: it wins for its own kind
        config = path / "config.json"
        if not config.is_file() or not (path.name == backbone or path.name.startswith(f"{backbone}-")):
            continue
        kind = json.loads(config.read_text()).get("kind", DEFAULT_HEAD_KIND)
        if (path.name == backbone or path.name == f"{backbone}-{kind}") and kind not in found:
            found[kind] = path
    return found


def resolve_heads(spec: str | None, model, backbone: str, fallback_untrained: bool = False, kind: str | None = None):
    """Heads for a command line's ``--heads``: a folder / Hub id, 'untrained' (fresh heads of ``kind``, default
    ``DEFAULT_HEAD_KIND``), or None for the heads shipped for ``backbone`` (of ``kind`` when given; untrained ones, with a note on
    stderr, when ``fallback_untrained`` and none ship)."""
    import sys

    fresh = head_kind(kind or DEFAULT_HEAD_KIND)
    if spec == "untrained":
        return fresh.for_backbone(model)
    path = spec or default_heads_path(backbone, kind)
    if path is None:
        if not fallback_untrained:
            what = f"{kind} heads" if kind else "heads"
            raise FileNotFoundError(f"no {what} are shipped for {backbone!r}: pass a heads folder / Hub id "
                                    "(or 'untrained')")
        print(f"note: no trained heads are shipped for {backbone!r}; using untrained heads (expect no speedup). "
              "Pass --heads PATH_OR_REPO.", file=sys.stderr)
        return fresh.for_backbone(model)
    heads = load_heads(path)
    if kind is not None and heads.config.kind != kind:
        raise ValueError(f"heads {path} are of kind {heads.config.kind!r}, expected {kind!r}")
    return heads
