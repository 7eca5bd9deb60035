"""Where calibrations (verify latency tables, ``tree="auto"`` choices) are cached on disk, and under which key.

A record is a JSON file CACHE/calibration/KEY.json (``tokenmaxx.heads.cache_dir``), written under a temp name then
renamed. Keys cover the backbone's identity, the heads' weights where they matter, the machine (CPU model and the
vector instructions PyTorch uses on it, threads, torch, dtype, and the device the backbone runs on by name: an H200's
table is never read on a CPU, nor the reverse)
and ``CALIBRATION_VERSION``, so a table measured on one machine is never read on another.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch

from tokenmaxx.heads import backbone_identity, cache_dir

CALIBRATION_VERSION = 6  # bumped when the calibration method, what it times or the key changes (4: GQA verify; 5: the
# CPU's vector ISA in the key; 6: verifies computed as the small-row plan says, whose sizes the tables hold exactly),
# so stale cached choices and latency tables are not reused


def cache_path(key: str, cache_root: Path | None) -> Path:
    """Where a calibration record lives: CACHE/calibration/KEY.json (``tokenmaxx.heads.cache_dir``)."""
    return (cache_root or cache_dir() / "calibration") / f"{key}.json"


def write_record(path: Path, record: dict) -> None:
    """Write a calibration record under a temp name, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where there is one)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def cpu_isa() -> str:
    """The vector instruction set PyTorch's CPU kernels use here ("AVX512", "AVX2", ...). CPUs sold under one model
    name differ in it (an "AMD EPYC" with AVX-512 runs bf16 matmuls several times faster than one with AVX2 only), so
    timings and calibrations name it beside the model."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def device_name(device: torch.device) -> str:
    """What runs the backbone: "cpu: " and the CPU model, or the accelerator's type and name ("cuda: NVIDIA H200")."""
    if device.type == "cpu":
        return f"cpu: {cpu_name()}"
    return f"{device.type}: {getattr(torch, device.type).get_device_name(device)}"


def machine_fingerprint(model) -> dict:
    """The machine a calibration holds for: host CPU, its vector ISA and threads (the loop's Python side runs there),
    torch, the backbone's dtype, and the device it runs on (``device_name``)."""
    weight = model.get_output_embeddings().weight
    return {"cpu": cpu_name(), "cpu_isa": cpu_isa(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "dtype": str(weight.dtype), "device": device_name(weight.device)}


def backbone_key(model, machine: dict, *what) -> str:
    """Cache key of a backbone-only calibration: its identity and shape, the machine fingerprint and ``what`` (the
    calibration's name, version and settings)."""
    shape = {k: getattr(model.config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                          "vocab_size", "intermediate_size")}
    return hashlib.sha256(json.dumps([backbone_identity(model), shape, machine, *what], sort_keys=True,
                                     default=str).encode()).hexdigest()[:24]


def calibration_key(model, heads, machine: dict) -> str:
    """Cache key over backbone identity, the heads' weights and the machine fingerprint."""
    digest = hashlib.sha256()
    digest.update(json.dumps([backbone_identity(model), machine, CALIBRATION_VERSION], sort_keys=True,
                             default=str).encode())
    for name, tensor in sorted(heads.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:24]
