"""Tree verifies of a few tokens on a CPU: the backbone's linear layers as W @ x^T where the BLAS is faster that way.

A verify forward multiplies every weight matrix by a handful of rows (the tree's nodes). On some CPU BLAS builds the
ordinary ``x @ W^T`` of ``nn.Linear`` takes a path made for large batches at such sizes: SmolLM2-135M fp32 on a 2-core
AVX2 EPYC (torch 2.13 MKL) verifies 2-4 tokens in ~84 ms against ~50 ms for one, while the same products computed as
``(W @ x^T)^T`` take ~62 ms. Which way is faster depends on the BLAS, the CPU, the number of rows and the matrix (on
that machine: at 6-8 rows only the 49,152 x 576 lm_head still gains, at 12 rows neither does, at 16 both do again), so
the verify forward itself is timed once per backbone and machine for each tree size with the products transposed in
the lm_head, in the other layers, in both or in neither (``cached_small_rows``), and each size uses what won. The
products are the same up to float rounding (greedy output stays the backbone's: the tests check it token for token).
Only this thread's verifies are affected (``transposed_linears``); the model's modules are left as they were after.

A plan maps a number of rows to the layers whose products are transposed at that size: "all", "head" (the output
embeddings) or "body" (every other ``nn.Linear``); sizes not in it are computed as usual. An int k stands for "all" at
2..k rows (0: never).
"""

from __future__ import annotations

import functools
import json
import statistics
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator, Mapping, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from .calibration_store import CALIBRATION_VERSION, backbone_key, cache_path, machine_fingerprint, write_record
from .timing import clock

Plan = Union[int, Mapping[int, str]]  # rows -> "all" | "head" | "body" (or k: "all" at 2..k rows)
PARTS = ("all", "head", "body")

# tree sizes the calibration times (one forward of each per part and repeat: ~40 s for SmolLM2-135M on 2 cores); a
# size between them is verified as usual, since neighbouring sizes can differ (above)
SMALL_ROW_SIZES = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
MIN_GAIN = 0.05  # a size's verify is changed only where that was at least this much faster than the usual one

_PLAN: ContextVar[Mapping[int, str]] = ContextVar("tokenmaxx_small_rows", default={})  # this thread's plan
_LOCK = threading.Lock()
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[nn.Linear]]]" = weakref.WeakKeyDictionary()


def as_plan(plan: Plan) -> dict[int, str]:
    """``plan`` as a dict (an int k: "all" at 2..k rows), checked."""
    if isinstance(plan, int):
        return {n: "all" for n in range(2, plan + 1)}
    bad = {n: part for n, part in plan.items() if part not in PARTS or n < 2}
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


class VerifyTimer:
    """Times the forward a tree verify of n nodes runs: n random tokens over a cache of ``prefix_len`` random ones
    (clamped so that ``max_tokens`` more stay inside the backbone's context), the cache cropped back after each. Token
    ids come from one seeded CPU generator (the same on every device) and reach the backbone's device before the clock
    starts; the clock waits for the device (``timing.clock``). Use under ``torch.inference_mode``."""

    def __init__(self, model, prefix_len: int, max_tokens: int):
        weight = model.get_output_embeddings().weight
        self.model, self.vocab, self.device = model, weight.shape[0], weight.device
        context = getattr(model.config, "max_position_embeddings", None)
        if context is not None:
            prefix_len = max(1, min(prefix_len, context - max_tokens))
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.cache = DynamicCache(config=model.config)
        model(input_ids=self.draw(prefix_len), past_key_values=self.cache, use_cache=True)

    def draw(self, n: int) -> torch.Tensor:
        """[1, n] random token ids on the backbone's device."""
        return torch.randint(self.vocab, (1, n), generator=self.gen, device="cpu").to(self.device)

    def seconds(self, ids: torch.Tensor, plan: Plan = 0) -> float:
        """One forward of ``ids`` [1, n] with the linear layers as ``plan`` computes n rows."""
        n = ids.shape[1]
        with transposed_linears(self.model, plan, rows=n):
            start = clock(self.device)
            self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, output_hidden_states=True)
            elapsed = clock(self.device) - start
        self.cache.crop(-n)
        return elapsed


@torch.inference_mode()
def measure_small_rows(model, sizes: Sequence[int] = SMALL_ROW_SIZES, prefix_len: int = 256,
                       repeats: int = 7) -> dict[int, dict[str, float]]:
    """Median seconds of one forward of n tokens over ``prefix_len`` cached tokens as usual and with the products of
    each part transposed, interleaved (a slow spell of a shared machine hits all alike): {n: {"usual"|part: s}}."""
    timer = VerifyTimer(model, prefix_len, max(sizes))
    ways = ("usual",) + PARTS
    times: dict[tuple[int, str], list[float]] = {(n, w): [] for n in sizes for w in ways}
    rounds = tqdm(range(repeats + 1), desc="timing small verifies, usual and transposed, on this machine (once)",
                  unit="round", leave=False)
    for _ in rounds:  # the first round warms every path up and is dropped
        for n in sizes:
            ids = timer.draw(n)
            for way in ways:
                times[(n, way)].append(timer.seconds(ids, {n: way} if way != "usual" else {}))
    return {n: {w: statistics.median(times[(n, w)][1:]) for w in ways} for n in sizes}


def choose_small_rows(measured: Mapping[int, Mapping[str, float]], min_gain: float = MIN_GAIN) -> dict[int, str]:
    """Per measured size, the fastest part to transpose, where it was at least ``min_gain`` faster than usual."""
    plan = {}
    for n, seconds in measured.items():
        part = min(PARTS, key=lambda p: seconds[p])
        if seconds[part] <= (1 - min_gain) * seconds["usual"]:
            plan[n] = part
    return plan


def cached_small_rows(model, cache_root: Path | None = None, refresh: bool = False) -> dict[int, str]:
    """This machine's plan for the backbone's verifies (``choose_small_rows`` of ``measure_small_rows``), measured once
    per backbone and machine and cached; empty on a GPU without measuring (its kernels have no such gap). A cached
    plan, so a seeded generation computes the same logits every time."""
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return {}
    machine = machine_fingerprint(model)
    key = backbone_key(model, machine, "small_rows", SMALL_ROW_SIZES, CALIBRATION_VERSION)
    path = cache_path(f"small-rows-{key}", cache_root)
    if path.is_file() and not refresh:
        return {int(n): part for n, part in json.loads(path.read_text())["plan"]}
    measured = measure_small_rows(model)
    plan = choose_small_rows(measured)
    write_record(path, {"plan": plan_record(plan), "measured": measured, "machine": machine})
    return plan
