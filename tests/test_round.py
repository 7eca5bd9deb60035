"""What one speculative round asks of the host: values read back from the device and tensors made from Python data
(host-to-device copies on an accelerator), counted per round on the CPU through a dispatch mode, and pinned.

On a GPU each read waits for everything queued before it, and a copy from Python data does too (a blocking copy):
a round that reads or copies mid-way stops feeding the device. The counts are the same on any device, so the CPU
pins them for the GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import (HostTraffic, OracleMTP, decode_one, greedy_reference, random_eagle3, random_heads,
                     random_prompts, repeating_prompts, tiny_model)

from tokenmaxx.heads import Tree
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig, Frontier, grow_tree
from tokenmaxx.heads.drafting import Outcome
from tokenmaxx.inference.costs import Costs, VerifyLatency
from tokenmaxx.inference.drafting import DraftSettings, make_drafter

class Marking:
    """A drafter that marks the traffic counter at the start of each round (its ``propose``)."""

    def __init__(self, drafter, traffic: HostTraffic):
        self.drafter, self.traffic = drafter, traffic
        self.feature_layers = drafter.feature_layers

    def start(self, prefill):
        self.drafter.start(prefill)

    def propose(self, root: int, room: int):
        self.traffic.mark()
        return self.drafter.propose(root, room)

    def observe(self, outcome: Outcome) -> None:
        self.drafter.observe(outcome)

    def share_forward(self, rows: int) -> None:
        self.drafter.share_forward(rows)


def round_traffic(model, drafter, prompt: torch.Tensor, new_tokens: int = 40,
                  cache: str = "dynamic") -> list[tuple[int, int]]:
    """(reads, copies) of each steady-state round of one greedy generation (the first and last rounds left out:
    the first reads what the prefill left, the last the generation's totals)."""
    traffic = HostTraffic()
    with traffic, torch.no_grad():  # (not inference_mode: its tensors' reads pass the dispatch mode by)
        decode_one(model, Marking(drafter, traffic), prompt, new_tokens, timed=False, cache=cache)
    marks = traffic.marks
    # the last rounds have less room than the trees' depth: their cut trees are new shapes, compiled once
    rounds = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])][1:-4]
    assert len(rounds) >= 3, f"only {len(rounds)} steady rounds: the prompt ended too soon"
    return rounds


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = None  # every generation runs its full length
    return model


def _prompt(model) -> torch.Tensor:
    return next(repeating_prompts(model.config.vocab_size, seed=3))[0]


def test_the_counter_sees_reads_and_copies():
    traffic = HostTraffic()
    x = torch.arange(4)
    with traffic:
        int(x[1]), x.tolist(), bool(x.sum() > 1)
        torch.tensor([1, 2]), x + 1, x.masked_fill(x > 1, 0)
    assert (traffic.reads, traffic.copies) == (3, 1)
    assert torch.Tensor.tolist is not None and x.tolist() == [0, 1, 2, 3]  # restored


@pytest.mark.parametrize("stop_early,cache", [(False, "dynamic"), (True, "dynamic"), (False, "static")])
def test_a_sequential_heads_round_reads_once(llama, stop_early, cache):
    heads = random_eagle3(llama, num_heads=3)
    drafter = heads.drafter(llama, DynamicTreeConfig(nodes=12, topk=4, min_mass=0.3))
    drafter.stop_early = stop_early
    rounds = round_traffic(llama, drafter, _prompt(llama), cache=cache)
    levels = drafter.depth - 1  # the checks growing a tree may read: one per level after the first
    # one read: the accepted length, path and tokens; no copy from the host (the root stays on the device)
    assert max(r for r, _ in rounds) <= (1 + levels if stop_early else 1), rounds
    assert max(c for _, c in rounds) == 0, rounds


def test_a_static_tree_round_reads_once(llama):
    drafter = random_heads(llama).drafter(llama, Tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]))
    rounds = round_traffic(llama, drafter, _prompt(llama))
    assert max(r for r, _ in rounds) == 1 and max(c for _, c in rounds) == 0, rounds


LATENCY = VerifyLatency({64: {1: 1.0, 4: 1.1, 8: 1.3, 16: 1.8, 32: 3.0}})


@pytest.mark.parametrize("mode", ["lookup", "hybrid", "heads"])
def test_host_drafting_modes_stay_inside_their_budget(llama, mode):
    """Lookup matches n-grams in the host's copy of the output and the budget drafter merges its branches and cuts the
    tree there: their rounds read the heads' tree once (when the heads ran) and copy the kept tree to the device
    once."""
    heads = random_eagle3(llama, num_heads=3)
    settings = DraftSettings(tree=DynamicTreeConfig(nodes=12, topk=4, min_mass=0),
                             costs=Costs(latency=LATENCY, propose_seconds=0.1))
    drafter = make_drafter(mode, llama, heads, settings)
    if hasattr(drafter, "heads"):
        drafter.heads.stop_early = False
    rounds = round_traffic(llama, drafter, _prompt(llama))
    reads, copies = max(r for r, _ in rounds), max(c for _, c in rounds)
    assert reads == (1 if mode == "lookup" else 2) and copies == 1, rounds


def test_trees_grown_without_reads_are_the_trees_grown_with_them():
    """Without the per-level checks every level is drafted, and a node that cannot enter the kept set has its
    children dropped: at min_mass 0 the kept tree is exactly the one the checks give."""
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    table = torch.randn(vocab, vocab, generator=gen).mul(2).log_softmax(-1)  # child log-probs by parent token

    def expand(frontier: Frontier) -> torch.Tensor:
        return table[frontier.tokens] + 0.01 * frontier.level

    for trial in range(30):
        root_lp = torch.randn(vocab, generator=gen).mul(2).log_softmax(-1)
        topk, depth, nodes = 1 + trial % 4, 1 + trial % 5, 2 + (7 * trial) % 20
        a = grow_tree(3, root_lp, expand, topk, depth, nodes, stop_early=True)
        b = grow_tree(3, root_lp, expand, topk, depth, nodes, stop_early=False)
        assert a.tokens.tolist() == b.tokens.tolist() and torch.equal(a.scores, b.scores), trial
        assert a.buffers.parents.tolist() == b.buffers.parents.tolist() and torch.equal(a.buffers.attn_mask,
                                                                                       b.buffers.attn_mask)


@pytest.mark.parametrize("stop_early", [False, True])
def test_sequential_drafts_grown_on_the_device_match_greedy(stop_early):
    """Rigged heads (long acceptance through side branches) drafting with and without the host's checks: the output
    is the backbone's greedy continuation either way."""
    model = tiny_model("llama", seed=1)
    taus = []
    for i, (prompt, _) in enumerate(random_prompts(3, model.config.vocab_size, seed=5)):
        reference = greedy_reference(model, prompt, 40)
        drafter = OracleMTP(model, reference, p_top=0.6, seed=i).drafter(
            model, DynamicTreeConfig(nodes=16, topk=3, depth=4, min_mass=0.2))
        drafter.stop_early = stop_early
        with torch.no_grad():
            tokens, stats = decode_one(model, drafter, prompt, 30)
        assert tokens == reference[0, prompt.shape[1]:][:len(tokens)].tolist(), i
        taus.append(stats.mean_tau)
    assert sum(taus) / len(taus) > 2.0, taus  # the paths really were accepted
