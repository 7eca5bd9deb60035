"""What a new user hit in the first hour, on the heads side: a mistyped heads path is never sent to the Hub and a Hub
miss says what was tried on both sides; ``push_to_hub.py --card_only`` keeps a README.md that differs; heads that name
their backbone warn when attached to a model without a name; the card names data sources, generation settings and
hardware readably. (A repo missing on a real Hub server: test_hub.py.)"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import BENCH, BENCH_STATS, random_heads, tiny_model
from huggingface_hub import constants

from tokenmaxx.heads import DraftHeads, HeadsConfig, modeling, resolve_heads
from tokenmaxx.heads.card import CardExistsError
from tokenmaxx.heads.card import method_label, render_model_card, save_model_card
from tokenmaxx.heads.hub import HubUnreachableError
from tokenmaxx.inference import SpeculativeGenerator

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "heads" / "pretrained"


# ---- 1. heads given as a path that names no folder ------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory with a runs/ folder (as after a training run); any Hub request fails the test."""
    def no_hub(*args, **kwargs):
        raise AssertionError(f"the Hub was asked for {args} {kwargs}")

    monkeypatch.setattr(modeling, "download_heads", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    return tmp_path.resolve()


@pytest.mark.parametrize("spec", ["nope", "./runs/exprt", "../exprt", "runs/exprt/", "runs/a/exprt", "~/no-such-heads",
                                  "org name/heads", "ABSOLUTE"])
def test_a_heads_path_naming_no_folder_is_not_sent_to_the_hub(workdir, spec):
    spec = str(workdir / "runs" / "gone") if spec == "ABSOLUTE" else spec
    resolved = Path(spec).expanduser().resolve()
    with pytest.raises(FileNotFoundError, match=f"no such heads folder {re.escape(str(resolved))}") as err:
        DraftHeads.from_pretrained(spec)
    assert "not a Hub repo id of the form 'org/name' either, so the Hub was not asked" in str(err.value)
    with pytest.raises(FileNotFoundError, match=re.escape(str(resolved))):  # what scripts/generate.py --heads calls
        resolve_heads(spec, None, "smollm2-135m")


def test_a_heads_path_naming_a_file_says_so(workdir):
    (workdir / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(workdir / 'model.safetensors'))} is a file, not a "
                                                "heads folder"):
        DraftHeads.from_pretrained("model.safetensors")


def test_an_unreachable_hub_says_what_was_tried_locally_and_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HubUnreachableError) as err:  # "runs/exprt" has the form org/name: the Hub is asked too
        DraftHeads.from_pretrained("runs/exprt", endpoint=dead, cache_dir=str(tmp_path / "cache"))
    message = str(err.value)
    local = tmp_path.resolve() / "runs" / "exprt"
    assert f"no such heads folder {local} (its parent {local.parent} exists: a typo?)" in message
    assert f"cannot reach the Hub at {dead} for heads 'runs/exprt' (revision main)" in message


# ---- 2. --card_only keeps what is in README.md ----------------------------------------------------------------------
@pytest.fixture
def heads_folder(tmp_path) -> Path:
    random_heads(tiny_model("llama")).save_pretrained(tmp_path / "heads")
    return tmp_path / "heads"


def test_save_model_card_refuses_to_replace_a_readme_that_differs(heads_folder):
    readme = heads_folder / "README.md"
    save_model_card(heads_folder, "org/x", bench=BENCH)
    with_bench = readme.read_text()
    assert save_model_card(heads_folder, "org/x", bench=BENCH) == readme  # the same card again: fine
    with pytest.raises(CardExistsError) as err:  # no bench: the benchmark table would be lost
        save_model_card(heads_folder, "org/x")
    assert isinstance(err.value, ValueError) and isinstance(err.value, FileExistsError)
    message = str(err.value)
    assert str(readme) in message and "overwrite=True (push_to_hub.py --overwrite)" in message
    assert "It has a benchmark section and the new card has none" in message
    assert readme.read_text() == with_bench
    readme.write_text("# my notes\n\nwritten by hand\n")
    with pytest.raises(ValueError, match=re.escape(f"{readme} exists and differs")) as err:
        save_model_card(heads_folder, "org/x", bench=BENCH)
    assert "benchmark section" not in str(err.value) and readme.read_text() == "# my notes\n\nwritten by hand\n"
    save_model_card(heads_folder, "org/x", overwrite=True)
    assert "No benchmark was recorded" in readme.read_text()


