"""The registry of head kinds: a name in ``HeadsConfig.kind`` -> the DraftHeads subclass that implements it.

A kind registers itself in its own module (``@register_head_kind("medusa")``); nothing else in tokenmaxx asks what
kind it holds. This module imports nothing of tokenmaxx, so the config, the loader and the kinds can all read it.
"""

from __future__ import annotations

HEAD_KINDS: dict[str, type] = {}
DEFAULT_HEAD_KIND = "eagle3"  # the kind of fresh heads and training runs when none is named: that of the shipped
# default heads, the one `export` writes (EAGLE-3 reads backbone layers 2, L//2 and L-3: a backbone of >= 7 layers)


def register_head_kind(name: str):
    """Class decorator: make a DraftHeads subclass loadable by ``HeadsConfig.kind == name``."""

    def wrap(cls):
        if name in HEAD_KINDS:
            raise ValueError(f"head kind {name!r} is already registered by {HEAD_KINDS[name].__name__}")
        HEAD_KINDS[name] = cls
        cls.kind = name
        return cls

    return wrap


def head_kind(name: str) -> type:
    """The class registered for ``name``; a ValueError listing the known kinds otherwise."""
    try:
        return HEAD_KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown head kind {name!r}: known kinds are {sorted(HEAD_KINDS)}") from None
