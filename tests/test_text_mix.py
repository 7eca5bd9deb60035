"""The text mix: ShareGPT's original answers and task-shaped text as chats whose last turn is the answer, cut into
training windows that cover every answer token once, written as a dataset whose provenance says the labels are the
backbone's (training refuses any loss but KL on it)."""

import json
import re
import struct
from collections import Counter

import pytest

from tokenmaxx.scripts import make_text_data
from tokenmaxx.training.text_mix import (CATALOG_LOCALES, TextMixConfig, build_text_mix, catalog_digest, chat_records,
                                         math_records, read_catalogs, summary_of, windows, write_text_dataset)
from tokenmaxx.training.prompt_mix import conversations

from test_prompt_mix import PASSAGE, _records

MESSAGES = {"Save": "Enregistrer", "Delete": "Supprimer", "Log out": "Déconnexion", "%(name)s was added.":
            "%(name)s a été ajouté.", "Close": "Fermer", "Search": "Rechercher", "Name": "Nom"}


def write_mo(path, messages: dict[str, str]) -> None:
    """A GNU gettext .mo catalog of ``messages`` (the format gettext.GNUTranslations reads), made here so no
    package is needed: header, two tables of (length, offset), then the NUL-terminated strings."""
    messages = {"": "Content-Type: text/plain; charset=UTF-8\n", **messages}  # the header names the charset
    keys = sorted(messages)
    ids, strs = b"", b""
    id_entries, str_entries = [], []
    for k in keys:
        id_entries.append((len(k.encode()), len(ids)))
        ids += k.encode() + b"\0"
        str_entries.append((len(messages[k].encode()), len(strs)))
        strs += messages[k].encode() + b"\0"
    start = 7 * 4 + 16 * len(keys)
    table = b"".join(struct.pack("II", n, start + o) for n, o in id_entries)
    table += b"".join(struct.pack("II", n, start + len(ids) + o) for n, o in str_entries)
    header = struct.pack("Iiiiiii", 0x950412DE, 0, len(keys), 7 * 4, 7 * 4 + 8 * len(keys), 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + table + ids + strs)


@pytest.fixture
def catalog_root(tmp_path):
    for language, locale in CATALOG_LOCALES.items():
        write_mo(tmp_path / "pkg" / "conf" / "locale" / locale / "LC_MESSAGES" / "django.mo",
                 {k: f"{v} [{locale}]" for k, v in MESSAGES.items()})
    write_mo(tmp_path / "pkg" / "contrib" / "admin" / "locale" / "fr" / "LC_MESSAGES" / "django.mo",
             {"Add another": "Ajouter un autre", "Untranslated": "Untranslated", "ctx\x04Open": "Ouvrir"})
    return tmp_path / "pkg"


@pytest.mark.parametrize("prompt_len,answer_len", [(3, 40), (10, 5), (30, 200), (70, 10)])
def test_windows_train_every_answer_token_once_within_seq_len(prompt_len, answer_len):
    prompt, answer = list(range(1000, 1000 + prompt_len)), list(range(answer_len))
    examples = windows(prompt, answer, seq_len=32, context=8)
    assert all(len(p) + len(a) <= 32 and a for p, a in examples)
    assert [t for _, a in examples for t in a] == answer  # in order, each once
    sequence = prompt + answer
    for p, a in examples:  # each example is a stretch of the real sequence: its prompt is what came before it
        start = next(i for i in range(len(sequence)) if sequence[i:i + len(a)] == a and i >= len(p))
        assert sequence[start - len(p):start] == p
    assert all(len(p) == 8 for p, _ in examples[1:])


def test_catalogs_are_read_in_every_language_both_ways_and_digested(catalog_root, tmp_path):
    catalogs = read_catalogs(catalog_root)
    assert set(catalogs) == set(CATALOG_LOCALES)
    fr = dict(catalogs["French"])
    assert fr["Save"] == "Enregistrer [fr]" and fr["Add another"] == "Ajouter un autre"  # contrib catalogs too
    assert "Untranslated" not in fr and not any("\x04" in k for k in fr)  # untranslated and context entries skipped
    digest = catalog_digest(catalog_root)
    assert digest == catalog_digest(catalog_root)
    write_mo(catalog_root / "conf" / "locale" / "de" / "LC_MESSAGES" / "django.mo", {"Save": "Sichern"})
    assert catalog_digest(catalog_root) != digest

    records = build_text_mix(_records(), catalogs, TextMixConfig(weights={"translate": 1.0}))
    assert records and {r["source"] for r in records} == {"translate"}
    into = [r for r in records if r["origin"].endswith(":into")]
    out = [r for r in records if r["origin"].endswith(":out")]
    assert len(into) == len(out)
    french = next(r for r in into if ":fr:" in r["origin"])
    asked, answer = french["messages"][0]["content"], french["messages"][-1]["content"]
    assert asked.startswith("Translate the following into French:") and french["messages"][-1]["role"] == "assistant"
    for line, translated in zip(asked.split("\n\n", 1)[1].splitlines(), answer.splitlines()):
        number, english = line.split(". ", 1)
        assert translated == f"{number}. {fr[english]}"  # the pair, in the same numbered place


