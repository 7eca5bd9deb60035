"""The static KV cache (inference/kv.py): padded trees verify as the unpadded ones, commits land in place, and a
generation on it (eager, or captured through torch.compile) is the backbone's greedy output in fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import (OracleMTP, assert_matches_greedy, greedy_reference, random_eagle3, random_heads, random_prompts,
                     repeating_prompts, tiny_model)
from transformers import DynamicCache

from tokenmaxx.heads import Tree
from tokenmaxx.heads.dynamic_tree import DynamicTreeConfig
from tokenmaxx.inference import SpeculativeGenerator
from tokenmaxx.heads import capture as capture_module
from tokenmaxx.heads import sequential
from tokenmaxx.inference import loop
from tokenmaxx.inference.decoding import accept_greedy, commit, verify
from tokenmaxx.inference.forward import CaptureFallbackWarning, ForwardContext
from tokenmaxx.inference.kv import BUCKETS, StaticKV, bucket
from tokenmaxx.inference.loop import eos_ids, greedy_root, speculative_decode

TREE = Tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # 8 nodes: padded to 8; 7-node cut to 8 too


def test_buckets():
    assert [bucket(n, BUCKETS) for n in (1, 2, 3, 8, 9, 100, 256, 257, 600)] == [1, 2, 4, 8, 16, 128, 256, 512, 768]
    assert bucket(5, (4, 6)) == 6 and bucket(7, (4, 6)) == 12
    with pytest.raises(ValueError, match="increasing positive"):
        StaticKV(tiny_model(), 64, buckets=(8, 4))


def _prefilled(model, prefix, kv=None):
    cache = kv if kv is not None else DynamicCache(config=model.config)
    inputs = kv.prefill_inputs() if kv is not None else {"past_key_values": cache}
    model(input_ids=prefix, use_cache=True, **inputs)
    if kv is not None:
        kv.write_at(prefix.shape[1])
    return cache


@pytest.mark.parametrize("tree", [TREE, Tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])], ids=["full", "padded"])
def test_a_padded_tree_on_the_static_cache_verifies_as_on_the_dynamic_one(tree):
    model = tiny_model("llama", seed=2)
    prefix = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, 96, (tree.num_nodes,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dynamic = verify(model, _prefilled(model, prefix), tokens, tree.buffers, prefix.shape[1])
        kv = _prefilled(model, prefix, StaticKV(model, 64, buckets=(4, 8)))
        static = verify(model, kv, tokens, tree.buffers, prefix.shape[1])
    assert static.logits.shape == dynamic.logits.shape == (tree.num_nodes, 96)
    torch.testing.assert_close(static.logits, dynamic.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static.hidden, dynamic.hidden, atol=1e-5, rtol=1e-5)


def test_a_commit_on_the_static_cache_leaves_what_a_plain_prefill_of_the_path_leaves():
    model = tiny_model("llama", seed=2)
    prefix = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(3, 96, (TREE.num_nodes,), generator=torch.Generator().manual_seed(4))
    # (nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0, 0), 5 (0, 1), 6 (1, 0), 7 (0, 0, 0))
    for path in ([0, 1, 4, 7], [0, 2, 6], [0, 1], [0]):  # gathers, a chain prefix in place, the root alone
        with torch.no_grad():
            kv = _prefilled(model, prefix, StaticKV(model, 48))
            verify(model, kv, tokens, TREE.buffers, prefix.shape[1])
            nodes = torch.tensor(path)
            keep = commit(kv, prefix.shape[1], nodes, path)
            plain = _prefilled(model, torch.cat([prefix[0], tokens[nodes]])[None])
        assert keep == prefix.shape[1] + len(path) == plain.get_seq_length()
        for layer, ref in zip(kv.cache.layers, plain.layers):
            torch.testing.assert_close(layer.keys[:, :, :keep], ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[:, :, :keep], ref.values, atol=1e-5, rtol=1e-5)
            assert int(layer.cumulative_length) == keep  # the next verify writes right after the path


def test_a_tree_past_the_static_cache_is_refused():
    model = tiny_model()
    kv = _prefilled(model, torch.tensor([[5, 6, 7]]), StaticKV(model, 8))
    with pytest.raises(ValueError, match="verified as 8.*overruns the static cache of 8"):
        verify(model, kv, torch.arange(3, 8), Tree([(0,), (1,), (2,), (3,)]).buffers, 3)


@pytest.mark.usefixtures("on_cpu")  # (the defaults asserted are a CPU's)
def test_forward_context_settings_are_checked():
    with pytest.raises(ValueError, match="cache must be one of"):
        ForwardContext(cache="paged")
    with pytest.raises(ValueError, match="capture=True needs cache='static'"):
        ForwardContext(capture=True)
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
    assert gen.forward.cache == "static"  # (captured on an accelerator; the fast tier runs it uncompiled there)
    assert_matches_greedy(gen, model, 6, seed=4)
    for prompt, new in repeating_prompts(model.config.vocab_size, seed=5, n=3):  # lookup branches accepted
        out = gen.generate(prompt, max_new_tokens=new)
        assert out.sequences.tolist() == greedy_reference(model, prompt, new).tolist()


def _oracle_run(model, forward, n=3, capture=False):
    """Rigged sequential heads (long paths through side branches: gathers in every commit) on ``forward``, their
    passes captured or not; returns whether each output is greedy's, and the mean tau."""
    same, taus = [], []
    for i, (prompt, _) in enumerate(random_prompts(n, model.config.vocab_size, seed=5)):
        reference = greedy_reference(model, prompt, 40)
        drafter = OracleMTP(model, reference, p_top=0.6, seed=i).drafter(
            model, DynamicTreeConfig(nodes=16, topk=3, depth=4, min_mass=0.2), capture=capture)
        with torch.no_grad():
            tokens, stats = speculative_decode(model, drafter, prompt, 30, accept_greedy, greedy_root,
                                               eos_ids(model.generation_config), forward=forward)
        same.append(tokens == reference[0, prompt.shape[1]:][:len(tokens)].tolist())
        taus.append(stats.mean_tau)
    return same, sum(taus) / len(taus)


