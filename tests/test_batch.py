"""Batches (``loop.decode`` over several rows, ``SpeculativeGenerator.generate`` with several prompts; one prompt is a
batch of one row, through the same code): every row's output is what that prompt gives alone (fp32 greedy: token for
token; sampling: the same distribution), rows of different lengths drift apart and finish apart, the node budget
follows the load, a captured generator captures batches too, and bad batches are refused before any work."""

from __future__ import annotations

import pytest
import torch
from helpers import (HostTraffic, OracleMTP, broken_accept, chi2_pvalue, exact_pair, greedy_reference, random_eagle3, random_heads,
                     random_prompts, repeating_prompts, tiny_model)
from transformers import GenerationConfig

from tokenmaxx.heads.drafting import Outcome, Prefill, propose_rows
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig
from tokenmaxx.heads.modeling import backbone_features
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.inference import generator as generator_module
from tokenmaxx.inference import loop, runner
from tokenmaxx.inference.costs import Costs, VerifyLatency
from tokenmaxx.inference.decoding import accept_greedy
from tokenmaxx.inference.drafting import DraftSettings, make_drafter
from tokenmaxx.inference.kv import StaticKV
from tokenmaxx.inference.loop import LoadGate, decode, greedy_root, prefill_groups
from tokenmaxx.inference.sampling import build_warpers, target_probs


def _alone(model, prompt: list[int], new: int) -> list[int]:
    return greedy_reference(model, torch.tensor([prompt]), new)[0].tolist()


def _eos_model(seed=3):
    """A tiny backbone whose EOS id is a token one prompt reaches early (its row must stop there, the others not)."""
    model = tiny_model("llama", seed=seed)
    prompts = [p[0].tolist() for p, _ in repeating_prompts(model.config.vocab_size, seed=5, n=4)]
    early = _alone(model, prompts[2], 30)[len(prompts[2]) + 4]  # prompt 2's 5th new token
    model.generation_config.eos_token_id = early
    return model, prompts


@pytest.mark.parametrize("draft,kind", [("hybrid", "eagle3"), ("heads", "eagle3"), ("lookup", None),
                                        ("hybrid", "medusa")])
def test_each_row_is_what_its_prompt_gives_alone(draft, kind):
    model, prompts = _eos_model()
    heads = {"eagle3": lambda: random_eagle3(model, scale=0.05), "medusa": lambda: random_heads(model),
             None: lambda: None}[kind]()
    gen = SpeculativeGenerator(model, heads, draft=draft)
    news = [24, 31, 30, 9]
    out = gen.generate(prompts, max_new_tokens=news)
    assert len(out.rows) == 4 and len({len(p) for p in prompts}) > 1  # rows of different lengths
    for i, row in enumerate(out.rows):
        assert row.sequences.tolist() == [_alone(model, prompts[i], news[i])], i
    eos = model.generation_config.eos_token_id
    assert out.rows[2].new_tokens[-1] == eos and len(out.rows[2].new_tokens) == 5  # ended early on EOS
    assert out.stats.new_tokens == sum(len(r.new_tokens) for r in out.rows)
    assert out.stats.active_per_forward[0] == 4 and out.stats.active_per_forward[-1] < 4  # finished rows left


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] and mask [B, T], each row's tokens at its end."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


def test_ids_with_a_padding_mask_and_long_accepted_paths():
    """Rigged heads (long paths through side branches: each round gathers, rows drift apart by up to a tree's
    depth): every row equals greedy alone; and through the API, ids [B, T] right-padded with their mask."""
    model = tiny_model("llama", seed=1)
    prompts = [p[0] for p, _ in random_prompts(5, model.config.vocab_size, seed=5)]
    refs = [greedy_reference(model, p[None], 40) for p in prompts]
    news = [30, 25, 40, 10, 33]
    drafters = [OracleMTP(model, refs[i], p_top=0.6, seed=i).drafter(
        model, DynamicTreeConfig(nodes=16, topk=3, depth=4, min_mass=0.2)) for i in range(5)]
    with torch.no_grad():
        ids, mask = _left_padded(prompts)
        tokens, stats = decode(model, drafters, ids, news, accept_greedy, greedy_root, set(), attention_mask=mask)
    for i in range(5):
        assert tokens[i] == refs[i][0, len(prompts[i]):][:news[i]].tolist(), i
    assert min(r.mean_tau for r in stats.rows) > 3.0  # long paths really were accepted
    ids, mask = (t.flip(1) for t in _left_padded([p.flip(0) for p in prompts]))  # right-padded
    out = SpeculativeGenerator(model, None, draft="lookup").generate(ids, max_new_tokens=news, attention_mask=mask)
    for i, row in enumerate(out.rows):
        assert row.sequences.tolist() == refs[i][:, : len(prompts[i]) + news[i]].tolist(), i


