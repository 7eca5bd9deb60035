"""One backbone, two threads generating at once: each gets exactly what it gets alone (the shared-KV attention switch
travels with each forward call; every generation has its own drafter, caches and statistics)."""

import os
import threading

import pytest
import torch
from helpers import greedy_reference, random_mtp, tiny_model

from tokenmaxx.inference import SpeculativeGenerator


@pytest.mark.parametrize("draft", ["hybrid", "heads"])
def test_two_threads_on_one_backbone_give_the_sequential_outputs(draft):
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None  # full length: the threads overlap for the whole generation
    gen = SpeculativeGenerator(model, random_mtp(model), draft=draft)
    prompts = [torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5]]), torch.tensor([[9, 10, 11, 12]])]
    sequential = [gen.generate(p, max_new_tokens=40).new_tokens for p in prompts]
    for p, tokens in zip(prompts, sequential):  # fp32: the backbone's own greedy output
        assert torch.equal(greedy_reference(model, p, 40)[0, p.shape[1]:], torch.tensor(tokens))
    environment = dict(os.environ)
    for _ in range(3):
        results: list = [None, None]
        barrier = threading.Barrier(2)

        def run(i):
            barrier.wait()
            results[i] = gen.generate(prompts[i], max_new_tokens=40).new_tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == sequential
    assert dict(os.environ) == environment
