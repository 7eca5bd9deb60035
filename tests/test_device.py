"""The same code on any device, checked on a CPU-only machine.

- Everything the decode loop and the drafters create follows the backbone's device: a generation run under
  ``torch.device("meta")`` as the default device (any tensor made without naming its device lands on meta and fails)
  gives exactly what it gives without it; the steps that only shape tensors run on a backbone moved to "meta".
- Every clock read that times device work waits for the device first (``machine.clock``), counted per round.
- Calibration caches are keyed by the device's name; key/value-head sharing stays off off the CPU.
- fp16 and bf16 backbones generate (greedy identity is only exact in fp32, so only the length is checked).
"""

import types
import warnings

import pytest
import torch
from helpers import greedy_reference, random_heads, random_mtp, tiny_model, tree_draft
from transformers import DynamicCache

from tokenmaxx.heads import Prefill, Tree
from tokenmaxx.heads.attention import shared_kv_kwargs, shares_kv_heads, use_shared_kv_attention
from tokenmaxx.heads.machine import cpu_isa, device_name
from tokenmaxx.heads import machine
from tokenmaxx.inference import EmulatedBf16Warning, EmulatedDtypeWarning, SpeculativeGenerator, generator, verify
from tokenmaxx.scripts.benchmark import Prompt, hf_method, run_benchmark
from tokenmaxx.inference.measure.store import calibration_key, machine_fingerprint
from tokenmaxx.inference.kv import GrowingKV
from tokenmaxx.inference.runner import Runner
from tokenmaxx.inference.measure.latency import measure_latency
from tokenmaxx.inference.sampling import make_generator
from tokenmaxx.scripts.generate import plain_generate

META = torch.device("meta")
PROMPT = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5]])  # repeats itself: lookup branches match


def _model():
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = None  # full length
    return model


def _devices(*args, **kwargs) -> set:
    """The devices of the tensors among a call's arguments."""
    return {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}


def _count_synchronize(monkeypatch) -> list:
    """Replace ``machine.synchronize`` by a recorder; returns the devices it was called with."""
    calls = []
    monkeypatch.setattr(machine, "synchronize", calls.append)
    return calls


# ---- device plumbing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,draft", [("medusa", "heads"), ("mtp", "heads"), ("mtp", "hybrid"), (None, "lookup")])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_generation_creates_every_tensor_on_the_backbone_device(kind, draft, sampling):
    model = _model()
    heads = {"medusa": random_heads, "mtp": random_mtp, None: lambda m: None}[kind](model)
    gen = SpeculativeGenerator(model, heads, draft=draft)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=1) if sampling else {}
    expected = gen.generate(PROMPT, max_new_tokens=24, **kwargs)
    with torch.device(META):  # a tensor made without the backbone's device would land here, and fail
        out = gen.generate(PROMPT, max_new_tokens=24, **kwargs)
    assert out.new_tokens == expected.new_tokens and len(out.new_tokens) == 24
    assert out.sequences.device == model.device
    if not sampling:
        assert out.new_tokens == greedy_reference(model, PROMPT, 24)[0, PROMPT.shape[1]:].tolist()