def test_prefill_groups_pay_for_padding_only_where_tokens_cost_time():
    """Rows whose prompts differ a lot get their own prefill forwards where a forward's cost grows with its tokens;
    one forward holds them all where it stays flat, or where nothing was measured."""
    linear = {1: 0.040, 64: 0.040 + 63e-3}  # 40 ms a forward, 1 ms a token
    flat = {1: 0.040, 64: 0.041}
    lengths = [5, 100, 6, 95, 7]
    assert prefill_groups(lengths, linear) == [[0, 2, 4], [1, 3]]
    assert prefill_groups(lengths, flat) == [[0, 1, 2, 3, 4]]
    assert prefill_groups(lengths, None) == [[0, 1, 2, 3, 4]]
    assert prefill_groups([300, 8], {1: 0.001, 64: 0.064}) == [[1], [0]]  # no fixed cost: every row alone
    assert prefill_groups([12], linear) == [[0]]


def test_rows_prefilled_apart_and_a_padding_column_give_what_each_prompt_gives_alone():
    """A grouped prefill (a short and a long prompt, on a table where padding costs time) assembled into one cache,
    and a column of padding in every row: every row still equals greedy alone, and the prefill took two forwards."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = None
    prompts = [p[0] for p, _ in random_prompts(3, model.config.vocab_size, seed=7)]
    prompts = [prompts[0][:3], torch.cat([prompts[1], prompts[2], prompts[1]]), prompts[2][:4]]
    refs = [greedy_reference(model, p[None], 14) for p in prompts]
    latency = VerifyLatency({0: {1: 0.040, 64: 0.040 + 63e-3}})
    ids, mask = _left_padded(prompts)
    ids, mask = torch.cat([ids.new_zeros(3, 1), ids], 1), torch.cat([mask.new_zeros(3, 1), mask], 1)
    forwards = []
    handle = model.register_forward_hook(lambda module, args, kwargs_out: forwards.append(1))
    drafters = [make_drafter("lookup", model, None, DraftSettings(costs=Costs(latency=latency))) for _ in prompts]
    try:
        with torch.no_grad():
            tokens, stats = decode(model, drafters, ids, [14] * 3, accept_greedy, greedy_root, set(),
                                   attention_mask=mask, costs=Costs(latency=latency))
    finally:
        handle.remove()
    for i in range(3):
        assert tokens[i] == refs[i][0, len(prompts[i]):].tolist(), i
    assert len(forwards) == 2 + stats.forwards  # the two short rows together, the long one alone


def test_the_load_gate_explores_ever_more_rarely_while_drafting_loses_and_drafts_again_when_it_wins():
    """On a table where a token costs its full time (16 rows x 4 nodes cost 4x a plain round), drafting at tau 1.5
    loses: the rounds are plain except explorations 8, 16, 32 and then 64 rounds apart. Once the rounds it drafts
    yield enough (tau 6), it drafts every round again."""
    gate = LoadGate(VerifyLatency({0: {1: 0.001, 256: 0.256}}), decay=0.0)
    gate.update(1.5, 4.0)
    drafted = []
    for round_ in range(1, 250):
        if gate.draft(16, 0):
            drafted.append(round_)
            gate.update(1.5, 4.0)
    assert drafted == [8, 24, 56, 120, 184, 248]
    gate.update(6.0, 4.0)
    assert all(gate.draft(16, 0) for _ in range(5))
    gate.update(1.5, 4.0)  # losing again: the explorations start 8 rounds apart
    assert [gate.draft(16, 0) for _ in range(8)] == [False] * 7 + [True]


def test_the_rows_module_passes_run_together_and_draft_what_each_row_drafts_alone():
    """propose_rows: three EAGLE-3 rows (prompts of different lengths, one with accepted positions still to learn)
    draft in one module call a step (the catch-up, then a tree level) instead of one a row, and each row's tree is the
    one it drafts alone (fp32), its module cache left as alone."""
    model = tiny_model("llama", seed=6)
    heads = random_eagle3(model, seed=2, scale=0.5)
    tree = DynamicTreeConfig(nodes=40, topk=3, depth=4, min_mass=0.0)
    prompts = [p[0] for p, _ in random_prompts(3, model.config.vocab_size, seed=9)]
    prompts = [prompts[0][:5], prompts[1], torch.cat([prompts[2], prompts[0]])]

    def started():
        drafters = []
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                out = model(ids[None], output_hidden_states=True)
            hidden = backbone_features(out.hidden_states, heads.feature_layers)[0]
            drafter = heads.drafter(model, tree)
            cut = len(ids) - 2 if i == 1 else len(ids)
            drafter.start(Prefill(input_ids=ids[:cut], hidden=hidden[:cut], root=7 + i))
            if i == 1:  # two accepted positions for the next proposal to learn first (its catch-up pass)
                drafter.observe(Outcome(draft=None, nodes=None, tokens=[], hidden=hidden[-2:], emitted=[], path=[],
                                        token_ids=torch.tensor([4, 9])))
            drafters.append(drafter)
        return drafters

    alone, together = started(), started()
    calls, expected = [], []
    step = heads.step
    heads.step = lambda prev, *args, **kw: calls.append(prev.shape[0]) or step(prev, *args, **kw)
    with torch.no_grad():
        solo = []
        for d in alone:
            calls[:] = []
            expected.append(d.propose(9, 5))
            solo.append(len(calls))
        calls[:] = []
        drafts = propose_rows(together, [9, 9, 9], [5, 5, 5])
    # one call a step for the rows still drafting: as many calls as the longest row's own, each row in as many
    assert len(calls) == max(solo) > min(solo) and calls == [sum(n > k for n in solo) for k in range(max(solo))]
    for mine, want, a, b in zip(drafts, expected, together, alone):
        assert mine.tokens.tolist() == want.tokens.tolist()
        assert torch.equal(mine.buffers.retrieve, want.buffers.retrieve)
        assert torch.allclose(mine.values, want.values, atol=1e-5)
        assert a.cached == b.cached and a.cache.get_seq_length() == b.cache.get_seq_length()
        assert torch.allclose(a.cache.layers[0].keys, b.cache.layers[0].keys, atol=1e-5)


def test_the_node_budget_follows_the_load():
    """On a latency table flat to 16 tokens and linear past it, one row keeps its whole tree while sixteen rows
    verify each row's root alone (plain batched decoding): a node would cost what sixteen tokens cost."""
    latency = VerifyLatency({0: {1: 1.0, 8: 1.05, 16: 1.1, 32: 2.2, 64: 4.4, 128: 8.8, 256: 17.6}})
    assert latency.at(0, rows=16)[1] == pytest.approx(1.1) and latency.at(0, rows=16)[2] == pytest.approx(2.2)
    model = tiny_model("llama", seed=1)
    prompts = [p[0] for p, _ in random_prompts(16, model.config.vocab_size, seed=5)]
    refs = [greedy_reference(model, p[None], 12) for p in prompts]
    tree = DynamicTreeConfig(nodes=8, topk=2, depth=3)

    def run(rows):
        drafters = [make_drafter("heads", model, OracleMTP(model, refs[i], p_top=1.0, seed=i),
                                 DraftSettings(tree=tree, costs=Costs(latency=latency))) for i in range(rows)]
        with torch.no_grad():
            ids, mask = _left_padded(prompts[:rows])
            tokens, stats = decode(model, drafters, ids, [12] * rows, accept_greedy, greedy_root, set(),
                                   attention_mask=mask)
        for i in range(rows):
            assert tokens[i] == refs[i][0, len(prompts[i]):].tolist()
        return max(r.mean_tau for r in stats.rows)

    assert run(1) > 2.5  # alone: the tree pays
    assert run(16) == 1.0  # sixteen rows: no node pays, speculation is off


