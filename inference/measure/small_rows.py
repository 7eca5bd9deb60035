"""This machine's small-row plan: the tree sizes whose verifies are faster with the backbone's linear layers computed
as ``(W @ x^T)^T`` (``runner.transposed_linears``, which explains why), measured once per backbone and machine.

The verify forward itself is timed for each tree size in ``SMALL_ROW_SIZES`` with the products transposed in the
lm_head, in the other layers, in both or in neither; each size keeps what won by at least ``MIN_GAIN``. Neighbouring
sizes can differ, so a size between the measured ones is verified as usual.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Mapping, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..runner import PARTS, Plan, plan_record, transposed_linears
from tokenmaxx.heads.machine import clock
from .store import CALIBRATION_VERSION, backbone_key, cache_path, machine_fingerprint, write_record

# tree sizes the calibration times (one forward of each per part and repeat); a size between them is verified as usual
SMALL_ROW_SIZES = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
MIN_GAIN = 0.05  # a size's verify is changed only where that was at least this much faster than the usual one


class VerifyTimer:
    """Times the forward a tree verify of n nodes runs: n random tokens over a cache of ``prefix_len`` random ones
    (clamped so that ``max_tokens`` more stay inside the backbone's context), the cache cropped back after each. Token
    ids come from one seeded CPU generator (the same on every device) and reach the backbone's device before the clock
    starts; the clock waits for the device (``heads.machine.clock``). Use under ``torch.inference_mode``."""

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
    rounds = tqdm(range(repeats + 1), desc=f"small-row products: verifies of {min(sizes)}-{max(sizes)} tokens, usual and transposed",
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
    path = small_rows_path(model, cache_root)
    if path is None:
        return {}
    if path.is_file() and not refresh:
        return read_plan(path)
    measured = measure_small_rows(model)
    plan = choose_small_rows(measured)
    write_record(path, {"plan": plan_record(plan), "measured": measured, "machine": machine_fingerprint(model)})
    return plan


def read_plan(path: Path) -> dict[int, str]:
    """A cached small-row plan (``cached_small_rows``' record), read without measuring."""
    return {int(n): part for n, part in json.loads(path.read_text())["plan"]}


def small_rows_path(model, cache_root: Path | None = None) -> Path | None:
    """Where this backbone's small-row plan on this machine is cached; None off the CPU (nothing to measure there)."""
    if model.get_output_embeddings().weight.device.type != "cpu":
        return None
    key = backbone_key(model, machine_fingerprint(model), "small_rows", SMALL_ROW_SIZES, CALIBRATION_VERSION)
    return cache_path(f"small-rows-{key}", cache_root)
