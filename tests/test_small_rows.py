"""Tree verifies with the linear layers as (W @ x^T)^T (``inference/small_rows.py``): the same logits up to rounding,
the model's modules untouched afterwards, greedy output still token-identical, and the choice measured once."""

import json

import pytest
import torch
from helpers import assert_matches_greedy, greedy_reference, random_heads, random_mtp, tiny_model
from tiny_tokenizer import tiny_tokenizer
from torch import nn

from tokenmaxx.inference import SpeculativeGenerator, autotune
from tokenmaxx.inference import generator as generator_module
from tokenmaxx.inference import latency as latency_module
from tokenmaxx.inference import small_rows as small_rows_module
from tokenmaxx.inference.small_rows import cached_small_rows, choose_small_rows, transposed_linears


def test_transposed_linears_give_the_same_products_and_leave_the_modules_as_they_were(model):
    ids = torch.randint(4, model.config.vocab_size, (1, 12))
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears
    with torch.no_grad():
        for n in (1, 2, 3, 4, 8):
            usual = model(input_ids=ids[:, :n]).logits
            with transposed_linears(model, 4):
                assert all("forward" in m.__dict__ for m in linears)
                transposed = model(input_ids=ids[:, :n]).logits
            torch.testing.assert_close(transposed, usual, rtol=1e-5, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in linears)  # back to the class's forward
    layer = nn.Linear(6, 5)
    x = torch.randn(2, 3, 6)  # 6 rows: outside max_rows 4, so the usual product
    with transposed_linears(layer, 8):
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer(x[:1, :2]), nn.functional.linear(x[:1, :2], layer.weight, layer.bias))
    with transposed_linears(layer, 8):  # nested and in other threads: patched while anyone is inside, per-thread rows
        import threading

        seen = []
        other = threading.Thread(target=lambda: seen.append(torch.equal(
            layer(x[:1, :2]), nn.functional.linear(x[:1, :2], layer.weight, layer.bias))))
        with transposed_linears(layer, 4):
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__  # the outer one is still inside
        other.start()
        other.join()
        assert seen == [True]  # another thread, outside any transposed_linears: the usual product, bit for bit
    assert "forward" not in layer.__dict__
    with pytest.raises(RuntimeError, match="boom"):
        with transposed_linears(layer, 8):
            raise RuntimeError("boom")
    assert "forward" not in layer.__dict__  # restored after an exception too
    with transposed_linears(layer, 0):  # off: nothing patched
        assert "forward" not in layer.__dict__
    for rows, patched in ((1, False), (2, True), (8, True), (9, False)):  # a forward of a known size the plan does
        with transposed_linears(layer, 8, rows=rows):  # not name installs nothing
            assert ("forward" in layer.__dict__) is patched
    with pytest.raises(ValueError, match=r"a small-rows plan maps row counts >= 2 to one of \('all', 'head', 'body'\); "
                       r"got \{3: 'lm_head'\}"):
        with transposed_linears(layer, {2: "all", 3: "lm_head"}):
            pass
    assert "forward" not in layer.__dict__


def test_a_plan_transposes_only_the_part_it_names_at_the_sizes_it_names(model, monkeypatch):
    """{n: "head"} transposes the lm_head's product alone at n rows, {n: "body"} every other layer's, and other sizes
    nothing: seen by which modules' products go the transposed way."""
    head = model.get_output_embeddings()
    seen = []
    real = small_rows_module._transposed
    monkeypatch.setattr(small_rows_module, "_transposed",
                        lambda w, b, x: seen.append(w is head.weight) or real(w, b, x))
    ids = torch.randint(4, model.config.vocab_size, (1, 3))
    linears = sum(type(m) is nn.Linear for m in model.modules())
    expected = {"head": [True], "body": [False] * (linears - 1), "all": [False] * (linears - 1) + [True]}
    with torch.no_grad():
        for part, calls in expected.items():
            seen.clear()
            with transposed_linears(model, {3: part, 5: "all"}):
                model(input_ids=ids)
                assert seen == calls
                seen.clear()
                model(input_ids=ids[:, :2])  # 2 rows: not in the plan
                assert seen == []


def times(usual, all_, head, body):
    return {"usual": usual, "all": all_, "head": head, "body": body}


def test_choose_small_rows_keeps_the_fastest_part_per_size_where_it_won():
    measured = {2: times(0.08, 0.06, 0.07, 0.07), 4: times(0.08, 0.07, 0.06, 0.09), 8: times(0.08, 0.079, 0.08, 0.077),
                12: times(0.09, 0.1, 0.1, 0.1), 16: times(0.1, 0.09, 0.095, 0.085)}
    # 8: 3.75% is under the 5% bar; 12: nothing won
    assert choose_small_rows(measured) == {2: "all", 4: "head", 16: "body"}
    assert choose_small_rows(measured, min_gain=0.0) == {2: "all", 4: "head", 8: "body", 16: "body"}


@pytest.mark.parametrize("draft", ["heads", "hybrid", "lookup"])
def test_greedy_output_is_the_backbones_with_transposed_verifies(model, draft, monkeypatch):
    transposed_rows = []
    real = small_rows_module._transposed

    def counting(weight, bias, x):  # the verifies really go through the transposed products
        transposed_rows.append(x.numel() // x.shape[-1])
        return real(weight, bias, x)

    monkeypatch.setattr(small_rows_module, "_transposed", counting)
    heads = random_mtp(model) if draft != "lookup" else None
    tree = "dynamic:nodes=6,topk=3,min_mass=0" if heads is not None else None  # random heads: keep their nodes
    gen = SpeculativeGenerator(model, heads, tree=tree, draft=draft, adaptive_budget=False, small_row_linears=False)
    assert not gen.small_rows
    gen.small_rows = {n: ("all", "head", "body")[n % 3] for n in range(2, 9)}  # whatever this machine measured
    assert_matches_greedy(gen, model, 3, seed=11)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # lookup finds continuations in it
    assert gen.generate(ids, max_new_tokens=16).sequences.tolist() == greedy_reference(model, ids, 16).tolist()
    assert any(transposed_rows)
    medusa = SpeculativeGenerator(model, random_heads(model), tree="chain:3", draft="heads", small_row_linears=False)
    medusa.small_rows = {n: "all" for n in range(2, 9)}
    transposed_rows.clear()
    assert_matches_greedy(medusa, model, 2, seed=12)
    assert any(transposed_rows)


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
    lengths = sorted(gen.latency.tables)
    assert sorted(seen) == [(n, plan) for n in lengths] and gen.small_rows == plan  # each cache length timed once
    [record] = [json.loads(f.read_text()) for f in (tmp_path / "calibration").glob("*.json")
                if "latency_prefix" in json.loads(f.read_text())]  # the tree='auto' record
    assert record["machine"]["small_rows"] == [[2, "all"], [3, "head"], [5, "body"]]
    table = gen.latency.at(record["latency_prefix"])
    assert {int(n): s for n, s in record["latency"].items()} == table and {2, 3, 5} <= set(table)
    assert_matches_greedy(gen, model, 2, seed=3)
