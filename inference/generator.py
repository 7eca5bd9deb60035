"""SpeculativeGenerator: the decode loop (prefill, then propose -> verify -> accept -> commit rounds)."""

from __future__ import annotations

import copy
import functools
import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig

from tokenmaxx.heads import DEFAULT_BACKBONE, DraftHeads, MedusaHeads, default_heads_path, load_backbone

from .decoding import accept_greedy, commit, propose, verify
from .draft_vocab import DraftVocab
from .dynamic_tree import DynamicTreeConfig, MTPDrafter
from .lookup import DRAFT_MODES, HEADS, LOOKUP, SOURCE_NAMES, HeadsCalibration, HeadsGate, LookupConfig, \
    LookupReliability, NgramIndex, merge_branch, share_budget
from .sampling import TypicalAcceptance, accept_sampling, accept_typical, build_warpers, make_generator, sample, \
    target_probs
from .tree import Tree, chain, parse_tree


@dataclass
class GenerationStats:
    steps: int = 0  # speculative rounds (backbone forwards after the prefill)
    new_tokens: int = 0
    accepted_hist: dict[int, int] = field(default_factory=dict)  # tau -> number of rounds
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(  # decode time split by step: propose, verify, accept, commit
        default_factory=lambda: dict.fromkeys(("propose", "verify", "accept", "commit"), 0.0))
    accepted_by_source: dict[str, int] = field(  # accepted candidates by who drafted them (bonus tokens excluded)
        default_factory=lambda: dict.fromkeys(("heads", "lookup", "both"), 0))
    heads_skipped: int = 0  # hybrid: rounds drafted by lookup alone because the heads were not paying (HeadsGate)

    @property
    def mean_tau(self) -> float:
        """Tokens per backbone forward over the speculative rounds (accepted candidates + bonus)."""
        total = sum(t * c for t, c in self.accepted_hist.items())
        return total / self.steps if self.steps else 0.0

    @property
    def wall_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "new_tokens": self.new_tokens, "mean_tau": round(self.mean_tau, 4),
                "accepted_hist": dict(sorted(self.accepted_hist.items())), "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "wall_seconds": self.wall_seconds,
                "tokens_per_s": self.tokens_per_s, "phase_seconds": self.phase_seconds,
                "accepted_by_source": self.accepted_by_source, "heads_skipped": self.heads_skipped}


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [1, T_prompt + T_new] prompt followed by the new tokens (like model.generate)
    new_tokens: list[int]
    stats: GenerationStats
    text: str | None = None  # decoded new tokens, when a tokenizer is known