def test_tree_buffers_copy_to_a_device_once():
    buffers = Tree([(0,), (1,), (0, 0)]).buffers
    assert buffers.to("cpu") is buffers
    on_meta = buffers.to(META)
    assert on_meta is buffers.to("meta")  # made once per device
    for name in ("depths", "parents", "attn_mask", "token_index", "retrieve"):
        assert getattr(on_meta, name).device == META and getattr(on_meta, name).shape == getattr(buffers, name).shape
        assert getattr(buffers, name).device.type == "cpu"  # the CPU copy stays for the drafters' Python side
    assert (on_meta.children, on_meta.topk, on_meta.num_nodes) == (buffers.children, buffers.topk, buffers.num_nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_bias_takes_the_backbone_dtype_and_device(dtype):
    buffers = Tree([(0,), (1,)]).buffers
    for device in (torch.device("cpu"), META):
        kv = _empty_kv(device, prefix_len=2)
        bias = kv.tree_inputs(torch.tensor([[5, 6, 7]], device=device), buffers.depths[None].to(device),
                              buffers.attn_mask[None].to(device), None, dtype)["attention_mask"]
        assert bias.dtype == dtype and bias.device == device and bias.shape == (1, 1, 3, 5)
        if device.type == "cpu":
            assert bias[0, 0, 1, 4] == torch.finfo(dtype).min and bias[0, 0, 1, 3] == 0


def _empty_kv(device, prefix_len: int = 0) -> GrowingKV:
    """A growing cache of one row that holds ``prefix_len`` positions (by its bookkeeping alone)."""
    kv = GrowingKV(1)
    kv.cache, kv.ends, kv.positions = DynamicCache(), [prefix_len], [prefix_len]
    kv.live = torch.ones(1, prefix_len, dtype=torch.bool, device=device)
    return kv


def test_verify_feeds_the_backbone_on_its_device():
    """A backbone moved to "meta" computes shapes only; its inputs (tokens, 4D mask, position ids) are all on it."""
    model = _model().to(META)
    inputs = []
    model.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(_devices(*args, **kwargs)),
                                    with_kwargs=True)
    tokens = torch.tensor([5, 6, 7], device=META)  # [N]
    verified = verify(model, _empty_kv(META), [tree_draft(tokens, Tree([(0,), (1,)]).buffers)],
                      Runner(attention=shared_kv_kwargs(model)))
    assert inputs == [{META}]
    assert verified.logits.device == META and verified.logits.shape == (1, 3, model.config.vocab_size)
    assert verified.hidden.shape == (1, 3, model.config.hidden_size)


def test_drafters_draft_on_the_backbone_device():
    model = _model()
    medusa, mtp = random_heads(model), random_mtp(model)
    model.to(META)
    hidden = torch.zeros(PROMPT.shape[1], model.config.hidden_size, device=META)  # [P, H]
    prefill = Prefill(input_ids=PROMPT[0].to(META), hidden=hidden, root=9)
    # built by the constructor, which measures nothing (a backbone on the meta device has no latency to measure)
    medusa_drafter = SpeculativeGenerator(model, medusa, draft="heads").make_drafter()
    medusa_drafter.start(prefill)
    draft = medusa_drafter.propose(9, room=4)  # top-k guesses laid on the tree: shapes only
    assert {t.device for t in (draft.tokens, draft.sources, draft.values)} == {META}
    assert draft.tokens.shape == (draft.buffers.num_nodes,)
    mtp_drafter = SpeculativeGenerator(model, mtp, draft="heads").make_drafter()
    step, inputs = mtp_drafter.heads.step, []

    def recording_step(*args, **kwargs):
        inputs.append(_devices(*args, **kwargs))
        return step(*args, **kwargs)

    mtp_drafter.heads.step = recording_step
    mtp_drafter.start(prefill)  # the module reads the end of the prompt: states, tokens, positions and mask
    assert inputs == [{META}]
    assert mtp_drafter.last_state.device == META and mtp_drafter.cached == mtp.config.num_heads + 1


def test_heads_follow_the_backbone_device_and_dtype():
    model = _model()
    heads = random_mtp(model)
    model.to(device=META, dtype=torch.float16)
    gen = SpeculativeGenerator(model, heads, draft="heads")
    assert {(p.device, p.dtype) for p in gen.heads.parameters()} == {(META, torch.float16)}


def test_a_sampling_generator_must_be_on_the_backbone_device():
    assert make_generator(3, None, torch.device("cpu")).device == torch.device("cpu")
    with pytest.raises(ValueError, match="generator= is on cpu but the backbone is on cuda:0"):
        make_generator(None, torch.Generator(), torch.device("cuda", 0))


