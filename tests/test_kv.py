"""The KV caches (inference/kv.py): on the static one padded trees verify as the unpadded ones, commits land in
place, and a generation on it (eager, or captured through torch.compile: inference/runner.py) is the backbone's
greedy output in fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import (OracleMTP, assert_matches_greedy, decode_one, greedy_reference, prefilled, random_eagle3,
                     random_heads, random_prompts, repeating_prompts, tiny_model, tree_draft)

from tokenmaxx.heads import Tree
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.inference import loop
from tokenmaxx.inference import runner as capture_module
from tokenmaxx.inference.decoding import accept_greedy, commit, verify
from tokenmaxx.inference.kv import BUCKETS, StaticKV, bucket, open_kv, static_cache
from tokenmaxx.inference.runner import CaptureFallbackWarning, Runner

TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # 8 nodes: padded to 8; 7-node cut to 8 too


def test_buckets():
    assert [bucket(n, BUCKETS) for n in (1, 2, 3, 8, 9, 100, 256, 257, 600)] == [1, 2, 4, 8, 16, 128, 256, 512, 768]
    assert bucket(5, (4, 6)) == 6 and bucket(7, (4, 6)) == 12
    with pytest.raises(ValueError, match="increasing positive"):
        StaticKV(1, static_cache(tiny_model().config, 1, 64, torch.float32, "cpu"), buckets=(8, 4))


def _static(model, length, buckets=BUCKETS):
    return StaticKV(1, static_cache(model.config, 1, length, model.dtype, model.device), buckets)


@pytest.mark.parametrize("tree", [TREE, Tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])], ids=["full", "padded"])
def test_a_padded_tree_on_the_static_cache_verifies_as_on_the_dynamic_one(tree):
    model = tiny_model("llama", seed=2)
    prefix = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, 96, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dynamic = verify(model, prefilled(model, prefix), [tree_draft(tokens, tree.buffers)])
        kv = prefilled(model, prefix, _static(model, 64, buckets=(4, 8)))
        static = verify(model, kv, [tree_draft(tokens, tree.buffers)])
    assert static.logits.shape == dynamic.logits.shape == (1, tree.num_nodes, 96)
    torch.testing.assert_close(static.logits, dynamic.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static.hidden, dynamic.hidden, atol=1e-5, rtol=1e-5)


def test_a_commit_on_the_static_cache_leaves_what_a_plain_prefill_of_the_path_leaves():
    model = tiny_model("llama", seed=2)
    prefix = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(3, 96, (TREE.num_nodes,), generator=torch.Generator().manual_seed(4))
    # (nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0, 0), 5 (0, 1), 6 (1, 0), 7 (0, 0, 0))
    for path in ([0, 1, 4, 7], [0, 2, 6], [0, 1], [0]):  # gathers, a chain prefix in place, the root alone
        with torch.no_grad():
            kv = prefilled(model, prefix, _static(model, 48))
            verify(model, kv, [tree_draft(tokens, TREE.buffers)])
            nodes = torch.tensor(path)
            kv.commit([path], [nodes])
            keep = kv.end
            plain = prefilled(model, torch.cat([prefix[0], tokens[nodes]])[None]).cache
        assert keep == prefix.shape[1] + len(path) == plain.get_seq_length()
        for layer, ref in zip(kv.cache.layers, plain.layers):
            torch.testing.assert_close(layer.keys[:, :, :keep], ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[:, :, :keep], ref.values, atol=1e-5, rtol=1e-5)
            assert int(layer.cumulative_length) == keep  # the next verify writes right after the path


def test_a_tree_past_the_static_cache_is_refused():
    model = tiny_model()
    kv = prefilled(model, torch.tensor([[5, 6, 7]]), _static(model, 8))
    with pytest.raises(ValueError, match="a verify of 8 nodes after 3 positions overruns the static cache of 8"):
        verify(model, kv, [tree_draft(torch.arange(3, 8), Tree([(0,), (1,), (2,), (3,)]).buffers)])


@pytest.mark.usefixtures("on_cpu")  # (the defaults asserted are a CPU's)
def test_cache_settings_are_checked():
    with pytest.raises(ValueError, match="cache must be one of"):
        open_kv(tiny_model(), "paged", 1, 64)
    with pytest.raises(ValueError, match="a captured verify needs cache='static'"):
        open_kv(tiny_model(), "dynamic", 1, 64, captured=True)
    model = tiny_model()
    with pytest.raises(ValueError, match="cache must be 'auto' or one of"):
        SpeculativeGenerator(model, None, draft="lookup", cache="paged")
    gen = SpeculativeGenerator(model, None, draft="lookup")
    assert (gen.cache, gen.capture) == ("dynamic", False)  # "auto" on a CPU


@pytest.mark.parametrize("draft,kind", [("heads", "eagle3"), ("hybrid", "eagle3"), ("lookup", None),
                                        ("hybrid", "medusa")])
def test_generation_on_the_static_cache_matches_greedy(draft, kind):
    model = tiny_model("llama", seed=3)
    heads = {"eagle3": lambda: random_eagle3(model, scale=0.05), "medusa": lambda: random_heads(model),
             None: lambda: None}[kind]()
    gen = SpeculativeGenerator(model, heads, draft=draft, cache="static")
    assert gen.cache == "static"  # (captured on an accelerator; the fast tier runs it uncompiled there)
    assert_matches_greedy(gen, model, 6, seed=4)
    for prompt, new in repeating_prompts(model.config.vocab_size, seed=5, n=3):  # lookup branches accepted
        out = gen.generate(prompt, max_new_tokens=new)
        assert out.sequences.tolist() == greedy_reference(model, prompt, new).tolist()


def _oracle_run(model, runner: Runner, n=3):
    """Rigged sequential heads (long paths through side branches: gathers in every commit) on the static cache, run
    by ``runner`` (its verifies and the heads' passes captured or not); returns whether each output is greedy's, and
    the mean tau."""
    same, taus = [], []
    for i, (prompt, _) in enumerate(random_prompts(n, model.config.vocab_size, seed=5)):
        reference = greedy_reference(model, prompt, 40)
        drafter = OracleMTP(model, reference, p_top=0.6, seed=i).drafter(
            model, DynamicTreeConfig(nodes=16, topk=3, depth=4, min_mass=0.2))
        drafter.passes = runner.passes()
        with torch.no_grad():
            tokens, stats = decode_one(model, drafter, prompt, 30, runner=runner, cache="static")
        same.append(tokens == reference[0, prompt.shape[1]:][:len(tokens)].tolist())
        taus.append(stats.mean_tau)
    return same, sum(taus) / len(taus)


def test_long_accepted_paths_commit_in_place_on_the_static_cache():
    same, tau = _oracle_run(tiny_model("llama", seed=1), Runner())
    assert all(same) and tau > 3.0, (same, tau)


def test_a_forward_that_cannot_be_captured_runs_eagerly_and_says_so(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args, **kwargs):
            raise RuntimeError("no compiler here\nsecond line")
        return run

    model = tiny_model("llama", seed=1)
    monkeypatch.setattr(capture_module.torch, "compile", broken_compile)
    monkeypatch.setattr(capture_module, "MODULE_CACHE", 8)  # the preallocated module cache grows (twice) on the way
    with pytest.warns(CaptureFallbackWarning) as caught:
        same, tau = _oracle_run(model, Runner(capture=True), n=2)
    assert all(same) and tau > 3.0
    said = sorted({str(w.message) for w in caught if w.category is CaptureFallbackWarning})
    assert said == [f"capturing {name} failed (RuntimeError: no compiler here); running it eagerly"
                    for name in ("LlamaForCausalLM.forward", "OracleMTP.step")], said


@pytest.mark.capture  # (on an accelerator too: its own compile, on the eager backend)
def test_captured_calls_compile_a_graph_per_bucket_in_the_first_generation_and_none_after(monkeypatch, request):
    """The shapes a captured generation meets are few and fixed: the verify at its buckets, the module's pass at one
    padded width whatever the frontier's width, the accepted path's length or the prompt's. So the first generation
    compiles every graph, and prompts of other lengths, lookup branches and long rigged paths compile nothing more
    (counted by dynamo's own compile counter on its eager backend: what matters here is which shapes are traced, not
    the code inductor would make of them). Output is greedy's throughout."""
    from torch._dynamo.testing import CompileCounter

    counters: dict[str, CompileCounter] = {}
    real = torch.compile

    def counting_compile(fn, **kwargs):
        return real(fn, backend=counters.setdefault(fn.__qualname__, CompileCounter()), dynamic=False)

    monkeypatch.setattr(capture_module.torch, "compile", counting_compile)
    torch._dynamo.reset()  # (dynamo would reuse graphs an earlier test compiled from the same code, uncounted)
    request.addfinalizer(torch._dynamo.reset)  # (nor leave its own to later tests)
    model = tiny_model("llama", seed=3)
    gen = SpeculativeGenerator(model, random_eagle3(model, scale=0.05), draft="hybrid", cache="static", capture=True)
    compiled = []
    for prompt, new in [*random_prompts(3, model.config.vocab_size, seed=4),
                        *repeating_prompts(model.config.vocab_size, seed=5, n=3)]:
        out = gen.generate(prompt, max_new_tokens=new)
        assert out.sequences.tolist() == greedy_reference(model, prompt, new).tolist()
        compiled.append({name: counter.frame_count for name, counter in counters.items()})
    assert compiled[-1] == compiled[0], compiled
    assert compiled[0]["Eagle3Heads.step"] == 1 and 1 <= compiled[0]["LlamaForCausalLM.forward"] <= 2, compiled
    # rigged heads: accepted paths of every length, each catching the module up by its length
    seen = dict(counters)
    same, tau = _oracle_run(tiny_model("llama", seed=1), Runner(capture=True), n=3)
    assert all(same) and tau > 3.0
    assert {name: c.frame_count for name, c in counters.items() if name not in seen} == {"OracleMTP.step": 1}


def test_the_capture_backend_is_chosen_by_setting_or_environment_and_checked(monkeypatch):
    """Captured calls compile with inductor in "reduce-overhead" mode by default, with CUDA graphs of the eager
    kernels under "cudagraphs" (set in code or by TOKENMAXX_CAPTURE_BACKEND); a call keeps a compiled version per
    backend; an unknown name is refused, naming the choices."""
    seen = []
    monkeypatch.setattr(capture_module.torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    monkeypatch.delenv("TOKENMAXX_CAPTURE_BACKEND", raising=False)
    module, x = torch.nn.Linear(2, 2), torch.ones(1, 2)
    try:
        capture_module.captured(module, "forward", module.forward, x)
        monkeypatch.setenv("TOKENMAXX_CAPTURE_BACKEND", "cudagraphs")
        capture_module.captured(module, "forward", module.forward, x)
        capture_module.captured(module, "forward", module.forward, x)  # (compiled once per backend)
        capture_module.set_capture_backend("inductor")  # the setting before the environment
        assert capture_module.capture_backend() == "inductor"
        with pytest.raises(ValueError, match=r"capture backend must be one of \['cudagraphs', 'inductor'\], got 'trt'"):
            capture_module.set_capture_backend("trt")
        capture_module.set_capture_backend(None)
        monkeypatch.setenv("TOKENMAXX_CAPTURE_BACKEND", "trt")
        with pytest.raises(ValueError, match="TOKENMAXX_CAPTURE_BACKEND must be one of"):
            capture_module.captured(module, "forward", module.forward, x)
    finally:
        capture_module.set_capture_backend(None)
    assert [kw.get("backend") for kw in seen] == ["inductor", "cudagraphs"]
    assert seen[0]["mode"] == "reduce-overhead" and "mode" not in seen[1] and not seen[0]["dynamic"]


def test_a_captured_module_cache_is_kept_across_generations_and_grows_in_place_of_the_old():
    """Captured passes of one heads module in one thread use one preallocated module cache, whichever generation or
    generator drafts (its addresses are in the recorded graphs); a generation that needs more entries replaces it with
    a larger one holding the old one's entries, which later passes keep."""
    model = tiny_model("llama", seed=3)
    heads = random_eagle3(model, scale=0.05)
    passes = capture_module.CapturedPasses()
    first = passes._cache(heads, torch.device("cpu"), 10)
    assert passes._cache(heads, torch.device("cpu"), 100) is first
    keys = first.layers[0].keys
    gens = [SpeculativeGenerator(model, heads, draft=d, cache="static", capture=True) for d in ("heads", "hybrid")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture_module.torch, "compile", lambda fn, **kw: fn)
        for gen in gens:
            prompt, new = next(iter(random_prompts(1, model.config.vocab_size, seed=4)))
            assert gen.generate(prompt, max_new_tokens=new).sequences.tolist() == \
                greedy_reference(model, prompt, new).tolist()
        assert passes._cache(heads, torch.device("cpu"), 10).layers[0].keys is keys
        grown = passes._cache(heads, torch.device("cpu"), capture_module.MODULE_CACHE + 1)
        assert grown.layers[0].max_cache_len == 2 * capture_module.MODULE_CACHE
        assert torch.equal(grown.layers[0].keys[:, :, : capture_module.MODULE_CACHE], keys)
        assert passes._cache(heads, torch.device("cpu"), 10) is grown


class ReplayedOutputs:
    """A stand-in for ``torch.compile(mode="reduce-overhead")`` with what CUDA graph replays do to outputs: a call's
    outputs live in the graphs' memory pool, and the next captured call (any of them: ``runner.captured`` marks a
    new step each time) overwrites them (on a GPU, reading one then raises). Here they are filled with NaN, so a
    round that keeps one past the next call reads garbage where the GPU would stop."""

    def __init__(self):
        self.live: list[torch.Tensor] = []

    def compile(self, fn, **kwargs):
        def replay(*args, **kw):  # (inputs are read after the overwrite, as a replay copies them in)
            for tensor in self.live:
                tensor.fill_(float("nan"))
            out = fn(*args, **kw)
            self.live = [t for t in torch.utils._pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.is_floating_point()]
            return out
        return replay


@pytest.mark.parametrize("draft", ["hybrid", "heads", "medusa"])
def test_no_output_of_a_captured_call_is_read_after_the_next_one(monkeypatch, draft):
    """Captured passes drafting and verifying as on a GPU, each call's outputs overwritten by the next call: every
    round drafts the tree the same captured rounds draft with their outputs left alone (a kept output read after
    another call, such as the module state of the newest anchor, would change it), and the tokens are greedy's."""
    replayed, overwriting = ReplayedOutputs(), [True]
    monkeypatch.setattr(capture_module.torch, "compile",
                        lambda fn, **kw: (lambda *a, **k: replayed.compile(fn)(*a, **k) if overwriting[0]
                                          else fn(*a, **k)))
    drafted: list[list[int]] = []

    def recording_verify(model, kv, drafts, *args):
        drafted.append([d.tokens.tolist() for d in drafts])
        return verify(model, kv, drafts, *args)

    monkeypatch.setattr(loop, "verify", recording_verify)
    model = tiny_model("llama", seed=3)
    heads = random_heads(model, seed=1) if draft == "medusa" else random_eagle3(model, scale=0.3)
    tree = None if draft == "medusa" else "dynamic:nodes=16,topk=4,min_mass=0"  # every level a pass
    make = lambda **kw: SpeculativeGenerator(model, heads, draft="heads" if draft == "medusa" else draft,
                                             cache="static", tree=tree, **kw)
    gen = make(capture=True)
    for prompt, new in [*random_prompts(2, model.config.vocab_size, seed=4),
                        *repeating_prompts(model.config.vocab_size, seed=5, n=2)]:
        drafted.clear()
        overwriting[0] = True
        out = gen.generate(prompt, max_new_tokens=new)
        trees = list(drafted)
        drafted.clear()
        overwriting[0] = False  # the same captured shapes, outputs left alone
        gen.generate(prompt, max_new_tokens=new)
        assert trees == drafted
        assert out.sequences.tolist() == greedy_reference(model, prompt, new).tolist()
    assert replayed.live  # (the stand-in ran)


@pytest.mark.slow
@pytest.mark.capture
def test_captured_rounds_match_greedy():
    """torch.compile(mode="reduce-overhead") on the CPU: inductor compiles the verify forward per bucket and the
    EAGLE-3 module's pass per width (CUDA graphs are a GPU's addition); output identical in fp32, nothing fell
    back."""
    import warnings

    model = tiny_model("llama", seed=3)
    gen = SpeculativeGenerator(model, random_eagle3(model, scale=0.05), draft="hybrid", cache="static", capture=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)
        assert_matches_greedy(gen, model, 2, seed=4)
        for prompt, new in repeating_prompts(model.config.vocab_size, seed=5, n=1):
            assert gen.generate(prompt, max_new_tokens=new).sequences.tolist() == \
                greedy_reference(model, prompt, new).tolist()


def test_a_static_cache_is_reused_while_it_fits():
    model, other = tiny_model(max_position_embeddings=8192), tiny_model(seed=1, max_position_embeddings=8192)
    first = open_kv(model, "static", 1, 300).cache
    assert first.layers[0].max_cache_len == 1024 and open_kv(model, "static", 1, 1024).cache is first  # one shape
    assert open_kv(model, "static", 1, 500).cache is first  # another generator's generation too (one per thread)
    assert open_kv(other, "static", 1, 10).cache is not first  # another backbone's
    assert open_kv(model, "static", 4, 10).cache.layers[0].keys.shape[0] == 4  # another batch size, beside it:
    assert open_kv(model, "static", 1, 10).cache is first  # one prompt and batches taking turns keep their caches
    assert open_kv(model, "static", 1, 1025).cache.layers[0].max_cache_len == 2048
    length = lambda positions: open_kv(model, "static", 1, positions, captured=True).cache.layers[0].max_cache_len
    assert length(300) == length(4000) == 4096  # each length is a graph per bucket: fewer lengths
    assert length(4097) == 8192
    short = tiny_model()  # no longer than its context needs, as a power of two
    assert short.config.max_position_embeddings == 256
    assert open_kv(short, "static", 1, 300, captured=True).cache.layers[0].max_cache_len == 512


def test_rows_that_finish_stay_in_a_static_cache_as_padding_and_leave_a_growing_one():
    """Rows of one generation commit paths of different lengths (holes in the shorter rows), then one row finishes:
    a growing cache drops it, a static one keeps it as a padding row (the verify's shape stays); either way the next
    verify of the remaining row computes what a plain forward of that row's path computes."""
    model = tiny_model("llama", seed=2)
    prefix = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(3, 96, (2, TREE.num_nodes), generator=torch.Generator().manual_seed(6))
    nxt = torch.randint(3, 96, (3,), generator=torch.Generator().manual_seed(7))
    paths = [[0, 1, 4, 7], [0, 3]]
    for kv in (open_kv(model, "dynamic", 2, 64),
               StaticKV(2, static_cache(model.config, 2, 64, model.dtype, model.device))):
        with torch.no_grad():
            kv.prefill(model, prefix, torch.ones_like(prefix, dtype=torch.bool), [[0, 1]], None)
            verify(model, kv, [tree_draft(tokens[i], TREE.buffers) for i in range(2)])
            kv.commit(paths, [torch.tensor(p) for p in paths])
            assert kv.ends == [10, 8] and kv.live[1].tolist() == [True] * 8 + [False] * 2  # a hole
            kv.drop([1])
            assert kv.cache_rows == (2 if isinstance(kv, StaticKV) else 1)
            chain = Tree([(0,), (0, 0)])
            got = verify(model, kv, [tree_draft(nxt, chain.buffers)]).logits[0]
            seq = torch.cat([prefix[1], tokens[1, paths[1]], nxt])[None]
            ref = model(seq).logits[0, -3:]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
