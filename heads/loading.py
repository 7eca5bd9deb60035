"""Strict loading of saved heads (config.json + model.safetensors), for ``DraftHeads.from_pretrained`` and the Hub."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import CONFIG_NAME, WEIGHTS_NAME, HeadsConfig
from .registry import head_kind


def load_heads(folder: str | Path, dtype: torch.dtype | None = None):
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
