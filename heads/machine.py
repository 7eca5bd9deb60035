"""What machine this is: the CPU (model, vector ISA, native bf16) and the device a backbone runs on; a clock that
waits for that device.

One place for every package (training records it beside trained heads, inference keys calibrations and timings by
it, the backbone loader picks dtypes from it). Only the standard library and torch.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def cpu_id() -> str:
    """The CPU's vendor, family, model and stepping ("AuthenticAMD family 25 model 17 stepping 1"), where /proc/cpuinfo
    says them. A virtual machine may give only a family's name ("AMD EPYC") for CPUs generations apart, which time
    the same work differently: the caches of measured costs name the CPU by this too."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first processor's lines
    except OSError:
        return platform.processor() or "unknown"
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    return " ".join([fields.get("vendor_id", "?")] + [f"{label} {fields.get(key, '?')}" for label, key in
                                                       (("family", "cpu family"), ("model", "model"),
                                                        ("stepping", "stepping"))])


def cpu_isa() -> str:
    """The vector instruction set PyTorch's CPU kernels use here ("AVX512", "AVX2", ...). CPUs sold under one model
    name differ in it (an "AMD EPYC" may have AVX-512 or AVX2 only, and bf16 matmuls are far slower on the latter;
    docs/benchmarks.md), so timings and calibrations name it beside the model."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def cpu_info() -> dict[str, str]:
    """The host CPU as records name it: its model name, family/model/stepping and the vector ISA PyTorch uses."""
    return {"cpu": cpu_name(), "cpu_id": cpu_id(), "cpu_isa": cpu_isa()}


# oneDNN's instruction sets, lowest first: ONEDNN_MAX_CPU_ISA caps the one its products (PyTorch's bf16 / fp16
# matmuls on a CPU) use, so a cap below a dtype's native set makes that dtype emulated whatever the CPU has
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
               "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16")


def onednn_allows(isa: str) -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` (unset, ALL or DEFAULT: no cap) lets oneDNN use the instruction set ``isa``."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap not in ONEDNN_ISAS:
        return True
    return ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(isa)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX). Without it PyTorch converts every bf16 matmul
    through fp32, and a verify forward of several tokens costs nearly as much as decoding them one by one. A cap on
    oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16) makes it emulated too."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return any(check() for check in checks if check is not None) and onednn_allows("AVX512_CORE_BF16")
    except RuntimeError:
        return False


def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes float16 products natively (AMX FP16). Without it PyTorch converts fp16 products
    through fp32; AVX-512 FP16 alone did not beat float32 (docs/benchmarks.md)."""
    amx = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    try:
        return bool(amx is not None and amx()) and onednn_allows("AVX512_CORE_AMX_FP16")
    except RuntimeError:
        return False


def cpu_dtype_is_emulated(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` runs emulated (through fp32 conversions) on this CPU: bf16 without native bf16, fp16 without
    native fp16."""
    native = {torch.bfloat16: cpu_has_native_bf16, torch.float16: cpu_has_native_fp16}.get(dtype)
    return native is not None and not native()


def device_name(device: torch.device) -> str:
    """What runs the backbone: "cpu: " and the CPU model, or the accelerator's type and name ("cuda: NVIDIA H200")."""
    if device.type == "cpu":
        return f"cpu: {cpu_name()}"
    return f"{device.type}: {getattr(torch, device.type).get_device_name(device)}"


UNQUEUED = ("cpu", "meta")  # device types whose work is done when the call returns: nothing to wait for


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run all the work queued on it (``torch.accelerator.synchronize``; no-op on CPU).

    An accelerator (CUDA, ...) runs kernels asynchronously: a Python call returns once the work is queued, so a clock
    read right after it measures the launch."""
    if device.type not in UNQUEUED:
        torch.accelerator.synchronize(device)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work: every timing of backbone or heads work
    (the decode loop's phases, calibrations, benchmarks, training steps) reads it."""
    synchronize(device)
    return time.perf_counter()


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value of a tensor on ``device`` back to Python costs nothing beyond the read: true where the
    work is done when the call returns (the CPU). On an accelerator a read waits for all the work queued before it,
    so a round that reads mid-way stops feeding the device; drafters that could stop early on a value they read
    skip those reads there."""
    return device.type in UNQUEUED


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device``: the accelerator's free memory, or the CPU's available memory
    (MemAvailable in /proc/meminfo); None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            line = next(line for line in Path("/proc/meminfo").read_text().splitlines()
                        if line.startswith("MemAvailable:"))
            return int(line.split()[1]) * 1024
        except (OSError, StopIteration, ValueError):
            return None
    return None
