"""SpeculativeGenerator: speculative generation whose output is the backbone's own.

Build it from objects (``SpeculativeGenerator(model, heads, tokenizer=tok)``: measures nothing, changes nothing on
``model``), through the factory that also measures this machine (``SpeculativeGenerator.create``: ``costs="auto"``
and ``tree="auto"`` resolved, ``measure.measure_costs``), or from names (``SpeculativeGenerator.from_pretrained``).
Each ``generate`` call makes a fresh drafter per row (``drafting.make_drafter``) and runs the loop (``loop.decode``;
one prompt is a batch of one row), so one generator (and one backbone) may serve several threads at once.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig

from tokenmaxx.heads import DEFAULT_BACKBONE, DraftHeads, default_heads_path, load_backbone, load_heads
from tokenmaxx.heads.attention import shared_kv_kwargs
from tokenmaxx.heads.io.backbones import EmulatedDtypeWarning
from tokenmaxx.heads.machine import free_memory, reads_are_free

from .budget import GateConfig
from .costs import Costs
from .decoding import accept_greedy, each_row
from .drafting import DEFAULT_DRAFT, NEEDS_HEADS, DraftSettings, check_draft_mode, make_drafter
from .kv import CACHES, kv_heads, static_length
from .lookup import LookupConfig
from .loop import STATIC_MARGIN, BatchStats, GenerationStats, decode, eos_ids, greedy_root
from .record import Recorder
from .runner import Runner
from .online import OnlineAdapt, OnlineLearner
from .measure import Calibration, announce_measuring, cached_small_rows, measure_costs, resolve_auto
from .sampling import TypicalAcceptance, accept_sampling, accept_typical, build_warpers, make_generator, sample, \
    target_probs

# "auto": bfloat16 where it is native (a GPU, a CPU with AVX-512 BF16 or AMX), the fastest measured there; float32 on a
# CPU without, where emulated bf16 was slower (docs/benchmarks.md). float32 where token identity must be exact.
DEFAULT_DTYPE = "auto"
AUTO = "auto"  # costs="auto": measure this machine (create / from_pretrained)

__all__ = ["DEFAULT_DTYPE", "BatchOutput", "GenerationOutput", "GenerationStats", "RawTextPromptWarning",
           "SpeculativeGenerator"]
MEMORY_HEADROOM = 0.8  # a batch may plan to use this share of the memory that is free before its prefill


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [1, T_prompt + T_new] prompt, then new tokens; on the backbone's device, as generate's
    new_tokens: list[int]
    stats: GenerationStats
    text: str | None = None  # decoded new tokens, when a tokenizer is known


@dataclass
class BatchOutput:
    """What ``generate`` returns for several prompts: one ``GenerationOutput`` per row, in the prompts' order (each
    row's ``sequences`` is its own prompt, unpadded, then its new tokens), and the batch's totals."""

    rows: list[GenerationOutput]
    stats: BatchStats

    @property
    def texts(self) -> list[str | None]:
        return [row.text for row in self.rows]

    @property
    def new_tokens(self) -> list[list[int]]:
        return [row.new_tokens for row in self.rows]


class NoTrainedHeadsWarning(UserWarning):
    """``from_pretrained`` found no trained heads for the backbone and drafts with prompt lookup alone."""


EmulatedBf16Warning = EmulatedDtypeWarning  # the name it had when only bf16 was checked


class RawTextPromptWarning(UserWarning):
    """A prompt given as a string (raw text, continued as written) to a backbone with a chat template ended at once
    with no text: an instruct backbone answers chat messages; see ``SpeculativeGenerator.generate``."""


def _warn_if_raw_text_ended_at_once(tokenizer, rows: list[list[int]], texts: list[str | None], eos: set[int]) -> None:
    """``RawTextPromptWarning`` when a raw-text prompt to a backbone with a chat template stopped at an EOS having said
    nothing (the message is the same each time, so Python shows it once)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return
    if any(tokens and tokens[-1] in eos and not (text or "").strip() for tokens, text in zip(rows, texts)):
        warnings.warn(RawTextPromptWarning(
            "a text prompt ended at once with no answer: a string is raw text, continued as written, and this backbone "
            "has a chat template (an instruct model answers chats); pass chat messages instead, e.g. "
            "[{'role': 'user', 'content': text}] (a batch: one list of messages per row)"), stacklevel=4)


