"""The Python parts of ``scripts/gpu_check.py``: the verify-latency curve, and the report that judges the check.

    python scripts/device_check.py latency --device cuda --dtype bfloat16 --out latency.json
    python scripts/device_check.py report WORK OUT      # OUT/report.md; exit 1 when a check failed

The report reads what the steps left in WORK (or in OUT, where gpu_check.py copies them as each step ends: the report
can be made again from OUT): ``steps.tsv`` (step, exit status, seconds, the seconds it was allowed;
status 124 or 137 with a limit: killed at it; limit 0: not started, the check's deadline had passed), ``env.txt``,
``fast_tier.log`` (pytest), ``identity_fp32.json`` (a bench in fp32: greedy identity of every mode),
``latency.json`` and ``bench.json`` (bf16 on a GPU, the CPU's dtype in the dry run; its identical rates are the match
rates of that dtype), ``twin.json`` and ``batch.json`` (``bench.py --batch_sizes``). A bench that stopped at its
--time_budget reports the prompts it finished, and says so; the batch bench, the sizes it ran. ``fast_tier.log`` is not
copied to OUT (its output is in ``gpu_check.log``): a report made again from OUT says it has no log.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from tokenmaxx.heads import DEFAULT_BACKBONE, load_backbone
from tokenmaxx.heads.machine import device_name
from tokenmaxx.scripts.bench_report import batch_table, markdown_table

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128)
BF16_NOTE = ("bf16: a tree forward of N tokens and a one-token forward round differently, so near-tied logits can "
             "pick another argmax; the match rate is the share of prompts whose output equals plain greedy "
             "`generate` token for token (transformers' own prompt lookup shows the same effect).")


def latency_main(args: argparse.Namespace) -> int:
    from tokenmaxx.inference.measure.latency import measure_latency

    torch.set_num_threads(args.threads)
    model, _ = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    seconds = measure_latency(model, sizes=sizes, prefix_len=args.prefix_len, repeats=args.repeats,
                              statistic="median")
    device = model.get_output_embeddings().weight.device
    record = {"device": device_name(device), "dtype": str(model.dtype).removeprefix("torch."), "backbone": args.backbone,
              "prefix_len": args.prefix_len, "repeats": args.repeats, "statistic": "median",
              "ms": {str(n): round(s * 1e3, 4) for n, s in seconds.items()},
              "ratio_to_1": {str(n): round(s / seconds[sizes[0]], 4) for n, s in seconds.items()}}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["ms"]))
    return 0


# ---- the sizes users run: random-weight twins -------------------------------------------------------------------
TWINS = {  # the shapes of the backbones users run (from their published configs); weights random, made on the device
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   rope_theta=500000.0, max_position_embeddings=8192)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 rope_theta=1000000.0, max_position_embeddings=8192)),
}
LOGIT_SPREAD = 16.0  # the twins' output embeddings are scaled by this: argmax gaps far above bf16's rounding
TINY_TWIN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)  # the dry run's stand-in for either shape


class OracleChain:
    """A drafter that proposes the backbone's own greedy continuation as a chain ``depth`` deep (every node is
    accepted: tau = depth + 1), after running the real heads' proposal (its cost paid, its tree unused): what a round
    costs at this size, apart from acceptance."""

    def __init__(self, inner, continuation: torch.Tensor, depth: int):
        self.inner, self.continuation, self.depth = inner, continuation, depth  # continuation [T] on the device
        self.feature_layers = inner.feature_layers
        self.done = 0  # tokens of the continuation emitted so far (the root is the last of them)

    def start(self, prefill) -> None:
        self.inner.start(prefill)
        self.done = 1

    def propose(self, root: int, room: int):
        from tokenmaxx.heads.drafting import HEADS, Draft
        from tokenmaxx.heads.tree import chain

        self.inner.propose(root, room)
        depth = max(0, min(self.depth, room, self.continuation.numel() - self.done))
        tokens = self.continuation[self.done - 1: self.done + depth]  # the root, then the chain
        return Draft(tokens=tokens, buffers=chain(depth).buffers, sources=torch.full_like(tokens, HEADS),
                     values=torch.ones_like(tokens, dtype=torch.float))

    def observe(self, outcome) -> None:
        self.inner.observe(outcome)
        self.done += len(outcome.tokens)

    def share_forward(self, rows: int) -> None:
        self.inner.share_forward(rows)


def twin_main(args: argparse.Namespace) -> int:
    """Per twin: decode ms per token (eager greedy ``generate``), the verify curve at two cache lengths, and the
    oracle drafter's speedup over that decode at a few depths, with random EAGLE-3 heads proposing each round."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tokenmaxx.heads import Eagle3Heads
    from tokenmaxx.heads.io.backbones import resolve_dtype
    from tokenmaxx.heads.machine import clock
    from tokenmaxx.inference.decoding import accept_greedy
    from tokenmaxx.inference.loop import decode as speculative, greedy_root
    from tokenmaxx.inference.runner import Runner
    from tokenmaxx.inference.measure.latency import measure_latency

    torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    args.dtype = str(dtype).removeprefix("torch.")
    records = {}
    for name in args.twins.split(","):
        arch, shape = TWINS[name]
        shape = {**shape, **TINY_TWIN} if args.tiny else shape
        config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
        started = time.perf_counter()
        torch.manual_seed(0)  # the same random weights every run
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # made in the target dtype, on the device: nothing travels
        try:
            with torch.device(device):
                model = model_cls(config_cls(**shape, attn_implementation="sdpa")).eval()
                heads = Eagle3Heads.for_backbone(model, num_heads=max(args.depths)).eval()
        finally:
            torch.set_default_dtype(default)
        model.requires_grad_(False)
        model.generation_config.eos_token_id = None
        with torch.no_grad():  # random weights give near-flat logits, whose argmax a tree forward's rounding flips
            model.get_output_embeddings().weight.mul_(LOGIT_SPREAD)
        made = time.perf_counter() - started
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(model.config.vocab_size, (1, args.prompt_len), generator=gen).to(device)
        record = {"shape": shape, "seconds_to_build": round(made, 1)}
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up
            start = clock(device)
            reference = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                       max_new_tokens=args.new_tokens, do_sample=False)
            decode = (clock(device) - start) / args.new_tokens
            record["decode_ms_per_token"] = round(decode * 1e3, 3)
            record["verify_ms"] = {}
            for prefix in (256, 1024):
                seconds = measure_latency(model, sizes=[int(s) for s in args.sizes.split(",")], prefix_len=prefix,
                                          repeats=args.repeats, statistic="median")
                record["verify_ms"][str(prefix)] = {str(n): round(t * 1e3, 3) for n, t in seconds.items()}
            continuation = reference[0, args.prompt_len:]
            runner = Runner(capture=args.capture)
            record["oracle"] = {}
            for depth in [int(d) for d in args.depths]:
                def oracle():
                    inner = heads.drafter(model)
                    inner.passes = runner.passes()
                    return OracleChain(inner, continuation, depth)
                # warm-up (and the compiles, when captured)
                speculative(model, [oracle()], prompt, 8, accept_greedy, greedy_root, set(), runner=runner,
                            cache="static")
                start = clock(device)
                (tokens,), batch = speculative(model, [oracle()], prompt, args.new_tokens, accept_greedy, greedy_root,
                                               set(), runner=runner, cache="static")
                seconds, stats = clock(device) - start, batch.rows[0]
                reference_tokens = continuation.tolist()[: len(tokens)]
                same = next((i for i, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), len(tokens))
                speedup = (len(tokens) / seconds) / (1 / decode)
                record["oracle"][str(depth)] = {"tau": round(stats.mean_tau, 3), "speedup": round(speedup, 3),
                                                "speedup_over_tau": round(speedup / stats.mean_tau, 3),
                                                "tokens_as_generate": f"{same} of {len(tokens)}"}
        records[name] = record
        print(name, json.dumps({k: record[k] for k in ("decode_ms_per_token", "oracle")}), flush=True)
        del model, heads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = {"device": device_name(device), "dtype": args.dtype, "capture": args.capture, "tiny": args.tiny,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "twins": records}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