def test_push_script_card_only_refuses_without_overwrite(heads_folder, capsys):
    from tokenmaxx.scripts import push_to_hub
    from tokenmaxx.scripts.errors import run_script

    readme = heads_folder / "README.md"
    card_only = ["--heads", str(heads_folder), "--repo-id", "org/x", "--card_only"]
    bench = heads_folder.parent / "bench.json"
    bench.write_text(json.dumps(BENCH))
    assert run_script(push_to_hub.main, [*card_only, "--bench", str(bench)]) == 0
    recorded = readme.read_text()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TOKENMAXX_DEBUG", None)
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "push_to_hub.py"), *card_only], env=env,
                         capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert str(readme) in errors[0] and "--overwrite" in errors[0] and "benchmark section" in errors[0]
    assert readme.read_text() == recorded
    capsys.readouterr()
    assert run_script(push_to_hub.main, [*card_only, "--overwrite"]) == 0
    assert f"wrote {readme}" in capsys.readouterr().out and readme.read_text() != recorded


def test_push_script_card_shows_the_bench_rows_it_is_told_to(heads_folder, capsys):
    """A bench that ran these heads as its --heads names them `tokenmaxx` / `hybrid`, not after their kind:
    --bench_methods picks the rows; a name the bench lacks, or rows without a bench, are one error naming the fix."""
    from tokenmaxx.scripts import push_to_hub
    from tokenmaxx.scripts.errors import run_script

    kind = DraftHeads.from_pretrained(heads_folder).config.kind
    methods = {"baseline": BENCH["methods"]["baseline"], kind: BENCH["methods"]["medusa"],
               "tokenmaxx:auto": {**BENCH["methods"]["medusa"], "overall": {**BENCH_STATS, "speedup": 1.44}}}
    bench = heads_folder.parent / "bench.json"
    bench.write_text(json.dumps({**BENCH, "methods": methods}))
    card_only = ["--heads", str(heads_folder), "--repo-id", "org/x", "--card_only", "--bench", str(bench)]
    assert run_script(push_to_hub.main, [*card_only, "--bench_methods", "baseline, tokenmaxx:auto"]) == 0
    card = (heads_folder / "README.md").read_text()
    assert "heads only (the bench's `--heads`), tree `auto`" in card and "**1.44x" in card
    assert method_label(kind) not in card  # the kind's own row was not asked for
    capsys.readouterr()
    assert run_script(push_to_hub.main, [*card_only, "--bench_methods", "baseline,hybrid", "--overwrite"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and "'hybrid'" in error and "tokenmaxx:auto" in error
    no_bench = [a for a in card_only if a not in ("--bench", str(bench))]
    assert run_script(push_to_hub.main, [*no_bench, "--bench_methods", "baseline", "--overwrite"]) == 2
    assert "give the JSON with --bench" in capsys.readouterr().err
    assert (heads_folder / "README.md").read_text() == card  # nothing half-written


# what docs/bench/README.md renders each shipped card from: (repo id, bench record, rows)
SHIPPED_CARDS = {"smollm2-135m": ("tokenmaxx/smollm2-135m-eagle3", "bench-s29.json",
                                  ["baseline", "prompt_lookup", "tokenmaxx:auto", "hybrid", "lookup"]),
                 "smollm2-135m-medusa": ("tokenmaxx/smollm2-135m-medusa", "bench-s10b.json", None)}


@pytest.mark.parametrize("alias", sorted(SHIPPED_CARDS))
def test_shipped_cards_are_rendered_from_their_current_config_and_bench(alias):
    """A card left behind when the heads, their record or the card code change would tell users about other heads."""
    repo_id, bench, methods = SHIPPED_CARDS[alias]
    docs = (REPO / "docs" / "bench" / "README.md").read_text()
    flags = f"--bench docs/bench/{bench}" + (f" --bench_methods {','.join(methods)}" if methods else "")
    assert f"--heads heads/pretrained/{alias} --repo-id {repo_id}" in " ".join(docs.split()).replace(" \\ ", " ")
    assert flags in " ".join(docs.split())
    config = HeadsConfig.from_json_file(SHIPPED / alias / "config.json")
    card = render_model_card(config, repo_id, REPO / "docs" / "bench" / bench, methods=methods)
    assert (SHIPPED / alias / "README.md").read_text() == str(card)


# ---- 9. heads that name a backbone, on a model without a name -------------------------------------------------------
def _identity_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, modeling.BackboneIdentityWarning)]


