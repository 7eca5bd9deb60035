"""Tree verifies of a few tokens on a CPU: the backbone's linear layers as W @ x^T where the BLAS is faster that way.

A verify forward multiplies every weight matrix by a handful of rows (2-8 tree nodes). On some CPU BLAS builds the
ordinary ``x @ W^T`` of ``nn.Linear`` takes a path made for large batches at that size: SmolLM2-135M fp32 on a 2-core
AVX2 EPYC (torch 2.13 MKL) verifies 2-4 tokens in ~82 ms against ~49 ms for one, while the same products computed
as ``(W @ x^T)^T`` take ~62 ms (the 49,152 x 576 lm_head alone: 17.7 ms against 4.5 ms for 2 rows). Whether that
holds depends on the BLAS and the CPU, so it is measured once per backbone and machine (``cached_small_rows``) and
used only where it won; the products are the same up to float rounding (greedy output stays the backbone's: the
tests check it token for token). Only this thread's verifies are affected (``transposed_linears``); the model's
modules are left as they were afterwards.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import types
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from tokenmaxx.heads import backbone_identity

from .calibration_store import CALIBRATION_VERSION, cache_path, machine_fingerprint, write_record
from .timing import clock

SMALL_ROW_SIZES = (2, 4, 6, 8)  # verify sizes the calibration compares (trees of up to 8 nodes are the common case)
MIN_GAIN = 0.05  # the transposed products are used only where they were at least this much faster


_MAX_ROWS: ContextVar[int] = ContextVar("tokenmaxx_small_rows", default=0)  # this thread's setting (0: off)
_LOCK = threading.Lock()
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, tuple[int, list[nn.Linear]]]" = weakref.WeakKeyDictionary()


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, except inside ``transposed_linears`` of this thread for 2..max_rows rows."""
    max_rows = _MAX_ROWS.get()
    rows = x.numel() // x.shape[-1] if max_rows >= 2 and x.shape[-1] else 0
    if not 2 <= rows <= max_rows:
        return F.linear(x, self.weight, self.bias)
    out = (self.weight @ x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


@contextmanager
def transposed_linears(model: nn.Module, max_rows: int, rows: int | None = None) -> Iterator[None]:
    """Inside: every ``nn.Linear`` of ``model`` that this thread feeds 2..``max_rows`` rows computes ``(W @ x^T)^T``
    (other sizes, other threads, and ``max_rows`` < 2: as usual). The modules get their forward while at least one
    thread is inside (the setting itself is per thread, a ``ContextVar``: a generator serving several threads, or
    plain ``generate`` beside it, is not affected) and have their own back once the last one leaves, also after an
    exception. ``rows``: how many rows the forward inside feeds, where known; outside 2..``max_rows`` nothing is
    installed at all (a verify of one token or of a large tree pays nothing for the check)."""
    if max_rows < 2 or (rows is not None and not 2 <= rows <= max_rows):
        yield
        return
    with _LOCK:
        users, patched = _ACTIVE.get(model, (0, None))
        if patched is None:
            patched = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
            for module in patched:
                module.forward = types.MethodType(_forward, module)
        _ACTIVE[model] = (users + 1, patched)
    token = _MAX_ROWS.set(max_rows)
    try:
        yield
    finally:
        _MAX_ROWS.reset(token)
        with _LOCK:
            users, patched = _ACTIVE[model]
            if users == 1:
                for module in patched:
                    module.__dict__.pop("forward", None)
                del _ACTIVE[model]
            else:
                _ACTIVE[model] = (users - 1, patched)


@torch.inference_mode()
def measure_small_rows(model, sizes: Sequence[int] = SMALL_ROW_SIZES, prefix_len: int = 256,
                       repeats: int = 7) -> dict[int, tuple[float, float]]:
    """Median seconds of one forward of n tokens over ``prefix_len`` cached tokens, as usual and with
    ``transposed_linears``, interleaved (a slow spell of a shared machine hits both alike): {n: (usual, transposed)}."""
    weight = model.get_output_embeddings().weight
    vocab, device = weight.shape[0], weight.device
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:
        prefix_len = max(1, min(prefix_len, context - max(sizes)))
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(vocab, (1, prefix_len), generator=gen).to(device), past_key_values=cache,
          use_cache=True)
    times: dict[tuple[int, bool], list[float]] = {(n, t): [] for n in sizes for t in (False, True)}
    for _ in range(repeats + 1):  # the first round warms both paths up and is dropped
        for n in sizes:
            ids = torch.randint(vocab, (1, n), generator=gen).to(device)  # [1, n]
            for transposed in (False, True):
                with transposed_linears(model, max(sizes) if transposed else 0):
                    start = clock(device)
                    model(input_ids=ids, past_key_values=cache, use_cache=True)
                    times[(n, transposed)].append(clock(device) - start)
                cache.crop(-n)
    return {n: (statistics.median(times[(n, False)][1:]), statistics.median(times[(n, True)][1:])) for n in sizes}


def choose_small_rows(measured: dict[int, tuple[float, float]], min_gain: float = MIN_GAIN) -> int:
    """The largest measured n such that the transposed products were at least ``min_gain`` faster at every measured
    size up to n (0: never)."""
    best = 0
    for n in sorted(measured):
        usual, transposed = measured[n]
        if transposed > (1 - min_gain) * usual:
            break
        best = n
    return best


def cached_small_rows(model, cache_root: Path | None = None, refresh: bool = False) -> int:
    """Up to how many rows a verify on this machine computes the backbone's linear layers as ``(W @ x^T)^T``
    (``choose_small_rows`` of ``measure_small_rows``), measured once per backbone and machine and cached (~5 s on a
    2-core CPU; 0 on a GPU without measuring: its kernels have no such gap). A cached number, so a seeded generation
    computes the same logits every time."""
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return 0
    machine = machine_fingerprint(model)
    shape = {k: getattr(model.config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                          "vocab_size", "intermediate_size")}
    key = hashlib.sha256(json.dumps([backbone_identity(model), shape, machine, "small_rows", CALIBRATION_VERSION],
                                    sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = cache_path(f"small-rows-{key}", cache_root)
    if path.is_file() and not refresh:
        return int(json.loads(path.read_text())["max_rows"])
    measured = measure_small_rows(model)
    max_rows = choose_small_rows(measured)
    write_record(path, {"max_rows": max_rows, "measured": {n: list(t) for n, t in measured.items()},
                        "machine": machine})
    return max_rows