def test_bad_batches_are_refused_with_the_row_named(monkeypatch):
    model = tiny_model()
    gen = SpeculativeGenerator(model, None, draft="lookup")
    with pytest.raises(ValueError, match=r"row 1 of the batch: the prompt is empty"):
        gen.generate([[5, 6], []])
    with pytest.raises(ValueError, match=r"a batch mixes prompt types \(row 0 is ids, row 1 is text\)"):
        gen.generate([[5, 6], "text"])
    with pytest.raises(ValueError, match="row 1 of the batch is empty: its attention_mask marks no token"):
        gen.generate(torch.tensor([[5, 6], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match=r"row 0: prompt \(2 tokens\) \+ max_new_tokens \(300\)"):
        gen.generate([[5, 6], [7, 8]], max_new_tokens=[300, 3])
    with pytest.raises(ValueError, match="a streamer takes one prompt; this call has a batch of 2"):
        gen.generate([[5, 6], [7, 8]], streamer=object())
    with pytest.raises(ValueError, match="max_new_tokens lists 1 values for a batch of 2 rows"):
        gen.generate([[5, 6], [7, 8]], max_new_tokens=[3])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        gen.generate(torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.tensor([[1, 1, 1]]))
    monkeypatch.setattr(generator_module, "free_memory", lambda device: 1 << 16)  # 64 KiB free
    calls = []
    monkeypatch.setattr(generator_module, "decode", lambda *a, **k: calls.append(1))
    with pytest.raises(MemoryError, match=r"a batch of 2 rows of up to 12 positions needs about 6\d\d\.\d KiB \(KV "
                                          r"cache .* are free on cpu: use fewer rows"):
        gen.generate([[5, 6], [7, 8]], max_new_tokens=10)
    assert calls == []  # refused before the prefill


def test_a_captured_batch_drafts_each_row_as_that_row_drafts_alone(monkeypatch):
    """Captured module passes run a batch's rows one by one at fixed shapes; each row drafts over its own slot's module
    cache, so its trees are those it drafts alone (a shared cache would let one row's passes write over another's
    entries: the output stays greedy's, the trees and tau do not)."""
    monkeypatch.setattr(runner.torch, "compile", lambda fn, **kw: fn)  # (the captured path, uncompiled)
    trees: list[list[list[int]]] = []
    real = loop.verify
    monkeypatch.setattr(loop, "verify", lambda model_, kv, drafts, *a: trees.append(
        [d.tokens.tolist() for d in drafts]) or real(model_, kv, drafts, *a))
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, random_eagle3(model, scale=0.3), draft="heads", cache="static", capture=True,
                               tree="dynamic:nodes=8,topk=4,min_mass=0")
    prompts = [p[0].tolist() for p, _ in random_prompts(3, model.config.vocab_size, seed=6)]
    gen.generate(prompts, max_new_tokens=20)
    together = [t for t in trees if len(t) == len(prompts)]  # the rounds before any row finished
    assert len(together) >= 3
    for i, prompt in enumerate(prompts):
        trees.clear()
        gen.generate(prompt, max_new_tokens=20)
        assert [t[0] for t in trees[: len(together)]] == [t[i] for t in together], i


def test_a_static_cache_is_counted_at_the_size_it_is_allocated(monkeypatch):
    """The memory check of a batch counts a static cache at the positions it is allocated with (a power of two, at
    least ``kv.MIN_STATIC``), not at what the rows need: 1 MiB free holds two rows of 12 positions on a growing cache,
    not on a static one."""
    monkeypatch.setattr(generator_module, "free_memory", lambda device: 1 << 20)
    monkeypatch.setattr(generator_module, "decode", lambda *a, **k: 1 / 0)
    model = tiny_model()
    with pytest.raises(ZeroDivisionError):  # (past the check: the stand-in decode)
        SpeculativeGenerator(model, None, draft="lookup").generate([[5, 6], [7, 8]], max_new_tokens=10)
    with pytest.raises(MemoryError, match=r"KV cache 512\.0 KiB"):
        SpeculativeGenerator(model, None, draft="lookup", cache="static").generate([[5, 6], [7, 8]], max_new_tokens=10)


def _batch_pvalue(monkeypatch, broken: bool, calls: int = 30, rows: int = 50):
    """Rows of two prompts of different lengths in each batch; the 2nd and 3rd new tokens of the first prompt's rows
    against the exact distribution of plain sampling."""
    model = tiny_model("llama", seed=11, vocab_size=16)
    model.generation_config.eos_token_id = None
    if broken:
        monkeypatch.setattr(generator_module, "accept_sampling", broken_accept)
    gen = SpeculativeGenerator(model, random_heads(model, seed=3), draft="hybrid")
    warpers = build_warpers(GenerationConfig(do_sample=True, temperature=1.0))
    prefix = [3, 4, 5, 3, 4]  # repeats: lookup branches too
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prefix])).logits[0, -1], warpers)
    exact = sum(p1[a] * exact_pair(model, torch.tensor(prefix + [a]), warpers) for a in range(vocab))
    counts = torch.zeros(vocab * vocab)
    for seed in range(calls):
        out = gen.generate([prefix if i % 2 == 0 else [7, 8, 9] for i in range(rows)], max_new_tokens=3,
                           do_sample=True, temperature=1.0, seed=seed)
        for row in out.rows[::2]:
            counts[row.new_tokens[1] * vocab + row.new_tokens[2]] += 1
    return chi2_pvalue(counts, exact.flatten())


