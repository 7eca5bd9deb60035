#!/usr/bin/env python
"""Generate with draft heads on a backbone; optionally compare with plain ``model.generate``.

    python scripts/generate.py --prompt "Explain KV caches in two sentences." --compare
    python scripts/generate.py --backbone smollm2-135m --heads path/or/org-name --dtype float32 --json
    python scripts/generate.py --temperature 0.8 --seed 1      # samples (a temperature > 0 implies --do_sample)

Defaults are the library's (tokenmaxx.inference.DEFAULT_DRAFT / DEFAULT_DTYPE, the shipped default heads).
Bad input ends in one ``error: ...`` line and exit status 2; ``--debug`` (or ``TOKENMAXX_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field

import torch
from transformers import TextStreamer

from tokenmaxx.heads import DEFAULT_BACKBONE, DEFAULT_HEAD_KIND, default_heads_path, head_kind, load_backbone, resolve_heads
from tokenmaxx.heads.io.backbones import DEVICE_HELP, resolve_device
from tokenmaxx.inference import DEFAULT_DRAFT, DEFAULT_DTYPE, DRAFT_MODES, SpeculativeGenerator, TypicalAcceptance
from tokenmaxx.heads.machine import clock
from tokenmaxx.scripts.errors import parse_flags, run_script

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint. Use simple words."


@dataclass
class GenerateArgs:
    backbone: str = field(default=DEFAULT_BACKBONE, metadata={"help": "backbone alias, local HF folder or Hub id"})
    heads: str | None = field(default=None, metadata={
        "help": "heads folder or Hub id; default: the heads shipped for the backbone; 'untrained' builds fresh "
                "heads (each guesses the backbone's own next token again: a weak baseline)"})
    kind: str | None = field(default=None, metadata={
        "help": "medusa | mtp | eagle3: use the shipped heads of this kind (or fresh ones of it with --heads "
                f"untrained); default: the shipped default heads, whatever their kind (fresh: {DEFAULT_HEAD_KIND!r})"})
    adapter: str | None = field(default=None, metadata={"help": "PEFT adapter merged into the backbone"})
    prompt: str = field(default=DEFAULT_PROMPT, metadata={"help": "the user message (or raw text with --raw)"})
    raw: bool = field(default=False, metadata={"help": "feed the prompt as raw text, without the chat template"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate at most"})
    dtype: str = field(default=DEFAULT_DTYPE, metadata={
        "help": "auto (bfloat16 where it is native: a GPU, a CPU with AVX-512 BF16 / AMX; else float32) | float32 | "
                "bfloat16 | float16"})
    device: str = field(default="auto", metadata={"help": DEVICE_HELP})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    tree: str | None = field(default=None, metadata={
        "help": "draft tree: EAGLE-3 and MTP heads (the shipped default heads are EAGLE-3) grow a dynamic tree: "
                "'dynamic', 'dynamic:N' (N nodes), 'dynamic:nodes=N,topk=K,depth=D,min_mass=M' or 'auto'; Medusa "
                "heads take a static tree: 'default', 'chain:K', 'auto', a JSON list of paths or a JSON file; "
                "'auto' calibrates for this machine, 'auto:prompts=N,tokens=T' on less text (N of 8 prompts, T tokens "
                "each; quicker, noisier); default: the heads' own"})
    draft: str | None = field(default=None, metadata={
        "help": "heads | lookup | hybrid: who drafts the tree (hybrid adds prompt-lookup branches to the heads' tree); "
                f"default: {DEFAULT_DRAFT} where trained heads exist for the backbone (or --heads is given), else lookup"})
    adaptive_budget: bool = field(default=True, metadata={
        "help": "cut each round's tree (heads and hybrid) to the nodes worth their verify time on this machine's "
                "measured costs; false verifies the whole tree every round and measures nothing"})
    do_sample: bool | None = field(default=None, metadata={
        "nargs": "?", "const": True,  # a bare --do_sample means true, as for the other bool flags
        "help": "sample (lossless speculative sampling: the backbone's own distribution) instead of greedy; default: "
                "sample when --temperature > 0, --top_p < 1 or --top_k is given, else greedy; 'false' together "
                "with one of those is refused"})
    temperature: float | None = field(default=None, metadata={
        "help": "sampling temperature; > 0 samples (implies --do_sample), 0 means greedy"})
    top_k: int | None = field(default=None, metadata={"help": "sampling top-k (implies --do_sample; 0: off)"})
    top_p: float | None = field(default=None, metadata={"help": "sampling nucleus mass (< 1 implies --do_sample)"})
    seed: int | None = field(default=None, metadata={
        "help": "seed of the run: sampling, and untrained heads (deterministic output)"})
    typical: bool = field(default=False, metadata={
        "help": "Medusa typical acceptance instead of the lossless rule: faster, NOT the backbone's distribution"})
    json: bool = field(default=False, metadata={"help": "print one JSON object (text, token ids, stats)"})
    stream: bool = field(default=False, metadata={"help": "stream the text as it is generated"})
    compare: bool = field(default=False, metadata={
        "help": "also run plain model.generate (greedy) and print both speeds and whether the tokens are identical"})
    repeats: int = field(default=1, metadata={"help": "with --compare: interleaved repeats, best time kept"})
    prompts_file: str | None = field(default=None, metadata={
        "help": "prompts instead of --prompt: one per line, or a .jsonl file of {\"prompt\": ...} objects; with "
                "--compare prints each one's speedup and the mean, with --record records them all"})
    record: str | None = field(default=None, metadata={
        "help": "folder to append the traffic to (the backbone's states the heads read and its tokens, for "
                "`tokenmaxx adapt`); with --prompts_file, a rerun of the same command goes on after the prompts "
                "already recorded"})
    batch_size: int = field(default=1, metadata={"help": "with --prompts_file --record: prompts a generate call"})

    def __post_init__(self):
        resolve_device(self.device)  # refuses a device this machine does not have
        if self.kind is not None:
            head_kind(self.kind)  # ValueError naming the known kinds
        if self.draft is not None and self.draft not in DRAFT_MODES:
            raise ValueError(f"unknown --draft {self.draft!r}: expected one of {', '.join(DRAFT_MODES)}")
        if not (self.prompt if self.raw else self.prompt.strip()):
            raise ValueError("--prompt is empty")
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.threads <= 0 or self.repeats <= 0:
            raise ValueError("--threads and --repeats must be positive")
        for name, bad, expected in [("temperature", self.temperature is not None and self.temperature < 0,
                                     ">= 0 (0: greedy)"),
                                    ("top_p", self.top_p is not None and not 0 < self.top_p <= 1, "in (0, 1]"),
                                    ("top_k", self.top_k is not None and self.top_k < 0, ">= 0 (0: off)")]:
            if bad:
                raise ValueError(f"--{name} must be {expected}, got {getattr(self, name)}")
        if self.do_sample is False and self.sampling_flags():
            raise ValueError(f"--do_sample false contradicts {' '.join(self.sampling_flags())}: drop "
                             "--do_sample false to sample, or pass --temperature 0 for greedy decoding")
        if self.compare and self.sampling:
            raise ValueError("--compare checks token identity with greedy generate: use it without sampling "
                             "(no --do_sample, --temperature > 0, --top_p or --top_k)")
        if self.prompts_file is not None and not (self.compare or self.record):
            raise ValueError("--prompts_file gives prompts to --compare or to --record: add one of them")
        if self.compare and self.record:
            raise ValueError("--record keeps traffic and --compare times it: run them separately")
        if self.batch_size <= 0:
            raise ValueError(f"--batch_size must be positive, got {self.batch_size}")
        if self.typical and not self.sampling:
            raise ValueError("--typical is an acceptance rule for sampling: give --temperature > 0 (or --do_sample)")

    def sampling_flags(self) -> list[str]:
        """The given flags that ask for sampling (none when --temperature is 0, which means greedy)."""
        if self.temperature == 0:
            return []
        given = [("temperature", self.temperature is not None), ("top_p", self.top_p is not None and self.top_p < 1),
                 ("top_k", bool(self.top_k))]
        return [f"--{name} {getattr(self, name)}" for name, on in given if on]

    @property
    def sampling(self) -> bool:
        """do_sample as resolved: --temperature 0 is greedy; unset, it follows the sampling flags."""
        if self.temperature == 0:
            return False
        return self.do_sample if self.do_sample is not None else bool(self.sampling_flags())

    def generate_kwargs(self) -> dict:
        """Decoding keyword arguments of ``SpeculativeGenerator.generate`` (do_sample resolved)."""
        return dict(do_sample=self.sampling, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    seed=self.seed, typical=TypicalAcceptance() if self.typical else None)


def parse_args(argv: list[str] | None = None) -> GenerateArgs:
    """GenerateArgs from the command line; a bad value exits with one ``error:`` line (status 2), like argparse."""
    args = parse_flags(GenerateArgs, argv, description=__doc__.split("\n\n")[0])
    if args.do_sample is None and args.sampling:
        print(f"note: {' '.join(args.sampling_flags())} without --do_sample: sampling (--temperature 0 for greedy)",
              file=sys.stderr)
    return args


def plain_generate(model, input_ids, max_new_tokens):
    """Greedy ``model.generate`` on the backbone's device: (sequences [1, T], seconds, waiting for the device)."""
    device = model.get_output_embeddings().weight.device
    input_ids = input_ids.to(device)
    start = clock(device)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out, clock(device) - start


