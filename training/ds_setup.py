"""DeepSpeed on CPU or GPU: process-group environment, the JSON config merged with the script's flags, the engine.

Device (``--device``, ``training_device``): "auto" takes CUDA when there is a GPU, else the CPU. On CPU the process
group is gloo and DeepSpeed's accelerator is forced to "cpu" (DS_ACCELERATOR) even on a machine with a GPU; on CUDA it
is nccl, and rank r of several processes on one machine runs on cuda:LOCAL_RANK.

Launching (all run scripts/train_heads.py unchanged; the script reads RANK / WORLD_SIZE from the environment):

- one plain process: ``python scripts/train_heads.py --data D ...``. RANK=0, LOCAL_RANK=0, WORLD_SIZE=1,
  MASTER_ADDR=127.0.0.1 and a free MASTER_PORT are filled in when absent (``ensure_dist_env``).
- several processes on one machine: ``OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/train_heads.py ...``
  (or ``python -m torch.distributed.run``). Data-parallel over gloo; each rank reads its own share of every batch.
- DeepSpeed's launcher: ``OMP_NUM_THREADS=1 deepspeed --num_gpus 2 scripts/train_heads.py ...`` works the same way on
  CPU (it exports the same variables; ``--num_gpus`` is its name for processes per node). It passes
  ``--local_rank=N`` to the script, which is accepted and ignored (LOCAL_RANK is read from the environment).

Config merge (``resolve_ds_config``): the JSON (training/ds_config.json by default) holds DeepSpeed's own settings and
``"auto"`` where a script flag decides. For each flag in ``FLAG_PATHS``: a JSON value that is ``"auto"`` or absent
is filled from the flag (or its default); a concrete JSON value is used when the flag was not given; a flag given
explicitly that disagrees with a concrete JSON value raises ``DeepSpeedConfigError`` naming both.
Compiled optimizers (DeepSpeed's FusedAdam / CPUAdam) are refused: the optimizer must be Adam/AdamW with
``"torch_adam": true`` (torch.optim.AdamW), and ZeRO offload, which needs CPUAdam, is refused too.

The first ``deepspeed.init_distributed`` JIT-compiles the ``deepspeed_shm_comm`` op (a slow build on a small CPU;
docs/benchmarks.md) into the torch extensions folder ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), which
persists per user: later runs load the built op. ``prebuild_shm_comm()`` (``python -m tokenmaxx.training.ds_setup
--prebuild``) does it ahead of time, e.g. once in CI before the tests. torch drives that build with the first ``ninja``
on PATH: the venv's (1.13) and the system's (1.11) keep incompatible logs, so alternating them (an activated venv in
one run, a bare .venv/bin/python in the next) recompiles the op each time. Use one PATH for the prebuild and the runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import socket
import sys
from typing import Any

from .train_config import DEFAULTS, TrainConfig

# script flag -> where DeepSpeed keeps the same value in its JSON
FLAG_PATHS: dict[str, tuple[str, ...]] = {
    "micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "grad_accum": ("gradient_accumulation_steps",),
    "grad_clip": ("gradient_clipping",),
    "zero_stage": ("zero_optimization", "stage"),
    "lr": ("optimizer", "params", "lr"),
    "weight_decay": ("optimizer", "params", "weight_decay"),
    "warmup": ("scheduler", "params", "warmup_num_steps"),
    "max_steps": ("scheduler", "params", "total_num_steps"),
    "dtype": ("bf16", "enabled"),
}
AUTO = "auto"


class DeepSpeedConfigError(ValueError):
    """The DeepSpeed JSON is unusable here, or disagrees with an explicit script flag."""


# ---- process group ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> tuple[int, int]:
    """Fill RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for a plain single process; (rank, world)."""
    world = int(os.environ.setdefault("WORLD_SIZE", "1"))
    rank = int(os.environ.setdefault("RANK", "0"))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise RuntimeError(f"WORLD_SIZE={world} but MASTER_PORT is unset: launch several processes with torchrun "
                               "or the deepspeed launcher, which set it")
        os.environ["MASTER_PORT"] = str(_free_port())
    return rank, world


def training_device(spec: str) -> "torch.device":
    """The run's device: ``spec`` as ``load_backbone`` reads it, and on CUDA with several local processes
    cuda:LOCAL_RANK (a device index given explicitly is kept)."""
    import torch

    from tokenmaxx.heads.io.backbones import resolve_device

    device = resolve_device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        resolve_device(device)  # as many GPUs as local ranks
    return device


def auto_dtype(device_spec: str) -> str:
    """--dtype auto on the run's device (``heads.io.backbones.resolve_dtype``, as generate and make-data): 'bfloat16'
    where bf16 is native (a GPU, a CPU with AVX-512 BF16 / AMX), else 'float32'."""
    from tokenmaxx.heads.io.backbones import resolve_dtype

    return str(resolve_dtype("auto", training_device(device_spec))).removeprefix("torch.")


def init_distributed(device: "torch.device | None" = None) -> tuple[int, int]:
    """Join (or create) the process group through DeepSpeed, gloo on CPU and nccl on CUDA (``device`` sets
    DeepSpeed's accelerator before its first use); returns (rank, world size)."""
    import torch

    device = torch.device("cpu") if device is None else device
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if os.environ["DS_ACCELERATOR"] != device.type:
        raise RuntimeError(f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} but the run's device is {device}; unset "
                           "it or pass a matching --device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"training runs on cpu or cuda, not {device}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import deepspeed
    import deepspeed.comm as dist

    ensure_dist_env()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    return dist.get_rank(), dist.get_world_size()


def comm_device() -> "torch.device":
    """Where the process group's collectives take their tensors: the current GPU under nccl, else the CPU."""
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prebuild_shm_comm() -> str:
    """JIT-build (or load the cached) deepspeed_shm_comm op; returns the loaded module's file."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    return ShareMemCommBuilder().load().__file__


# ---- config merge -----------------------------------------------------------------------------------------------
def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _to_json_value(flag: str, value: Any) -> Any:
    return value == "bfloat16" if flag == "dtype" else value


def _from_json_value(flag: str, value: Any) -> Any:
    if flag == "dtype":
        if not isinstance(value, bool):
            raise DeepSpeedConfigError(f"DeepSpeed config bf16.enabled must be true, false or 'auto', got {value!r}")
        return "bfloat16" if value else "float32"
    return value


def _auto_paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _auto_paths(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix] if tree == AUTO else []


def _check_supported(ds: dict, source: str) -> None:
    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw") or (opt.get("params") or {}).get("torch_adam") is not True:
        raise DeepSpeedConfigError(
            f"{source}: optimizer must be {{'type': 'AdamW', 'params': {{'torch_adam': true, ...}}}} (torch's AdamW); "
            f"got {opt!r}. DeepSpeed's compiled optimizers (FusedAdam, CPUAdam) are not used by tokenmaxx")
    sched = ds.get("scheduler") or {}
    if sched.get("type") != "WarmupCosineLR":
        raise DeepSpeedConfigError(f"{source}: scheduler must be WarmupCosineLR (warm-up then cosine), got {sched!r}")
    zero = ds.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) and (zero[key].get("device", "none") != "none"):
            raise DeepSpeedConfigError(
                f"{source}: zero_optimization.{key} needs DeepSpeed's compiled CPUAdam; remove it")
    if (ds.get("fp16") or {}).get("enabled") is True:
        raise DeepSpeedConfigError(f"{source}: fp16 is not supported on CPU; use bf16 (--dtype bfloat16) or fp32")


def steps_per_epoch(num_train: int, world: int, micro_batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one pass over the training examples (each rank drops its incomplete tail batch)."""
    micro_per_rank = (num_train // world) // micro_batch_size
    steps = micro_per_rank // grad_accum
    if steps == 0:
        raise ValueError(f"{num_train} training examples are too few for one optimizer step of "
                         f"{world} process(es) x {micro_batch_size} sequences x {grad_accum} micro-batches")
    return steps


def resolve_ds_config(cfg: TrainConfig, world: int, num_train: int) -> tuple[TrainConfig, dict]:
    """Merge the JSON at ``cfg.ds_config`` with the flags; returns (cfg with every value concrete, DeepSpeed dict)."""
    source = cfg.ds_config
    try:
        with open(source) as f:
            ds = json.load(f)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"DeepSpeed config {source} is not valid JSON ({err})") from None
    ds = copy.deepcopy(ds)
    _check_supported(ds, source)
    explicit = {flag: getattr(cfg, flag) for flag in FLAG_PATHS}
    labels = {}
    if explicit["dtype"] == AUTO:  # --dtype auto given: this machine's choice, compared with a concrete JSON value
        explicit["dtype"], labels["dtype"] = auto_dtype(cfg.device), "--dtype auto (= dtype"
    if cfg.epochs is not None:  # --epochs decides the step count as explicitly as --max_steps would
        first = {f: _pick(f, explicit[f], _get(ds, FLAG_PATHS[f]), source) for f in ("micro_batch_size", "grad_accum")}
        explicit["max_steps"] = math.ceil(cfg.epochs * steps_per_epoch(num_train, world, **first))

    resolved: dict[str, Any] = {}
    for flag, path in sorted(FLAG_PATHS.items(), key=lambda item: item[0] == "warmup"):  # warm-up after max_steps
        if flag == "max_steps" and explicit[flag] is None and _get(ds, path) in (None, AUTO):
            resolved[flag] = steps_per_epoch(num_train, world, resolved["micro_batch_size"], resolved["grad_accum"])
        elif flag == "warmup" and explicit[flag] is None and _get(ds, path) in (None, AUTO) \
                and DEFAULTS["warmup"] > resolved["max_steps"]:
            # nobody asked for the default warm-up, and it is longer than this (short) run: warm up over its first
            # half instead (a warm-up someone gave that is too long is refused by TrainConfig)
            resolved[flag] = max(1, resolved["max_steps"] // 2)
            print(f"note: the default warm-up of {DEFAULTS['warmup']} steps is longer than this run's "
                  f"{resolved['max_steps']} steps: warming up over {resolved[flag]}", file=sys.stderr)
        else:
            label = f"--epochs {cfg.epochs} (= max_steps" if flag == "max_steps" and cfg.epochs is not None else None
            resolved[flag] = _pick(flag, explicit[flag], _get(ds, path), source, label or labels.get(flag))
            if flag == "dtype" and resolved[flag] == AUTO:  # neither flag nor JSON: the default, auto
                resolved[flag] = auto_dtype(cfg.device)
        _set(ds, path, _to_json_value(flag, resolved[flag]))

    batch = resolved["micro_batch_size"] * resolved["grad_accum"] * world
    if ds.get("train_batch_size") not in (None, AUTO) and ds["train_batch_size"] != batch:
        raise DeepSpeedConfigError(
            f"{source}: train_batch_size={ds['train_batch_size']} but micro_batch_size {resolved['micro_batch_size']} "
            f"x grad_accum {resolved['grad_accum']} x {world} process(es) = {batch}")
    ds["train_batch_size"] = batch
    left = _auto_paths(ds)
    if left:
        raise DeepSpeedConfigError(f"{source}: no script flag fills {left}; replace 'auto' there with a value")
    if resolved["zero_stage"] not in (0, 1, 2):
        raise DeepSpeedConfigError(f"{source}: zero_optimization.stage must be 0, 1 or 2, got {resolved['zero_stage']}")
    if resolved["warmup"] < 1:
        raise DeepSpeedConfigError(f"warm-up must be >= 1 step (WarmupCosineLR), got {resolved['warmup']}")
    # --epochs becomes max_steps here (the original request stays in run_config.json's "requested")
    return dataclasses.replace(cfg, **resolved, epochs=None), ds


def _pick(flag: str, flag_value: Any, json_value: Any, source: str, label: str | None = None) -> Any:
    """The one value of a setting both the script and the JSON know, or an error if they disagree."""
    if json_value in (None, AUTO):
        return DEFAULTS[flag] if flag_value is None else flag_value
    json_value = _from_json_value(flag, json_value)
    if flag_value is not None and flag_value != json_value:
        path = ".".join(FLAG_PATHS[flag])
        given = f"{label} {flag_value!r})" if label else f"--{flag} {flag_value!r}"
        raise DeepSpeedConfigError(
            f"{given} disagrees with {path} = {_to_json_value(flag, json_value)!r} in the DeepSpeed "
            f"config {source}; drop the flag, or set {path} to 'auto' (or the same value) in the JSON")
    return json_value


# ---- engine -----------------------------------------------------------------------------------------------------
def build_engine(module, ds: dict, device: "torch.device | None" = None):
    """DeepSpeed engine over ``module``'s trainable parameters (optimizer and scheduler come from ``ds``); the module
    must stay on ``device``, where the backbone is (DeepSpeed places it on its accelerator's device)."""
    import deepspeed

    params = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=ds)
    placed = next(engine.module.parameters()).device
    if device is not None and placed != device:
        raise RuntimeError(f"DeepSpeed placed the heads on {placed} but the backbone is on {device}; set "
                           f"DS_ACCELERATOR={device.type} (or pass --device {placed})")
    return engine


if __name__ == "__main__":
    if sys.argv[1:] != ["--prebuild"]:
        sys.exit("usage: python -m tokenmaxx.training.ds_setup --prebuild")
    print(prebuild_shm_comm())