class SpeculativeGenerator:
    """Speculative generation with draft heads on a frozen backbone; output equals the backbone's own.

    Build it from objects (``SpeculativeGenerator(model, heads, tokenizer=tok)``) or names
    (``SpeculativeGenerator.from_pretrained("smollm2-135m")``, which loads the shipped heads). ``tree``: a Tree, a
    list of paths, "default", "chain:K", "auto" (chosen for this machine, see ``tree_search``), or None for the
    heads' own tree (``heads.config.tree``, else the default).
    """

    def __init__(self, model, heads: DraftHeads | None, tokenizer=None, tree: Tree | str | list | None = None,
                 strict_identity: bool = True, draft: str = "heads", lookup: LookupConfig | None = None,
                 draft_vocab: bool = True, adaptive_budget: bool = True):
        if draft not in DRAFT_MODES:
            raise ValueError(f"unknown draft mode {draft!r}: expected one of {DRAFT_MODES}")
        if heads is None:
            if draft != "lookup":
                raise ValueError(f"draft={draft!r} needs heads; only draft='lookup' runs without them")
            heads = MedusaHeads.for_backbone(model, num_heads=1)  # never called: lookup drafts only
        heads.check_backbone(model, strict_identity=strict_identity)
        self.draft = draft
        self.lookup = lookup or LookupConfig()
        # heads that carry a draft vocabulary guess over it + the prompt's tokens (draft_vocab=False: all tokens)
        self.use_draft_vocab = bool(draft_vocab) and getattr(heads, "draft_vocab", None) is not None and \
            heads.config.share_lm_head and (callable(getattr(heads, "step", None))
                                            or callable(getattr(heads, "head_states", None)))
        self.model = model
        self.heads = heads.to(model.get_output_embeddings().weight.dtype).eval()
        self.tokenizer = tokenizer
        if tree == "auto" and tokenizer is None:
            raise ValueError("tree='auto' calibrates on chat prompts: it needs the tokenizer")
        self.dynamic: DynamicTreeConfig | None = None  # sequential (mtp) heads draft dynamic trees
        if callable(getattr(heads, "step", None)):
            if tree == "auto":  # the node budget with the best tokens/s on this machine (cached)
                from .tree_search import auto_dynamic

                self.dynamic = auto_dynamic(model, self.heads, tokenizer)
            else:
                self.dynamic = _dynamic_config(tree if tree is not None else heads.config.extra.get("dynamic_tree"))
            self.tree = chain(0)
        elif tree == "auto":  # calibrated for this machine (cached per backbone + heads + machine)
            from .tree_search import auto_tree

            self.tree = auto_tree(model, self.heads, tokenizer)
        else:
            if isinstance(tree, DynamicTreeConfig) or (isinstance(tree, str) and tree.startswith("dynamic")):
                raise ValueError(f"tree {tree!r}: dynamic trees are drafted by sequential heads (kind 'mtp'); "
                                 f"these heads are {heads.config.kind!r}: use a static tree ('default', 'chain:K', "
                                 "'auto' or a list of paths)")
            self.tree = parse_tree(tree if tree is not None else heads.config.tree, heads.config.num_heads)
        if self.tree.depth > heads.config.num_heads:
            raise ValueError(f"tree depth {self.tree.depth} exceeds the number of heads ({heads.config.num_heads})")
        if draft == "lookup":
            self.tree = chain(0)
            self.dynamic = None
        # hybrid trees size themselves per step from this machine's verify latency per node count (cached)
        self.latency = None
        if draft == "hybrid" and adaptive_budget:
            from .tree_search import cached_latency

            self.latency = cached_latency(model)

    @classmethod
    def from_pretrained(cls, backbone: str = DEFAULT_BACKBONE, heads: str | None = None,
                        dtype: torch.dtype | str = torch.float32, tree=None, revision: str | None = None,
                        **kwargs) -> "SpeculativeGenerator":
        """Load backbone (alias / folder / Hub id) and heads (folder / Hub id; default: the shipped ones)."""
        if heads is None:
            heads = default_heads_path(backbone)
            if heads is None:
                raise FileNotFoundError(f"no heads are shipped for backbone {backbone!r}; pass heads=PATH_OR_REPO")
        model, tokenizer = load_backbone(backbone, dtype=dtype)
        return cls(model, DraftHeads.from_pretrained(heads, revision=revision), tokenizer=tokenizer, tree=tree,
                   **kwargs)

    # ---- inputs -----------------------------------------------------------------------------------------------
    def encode(self, prompt) -> torch.Tensor:
        """input_ids [1, T] from a token tensor/list, a text, or chat messages (through the chat template)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("a text or chat prompt needs a tokenizer: pass tokenizer= or token ids")
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("the prompt is empty")
                ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            else:
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True,
                                                         return_tensors="pt")["input_ids"]
        else:
            ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
        if ids.shape[0] != 1:
            raise ValueError(f"only batch size 1 is supported, got a batch of {ids.shape[0]}")
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty (no tokens)")
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
        sampling = bool(config.do_sample) and config.temperature != 0
        if sampling:
            warpers = build_warpers(config)
            rng = make_generator(seed, generator)
            if typical is not None:
                accept = functools.partial(accept_typical, warpers=warpers, generator=rng, rule=typical)
            else:
                accept = functools.partial(accept_sampling, warpers=warpers, generator=rng)
        elif typical is not None:
            raise ValueError("typical acceptance is a sampling rule: pass do_sample=True with a temperature > 0")
        else:
            accept = accept_greedy
        eos = config.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))

        input_ids = self.encode(prompt)
        prompt_len = input_ids.shape[1]
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and prompt_len + max_new_tokens > context:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{prompt_len + max_new_tokens} exceeds the backbone's context of {context} tokens")
        stats = GenerationStats()
        lm_head = self.model.get_output_embeddings()
        if streamer is not None:
            streamer.put(input_ids)

        start = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True,
                         **_last_logits_only(self.model, prompt_len))
        last = out.logits[0, -1]  # [V]
        root = sample(target_probs(last, warpers), rng) if sampling else int(last.argmax())
        hidden = out.hidden_states[-1][0, -1]  # [H]
        vocab = DraftVocab.for_prompt(self.heads.draft_vocab, lm_head, input_ids) if self.use_draft_vocab else None
        drafter = None
        if self.dynamic is not None:
            drafter = MTPDrafter(self.heads, self.model, self.dynamic, vocab=vocab)
            drafter.start(out.hidden_states[-1][0], input_ids[0], root)
        prefix_len = prompt_len
        new_tokens = [root]
        stats.prefill_seconds = time.perf_counter() - start
        if streamer is not None:
            streamer.put(torch.tensor([root]))

        start = time.perf_counter()
        phases = stats.phase_seconds
        use_lookup = self.draft in ("lookup", "hybrid")
        if use_lookup:
            index = NgramIndex(self.lookup.max_ngram)
            index.extend(input_ids[0].tolist() + [root])
            # hybrid: the branch is offered whole and the shared budget decides how much of it is kept
            lookup_len = self.lookup.max_len if self.draft == "hybrid" else self.lookup.start_len
            min_ngram = self.lookup.shortest_ngram(self.draft)
            # hybrid: one acceptance estimate per (matched n-gram length, branch rank): a continuation of a matched
            # trigram is surer than one of a single token, the most recent occurrence surer than older ones
            reliability: dict[tuple[int, int], LookupReliability] = {}
            calibration = HeadsCalibration()  # hybrid: how the heads' values compare with what is accepted here
            # hybrid: heads that have stopped paying for their proposing time sit out rounds
            gate = HeadsGate(self.lookup.heads_min_yield, self.lookup.heads_explore_every)
        heads_on = True
        while root not in eos_ids and len(new_tokens) < max_new_tokens:
            # A round emits at most depth + 1 tokens: drop nodes that could only overshoot max_new_tokens.
            t0 = time.perf_counter()
            room = max_new_tokens - len(new_tokens) - 1
            if self.draft == "hybrid":
                heads_on = gate.propose()
                stats.heads_skipped += not heads_on
            if drafter is not None:
                draft_tree = drafter.propose(root, room if heads_on else 0)
                tokens, buffers = draft_tree.tokens, draft_tree.buffers  # [N]
                values = draft_tree.scores.exp() if self.draft == "hybrid" else None  # draft path probabilities
            else:
                tree = self.tree.truncate(room if heads_on else 0)
                buffers = tree.buffers
                tokens = propose(self.heads, lm_head, hidden, root, buffers, vocab)  # [N]
                values = _static_values(tree) if self.draft == "hybrid" else None
            sources = None
            if use_lookup:
                if self.draft == "hybrid":  # lookup and heads nodes share the node budget, sized per step
                    matched, branches = index.continuations(min(lookup_len, room), min_ngram, self.lookup.branches)
                    rels = [reliability.setdefault((matched, rank), LookupReliability())
                            for rank in range(len(branches))]
                    budget = max(self.dynamic.nodes if self.dynamic else len(self.tree),
                                 max((len(b) for b in branches), default=0) + 1)
                    # sized from the cached latency table only (no wall-clock input): a seeded generation picks the
                    # same trees, hence the same samples, every time
                    latency = self.latency.at(prefix_len) if self.latency is not None else None
                    branch_values = [rel.values(len(b)) for rel, b in zip(rels, branches)]
                    tokens, buffers, sources, heads_values, branch_nodes = share_budget(
                        tokens, buffers, values, branches, branch_values, budget, latency, calibration.scale)
                else:
                    branch = index.continuation(min(lookup_len, room), min_ngram)
                    if branch:
                        tokens, buffers, sources = merge_branch(tokens, buffers, branch)  # [N'], [N']
            t1 = time.perf_counter()
            verified = verify(self.model, cache, tokens, buffers, prefix_len)
            t2 = time.perf_counter()
            accepted = accept(tokens, verified.logits, buffers)
            t3 = time.perf_counter()
            prefix_len = commit(cache, prefix_len, accepted.nodes)
            hidden = verified.hidden[accepted.nodes[-1]]  # [H]
            if drafter is not None:  # the module cache learns the accepted positions (timed as commit)
                drafter.advance(verified.hidden[accepted.nodes], torch.tensor(accepted.tokens))
            t4 = time.perf_counter()
            phases["propose"] += t1 - t0
            phases["verify"] += t2 - t1
            phases["accept"] += t3 - t2
            phases["commit"] += t4 - t3

            emitted = accepted.tokens[: max_new_tokens - len(new_tokens)]
            stop = next((i for i, tok in enumerate(emitted) if tok in eos_ids), None)
            if stop is not None:
                emitted = emitted[: stop + 1]
            stats.steps += 1
            stats.accepted_hist[len(accepted.tokens)] = stats.accepted_hist.get(len(accepted.tokens), 0) + 1
            path = accepted.nodes[1:].tolist()
            if sources is None:
                stats.accepted_by_source["lookup" if self.draft == "lookup" else "heads"] += len(path)
            else:
                path_sources = sources[path].tolist()
                for src in path_sources:
                    stats.accepted_by_source[SOURCE_NAMES[src]] += 1
                from_lookup = sum(1 for src in path_sources if src & LOOKUP)
                if self.draft == "hybrid":
                    for rel, nodes in zip(rels, branch_nodes):
                        if nodes:
                            rel.update_branch(nodes, path)
                    if heads_on:
                        calibration.update(float(heads_values[1:].sum()),
                                           sum(1 for src in path_sources if src & HEADS))
                        gate.update(sum(1 for src in path_sources if src == HEADS))
                else:
                    lookup_len = self.lookup.next_len(lookup_len, len(branch), from_lookup)
            if use_lookup:
                index.extend(emitted)
            new_tokens.extend(emitted)
            root = emitted[-1]
            if streamer is not None:
                streamer.put(torch.tensor(emitted))
        stats.decode_seconds = time.perf_counter() - start
        stats.new_tokens = len(new_tokens)
        if streamer is not None:
            streamer.end()
        sequences = torch.cat([input_ids, torch.tensor([new_tokens], dtype=torch.long)], dim=1)
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(sequences=sequences, new_tokens=new_tokens, stats=stats, text=text)


def _last_logits_only(model, prompt_len: int) -> dict:
    """Prefill keyword that has the backbone project only the last prompt position onto the vocabulary.

    The prefill needs the logits of the last position alone; all of them are [P, V] (SmolLM2: 40 ms and 39 MB at 400
    tokens, 0.8 GB in fp32 at 4,096). An index tensor rather than the int ``logits_to_keep=1``: the int slices a
    [1, 1, H] view with the prompt's batch stride, which torch 2.13 on CPU projects through a slow path with frozen
    weights (100 ms instead of 3 ms for SmolLM2's lm_head in bf16); indexing makes a fresh tensor. Models whose
    forward has no ``logits_to_keep`` get every position as before.
    """
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": torch.tensor([prompt_len - 1])}


@functools.lru_cache(maxsize=64)
def _static_values(tree: Tree) -> torch.Tensor:
    """Estimated acceptance probability of each node of a static tree (root first): the product of typical per-rank
    head accuracies along its path (``tree.TYPICAL_RANK_ACCURACY``, what the default tree is grown from)."""
    from .tree import TYPICAL_RANK_ACCURACY, path_probability

    return torch.tensor([1.0] + [path_probability(TYPICAL_RANK_ACCURACY, path) for path in tree.paths])


def _dynamic_config(spec) -> DynamicTreeConfig:
    """Dynamic-tree settings from a spec: None / 'default' / 'dynamic[:...]' / a dict / a DynamicTreeConfig."""
    if spec is None or spec == "default":
        return DynamicTreeConfig()
    if isinstance(spec, DynamicTreeConfig):
        return spec
    if isinstance(spec, dict):
        return DynamicTreeConfig(**spec)
    if isinstance(spec, str) and spec.startswith("dynamic"):
        return DynamicTreeConfig.parse(spec)
    raise ValueError(f"tree {spec!r}: sequential (mtp) heads draft dynamic trees; pass 'dynamic', 'dynamic:N' "
                     "(N nodes) or 'dynamic:nodes=N,topk=K,depth=D'")