def mismatch_reason(dtype: str) -> str:
    """Why speculative output can differ from plain greedy ``generate`` in ``dtype``, and the fix."""
    if dtype == "float32":
        return ("in float32 the output must be identical: this is a bug, please report it with the prompt and "
                "--json output")
    return (f"in {dtype} a tree verify (many tokens in one forward) and plain generate's one-token forwards round "
            "differently, so near-tied logits can pick another token; --dtype float32 gives identical output")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.seed is not None:  # untrained heads are drawn at random too: --seed makes the whole run repeatable
        torch.manual_seed(args.seed)
    model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, adapter=args.adapter, device=args.device)
    draft = args.draft
    if draft is None:  # the library's default, where there are trained heads to draft with
        given = args.heads is not None or default_heads_path(args.backbone, args.kind) is not None
        draft = DEFAULT_DRAFT if given else "lookup"
        if draft == "lookup":
            print(f"note: no trained heads are shipped for {args.backbone!r}: drafting with prompt lookup alone. "
                  "Train heads for it (README: 'Train heads for your own model') or pass --heads PATH_OR_REPO.",
                  file=sys.stderr)
    heads = None if draft == "lookup" else \
        resolve_heads(args.heads, model, args.backbone, fallback_untrained=True, kind=args.kind)
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tokenizer, tree=args.tree, draft=draft,
                                      costs="auto" if args.adaptive_budget else None)
    tree_desc = gen.describe()
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    input_ids = gen.encode(prompt)

    if args.record and args.prompts_file:
        return record_prompts(gen, args)
    if not args.compare:
        streamer = TextStreamer(tokenizer, skip_prompt=True) if args.stream and not args.json else None
        out = gen.generate(input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer, record=args.record,
                           **args.generate_kwargs())
        if args.json:
            print(json.dumps({"text": out.text, "new_tokens": out.new_tokens, "dtype": str(model.dtype).removeprefix(
                "torch."), "draft": gen.describe(), "stats": out.stats.to_dict()}))
        else:
            if streamer is None:
                print(out.text)
            s = out.stats
            print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, mean tau {s.mean_tau:.2f} "
                  f"over {s.steps} steps, {tree_desc}]", file=sys.stderr)
        return 0

    prompts = [gen.encode(p if args.raw else [{"role": "user", "content": p}]) for p in read_prompts(args.prompts_file)]
    prompts = prompts or [input_ids]
    # Warm up both paths once, then per prompt interleave: spec, plain, spec, plain... keeping each one's best time.
    gen.generate(input_ids, max_new_tokens=8)
    plain_generate(model, input_ids, 8)
    results = [compare(gen, model, ids, args, tree_desc) for ids in prompts]
    dtype = results[0]["dtype"]
    if len(results) == 1:
        result, = results
        if args.json:
            print(json.dumps(result))
            return 0
        print(result["text"])
        show_comparison(result, tree_desc)
        return 0
    summary = {"backbone": args.backbone, "dtype": dtype, "threads": args.threads, "tree": tree_desc,
               "prompts": results, "mean_speedup": sum(r["speedup"] for r in results) / len(results),
               "median_speedup": statistics.median(r["speedup"] for r in results),
               "identical": all(r["identical"] for r in results), "repeats": args.repeats}
    if args.json:
        print(json.dumps(summary))
        return 0
    for i, result in enumerate(results):
        s = result["speculative"]
        print(f"prompt {i + 1}: {result['speedup']:.2f}x ({s['tokens_per_s']:.1f} vs "
              f"{result['plain']['tokens_per_s']:.1f} tok/s, mean tau {s['mean_tau']:.2f}), identical tokens: "
              f"{result['identical']}")
        if not result["identical"]:
            print(f"          first difference at new token {result['first_difference']}: "
                  f"{result['why_not_identical']}")
    print(f"\nmean speedup over {len(results)} prompts: {summary['mean_speedup']:.2f}x (median "
          f"{summary['median_speedup']:.2f}x)   identical tokens: "
          f"{summary['identical']} ({dtype}, {tree_desc})")
    return 0