@pytest.mark.slow
def test_each_row_samples_from_its_own_distribution(monkeypatch):
    assert _batch_pvalue(monkeypatch, broken=False) > 1e-3


@pytest.mark.slow
def test_the_batch_distribution_test_has_teeth(monkeypatch):
    assert _batch_pvalue(monkeypatch, broken=True) < 1e-3


def test_a_greedy_batch_round_reads_once():
    """Every row greedy: the batch's acceptance is one read for all rows (static-tree drafters, which read nothing
    themselves; the rows' trees still reach the device as each drafter built them)."""
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    heads = random_heads(model)
    prompts = [p[0] for p, _ in random_prompts(4, model.config.vocab_size, seed=3)]
    drafters = [heads.drafter(model) for _ in prompts]
    traffic = HostTraffic()
    for drafter in drafters[:1]:  # one row marks the start of each round
        propose = drafter.propose
        drafter.propose = lambda root, room, _p=propose: (traffic.mark(), _p(root, room))[1]
    with traffic, torch.no_grad():
        ids, mask = _left_padded(prompts)
        tokens, stats = decode(model, drafters, ids, [24] * 4, accept_greedy, greedy_root, set(), attention_mask=mask)
    rounds = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(traffic.marks, traffic.marks[1:])][1:-4]
    assert len(rounds) >= 5 and max(r for r, _ in rounds) == 1, rounds
    for i, p in enumerate(prompts):
        assert tokens[i] == greedy_reference(model, p[None], 24)[0, len(p):].tolist()


