"""bench.py end to end on a tiny model; the tree optimizer on hand-made tables; calibration cache keys."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_model
from tiny_tokenizer import tiny_tokenizer


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
