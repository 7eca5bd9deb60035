"""The bench's reports as people read them: the markdown (what ran, on which machine, the speedup table, warm-up and
per-phase round times), the batch table, and the plot. The numbers come from ``benchmark.summarize`` and
``benchmark.run_batch_benchmark``; this module only formats them."""

from __future__ import annotations

from pathlib import Path

from tokenmaxx.scripts.benchmark import compiled_name


def report_header(report: dict) -> str:
    """The lines that open a report's markdown: what ran (backbone, dtype), on which machine, on which prompts, and
    the command; empty for a report without its config (a summary alone)."""
    config, machine = report.get("config", {}), report.get("machine", {})
    if "backbone" not in config:
        return ""
    bf16 = {True: "native bf16", False: "no native bf16"}.get(machine.get("native_bf16"), "")
    cpu = ", ".join(x for x in (machine.get("cpu_id"), machine.get("cpu_isa"), bf16) if x)
    lines = [f"# Bench: {config['backbone']}, {config.get('dtype', '?')}", "",
             f"- machine: {machine.get('cpu', '?')} ({cpu}), {machine.get('threads', '?')} threads, "
             f"{machine.get('device', '?')}; torch {machine.get('torch', '?')}, transformers "
             f"{machine.get('transformers', '?')}",
             f"- prompts: `{config.get('prompts', '?')}`"
             + (f", {config['selection']}" if config.get("selection") else "")
             + f"; {config.get('max_new_tokens', '?')} new tokens, greedy"]
    if config.get("command"):
        lines.append(f"- command: `{config['command']}`")
    return "\n".join(lines) + "\n\n"


def markdown_table(report: dict) -> str:
    """The report as markdown: its header (``report_header``), the speedup table, warm-up seconds, and where each
    tokenmaxx method's rounds spent their time."""
    return report_header(report) + _tables(report)


def _tables(report: dict) -> str:
    methods = report["methods"]
    notes = report.get("config", {}).get("notes", {})
    if not methods:  # no prompt finished in the time budget: what the warm-up took
        return "No prompt finished. " + _warmup_line(notes.get("warmup_seconds", {}), notes)
    cats = list(next(iter(methods.values()))["categories"])
    compiled = compiled_name(methods)  # the second baseline's column, when the run has it
    head = "| method | " + " | ".join(cats) + " | overall |" + (" vs compiled |" if compiled else "") + \
        " tau | identical |\n"
    head += "|---" * (len(cats) + 4 + bool(compiled)) + "|\n"
    rows = []
    for name, m in methods.items():
        cells = [f"{m['categories'][c]['speedup']:.2f}x ({m['categories'][c]['tau']:.2f})" for c in cats]
        o = m["overall"]
        if compiled:
            cells.append(f"**{o['speedup']:.2f}x** ({o['tokens_per_s']:.1f} tok/s) | "
                         + (f"{o['speedup_compiled']:.2f}x" if o["speedup_compiled"] else "n/a"))
        else:
            cells.append(f"**{o['speedup']:.2f}x** ({o['tokens_per_s']:.1f} tok/s)")
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {o['tau']:.2f} | {o['identical_rate']:.0%} |")
    table = head + "\n".join(rows) + "\n\nCells: speedup vs baseline (tau = tokens per backbone forward).\n"
    if compiled:
        table += (f"vs compiled: the overall speedup vs `{compiled}` (the second baseline: `generate` with a static "
                  "cache, its decode step through torch.compile).\n")
    warm = {name: m["warmup_seconds"] for name, m in methods.items() if "warmup_seconds" in m}
    if warm:  # (records before it have none)
        table += _warmup_line(warm, notes)
    ours = {name: m["overall"] for name, m in methods.items() if "heads_round_share" in m["overall"]}
    if ours:  # where a round's time went, per tokenmaxx method
        table += ("\n| method | heads proposed in | propose | verify | accept | commit "
                  "| accepted heads / lookup / both |\n|---|---|---|---|---|---|---|\n")
        for name, o in ours.items():
            ms, share = o.get("ms_per_round"), o["accepted_share"]  # (none: rounds not timed)
            table += (f"| {name} | {o['heads_round_share']:.0%} of rounds | " +
                      " | ".join(f"{ms[k]:.1f} ms" if ms else "not timed"
                                 for k in ("propose", "verify", "accept", "commit")) +
                      f" | {share['heads']:.0%} / {share['lookup']:.0%} / {share['both']:.0%} |\n")
        table += "\nPer round of each tokenmaxx method (mean over its rounds).\n"
    return table


def _warmup_line(warm: dict[str, float], notes: dict) -> str:
    """The methods' untimed warm-up seconds, the compiled baselines' compile seconds, and the captured calls that fell
    back to eager (``notes``: the bench's)."""
    line = ("Warm-up, untimed (a compiled or captured method compiles there): "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in warm.items())
            + "".join(f"; {name} compiled before it in {seconds:.1f} s"
                      for name, seconds in notes.get("compile_seconds", {}).items()) + ".\n")
    if notes.get("capture_fallbacks"):
        line += "Captured calls that fell back to eager: " + "; ".join(notes["capture_fallbacks"]) + ".\n"
    return line


def figure(report: dict):
    """The report's plot: speedup and tau per category and overall, one bar per method, the legend below both
    panels (inside one it covered bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    cats = list(next(iter(methods.values()))["categories"]) + ["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(methods)
    for j, (name, m) in enumerate(methods.items()):
        stats = [m["categories"][c] for c in cats[:-1]] + [m["overall"]]
        xs = [i + j * width for i in range(len(cats))]
        axes[0].bar(xs, [s["speedup"] for s in stats], width, label=name)
        axes[1].bar(xs, [s["tau"] for s in stats], width, label=name)
    for ax, title in zip(axes, ("speedup vs plain generate", "tau (tokens per backbone forward)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.8)
    cfg = report["config"]
    fig.suptitle(f"{cfg['backbone']} {cfg['dtype']}, {cfg['threads']} threads, {cfg['max_new_tokens']} new tokens")
    rows = -(-len(methods) // 4)  # legend rows, four methods a row
    fig.tight_layout(rect=(0, 0.05 + 0.035 * rows, 1, 1))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(methods), 4), fontsize=8,
               frameon=False)
    return fig


def plot(report: dict, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_table(report: dict) -> str:
    """Markdown table of ``run_batch_benchmark``'s report."""
    lines = ["| batch | tokenmaxx tok/s | generate tok/s | speedup | ms/token (ours, generate) | our prefill | "
             "nodes per row | drafting rounds | tau | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for size, r in report.items():
        lines.append(f"| {size} | {r['tokens_per_s']} | {r['hf_tokens_per_s']} | {r['speedup']}x | "
                     f"{r['ms_per_token']}, {r['hf_ms_per_token']} | {100 * r.get('prefill_share', 0):.0f}% | "
                     f"{r['nodes_per_row']} | "
                     f"{100 * r['drafting_rounds']:.0f}% | {r['tau']} | "
                     f"{100 * r['identical']:.0f}% |")
    return "\n".join(lines)
