"""The command line: the `tokenmaxx` console command, the scripts' shared defaults, and how generate.py resolves its
sampling flags (a temperature > 0 samples; --do_sample false with one is refused)."""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import DEFAULT_BACKBONE, DynamicTreeConfig, MTPHeads, Tree
from tokenmaxx.inference import DEFAULT_DRAFT, DEFAULT_DTYPE, SpeculativeGenerator
from tokenmaxx.scripts import bench, cli, generate

REPO = Path(__file__).resolve().parents[1]
CONSOLE = Path(sys.executable).parent / "tokenmaxx"  # installed by pip from [project.scripts]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, cwd=REPO)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


# ---- defaults ------------------------------------------------------------------------------------------------------
def test_scripts_share_the_library_defaults():
    assert (DEFAULT_DRAFT, DEFAULT_DTYPE) == ("hybrid", "auto")
    for args in (generate.GenerateArgs(), bench.BenchArgs(prompts=__file__)):
        assert (args.backbone, args.draft, args.dtype, args.heads) == (DEFAULT_BACKBONE, DEFAULT_DRAFT, DEFAULT_DTYPE,
                                                                     None)
    assert generate.GenerateArgs().tree is None and generate.GenerateArgs().kind is None  # the shipped default heads
    api = inspect.signature(SpeculativeGenerator.__init__).parameters  # the Python API: the same defaults
    assert api["draft"].default == DEFAULT_DRAFT and api["tree"].default is None
    assert inspect.signature(SpeculativeGenerator.from_pretrained).parameters["dtype"].default == DEFAULT_DTYPE
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "--draft" not in demo.splitlines()[-1] and "--dtype float32" in demo  # fp32 on purpose: exact identity


# ---- generate.py: sampling flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, sampling", [
    ([], False),
    (["--temperature", "0.8"], True),
    (["--top_p", "0.9"], True),
    (["--top_k", "20"], True),
    (["--top_k", "0"], False),  # 0: top-k off
    (["--top_p", "1.0"], False),
    (["--temperature", "0"], False),  # 0 means greedy
    (["--temperature", "0", "--top_p", "0.9"], False),
    (["--do_sample", "--temperature", "0"], False),
    (["--do_sample"], True),
    (["--do_sample", "true", "--temperature", "0.5"], True),
    (["--do_sample", "false"], False),
    (["--do_sample", "false", "--temperature", "0"], False),
])
def test_sampling_flags_resolve(flags, sampling, capsys):
    args = generate.parse_args(flags)
    kwargs = args.generate_kwargs()
    assert args.sampling is sampling and kwargs["do_sample"] is sampling
    note = capsys.readouterr().err
    assert ("without --do_sample: sampling" in note) == (sampling and "--do_sample" not in flags)
    assert len(note.splitlines()) <= 1


def test_temperature_without_do_sample_samples_with_each_seed(capsys):
    one, two = (generate.parse_args(["--temperature", "0.8", "--seed", str(s)]).generate_kwargs() for s in (1, 2))
    assert capsys.readouterr().err.splitlines() == ["note: --temperature 0.8 without --do_sample: sampling "
                                                    "(--temperature 0 for greedy)"] * 2
    assert one["do_sample"] and two["do_sample"] and one["temperature"] == two["temperature"] == 0.8
    assert (one["seed"], two["seed"]) == (1, 2)
    assert {k: v for k, v in one.items() if k != "seed"} == {k: v for k, v in two.items() if k != "seed"}


