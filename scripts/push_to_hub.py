#!/usr/bin/env python
"""Push trained heads to the Hugging Face Hub: config.json, model.safetensors and a generated README.md model card,
in one commit (the repo, and the branch given by --revision, are created if needed).

    python scripts/push_to_hub.py --heads runs/heads/heads --repo-id ORG/NAME [--private] [--revision BRANCH] \
        [--bench runs/bench.json]

    python scripts/push_to_hub.py --heads runs/heads/heads --card_only [--repo-id ORG/NAME] [--bench ...]

The token comes from HF_TOKEN or the saved login (`hf auth login`); it is never printed. --card_only writes the card
into the heads folder (README.md) without any network access, to read it before pushing; --repo-id is optional then
(without it the card's title and usage name no repo). It does not replace a README.md there that differs (a card you
edited, a benchmark section) unless --overwrite is given. Bad input ends in one `error:` line and exit status 2
(--debug: the traceback).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field


from tokenmaxx.heads import push_heads
from tokenmaxx.heads.io.card import save_model_card
from tokenmaxx.scripts.errors import flag_parser, run_script


@dataclass
class PushArgs:
    heads: str = field(metadata={"help": "heads folder written by save_pretrained / the trainer's export"})
    repo_id: str | None = field(default=None, metadata={
        "help": "Hub repo id, ORG/NAME (required to push; optional with --card_only)"})
    private: bool = field(default=False, metadata={"help": "create the repo private (ignored if it exists already)"})
    revision: str | None = field(default=None, metadata={"help": "branch to commit to (created from main if missing)"})
    commit_message: str | None = field(default=None, metadata={"help": "commit message (default: names the heads)"})
    bench: str | None = field(default=None, metadata={
        "help": "bench JSON (scripts/bench.py) whose tau and speedup per category go into the model card"})
    bench_methods: str | None = field(default=None, metadata={
        "help": "comma-separated raw method names of --bench the card shows, in the bench's order (default: the "
                "reference methods and those named after the heads' kind, e.g. mtp and mtp_hybrid); use it when the "
                "bench ran these heads as its --heads (tokenmaxx, hybrid)"})
    license: str | None = field(default=None, metadata={
        "help": "license id for the card (default: the backbone's, when known)"})
    endpoint: str | None = field(default=None, metadata={"help": "Hub URL (default: HF_ENDPOINT or huggingface.co)"})
    card_only: bool = field(default=False, metadata={"help": "only write HEADS/README.md; push nothing"})
    overwrite: bool = field(default=False, metadata={
        "help": "with --card_only: replace an existing HEADS/README.md that differs from the new card (its content "
                "is lost)"})

    def __post_init__(self) -> None:
        if not self.card_only and not self.repo_id:
            raise ValueError("--repo_id ORG/NAME is required to push (only --card_only, which writes the card into "
                             "the heads folder, works without one)")
        if self.bench_methods and self.bench is None:
            raise ValueError("--bench_methods names rows of a bench JSON: give the JSON with --bench")


def main(argv=None) -> int:
    (args,) = flag_parser(PushArgs).parse_args_into_dataclasses(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    methods = [m.strip() for m in args.bench_methods.split(",") if m.strip()] if args.bench_methods else None
    if args.card_only:
        print(f"wrote {save_model_card(args.heads, args.repo_id, args.bench, args.license, methods, args.overwrite)}")
        return 0
    info = push_heads(args.heads, args.repo_id, private=args.private, revision=args.revision,
                      commit_message=args.commit_message, bench=args.bench, license=args.license,
                      endpoint=args.endpoint, bench_methods=methods)
    print(f"pushed {args.heads} to {args.repo_id} (revision {args.revision or 'main'}): {info.commit_url}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
