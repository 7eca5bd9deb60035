#!/usr/bin/env python
"""Train draft heads (EAGLE-3 unless --kind says mtp or medusa) on a frozen backbone with DeepSpeed, then export them.

One process:
    python scripts/train_heads.py --data data/smollm2 --backbone smollm2-135m --output_dir runs/smollm2 \\
        --feature_cache runs/smollm2/features --max_steps 2000
MTP heads (one decoder layer of the backbone's family, unrolled over --num_heads depths):
    python scripts/train_heads.py --kind mtp --data data/smollm2 --output_dir runs/smollm2-mtp ...
Two processes on one machine (data-parallel over gloo):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 scripts/train_heads.py --data ... --output_dir ...
DeepSpeed's launcher (same environment variables; its --local_rank argument is accepted and ignored):
    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 scripts/train_heads.py --data ... --output_dir ...
Continue an interrupted run bit-identically: the same command plus --resume.

DeepSpeed settings live in --ds_config (default training/ds_config.json); its "auto" values are filled from the
flags, and a flag that contradicts a concrete JSON value is an error. `--help` lists every flag.
The result is one JSON object on stdout (rank 0), the only thing there: logs, DeepSpeed's included, go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys


from tokenmaxx.scripts.errors import flag_parser, run_script
from tokenmaxx.training.train_config import TrainConfig
from tokenmaxx.training.trainer import train


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop ``--local_rank N`` / ``--local_rank=N`` that the deepspeed launcher appends (LOCAL_RANK is in the env)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not re.match(r"--local[_-]rank=", arg):
            out.append(arg)
    return out


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout meanwhile goes to stderr: Python's prints and loggers bound to sys.stdout
    (DeepSpeed's) and, through file descriptor 1, compiled code and subprocesses (DeepSpeed's op builds)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


INTERRUPTED_NOTE = "the checkpoints written so far are kept; the same command with --resume goes on from the last"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = flag_parser(TrainConfig, description=__doc__.split("\n\n")[0])
    (cfg,) = parser.parse_args_into_dataclasses(args=strip_launcher_args(sys.argv[1:] if argv is None else argv),
                                                look_for_args_file=False)
    with stdout_to_stderr():  # the result's JSON below is all of stdout (`| jq` reads it)
        result = train(cfg)
    import deepspeed.comm as dist

    if dist.get_rank() == 0:
        print(json.dumps({"export_dir": str(result.export_dir), "steps": result.steps,
                          "positions_per_s": round(result.positions_per_s, 1),
                          "wall_seconds": round(result.wall_seconds, 1),
                          **{k: v for k, v in result.metrics.items() if not k.startswith("rank_acc")},
                          **({"by_category": {c: {k: m[k] for k in ("eval_examples", "head_top1", "head_top5")}
                                              for c, m in result.metrics["by_category"].items()}}
                             if "by_category" in result.metrics else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
