"""How forwards run on this machine: one ``Runner``, handed to the loop. The method (loop, drafters, verify / accept
/ commit) runs every tree verify as ``runner(model, **inputs)`` and does not know what the runner adds:

- ``attention``: keywords for the attention function (``tokenmaxx.heads.attention.shared_kv_kwargs``: on a CPU, a
  masked forward lets SDPA share the key/value heads of grouped-query layers instead of copying them). Passed to
  forwards of one row only: with per-row masks of several rows, SDPA took its slow path on a CPU
  (docs/benchmarks.md, "Batches").
- ``small_rows``: a plan of the tree sizes whose verifies compute (some of) the backbone's linear layers as
  ``(W @ x^T)^T`` (``transposed_linears``). On some CPU BLAS builds ``x @ W^T`` takes a path made for large batches
  at a handful of rows, while the transposed product of the same numbers is faster; which way wins depends on the
  BLAS, the CPU, the number of rows and the matrix, so the plan is measured per backbone and machine
  (``measure.small_rows``) and comes in a ``costs.Costs``. The products are the same up to float rounding; greedy
  output stays the backbone's (tested token for token). A plan maps a number of rows to the layers whose products are
  transposed at that size: "all", "head" (the output embeddings) or "body" (every other ``nn.Linear``); sizes not in
  it are computed as usual. An int k stands for "all" at 2..k rows (0: never).
- ``capture``: each forward shape compiled once (``captured``: ``torch.compile(mode="reduce-overhead")``, which on a
  GPU records each shape as a CUDA graph, replayed in one launch; a small model's forward is ~1,000 kernel launches,
  bound by the host). The shapes are kept few by a static cache (``kv.StaticKV``) and, for the heads' module passes,
  by ``CapturedPasses`` (queries padded to ``MODULE_BUCKETS`` over a preallocated module cache), which the runner
  hands the drafters (``Runner.passes``). Where compiling fails the call runs eagerly from then on, computing the
  same, and says so once (``CaptureFallbackWarning``).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import StaticCache

from tokenmaxx.heads.drafting import EAGER

from .kv import bucket, static_cache

Plan = Union[int, Mapping[int, str]]  # rows -> "all" | "head" | "body" (or k: "all" at 2..k rows)
PARTS = ("all", "head", "body")

_PLAN: ContextVar[Mapping[int, str]] = ContextVar("tokenmaxx_small_rows", default={})  # this thread's plan
_LOCK = threading.Lock()
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[nn.Linear]]]" = weakref.WeakKeyDictionary()


def as_plan(plan: Plan) -> dict[int, str]:
    """``plan`` as a dict (an int k: "all" at 2..k rows), checked."""
    if isinstance(plan, int):
        return {n: "all" for n in range(2, plan + 1)}
    bad = {n: part for n, part in plan.items() if part not in PARTS or not isinstance(n, int) or n < 2}
    if bad:
        raise ValueError(f"a small-rows plan maps row counts >= 2 to one of {PARTS}; got {bad}")
    return dict(plan)


def plan_record(plan: Plan) -> list[list]:
    """``plan`` as JSON: [rows, part] pairs, sorted."""
    return sorted([n, part] for n, part in as_plan(plan).items())


def _transposed(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(W @ x^T)^T``."""
    rows = x.numel() // x.shape[-1]
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, x: torch.Tensor, part: str) -> torch.Tensor:
    """``nn.Linear.forward`` of ``module`` (of the ``part`` "head" or "body"), transposed where this thread's plan
    says so for this many rows."""
    plan = _PLAN.get()
    if plan and x.shape[-1] and plan.get(x.numel() // x.shape[-1]) in ("all", part):
        return _transposed(module.weight, module.bias, x)
    return F.linear(x, module.weight, module.bias)


@contextmanager
def transposed_linears(model: nn.Module, plan: Plan, rows: int | None = None) -> Iterator[None]:
    """Inside: each ``nn.Linear`` of ``model`` that this thread feeds a number of rows the ``plan`` names, and that is
    of the part it names, computes ``(W @ x^T)^T`` (other sizes, other threads, and an empty plan: as usual). The
    modules get their forward while at least one thread is inside (the plan itself is per thread, a ``ContextVar``: a
    generator serving several threads, or plain ``generate`` beside it, is not affected) and have their own back once
    the last one leaves, also after an exception. ``rows``: how many rows the forward inside feeds, where known; a
    size the plan does not name installs nothing at all (a verify of one token or of a large tree pays nothing)."""
    plan = as_plan(plan)
    if not plan or (rows is not None and rows not in plan):
        yield
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with _LOCK:
        users, patched = _ACTIVE.get(model, (0, None))
        if patched is None:
            patched = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
            for module in patched:
                module.forward = functools.partial(_forward, module, part="head" if module is head else "body")
        _ACTIVE[model] = (users + 1, patched)
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)
        with _LOCK:
            users, patched = _ACTIVE[model]
            if users == 1:
                for module in patched:
                    module.__dict__.pop("forward", None)
                del _ACTIVE[model]
            else:
                _ACTIVE[model] = (users - 1, patched)


# ---- capture ---------------------------------------------------------------------------------------------------------
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


MODULE_CACHE = 2048  # entries a captured drafter's module cache starts with (doubled when a generation needs more)
MODULE_BUCKETS = (16, 64)  # query counts a captured module pass is padded to (past the last, its multiples)


