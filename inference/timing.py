"""Clock reads that time the device's work, not just the launching of it.

An accelerator (CUDA, ...) runs kernels asynchronously: a Python call returns once the work is queued, so a clock read
right after it measures the launch. ``clock(device)`` first waits for the device to finish what is queued
(``synchronize``), then reads ``time.perf_counter``; on the CPU the work is done when the call returns and nothing
waits. Every timing of backbone or heads work (the decode loop's phases, latency calibration, benchmarks) reads it.
"""

from __future__ import annotations

import time

import torch

UNQUEUED = ("cpu", "meta")  # device types whose work is done when the call returns: nothing to wait for


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run all the work queued on it (``torch.accelerator.synchronize``; no-op on CPU)."""
    if device.type not in UNQUEUED:
        torch.accelerator.synchronize(device)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work."""
    synchronize(device)
    return time.perf_counter()