def read_prompts(path: str | None) -> list[str]:
    """The prompts of ``--prompts_file``: one per line (blank lines skipped), or the "prompt" of each line of a .jsonl
    file; none without the flag."""
    if path is None:
        return []
    try:
        lines = [line.strip() for line in open(path, encoding="utf-8") if line.strip()]
    except OSError as err:
        raise FileNotFoundError(f"--prompts_file {path}: {err.strerror}") from None
    prompts = lines
    if path.endswith(".jsonl"):
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"--prompts_file {path} line {number} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise ValueError(f"--prompts_file {path} line {number} has no \"prompt\" text (expected "
                                 '{"prompt": "..."} objects, one a line)')
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"--prompts_file {path} holds no prompt (expected one per line)")
    return prompts


def record_prompts(gen, args) -> int:
    """Generate every prompt of --prompts_file (--batch_size a call) into the --record folder. What is done is noted in
    the folder after each call's shard (``PROGRESS``, by the prompts' sha256 and the settings), so the same command
    goes on where a killed one stopped."""
    import hashlib
    from pathlib import Path

    from tqdm.auto import tqdm

    prompts = read_prompts(args.prompts_file)
    key = hashlib.sha256(json.dumps([prompts, args.raw, args.max_new_tokens, args.generate_kwargs()["seed"]],
                                    default=str).encode()).hexdigest()
    progress = Path(args.record) / PROGRESS
    done = 0
    if progress.is_file():
        done = max((r["done"] for r in map(json.loads, progress.read_text().splitlines()) if r["prompts"] == key),
                   default=0)
    tokens = 0
    with tqdm(total=len(prompts), initial=done, desc="record", unit="prompt") as bar:
        for first in range(done, len(prompts), args.batch_size):
            chunk = prompts[first: first + args.batch_size]
            rows = [gen.encode(p if args.raw else [{"role": "user", "content": p}])[0].tolist() for p in chunk]
            out = gen.generate(rows if len(rows) > 1 else rows[0], max_new_tokens=args.max_new_tokens,
                               record=args.record, **args.generate_kwargs())
            tokens += sum(map(len, out.new_tokens)) if len(rows) > 1 else len(out.new_tokens)
            with open(progress, "a", encoding="utf-8") as f:
                f.write(json.dumps({"prompts": key, "done": first + len(chunk)}) + "\n")
            bar.update(len(chunk))
    print(json.dumps({"record": args.record, "prompts": len(prompts), "recorded_now": len(prompts) - done,
                      "new_tokens_now": tokens}))
    return 0


