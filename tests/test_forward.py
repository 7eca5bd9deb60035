"""Tree verifies with the linear layers as (W @ x^T)^T (``inference/runner.py``, the plan measured by
``inference/measure/small_rows.py``): the same logits up to rounding, the model's modules untouched afterwards, greedy
output still token-identical, and the choice measured once."""


import pytest
import torch
from helpers import assert_matches_greedy, greedy_reference, random_heads, random_mtp
from torch import nn

from tokenmaxx.inference import Costs, SpeculativeGenerator
from tokenmaxx.inference import runner as forward_module
from tokenmaxx.inference.runner import transposed_linears


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
    real = forward_module._transposed
    monkeypatch.setattr(forward_module, "_transposed",
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


@pytest.mark.parametrize("draft", ["heads", "hybrid", "lookup"])
def test_greedy_output_is_the_backbones_with_transposed_verifies(model, draft, monkeypatch):
    transposed_rows = []
    real = forward_module._transposed

    def counting(weight, bias, x):  # the verifies really go through the transposed products
        transposed_rows.append(x.numel() // x.shape[-1])
        return real(weight, bias, x)

    monkeypatch.setattr(forward_module, "_transposed", counting)
    heads = random_mtp(model) if draft != "lookup" else None
    tree = "dynamic:nodes=6,topk=3,min_mass=0" if heads is not None else None  # random heads: keep their nodes
    assert not SpeculativeGenerator(model, heads, tree=tree, draft=draft).runner.small_rows  # unmeasured: none
    plan = {n: ("all", "head", "body")[n % 3] for n in range(2, 9)}  # whatever this machine measured
    gen = SpeculativeGenerator(model, heads, tree=tree, draft=draft, costs=Costs(small_rows=plan))
    assert_matches_greedy(gen, model, 3, seed=11)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # lookup finds continuations in it
    assert gen.generate(ids, max_new_tokens=16).sequences.tolist() == greedy_reference(model, ids, 16).tolist()
    assert any(transposed_rows)
    medusa = SpeculativeGenerator(model, random_heads(model), tree="chain:3", draft="heads",
                                  costs=Costs(small_rows={n: "all" for n in range(2, 9)}))
    transposed_rows.clear()
    assert_matches_greedy(medusa, model, 2, seed=12)
    assert any(transposed_rows)
