"""Tree verifies with the linear layers as (W @ x^T)^T (``inference/small_rows.py``): the same logits up to rounding,
the model's modules untouched afterwards, greedy output still token-identical, and the choice measured once."""

import pytest
import torch
from helpers import assert_matches_greedy, greedy_reference, random_heads, random_mtp
from torch import nn

from tokenmaxx.inference import SpeculativeGenerator
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
    for rows, patched in ((1, False), (2, True), (8, True), (9, False)):  # a forward of known size outside 2..8
        with transposed_linears(layer, 8, rows=rows):  # installs nothing
            assert ("forward" in layer.__dict__) is patched


def test_choose_small_rows_keeps_the_sizes_that_won():
    assert choose_small_rows({2: (0.08, 0.06), 4: (0.08, 0.06), 8: (0.08, 0.079)}) == 4
    assert choose_small_rows({2: (0.08, 0.06), 4: (0.08, 0.081), 8: (0.08, 0.05)}) == 2  # contiguous from 2 only
    assert choose_small_rows({2: (0.08, 0.078), 4: (0.08, 0.05)}) == 0  # 2.5% is under the 5% bar
    assert choose_small_rows({2: (1.0, 0.5), 4: (1.0, 0.5), 8: (1.0, 0.5)}) == 8


@pytest.mark.parametrize("draft", ["heads", "hybrid", "lookup"])
def test_greedy_output_is_the_backbones_with_transposed_verifies(model, draft, monkeypatch):
    transposed_rows = []
    usual = small_rows_module._forward

    def counting(self, x):  # the verifies really go through the transposed products
        rows = x.numel() // x.shape[-1]
        transposed_rows.append(rows if 2 <= rows <= small_rows_module._MAX_ROWS.get() else 0)
        return usual(self, x)

    monkeypatch.setattr(small_rows_module, "_forward", counting)
    heads = random_mtp(model) if draft != "lookup" else None
    tree = "dynamic:nodes=6,topk=3,min_mass=0" if heads is not None else None  # random heads: keep their nodes
    gen = SpeculativeGenerator(model, heads, tree=tree, draft=draft, adaptive_budget=False, small_row_linears=False)
    assert gen.small_rows == 0
    gen.small_rows = 8  # whatever this machine measured
    assert_matches_greedy(gen, model, 3, seed=11)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # lookup finds continuations in it
    assert gen.generate(ids, max_new_tokens=16).sequences.tolist() == greedy_reference(model, ids, 16).tolist()
    assert any(transposed_rows)
    medusa = SpeculativeGenerator(model, random_heads(model), tree="chain:3", draft="heads", small_row_linears=False)
    medusa.small_rows = 8
    transposed_rows.clear()
    assert_matches_greedy(medusa, model, 2, seed=12)
    assert any(transposed_rows)


def test_small_rows_are_measured_once_per_machine(model, tmp_path, monkeypatch):
    calls = []

    def fake_measure(m):
        calls.append(m)
        return {2: (0.08, 0.06), 4: (0.08, 0.07), 8: (0.08, 0.09)}

    monkeypatch.setattr(small_rows_module, "measure_small_rows", fake_measure)
    assert cached_small_rows(model, cache_root=tmp_path) == 4
    assert cached_small_rows(model, cache_root=tmp_path) == 4 and len(calls) == 1  # read back, not measured again
    assert cached_small_rows(model, cache_root=tmp_path, refresh=True) == 4 and len(calls) == 2
    monkeypatch.undo()
    real = small_rows_module.measure_small_rows(model, sizes=(2, 4), repeats=2)  # the real thing, on the tiny model
    assert set(real) == {2, 4} and all(a > 0 and b > 0 for a, b in real.values())