class CapturedPasses:
    """How a drafter's passes run when captured (``heads.drafting.Eager`` is the default): a call through
    ``captured``; a sequential module's pass (``heads.sequential.ModulePass``) at a fixed shape, its n queries padded
    to ``bucket(n, MODULE_BUCKETS)`` (padding queries see only themselves, and no real query sees them; their entries
    land past the real ones, where the next pass writes) over a preallocated module cache of those heads, the mask
    spanning all of it: this thread's cache of row ``slot`` (a batch's rows each draft with their own slot's, so no
    row writes over another's entries). A cache is kept across generations (the recorded graphs hold its addresses; a
    new one per generation would record every graph again) and doubled when a generation needs more."""

    together = False  # (fixed shapes: a batch's rows pass one by one)

    def __init__(self, slot: int = 0):
        self.slot = slot
        self.pool = _MODULE_CACHES.__dict__.setdefault("by_heads", weakref.WeakKeyDictionary())  # this thread's

    def call(self, module: nn.Module, name: str, fn: Callable, *args):
        return captured(module, name, fn, *args)

    def module_pass(self, p) -> torch.Tensor:
        """``p.drafter``'s pass of n queries ``p`` (prev [n, H], tokens and positions [n], visible [n, C+n]) written
        after its first C entries. Returns states [n, H], a copy: the next captured call overwrites its outputs."""
        drafter = p.drafter
        heads, device, dtype = drafter.heads, drafter.device, drafter.heads.dtype
        n, width = p.visible.shape
        extra = bucket(n, MODULE_BUCKETS) - n
        cache = self._cache(heads, device, width + extra)
        for layer in cache.layers:
            layer.cumulative_length.fill_(width - n)  # the pass writes right after what it keeps
        prev, tokens, positions, visible = p.prev.contiguous(), p.tokens, p.positions, p.visible  # (an expanded
        if extra:  # state has stride 0: a graph of its own)
            prev = F.pad(prev, (0, 0, 0, extra))
            tokens, positions = F.pad(tokens, (0, extra)), F.pad(positions, (0, extra))
            own = torch.zeros(extra, width + extra, dtype=torch.bool, device=device)
            own[:, width:] = torch.eye(extra, dtype=torch.bool, device=device)
            visible = torch.cat([F.pad(visible, (0, extra)), own])  # [n + extra, width + extra]
        visible = F.pad(visible, (0, cache.layers[0].max_cache_len - visible.shape[1]))
        mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=device)
        mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
        inputs = (prev[None], tokens[None], drafter.embed, positions[None], mask, cache)
        return captured(heads, "step", heads.step, *inputs, **drafter.attention)[0, :n].clone()

    def _cache(self, heads, device: torch.device, width: int) -> StaticCache:
        """This thread's module cache of ``heads``, of at least ``width`` entries (its layers allocated up front, so
        that the first captured pass sees the cache every later pass sees): the current one, or one twice as large
        (or more) holding its entries."""
        slots = self.pool.setdefault(heads, {})
        old = slots.get(self.slot)
        layer = old.layers[0] if old is not None else None
        usable = layer is not None and layer.keys.device == device and layer.keys.dtype == heads.dtype
        if usable and layer.max_cache_len >= width:
            return old
        size = layer.max_cache_len if usable else MODULE_CACHE
        while size < width:
            size *= 2
        cache = static_cache(heads.layer_config, 1, size, heads.dtype, device)
        if usable:
            for new, was in zip(cache.layers, old.layers):  # (a generation that outgrew it keeps its entries)
                new.keys[:, :, : was.max_cache_len] = was.keys
                new.values[:, :, : was.max_cache_len] = was.values
        slots[self.slot] = cache
        return cache


_MODULE_CACHES = threading.local()  # .by_heads: heads -> {slot: its module cache in this thread}


@dataclass(frozen=True)
class Runner:
    """How forwards run here (see the module docstring). ``Runner()`` runs the model as it is."""

    attention: Mapping[str, object] = field(default_factory=dict)  # forward keywords for one row's verifies
    small_rows: Mapping[int, str] = field(default_factory=dict)  # the verifies' small-row plan
    capture: bool = False  # compile each forward shape once (CUDA graphs on a GPU); needs a static cache

    def __post_init__(self):
        object.__setattr__(self, "small_rows", as_plan(self.small_rows))

    def passes(self, row: int = 0):
        """How the drafter of a generation's ``row`` runs its passes (``heads.drafting.Eager``, or
        ``CapturedPasses`` over that row's module cache)."""
        return CapturedPasses(row) if self.capture else EAGER

    def __call__(self, model, **inputs):
        """``model(**inputs)`` (a verify: its cache filled, its hidden states returned) with this machine's attention
        keywords where one row runs, its linear layers as the plan computes the rows of ``inputs["input_ids"]``;
        captured where asked."""
        ids = inputs["input_ids"]
        attention = self.attention if ids.shape[0] == 1 else {}
        with transposed_linears(model, self.small_rows, rows=ids.numel()):
            if self.capture:
                return captured(model, "forward", model.forward, **inputs, use_cache=True, output_hidden_states=True,
                                **attention)
            return model(**inputs, use_cache=True, output_hidden_states=True, **attention)