# ---- report -----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


KILLED = (124, 137)  # timeout's status for a step it ended at its limit (TERM, then KILL)


def _steps(work: Path) -> list[tuple[str, int, float, int | None]]:
    """(step, exit status, seconds, the seconds it was allowed or None where not recorded)."""
    rows = []
    if (work / "steps.tsv").is_file():
        for line in (work / "steps.tsv").read_text().splitlines():
            name, status, seconds, *limit = line.split("\t")
            rows.append((name, int(status), float(seconds), int(limit[0]) if limit else None))
    return rows


def _step_note(status: int, limit: int | None) -> str:
    if limit == 0:
        return "not started: the check's deadline had passed"
    if status in KILLED and limit is not None:
        return f"killed at its limit of {limit} s"
    return "" if status == 0 else "failed"


def _coverage(result: dict) -> str:
    """'' for a run of every planned prompt, else what it covered (a run stopped by its --time_budget)."""
    done, planned = result["config"]["prompt_count"], result["config"].get("prompts_planned")
    return "" if planned in (None, done) else f" (stopped at its time budget: {done} of {planned} prompts)"


def _pytest_summary(log: Path) -> str:
    if not log.is_file():
        return "no log"
    lines = [ln.strip("= ") for ln in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1] if lines else "no summary line (killed?)"


