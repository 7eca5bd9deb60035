"""bench.py end to end on a tiny model; the compiled static-cache baseline; a run that stops at its deadline keeps
what it finished."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import random_eagle3, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.scripts.bench_report import batch_table, figure, markdown_table
from tokenmaxx.scripts.benchmark import (Prompt, compiled_method, hf_method, interleave_categories, load_prompts,
                                           prompt_rows, run_batch_benchmark, run_benchmark, selection_note, summarize)


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_end_to_end_writes_documented_json(tmp_path):
    model, tok = tiny_model("llama", seed=11), tiny_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "qa", "turns": ["what is two plus two?"]},
        {"question_id": 2, "category": "writing", "turns": ["write a line about the sea."]},
    ]))
    from helpers import random_mtp

    random_mtp(model).save_pretrained(tmp_path / "mtp")
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--backbone", str(tmp_path / "tiny"), "--heads",
         str(tmp_path / "mtp"), "--dtype", "float32", "--threads", "1", "--max_new_tokens", "12", "--prompts", str(prompts),
         "--methods", "baseline,compiled:eager,prompt_lookup,assisted,tokenmaxx,medusa:chain:2,hybrid,lookup,medusa,"
         "mtp,mtp:dynamic:nodes=6,min_mass=0,mtp_hybrid", "--medusa_heads", "untrained",
         "--mtp_heads", str(tmp_path / "mtp"),
         "--lookup_tokens", "2,4",
         "--warmup", "1", "--time_budget", "600", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report) == {"config", "machine", "methods"}
    ours = ("tokenmaxx", "medusa:chain:2", "hybrid", "lookup", "medusa", "mtp", "mtp:dynamic:nodes=6,min_mass=0",
            "mtp_hybrid")
    assert set(report["methods"]) == {"baseline", "compiled:eager", "prompt_lookup", *ours}
    assert report["config"]["prompt_count"] == report["config"]["prompts_planned"] == 2  # all ran within the budget
    assert report["config"]["notes"]["mtp:dynamic:nodes=6,min_mass=0 tree"] == {"nodes": 6, "topk": 8, "depth": None,
                                                                                 "min_mass": 0.0}
    assert report["config"]["notes"]["mtp tree"]["min_mass"] == 0.5  # the default
    assert "skipped" in report["config"]["notes"]["assisted"]
    keys = {"tokens", "seconds", "tokens_per_s", "speedup", "speedup_compiled", "tau", "identical_rate", "prompts"}
    for name, m in report["methods"].items():
        assert set(m) == {"overall", "categories", "warmup_seconds"} and m["warmup_seconds"] > 0
        extra = {"accepted_share", "heads_round_share", "ms_per_round"} if name in ours else set()
        assert set(m["overall"]) == keys | extra
        assert set(m["categories"]) == {"qa", "writing"}  # as the file names them
        for c in m["categories"].values():
            assert set(c) == keys | extra
    base = report["methods"]["baseline"]["overall"]
    assert base["speedup"] == 1.0 and base["identical_rate"] == 1.0 and base["tau"] == 1.0
    for name in ours:
        assert report["methods"][name]["overall"]["identical_rate"] == 1.0  # fp32: exact
    md = out.with_suffix(".md").read_text()
    assert md.startswith(f"# Bench: {tmp_path / 'tiny'}, float32\n")
    for said in ("- machine: ", "threads", f"- prompts: `{prompts}`, 2 prompts: qa 1, writing 1; 12 new tokens",
                 "- command: `tokenmaxx bench --backbone "):
        assert said in md, said
    assert "| method |" in md
    rows = [json.loads(line) for line in out.with_suffix(".prompts.jsonl").read_text().splitlines()]
    raw = {"baseline", "compiled:eager", "prompt_lookup:2", "prompt_lookup:4", *ours}  # every setting, before the best
    assert {r["method"] for r in rows} == raw and len(rows) == len(raw) * report["config"]["prompt_count"]
    best = report["config"]["notes"]["prompt_lookup"]["best"]
    for name, m in report["methods"].items():  # the rows add up to the summaries
        mine = [r for r in rows if r["method"] == (best if name == "prompt_lookup" else name)]
        assert sum(r["tokens"] for r in mine) == m["overall"]["tokens"]
        assert sum(r["identical"] for r in mine) / len(mine) == pytest.approx(m["overall"]["identical_rate"], abs=1e-4)
        assert all(("accepted_by_source" in r) == (name in ours) for r in mine)
        if name in ours:  # rounds add up too: one backbone forward each, after the prefill
            assert sum(r["rounds"] for r in mine) == sum(r["forwards"] - 1 for r in mine)
            share = m["overall"]["heads_round_share"]
            assert share == pytest.approx(sum(r["heads_rounds"] for r in mine) / sum(r["rounds"] for r in mine),
                                          abs=1e-4)
            assert (share == 0) == (name == "lookup"), (name, share)  # untrained heads ran in the first rounds
            assert set(m["overall"]["ms_per_round"]) == {"propose", "verify", "accept", "commit"}
    assert "heads proposed in" in out.with_suffix(".md").read_text() and "| vs compiled |" in \
        out.with_suffix(".md").read_text()
    assert report["methods"]["compiled:eager"]["overall"]["identical_rate"] == 1.0
    assert set(report["config"]["notes"]["compile_seconds"]) == {"compiled:eager"}  # compiled before the warm-up
    assert "compiled:eager compiled before it in" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000


def test_a_bad_capture_backend_is_refused_and_fallbacks_are_recorded_for_the_report(capsys, tmp_path):
    import warnings

    from tokenmaxx.inference.runner import CaptureFallbackWarning
    from tokenmaxx.scripts import bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}))
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts", str(prompts), "--capture_backend", "tensorrt"])
    assert "unknown --capture_backend 'tensorrt': expected one of inductor, cudagraphs" in capsys.readouterr().err
    said: list[str] = []
    with bench.recording_fallbacks(said):
        for _ in range(2):  # said each time (a per-call fallback is a finding each time)
            warnings.warn(CaptureFallbackWarning("capturing X.step failed (E: e); running it eagerly"))
        warnings.warn(UserWarning("something else"))
    assert said == ["capturing X.step failed (E: e); running it eagerly"] * 2


@pytest.mark.slow
def test_a_bench_whose_budget_ends_before_its_first_prompt_says_so_and_keeps_the_warm_up(tmp_path):
    """The time budget gone before a prompt (on a GPU: the compiles of the warm-up): one error line, and the report
    holds each method's warm-up seconds."""
    model, tok = tiny_model("llama", seed=11), tiny_tokenizer()
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["what is two plus two?"]}))
    out = tmp_path / "bench"
    args = [sys.executable, str(REPO / "scripts" / "bench.py"), "--backbone", str(tmp_path / "tiny"), "--heads",
            "untrained", "--dtype", "float32", "--threads", "1", "--max_new_tokens", "4", "--prompts", str(prompts),
            "--methods", "baseline,lookup", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(args + ["--time_budget", "0.001"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "ended the run before its first prompt" in proc.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["methods"] == {} and report["config"]["prompt_count"] == 0
    assert set(report["config"]["notes"]["warmup_seconds"]) == {"baseline", "lookup"}
    assert out.with_suffix(".md").read_text().split("\n\n", 2)[2].startswith("No prompt finished. Warm-up, untimed")


def _prompts(n: int, categories=("qa", "math")) -> list[Prompt]:
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5]])
    return [Prompt(i, categories[i % len(categories)], ids) for i in range(n)]