def test_long_accepted_paths_commit_in_place_on_the_static_cache():
    same, tau = _oracle_run(tiny_model("llama", seed=1), ForwardContext(cache="static"))
    assert all(same) and tau > 3.0, (same, tau)


def test_a_forward_that_cannot_be_captured_runs_eagerly_and_says_so(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args, **kwargs):
            raise RuntimeError("no compiler here\nsecond line")
        return run

    model = tiny_model("llama", seed=1)
    monkeypatch.setattr(capture_module.torch, "compile", broken_compile)
    monkeypatch.setattr(sequential, "MODULE_CACHE", 8)  # the drafter's preallocated cache grows (twice) on the way
    with pytest.warns(CaptureFallbackWarning) as caught:
        same, tau = _oracle_run(model, ForwardContext(cache="static", capture=True), n=2, capture=True)
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
    same, tau = _oracle_run(tiny_model("llama", seed=1), ForwardContext(cache="static", capture=True), n=3,
                            capture=True)
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
    """Captured drafters of one heads module in one thread use one preallocated module cache, whichever generation or
    generator drafts (its addresses are in the recorded graphs); a generation that needs more entries replaces it with
    a larger one, which later drafters keep."""
    model = tiny_model("llama", seed=3)
    heads = random_eagle3(model, scale=0.05)
    config = DynamicTreeConfig(nodes=8, topk=4, min_mass=0)
    first, second = heads.drafter(model, config, capture=True), heads.drafter(model, config, capture=True)
    assert first.cache is second.cache and heads.drafter(model, config).cache is not first.cache
    keys = first.cache.layers[0].keys
    gens = [SpeculativeGenerator(model, heads, draft=d, cache="static", capture=True) for d in ("heads", "hybrid")]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture_module.torch, "compile", lambda fn, **kw: fn)
        for gen in gens:
            prompt, new = next(iter(random_prompts(1, model.config.vocab_size, seed=4)))
            assert gen.generate(prompt, max_new_tokens=new).sequences.tolist() == \
                greedy_reference(model, prompt, new).tolist()
        assert heads.drafter(model, config, capture=True).cache.layers[0].keys is keys
        grown = heads.drafter(model, config, capture=True)
        grown._reserve(sequential.MODULE_CACHE + 1)
        assert grown.cache.layers[0].max_cache_len == 2 * sequential.MODULE_CACHE
        assert heads.drafter(model, config, capture=True).cache is grown.cache


class ReplayedOutputs:
    """A stand-in for ``torch.compile(mode="reduce-overhead")`` with what CUDA graph replays do to outputs: a call's
    outputs live in the graphs' memory pool, and the next captured call (any of them: ``capture.captured`` marks a
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

    def recording_verify(model, cache, tokens, *args):
        drafted.append(tokens.tolist())
        return verify(model, cache, tokens, *args)

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
    context = ForwardContext(cache="static")
    first = context.static_cache(model, 300)
    assert first.max_len == 1024 and context.static_cache(model, 1024) is first  # one shape for most generations
    assert ForwardContext(cache="static").static_cache(model, 500) is first  # another generator's generation too
    assert context.static_cache(other, 10) is not first  # another backbone's
    assert context.static_cache(model, 1025).max_len == 2048
    captured = ForwardContext(cache="static", capture=True)  # each length is a graph per bucket: fewer lengths
    assert captured.static_cache(model, 300).max_len == captured.static_cache(model, 4000).max_len == 4096
    assert captured.static_cache(model, 4097).max_len == 8192
    short = tiny_model()  # no longer than its context needs, as a power of two
    assert short.config.max_position_embeddings == 256
    assert ForwardContext(cache="static", capture=True).static_cache(short, 300).max_len == 512