class SpeculativeGenerator:
    """Speculative generation with draft heads on a frozen backbone; output equals the backbone's own.

    ``draft``: "hybrid" (heads + prompt lookup, the default), "heads" or "lookup" (no heads needed). ``tree``: the
    heads' tree settings as their kind reads them (EAGLE-3 and MTP heads: "dynamic", "dynamic:N",
    "dynamic:nodes=N,topk=K,..."; Medusa: a Tree, a list of paths, "default", "chain:K") or None for the heads' own;
    "auto" or "auto:prompts=N,tokens=T" (chosen for this machine) goes through ``SpeculativeGenerator.create``.
    ``lookup``: prompt-lookup settings; ``gate``: when heads that do not pay sit rounds out. ``draft_vocab``: heads
    with a draft vocabulary guess over it. ``costs``: what was measured about this machine (``costs.Costs``: verify
    latency, the heads' proposing time, the verifies' small-row plan), as ``create`` measures it with
    ``costs="auto"``; None: whole trees every round, every forward as the model computes it. The attention of the tree
    verifies follows the backbone's implementation (``heads.attention.shared_kv_kwargs``; ``load_backbone`` puts a
    CPU backbone on the one that shares key/value heads). ``cache``: the generation's KV cache, "dynamic" (grown and
    cropped each round), "static" (preallocated, trees padded to a few sizes, ``kv.StaticKV``) or "auto": static
    on an accelerator, dynamic on a CPU. ``capture``: compile each verify shape once (CUDA graphs on a GPU), eager
    where that fails; None: with a static cache on an accelerator. ``online``: adapt the heads in place to the
    traffic they serve (``online.OnlineAdapt``; off by default); the output stays the backbone's own.
    """

    def __init__(self, model, heads: DraftHeads | None, tokenizer=None, tree=None, strict_identity: bool = True,
                 draft: str = DEFAULT_DRAFT, lookup: LookupConfig | None = None, gate: GateConfig | None = None,
                 draft_vocab: bool = True, costs: Costs | None = None, cache: str = "auto",
                 capture: bool | None = None, online: OnlineAdapt | None = None):
        check_draft_mode(draft, heads)
        if cache not in ("auto",) + CACHES:
            raise ValueError(f"cache must be 'auto' or one of {CACHES}, got {cache!r}")
        accelerated = not reads_are_free(model.get_output_embeddings().weight.device)
        self.cache = cache if cache != "auto" else ("static" if accelerated else "dynamic")
        self.capture = (self.cache == "static" and accelerated) if capture is None else bool(capture)
        if self.capture and self.cache != "static":
            raise ValueError("capture=True needs cache='static' (a captured forward runs at fixed shapes)")
        if Calibration.parse(tree) is not None:
            raise ValueError(f"tree={tree!r} calibrates the tree on this machine: build the generator with "
                             "SpeculativeGenerator.create(model, heads, tokenizer=..., tree='auto') or from_pretrained")
        if isinstance(costs, str):
            raise ValueError(f"costs={costs!r}: measuring this machine is done by SpeculativeGenerator.create or "
                             "from_pretrained (costs='auto'); the constructor takes a Costs or None")
        if costs is not None and not isinstance(costs, Costs):
            raise TypeError(f"costs must be a tokenmaxx.inference.Costs or None, got {type(costs).__name__}")
        heads = _on_backbone(heads, model, strict_identity)
        self.model, self.heads, self.tokenizer, self.draft = model, heads, tokenizer, draft
        self.lookup = lookup or LookupConfig()
        self.gate = gate or GateConfig()
        self.draft_vocab = draft_vocab
        # the heads' tree settings as their kind parses them (here, once); None when only lookup drafts
        self.tree_settings = heads.tree_settings(heads.config, tree) if draft != "lookup" else None
        if online is not None and (heads is None or draft not in NEEDS_HEADS):
            raise ValueError("online adaptation trains the heads on what they serve: it needs heads drafting "
                             f"(draft='hybrid' or 'heads'), this generator drafts with {draft!r}")
        self.online = OnlineLearner(online, heads, model) if online is not None else None
        self.costs = costs
        # how forwards run here: the backbone's attention keywords, the measured small-row plan, capture
        self.runner = Runner(attention=shared_kv_kwargs(model), small_rows=costs.small_rows if costs is not None
                             else {}, capture=self.capture)

    @classmethod
    def create(cls, model, heads: DraftHeads | None, tokenizer=None, tree=None, costs: Costs | str | None = AUTO,
               **kwargs) -> "SpeculativeGenerator":
        """Like the constructor, with this machine measured: ``costs="auto"`` (the default) measures the costs the
        method is handed (``measure.measure_costs``: once per backbone, heads and machine, then cached), and
        ``tree="auto"`` chooses the heads' tree settings with the best expected tokens/s here (``measure.autotune``).
        ``tree="auto:prompts=N,tokens=T"`` (or a ``Calibration``) calibrates on the first N of its 8 prompts, T tokens
        each (default 8 and 128): quicker, noisier. A ``Costs`` or None is used as given."""
        if costs is not None and costs != AUTO and not isinstance(costs, Costs):
            raise ValueError(f"costs must be 'auto', a tokenmaxx.inference.Costs or None, got {costs!r}")
        calibration = Calibration.parse(tree)
        if calibration is not None and heads is None:
            raise ValueError("tree='auto' tunes the heads' trees: pass heads (or draft='lookup' without a tree)")
        draft, draft_vocab = kwargs.get("draft", DEFAULT_DRAFT), kwargs.get("draft_vocab", True)
        check_draft_mode(draft, heads)
        heads = _on_backbone(heads, model, kwargs.get("strict_identity", True))
        heads_drafting = heads if draft in NEEDS_HEADS else None
        # the heads' tree settings as their kind parses them
        tree = heads.tree_settings(heads.config, None if calibration is not None else tree) \
            if heads_drafting is not None else None
        if costs == AUTO:  # one line first, if anything is to be measured: what, why, where it is cached
            announce_measuring(model, heads_drafting, tree, draft_vocab)
        # the small-row plan first: the latency of tree='auto' and of the costs is measured as the verifies will run
        plan = (cached_small_rows(model) if costs == AUTO else dict(costs.small_rows) if costs is not None else {})
        if calibration is not None and heads_drafting is not None:
            tree = resolve_auto(model, heads, tokenizer, plan, calibration, tree)
        if costs == AUTO:
            costs = measure_costs(model, heads_drafting, tree, draft_vocab, small_rows=plan, announce=False)
        return cls(model, heads, tokenizer=tokenizer, tree=tree, costs=costs, **kwargs)

    @classmethod
    def from_pretrained(cls, backbone: str = DEFAULT_BACKBONE, heads: str | None = None,
                        dtype: torch.dtype | str = DEFAULT_DTYPE, tree=None, revision: str | None = None,
                        device: str | torch.device | None = "auto", **kwargs) -> "SpeculativeGenerator":
        """Load backbone (alias / folder / Hub id) and heads (folder / Hub id; default: the shipped ones), then
        ``create`` (``costs="auto"`` unless given). A backbone without shipped heads drafts with prompt lookup alone
        (``NoTrainedHeadsWarning``), unless ``draft`` asks for heads.

        device: where the backbone runs (``load_backbone``: "auto" takes the first CUDA GPU when there is one)."""
        if heads is None:
            heads = default_heads_path(backbone)
            if heads is None and kwargs.get("draft", "lookup") != "lookup":
                raise FileNotFoundError(f"no heads are shipped for backbone {backbone!r}: draft={kwargs['draft']!r} "
                                        "needs heads=PATH_OR_REPO (draft='lookup' runs without)")
            if heads is None:
                warnings.warn(NoTrainedHeadsWarning(
                    f"no trained heads are shipped for backbone {backbone!r}: drafting with prompt lookup alone; "
                    "train heads for it or pass heads=PATH_OR_REPO"), stacklevel=2)
                kwargs["draft"] = "lookup"
        model, tokenizer = load_backbone(backbone, dtype=dtype, device=device)
        loaded = load_heads(heads, revision=revision) if heads is not None else None
        return cls.create(model, loaded, tokenizer=tokenizer, tree=tree, **kwargs)

    def make_drafter(self, row: int = 0):
        """A fresh drafter for one generation (of its ``row``), its heads' passes run as the generator's runner runs
        them."""
        return make_drafter(self.draft, self.model, self.heads, DraftSettings(
            tree=self.tree_settings, lookup=self.lookup, gate=self.gate, draft_vocab=self.draft_vocab,
            costs=self.costs, passes=self.runner.passes(row)))

    def describe(self) -> str:
        """What drafts, e.g. "hybrid drafting: dynamic tree, 8 nodes + prompt lookup"."""
        return f"{self.draft} drafting: {self.make_drafter().describe()}"

    # ---- inputs -----------------------------------------------------------------------------------------------
    def encode(self, prompt) -> torch.Tensor:
        """input_ids [1, T] on the backbone's device from a token tensor/list, a text, or chat messages (through the
        chat template).

        One prompt (``generate`` splits a batch into its rows first); an empty prompt, a chat message without
        content, and token ids outside the backbone's vocabulary are refused."""
        device = self.model.get_output_embeddings().weight.device
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
            raise ValueError(f"one prompt per encode, got a batch of {ids.shape[0]} (generate takes batches)")
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty (no tokens, or an empty list of messages)")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = ids[(ids < 0) | (ids >= vocab)].unique().tolist()
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(f"token ids out of the vocabulary: {shown} (the backbone's vocabulary has {vocab} ids, "
                             f"0..{vocab - 1})")
        return ids

    # ---- batches ----------------------------------------------------------------------------------------------
    def _rows(self, prompt, attention_mask) -> list[torch.Tensor] | None:
        """A batch's rows as token ids [1, P_b] each, or None for a single prompt. Refuses, naming the row: an empty
        row, rows of different kinds (texts, chats, token ids), and a mask that does not fit the ids."""
        device = self.model.get_output_embeddings().weight.device
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and (prompt.shape[0] > 1 or attention_mask is not None):
            if attention_mask is not None and tuple(attention_mask.shape) != tuple(prompt.shape):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but the ids have "
                                 f"{tuple(prompt.shape)}: one mask entry per token")
            mask = torch.ones_like(prompt, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            rows = []
            for i in range(prompt.shape[0]):
                if not mask[i].any():
                    raise ValueError(f"row {i} of the batch is empty: its attention_mask marks no token")
                rows.append(self.encode(prompt[i][mask[i].to(prompt.device)]))
            return rows
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids [B, T]; texts and chats are padded by tokenizing")
        if not isinstance(prompt, (list, tuple)) or not prompt or _is_chat(prompt) or _kind(prompt) == "ids":
            return None  # one prompt: text, chat, or token ids
        kinds = [_kind(p) for p in prompt]
        for i, kind in enumerate(kinds):
            if kind is None:
                raise ValueError(f"row {i} of the batch is not a prompt (got {type(prompt[i]).__name__}): a batch "
                                 "is a list of texts, of chats (lists of messages) or of token-id lists")
        if len(set(kinds)) > 1:
            first = {kind: i for i, kind in reversed(list(enumerate(kinds)))}
            named = ", ".join(f"row {i} is {kind}" for kind, i in sorted(first.items(), key=lambda kv: kv[1]))
            raise ValueError(f"a batch mixes prompt types ({named}): pass rows of one kind")
        rows = []
        for i, row in enumerate(prompt):
            try:
                rows.append(self.encode(row).to(device))
            except ValueError as err:
                raise ValueError(f"row {i} of the batch: {err}") from None
        return rows

    def _check_rows(self, rows: list[torch.Tensor], max_new: list[int]) -> None:
        """ValueError for a row whose prompt and new tokens exceed the backbone's context, MemoryError for a batch
        that would not fit (``_check_memory``), before the prefill."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        for i, (ids, new) in enumerate(zip(rows, max_new)):
            if context is not None and ids.shape[1] + new > context:
                where = f"row {i}: prompt" if len(rows) > 1 else "prompt"
                raise ValueError(f"{where} ({ids.shape[1]} tokens) + max_new_tokens ({new}) = {ids.shape[1] + new} "
                                 f"exceeds the backbone's context of {context} tokens")
        if len(rows) > 1:
            self._check_memory(len(rows), max(ids.shape[1] for ids in rows) + max(max_new))

    def _check_memory(self, rows: int, positions: int) -> None:
        """MemoryError before the prefill when a batch of ``rows`` rows of up to ``positions`` cache entries (plus
        the largest tree each; a static cache: the positions it is allocated with) would not fit in
        ``MEMORY_HEADROOM`` of the memory free now: the KV cache, and the verify's logits (rows x nodes x vocabulary,
        in fp32 for the acceptance)."""
        config = self.model.config
        weight = self.model.get_output_embeddings().weight
        layers, (heads, head_dim) = getattr(config, "num_hidden_layers", 0), kv_heads(config)
        nodes = STATIC_MARGIN
        entries = positions + nodes if self.cache == "dynamic" else static_length(self.model, positions + nodes,
                                                                                   self.capture)
        cache = rows * entries * layers * 2 * heads * head_dim * weight.element_size()
        logits = rows * nodes * weight.shape[0] * 4
        need, free = cache + logits, free_memory(weight.device)
        if free is not None and need > MEMORY_HEADROOM * free:
            raise MemoryError(f"a batch of {rows} rows of up to {positions} positions needs about {_size(need)} (KV "
                              f"cache {_size(cache)}, verify logits {_size(logits)}) and {_size(free)} are free on "
                              f"{weight.device}: use fewer rows or a smaller max_new_tokens")

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
    def generate(self, prompt, max_new_tokens: int | list[int] | None = None, streamer=None, *,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, min_p: float | None = None, seed: int | None = None,
                 generator: torch.Generator | None = None, generation_config: GenerationConfig | None = None,
                 typical: TypicalAcceptance | None = None, attention_mask: torch.Tensor | None = None,
                 timed: bool | None = None, record: str | Path | None = None) -> GenerationOutput | BatchOutput:
        """Speculative generation whose output is the backbone's own.

        ``prompt``: one text, chat (a list of messages) or token ids [T] / [1, T] -> a ``GenerationOutput``; or
        a batch -> a ``BatchOutput`` (one result per row): a list of texts, of chats, or of token-id lists, or
        ids [B, T] (with ``attention_mask`` [B, T] marking each row's tokens when they are padded). As in
        transformers' pipelines and vLLM, a string is raw text, continued as written, and a list of messages is
        a chat, put through the tokenizer's chat template with the assistant's turn opened: an instruct backbone
        answers chats (``RawTextPromptWarning`` when a text prompt to a backbone with a chat template ends at
        once with no text). The rows are verified together, one backbone forward a round, each row's output what
        it would be alone; ``max_new_tokens`` may then be a list (one per row). A streamer takes one prompt.
        ``timed``: time each round's phases (``stats.phase_seconds``), which on an accelerator waits for it four
        times a round; None: where that is free (a CPU).
        ``record``: a folder to append this call's traffic to (every row: the backbone's states the heads read and
        its tokens; ``heads.io.traffic``), which ``tokenmaxx adapt`` trains the heads on; the output is unchanged.

        Greedy (default, or ``do_sample=False``, or temperature 0): tokens equal ``model.generate(do_sample=False)``.
        Sampling (``do_sample=True`` with temperature / top_k / top_p / min_p, or a ``generation_config``): lossless
        tree speculative sampling, distributed as ``model.generate(do_sample=True)`` (see ``sampling.py``); fixed
        ``seed`` or ``generator`` -> deterministic. ``typical=TypicalAcceptance(...)`` switches to Medusa's typical
        acceptance, which is faster but NOT distribution-preserving.

        Stops at any EOS id of the generation config, or at ``max_new_tokens`` (default: the generation config's,
        else 128). A prompt plus ``max_new_tokens`` beyond the backbone's context is refused up front.
        """
        rows = self._rows(prompt, attention_mask)
        if rows is not None and streamer is not None:
            raise ValueError(f"a streamer takes one prompt; this call has a batch of {len(rows)}: stream each prompt "
                             "on its own, or generate the batch without a streamer")
        if rows is None and isinstance(max_new_tokens, (list, tuple)):
            raise ValueError("max_new_tokens is a list (one per row) but the prompt is a single prompt")
        per_row = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else None
        if rows is not None and per_row is not None and len(per_row) != len(rows):
            raise ValueError(f"max_new_tokens lists {len(per_row)} values for a batch of {len(rows)} rows")
        config, max_new_tokens = self._resolve_config(
            generation_config, per_row[0] if per_row else max_new_tokens,
            dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
        if per_row:
            per_row = [self._resolve_config(generation_config, n, {})[1] for n in per_row]
        device = self.model.get_output_embeddings().weight.device  # where the backbone, heads and drafts run
        sampling = bool(config.do_sample) and config.temperature != 0
        if sampling:
            warpers = build_warpers(config)
            rng = make_generator(seed, generator, device)
            rule = functools.partial(accept_typical, rule=typical) if typical is not None else accept_sampling
            accept = each_row(functools.partial(rule, warpers=warpers, generator=rng))
        elif typical is not None:
            raise ValueError("typical acceptance is a sampling rule: pass do_sample=True with a temperature > 0")
        else:
            accept = accept_greedy
        recorder = None
        if record is not None or self.online is not None:
            recorder = Recorder(record, self.model, self.heads if self.draft in NEEDS_HEADS else None)
        batch = rows is not None
        rows = rows if batch else [self.encode(prompt)]  # [1, P_b] each, on the device: so are the sequences
        max_new = per_row or [max_new_tokens] * len(rows)
        self._check_rows(rows, max_new)
        input_ids = pad_sequence([ids[0] for ids in rows], batch_first=True, padding_side="left")
        mask = pad_sequence([torch.ones_like(ids[0], dtype=torch.bool) for ids in rows], True, padding_side="left")
        choose_root = (lambda logits, row: sample(target_probs(logits, warpers), rng)) if sampling else greedy_root
        drafters = [self.make_drafter(row) for row in range(len(rows))]
        if recorder is not None:
            drafters = [recorder.wrap(d) for d in drafters]
        tokens, stats = decode(self.model, drafters, input_ids, max_new, accept, choose_root, eos_ids(config),
                               attention_mask=None if len(rows) == 1 else mask, runner=self.runner, cache=self.cache,
                               costs=self.costs, streamer=streamer, timed=timed)
        if recorder is not None:
            traffic = recorder.finish(sampling)
            if self.online is not None:  # a call's traffic, to online adaptation
                self.online.add(traffic)
        outputs = []
        for ids, new, row_stats in zip(rows, tokens, stats.rows):
            text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
            sequences = torch.cat([ids, torch.tensor([new], dtype=torch.long, device=device)], dim=1)
            outputs.append(GenerationOutput(sequences=sequences, new_tokens=new, stats=row_stats, text=text))
        texts = prompt if batch else [prompt]
        if isinstance(texts, (list, tuple)) and _kind(texts[0]) == "text":
            _warn_if_raw_text_ended_at_once(self.tokenizer, [o.new_tokens for o in outputs],
                                            [o.text for o in outputs], eos_ids(config))
        return BatchOutput(rows=outputs, stats=stats) if batch else outputs[0]


def _size(size: float) -> str:
    """Bytes for a message: "1.5 GiB", "12.0 MiB", "64.0 KiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.1f} KiB"


def _kind(prompt) -> str | None:
    """What one row of a batch is: "text", "chat", "ids", or None for something else."""
    if isinstance(prompt, str):
        return "text"
    if _is_chat(prompt):
        return "chat"
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
        return "ids"
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "ids"
    return None


def _on_backbone(heads: DraftHeads | None, model, strict_identity: bool = True) -> DraftHeads | None:
    """The heads, checked against the backbone (``DraftHeads.check_backbone``), in eval mode on its device and in its
    dtype (the lm_head's)."""
    if heads is None:
        return None
    heads.check_backbone(model, strict_identity=strict_identity)
    weight = model.get_output_embeddings().weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval()


def _is_chat(prompt) -> bool:
    """Chat messages: a non-empty list of dicts ({"role": ..., "content": ...})."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _check_messages(messages) -> None:
    """ValueError for a chat message without text: a missing, empty or whitespace-only ``content``."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None or not (content.strip() if isinstance(content, str) else content):
            raise ValueError(f"chat message {i} ({message.get('role', 'no role')}) is empty: every message needs "
                             "content with text")