PROGRESS = "recorded-prompts.jsonl"  # in the --record folder: {"prompts": sha256, "done": N} after each call


def compare(gen, model, input_ids, args, tree_desc: str) -> dict:
    """Speculative against plain greedy generation of one prompt, ``args.repeats`` times interleaved, best kept: both
    speeds, the speedup, whether the tokens are identical (and if not, where and why)."""
    best_spec = best_plain = float("inf")
    for _ in range(args.repeats):
        spec = gen.generate(input_ids, max_new_tokens=args.max_new_tokens)
        best_spec = min(best_spec, spec.stats.wall_seconds)
        plain, seconds = plain_generate(model, input_ids, args.max_new_tokens)
        best_plain = min(best_plain, seconds)
    plain_new = plain[0, input_ids.shape[1]:].tolist()
    identical = plain_new == spec.new_tokens
    dtype = str(model.dtype).removeprefix("torch.")
    s = spec.stats
    step_overhead = {k: v / s.steps for k, v in s.phase_seconds.items()} if s.steps and s.phase_seconds else {}
    result = {
        "backbone": args.backbone, "dtype": dtype, "threads": args.threads, "tree": tree_desc,
        "prompt_tokens": input_ids.shape[1], "identical": identical,
        "speculative": {"tokens": s.new_tokens, "seconds": best_spec, "tokens_per_s": s.new_tokens / best_spec,
                        "mean_tau": s.mean_tau, "steps": s.steps, "seconds_per_step": step_overhead,
                        "accepted_by_source": s.accepted_by_source},
        "plain": {"tokens": len(plain_new), "seconds": best_plain, "tokens_per_s": len(plain_new) / best_plain,
                  "seconds_per_token": best_plain / max(len(plain_new), 1)},
        "speedup": (s.new_tokens / best_spec) / (len(plain_new) / best_plain),
        "repeats": args.repeats, "text": spec.text,
    }
    if not identical:
        result["first_difference"] = next((i for i, (a, b) in enumerate(zip(plain_new, spec.new_tokens)) if a != b),
                                          min(len(plain_new), len(spec.new_tokens)))
        result["why_not_identical"] = mismatch_reason(dtype)
    return result


def show_comparison(result: dict, tree_desc: str) -> None:
    """The comparison of one prompt, for a reader."""
    s, identical = result["speculative"], result["identical"]
    print(f"\nspeculative: {s['tokens_per_s']:.1f} tok/s (mean tau {s['mean_tau']:.2f}, {s['steps']} steps, "
          f"{tree_desc})")
    print(f"plain:       {result['plain']['tokens_per_s']:.1f} tok/s")
    print(f"speedup:     {result['speedup']:.2f}x   identical tokens: {identical} ({result['dtype']})")
    if not identical:
        print(f"             first difference at new token {result['first_difference']}: "
              f"{result['why_not_identical']}")
    per_step = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in s["seconds_per_step"].items()) or "rounds not timed"
    print(f"per step:    {per_step}; plain decode {result['plain']['seconds_per_token'] * 1e3:.2f} ms/token")

if __name__ == "__main__":
    sys.exit(run_script(main))
