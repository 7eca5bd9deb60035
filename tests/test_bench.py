"""bench.py end to end on a tiny model; the tree optimizer on hand-made tables; calibration cache keys."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_heads, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.inference import Tree
from tokenmaxx.inference.calibration_store import calibration_key, machine_fingerprint
from tokenmaxx.inference.latency import interpolate
from tokenmaxx.inference.tree_search import choose_tree, ordered_paths_from_accuracy, ordered_paths_from_ranks

REPO = Path(__file__).resolve().parents[1]


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
         "untrained", "--dtype", "float32", "--threads", "1", "--max_new_tokens", "12", "--prompts", str(prompts),
         "--methods", "baseline,prompt_lookup,assisted,tokenmaxx,medusa:chain:2,hybrid,lookup,medusa,mtp,"
         "mtp:dynamic:nodes=6,min_mass=0,mtp_hybrid", "--medusa_heads", "untrained",
         "--mtp_heads", str(tmp_path / "mtp"),
         "--lookup_tokens", "2,4",
         "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report) == {"config", "machine", "methods"}
    ours = ("tokenmaxx", "medusa:chain:2", "hybrid", "lookup", "medusa", "mtp", "mtp:dynamic:nodes=6,min_mass=0",
            "mtp_hybrid")
    assert set(report["methods"]) == {"baseline", "prompt_lookup", *ours}
    assert report["config"]["notes"]["mtp:dynamic:nodes=6,min_mass=0 tree"] == {"nodes": 6, "topk": 8, "depth": None,
                                                                                 "min_mass": 0.0}
    assert report["config"]["notes"]["mtp tree"]["min_mass"] == 0.5  # the default
    assert "skipped" in report["config"]["notes"]["assisted"]
    keys = {"tokens", "seconds", "tokens_per_s", "speedup", "tau", "identical_rate", "prompts"}
    for name, m in report["methods"].items():
        assert set(m) == {"overall", "categories"}
        extra = {"accepted_share", "heads_round_share", "ms_per_round"} if name in ours else set()
        assert set(m["overall"]) == keys | extra
        assert set(m["categories"]) == {"qa", "mt_bench"}
        for c in m["categories"].values():
            assert set(c) == keys | extra
    base = report["methods"]["baseline"]["overall"]
    assert base["speedup"] == 1.0 and base["identical_rate"] == 1.0 and base["tau"] == 1.0
    for name in ours:
        assert report["methods"][name]["overall"]["identical_rate"] == 1.0  # fp32: exact
    assert out.with_suffix(".md").read_text().startswith("| method |")
    rows = [json.loads(line) for line in out.with_suffix(".prompts.jsonl").read_text().splitlines()]
    raw = {"baseline", "prompt_lookup:2", "prompt_lookup:4", *ours}  # every setting, before the best is picked
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
    assert "heads proposed in" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000


def test_optimizer_picks_known_optimum():
    # paths with acceptance probabilities (most probable first); latency grows after 3 nodes
    ordered = [((0,), 0.6), ((0, 0), 0.4), ((1,), 0.2), ((0, 0, 0), 0.05)]
    flat = {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.2}
    tree, table = choose_tree(ordered, flat, overhead=0.0)
    # N=1: 1/1, N=2: 1.6/1, N=3: 2.0/1, N=4: 2.2/2, N=5: 2.25/2.2 -> N=3
    assert tree == Tree([(0,), (0, 0)])
    assert [round(r["tokens_per_s"], 3) for r in table] == [1.0, 1.6, 2.0, 1.1, round(2.25 / 2.2, 3)]
    cheap = {1: 1.0, 64: 1.0}  # verification is free: take every path
    assert choose_tree(ordered, cheap, overhead=0.0)[0].num_nodes == 5
    dear = {1: 1.0, 2: 10.0}  # verification of 2+ tokens is dear: plain decoding wins
    assert choose_tree(ordered, dear, overhead=0.0)[0].num_nodes == 1
    assert choose_tree(ordered, cheap, overhead=0.0, max_depth=1)[0] == Tree([(0,), (1,)])


def test_ordered_paths_from_ranks_are_joint_frequencies():
    ranks = torch.tensor([[0, 0, 9], [0, 1, 0], [1, 0, 0], [9, 0, 0]])  # 9 = not in the top-k
    ordered = dict(ordered_paths_from_ranks(ranks, max_rank=9))
    assert ordered == {(0,): 0.5, (0, 0): 0.25, (0, 1): 0.25, (0, 1, 0): 0.25, (1,): 0.25, (1, 0): 0.25,
                       (1, 0, 0): 0.25}


def test_ordered_paths_from_accuracy_products():
    ordered = ordered_paths_from_accuracy([[0.5, 0.2], [0.6, 0.1]], max_nodes=4)
    assert [p for p, _ in ordered] == [(0,), (0, 0), (1,)]
    assert [round(v, 3) for _, v in ordered] == [0.5, 0.3, 0.2]


def test_interpolation():
    lat = {1: 1.0, 8: 2.0, 16: 4.0}
    assert interpolate(lat, 8) == 2.0
    assert interpolate(lat, 12) == 3.0
    assert interpolate(lat, 24) == 6.0  # extrapolated from the last segment


def test_fit_latency_recovers_flat_then_linear_and_never_decreases():
    from tokenmaxx.inference.latency import fit_latency

    # exact flat-then-linear data from 2 tokens on (knee at 8, 0.1 s a token), a cheaper single token
    exact = {1: 1.0, 2: 1.2, 4: 1.2, 8: 1.2, 16: 2.0, 32: 3.6}
    fitted = fit_latency(exact)
    assert fitted == pytest.approx(exact)
    # a shared machine's noise: 12 tokens measured faster than 1 and a spike at 24; the fit still rises with n
    noisy = {1: 0.645, 2: 0.673, 4: 0.718, 6: 0.807, 8: 0.778, 12: 0.630, 16: 0.667, 20: 0.773, 24: 1.311, 32: 0.956,
             48: 0.903, 64: 1.100}
    fitted = fit_latency(noisy)
    values = [fitted[n] for n in sorted(fitted)]
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert fitted[12] >= fitted[1] and fitted[64] > fitted[2]  # nodes are not free, a long tree costs more
    assert fit_latency({1: 0.5, 2: 0.4}) == {1: 0.4, 2: 0.4}  # too few sizes to fit: as measured, kept monotone


def test_fit_latency_keeps_the_small_row_plans_sizes_as_measured():
    """Sizes verified another way (a small-row plan) stay out of the curve and keep their dips where they are below
    it; every size from 1 to the largest measured gets a value, so the sizes between come from the curve, not from a
    line drawn through the dips."""
    from tokenmaxx.inference.latency import fit_latency

    # the other sizes: flat 0.9 up to 12, then 0.01 s a token; the plan's sizes 2, 4 and 16 are cheaper, 8 is not
    measured = {1: 0.5, 2: 0.6, 4: 0.65, 8: 1.0, 12: 0.9, 16: 0.7, 20: 0.98, 24: 1.02, 32: 1.1}
    fitted = fit_latency(measured, exact={2, 4, 8, 16})
    assert sorted(fitted) == list(range(1, 33))
    assert fitted[2] == 0.6 and fitted[4] == 0.65 and fitted[16] == 0.7  # the dips, as measured
    assert fitted[8] == pytest.approx(0.9)  # measured above the curve: the curve
    assert fitted[3] == pytest.approx(0.9) and fitted[15] == pytest.approx(0.93) and fitted[17] == pytest.approx(0.95)
    assert fitted[1] == 0.5
    assert fit_latency(measured, exact={2, 4, 8, 12, 16, 20, 24}) == fit_latency(measured)  # too few others to fit
    assert fit_latency(measured, exact=()) == fit_latency(measured)


def test_measure_latency_statistics():
    from tokenmaxx.inference.latency import measure_latency

    model = tiny_model("llama")
    with torch.inference_mode():
        for statistic in ("min", "median"):
            measured = measure_latency(model, sizes=(1, 2, 4), prefix_len=16, repeats=3, statistic=statistic)
            assert sorted(measured) == [1, 2, 4]
        with pytest.raises(ValueError, match="statistic must be 'min' or 'median', got 'mean'"):
            measure_latency(model, statistic="mean")


def test_propose_cost_is_measured_once_per_heads_and_tree_settings(tmp_path, monkeypatch):
    """The heads' proposing time is timed on the backbone's own continuation, cached per heads, tree settings and
    draft vocabulary, and read back (not timed again) for the same ones."""
    from helpers import random_mtp

    from tokenmaxx.inference import latency

    model = tiny_model("llama")
    heads = random_mtp(model)
    seconds = latency.cached_propose_cost(model, heads, "dynamic:6", cache_root=tmp_path)
    assert 0 < seconds < 5
    files = list(tmp_path.glob("propose-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["propose_seconds"] == seconds

    def timed(model, drafter):  # what is timed: the heads' drafter with these settings
        timed.nodes.append(drafter.nodes)
        return 0.5
    timed.nodes = []
    monkeypatch.setattr(latency, "measure_propose", timed)
    assert latency.cached_propose_cost(model, heads, "dynamic:6", cache_root=tmp_path) == seconds and not timed.nodes
    assert latency.cached_propose_cost(model, heads, "dynamic:12", cache_root=tmp_path) == 0.5 and timed.nodes == [12]
    assert latency.cached_propose_cost(model, random_mtp(model, seed=1), "dynamic:6", cache_root=tmp_path) == 0.5
    assert len(list(tmp_path.glob("propose-*.json"))) == 3


def test_verify_latency_between_cache_lengths():
    from tokenmaxx.inference.latency import VerifyLatency

    latency = VerifyLatency({100: {1: 1.0, 8: 2.0}, 300: {1: 2.0, 8: 5.0}})
    assert latency.at(50) == {1: 1.0, 8: 2.0}  # shorter than measured: the shortest cache's table
    assert latency.at(200) == pytest.approx({1: 1.5, 8: 3.5})
    assert latency.at(500) == pytest.approx({1: 3.0, 8: 8.0})  # extended along the last segment
    assert VerifyLatency({100: {1: 1.0}}).at(1000) == {1: 1.0}
    dips = VerifyLatency({100: {1: 1.0, 2: 2.0, 3: 1.5}, 300: {1: 2.0, 2: 4.0, 3: 3.0}})  # a small-row plan's dip
    assert dips.at(200) == pytest.approx({1: 1.5, 2: 3.0, 3: 2.25})  # kept between cache lengths


def test_calibration_key_changes_with_machine():
    model = tiny_model("llama")
    heads = random_heads(model)
    machine = machine_fingerprint(model)
    key = calibration_key(model, heads, machine)
    assert key == calibration_key(model, heads, dict(machine))
    assert key != calibration_key(model, heads, {**machine, "threads": machine["threads"] + 1})
    assert key != calibration_key(model, heads, {**machine, "cpu": "another cpu"})
    assert key != calibration_key(model, random_heads(model, seed=5), machine)


def test_auto_tree_calibrates_once_and_caches(tmp_path, monkeypatch):
    from tokenmaxx.inference import SpeculativeGenerator
    from tokenmaxx.inference import autotune

    model, tok = tiny_model("qwen2", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    heads = random_heads(model)
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.", "name a colour."))
    tree = autotune.auto_tree(model, heads, tok)
    files = [f for f in (tmp_path / "calibration").glob("*.json") if not f.name.startswith("latency-")]
    assert len(files) == 1  # and the verify latency it read, the generator's table (measured once, shared)
    record = json.loads(files[0].read_text())
    assert record["tree"] == [list(p) for p in tree.paths] and record["positions"] > 0
    assert 1 in map(int, record["latency"])
    monkeypatch.setattr(autotune, "calibrate_ranks", lambda *a, **k: pytest.fail("calibrated twice"))
    # reads the cache (calibrated above as for verifies without small-row products)
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto", draft="heads", small_row_linears=False)
    assert gen.tree_settings == tree
    with pytest.raises(ValueError, match=r"tree='auto' calibrates the tree on this machine: build the generator with "
                       r"SpeculativeGenerator.create"):
        SpeculativeGenerator(model, heads, tokenizer=tok, tree="auto", draft="heads")
    ids = torch.tensor([[5, 6, 7]])
    from helpers import greedy_reference
    assert gen.generate(ids, 10).sequences.tolist() == greedy_reference(model, ids, 10).tolist()


def test_auto_calibration_size_parses_and_names_what_was_wrong():
    """tree='auto:prompts=N,tokens=T' asks for a smaller calibration; other tree settings are not tree='auto'; bad
    sizes and keys are one clear error each."""
    from tokenmaxx.inference.autotune import CALIBRATION_PROMPTS, Calibration, is_auto

    assert Calibration.parse("auto") == Calibration() and Calibration().texts == CALIBRATION_PROMPTS
    assert Calibration.parse("auto:prompts=2,tokens=16") == Calibration(prompts=2, tokens=16)
    assert Calibration.parse("auto: tokens=32 ") == Calibration(tokens=32) and Calibration(tokens=32).key == [8, 32]
    small = Calibration(prompts=3)
    assert Calibration.parse(small) is small and small.texts == CALIBRATION_PROMPTS[:3] and small.loop_tokens == 48
    assert Calibration(tokens=16).loop_tokens == 16
    for other in (None, "default", "dynamic:8", "chain:3", "autotune", Tree([(0,), (0, 0)]), [[0], [0, 0]]):
        assert Calibration.parse(other) is None and not is_auto(other)
    for spec, message in (("auto:prompts=0", r"prompts must be an integer in \[1, 8\], got 0"),
                          ("auto:prompts=9", r"prompts must be an integer in \[1, 8\], got 9"),
                          ("auto:tokens=4", r"tokens must be an integer in \[8, 4096\], got 4"),
                          ("auto:prompts=two", r"prompts must be an integer, got 'two'"),
                          ("auto:nodes=8", r"expected 'auto' or 'auto:prompts=N,tokens=T'.*got 'nodes=8'"),
                          ("auto:prompts", r"expected 'auto' or 'auto:prompts=N,tokens=T'.*got 'prompts'"),
                          ("auto:prompts=2,prompts=3", r"each key at most once")):
        with pytest.raises(ValueError, match=message):
            Calibration.parse(spec)
    with pytest.raises(ValueError, match=r"prompts must be an integer in \[1, 8\], got True"):
        Calibration(prompts=True)


def test_a_smaller_auto_calibration_drafts_on_less_text_and_is_cached_apart(tmp_path, monkeypatch):
    """tree='auto:prompts=1,tokens=16' calibrates on the first prompt's 16-token continuation and times the decode
    loop on 16-token generations (the default: every prompt, 128 tokens, 48-token timings); the two sizes are cached
    under different keys, and the generator's tree='auto:...' reads its own size's record."""
    from tokenmaxx.inference import SpeculativeGenerator
    from tokenmaxx.inference import autotune

    model, tok = tiny_model("qwen2", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    heads = random_heads(model)
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.", "name a colour."))
    loop_tokens, decode = [], autotune.speculative_decode

    def spy(model, drafter, ids, max_new_tokens, *args, **kwargs):
        loop_tokens.append(max_new_tokens)
        return decode(model, drafter, ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(autotune, "speculative_decode", spy)
    small = autotune.Calibration(prompts=1, tokens=16)
    tree = autotune.auto_tree(model, heads, tok, calibration=small)
    [path] = [f for f in (tmp_path / "calibration").glob("*.json") if not f.name.startswith("latency-")]
    record = json.loads(path.read_text())
    assert record["positions"] == 16 + 1 and record["machine"]["calibration"] == [1, 16]  # one prompt, 16 tokens
    assert loop_tokens and set(loop_tokens) == {16}
    loop_tokens.clear()
    autotune.auto_tree(model, heads, tok)  # the default size is not read from the small one's record
    files = [f for f in (tmp_path / "calibration").glob("*.json") if not f.name.startswith("latency-")]
    [default] = [json.loads(f.read_text()) for f in files if f != path]
    assert default["positions"] == 2 * (128 + 1) and default["machine"]["calibration"] == [2, 128]
    assert set(loop_tokens) == {48}
    monkeypatch.setattr(autotune, "calibrate_ranks", lambda *a, **k: pytest.fail("calibrated again"))
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto:prompts=1,tokens=16", draft="heads",
                                      small_row_linears=False)  # calibrated above as for verifies without them
    assert gen.tree_settings == tree
    with pytest.raises(ValueError, match=r"tree='auto:prompts=1' calibrates the tree on this machine"):
        SpeculativeGenerator(model, heads, tokenizer=tok, tree="auto:prompts=1", draft="heads")
    with pytest.raises(ValueError, match=r"tokens must be an integer in \[8, 4096\], got 2"):
        SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto:tokens=2", draft="heads")


def test_auto_tree_says_what_it_chose_and_why(tmp_path, monkeypatch, capsys):
    """tree='auto' shows its progress on stderr and ends in one line on what it chose and why; when no tree beats
    plain decoding (every extra node costs a second here) it says drafting is off, with the numbers; a cached choice
    says which file it came from."""
    from tokenmaxx.inference import autotune

    model, tok = tiny_model("qwen2", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    heads = random_heads(model)
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.",))

    def said(prefix: str) -> list[str]:  # the lines tree='auto' printed (tqdm's \r-updates split off too)
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith(prefix)]

    sizes = (1, 2, 4, 8, 16, 32, 64)
    monkeypatch.setattr(autotune, "verify_latency", lambda *a, **k: {n: 0.01 + 1.0 * (n > 1) for n in sizes})
    assert autotune.auto_tree(model, heads, tok, cache_root=tmp_path).num_nodes == 1
    err = capsys.readouterr().err
    assert "tree='auto': calibrating on prompts" in err and "tree='auto': timing the decode loop" in err
    [line] = [line for line in err.splitlines() if line.startswith("tree='auto': drafting")]
    assert re.fullmatch(r"tree='auto': drafting disabled \(1-node tree\): no tree beat plain decoding on this "
                        r"machine's measured latency: the best drafted tree \(\d+ nodes\) expects [\d.]+ tok/s "
                        r"\(tau [\d.]+, [\d.]+ ms a step\) vs [\d.]+ tok/s with 1 node \([\d.]+ ms a step\) "
                        r"\(calibrated in \d+ s, cached in .*\.json\)", line), line
    [path] = tmp_path.glob("*.json")
    monkeypatch.setattr(autotune, "calibrate_ranks", lambda *a, **k: pytest.fail("calibrated twice"))
    assert autotune.auto_tree(model, heads, tok, cache_root=tmp_path).num_nodes == 1
    assert said("tree='auto'") == [f"tree='auto': read from cache {path}: drafting disabled (1-node tree): "
                                   + line.split("(1-node tree): ")[1].split(" (calibrated in")[0]]

    monkeypatch.undo()  # extra nodes cost nothing: the largest tree wins
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.",))
    monkeypatch.setattr(autotune, "verify_latency", lambda *a, **k: dict.fromkeys(sizes, 0.01))
    tree = autotune.auto_tree(model, heads, tok, cache_root=tmp_path, refresh=True)
    [line] = said("tree='auto': chose")
    assert tree.num_nodes > 1 and line.startswith(f"tree='auto': chose a tree of {tree.num_nodes} nodes: "), line
    assert re.search(r"tok/s expected \(tau [\d.]+, [\d.]+ ms a step\) vs [\d.]+ tok/s with 1 node", line), line
