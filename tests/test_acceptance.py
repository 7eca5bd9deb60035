"""scripts/acceptance.py: where the heads' acceptance is lost, per category, depth and tree size, on benchmark prompts
and held-out training rows."""

import json

import pytest
import torch
from helpers import random_eagle3

from tokenmaxx.heads import load_backbone
from tokenmaxx.scripts import acceptance


def test_depth_acceptance_is_each_depths_share_of_the_rounds_that_reached_it():
    # 4 rounds accepted nothing (tau 1), 3 one candidate, 2 two, 1 three
    hist = {1: 4, 2: 3, 3: 2, 4: 1}
    assert acceptance.depth_acceptance(hist, 4) == [6 / 10, 3 / 6, 1 / 3, 0.0]
    assert acceptance.depth_acceptance({1: 5}, 2) == [0.0, None]  # nothing reached depth 1


def test_outside_share_counts_what_the_draft_vocabulary_and_the_prompt_cannot_guess():
    assert acceptance.outside_share([1, 2, 3, 9, 9], {1, 2}) == (3, 5)
    assert acceptance.outside_share([1, 2, 3, 9, 9], {1, 2}, prompt={9}) == (1, 5)


def test_a_run_on_benchmark_prompts_and_held_out_rows_writes_one_table(tmp_path, backbone_dir, data_dir, capsys):
    model, _ = load_backbone(str(backbone_dir))
    heads = random_eagle3(model, seed=4)
    heads.set_draft_vocab(range(10, 80))
    heads.save_pretrained(tmp_path / "heads")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("qa", "12 13 14 12 13"), ("qa", "40 41 40 41"), ("math", "7 8 9")])))
    out = tmp_path / "acc"
    assert acceptance.main(["--prompts", str(prompts), "--data", str(data_dir), "--data_rows", "1", "--backbone",
                            str(backbone_dir), "--heads", str(tmp_path / "heads"), "--nodes", "2,4",
                            "--vocab_sizes", "16,32", "--max_new_tokens", "12", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["categories"]
    assert list(rows)[:2] == ["qa", "math"] and rows["qa"]["prompts"] == 2 and rows["math"]["prompts"] == 1
    assert [c for c in rows if c.startswith("data: ")] == ["data: rows"]  # the tiny data has no category column
    own = heads.tree_settings(heads.config, None).nodes
    assert report["config"]["sizes"] == sorted({2, 4, own}) and report["config"]["own_nodes"] == own  # and the own
    for row in rows.values():
        assert set(row["tau"]) == {"2", "4", str(own)} and all(1.0 <= t <= 4.0 for t in row["tau"].values())
        assert len(row["depth_acceptance"]) == 3 and 0.0 <= row["outside_vocab_and_prompt"] <= \
            row["outside_draft_vocab"] <= 1.0
        shares = row["outside_data_vocab_and_prompt"]
        assert list(shares) == ["16", "32"] and shares["32"] <= shares["16"]  # a larger vocabulary misses less
    table = out.with_suffix(".md").read_text()
    assert table.startswith("`tokenmaxx acceptance --prompts ") and "| qa | 2 |" in table and f"tau @{own}" in table
    assert f"accept d1 @{own}" in table and "outside draft vocab (70)" in table and "outside top 16 + prompt" in table
    with pytest.raises(ValueError, match="nothing to measure: give --prompts"):
        acceptance.main(["--out", str(out)])


def test_vocab_tau_drafts_with_each_vocabulary_and_times_its_proposals(tmp_path, backbone_dir, data_dir):
    from tokenmaxx.heads.draft_vocab import frequent_tokens

    model, _ = load_backbone(str(backbone_dir))
    heads = random_eagle3(model, seed=4)
    _, data = acceptance.held_out_prompts(str(data_dir), heads, 1)
    top32 = frequent_tokens((data.examples[r].ids.tolist() for r in data.train), 32)  # what training would make
    heads.set_draft_vocab(top32.tolist())
    heads.save_pretrained(tmp_path / "heads")
    out = tmp_path / "acc"
    assert acceptance.main(["--data", str(data_dir), "--data_rows", "3", "--backbone", str(backbone_dir), "--heads",
                            str(tmp_path / "heads"), "--nodes", "4", "--vocab_sizes", "16,32", "--vocab_tau",
                            "--propose_repeats", "1", "--max_new_tokens", "12", "--threads", "1", "--coverage_rows", "2",
                            "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    [(category, coverage)] = report["emitted_coverage"].items()
    answers = [data.examples[r].ids.numel() - data.examples[r].prompt_len for r in data.eval[:2]]
    assert category == "data: rows" and coverage["rows"] == 2 and coverage["tokens"] == sum(answers)
    shares = coverage["outside_vocab_and_prompt"]
    assert 0.0 <= shares["32"] <= shares["16"] <= 1.0
    own = report["config"]["own_nodes"]
    for row in report["categories"].values():
        assert row["tau_by_vocab"]["32"] == row["tau"][str(own)]  # the heads' own vocabulary: the same drafts
        assert 1.0 <= row["tau_by_vocab"]["16"] <= 4.0
    assert set(report["propose_seconds_by_vocab"]) == {"16", "32"}
    assert all(s > 0 for s in report["propose_seconds_by_vocab"].values())
    table = out.with_suffix(".md").read_text()
    assert f"tau @{own}, top 16" in table and "One proposal at the heads' own tree size: top 16 " in table
    with pytest.raises(ValueError, match="--vocab_tau drafts with vocabularies made from --data"):
        acceptance.main(["--prompts", str(tmp_path / "p.jsonl"), "--vocab_tau", "--out", str(out)])