def identity_lines(identity: dict | None) -> tuple[list[str], bool]:
    """fp32 greedy identity per method (from a bench run): lines of the report, and whether every mode held, through
    its captured rounds (a captured call that fell back to eager fails it)."""
    if identity is None:
        return ["- no result (the step failed or ran out of time)"], False
    ok, lines = bool(identity["methods"]), []  # (no prompt finished: nothing held)
    if "config" in identity:  # how many prompts ran (a run stopped by its time budget says so)
        lines.append(f"- {identity['config']['prompt_count']} prompts{_coverage(identity)}")
    for name, res in identity["methods"].items():
        if name == "baseline":
            continue
        rate = res["overall"]["identical_rate"]
        ok &= rate == 1.0
        lines.append(f"- {name}: {rate:.0%} of {res['overall']['prompts']} prompts token-identical "
                     f"(tau {res['overall']['tau']})")
    fell_back = identity.get("config", {}).get("notes", {}).get("capture_fallbacks") or []
    if fell_back:  # identical, but not through the captured rounds the check is for
        ok = False
        lines.append("- captured calls fell back to eager: " + "; ".join(fell_back))
    return lines, ok


def twin_lines(twin: dict | None) -> list[str]:
    """The twin step's record as report lines: per twin, decode, the verify curve's ends, the oracle per depth."""
    if twin is None:
        return ["- no result (the step failed or ran out of time)"]
    lines = [f"{twin['device']}, {twin['dtype']}, rounds {'captured' if twin['capture'] else 'eager'}"
             f"{' (toy shapes: the dry run)' if twin['tiny'] else ''}; prompt {twin['prompt_len']} tokens, "
             f"{twin['new_tokens']} new", "", "| twin | decode ms/token | verify ms (cache 256: n=1, largest; cache "
             "1024: n=1, largest) | oracle depth: tau, speedup, speedup/tau |", "| --- | --- | --- | --- |"]
    for name, rec in twin["twins"].items():
        curve = "; ".join(f"{p}: {ms[next(iter(ms))]}, {ms[list(ms)[-1]]}" for p, ms in rec["verify_ms"].items())
        oracle = "; ".join(f"{d}: {o['tau']}, {o['speedup']}x, {o['speedup_over_tau']}" for d, o in
                           rec["oracle"].items())
        lines.append(f"| {name} | {rec['decode_ms_per_token']} | {curve} | {oracle} |")
    return lines


