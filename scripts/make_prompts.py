#!/usr/bin/env python
"""Build the training prompt mix (training/prompt_mix.py) and write it as .jsonl parts for make_data.

    python scripts/make_prompts.py --output_dir data/mix --exclude ../shared/bench [--part_size 2048]

Writes OUTPUT_DIR/prompts-000.jsonl, prompts-001.jsonl, ... (records {"messages", "source", "origin"}, in the mix's
order: any first N parts are a sample of the whole mix) and OUTPUT_DIR/mix.json (settings and counts per source).
Each part is then answered by the backbone on its own (``make_data --sources PART --whole_conversation true``), so a
recipe can stop after any part and resume at the next; ``merge_data`` joins the finished parts.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


from tokenmaxx.scripts.errors import flag_parser, run_script
from tokenmaxx.training.data import load_exclusions, normalize, read_json_array, sharegpt_path
from tokenmaxx.training.prompt_mix import MixConfig, build_mix


@dataclass
class PromptArgs:
    output_dir: str = field(metadata={"help": "folder for the prompts-NNN.jsonl parts and mix.json"})
    exclude: list[str] = field(default_factory=list, metadata={
        "help": "benchmark prompts never to train on (.jsonl files or folders of them): records with a user turn "
                "equal to one of theirs are dropped (make_data checks again)"})
    part_size: int = field(default=2048, metadata={"help": "prompts per part (the unit a recipe resumes at)"})
    seed: int = field(default=0, metadata={"help": "seed of the mix's order and its generated parts"})
    overwrite: bool = field(default=False, metadata={"help": "replace parts already in output_dir"})

    def __post_init__(self):
        if self.part_size <= 0:
            raise ValueError(f"--part_size must be positive, got {self.part_size}")


def main(argv=None) -> int:
    (args,) = flag_parser(PromptArgs).parse_args_into_dataclasses(argv)
    out = Path(args.output_dir)
    if out.is_dir() and any(out.glob("prompts-*.jsonl")) and not args.overwrite:
        raise ValueError(f"{out} already holds prompt parts; pass --overwrite to replace them")
    mix = build_mix(read_json_array(sharegpt_path()), MixConfig(seed=args.seed))
    excluded = load_exclusions(args.exclude)
    kept = [r for r in mix if not any(m["role"] == "user" and normalize(m["content"]) in excluded
                                      for m in r["messages"])]
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("prompts-*.jsonl"):
        old.unlink()
    parts = [kept[i:i + args.part_size] for i in range(0, len(kept), args.part_size)]
    for p, part in enumerate(parts):
        tmp = out / f".prompts-{p:03d}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        tmp.replace(out / f"prompts-{p:03d}.jsonl")
    record = {"seed": args.seed, "part_size": args.part_size, "parts": len(parts), "prompts": len(kept),
              "excluded": len(mix) - len(kept), "exclude": args.exclude,
              "per_source": dict(Counter(r["source"] for r in kept)),
              "per_source_first_part": dict(Counter(r["source"] for r in parts[0])) if parts else {}}
    (out / "mix.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(json.dumps(record, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
