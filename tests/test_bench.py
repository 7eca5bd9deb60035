"""scripts/bench.py's command line: required prompts, method names (draft, kind, tree, flags), the recorded tree
settings and named heads. (The bench itself: test_benchmark.py.)"""

import pytest
from helpers import error_lines

from tokenmaxx.heads import DynamicTreeConfig, Tree
from tokenmaxx.scripts import bench


def test_bench_prompts_are_required(tmp_path, capsys):
    for flags, message in [([], "the following arguments are required: --prompts"),
                           (["--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file")]:
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(flags)
        errors = error_lines(capsys.readouterr().err)
        assert exit_info.value.code == 2 and len(errors) == 1 and message in errors[0], errors


def test_bench_method_names_give_draft_kind_tree_and_flags():
    spec = bench.tokenmaxx_method_spec
    assert spec("mtp", "hybrid") == ("heads", "mtp", None, False, False)
    assert spec("mtp:dynamic:16@fixed", "hybrid") == ("heads", "mtp", "dynamic:16", True, False)
    assert spec("hybrid:/runs/a@b/tree.json", "heads") == ("hybrid", None, "/runs/a@b/tree.json", False, False)
    assert spec("tokenmaxx@fixed", "heads") == ("heads", None, None, True, False)
    assert spec("medusa_hybrid", "heads") == ("hybrid", "medusa", None, False, False)
    assert spec("lookup", "hybrid") == ("lookup", None, None, False, False)
    assert spec("lookup@usual", "hybrid") == ("lookup", None, None, False, True)
    assert spec("mtp:dynamic:16@usual@fixed", "hybrid") == ("heads", "mtp", "dynamic:16", True, True)
    assert spec("baseline", "hybrid") is None and spec("mtp@whole", "hybrid") is None
    with pytest.raises(ValueError, match="lookup drafting has no heads' tree"):
        spec("lookup@fixed", "hybrid")


def test_bench_records_the_tree_settings_as_json():
    assert bench.tree_note(None) is None  # lookup-only drafting has no tree
    assert bench.tree_note(DynamicTreeConfig(nodes=6, min_mass=0.0)) == {"nodes": 6, "topk": 8, "depth": None,
                                                                         "min_mass": 0.0}
    assert bench.tree_note(Tree([(1,), (0,), (0, 0)])) == [[0], [1], [0, 0]]


def test_bench_names_more_heads_and_refuses_bad_names():
    assert bench.named_heads("adapted=runs/a/heads, b=x") == {"adapted": "runs/a/heads", "b": "x"}
    assert bench.named_heads(None) == {}
    for bad, message in [("adapted", "expected NAME=PATH"), ("hybrid=x", "is a built-in method's"),
                         ("a-b=x", "expected NAME=PATH")]:
        with pytest.raises(ValueError, match=message):
            bench.named_heads(bad)
