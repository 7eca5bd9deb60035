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

import os
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

BACKENDS = {  # how a captured call is compiled: torch.compile's keywords (compile times: docs/benchmarks.md)
    # generated (fused) kernels, replayed as CUDA graphs: the fastest calls, the longest compiles
    "inductor": {"backend": "inductor", "mode": "reduce-overhead"},
    # the eager kernels recorded as CUDA graphs: the host's launches gone, not the kernels' count; no code generated
    "cudagraphs": {"backend": "cudagraphs"},
}
_backend: str | None = None  # set_capture_backend's choice; None: TOKENMAXX_CAPTURE_BACKEND, else "inductor"

_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], Callable | None]]" = \
    weakref.WeakKeyDictionary()  # module -> (name, backend) -> its compiled function, or None once compiling failed


def set_capture_backend(name: str | None) -> None:
    """How calls captured from now on are compiled (``BACKENDS``; those compiled before keep theirs): "inductor" (the
    default) for the fastest rounds, "cudagraphs" where compile time matters more (a short-lived process, a check).
    None: back to the environment's ``TOKENMAXX_CAPTURE_BACKEND``, else "inductor"."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"capture backend must be one of {sorted(BACKENDS)}, got {name!r}")
    _backend = name


def capture_backend() -> str:
    """The backend calls captured now compile with (``set_capture_backend``)."""
    name = _backend or os.environ.get("TOKENMAXX_CAPTURE_BACKEND") or "inductor"
    if name not in BACKENDS:
        raise ValueError(f"TOKENMAXX_CAPTURE_BACKEND must be one of {sorted(BACKENDS)}, got {name!r}")
    return name


def captured(module: nn.Module, name: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` through its compiled version (one per ``module``, ``name`` and backend; a graph per
    input shape); eagerly once compiling failed, which is said once per module, name and backend."""
    compiled = _COMPILED.setdefault(module, {})
    key = (name, capture_backend())
    if key not in compiled:
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:  # (process-wide: raised, never lowered)
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        compiled[key] = torch.compile(fn, fullgraph=False, dynamic=False, **BACKENDS[key[1]])
    run = compiled[key]
    if run is None:
        return fn(*args, **kwargs)
    try:
        torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are consumed: their memory may go
        return run(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure to compile: the eager call computes the same
        compiled[key] = None
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
