"""How the backbone's tree-verify forward runs on this machine: one ``ForwardContext``, handed to the loop.

The loop verifies every tree with ``forward(model, **inputs)`` and does not know what the context adds. It adds:

- ``attention``: keywords for the attention function (``tokenmaxx.heads.attention.shared_kv_kwargs``: on a CPU, a
  masked forward lets SDPA share the key/value heads of grouped-query layers instead of copying them);
- ``small_rows``: a plan of the tree sizes whose verifies compute (some of) the backbone's linear layers as
  ``(W @ x^T)^T`` (``transposed_linears``). On some CPU BLAS builds ``x @ W^T`` takes a path made for large batches
  at a handful of rows, while the transposed product of the same numbers is faster; which way wins depends on the
  BLAS, the CPU, the number of rows and the matrix, so the plan is measured per backbone and machine
  (``measure.small_rows``) and comes in a ``costs.Costs``. The products are the same up to float rounding; greedy
  output stays the backbone's (tested token for token).

A plan maps a number of rows to the layers whose products are transposed at that size: "all", "head" (the output
embeddings) or "body" (every other ``nn.Linear``); sizes not in it are computed as usual. An int k stands for "all" at
2..k rows (0: never).
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Union

import torch
import torch.nn.functional as F
from torch import nn

from tokenmaxx.heads.capture import CaptureFallbackWarning, captured  # noqa: F401 - re-exported

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


CACHES = ("dynamic", "static")
_STATIC = threading.local()  # .kv: this thread's last static cache (``ForwardContext.static_cache``)
MIN_STATIC = 1024  # the smallest static cache (positions): most generations fit it, so one shape serves them
MIN_CAPTURED = 4096  # ... when its forwards are captured: each cache length is another graph per bucket (a compile),
# and prompts of a few thousand tokens are common; the price is each verify attending over the whole cache (its
# keys and values read beside the weights: a larger share for a small backbone), which the device check measures


def _power_of_two(n: int) -> int:
    """The smallest power of two at least ``n``."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class ForwardContext:
    """How a tree-verify forward runs (see the module docstring). ``ForwardContext()`` runs the model as it is."""

    attention: Mapping[str, object] = field(default_factory=dict)  # extra forward keywords for the attention function
    small_rows: Mapping[int, str] = field(default_factory=dict)  # the verifies' small-row plan
    cache: str = "dynamic"  # the generation's KV cache: "dynamic" (grown, cropped) or "static" (``kv.StaticKV``)
    capture: bool = False  # compile each verify shape once (``torch.compile(mode="reduce-overhead")``: CUDA graphs
    # on a GPU), falling back to eager with a ``CaptureFallbackWarning``; needs the static cache (fixed shapes)

    def __post_init__(self):
        object.__setattr__(self, "small_rows", as_plan(self.small_rows))
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if self.capture and self.cache != "static":
            raise ValueError("capture=True needs cache='static': a captured forward runs at fixed shapes")

    def static_cache(self, model, positions: int):
        """A ``kv.StaticKV`` for a generation of up to ``positions`` positions (prompt, new tokens, the largest padded
        tree): this thread's last one when it is for ``model`` and these tree sizes and large enough (whichever
        generator made it: a thread runs one generation at a time), else a new one of the next power of two (at least
        ``MIN_STATIC``, or ``MIN_CAPTURED`` when captured; at most the power of two that holds the model's context)
        positions. Reusing one cache keeps its tensors at one address and its mask at one width: a captured forward is
        compiled and recorded once, not per prompt length or generator. Captured verifies pad trees to the few sizes
        of ``kv.CAPTURE_BUCKETS`` (one compile each), others to ``kv.BUCKETS``."""
        from .kv import BUCKETS, CAPTURE_BUCKETS, StaticKV  # (kv imports nothing of this module's users)

        buckets = CAPTURE_BUCKETS if self.capture else BUCKETS
        kv = getattr(_STATIC, "kv", None)
        if kv is None or kv.model_ref() is not model or kv.buckets != buckets or kv.max_len < positions:
            length = max(MIN_CAPTURED if self.capture else MIN_STATIC, _power_of_two(positions))
            context = getattr(model.config, "max_position_embeddings", None)  # (no generation needs more)
            if context:
                length = min(length, _power_of_two(max(context, positions)))
            kv = _STATIC.kv = StaticKV(model, length, buckets=buckets)
        return kv

    def __call__(self, model, **inputs):
        """``model(**inputs)`` with this context's keywords, its linear layers as the plan computes the rows of
        ``inputs["input_ids"]``; captured where asked."""
        with transposed_linears(model, self.small_rows, rows=inputs["input_ids"].numel()):
            if self.capture:
                return captured(model, "forward", model.forward, **inputs, **self.attention)
            return model(**inputs, **self.attention)
