"""The ``tokenmaxx`` console command: ``tokenmaxx <command> [flags]`` runs the matching script's ``main(flags)``.

    tokenmaxx generate --prompt "Explain KV caches in two sentences." --compare
    tokenmaxx bench --prompts spec_bench_dev.jsonl --limit 5 --out runs/bench
    tokenmaxx generate --help

Each command takes exactly the flags of its script (``python scripts/<script>.py`` runs the same code). Bad input ends
in one ``error: ...`` line and status 2, Ctrl-C in one ``interrupted`` line and status 130; ``--debug`` (or
``TOKENMAXX_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import sys

from tokenmaxx.scripts.errors import DEBUG_FLAG, debugging, interrupted, run_script

# command -> (module in tokenmaxx.scripts, one line of help). Scripts are imported only when their command runs.
COMMANDS = {
    "generate": ("generate", "speculative generation with draft heads; --compare times plain generate too"),
    "bench": ("bench", "benchmark against plain generate, prompt lookup and assisted generation"),
    "train": ("train_heads", "train draft heads on a frozen backbone (DeepSpeed) and export them"),
    "make-data": ("make_data", "self-distilled training data: the backbone answers chat prompts"),
    "make-text-data": ("make_text_data", "training data from text the backbone did not write (ShareGPT's answers, "
                                         "task-shaped text), labelled by it in training (--loss kl)"),
    "adapt": ("adapt", "fine-tune heads on recorded traffic (generate --record): no backbone forward, shipped only "
                       "if they score better on held-out traffic"),
    "push": ("push_to_hub", "push trained heads (and their model card) to the Hugging Face Hub"),
    "export": ("export_heads", "export heads for a serving engine (EAGLE-3 for vLLM / SGLang, or speculators' layout)"),
    "eval": ("eval_heads", "held-out accuracy of trained heads on a self-distilled dataset, per depth and category"),
    "acceptance": ("acceptance", "where the heads' acceptance is lost: tau per category, depth and tree size, and the "
                                 "tokens their draft vocabulary cannot guess"),
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
    words = [a for a in argv if a != DEBUG_FLAG]  # --debug may come anywhere: run_script reads it from the flags
    if words[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not words or words[0] not in COMMANDS:
        what = f"unknown command {words[0]!r}" if words else "missing command"
        print(f"{PROG}: error: {what}; known commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    name, flags = words[0], list(argv)
    flags.remove(name)  # only --debug can come before the command; it stays in the flags for run_script
    try:  # (importing a script imports torch and transformers: seconds, in which Ctrl-C must end quietly too)
        script = importlib.import_module(f"tokenmaxx.scripts.{COMMANDS[name][0]}")
    except KeyboardInterrupt:
        if debugging(flags):
            raise
        return interrupted()
    saved, sys.argv = sys.argv, [f"{PROG} {name}", *flags]  # argparse names the program after argv[0]
    try:
        return run_script(script.main, flags)  # bad input: one error line, status 2 (--debug: the traceback)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
