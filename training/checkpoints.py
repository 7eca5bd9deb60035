"""Checkpoints of a run (DeepSpeed's own format, heads only) and the identity a resume must match.

OUTPUT_DIR/checkpoints/
    run.json          the run's identity: backbone (id, revision, adapter), head shape, data fingerprint and the
                      settings that fix the data order and the optimizer state layout
    latest            DeepSpeed's pointer to the newest tag (written after the tag's files are complete)
    step-000200/      engine.save_checkpoint(..., exclude_frozen_parameters=True): head weights, optimizer, scheduler

Resuming compares run.json with the new run first, so a checkpoint of another backbone or head shape fails with a
message naming every differing field, before DeepSpeed reads anything.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RUN_FILE = "run.json"
# identity fields -> why they must match
BACKBONE_FIELDS = ("backbone", "backbone_revision", "adapter", "adapter_revision", "hidden_size", "vocab_size")
HEAD_FIELDS = ("kind", "num_heads", "num_layers", "share_lm_head", "feature_layers")
ORDER_FIELDS = ("data_fingerprint", "seed", "seq_len", "eval_fraction", "eval_max_examples", "micro_batch_size",
                "grad_accum", "world_size", "max_steps", "lr", "warmup", "weight_decay", "grad_clip", "zero_stage",
                "dtype", "loss", "head_decay", "loss_vocab", "group_by_length", "seen_parts")


class CheckpointMismatchError(ValueError):
    """A checkpoint belongs to another backbone, head shape or run set-up than the run resuming from it."""


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write under a temp name in the same folder, then rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def run_identity(cfg, heads_config, data_fingerprint: str, world_size: int, seen_parts=()) -> dict:
    """What a checkpoint is tied to (``cfg``: the resolved TrainConfig; ``heads_config``: HeadsConfig;
    ``seen_parts``: the parts --init_heads trained on, which shape the held-out split)."""
    identity = {name: getattr(heads_config, name) for name in BACKBONE_FIELDS + HEAD_FIELDS}
    identity.update({name: getattr(cfg, name) for name in ORDER_FIELDS
                     if name not in ("data_fingerprint", "world_size", "loss_vocab", "seen_parts")})
    identity.update(data_fingerprint=data_fingerprint, world_size=world_size)
    # absent from checkpoints made before --init_heads existed: None (fresh heads) matches them
    identity["seen_parts"] = sorted(seen_parts) or None
    # absent from checkpoints made before --loss_vocab existed: None (all tokens) matches them
    identity["loss_vocab"] = cfg.draft_vocab_size if cfg.loss_vocab == "draft" else None
    return identity


def check_identity(found: dict, wanted: dict, folder: Path) -> None:
    """Raise CheckpointMismatchError naming each field where checkpoint and run differ."""
    def diff(names):
        return {n: (found.get(n), wanted.get(n)) for n in names if found.get(n) != wanted.get(n)}

    for names, what, hint in (
            (BACKBONE_FIELDS, "another backbone", "heads only fit the backbone they were trained on"),
            (HEAD_FIELDS, "another head shape", "the weights' shapes differ"),
            (ORDER_FIELDS, "other training settings", "a bit-identical resume needs the same data order and "
                                                      "optimizer layout")):
        bad = diff(names)
        if bad:
            detail = "; ".join(f"{n}: checkpoint {a!r}, this run {b!r}" for n, (a, b) in bad.items())
            if "seen_parts" in bad:  # the parts the run's --init_heads were trained on
                hint += "; seen_parts are the data parts of the run's --init_heads: resume with the same ones"
            raise CheckpointMismatchError(f"checkpoints in {folder} were made for {what} ({detail}): {hint}. "
                                          "Resume with the original settings, or train into a new --output_dir")


def latest_tag(folder: Path) -> str | None:
    latest = folder / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def prepare(folder: Path, identity: dict, resume: bool, rank: int) -> bool:
    """Check the checkpoint folder against the run; returns whether there is a checkpoint to resume from."""
    tag = latest_tag(folder)
    run_file = folder / RUN_FILE
    if tag is not None and not resume:
        raise FileExistsError(f"{folder} already holds checkpoints (latest {tag}): pass --resume to continue that run, "
                              "or choose another --output_dir")
    if resume and tag is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {folder} (no 'latest' file)")
    if run_file.is_file():
        if resume:
            check_identity(json.loads(run_file.read_text()), identity, folder)
        elif rank == 0:  # a run that never reached its first checkpoint: start over
            run_file.unlink()
    if rank == 0 and not run_file.is_file():
        atomic_write_text(run_file, json.dumps(identity, indent=2, sort_keys=True) + "\n")
    return tag is not None


@dataclass
class Progress:
    """What a run has spent up to a checkpoint, summed over the processes that made it (a resumed run counts the time
    of the work its checkpoints kept: steps after the last checkpoint of a killed process are redone, and counted
    once)."""

    wall_seconds: float = 0.0  # from each process's start to the checkpoint
    step_seconds: float = 0.0  # inside optimizer steps
    positions: float = 0.0  # trained positions
    processes: int = 0  # processes (starts) that made these steps
    known: bool = True  # False: resumed from a checkpoint older than this record (its earlier time is missing)


def save(engine, folder: Path, step: int, keep: int, rank: int, progress: Progress | None = None) -> None:
    """Checkpoint the heads, optimizer and scheduler (collective: every rank calls it), then prune old tags."""
    tag = f"step-{step:06d}"
    client_state = {"tokenmaxx_step": step, "torch_rng": torch.get_rng_state()}
    if progress is not None:
        client_state["tokenmaxx_progress"] = asdict(progress)
    engine.save_checkpoint(str(folder), tag=tag, client_state=client_state, exclude_frozen_parameters=True)
    if rank == 0 and keep > 0:
        tags = sorted(p for p in folder.glob("step-*") if p.is_dir())
        for old in tags[:-keep]:
            if old.name != tag:
                shutil.rmtree(old)


def load(engine, folder: Path) -> tuple[int, Progress]:
    """Restore the newest checkpoint into ``engine``; returns the optimizer step it was taken at and the run's
    progress up to it (``known=False`` for checkpoints made before progress was recorded)."""
    load_path, client_state = engine.load_checkpoint(str(folder), load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no loadable checkpoint in {folder} (tag {latest_tag(folder)})")
    torch.set_rng_state(client_state["torch_rng"])
    step = int(client_state["tokenmaxx_step"])
    if step != engine.global_steps:
        raise RuntimeError(f"checkpoint {load_path}: step {step} but the engine restored global_steps "
                           f"{engine.global_steps}")
    recorded = client_state.get("tokenmaxx_progress")
    return step, Progress(**recorded) if recorded else Progress(known=False)
