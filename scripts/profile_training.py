#!/usr/bin/env python
"""Where a training step's time goes: the trainer's own pieces timed phase by phase, without DeepSpeed around them.

    python scripts/profile_training.py --data DIR --kind eagle3 --feature_cache DIR [--steps 20] [--warmup 3]

Phases per optimizer step (``--grad_accum`` micro-batches of ``--micro_batch_size`` sequences): ``batch`` (collate
and move), ``features`` (cached states read, or the backbone's forward), ``heads`` (the heads' training states: the
unrolled module for sequential kinds), ``loss`` (vocabulary projection, cross-entropy and its input gradient, fused),
``backward`` (autograd through the heads), ``optimizer`` (AdamW step). Prints one JSON line: seconds per phase,
trained positions per second (also without the features phase: what a run with a warm feature cache gets), and the
settings; run it alone on the machine (timings).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import torch

from tokenmaxx.heads import HEAD_KINDS, load_backbone
from tokenmaxx.scripts.errors import flag_parser, run_script
from tokenmaxx.training.batches import collate, load_data, step_micro_batches
from tokenmaxx.training.features import BackboneFeatures, FeatureCache
from tokenmaxx.training.linear_ce import linear_cross_entropy
from tokenmaxx.training.losses import HeadsObjective
from tokenmaxx.training.trainer import draft_vocab_from, step_norm

PHASES = ("batch", "features", "heads", "loss", "backward", "optimizer")


@dataclass
class ProfileArgs:
    data: str = field(metadata={"help": "self-distilled dataset folder"})
    kind: str = field(default="eagle3", metadata={"help": f"head kind, one of {sorted(HEAD_KINDS)}"})
    backbone: str = field(default="smollm2-135m", metadata={"help": "backbone alias / folder"})
    dtype: str = field(default="bfloat16", metadata={"help": "float32 | bfloat16"})
    num_heads: int = field(default=4, metadata={"help": "heads / depths"})
    feature_layers: list[int] | None = field(default=None, metadata={
        "help": "kind eagle3: backbone hidden states read (default EAGLE-3's 2, L//2, L-3)"})
    seq_len: int = field(default=768, metadata={"help": "max tokens per sequence"})
    micro_batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch"})
    grad_accum: int = field(default=4, metadata={"help": "micro-batches per optimizer step"})
    draft_vocab_size: int = field(default=16384, metadata={"help": "loss vocabulary (0: the whole vocabulary)"})
    feature_cache: str | None = field(default=None, metadata={"help": "feature cache folder (built if missing)"})
    steps: int = field(default=20, metadata={"help": "timed optimizer steps"})
    warmup: int = field(default=3, metadata={"help": "untimed steps first"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    group_by_length: bool = field(default=True, metadata={
        "help": "micro-batches of similar length within each step, as train_heads does by default"})


def main(argv=None) -> int:
    (args,) = flag_parser(ProfileArgs).parse_args_into_dataclasses(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_backbone(args.backbone, dtype=args.dtype)
    device = model.get_output_embeddings().weight.device
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    data = load_data(args.data, args.seq_len, 0.02, 64, 0)
    layers = {"feature_layers": list(args.feature_layers)} if args.feature_layers else {}
    heads = HEAD_KINDS[args.kind].for_backbone(model, num_heads=args.num_heads, **layers)
    heads = heads.to(device, getattr(torch, args.dtype))
    heads.train().requires_grad_(True)
    vocab = draft_vocab_from(data, args.draft_vocab_size)[0] if args.draft_vocab_size else None
    objective = HeadsObjective(heads, "ce", vocab=vocab)
    features = FeatureCache.build_or_open(args.feature_cache, model, data, args.seq_len, args.num_heads,
                                          layers=heads.feature_layers) if args.feature_cache \
        else BackboneFeatures(model, data, heads.feature_layers)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-4)
    order = step_micro_batches(data.train, 0, max(1, len(data.train) // (args.micro_batch_size * args.grad_accum)),
                               args.grad_accum, 0, 0, 1, args.micro_batch_size,
                               data.window_lengths(args.num_heads) if args.group_by_length else None)
    totals, positions = dict.fromkeys(PHASES, 0.0), 0
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        seconds = dict.fromkeys(PHASES, 0.0)
        t0 = time.perf_counter()
        batches = [collate(data, rows, args.num_heads).to(device) for rows in next(order)]
        norm = step_norm(objective, batches, lm_head)  # as the trainer weighs a step's targets
        seconds["batch"] += time.perf_counter() - t0
        for batch in batches:
            t1 = time.perf_counter()
            hidden = features.hidden(batch)  # [B, W, F]
            t2 = time.perf_counter()
            sel = objective.select(hidden, batch.input_ids, batch.answer_start, batch.lengths, lm_head)
            states = objective.head_states(hidden, batch.input_ids, sel.selected, embed)  # [K, n, H]
            t3 = time.perf_counter()
            num_heads, n = sel.targets.shape
            safe = torch.where(sel.trained, sel.targets, 0).flatten()
            ce, kl, hit = linear_cross_entropy(states.reshape(num_heads * n, -1), objective.projection(lm_head), safe)
            loss, _ = objective.loss(ce.view(num_heads, n), kl.view(num_heads, n), hit.view(num_heads, n),
                                     sel.trained, norm)
            t4 = time.perf_counter()
            loss.backward()
            t5 = time.perf_counter()
            for name, a, b in zip(PHASES[1:], (t1, t2, t3, t4), (t2, t3, t4, t5)):
                seconds[name] += b - a
            positions += int(sel.trained.any(0).sum()) if timed else 0
        t6 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds["optimizer"] += time.perf_counter() - t6
        if timed:
            for name in PHASES:
                totals[name] += seconds[name]
    total = sum(totals.values())
    own = total - totals["features"]  # what a step costs once the features are read from a cache
    record = {"positions_per_s": round(positions / total, 1),
              "positions_per_s_without_features": round(positions / own, 1),
              "seconds_per_step": round(total / args.steps, 4),
              "share": {k: round(v / total, 3) for k, v in totals.items()},
              "seconds": {k: round(v / args.steps, 4) for k, v in totals.items()},
              "positions_per_step": round(positions / args.steps, 1), "settings": vars(args)}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
