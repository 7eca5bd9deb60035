#!/usr/bin/env python
"""Generate with draft heads on a backbone; optionally compare with plain ``model.generate``.

    python scripts/generate.py --prompt "Explain KV caches in two sentences." --compare
    python scripts/generate.py --backbone smollm2-135m --heads path/or/org-name --dtype bfloat16 --json
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, TextStreamer

from tokenmaxx.heads import DEFAULT_BACKBONE, load_backbone, resolve_heads
from tokenmaxx.inference import SpeculativeGenerator, TypicalAcceptance

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint. Use simple words."


@dataclass
class GenerateArgs:
    backbone: str = field(default=DEFAULT_BACKBONE, metadata={"help": "backbone alias, local HF folder or Hub id"})
    heads: str | None = field(default=None, metadata={
        "help": "heads folder or Hub id; default: the heads shipped for the backbone; 'untrained' builds fresh "
                "heads (each guesses the backbone's own next token again: a weak baseline)"})
    kind: str | None = field(default=None, metadata={
        "help": "medusa | mtp: use the shipped heads of this kind (or fresh ones of it with --heads untrained)"})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter merged into the backbone"})
    prompt: str = field(default=DEFAULT_PROMPT, metadata={"help": "the user message (or raw text with --raw)"})
    raw: bool = field(default=False, metadata={"help": "feed the prompt as raw text, without the chat template"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate at most"})
    dtype: str = field(default="bfloat16", metadata={"help": "float32 | bfloat16 | float16"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    tree: str | None = field(default=None, metadata={
        "help": "draft tree: Medusa heads: 'default', 'chain:K', 'auto' (calibrated for this machine), a JSON list "
                "of paths or a JSON file; MTP heads: 'dynamic', 'dynamic:N' (N nodes) or "
                "'dynamic:nodes=N,topk=K,depth=D'; default: the heads' own"})
    draft: str = field(default="heads", metadata={
        "help": "heads | lookup | hybrid: who drafts the tree (hybrid adds prompt-lookup branches to the heads' tree)"})
    do_sample: bool = field(default=False, metadata={
        "help": "sample (lossless speculative sampling: the backbone's own distribution) instead of greedy"})
    temperature: float | None = field(default=None, metadata={"help": "sampling temperature (0: greedy)"})
    top_k: int | None = field(default=None, metadata={"help": "sampling top-k"})
    top_p: float | None = field(default=None, metadata={"help": "sampling nucleus mass"})
    seed: int | None = field(default=None, metadata={"help": "sampling seed (deterministic output)"})
    typical: bool = field(default=False, metadata={
        "help": "Medusa typical acceptance instead of the lossless rule: faster, NOT the backbone's distribution"})
    json: bool = field(default=False, metadata={"help": "print one JSON object (text, token ids, stats)"})
    stream: bool = field(default=False, metadata={"help": "stream the text as it is generated"})
    compare: bool = field(default=False, metadata={
        "help": "also run plain model.generate (greedy) and print both speeds and whether the tokens are identical"})
    repeats: int = field(default=1, metadata={"help": "with --compare: interleaved repeats, best time kept"})

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.threads <= 0 or self.repeats <= 0:
            raise ValueError("--threads and --repeats must be positive")


def plain_generate(model, input_ids, max_new_tokens):
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    (args,) = HfArgumentParser(GenerateArgs).parse_args_into_dataclasses(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, adapter=args.adapter)
    heads = resolve_heads(args.heads, model, args.backbone, fallback_untrained=True, kind=args.kind)
    gen = SpeculativeGenerator(model, heads, tokenizer=tokenizer, tree=args.tree, draft=args.draft)
    tree_desc = f"dynamic tree {gen.dynamic.nodes} nodes" if gen.dynamic else f"tree {len(gen.tree)} nodes"
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    input_ids = gen.encode(prompt)

    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, typical=TypicalAcceptance() if args.typical else None)
    if not args.compare:
        streamer = TextStreamer(tokenizer, skip_prompt=True) if args.stream and not args.json else None
        out = gen.generate(input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **sampling)
        if args.json:
            print(json.dumps({"text": out.text, "new_tokens": out.new_tokens, "stats": out.stats.to_dict()}))
        else:
            if streamer is None:
                print(out.text)
            s = out.stats
            print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, mean tau {s.mean_tau:.2f} "
                  f"over {s.steps} steps, {tree_desc}]", file=sys.stderr)
        return 0

    if args.do_sample:
        raise SystemExit("--compare checks token identity with greedy generate: use it without --do_sample")
    # Warm up both paths, then interleave: spec, plain, spec, plain... keeping each one's best time.
    gen.generate(input_ids, max_new_tokens=8)
    plain_generate(model, input_ids, 8)
    best_spec = best_plain = float("inf")
    for _ in range(args.repeats):
        spec = gen.generate(input_ids, max_new_tokens=args.max_new_tokens)
        best_spec = min(best_spec, spec.stats.wall_seconds)
        plain, seconds = plain_generate(model, input_ids, args.max_new_tokens)
        best_plain = min(best_plain, seconds)
    plain_new = plain[0, input_ids.shape[1]:].tolist()
    identical = plain_new == spec.new_tokens
    s = spec.stats
    step_overhead = {k: v / s.steps for k, v in s.phase_seconds.items()} if s.steps else {}
    result = {
        "backbone": args.backbone, "dtype": args.dtype, "threads": args.threads, "tree": tree_desc,
        "prompt_tokens": input_ids.shape[1], "identical": identical,
        "speculative": {"tokens": s.new_tokens, "seconds": best_spec, "tokens_per_s": s.new_tokens / best_spec,
                        "mean_tau": s.mean_tau, "steps": s.steps, "seconds_per_step": step_overhead,
                        "accepted_by_source": s.accepted_by_source},
        "plain": {"tokens": len(plain_new), "seconds": best_plain, "tokens_per_s": len(plain_new) / best_plain,
                  "seconds_per_token": best_plain / max(len(plain_new), 1)},
        "speedup": (s.new_tokens / best_spec) / (len(plain_new) / best_plain),
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({**result, "text": spec.text}))
    else:
        print(spec.text)
        print(f"\nspeculative: {result['speculative']['tokens_per_s']:.1f} tok/s (mean tau {s.mean_tau:.2f}, "
              f"{s.steps} steps, {tree_desc})")
        print(f"plain:       {result['plain']['tokens_per_s']:.1f} tok/s")
        print(f"speedup:     {result['speedup']:.2f}x   identical tokens: {identical}")
        per_step = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in step_overhead.items())
        print(f"per step:    {per_step}; plain decode {result['plain']['seconds_per_token'] * 1e3:.2f} ms/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
