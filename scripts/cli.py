"""The ``tokenmaxx`` console command: ``tokenmaxx <command> [flags]`` runs the matching script's ``main(flags)``.

    tokenmaxx generate --prompt "Explain KV caches in two sentences." --compare
    tokenmaxx bench --prompts spec_bench_dev.jsonl --limit 5 --out runs/bench
    tokenmaxx generate --help

Each command takes exactly the flags of its script (``python scripts/<script>.py`` runs the same code).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module in tokenmaxx.scripts, one line of help). Scripts are imported only when their command runs.
COMMANDS = {
    "generate": ("generate", "speculative generation with draft heads; --compare times plain generate too"),
    "bench": ("bench", "benchmark against plain generate, prompt lookup and assisted generation"),
    "train": ("train_heads", "train draft heads on a frozen backbone (DeepSpeed) and export them"),
    "make-data": ("make_data", "self-distilled training data: the backbone answers chat prompts"),
    "push": ("push_to_hub", "push trained heads (and their model card) to the Hugging Face Hub"),
}
PROG = "tokenmaxx"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} <command> [flags]   ({PROG} <command> --help lists a command's flags)", "",
             "Self-drafting speculative decoding for Hugging Face causal LMs.", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "missing command"
        print(f"{PROG}: error: {what}; known commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    name, flags = argv[0], argv[1:]
    script = importlib.import_module(f"tokenmaxx.scripts.{COMMANDS[name][0]}")
    saved, sys.argv = sys.argv, [f"{PROG} {name}", *flags]  # argparse names the program after argv[0]
    try:
        code = script.main(flags)
    finally:
        sys.argv = saved
    return code if isinstance(code, int) else 0  # make_data's main returns its dataset and stats


if __name__ == "__main__":
    sys.exit(main())