# ---- clocks wait for the device ----------------------------------------------------------------------------------
def test_synchronize_waits_on_an_accelerator_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.accelerator, "synchronize", waited.append)
    machine.synchronize(torch.device("cpu"))
    machine.synchronize(META)
    assert waited == []
    assert isinstance(machine.clock(torch.device("cuda", 0)), float)
    assert waited == [torch.device("cuda", 0)]


def test_the_loop_waits_for_the_device_before_every_clock_read(monkeypatch):
    model = _model()
    gen = SpeculativeGenerator(model, random_mtp(model), draft="hybrid")
    calls = _count_synchronize(monkeypatch)
    out = gen.generate(PROMPT, max_new_tokens=16)
    # prefill: start and end; decode: start and end; each round: before propose, verify, accept, commit, and after
    assert len(calls) == 4 + 5 * out.stats.steps and set(calls) == {model.device}


def test_latency_bench_and_compare_timings_wait_for_the_device(monkeypatch):
    model = _model()
    calls = _count_synchronize(monkeypatch)
    measure_latency(model, sizes=(1, 2), prefix_len=8, repeats=2)
    assert len(calls) == 2 * 2 * 2  # sizes x repeats, a clock read before and after each forward
    calls.clear()
    plain_generate(model, PROMPT, 4)
    assert len(calls) == 2
    calls.clear()
    run_benchmark(model, {"baseline": hf_method(model)}, [Prompt(1, "all", PROMPT)], 4, warmup=0, progress=False)
    assert len(calls) == 2 and set(calls) == {model.device}


# ---- calibration keys, attention -----------------------------------------------------------------------------------
def _fake_backbone(device: torch.device, dtype=torch.float32):
    """What machine_fingerprint reads of a backbone: its lm_head weight's device and dtype."""
    weight = types.SimpleNamespace(device=device, dtype=dtype)
    return types.SimpleNamespace(get_output_embeddings=lambda: types.SimpleNamespace(weight=weight))


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
def test_calibration_keys_tell_devices_apart(monkeypatch):
    model = _model()
    heads = random_heads(model)
    names = {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device.index])
    assert device_name(torch.device("cuda", 0)) == "cuda: NVIDIA H200"
    assert device_name(torch.device("cpu")).startswith("cpu: ")
    cpu = machine_fingerprint(model)
    h200 = machine_fingerprint(_fake_backbone(torch.device("cuda", 0)))
    a100 = machine_fingerprint(_fake_backbone(torch.device("cuda", 1)))
    assert cpu["device"] == device_name(torch.device("cpu")) and h200["device"] == "cuda: NVIDIA H200"
    assert {k: v for k, v in h200.items() if k != "device"} == {k: v for k, v in cpu.items() if k != "device"}
    keys = {calibration_key(model, heads, machine) for machine in (cpu, h200, a100)}
    assert len(keys) == 3


def test_calibration_keys_tell_cpu_instruction_sets_apart(monkeypatch):
    """Two CPUs of one model name ("AMD EPYC") with and without AVX-512 time bf16 verifies several times apart: a
    latency table or tree="auto" choice made on one is not read on the other."""
    model = _model()
    heads = random_heads(model)
    assert cpu_isa() == torch.backends.cpu.get_cpu_capability()
    keys = set()
    for isa in ("AVX512", "AVX2"):
        monkeypatch.setattr("tokenmaxx.heads.machine.cpu_isa", lambda isa=isa: isa)
        machine = machine_fingerprint(model)
        assert machine["cpu_isa"] == isa
        keys.add(calibration_key(model, heads, machine))
    assert len(keys) == 2


