"""Shared test helpers: tiny random backbones built from a config (fp32, no download), heads with random or rigged
weights, greedy references, statistics for the sampling tests. Test files import from here, never from each other."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._device import _device_constructors
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tokenmaxx.heads import Eagle3Heads, HeadsConfig, MedusaHeads, MTPHeads, load_heads
from tokenmaxx.inference.decoding import Accepted
from tokenmaxx.inference.sampling import target_probs
from tokenmaxx.training.train_config import TrainConfig


# The device the fast tier runs on: the CPU, or e.g. "cuda" under scripts/gpu_check.py (TOKENMAXX_TEST_DEVICE).
TEST_DEVICE = torch.device(os.environ.get("TOKENMAXX_TEST_DEVICE", "cpu"))


class OnTestDevice(TorchFunctionMode):
    """While active, tensors made without a device (models built from a config, hand-written token tensors) are made
    on ``device``; a random draw from a CPU generator is drawn on the CPU, as on a CPU-only run, then moved there. So
    the same test files run unchanged on a GPU (conftest.py enters it when TOKENMAXX_TEST_DEVICE is set)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device != self.device:
                return func(*args, **kwargs, device=generator.device).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def error_lines(stderr: str) -> list[str]:
    """The lines of a command's stderr that argparse or ``run_script`` wrote as errors."""
    return [line for line in stderr.splitlines() if "error:" in line]


def seeded_generator(seed: int) -> torch.Generator:
    """A seeded generator on the test device (where sampling draws)."""
    return torch.Generator(device=TEST_DEVICE).manual_seed(seed)


TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **overrides):
    torch.manual_seed(seed)
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = cfg_cls(**{**TINY, **overrides}, attn_implementation=attn)
    model = model_cls(config).eval()
    # Spread the logits: random init gives near-flat distributions whose argmax ties are numerically fragile.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.requires_grad_(False)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def random_heads(model, seed: int = 0, num_heads: int = 4, **kw) -> MedusaHeads:
    """Medusa heads with random (non-zero) residual weights: they guess badly, so acceptance is low."""
    heads = MedusaHeads.for_backbone(model, num_heads=num_heads, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return heads


class OracleHeads(MedusaHeads):
    """Heads rigged to know the backbone's greedy continuation ``reference`` (prompt + new tokens).

    The position of a hidden state is found by nearest neighbour among the reference sequence's hidden states, and head
    k proposes the true token at t+k+1 at a random rank (rank 0 with probability ``p_top``), or, with probability
    ``p_wrong``, not at all; other ranks get random tokens. So accepted paths are long and run through side branches.
    """

    def __init__(self, model, reference: torch.Tensor, num_heads: int = 4, p_top: float = 0.7,
                 p_wrong: float = 0.1, seed: int = 0):
        hidden, vocab = model.lm_head.weight.shape[1], model.lm_head.weight.shape[0]
        super().__init__(HeadsConfig(kind="medusa", num_heads=num_heads, hidden_size=hidden, vocab_size=vocab))
        self.reference = reference[0]  # [T]
        with torch.no_grad():
            self.states = model(reference, output_hidden_states=True).hidden_states[-1][0]  # [T, H]
        self.vocab = vocab
        self.p_top, self.p_wrong = p_top, p_wrong
        self.gen = torch.Generator().manual_seed(seed)

    def draft_logits(self, hidden, lm_head=None):  # hidden [H] -> logits [K, V] (what Medusa drafting reads)
        t = int((self.states - hidden.float()).norm(dim=-1).argmin())
        logits = torch.rand(self.config.num_heads, self.vocab, generator=self.gen)
        for k in range(1, self.config.num_heads + 1):
            if t + k + 1 >= self.reference.numel():
                continue
            u = float(torch.rand(1, generator=self.gen))
            if u < self.p_wrong:
                continue
            target = int(self.reference[t + k + 1])
            if u >= self.p_wrong + self.p_top:  # the truth at rank 1, behind a decoy
                logits[k - 1, int(torch.randint(self.vocab, (1,), generator=self.gen))] = 10.0
            logits[k - 1, target] = 10.0 if u < self.p_wrong + self.p_top else 5.0
        return logits


def greedy_reference(model, input_ids, max_new_tokens):
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          do_sample=False)


