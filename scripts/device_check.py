"""The Python parts of ``scripts/gpu_check.sh``: the verify-latency curve, and the report that judges the check.

    python scripts/device_check.py latency --device cuda --dtype bfloat16 --out latency.json
    python scripts/device_check.py report WORK OUT      # OUT/report.md; exit 1 when a check failed

The report reads what the steps left in WORK (or in OUT, where gpu_check.sh copies them as each step ends: the report
can be made again from a device call's files): ``steps.tsv`` (step, exit status, seconds, the seconds it was allowed;
status 124 or 137 with a limit: killed at it; limit 0: not started, the check's deadline had passed), ``env.txt``,
``fast_tier.log`` (pytest), ``identity_fp32.json`` (a bench in fp32: greedy identity of every mode),
``latency.json`` and ``bench.json`` (bf16 on a GPU, the CPU's dtype in the dry run; its identical rates are the match
rates of that dtype). A bench that stopped at its --time_budget reports the prompts it finished, and says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from tokenmaxx.heads import DEFAULT_BACKBONE, load_backbone
from tokenmaxx.heads.machine import device_name
from tokenmaxx.inference.benchmark import markdown_table

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
    """fp32 greedy identity per method (from a bench run): lines of the report, and whether every mode held."""
    if identity is None:
        return ["- no result (the step failed or ran out of time)"], False
    ok, lines = True, []
    if "config" in identity:  # how many prompts ran (a run stopped by its time budget says so)
        lines.append(f"- {identity['config']['prompt_count']} prompts{_coverage(identity)}")
    for name, res in identity["methods"].items():
        if name == "baseline":
            continue
        rate = res["overall"]["identical_rate"]
        ok &= rate == 1.0
        lines.append(f"- {name}: {rate:.0%} of {res['overall']['prompts']} prompts token-identical "
                     f"(tau {res['overall']['tau']})")
    return lines, ok


def report_main(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    steps = _steps(work)
    env = (work / "env.txt").read_text() if (work / "env.txt").is_file() else "(missing)\n"
    identity, latency, bench = (_read_json(work / f) for f in ("identity_fp32.json", "latency.json", "bench.json"))
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
    rep = sub.add_parser("report", help="WORK (the steps' outputs) -> OUT/report.md; exit 1 when a check failed")
    rep.add_argument("work")
    rep.add_argument("out")
    args = parser.parse_args(argv)
    return latency_main(args) if args.command == "latency" else report_main(args)


if __name__ == "__main__":
    sys.exit(main())