def report_main(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    steps = _steps(work)
    env = (work / "env.txt").read_text() if (work / "env.txt").is_file() else "(missing)\n"
    identity, latency, bench, twin = (_read_json(work / f) for f in ("identity_fp32.json", "latency.json",
                                                                      "bench.json", "twin.json"))
    lines = ["# gpu_check report", "", "## Machine", "", "```", env.rstrip(), "```", "", "## Steps", "",
             "| step | exit | seconds | allowed | note |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {status} | {seconds:.0f} | {'' if limit is None else limit} | {_step_note(status, limit)} |"
              for name, status, seconds, limit in steps]
    lines += ["", "## Fast tier (tiny random models)", "", f"- {_pytest_summary(work / 'fast_tier.log')}", "",
              "## Greedy identity, fp32, real backbone", ""]
    id_lines, identical = identity_lines(identity)
    lines += id_lines
    # the bench's dtype: bf16 on a GPU; the dry run's is the CPU's ("auto": fp32 where bf16 is not native)
    dtype = (bench or {}).get("machine", {}).get("dtype", "bfloat16")
    label = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    lines += ["", f"## {label} match rate (from the bench)", ""]
    if bench is not None:
        lines += [f"- {name}: {res['overall']['identical_rate']:.0%} of {res['overall']['prompts']} prompts"
                  for name, res in bench["methods"].items() if name != "baseline"]
        lines += ["", BF16_NOTE] if dtype != "float32" else []
    else:
        lines += ["- no result"]
    lines += ["", "## Verify latency (one forward of n tree tokens over a 256-token cache)", ""]
    if latency is not None:
        lines += [f"{latency['device']}, {latency['dtype']}, median of {latency['repeats']}", "",
                  "| n | ms | x one token |", "| --- | --- | --- |"]
        lines += [f"| {n} | {ms} | {latency['ratio_to_1'][n]} |" for n, ms in latency["ms"].items()]
    else:
        lines += ["- no result"]
    lines += ["", f"## Bench ({label})", ""]
    if bench is not None:
        config = bench["config"]
        lines += [(f"{config['prompt_count']} prompts, {config['max_new_tokens']} new tokens each{_coverage(bench)}; "
                   "tokens/s and speedup over eager `generate` (baseline) and, where it ran, over compiled "
                   "static-cache `generate`"), ""]
        missing = [f"- {name}: {note}" for name, note in config.get("notes", {}).items()  # methods that did not run
                   if isinstance(note, str) and note.startswith(("left out", "skipped"))]
        lines += missing + ([""] if missing else []) + [markdown_table(bench).rstrip()]
    else:
        lines += ["- no result"]
    lines += ["", "## The sizes users run (random-weight twins)", ""] + twin_lines(twin)
    batch = _read_json(work / "batch.json")
    lines += ["", "## Batches (hybrid against transformers' batched `generate`)", ""]
    if batch is not None:
        config = batch["config"]
        lines += [f"{config['prompts']} prompts at every size, {config['max_new_tokens']} new tokens, "
                  f"{config['dtype']}; sizes planned {config.get('batch_sizes')}, run {list(batch['batch'])}", "",
                  batch_table(batch["batch"])]
    else:
        lines += ["- no result (the step failed or ran out of time)"]
    failed = [name for name, status, *_ in steps if status != 0]
    verdict = "PASS" if identical and not failed and steps else "FAIL"
    why = ([f"steps failed: {', '.join(failed)}"] if failed else []) + ([] if identical else ["fp32 identity"])
    lines += ["", f"## Verdict: {verdict}" + (f" ({'; '.join(why)})" if why else ""), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if verdict == "PASS" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lat = sub.add_parser("latency", help="the verify-latency curve of the backbone on a device")
    lat.add_argument("--backbone", default=DEFAULT_BACKBONE)
    lat.add_argument("--device", default="auto")
    lat.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32 or auto (the device's best)")
    lat.add_argument("--sizes", default=",".join(map(str, CURVE_SIZES)), help="tree sizes, comma separated")
    lat.add_argument("--prefix_len", type=int, default=256)
    lat.add_argument("--repeats", type=int, default=10)
    lat.add_argument("--threads", type=int, default=2)
    lat.add_argument("--out", required=True)
    twin = sub.add_parser("twin", help="random-weight backbones of users' sizes: decode, verify curve, oracle rounds")
    twin.add_argument("--twins", default=",".join(TWINS))
    twin.add_argument("--device", default="auto")
    twin.add_argument("--dtype", default="bfloat16")
    twin.add_argument("--sizes", default=",".join(map(str, CURVE_SIZES)))
    twin.add_argument("--depths", default="3,5,7", type=lambda s: [int(d) for d in s.split(",")])
    twin.add_argument("--prompt_len", type=int, default=256)
    twin.add_argument("--new_tokens", type=int, default=64)
    twin.add_argument("--repeats", type=int, default=5)
    twin.add_argument("--threads", type=int, default=2)
    twin.add_argument("--capture", action="store_true", help="captured rounds (compiles: minutes at these sizes)")
    twin.add_argument("--tiny", action="store_true", help="toy shapes (the dry run)")
    twin.add_argument("--out", required=True)
    rep = sub.add_parser("report", help="WORK (the steps' outputs) -> OUT/report.md; exit 1 when a check failed")
    rep.add_argument("work")
    rep.add_argument("out")
    args = parser.parse_args(argv)
    return {"latency": latency_main, "twin": twin_main, "report": report_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
