"""Where calibrations (verify latency tables, ``tree="auto"`` choices) are cached on disk, and under which key.

A record is a JSON file CACHE/calibration/KEY.json (``tokenmaxx.heads.cache_dir``), written under a temp name then
renamed. Keys cover the backbone's identity, the heads' weights where they matter, the machine (the CPU by name and
by family, model and stepping, the vector instructions PyTorch uses on it, threads, torch, dtype, and the device the
backbone runs on by name: an H200's table is never read on a CPU, nor the reverse) and ``CALIBRATION_VERSION``, so a
table measured on one machine is never read on another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from tokenmaxx.heads import backbone_identity, cache_dir
from tokenmaxx.heads.machine import cpu_info, device_name

CALIBRATION_VERSION = 6  # bumped when the calibration method, what it times or the key changes, so stale cached
# choices and latency tables are not reused


def cache_path(key: str, cache_root: Path | None) -> Path:
    """Where a calibration record lives: CACHE/calibration/KEY.json (``tokenmaxx.heads.cache_dir``)."""
    return (cache_root or cache_dir() / "calibration") / f"{key}.json"


def write_record(path: Path, record: dict) -> None:
    """Write a calibration record under a temp name, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def machine_fingerprint(model) -> dict:
    """The machine a calibration holds for: host CPU (by name and by family, model and stepping), its vector ISA and
    threads (the loop's Python side runs there), torch, the backbone's dtype, and the device it runs on
    (``device_name``)."""
    weight = model.get_output_embeddings().weight
    return {**cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(weight.dtype),
            "device": device_name(weight.device)}


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
