"""SpeculativeGenerator: speculative generation whose output is the backbone's own.

Build it from objects (``SpeculativeGenerator(model, heads, tokenizer=tok)``), through the factory that also resolves
``tree="auto"`` (``SpeculativeGenerator.create``), or from names (``SpeculativeGenerator.from_pretrained``). Each
``generate`` call makes a fresh drafter (``drafting.make_drafter``) and runs the loop (``loop.speculative_decode``),
so one generator (and one backbone) may serve several threads at once.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from tokenmaxx.heads import DEFAULT_BACKBONE, DraftHeads, cpu_has_native_bf16, default_heads_path, load_backbone
from tokenmaxx.heads.attention import shared_kv_kwargs

from .autotune import Calibration, is_auto, resolve_auto
from .calibration_store import cpu_isa, cpu_name
from .decoding import accept_greedy
from .drafting import DEFAULT_DRAFT, NEEDS_HEADS, check_draft_mode, make_drafter
from .latency import cached_latency, cached_propose_cost
from .lookup import LookupConfig
from .loop import GenerationStats, eos_ids, greedy_root, speculative_decode
from .small_rows import cached_small_rows
from .sampling import TypicalAcceptance, accept_sampling, accept_typical, build_warpers, make_generator, sample, \
    target_probs

# "auto": bfloat16 where it is native (a GPU, a CPU with AVX-512 BF16 or AMX), the fastest measured there; float32 on a
# CPU without, where emulated bf16 was slower (docs/benchmarks.md). float32 where token identity must be exact.
DEFAULT_DTYPE = "auto"

__all__ = ["DEFAULT_DTYPE", "GenerationOutput", "GenerationStats", "SpeculativeGenerator"]


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [1, T_prompt + T_new] prompt, then new tokens; on the backbone's device, as generate's
    new_tokens: list[int]
    stats: GenerationStats
    text: str | None = None  # decoded new tokens, when a tokenizer is known



class EmulatedBf16Warning(UserWarning):
    """The backbone runs in bfloat16 on a CPU that has no native bf16 (see ``warn_if_bf16_is_emulated``)."""


def warn_if_bf16_is_emulated(model) -> None:
    """Warn when ``model`` runs in bf16 on a CPU without native bf16 (AVX2 only): there verifying a tree costs nearly a
    decode step per token, so drafting barely pays, and float32 is faster (the demo prompt on a 2-core AVX2 EPYC: hybrid
    1.41x over plain generate in fp32, 0.87x in bf16; docs/benchmarks.md)."""
    weight = model.get_output_embeddings().weight
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        warnings.warn(EmulatedBf16Warning(
            f"bfloat16 on this CPU ({cpu_name()}, {cpu_isa()}) has no native bf16 support, so speculative decoding "
            "barely pays in it; dtype='float32' is faster here (on an AVX2-only CPU the hybrid gave 1.41x in float32 "
            "and 0.87x in bfloat16)"), stacklevel=3)

class SpeculativeGenerator:
    """Speculative generation with draft heads on a frozen backbone; output equals the backbone's own.

    ``draft``: "hybrid" (heads + prompt lookup, the default), "heads" or "lookup" (no heads needed). ``tree``: the
    heads' tree settings as their kind reads them (Medusa: a Tree, a list of paths, "default", "chain:K"; MTP:
    "dynamic", "dynamic:N", "dynamic:nodes=N,topk=K,...") or None for the heads' own; "auto" or
    "auto:prompts=N,tokens=T" (chosen for this machine) goes through ``SpeculativeGenerator.create``. ``lookup``:
    prompt-lookup settings. ``draft_vocab``: heads with a draft vocabulary guess over it. ``adaptive_budget``: the
    heads' and hybrid trees are sized per round from this machine's verify latency and the heads' proposing time (both
    measured once, cached): nodes that would not pay for their verify time are cut, and heads that would not pay for
    their proposing time sit rounds out.
    ``small_row_linears``: on a CPU whose BLAS multiplies a few rows faster as ``(W @ x^T)^T`` (timed once per
    backbone, machine and tree size, cached: ``small_rows.cached_small_rows``), verifies of the sizes that gained
    compute the backbone's linear layers that way; False: always as the model does.
    """

    def __init__(self, model, heads: DraftHeads | None, tokenizer=None, tree=None, strict_identity: bool = True,
                 draft: str = DEFAULT_DRAFT, lookup: LookupConfig | None = None, draft_vocab: bool = True,
                 adaptive_budget: bool = True, small_row_linears: bool = True):
        check_draft_mode(draft, heads)
        if is_auto(tree):
            raise ValueError(f"tree={tree!r} calibrates the tree on this machine: build the generator with "
                             "SpeculativeGenerator.create(model, heads, tokenizer=..., tree='auto') or from_pretrained")
        if heads is not None:
            heads.check_backbone(model, strict_identity=strict_identity)
            heads = _on_backbone(heads, model)
        self.model, self.heads, self.tokenizer, self.draft = model, heads, tokenizer, draft
        self.lookup = lookup or LookupConfig()
        self.draft_vocab = draft_vocab
        # the heads' tree settings as their kind parses them (validated here, once); None when only lookup drafts
        self.tree_settings = heads.tree_settings(heads.config, tree) if draft != "lookup" else None
        self.attention = shared_kv_kwargs(model)  # tree verifies let SDPA share the KV heads where that applies
        # the tree sizes whose verifies compute (some) linear layers as (W @ x^T)^T, and which; measured before the
        # latency table, which is then measured the same way
        self.small_rows = cached_small_rows(model) if small_row_linears else {}
        self.latency = cached_latency(model, small_rows=self.small_rows) \
            if draft in NEEDS_HEADS and adaptive_budget else None
        self.propose_cost = cached_propose_cost(model, heads, self.tree_settings, draft_vocab) \
            if self.latency is not None else None

    @classmethod
    def create(cls, model, heads: DraftHeads | None, tokenizer=None, tree=None, **kwargs) -> "SpeculativeGenerator":
        """Like the constructor, and ``tree="auto"`` is resolved first: the heads' tree settings with the best
        expected tokens/s on this machine (``autotune.resolve_auto``: calibrated once, then cached).
        ``tree="auto:prompts=N,tokens=T"`` (or an ``autotune.Calibration``) calibrates on the first N of its 8 prompts,
        T tokens each (default 8 and 128): quicker, noisier."""
        calibration = Calibration.parse(tree)
        if calibration is not None:
            if heads is None:
                raise ValueError("tree='auto' tunes the heads' trees: pass heads (or draft='lookup' without a tree)")
            heads.check_backbone(model, strict_identity=kwargs.get("strict_identity", True))
            heads = _on_backbone(heads, model)
            small_rows = cached_small_rows(model) if kwargs.get("small_row_linears", True) else {}
            tree = resolve_auto(model, heads, tokenizer, small_rows, calibration)
        return cls(model, heads, tokenizer=tokenizer, tree=tree, **kwargs)

    @classmethod
    def from_pretrained(cls, backbone: str = DEFAULT_BACKBONE, heads: str | None = None,
                        dtype: torch.dtype | str = DEFAULT_DTYPE, tree=None, revision: str | None = None,
                        device: str | torch.device | None = "auto", **kwargs) -> "SpeculativeGenerator":
        """Load backbone (alias / folder / Hub id) and heads (folder / Hub id; default: the shipped ones).

        device: where the backbone runs (``load_backbone``: "auto" takes the first CUDA GPU when there is one)."""
        if heads is None:
            heads = default_heads_path(backbone)
            if heads is None:
                raise FileNotFoundError(f"no heads are shipped for backbone {backbone!r}; pass heads=PATH_OR_REPO")
        model, tokenizer = load_backbone(backbone, dtype=dtype, device=device)
        warn_if_bf16_is_emulated(model)
        return cls.create(model, DraftHeads.from_pretrained(heads, revision=revision), tokenizer=tokenizer,
                          tree=tree, **kwargs)

    def make_drafter(self):
        """A fresh drafter for one generation."""
        return make_drafter(self.draft, self.model, self.heads, tree=self.tree_settings, lookup=self.lookup,
                            draft_vocab=self.draft_vocab, latency=self.latency, propose_cost=self.propose_cost)

    def describe(self) -> str:
        """What drafts, e.g. "hybrid drafting: dynamic tree, 8 nodes + prompt lookup"."""
        return f"{self.draft} drafting: {self.make_drafter().describe()}"

    # ---- inputs -----------------------------------------------------------------------------------------------
    def encode(self, prompt) -> torch.Tensor:
        """input_ids [1, T] on the backbone's device from a token tensor/list, a text, or chat messages (through the
        chat template).

        One prompt per call: a list of texts or of chats is refused (batches are not supported yet), as are an empty
        prompt, a chat message without content, and token ids outside the backbone's vocabulary."""
        device = self.model.get_output_embeddings().weight.device
        if isinstance(prompt, (list, tuple)) and prompt and all(_is_text_or_chat(p) for p in prompt):
            raise ValueError(f"batches are not supported yet: one prompt per call (got a list of {len(prompt)} "
                             "prompts)")
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(f"the prompt is empty ({'no text' if not prompt else 'only whitespace'}): expected text, "
                             "chat messages or token ids")
        if isinstance(prompt, str) or _is_chat(prompt):
            if self.tokenizer is None:
                raise ValueError("a text or chat prompt needs a tokenizer: pass tokenizer= or token ids")
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            else:
                _check_messages(prompt)
                ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=True,
                                                         return_tensors="pt")["input_ids"]
        else:
            ids = torch.as_tensor(prompt, dtype=torch.long, device=device)
        ids = ids.to(device)  # the tokenizer's are on the CPU
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
        if ids.shape[0] != 1:
            raise ValueError(f"only batch size 1 is supported, got a batch of {ids.shape[0]}")
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty (no tokens, or an empty list of messages)")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = ids[(ids < 0) | (ids >= vocab)].unique().tolist()
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(f"token ids out of the vocabulary: {shown} (the backbone's vocabulary has {vocab} ids, "
                             f"0..{vocab - 1})")
        return ids

    # ---- the loop ---------------------------------------------------------------------------------------------
    def _resolve_config(self, generation_config, max_new_tokens, overrides) -> tuple[GenerationConfig, int]:
        config = copy.deepcopy(generation_config if generation_config is not None else self.model.generation_config)
        for name, value in overrides.items():
            if value is not None:
                setattr(config, name, value)
        if max_new_tokens is None:
            max_new_tokens = (generation_config.max_new_tokens if generation_config is not None
                              and generation_config.max_new_tokens is not None else 128)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        return config, max_new_tokens

    @torch.inference_mode()
    def generate(self, prompt, max_new_tokens: int | None = None, streamer=None, *, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, seed: int | None = None, generator: torch.Generator | None = None,
                 generation_config: GenerationConfig | None = None,
                 typical: TypicalAcceptance | None = None) -> GenerationOutput:
        """Speculative generation whose output is the backbone's own.

        Greedy (default, or ``do_sample=False``, or temperature 0): tokens equal ``model.generate(do_sample=False)``.
        Sampling (``do_sample=True`` with temperature / top_k / top_p / min_p, or a ``generation_config``): lossless
        tree speculative sampling, distributed as ``model.generate(do_sample=True)`` (see ``sampling.py``); fixed
        ``seed`` or ``generator`` -> deterministic. ``typical=TypicalAcceptance(...)`` switches to Medusa's typical
        acceptance, which is faster but NOT distribution-preserving.

        Stops at any EOS id of the generation config, or at ``max_new_tokens`` (default: the generation config's,
        else 128). A prompt plus ``max_new_tokens`` beyond the backbone's context is refused up front.
        """
        config, max_new_tokens = self._resolve_config(
            generation_config, max_new_tokens,
            dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
        device = self.model.get_output_embeddings().weight.device  # where the backbone, heads and drafts run
        sampling = bool(config.do_sample) and config.temperature != 0
        if sampling:
            warpers = build_warpers(config)
            rng = make_generator(seed, generator, device)
            if typical is not None:
                accept = functools.partial(accept_typical, warpers=warpers, generator=rng, rule=typical)
            else:
                accept = functools.partial(accept_sampling, warpers=warpers, generator=rng)
        elif typical is not None:
            raise ValueError("typical acceptance is a sampling rule: pass do_sample=True with a temperature > 0")
        else:
            accept = accept_greedy
        input_ids = self.encode(prompt)  # [1, P] on the device: so are the sequences, as from model.generate
        prompt_len = input_ids.shape[1]
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and prompt_len + max_new_tokens > context:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{prompt_len + max_new_tokens} exceeds the backbone's context of {context} tokens")
        choose_root = (lambda logits: sample(target_probs(logits, warpers), rng)) if sampling else greedy_root
        new_tokens, stats = speculative_decode(self.model, self.make_drafter(), input_ids, max_new_tokens, accept,
                                               choose_root, eos_ids(config), streamer=streamer,
                                               attention=self.attention, small_rows=self.small_rows)
        sequences = torch.cat([input_ids, torch.tensor([new_tokens], dtype=torch.long, device=device)], dim=1)
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(sequences=sequences, new_tokens=new_tokens, stats=stats, text=text)


def _on_backbone(heads: DraftHeads, model) -> DraftHeads:
    """The heads in eval mode on the backbone's device and in its dtype (the lm_head's)."""
    weight = model.get_output_embeddings().weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval()


def _is_chat(prompt) -> bool:
    """Chat messages: a non-empty list of dicts ({"role": ..., "content": ...})."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _is_text_or_chat(prompt) -> bool:
    return isinstance(prompt, str) or _is_chat(prompt)


def _check_messages(messages) -> None:
    """ValueError for a chat message without text: a missing, empty or whitespace-only ``content``."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None or not (content.strip() if isinstance(content, str) else content):
            raise ValueError(f"chat message {i} ({message.get('role', 'no role')}) is empty: every message needs "
                             "content with text")
