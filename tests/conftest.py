"""Fixtures (the helpers themselves are in helpers.py): a tiny random Llama / Qwen2 backbone per test."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TEST_DEVICE, OnTestDevice, tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))
if "TOKENMAXX_TEST_DEVICE" in os.environ:  # scripts/gpu_check.sh: the fast tier on a GPU (its dry run: on the CPU)
    OnTestDevice(TEST_DEVICE).__enter__()


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