def test_one_prompt_and_a_batch_of_one_run_the_same_round(monkeypatch):
    """``generate(p)`` and ``generate([p])`` go through the one loop (``loop.decode``, a batch of one row) and give the
    same tokens and the same statistics, timings included; a batch's rows are timed too."""
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, random_eagle3(model, scale=0.05), draft="hybrid",
                               costs=Costs(latency=VerifyLatency({0: {1: 0.01, 64: 0.02}}), propose_seconds=0.001))
    rows, real = [], loop.decode
    monkeypatch.setattr(generator_module, "decode", lambda model_, drafters, ids, *a, **k: rows.append(
        ids.shape[0]) or real(model_, drafters, ids, *a, **k))
    prompt = next(random_prompts(1, model.config.vocab_size, seed=4))[0][0].tolist()
    one, many = gen.generate(prompt, max_new_tokens=30), gen.generate([prompt], max_new_tokens=30)
    assert rows == [1, 1]
    assert one.new_tokens == many.rows[0].new_tokens and one.sequences.tolist() == [_alone(model, prompt, 30)]
    a, b = one.stats.to_dict(), many.rows[0].stats.to_dict()
    timings = ("prefill_seconds", "decode_seconds", "wall_seconds", "tokens_per_s", "phase_seconds")
    assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}
    assert all(a[k] and b[k] for k in timings) and a["phase_seconds"].keys() == b["phase_seconds"].keys()
    batch = gen.generate([prompt, prompt[:3]], max_new_tokens=[30, 5])
    assert all(row.stats.decode_seconds > 0 and row.stats.phase_seconds["verify"] > 0 for row in batch.rows)
    assert batch.rows[1].stats.decode_seconds < batch.rows[0].stats.decode_seconds  # (it finished first)


@pytest.mark.parametrize("rows", [1, 4])
def test_batches_verify_on_the_static_cache_through_captured_calls(monkeypatch, rows):
    """A generator that captures its rounds (static cache, compiled calls: an accelerator's default) does so for a
    batch as for one prompt: the cache is a ``StaticKV``, every verify and every module pass goes through the captured
    call (the stand-in compiles nothing: it counts), rows that finish early stay as padding rows, and every row is
    greedy's."""
    calls: dict[str, int] = {}

    def standin(fn, **kwargs):
        def run(*args, **kw):
            calls[fn.__qualname__] = calls.get(fn.__qualname__, 0) + 1
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(runner.torch, "compile", standin)
    opened, real = [], loop.open_kv
    monkeypatch.setattr(loop, "open_kv", lambda *a, **k: opened.append(real(*a, **k)) or opened[-1])
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, random_eagle3(model, scale=0.05), draft="hybrid", cache="static", capture=True)
    prompts = [p[0].tolist() for p, _ in random_prompts(rows, model.config.vocab_size, seed=3)]
    news = [12, 5, 9, 12][:rows]
    out = gen.generate(prompts if rows > 1 else prompts[0], max_new_tokens=news if rows > 1 else news[0])
    for i, row in enumerate(out.rows if rows > 1 else [out]):
        assert row.sequences.tolist() == [_alone(model, prompts[i], news[i])], i
    forwards = out.stats.forwards if rows > 1 else out.stats.steps
    assert len(opened) == 1 and isinstance(opened[0], StaticKV) and opened[0].rows == rows
    assert calls["LlamaForCausalLM.forward"] == forwards and calls["Eagle3Heads.step"] > 0, calls