def test_the_compiled_static_cache_baseline_goes_through_torch_compile_and_generates_what_generate_does():
    """compiled: transformers' static cache and its decode step through torch.compile (the "eager" backend here:
    traced, no code generated, so seconds on a CPU); every method gains ``speedup_compiled`` over it."""
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    prompts = _prompts(3)
    torch._dynamo.reset()
    try:
        methods = {"baseline": hf_method(model), "compiled:eager": compiled_method(model, 64, backend="eager")}
        results = run_benchmark(model, methods, prompts, 12, warmup=1, progress=False)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs >= 1  # the decode step went through torch.compile
    assert results["compiled:eager"].warmup_seconds > results["baseline"].warmup_seconds  # (tracing: in the warm-up)
    summary = summarize(results, prompts)
    assert summary["compiled:eager"]["overall"]["identical_rate"] == 1.0
    assert summary["compiled:eager"]["overall"]["speedup_compiled"] == 1.0
    assert set(summary["baseline"]["categories"]["qa"]) >= {"speedup", "speedup_compiled"}
    table = markdown_table({"methods": summary})
    assert "| vs compiled |" in table and "vs `compiled:eager`" in table and "Warm-up, untimed" in table


def test_a_run_stopped_at_its_deadline_keeps_and_summarizes_the_prompts_it_finished():
    """The warm-up's and then each prompt's results are handed on as soon as every method ran it (bench.py saves them
    then); no prompt starts that would end after the deadline, judged by the last prompt's time."""
    def slow(input_ids, max_new_tokens):
        time.sleep(0.5)
        return [5, 6, 7], None

    model, prompts, seen = tiny_model("llama"), _prompts(4), []
    results = run_benchmark(model, {"baseline": slow}, prompts, 3, warmup=0, progress=False,
                            after_prompt=lambda results, done: seen.append((done, len(results["baseline"].runs))),
                            deadline=time.perf_counter() + 0.6)
    assert seen == [(0, 0), (1, 1)]  # after the warm-up (its seconds), then the first prompt
    assert sorted(results["baseline"].runs) == [0]  # the second would have ended at ~1.0 s
    summary = summarize(results, prompts)
    assert summary["baseline"]["overall"]["prompts"] == 1 and set(summary["baseline"]["categories"]) == {"qa"}
    assert [r["question_id"] for r in prompt_rows(results, prompts)] == [0]


