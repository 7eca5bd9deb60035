"""Fixtures (the helpers themselves are in helpers.py): a tiny random Llama / Qwen2 backbone per test."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