def test_chat_records_answer_every_assistant_turn_after_a_user_turn_with_its_context():
    convs = list(conversations(_records()))
    records = chat_records(convs, TextMixConfig())
    by_origin = {r["origin"]: r for r in records}
    assert set(by_origin) == {"sharegpt:a:1", "sharegpt:a:3", "sharegpt:b:1", "sharegpt:c:1", "sharegpt:d:1"}
    second = by_origin["sharegpt:a:3"]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user", "assistant"]
    assert second[-1]["content"] == "It was built in 1950." and second[1]["content"] == PASSAGE
    short = chat_records(convs, TextMixConfig(max_context_chars=40))  # the oldest turns go, from a user turn
    assert [m["role"] for m in {r["origin"]: r for r in short}["sharegpt:a:3"]["messages"]] == ["user", "assistant"]


def test_summaries_are_the_passages_opening_sentences():
    import random

    summary = summary_of(PASSAGE, random.Random(0), (1, 3))
    assert PASSAGE.startswith(summary) and summary.endswith(".") and len(summary) < len(PASSAGE)
    assert summary_of("One sentence only.", random.Random(0), (1, 3)) is None


def test_worked_math_solutions_add_up():
    for record in math_records(TextMixConfig(math_problems=200)):
        solution = record["messages"][-1]["content"]
        assert solution.rstrip().splitlines()[-1].startswith("The answer is ")
        for a, op, b, result in re.findall(r"(\d+) ([+\-x]) (\d+) = \$?(\d+)\b", solution.replace(",", "")):
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "x": int(a) * int(b)}[op]
            assert value == int(result), solution


def _more_records():
    topics = ("the river", "the dam", "the farm", "the lake", "the hills", "the fields")
    return _records() + [{"id": f"q{i}", "conversations": [
        {"from": "human", "value": f"What can you tell me about {t} and its history?"},
        {"from": "gpt", "value": PASSAGE.replace("river", t.split()[1])}]} for i, t in enumerate(topics)]


def test_the_mix_is_seeded_and_keeps_every_source(catalog_root):
    catalogs = read_catalogs(catalog_root)
    mix = build_text_mix(_more_records(), catalogs, TextMixConfig(math_problems=30))
    assert mix == build_text_mix(_more_records(), catalogs, TextMixConfig(math_problems=30))
    assert mix != build_text_mix(_more_records(), catalogs, TextMixConfig(math_problems=30, seed=1))
    assert set(Counter(r["source"] for r in mix)) == {"chat", "rag", "summarize", "translate", "math"}
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-2]["role"] == "user" for r in mix)
    rag = next(r for r in mix if r["source"] == "rag")
    assert " ".join(rag["messages"][-1]["content"].split()[:20]) in rag["messages"][0]["content"]  # copies a passage
    with pytest.raises(ValueError, match="weights"):
        TextMixConfig(weights={"poetry": 1.0})


def test_the_dataset_is_written_whole_with_its_counts_and_refuses_to_overwrite(tmp_path, backbone_dir, catalog_root):
    from transformers import AutoTokenizer

    datasets = pytest.importorskip("datasets")
    tokenizer = AutoTokenizer.from_pretrained(backbone_dir)
    mix = build_text_mix(_records(), read_catalogs(catalog_root), TextMixConfig(math_problems=10))
    out = tmp_path / "text"
    written = write_text_dataset(mix, tokenizer, out, {"answers": "text"}, seq_len=256, context=16)
    dataset = datasets.load_from_disk(str(out))
    assert len(dataset) == written["num_records"] > len(mix)  # long answers go on in further windows
    assert written["answer_tokens"] == sum(len(a) for a in dataset["answer_ids"])
    assert {s: c["records"] for s, c in written["per_source"].items()} == dict(Counter(r["source"] for r in mix))
    assert json.loads((out / "provenance.json").read_text()) == written
    assert all(len(p) + len(a) <= 256 for p, a in zip(dataset["prompt_ids"], dataset["answer_ids"]))
    first = next(i for i, c in enumerate(dataset["category"]) if c == "math")
    math = next(r for r in mix if r["source"] == "math")
    answer = tokenizer(math["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
    answer += [tokenizer.eos_token_id]
    assert dataset[first]["answer_ids"] == answer[:256 - len(dataset[first]["prompt_ids"])]
    assert dataset[first]["prompt_ids"] == tokenizer.apply_chat_template(
        math["messages"][:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ValueError, match="already exists"):
        write_text_dataset(mix, tokenizer, out, {}, seq_len=256, context=16)


def test_the_command_refuses_bad_flags_and_a_missing_catalog_folder(tmp_path):
    with pytest.raises(ValueError, match="--window_context"):
        make_text_data.main(["--output_dir", str(tmp_path / "x"), "--window_context", "600"])
    with pytest.raises(FileNotFoundError, match="--catalogs"):
        make_text_data.main(["--output_dir", str(tmp_path / "x"), "--catalogs", str(tmp_path / "none")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no catalogs for"):
        make_text_data.main(["--output_dir", str(tmp_path / "x"), "--catalogs", str(tmp_path / "empty")])


def test_training_on_text_takes_the_backbones_labels_only(tmp_path, data_dir):
    import shutil

    from helpers import make_cfg

    from tokenmaxx.training.trainer import train

    text = tmp_path / "text"
    shutil.copytree(data_dir, text)
    provenance = json.loads((text / "provenance.json").read_text())
    (text / "provenance.json").write_text(json.dumps({**provenance, "answers": "text"}))
    for loss in ("ce", "ce+kl"):
        with pytest.raises(ValueError, match=rf"train it with --loss kl, not --loss {re.escape(loss)}"):
            train(make_cfg(text, tmp_path / "run", loss=loss))
    assert not (tmp_path / "run" / "checkpoints").exists()
