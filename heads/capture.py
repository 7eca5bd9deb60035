"""Captured calls: a module's forward (or one of its steps) compiled once per input shape with
``torch.compile(mode="reduce-overhead")``, which on a GPU records each shape as a CUDA graph, replayed in one launch.

A small model's forward is ~1,000 kernel launches; on a GPU that is bound by the host, and replaying a recorded graph
takes it off. The callers keep the shapes few (a static KV cache, trees padded to a few sizes: ``inference/kv.py``;
the sequential drafter's fixed-width frontiers). Where compiling fails (no compiler, an operation it cannot trace) the
call runs eagerly from then on, computing the same, and says so once (``CaptureFallbackWarning``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch
from torch import nn


class CaptureFallbackWarning(UserWarning):
    """A call could not be captured (compiled) here and runs eagerly: same output, more launches."""


_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict[str, Callable | None]]" = weakref.WeakKeyDictionary()
# module -> name -> its compiled function, or None once compiling failed


def captured(module: nn.Module, name: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` through its compiled version (one per ``module`` and ``name``; a graph per input
    shape); eagerly once compiling failed, which is said once per module and name."""
    compiled = _COMPILED.setdefault(module, {})
    if name not in compiled:
        compiled[name] = torch.compile(fn, mode="reduce-overhead", fullgraph=False, dynamic=False)
    run = compiled[name]
    if run is None:
        return fn(*args, **kwargs)
    try:
        torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are consumed: their memory may go
        return run(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure to compile: the eager call computes the same
        compiled[name] = None
        first = str(err).splitlines()[0] if str(err) else ""
        warnings.warn(CaptureFallbackWarning(f"capturing {type(module).__name__}.{name} failed "
                                             f"({type(err).__name__}: {first}); running it eagerly"), stacklevel=3)
        return fn(*args, **kwargs)
