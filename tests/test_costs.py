"""What was measured about the machine is a value handed to the method (``inference/costs.py``): the constructor
measures nothing and changes nothing on the model, ``create`` measures once (``measure.measure_costs``), a hand-made
``Costs`` is used as given, bad costs are one clear error; and the method's modules import nothing of the measuring."""

import ast
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_greedy, random_heads, random_mtp, tiny_model

from tokenmaxx.inference import Costs, SpeculativeGenerator, VerifyLatency, measure_costs
from tokenmaxx.inference import generator as generator_module
from tokenmaxx.inference.costs import interpolate
from tokenmaxx.inference.measure import latency as latency_module
from tokenmaxx.inference.measure import small_rows as small_rows_module

ROOT = Path(__file__).resolve().parents[1]


def _forbid_measuring(monkeypatch):
    for module, name in ((small_rows_module, "measure_small_rows"), (latency_module, "measure_latency"),
                         (latency_module, "measure_propose"), (latency_module, "measure_propose_rows")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))


@pytest.mark.parametrize("draft", ["heads", "hybrid", "lookup"])
def test_the_constructor_measures_nothing_and_leaves_the_model_as_it_was(draft, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    _forbid_measuring(monkeypatch)
    model = tiny_model("qwen2", seed=4)  # grouped-query layers on transformers' "sdpa"
    heads = random_mtp(model) if draft != "lookup" else None
    gen = SpeculativeGenerator(model, heads, draft=draft)
    assert model.config._attn_implementation == "sdpa" and gen.costs is None
    assert not any(tmp_path.iterdir())  # no cache written
    assert gen.runner.attention == {} and gen.runner.small_rows == {}
    assert_matches_greedy(gen, model, 2, seed=1)
    assert model.config._attn_implementation == "sdpa" and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_create_measures_the_costs_once_and_hands_them_to_the_method(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    model = tiny_model("llama", seed=2)
    heads = random_heads(model)
    calls = []
    real = generator_module.measure_costs
    monkeypatch.setattr(generator_module, "measure_costs", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(small_rows_module, "SMALL_ROW_SIZES", (2, 4))
    monkeypatch.setattr(latency_module, "LATENCY_SIZES", (1, 2, 4, 8))
    gen = SpeculativeGenerator.create(model, heads, draft="heads")
    assert len(calls) == 1 and isinstance(gen.costs, Costs)
    assert gen.costs.latency is not None and gen.costs.propose_seconds > 0
    assert set(gen.costs.propose_rows) == {4, 16} and min(gen.costs.propose_rows.values()) > 0
    assert gen.runner.small_rows == gen.costs.small_rows
    assert gen.describe().endswith("sized per round")
    _forbid_measuring(monkeypatch)  # a second generator reads every part from the cache
    again = SpeculativeGenerator.create(model, heads, draft="heads")
    assert again.costs == gen.costs
    assert measure_costs(model).latency is None  # lookup drafting: the small-row plan alone
    assert SpeculativeGenerator.create(model, heads, draft="heads", costs=None).costs is None


def test_a_hand_made_costs_is_used_as_given(monkeypatch):
    _forbid_measuring(monkeypatch)
    model = tiny_model("llama", seed=2)
    costs = Costs(latency=VerifyLatency({0: {1: 1.0, 2: 100.0}}), propose_seconds=0.0, small_rows={2: "head"})
    gen = SpeculativeGenerator.create(model, random_mtp(model), draft="heads", costs=costs)
    assert gen.costs is costs and gen.runner.small_rows == {2: "head"}
    out = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6)
    assert out.stats.mean_tau == 1.0  # every node costs 100 plain steps: each round verifies the root alone


def test_bad_costs_are_one_clear_error():
    model = tiny_model("llama")
    heads = random_heads(model)
    with pytest.raises(ValueError, match=r"costs='auto': measuring this machine is done by SpeculativeGenerator.create"):
        SpeculativeGenerator(model, heads, costs="auto")
    with pytest.raises(TypeError, match="costs must be a tokenmaxx.inference.Costs or None, got dict"):
        SpeculativeGenerator(model, heads, costs={"latency": None})
    with pytest.raises(ValueError, match="costs must be 'auto', a tokenmaxx.inference.Costs or None, got 'fast'"):
        SpeculativeGenerator.create(model, heads, costs="fast")
    with pytest.raises(ValueError, match="propose_seconds must be >= 0 seconds"):
        Costs(propose_seconds=-1.0)
    with pytest.raises(ValueError, match="at least one table"):
        VerifyLatency({})
    with pytest.raises(ValueError, match="nodes >= 1: seconds >= 0"):
        VerifyLatency({0: {0: 1.0}})
    with pytest.raises(ValueError, match="a small-rows plan maps row counts >= 2"):
        Costs(small_rows={1: "all"})
    with pytest.raises(ValueError, match="propose_rows must map rows >= 2 to seconds >= 0"):
        Costs(propose_seconds=0.01, propose_rows={1: 0.01})
    with pytest.raises(ValueError, match="beside a propose_seconds for one row"):
        Costs(propose_rows={4: 0.02})


def test_a_batch_prices_its_proposals_at_what_rows_together_were_measured_to_cost():
    """propose_time: one row's seconds; R rows between the measured counts (their passes are batched, so less than R
    times one row's); R x one row's where rows together were not measured; nothing where proposing was not."""
    costs = Costs(propose_seconds=0.01, propose_rows={4: 0.016, 16: 0.04})
    assert costs.propose_time(1) == 0.01
    assert costs.propose_time(4) == pytest.approx(0.016) and costs.propose_time(2) == pytest.approx(0.012)
    assert costs.propose_time(10) == pytest.approx(0.028) and costs.propose_time(32) == pytest.approx(0.072)
    assert Costs(propose_seconds=0.01).propose_time(8) == pytest.approx(0.08)
    assert Costs().propose_time(8) == 0.0


def test_verify_latency_blends_cache_lengths_and_interpolates_node_counts():
    latency = VerifyLatency({100: {1: 1.0, 4: 2.0}, 300: {1: 3.0, 4: 6.0}})
    assert latency.at(50) == {1: 1.0, 4: 2.0} and latency.at(200) == {1: 2.0, 4: 4.0}
    assert latency.at(400) == {1: 4.0, 4: 8.0}  # the last segment, extended
    assert interpolate({1: 1.0, 4: 2.0}, 2) == pytest.approx(4 / 3) and interpolate({1: 1.0, 4: 2.0}, 7) == 3.0
    assert interpolate({8: 0.5}, 3) == 0.5


def _imports(path: Path) -> set[str]:
    """Every module a file imports (lazy imports included), relative imports resolved against its package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else [])).removeprefix("tokenmaxx.")
            found |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tokenmaxx.") for a in node.names}
    return found


def test_the_method_imports_nothing_of_the_measuring_and_packages_import_one_way():
    method = ("loop", "decoding", "drafting", "budget", "lookup", "sampling", "runner", "kv", "costs")
    for name in method:
        imported = _imports(ROOT / "inference" / f"{name}.py")
        assert not {m for m in imported if m.startswith(("inference.measure", "measure"))}, (name, imported)
    for path in (ROOT / "training").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("inference")}, path.name
    for path in (ROOT / "heads").glob("*.py"):  # the model code: no Hub, cards, loaders (heads/io/)
        if path.name != "__init__.py":
            assert not {m for m in _imports(path) if m.startswith("heads.io") or m == "io"}, path.name


def test_the_announced_duration_is_the_forwards_times_one_timed_verify(monkeypatch):
    """The first-use notice says minutes: its forwards times one verify timed here (a stubbed clock: 0.5 s each)."""
    import itertools

    import tokenmaxx.inference.measure as measure

    ticks = itertools.count(step=0.5)
    monkeypatch.setattr(measure, "clock", lambda device: next(ticks))
    model = tiny_model("llama", seed=2)
    assert measure._duration(400, model) == "about 3 minutes"  # 400 x 0.5 s = 200 s
    assert measure._duration(100, model) == "about 1 minute"
    assert measure._duration(60, model) == "under a minute"


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
def test_the_first_measurement_is_announced_in_one_line_and_then_read_from_the_cache(monkeypatch, tmp_path, capsys):
    """What is measured and why, about how much, where it is cached and how to skip it: one line, once per backbone,
    dtype and machine (the measurements themselves are stubbed here: the line is the subject)."""
    monkeypatch.setenv("TOKENMAXX_CACHE", str(tmp_path))
    monkeypatch.setattr(small_rows_module, "measure_small_rows", lambda model: {2: {"usual": 1.0, "all": 0.5,
                                                                                   "head": 0.9, "body": 0.9}})
    monkeypatch.setattr(latency_module, "measure_latency", lambda model, sizes, **k: {n: 0.01 * n for n in sizes})
    monkeypatch.setattr(latency_module, "measure_propose", lambda model, drafter: 0.002)
    monkeypatch.setattr(latency_module, "measure_propose_rows", lambda model, make, rows: 0.001 * rows)
    model = tiny_model("llama", seed=2)
    heads = random_mtp(model)
    gen = SpeculativeGenerator.create(model, heads, draft="hybrid")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenmaxx: measuring")]
    assert len(lines) == 1, lines
    [line] = lines
    for said in ("measuring this machine once for", "(float32, cpu: ", "transposed products", "verify latency",
                 "proposing time", "4 and 16 rows together", "under a minute",  # (a tiny model's forwards)
                 f"Cached in {tmp_path / 'calibration'}", "costs=None", "--no_adaptive_budget"):
        assert said in line, (said, line)
    assert "forwards" not in line and "--adaptive_budget false" not in line  # time, and the flag a user types
    assert gen.costs.small_rows == {2: "all"} and gen.costs.propose_seconds == 0.002
    assert gen.costs.propose_rows == {4: 0.004, 16: 0.016}
    SpeculativeGenerator.create(model, heads, draft="hybrid")  # everything cached: not a word
    assert "tokenmaxx: measuring" not in capsys.readouterr().err
    SpeculativeGenerator.create(model, random_mtp(model, seed=3), draft="hybrid")  # other heads: their time only
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenmaxx: measuring")]
    assert "proposing time" in line and "verify latency" not in line and "transposed" not in line