def test_heads_naming_a_backbone_warn_once_on_a_model_without_identity():
    model = tiny_model("llama")  # built from a config: no name_or_path, no tokenmaxx_backbone
    heads = random_heads(model)
    heads.config.backbone, heads.config.backbone_revision = "smollm2-135m", "b179c95"
    with pytest.warns(modeling.BackboneIdentityWarning,
                      match=r"made for backbone 'smollm2-135m' \(revision b179c95\).*could not be checked"):
        SpeculativeGenerator(model, heads, draft="heads")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeculativeGenerator(model, heads, draft="heads")  # the same model again: warned already
        heads.check_backbone(tiny_model("llama"), strict_identity=False)  # identity checks skipped knowingly
        random_heads(model).check_backbone(model)  # heads that name no backbone: nothing to check
        named = tiny_model("llama")
        named.config.tokenmaxx_backbone = "smollm2-135m"
        heads.check_backbone(named)  # a model with a name: checked, no warning
    assert _identity_warnings(caught) == []
    with pytest.warns(modeling.BackboneIdentityWarning):
        heads.check_backbone(tiny_model("llama"))  # another unnamed model object: warned again


# ---- 10. the card's data, generation settings and hardware ----------------------------------------------------------
def _row(text: str, what: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {what} |"))


def test_card_names_local_data_by_file_name_and_shows_settings_and_hardware(tmp_path):
    sources = [str(tmp_path / "prompts.jsonl"), "sharegpt", "HuggingFaceH4/ultrachat_200k", "./more/extra.json",
               str(tmp_path / "a-datasets-folder")]
    extra = {"training": {"data": str(tmp_path / "data" / "my-set")}, "world_size": 1,
             "deepspeed": {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
             "machine": {"cpu": "Intel(R) Xeon(R) Processor", "threads": 2, "torch": "2.13.0+cpu"},
             "data": {"rows": 120, "provenance": {"sources": sources,
                                                  "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 0}}}}
    text = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=extra), "org/x").text
    assert str(tmp_path) not in text and "./more" not in text
    assert _row(text, "data") == (
        "| data | `prompts.jsonl`, `sharegpt`, `HuggingFaceH4/ultrachat_200k`, `extra.json`, `a-datasets-folder`, "
        "120 prompts; answers generated by the backbone itself (self-distillation, sampled: temperature 0.7, "
        "top_p 0.9, top_k 0) |")
    assert _row(text, "hardware") == ("| hardware | cpu Intel(R) Xeon(R) Processor, threads 2, torch 2.13.0+cpu; "
                                      "1 process; DeepSpeed ZeRO stage 1 |")
    only_folder = {"training": {"data": str(tmp_path / "data" / "my-set")}, "world_size": 2}
    text = render_model_card(HeadsConfig(kind="medusa", hidden_size=32, vocab_size=96, extra=only_folder), "o/x").text
    assert _row(text, "data") == "| data | `my-set`; answers generated by the backbone itself (self-distillation) |"
    assert _row(text, "hardware") == "| hardware | 2 processes |" and str(tmp_path) not in text


SHIPPED_RUNS = {  # what each shipped card says of the data and the machine (config.json -> extra)
    "smollm2-135m": ("| data | " + ", ".join(f"`prompts-00{i}.jsonl`" for i in range(8)) + ", 15,395 prompts (chat "
                     "7,802, math 1,993, rag 1,590, summarize 2,009, translate 2,001), 2,869,368 answer tokens; answers "
                     "generated by the backbone itself (self-distillation, greedy) |",
                     "| hardware | cpu Intel(R) Xeon(R) Processor, cpu_isa AVX512, device cuda: NVIDIA H200, threads 16, "
                     "torch 2.11.0+cu130; 1 process; DeepSpeed ZeRO stage 1 |"),
    "smollm2-135m-medusa": ("| data | `sharegpt`, 3,000 prompts, 604,159 answer tokens; answers generated by the "
                            "backbone itself (self-distillation, greedy) |",
                            "| hardware | 1 process; DeepSpeed ZeRO stage 1 |"),
}


@pytest.mark.parametrize("alias", sorted(SHIPPED_RUNS))
def test_card_of_the_shipped_heads_shows_their_recorded_run(alias):
    config = HeadsConfig.from_json_file(SHIPPED / alias / "config.json")
    text = render_model_card(config, "org/x").text
    assert (_row(text, "data"), _row(text, "hardware")) == SHIPPED_RUNS[alias]
    assert "{" not in _row(text, "data") and "/work/" not in text and "/root/" not in text
