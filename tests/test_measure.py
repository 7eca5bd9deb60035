"""Measuring the machine (``inference/measure/``): the verify latency (measured, fitted, cached), the heads'
proposing cost, the small-row plan, the tree search, and ``tree="auto"`` (calibrated once, cached, said why)."""

import json
import re

import pytest
import torch
from helpers import OracleMTP, assert_matches_greedy, greedy_reference, random_eagle3, random_heads, random_mtp, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import DynamicTreeConfig, Tree
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.inference import generator as generator_module
from tokenmaxx.inference.costs import VerifyLatency, interpolate
from tokenmaxx.inference.measure import autotune
from tokenmaxx.inference.measure import latency as latency_module
from tokenmaxx.inference.measure import small_rows as small_rows_module
from tokenmaxx.inference.measure.autotune import CALIBRATION_PROMPTS, Calibration, is_auto
from tokenmaxx.inference.measure.latency import fit_latency, measure_latency
from tokenmaxx.inference.measure.small_rows import cached_small_rows, choose_small_rows
from tokenmaxx.inference.measure.store import calibration_key, machine_fingerprint
from tokenmaxx.inference.measure.tree_search import choose_tree, ordered_paths_from_ranks


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


def test_interpolation():
    lat = {1: 1.0, 8: 2.0, 16: 4.0}
    assert interpolate(lat, 8) == 2.0
    assert interpolate(lat, 12) == 3.0
    assert interpolate(lat, 24) == 6.0  # extrapolated from the last segment