def test_interleaved_prompts_take_their_categories_in_turn():
    prompts = [Prompt(i, c, torch.zeros(1, 1)) for i, c in enumerate(["a", "a", "a", "b", "c", "c"])]
    assert [p.question_id for p in interleave_categories(prompts)] == [0, 3, 4, 1, 5, 2]


def test_a_compiled_baseline_that_fails_to_compile_is_left_out_and_said_so(capsys):
    from tokenmaxx.scripts import bench

    def broken(input_ids, max_new_tokens):
        raise RuntimeError("no compiler here")

    model = tiny_model("llama")
    methods, notes = {"baseline": hf_method(model), "compiled": broken}, {}
    bench.probe_compiled(methods, notes, _prompts(1)[0], model)
    assert set(methods) == {"baseline"}
    assert notes["compiled"] == "left out: compiling failed here: RuntimeError: no compiler here"
    assert "compiled: left out" in capsys.readouterr().err


def test_the_batch_bench_runs_every_prompt_at_every_size_and_records_what_it_chose():
    """run_batch_benchmark: each size covers every prompt (in batches of that size, the last filled by cycling), so
    sizes differ by their load only; fp32 greedy rows equal transformers' batched rows."""
    from tokenmaxx.inference import SpeculativeGenerator

    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None
    prompts = [Prompt(i, "qa", torch.tensor([[3 + i, 4, 5, 6, 7, 3, 4][: 4 + i]])) for i in range(3)]
    gen = SpeculativeGenerator(model, random_eagle3(model, seed=1), costs=None)
    calls = []
    original = gen.generate
    gen.generate = lambda rows, **kw: calls.append([len(r) for r in rows]) or original(rows, **kw)
    report = run_batch_benchmark(model, gen, prompts, [1, 2], max_new_tokens=6, progress=False)
    # warm-up (one row), then size 1: each prompt alone; size 2: [0, 1], [2, 0]
    assert calls == [[4], [4], [5], [6], [4, 5], [6, 4]]
    for size in (1, 2):
        assert report[size]["identical"] == 1.0
        assert 0 < report[size]["prefill_share"] < 1
    assert "hf_prompt_lookup_tokens_per_s" in report[1]
    assert batch_table(report).count("\n") == 3  # a header, its rule and one line a size
    assert report[1]["rows"] == 3 and report[2]["rows"] == 4
    calls.clear()  # past its deadline: the warm-up only, and no size to report
    assert run_batch_benchmark(model, gen, prompts, [1, 2], max_new_tokens=6, progress=False,
                               deadline=time.perf_counter() - 1) == {} and calls == [[4]]


def test_the_limit_applies_per_category_as_written_and_grouping_says_what_it_kept(tmp_path):
    """--limit 1 on a file of writing, math and qa prompts runs one of each, under those names; Spec-Bench's grouping
    (--group_mt_bench) puts writing and math in one mt_bench column, limits the group, and says what it kept."""
    path = tmp_path / "p.jsonl"
    rows = [("writing", "a poem"), ("writing", "a song"), ("math", "two plus two"), ("qa", "why"), ("qa", "how")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                            for i, (c, t) in enumerate(rows)))
    tok = tiny_tokenizer()
    kept = load_prompts(path, tok, limit=1)
    assert [p.category for p in kept] == ["writing", "math", "qa"] and [p.question_id for p in kept] == [0, 2, 3]
    assert selection_note(kept) == "3 prompts: writing 1, math 1, qa 1"
    grouped = load_prompts(path, tok, limit=1, group_mt_bench=True)
    assert [(p.category, p.written) for p in grouped] == [("mt_bench", "writing"), ("qa", "qa")]
    assert selection_note(grouped) == "2 prompts: mt_bench 1 (writing 1), qa 1"
    assert selection_note(load_prompts(path, tok, group_mt_bench=True)) == \
        "5 prompts: mt_bench 3 (math 1, writing 2), qa 2"


def test_the_plots_legend_covers_no_bar():
    """The legend sits below both panels: its box overlaps no bar's (it used to cover the first panel's bars)."""
    import matplotlib.pyplot as plt

    cell = {"speedup": 1.8, "tau": 2.5}
    methods = {f"method {i}": {"overall": cell, "categories": {c: cell for c in ("qa", "rag", "math", "writing")}}
               for i in range(6)}
    fig = figure({"methods": methods, "config": {"backbone": "b", "dtype": "float32", "threads": 2,
                                                 "max_new_tokens": 8}})
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for ax in fig.axes for patch in ax.patches]
    assert len(bars) == 2 * 6 * 5 and not any(legend.overlaps(bar) for bar in bars)
    plt.close(fig)