def random_mtp(model, seed: int = 0, num_heads: int = 3, scale: float = 0.3) -> MTPHeads:
    heads = MTPHeads.for_backbone(model, num_heads=num_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return heads.eval()


def random_eagle3(model, seed: int = 0, num_heads: int = 3, scale: float = 0.3,
                  feature_layers=(0, 1, 2)) -> Eagle3Heads:
    """EAGLE-3 heads with random weights; the tiny backbones have 2 layers, so they read hidden states 0, 1 and 2
    (the embeddings, the middle, the final-normed output) instead of EAGLE-3's default (2, L//2, L-3)."""
    heads = Eagle3Heads.for_backbone(model, num_heads=num_heads, feature_layers=list(feature_layers))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return heads.eval()


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 merged into one."""
    n = counts.sum()
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def exact_pair(model, prefix: torch.Tensor, warpers) -> torch.Tensor:
    """Exact P(t1=a, t2=b) [V, V] of plain sampling after ``prefix`` [T]."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(prefix[None]).logits[0, -1], warpers)  # [V]
        seqs = torch.cat([prefix.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)  # [V, T+1]
        p2 = target_probs(model(seqs).logits[:, -1], warpers)  # [V, V]
    return p1[:, None] * p2


def broken_accept(tokens, logits, buffers, warpers, generator):
    """Deliberately wrong: no residual (p is not renormalised after a rejection, the bonus may repeat a rejected draft)."""
    node, path = 0, [0]
    p = target_probs(logits[0], warpers)
    while True:
        for child in buffers.children[node]:
            if float(torch.rand((), generator=generator)) < p[int(tokens[child])]:
                node, path = child, path + [child]
                p = target_probs(logits[child], warpers)
                break
        else:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            break
    nodes = torch.tensor(path)
    return Accepted(nodes=nodes, tokens=tokens[nodes[1:]].tolist() + [bonus])


def random_prompts(n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        length = int(torch.randint(1, 20, (1,), generator=gen))
        yield torch.randint(3, vocab, (1, length), generator=gen), int(torch.randint(1, 40, (1,), generator=gen))


def oracle_tau(model, make_generator, n: int, seed: int) -> float:
    """Generate from n random prompts with ``make_generator(reference, i)`` (oracle heads that know ``reference``, the
    greedy continuation, 8 tokens beyond what is generated for their look-ahead), assert each output equals plain
    greedy generate, and return the mean tokens per speculative step."""
    total_steps = total_tokens = 0
    for i, (input_ids, max_new) in enumerate(random_prompts(n, model.config.vocab_size, seed=seed)):
        max_new += 20
        expected = greedy_reference(model, input_ids, max_new)
        gen = make_generator(greedy_reference(model, input_ids, max_new + 8), i)
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == expected.tolist()
        total_steps += out.stats.steps
        total_tokens += out.stats.new_tokens - 1  # the first token comes from the prefill
    return total_tokens / total_steps


def assert_matches_greedy(gen, model, n: int, seed: int) -> None:
    """``gen`` reproduces model.generate(do_sample=False) on n random prompts of random lengths and token budgets."""
    for input_ids, max_new in random_prompts(n, model.config.vocab_size, seed=seed):
        expected = greedy_reference(model, input_ids, max_new)
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == expected.tolist()
        assert out.stats.new_tokens == expected.shape[1] - input_ids.shape[1]


BENCH_STATS = {"tokens": 640, "seconds": 4.0, "tokens_per_s": 160.0, "speedup": 1.62, "tau": 2.05, "identical_rate": 1.0,
     "prompts": 5}
BENCH = {"config": {"backbone": "smollm2-135m", "dtype": "bfloat16", "threads": 2, "max_new_tokens": 128},
         "machine": {"cpu": "test cpu", "threads": 2},
         "methods": {"baseline": {"overall": {**BENCH_STATS, "speedup": 1.0, "tau": 1.0}, "categories": {"coding": BENCH_STATS, "math": BENCH_STATS}},
                     "medusa": {"overall": BENCH_STATS, "categories": {"coding": {**BENCH_STATS, "speedup": 1.91}, "math": BENCH_STATS}}}}


# ---- training -----------------------------------------------------------------------------------------------------
ANSWER_LEN = 24  # tokens of each answer in the tiny training data (conftest.data_dir)


@torch.no_grad()
def greedy_answers(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] (same length) -> the backbone's greedy continuation [B, new_tokens] (no EOS stop)."""
    ids = prompts
    for _ in range(new_tokens):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1]:]


def make_cfg(data_dir: Path, out: Path, **overrides) -> TrainConfig:
    """A short training run on the tiny data (medusa heads, fp32, 6 steps, checkpoints every 3)."""
    values = dict(data=str(data_dir), backbone="unused", kind="medusa", dtype="float32", output_dir=str(out), seq_len=48,
                  max_steps=6, lr=3e-2, warmup=2, micro_batch_size=4, grad_accum=2, eval_fraction=0.1, save_every=3)
    return TrainConfig(**{**values, **overrides})


def head_state(export_dir: Path) -> dict[str, torch.Tensor]:
    return load_heads(export_dir).state_dict()


def repeating_prompts(vocab, seed, n=5):
    """n prompts [1, T] that repeat a random motif (prompt lookup finds continuations in them), each with a
    max_new_tokens."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen)
        reps = int(torch.randint(2, 5, (1,), generator=gen))
        yield torch.cat([motif] * reps)[None], int(torch.randint(8, 40, (1,), generator=gen))


class OracleMTP(MTPHeads):
    """Real MTP module (cache, masks, positions all exercised) whose logits are rigged from a reference continuation.

    A query at position q conditioned on token x predicts the token at q+2. If x is the reference token at q+1 (the
    path so far is right), the true token is put at rank 0 (prob p_top) or rank 1 behind a decoy; otherwise noise.
    """

    def __init__(self, model, reference: torch.Tensor, p_top: float = 0.7, seed: int = 0):
        base = MTPHeads.for_backbone(model, num_heads=3)
        super().__init__(base.config)
        self.reference = reference[0].tolist()
        self.seed = seed
        self.p_top = p_top

    def step(self, prev, tokens, embed, position_ids, attention_mask, cache=None, **attention):
        """The module's pass, its output carrying each query's position and token in its first two channels (for
        ``logits``, whichever rows of it are read: padded passes, batched rows)."""
        out = super().step(prev, tokens, embed, position_ids, attention_mask, cache, **attention)  # [B, n, H]
        return torch.cat([position_ids[..., None].to(out.dtype), tokens[..., None].to(out.dtype), out[..., 2:]], -1)

    def logits(self, states, lm_head):
        vocab = lm_head.weight.shape[0]
        rows = states.reshape(-1, states.shape[-1])[:, :2].round().long().tolist()  # (q, token) per state
        out = torch.empty(len(rows), vocab)
        for i, (q, tok) in enumerate(rows):
            gen = torch.Generator().manual_seed(self.seed * 100003 + q * 1009 + tok)  # same query, same guesses
            out[i] = torch.randn(vocab, generator=gen)
            if q + 2 < len(self.reference) and self.reference[q + 1] == tok:
                target = self.reference[q + 2]
                if float(torch.rand((), generator=gen)) < self.p_top:
                    out[i, target] = 12.0
                else:
                    out[i, int(torch.randint(vocab, (), generator=gen))] = 12.0
                    out[i, target] = 11.0
        return out.reshape(*states.shape[:-1], vocab)


class HostTraffic(TorchDispatchMode):
    """Counts, while active: ``reads`` (a value brought back to Python: ``item``/``int``/``bool``/``float`` of a
    tensor, ``tolist``, ``numpy``) and ``copies`` (a tensor of one or more dimensions made from Python data: a copy
    to the device on an accelerator; a Python number becomes a 0-d wrapped scalar, passed to kernels by value, and is
    not counted). ``marks`` snapshots both at each ``mark``."""

    def __init__(self):
        super().__init__()
        self.reads = self.copies = 0
        self.marks: list[tuple[int, int]] = []
        self._patched: dict[str, object] = {}

    def mark(self) -> None:
        self.marks.append((self.reads, self.copies))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif func is torch.ops.aten.lift_fresh.default and out.dim() > 0:
            self.copies += 1
        return out

    def __enter__(self):
        for name in ("tolist", "numpy"):  # read straight from CPU memory, past the dispatcher
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(tensor, *a, _original=original, **kw):
                self.reads += 1
                return _original(tensor, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def tree_draft(tokens: torch.Tensor, buffers) -> "Draft":
    """A draft of the given tree tokens [N] and buffers, every node the heads'."""
    from tokenmaxx.heads.drafting import HEADS, Draft

    return Draft(tokens=tokens, buffers=buffers, sources=torch.full_like(tokens, HEADS),
                 values=torch.ones(tokens.shape[0], device=tokens.device))


def prefilled(model, prefix: torch.Tensor, kv=None):
    """``kv`` (default: a growing cache of one row) holding the positions of ``prefix`` [1, P]."""
    from tokenmaxx.inference.kv import GrowingKV

    kv = kv if kv is not None else GrowingKV(1)
    with torch.no_grad():
        kv.prefill(model, prefix, torch.ones_like(prefix, dtype=torch.bool), [[0]], None)
    return kv


def decode_one(model, drafter, prompt: torch.Tensor, new_tokens: int, **kwargs):
    """``loop.decode`` of one prompt [1, P], greedy: its new tokens and its row's statistics."""
    from tokenmaxx.inference.decoding import accept_greedy
    from tokenmaxx.inference.loop import decode, eos_ids, greedy_root

    (tokens,), stats = decode(model, [drafter], prompt, new_tokens, accept_greedy, greedy_root,
                              eos_ids(model.generation_config), **kwargs)
    return tokens, stats.rows[0]