def test_fit_latency_recovers_flat_then_linear_and_never_decreases():
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
    latency = latency_module
    model = tiny_model("llama")
    heads = random_mtp(model)
    six, twelve = DynamicTreeConfig(nodes=6), DynamicTreeConfig(nodes=12)
    seconds = latency.cached_propose_cost(model, heads, six, cache_root=tmp_path)
    assert 0 < seconds < 5
    files = list(tmp_path.glob("propose-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["propose_seconds"] == seconds

    def timed(model, drafter):  # what is timed: the heads' drafter with these settings
        timed.nodes.append(drafter.nodes)
        return 0.5
    timed.nodes = []
    monkeypatch.setattr(latency, "measure_propose", timed)
    assert latency.cached_propose_cost(model, heads, six, cache_root=tmp_path) == seconds and not timed.nodes
    assert latency.cached_propose_cost(model, heads, twelve, cache_root=tmp_path) == 0.5 and timed.nodes == [12]
    assert latency.cached_propose_cost(model, random_mtp(model, seed=1), six, cache_root=tmp_path) == 0.5
    assert len(list(tmp_path.glob("propose-*.json"))) == 3


def test_rows_proposing_together_are_timed_once_per_heads_and_cached(tmp_path, monkeypatch):
    """Several rows' proposals run together (their module passes batched) are timed along the backbone's own
    continuation for each of PROPOSE_ROWS, cached beside one row's time, and read back after."""
    latency = latency_module
    model = tiny_model("llama")
    heads = random_eagle3(model)
    monkeypatch.setattr(latency, "PROPOSE_ROWS", (2, 3))
    seconds = latency.cached_propose_rows(model, heads, DynamicTreeConfig(nodes=6), cache_root=tmp_path)
    assert set(seconds) == {2, 3} and all(0 < s < 5 for s in seconds.values())
    [record] = tmp_path.glob("propose-rows-*.json")
    assert json.loads(record.read_text())["propose_rows"] == {"2": seconds[2], "3": seconds[3]}
    monkeypatch.setattr(latency, "measure_propose_rows", lambda *a, **k: pytest.fail("timed again"))
    assert latency.cached_propose_rows(model, heads, DynamicTreeConfig(nodes=6), cache_root=tmp_path) == seconds


def test_verify_latency_between_cache_lengths():
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


@pytest.mark.slow
def test_auto_tree_calibrates_once_and_caches(tmp_path, monkeypatch):
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
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto", draft="heads", costs=None)
    assert gen.tree_settings == tree
    with pytest.raises(ValueError, match=r"tree='auto' calibrates the tree on this machine: build the generator with "
                       r"SpeculativeGenerator.create"):
        SpeculativeGenerator(model, heads, tokenizer=tok, tree="auto", draft="heads")
    ids = torch.tensor([[5, 6, 7]])
    assert gen.generate(ids, 10).sequences.tolist() == greedy_reference(model, ids, 10).tolist()


def test_auto_calibration_size_parses_and_names_what_was_wrong():
    """tree='auto:prompts=N,tokens=T' asks for a smaller calibration; other tree settings are not tree='auto'; bad
    sizes and keys are one clear error each."""
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


@pytest.mark.slow
def test_a_smaller_auto_calibration_drafts_on_less_text_and_is_cached_apart(tmp_path, monkeypatch):
    """tree='auto:prompts=1,tokens=16' calibrates on the first prompt's 16-token continuation and times the decode
    loop on 16-token generations (the default: every prompt, 128 tokens, 48-token timings); the two sizes are cached
    under different keys, and the generator's tree='auto:...' reads its own size's record."""
    model, tok = tiny_model("qwen2", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    heads = random_heads(model)
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.", "name a colour."))
    loop_tokens, decode = [], autotune.decode

    def spy(model, drafters, ids, max_new_tokens, *args, **kwargs):
        loop_tokens.append(max_new_tokens)
        return decode(model, drafters, ids, max_new_tokens, *args, **kwargs)

    monkeypatch.setattr(autotune, "decode", spy)
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
                                      costs=None)  # calibrated above as for verifies without small-row products
    assert gen.tree_settings == tree
    with pytest.raises(ValueError, match=r"tree='auto:prompts=1' calibrates the tree on this machine"):
        SpeculativeGenerator(model, heads, tokenizer=tok, tree="auto:prompts=1", draft="heads")
    with pytest.raises(ValueError, match=r"tokens must be an integer in \[8, 4096\], got 2"):
        SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto:tokens=2", draft="heads")


@pytest.mark.slow
def test_auto_tree_says_what_it_chose_and_why(tmp_path, monkeypatch, capsys):
    """tree='auto' shows its progress on stderr and ends in one line on what it chose and why; when no tree beats
    plain decoding (every extra node costs a second here) it says drafting is off, with the numbers; a cached choice
    says which file it came from."""
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
def test_auto_budget_times_only_the_budgets_that_can_win(monkeypatch):
    """tree='auto' times the decode loop (short generations, verify forwards included) only of budgets whose bound
    tau / verify latency reaches 90% of the tokens/s of the budget with the best bound; the others are left out, and
    the choice is the one timing every budget would make."""
    taus = {4: 2.0, 8: 2.4, 16: 2.6, 32: 2.7, 64: 2.8}
    latency = {4: 0.10, 8: 0.11, 16: 0.14, 32: 0.25, 64: 0.60}  # bounds 20, 21.8, 18.6, 10.8, 4.7 tok/s
    overhead = {4: 0.010, 8: 0.012, 16: 0.015, 32: 0.02, 64: 0.03}
    calls = []

    def fake_overheads(model, heads, tokenizer, trees, repeats=3, max_new_tokens=48):
        calls.append((sorted(trees), repeats))
        assert max_new_tokens == 48
        assert all(tree.nodes == n for n, tree in trees.items())
        return {n: overhead[n] for n in trees}

    monkeypatch.setattr(autotune, "measure_overheads", fake_overheads)
    loop, untimed = autotune.timed_overheads(None, None, None, DynamicTreeConfig(), taus, latency)
    # first the best bound (8 nodes: 2.4 / 0.122 s = 19.7 tok/s), then every bound >= 17.7 tok/s, interleaved
    assert calls == [([8], 1), ([4, 8, 16], 3)]
    assert loop == {n: overhead[n] for n in (4, 8, 16)}
    assert [row["nodes"] for row in untimed] == [32, 64]
    assert untimed[0] == {"nodes": 32, "expected_tau": 2.7, "bound_tokens_per_s": pytest.approx(10.8)}
    every = max(taus, key=lambda n: taus[n] / (latency[n] + overhead[n]))
    assert every == max(loop, key=lambda n: taus[n] / (latency[n] + loop[n])) == 8


# ---- bad inputs ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_auto_budget_calibrates_once_caches_and_measures_tau(tmp_path, monkeypatch, capsys):
    """tree='auto' with MTP heads: expected tau per node budget along the backbone's own continuation (an oracle
    that always drafts the truth gets tau = 1 + depth for every budget that holds a full chain), the budget with the
    best tokens/s is chosen (shown on stderr with its numbers against a 1-node tree's), cached per machine, and read
    back without calibrating again (saying from which file)."""


    model, tok = tiny_model("llama", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.",))
    ids = tok.apply_chat_template([{"role": "user", "content": "count to ten."}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    oracle = OracleMTP(model, greedy_reference(model, ids, 140), p_top=1.0)
    taus, propose_s = autotune.calibrate_dynamic(model, oracle, tok, DynamicTreeConfig(topk=2, depth=3),
                                                     budgets=(2, 4, 8), max_new_tokens=30)
    assert taus[2] == pytest.approx(2.0, abs=0.05)  # one node: the right first guess, every time
    assert taus[4] == pytest.approx(4.0, abs=0.15)  # a full depth-3 chain fits (minus the last positions)
    chosen = autotune.auto_dynamic(model, oracle, tok)
    files = [f for f in (tmp_path / "calibration").glob("*.json") if not f.name.startswith("latency-")]
    assert len(files) == 1  # beside the verify latency table it read
    record = json.loads(files[0].read_text())
    timed = [r["nodes"] for r in record["table"]]
    assert record["dynamic_tree"]["nodes"] == chosen.nodes and sorted(timed + [
        r["nodes"] for r in record["untimed"]]) == list(autotune.DYNAMIC_BUDGETS)
    overhead = [record["overhead"][str(n)] for n in timed]  # fitted: never decreasing
    assert overhead == sorted(overhead) and all(a >= b for a, b in zip(overhead, [
        record["measured_overhead"][str(n)] for n in timed]))
    err = capsys.readouterr().err
    assert "tree='auto': calibrating on prompts" in err and "tree='auto': timing the decode loop" in err
    [line] = [line for line in err.splitlines() if line.startswith("tree='auto': chose")]
    row = next(row for row in record["table"] if row["nodes"] == chosen.nodes)
    assert line.startswith(f"tree='auto': chose a dynamic tree of {chosen.nodes} nodes: "
                           f"{row['tokens_per_s']:.1f} tok/s expected (tau {row['expected_tau']:.2f}, "), line
    assert f" vs {1 / record['latency']['1']:.1f} tok/s with 1 node (" in line and f"cached in {files[0]})" in line
    monkeypatch.setattr(autotune, "calibrate_dynamic", lambda *a, **k: pytest.fail("calibrated twice"))
    gen = SpeculativeGenerator.create(model, oracle, tokenizer=tok, tree="auto", draft="heads",
                                      costs=None)  # calibrated above as for verifies without small-row products
    assert gen.tree_settings == chosen
    choice = line.removeprefix("tree='auto': ").split(" (calibrated in")[0]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tree='auto'")]
    assert said == [f"tree='auto': read from cache {files[0]}: {choice}"]  # (beside the generator's latency timing)


@pytest.mark.slow
def test_auto_budget_calibrates_on_the_size_asked_for(tmp_path, monkeypatch):
    """tree='auto:prompts=N,tokens=T' with MTP heads: tau is measured along the first N prompts' T-token
    continuations, the decode loop timed on min(T, 48)-token generations, and the record cached under its size."""


    model, tok = tiny_model("llama", seed=12), tiny_tokenizer()
    heads = random_mtp(model)
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path / "cache"))
    asked = {}

    def fake_calibrate(model, heads, tokenizer, config, prompts=None, max_new_tokens=128):
        asked.update(prompts=prompts, tokens=max_new_tokens)
        return dict.fromkeys(autotune.DYNAMIC_BUDGETS, 1.5), 0.001

    def fake_overheads(model, heads, tokenizer, config, taus, latency, max_new_tokens=48):
        asked["loop_tokens"] = max_new_tokens
        return dict.fromkeys(taus, 0.001), []

    monkeypatch.setattr(autotune, "calibrate_dynamic", fake_calibrate)
    monkeypatch.setattr(autotune, "timed_overheads", fake_overheads)
    monkeypatch.setattr(autotune, "verify_latency", lambda *a, **k: {n: 0.01 * (1 + n / 64) for n in
                                                                     (1, *autotune.DYNAMIC_BUDGETS)})
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto:prompts=3,tokens=24", draft="heads")
    assert asked == {"prompts": autotune.CALIBRATION_PROMPTS[:3], "tokens": 24, "loop_tokens": 24}
    assert isinstance(gen.tree_settings, DynamicTreeConfig)
    autotune.auto_dynamic(model, heads, tok, calibration=autotune.Calibration(), cache_root=tmp_path)
    assert asked == {"prompts": autotune.CALIBRATION_PROMPTS, "tokens": 128, "loop_tokens": 48}
    records = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    assert [r["machine"]["calibration"] for r in records] == [[8, 128]]
def times(usual, all_, head, body):
    return {"usual": usual, "all": all_, "head": head, "body": body}


def test_choose_small_rows_keeps_the_fastest_part_per_size_where_it_won():
    measured = {2: times(0.08, 0.06, 0.07, 0.07), 4: times(0.08, 0.07, 0.06, 0.09), 8: times(0.08, 0.079, 0.08, 0.077),
                12: times(0.09, 0.1, 0.1, 0.1), 16: times(0.1, 0.09, 0.095, 0.085)}
    # 8: 3.75% is under the 5% bar; 12: nothing won
    assert choose_small_rows(measured) == {2: "all", 4: "head", 16: "body"}
    assert choose_small_rows(measured, min_gain=0.0) == {2: "all", 4: "head", 8: "body", 16: "body"}


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
@pytest.mark.slow
def test_small_rows_are_measured_once_per_machine(model, tmp_path, monkeypatch):
    calls = []

    def fake_measure(m):
        calls.append(m)
        return {2: times(0.08, 0.06, 0.07, 0.07), 4: times(0.08, 0.07, 0.06, 0.09), 8: times(0.08, 0.09, 0.09, 0.09)}

    monkeypatch.setattr(small_rows_module, "measure_small_rows", fake_measure)
    plan = {2: "all", 4: "head"}
    assert cached_small_rows(model, cache_root=tmp_path) == plan
    assert cached_small_rows(model, cache_root=tmp_path) == plan and len(calls) == 1  # read back, not measured again
    assert cached_small_rows(model, cache_root=tmp_path, refresh=True) == plan and len(calls) == 2
    monkeypatch.undo()
    real = small_rows_module.measure_small_rows(model, sizes=(2, 4), repeats=2)  # the real thing, on the tiny model
    assert set(real) == {2, 4} and all(set(t) == {"usual", "all", "head", "body"} and min(t.values()) > 0
                                       for t in real.values())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "mtp"])
def test_tree_auto_weighs_trees_with_the_generators_latency_table_timed_as_the_plan_says(tmp_path, monkeypatch, kind):
    """tree='auto' reads the verify latency the generator's node budget reads (one measurement, not two), timed with
    the small-row plan, and keys its record by the plan: the trees it weighs cost what they will cost."""
    model, tok = tiny_model("qwen2", seed=12), tiny_tokenizer()
    model.generation_config.eos_token_id = None
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "CALIBRATION_PROMPTS", ("count to ten.",))
    plan = {2: "all", 3: "head", 5: "body"}
    monkeypatch.setattr(generator_module, "cached_small_rows", lambda m, *a, **k: plan)
    seen = []
    real = latency_module.measure_latency
    monkeypatch.setattr(latency_module, "measure_latency",
                        lambda *a, **k: seen.append((k["prefix_len"], k.get("small_rows"))) or real(*a, **k))
    heads = random_heads(model) if kind == "medusa" else random_mtp(model)
    gen = SpeculativeGenerator.create(model, heads, tokenizer=tok, tree="auto", draft="heads")
    lengths = sorted(gen.costs.latency.tables)
    assert sorted(seen) == [(n, plan) for n in lengths] and gen.costs.small_rows == plan  # each length timed once
    [record] = [json.loads(f.read_text()) for f in (tmp_path / "calibration").glob("*.json")
                if "latency_prefix" in json.loads(f.read_text())]  # the tree='auto' record
    assert record["machine"]["small_rows"] == [[2, "all"], [3, "head"], [5, "body"]]
    table = gen.costs.latency.at(record["latency_prefix"])
    assert {int(n): s for n, s in record["latency"].items()} == table and {2, 3, 5} <= set(table)
    assert_matches_greedy(gen, model, 2, seed=3)
