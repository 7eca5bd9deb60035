"""Fixtures (the helpers themselves are in helpers.py): a tiny random Llama / Qwen2 backbone per test; ``on_cpu`` for
tests of CPU-only behaviour; for the training tests, a tiny backbone saved to disk and a dataset of its own greedy
answers (those need the ``datasets`` library, and skip where it is not installed, as on the GPU machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import ANSWER_LEN, TEST_DEVICE, OnTestDevice, greedy_answers, tiny_model
from tiny_tokenizer import tiny_tokenizer

from tokenmaxx.heads import load_backbone

torch.set_num_threads(min(2, os.cpu_count() or 1))
if "TOKENMAXX_TEST_DEVICE" in os.environ:  # scripts/gpu_check.py: the fast tier on a GPU (its dry run: on the CPU)
    OnTestDevice(TEST_DEVICE).__enter__()


@pytest.fixture(autouse=True)
def eager_on_the_test_device(request, monkeypatch):
    """On an accelerator (``TOKENMAXX_TEST_DEVICE``) generators default to a static cache with captured passes
    (``inference.runner``: torch.compile per shape). The fast tier checks what they compute, so there it runs those
    passes uncompiled (compiling each tiny model's shapes would take most of the device's minutes); a test marked
    ``capture`` compiles."""
    if TEST_DEVICE.type != "cpu" and "capture" not in request.keywords:
        from tokenmaxx.inference import runner

        monkeypatch.setattr(runner.torch, "compile", lambda fn, **kwargs: fn)


@pytest.fixture(scope="session", autouse=True)
def cache_in_tmp(tmp_path_factory):
    """The tests' tokenmaxx cache (``$TOKENMAXX_CACHE``) is a temp folder whose backbones/ is the user's: converted
    real backbones are reused, while calibration records (latency, proposing cost, small rows, trees) of the tests'
    tiny and real models are neither read stale from nor left behind in the user's cache."""
    from tokenmaxx.heads.io.backbones import CACHE_ENV, cache_dir

    backbones = cache_dir() / "backbones"
    backbones.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("tokenmaxx-cache")
    (root / "backbones").symlink_to(backbones, target_is_directory=True)
    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, str(root))
    yield root
    patch.undo()


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A test that runs a script's ``main`` in-process (``--threads 1``) must not leave torch on one thread: later
    tests would run at half speed, and the real backbone's calibrations (keyed by threads) would be measured again."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture
def on_cpu():
    """For a test of what happens on the CPU alone (key/value-head sharing, the transposed small-row products, the
    CPU's calibration keys): what it builds is made on the CPU whatever ``TOKENMAXX_TEST_DEVICE`` says, so under
    scripts/gpu_check.py it checks the CPU's behaviour instead of failing on the GPU's. Name it first
    (``@pytest.mark.usefixtures("on_cpu")``): it must be active before fixtures that build models."""
    with OnTestDevice(torch.device("cpu")):
        yield


# ---- training: a tiny backbone on disk and its own greedy answers ---------------------------------------------------
@pytest.fixture(scope="session")
def backbone_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-backbone")
    tiny_model("llama", seed=1).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, backbone_dir) -> Path:
    datasets = pytest.importorskip("datasets", reason="the training data fixture needs the datasets library")
    model, _ = load_backbone(str(backbone_dir))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt_len in (3, 6, 9, 12):  # 4 groups of 10 prompts
        prompts = torch.randint(4, 96, (10, prompt_len), generator=gen)
        for p, a in zip(prompts.tolist(), greedy_answers(model, prompts, ANSWER_LEN).tolist()):
            rows.append({"prompt": " ".join(map(str, p)), "prompt_ids": p, "answer_ids": a})
    path = tmp_path_factory.mktemp("data") / "tiny"
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    ident, revision = str(backbone_dir), None
    (path / "provenance.json").write_text(json.dumps({"backbone": ident, "backbone_revision": revision,
                                                      "sampling": {"greedy": True}}))
    return path
