"""Captured calls: a module's forward (or one of its steps) compiled once per input shape with
``torch.compile(mode="reduce-overhead")``, which on a GPU records each shape as a CUDA graph, replayed in one launch.

A small model's forward is ~1,000 kernel launches; on a GPU that is bound by the host, and replaying a recorded graph
takes it off. The callers keep the shapes few (a static KV cache, trees padded to a few sizes: ``inference/kv.py``;
the sequential drafter's passes padded to ``MODULE_BUCKETS`` queries: ``bucket``), so that a generation compiles a
handful of graphs, all in its first rounds, and later prompts of any length compile nothing. Where compiling fails
(no compiler, an operation it cannot trace) the call runs eagerly from then on, computing the same, and says so once
(``CaptureFallbackWarning``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch
from torch import nn


class CaptureFallbackWarning(UserWarning):
    """A call could not be captured (compiled) here and runs eagerly: same output, more launches."""


RECOMPILE_LIMIT = 64  # graphs dynamo keeps per function before it runs new shapes eagerly (its default is 8)
# One code object can serve several captured calls (transformers' forward decorators wrap every model's forward in
# one ``wrapper``), and each (bucket, cache length) is a graph: 8 can run out in one process with two backbones.

_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict[str, Callable | None]]" = weakref.WeakKeyDictionary()
# module -> name -> its compiled function, or None once compiling failed


def captured(module: nn.Module, name: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` through its compiled version (one per ``module`` and ``name``; a graph per input
    shape); eagerly once compiling failed, which is said once per module and name."""
    compiled = _COMPILED.setdefault(module, {})
    if name not in compiled:
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:  # (process-wide: raised, never lowered)
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
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


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The size ``n`` rows (tree nodes, queries) are padded to: the smallest of ``sizes`` (increasing) that holds
    them; past the largest, the next multiple of the largest. Each size is one graph of a captured call."""
    for size in sizes:
        if n <= size:
            return size
    return -(-n // sizes[-1]) * sizes[-1]
