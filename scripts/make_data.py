"""Self-distilled training data: the backbone answers chat prompts; the result is a datasets.Dataset on disk.

    python scripts/make_data.py --output_dir data/sharegpt-smollm2 --max_prompts 20000 --max_new_tokens 256 \
        --exclude ../shared/bench

--exclude names the benchmark prompts never to train on (.jsonl files or folders of them; nothing is excluded unless
given). Re-running the same command after an interruption resumes where it stopped. ``--help`` lists every option.
"""

from __future__ import annotations

import sys

from transformers import HfArgumentParser

from tokenmaxx.heads import load_backbone
from tokenmaxx.scripts.errors import run_script
from tokenmaxx.training.data import DataConfig, DataStats, make_data


def main(argv: list[str] | None = None, model=None, tokenizer=None):
    """Parse DataConfig flags, load the backbone (unless a model and tokenizer are given), make the data."""
    parser = HfArgumentParser(DataConfig, description=__doc__.split("\n\n")[0])
    (config,) = parser.parse_args_into_dataclasses(args=argv)
    if not config.exclude:
        print("note: nothing to --exclude: prompts that are also benchmark prompts are kept (name the benchmark's "
              ".jsonl files or folder to drop them)", file=sys.stderr)
    if model is None:
        model, tokenizer = load_backbone(config.backbone, dtype=config.dtype, device=config.device)
    stats = DataStats()
    dataset = make_data(config, model, tokenizer, stats)
    print(f"make_data: {config.output_dir}: {stats.summary()}", flush=True)
    return dataset, stats


if __name__ == "__main__":
    sys.exit(run_script(main))
