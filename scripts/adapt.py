#!/usr/bin/env python
"""Adapt trained heads to recorded traffic (generate --record): fine-tune them on the backbone's own states and tokens,
with a replay sample of their training data, and ship them only if they score better on held-out traffic.

    tokenmaxx generate --prompts_file my_prompts.jsonl --record traffic/
    tokenmaxx adapt --heads heads/pretrained/smollm2-135m --traffic traffic/ --replay distilled/smollm2-mix \\
        --output_dir runs/adapted
    tokenmaxx generate --heads runs/adapted/heads --prompt "..."

The report (before and after, per category, and the run's speed) is the one JSON object on stdout and
OUT/adapt.json; exit status 1 when the adapted heads did not win (nothing is shipped then). The same command plus
--resume goes on from the newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import sys

from tokenmaxx.scripts.errors import parse_flags, run_script
from tokenmaxx.scripts.train_heads import INTERRUPTED_NOTE, stdout_to_stderr  # noqa: F401 (run_script's note)
from tokenmaxx.training.adapt import AdaptConfig, adapt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_flags(AdaptConfig, argv, description=__doc__.split("\n\n")[0])
    with stdout_to_stderr():  # the report is all of stdout
        report = adapt(cfg)
    print(json.dumps(report))
    return 0 if report["shipped"] else 1


if __name__ == "__main__":
    sys.exit(run_script(main))
