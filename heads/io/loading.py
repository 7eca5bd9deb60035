"""Strict loading of a saved heads folder (config.json + model.safetensors), for ``hub.load_heads`` and
``hub.push_heads``; and which heads specs name a local folder rather than a Hub repo id."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig
from ..registry import head_kind


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` can only be a local path, never a Hub repo id ("org/name"): it starts with ``./``, ``../``,
    ``/`` or ``~``, ends with ``/``, or has more than one ``/``."""
    return spec.startswith(("./", "../", "/", "~")) or spec in (".", "..") or spec.endswith("/") or spec.count("/") > 1


def missing_folder(spec: str | os.PathLike) -> str:
    """What a heads spec that names no folder says about the local side: the folder, resolved, and a hint when it
    is a file, or when its parent exists (a typo in the last part)."""
    folder = Path(spec).expanduser().resolve()
    if folder.exists():
        return f"{folder} is a file, not a heads folder (one holding {CONFIG_NAME} and {WEIGHTS_NAME})"
    named_parent = Path(spec).expanduser().parent != Path(".") and folder.parent != Path(folder.anchor)
    hint = f" (its parent {folder.parent} exists: a typo?)" if named_parent and folder.parent.is_dir() else ""
    return f"no such heads folder {folder}{hint}"


def load_folder(folder: str | Path, dtype: torch.dtype | None = None):
    """The heads saved in ``folder``, of the kind their config names: every weight present, of the expected shape,
    and nothing else (safetensors only). ValueError / FileNotFoundError name the file and what was wrong."""
    folder = Path(folder)
    config = HeadsConfig.from_json_file(folder / CONFIG_NAME)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"heads weights {weights} are missing")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"heads weights {weights} are corrupt or truncated ({err})") from None
    heads = head_kind(config.kind)(config)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"heads weights {weights} do not match a {config.kind!r} config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"heads weight {name!r} in {weights} has shape {tuple(tensor.shape)}, "
                             f"the config expects {tuple(expected[name].shape)}")
    heads.load_state_dict(state, strict=True)
    if dtype is not None:
        heads.to(dtype)
    return heads.eval()


def check_repo_id(repo_id: str) -> str:
    """Return ``repo_id`` if it is a valid Hub model id ("org/name" or "name"), else raise ValueError naming it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str):
        raise ValueError(f"repo id must be a string like 'org/name', got {type(repo_id).__name__} {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"malformed Hub repo id {repo_id!r}: expected 'org/name' (letters, digits, '-', '_', '.'; "
                         f"at most 96 characters per part) ({err})") from None
    return repo_id


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` has the form of a Hub repo id that heads can live under: "org/name", valid."""
    with contextlib.suppress(ValueError):
        return isinstance(spec, str) and spec.count("/") == 1 and check_repo_id(spec) == spec
    return False


def write_atomic(path: Path, write) -> None:
    """``write(temp_path)`` then rename it to ``path``: a killed process leaves the old file or none, never half of
    one (the temp file is removed when ``write`` fails)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