def test_calibration_keys_tell_cpus_of_one_name_and_isa_apart(monkeypatch, tmp_path):
    """Virtual machines name CPUs generations apart alike ("AMD EPYC", both AVX-512): their family, model and stepping
    (/proc/cpuinfo) tell them apart, and a cost measured on one is not read on the other."""
    from tokenmaxx.heads import machine as machine_module

    cpuinfo = tmp_path / "cpuinfo"
    real_path = machine_module.Path
    monkeypatch.setattr(machine_module, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    model, keys = _model(), set()
    for model_number in (1, 17):
        cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model_number}"
                           "\nmodel name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel\t\t: 99\n")
        machine = machine_fingerprint(model)
        assert machine["cpu"] == "AMD EPYC"
        assert machine["cpu_id"] == f"AuthenticAMD family 25 model {model_number} stepping 1"  # the first processor's
        keys.add(calibration_key(model, random_heads(model), machine))
    assert len(keys) == 2


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
def test_half_precision_on_a_cpu_that_emulates_it_is_warned_about_when_loading(monkeypatch, tmp_path):
    """load_backbone (so from_pretrained and every command) warns for bf16 and fp16 where this CPU emulates them,
    and auto picks float32 there; where bf16 is native, neither warns and auto picks bf16."""
    from tiny_tokenizer import tiny_tokenizer

    from tokenmaxx.heads.io import backbones

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "backbone")
    tiny_tokenizer().save_pretrained(tmp_path / "backbone")
    random_mtp(model).save_pretrained(tmp_path / "heads")

    def load(**dtype):
        gen = SpeculativeGenerator.from_pretrained(str(tmp_path / "backbone"), heads=str(tmp_path / "heads"),
                                                   device="cpu", costs=None, **dtype)  # the warning, not the costs
        return gen.model.get_output_embeddings().weight.dtype

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # any CPU is an AVX2-only one to oneDNN's products then
    for name in ("bfloat16", "float16"):
        said = rf"{name} on this CPU .*no native {name} support.*float32 is faster here \(dtype='float32', or --dtype "
        with pytest.warns(EmulatedDtypeWarning, match=said + r"float32\)"):
            load(dtype=name)
    assert EmulatedBf16Warning is EmulatedDtypeWarning  # (its earlier name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedDtypeWarning)
        assert load(dtype="float32") == torch.float32
        assert load() == torch.float32  # the default picks fp32 here
        monkeypatch.setattr(backbones, "cpu_has_native_bf16", lambda: True)
        monkeypatch.setattr(backbones, "cpu_dtype_is_emulated", lambda dtype: False)
        assert load(dtype="bfloat16") == torch.bfloat16
        assert load() == torch.bfloat16  # and bf16 where it is native


def test_dtype_auto_is_bf16_off_the_cpu_and_bad_dtypes_are_refused():
    from tokenmaxx.heads import resolve_dtype

    assert resolve_dtype("auto", META) == torch.bfloat16  # any accelerator
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, META) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'float8': expected auto, float32, bfloat16 or float16"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.usefixtures("on_cpu")  # what the CPU alone does: built there whatever TOKENMAXX_TEST_DEVICE says
def test_kv_head_sharing_stays_off_off_the_cpu():
    model = _model()  # 4 query heads, 2 key/value heads
    assert shares_kv_heads(model)
    model.to(META)  # any device but the CPU: on CUDA, SDPA with a mask and enable_gqa runs its slow math kernel
    assert not shares_kv_heads(model)
    assert not use_shared_kv_attention(model) and model.config._attn_implementation == "sdpa"  # transformers' own
    assert shared_kv_kwargs(model) == {}


# ---- half precision ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_backbones_generate(dtype):
    """Greedy identity is exact in fp32 only (a tree forward rounds differently from a one-token forward); here: the
    loop runs in the backbone's dtype end to end and produces every token asked for."""
    model = tiny_model("qwen2", seed=3)
    model.generation_config.eos_token_id = None
    heads = random_mtp(model)
    model.to(dtype)
    gen = SpeculativeGenerator(model, heads, draft="hybrid")
    out = gen.generate(PROMPT, max_new_tokens=16)
    assert len(out.new_tokens) == 16 and all(0 <= t < model.config.vocab_size for t in out.new_tokens)
    assert {p.dtype for p in gen.heads.parameters()} == {dtype}
    sampled = gen.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=0.8, seed=0)
    assert len(sampled.new_tokens) == 16
