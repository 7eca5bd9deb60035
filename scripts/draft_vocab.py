#!/usr/bin/env python
"""Give trained heads a draft vocabulary (the most frequent tokens of their training data), or remove it.

    python scripts/draft_vocab.py --heads runs/smollm2/heads --data data/smollm2 --size 16384 [--out DIR]
    python scripts/draft_vocab.py --heads DIR --remove

Drafting then projects onto those tokens plus each prompt's own tokens instead of the whole vocabulary (see
tokenmaxx/heads/draft_vocab.py): much cheaper guesses, output unchanged. The held-out split is the trainer's
(same --seq_len / --eval_fraction / --seed), and its token coverage is recorded in config.extra["draft_vocab"].
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmaxx.heads import load_heads
from tokenmaxx.scripts.errors import run_script


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="heads folder (config.json + model.safetensors)")
    parser.add_argument("--data", help="the self-distilled dataset the heads were trained on")
    parser.add_argument("--size", type=int, default=16384, help="most frequent tokens kept")
    parser.add_argument("--out", help="write the heads here (default: update --heads in place)")
    parser.add_argument("--remove", action="store_true", help="remove the draft vocabulary instead")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--eval_fraction", type=float, default=0.05)
    parser.add_argument("--eval_max_examples", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    heads = load_heads(args.heads)
    if args.remove:
        heads.set_draft_vocab(None)
        heads.config.extra.pop("draft_vocab", None)
        record = None
    else:
        if not args.data:
            parser.error("--data is required (or pass --remove)")
        if args.size <= 0:
            parser.error(f"--size must be positive, got {args.size}")
        from tokenmaxx.training.batches import load_data
        from tokenmaxx.training.trainer import draft_vocab_from

        data = load_data(args.data, args.seq_len, args.eval_fraction, args.eval_max_examples, args.seed)
        ids, record = draft_vocab_from(data, args.size)
        heads.set_draft_vocab(ids)
        heads.config.extra["draft_vocab"] = {**record, "data": str(args.data)}
    heads.save_pretrained(args.out or args.heads)
    print(json.dumps({"heads": str(args.out or args.heads), "draft_vocab": record}))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