@pytest.mark.parametrize("flags, message", [
    (["--do_sample", "false", "--temperature", "0.8"], "--do_sample false contradicts --temperature 0.8"),
    (["--do_sample", "false", "--top_p", "0.5"], "--do_sample false contradicts --top_p 0.5"),
    (["--compare", "--temperature", "0.7"], "--compare checks token identity with greedy generate"),
    (["--compare", "--do_sample"], "--compare checks token identity with greedy generate"),
    (["--typical"], "--typical is an acceptance rule for sampling"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top_p", "0"], r"--top_p must be in \(0, 1\]"),
    (["--top_k", "-3"], "--top_k must be >= 0"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be positive"),
])
def test_bad_generate_flags_give_one_error_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.parse_args(flags)
    assert exit_info.value.code == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and re.search(message, errors[0]), errors


@pytest.mark.parametrize("parse, flags, message", [
    (generate.parse_args, ["--kind", "foo"], r"unknown head kind 'foo': known kinds are \['eagle3', 'medusa', 'mtp'\]"),
    (generate.parse_args, ["--draft", "foo"], "unknown --draft 'foo': expected one of heads, lookup, hybrid"),
    (generate.parse_args, ["--prompt", " "], "--prompt is empty"),
    (lambda flags: bench.parse_args(["--prompts", __file__, *flags]), ["--draft", "foo"], "unknown --draft 'foo'"),
    (lambda flags: cli.main(["generate", *flags]), ["--kind", "foo"], "unknown head kind 'foo'"),
])
def test_unknown_kind_draft_or_empty_prompt_give_one_error_line(parse, flags, message, capsys):
    """Refused while parsing, before any backbone is loaded."""
    with pytest.raises(SystemExit) as exit_info:
        parse(flags)
    errors = error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors


def test_typical_with_sampling_is_accepted():
    assert generate.parse_args(["--typical", "--temperature", "0.7"]).generate_kwargs()["typical"] is not None


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> tuple[Path, Path]:
    backbone, heads = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("mtp")
    model = tiny_model("llama", seed=3)
    model.save_pretrained(backbone)
    tiny_tokenizer().save_pretrained(backbone)
    torch.manual_seed(0)
    MTPHeads.for_backbone(model, num_heads=3).save_pretrained(heads)
    return backbone, heads


@pytest.mark.parametrize("heads", ["saved", "untrained"])  # untrained heads are drawn from --seed too
def test_generate_samples_differently_per_seed(tiny_folders, heads, capsys):
    """End to end on a tiny backbone: a temperature without --do_sample samples (seeded: repeatable), 0 is greedy."""
    backbone, saved = tiny_folders

    def new_tokens(*flags: str) -> list[int]:
        generate.main(["--backbone", str(backbone), "--heads", str(saved) if heads == "saved" else heads, "--dtype",
                       "float32", "--threads", "1", "--max_new_tokens", "16", "--raw", "--prompt", "a b c a b c",
                       "--json", *flags])
        return json.loads(capsys.readouterr().out)["new_tokens"]

    first, again, other = (new_tokens("--temperature", "1.5", "--seed", s) for s in ("1", "1", "2"))
    assert first == again and first != other
    assert new_tokens("--temperature", "0") == new_tokens() == new_tokens("--seed", "2")  # greedy: seeds change nothing


def test_adaptive_budget_flag_chooses_sized_or_whole_trees(tiny_folders, capsys):
    backbone, saved = tiny_folders

    def run(*flags: str) -> tuple[str, str]:
        generate.main(["--backbone", str(backbone), "--heads", str(saved), "--dtype", "float32", "--threads", "1",
                       "--max_new_tokens", "12", "--raw", "--prompt", "a b c a b c", "--draft", "heads", *flags])
        out = capsys.readouterr()
        return out.out, out.err

    (sized_text, sized_log), (whole_text, whole_log) = run(), run("--adaptive_budget", "false")
    assert sized_text == whole_text  # greedy: the tree changes the speed, never the text
    assert "sized per round" in sized_log and "sized per round" not in whole_log and "dynamic tree" in whole_log


@pytest.mark.slow
def test_bad_values_end_in_one_error_line_and_status_2(tiny_folders, monkeypatch, capsys):
    """A bad value found after parsing (a mistyped --heads, an unknown backbone alias, a bad --tree) ends in one
    ``error:`` line on stderr and status 2, from the script and from the console command; --debug or TOKENMAXX_DEBUG=1
    shows the traceback instead."""
    backbone, heads = tiny_folders
    common = ["--backbone", str(backbone), "--dtype", "float32", "--threads", "1", "--max_new_tokens", "4"]
    for command, message in [
        ([sys.executable, REPO / "scripts" / "generate.py", "--backbone", "gpt-9"], "unknown backbone 'gpt-9'"),
        ([CONSOLE, "generate", *common, "--heads", "nope"], "'nope'"),
    ]:
        out = run(*command)  # stderr may also hold transformers' weight-loading progress bar
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
        assert len(errors) == 1 and message in errors[0] and out.stderr.endswith(errors[0] + "\n"), out.stderr
    debug = run(CONSOLE, "generate", *common, "--heads", "nope", "--debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr

    assert cli.main(["generate", *common, "--heads", str(heads), "--tree", "bogus"]) == 2  # in-process: the same path
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bogus" in errors[0], errors
    monkeypatch.setenv("TOKENMAXX_DEBUG", "1")
    with pytest.raises(ValueError, match="bogus"):
        cli.main(["generate", *common, "--heads", str(heads), "--tree", "bogus"])


@pytest.mark.parametrize("err", [OSError("We couldn't connect to the Hub.\nCheck your connection."),
                                 ValueError("bad\n  value")])
def test_run_script_ends_any_user_error_in_one_line(err, capsys):
    """transformers' OSError for an unreachable backbone id included; a multi-line message is joined."""
    from tokenmaxx.scripts.errors import run_script

    def main(argv):
        raise err

    assert run_script(main, []) == 2
    assert capsys.readouterr().err == f"error: {' '.join(str(err).split())}\n"
    with pytest.raises(type(err)):
        run_script(main, ["--debug"])


# ---- bench.py ------------------------------------------------------------------------------------------------------
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


# ---- the tokenmaxx console command ---------------------------------------------------------------------------------
def test_console_help_lists_the_commands():
    assert CONSOLE.is_file(), f"{CONSOLE} is missing: reinstall (pip install --no-deps -e .)"
    out = run(CONSOLE, "--help")
    assert out.returncode == 0, out.stderr
    for name in ("generate", "bench", "train", "make-data", "push", "export", "eval"):
        assert f"\n  {name} " in out.stdout
    assert set(cli.COMMANDS) == {"generate", "bench", "train", "make-data", "push", "export", "eval"}


@pytest.mark.parametrize("argv", [["bogus"], []])
def test_console_unknown_or_missing_command(argv):
    out = run(CONSOLE, *argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("tokenmaxx: error: ")
    assert "known commands: generate, bench, train, make-data, push" in out.stderr


@pytest.mark.slow
def test_console_generate_help_and_script_help_agree():
    console = run(CONSOLE, "generate", "--help")
    script = run(sys.executable, REPO / "scripts" / "generate.py", "--help")
    assert console.returncode == 0 and script.returncode == 0, console.stderr + script.stderr
    assert console.stdout.startswith("usage: tokenmaxx generate ") and script.stdout.startswith("usage: generate.py ")
    for flag in ("--prompt", "--heads", "--draft", "--dtype", "--tree", "--temperature", "--do_sample", "--compare"):
        assert flag in console.stdout and flag in script.stdout
    refused = run(CONSOLE, "generate", "--temperature", "0.8", "--do_sample", "false")
    assert refused.returncode == 2 and len(error_lines(refused.stderr)) == 1


@pytest.mark.parametrize("name, flag", [("bench", "--prompts"), ("train", "--kind"), ("make-data", "--exclude"),
                                        ("push", "--repo_id"), ("eval", "--split")])
def test_every_command_parses_its_scripts_flags(name, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tokenmaxx {name} ") and flag in out
