"""The training prompt mix: every chat turn in its real context, task-shaped prompts from non-benchmark text, a
weighted seeded interleave whose prefixes keep the proportions, and the parts script."""

import json
import random
from collections import Counter

import pytest

from tokenmaxx.scripts import make_prompts
from tokenmaxx.training.prompt_mix import MixConfig, build_mix, chat_prompts, conversations, interleave, math_prompts

PASSAGE = ("The river rises in the hills and runs south through farmland for about two hundred kilometres. "
           "Farmers along its banks grow wheat and barley, and in spring the water often floods the lower fields. "
           "A dam built in the last century now holds back the worst of the floods, and its lake is used for "
           "boating and fishing in the summer months.")


def _records():
    return [
        {"id": "a", "conversations": [
            {"from": "human", "value": "Tell me about the river."}, {"from": "gpt", "value": PASSAGE},
            {"from": "human", "value": "And the dam?"}, {"from": "gpt", "value": "It was built in 1950."},
            {"from": "human", "value": "Thanks!"}]},
        {"id": "b", "conversations": [
            {"from": "human", "value": "Explain photosynthesis in simple words please."},
            {"from": "gpt", "value": PASSAGE.replace("river", "plant")},
            {"from": "human", "value": "  "}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Write code"},
                                      {"from": "gpt", "value": "```python\nprint(1)\n```"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "¿Qué es la fotosíntesis?"},
                                      {"from": "gpt", "value": "La fotosíntesis es el proceso por el cual las plantas "
                                                               "convierten la luz en energía química. " * 3}]},
        "not a record",
    ]


def test_every_user_turn_is_a_prompt_in_its_real_context():
    convs = list(conversations(_records()))
    chats = chat_prompts(convs, MixConfig())
    by_origin = {c["origin"]: c["messages"] for c in chats}
    assert set(by_origin) == {"sharegpt:a:0", "sharegpt:a:2", "sharegpt:a:4", "sharegpt:b:0", "sharegpt:c:0",
                              "sharegpt:d:0"}  # b's empty third turn is dropped
    assert [m["role"] for m in by_origin["sharegpt:a:4"]] == ["user", "assistant", "user", "assistant", "user"]
    assert by_origin["sharegpt:a:4"][1]["content"] == PASSAGE  # the conversation's own earlier answer
    short = chat_prompts(convs, MixConfig(max_context_chars=60))
    trimmed = {c["origin"]: c["messages"] for c in short}["sharegpt:a:4"]
    assert trimmed[0]["role"] == "user" and trimmed[-1]["content"] == "Thanks!"  # oldest turns dropped, whole
    assert sum(len(m["content"]) for m in trimmed) <= 60


def test_the_mix_has_every_task_shape_from_its_own_text():
    mix = build_mix(_records(), MixConfig(math_problems=5, passage_words=(20, 300), seed=1))
    by_source = Counter(r["source"] for r in mix)
    assert set(by_source) == {"chat", "summarize", "translate", "rag", "math"} and by_source["math"] == 5
    texts = {r["source"]: r["messages"][-1]["content"] for r in mix}
    assert texts["summarize"].endswith(PASSAGE) or "plant" in texts["summarize"]
    assert "```" not in "".join(r["messages"][-1]["content"] for r in mix if r["source"] != "chat")  # no code
    rag = [r for r in mix if r["source"] == "rag"]
    assert all(r["messages"][0]["content"].count("Passage ") == 3 for r in rag)
    translations = [r["messages"][0]["content"] for r in mix if r["source"] == "translate"]
    assert any(t.startswith("Translate the following text into English.") for t in translations)  # from Spanish
    assert build_mix(_records(), MixConfig(math_problems=5, passage_words=(20, 300), seed=1)) == mix  # seeded


def test_math_problems_are_generated_and_reproducible():
    problems = math_prompts(MixConfig(math_problems=30, seed=4))
    assert len({p["messages"][0]["content"] for p in problems}) == 30
    assert problems == math_prompts(MixConfig(math_problems=30, seed=4))
    assert all(p["origin"].startswith("template:") for p in problems)


def test_interleave_keeps_the_proportions_in_every_prefix():
    streams = {"chat": list(range(10000)), "math": list(range(10000, 12000))}
    out = interleave(streams, {"chat": 0.8, "math": 0.2}, random.Random(0))
    assert sorted(out) == list(range(12000))
    head = out[:2000]
    assert 0.17 < sum(x >= 10000 for x in head) / len(head) < 0.23
    with pytest.raises(ValueError, match="weights must be non-negative"):
        MixConfig(weights={"poetry": 1.0})


def test_the_parts_script_excludes_benchmark_prompts(tmp_path, monkeypatch):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(_records()))
    monkeypatch.setattr(make_prompts, "sharegpt_path", lambda: data)
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["and the DAM?"]}) + "\n")
    assert make_prompts.main(["--output_dir", str(tmp_path / "mix"), "--exclude", str(bench), "--part_size",
                              "7"]) == 0
    record = json.loads((tmp_path / "mix" / "mix.json").read_text())
    rows = [json.loads(line) for f in sorted((tmp_path / "mix").glob("prompts-*.jsonl")) for line in f.open()]
    assert len(rows) == record["prompts"] and record["parts"] == -(-len(rows) // 7) and record["excluded"] >= 1
    assert not any("And the dam?" in m["content"] for r in rows for m in r["messages"])
    with pytest.raises(ValueError, match="already holds prompt parts"):
        make_prompts.main(["--output_dir", str(tmp_path / "mix")])
