"""Acceptance at temperature > 0: lossless tree speculative sampling, and Medusa's typical acceptance (lossy).

Target distribution p: the backbone's next-token distribution after the same logits warpers ``model.generate`` would
apply for the generation config (temperature, top-k, top-p, min-p; transformers' own warper classes, same order).

Proposal q: the drafts are *deterministic*: at a tree node the heads' top-k tokens x_1, ..., x_m (the node's children,
best rank first, all distinct) are proposed, each as a point mass q_i = delta(x_i).

Lossless rule (multi-draft speculative sampling, SpecInfer/Medusa style), applied level by level from the root:
  for i = 1..m: accept x_i with probability min(1, p(x_i) / q_i(x_i)) = p(x_i); on acceptance descend into x_i's node
  (its p is the backbone's distribution there, computed by the same tree forward); on rejection replace p by the
  normalised residual norm(max(0, p - q_i)), i.e. p with x_i's mass removed. If every child is rejected (or the node is
  a leaf) the bonus token is sampled from the current (residual) p, and the round ends.

Why the output is distributed exactly as p (one level; deeper levels follow by induction, since once x_i is emitted
the next level starts from the backbone's true conditional distribution after x_i): write p_0 = p and
p_i = p_{i-1} without x_i, renormalised, so p_i(y) = p(y) / (1 - p(x_1) - ... - p(x_i)) for y not in {x_1..x_i}.
The chance to reach sibling i is R_{i-1} = prod_{j<i} (1 - p_{j-1}(x_j)) = 1 - p(x_1) - ... - p(x_{i-1}) (telescoping).
So P(emit x_i) = R_{i-1} * p_{i-1}(x_i) = p(x_i), and for a token y never drafted
P(emit y) = R_m * p_m(y) = (1 - sum_j p(x_j)) * p(y) / (1 - sum_j p(x_j)) = p(y).
Hence every round emits each token with exactly the backbone's probability, and the sequence has the distribution of
plain sampling (``model.generate(do_sample=True)``) with the same generation config.

Typical acceptance (Medusa-2, *not* distribution-preserving): a candidate x at a node is accepted when
p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), H the entropy of p; the longest path of accepted
candidates wins and the bonus token is sampled from p at its last node. It trades exactness for longer acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from .decoding import Accepted
from tokenmaxx.heads.tree import TreeBuffers

UNSUPPORTED_WARPERS = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance: lossy; larger thresholds accept less."""

    posterior_threshold: float = 0.09  # hard cap on the probability a candidate needs
    posterior_alpha: float = 0.3  # scale of the entropy-adaptive threshold alpha * exp(-H)

    def __post_init__(self):
        if not 0 < self.posterior_threshold <= 1 or not 0 < self.posterior_alpha <= 1:
            raise ValueError(f"typical acceptance needs 0 < posterior_threshold, posterior_alpha <= 1, got "
                             f"{self.posterior_threshold}, {self.posterior_alpha}")


def build_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The warpers ``model.generate`` applies when sampling with this config (same classes, same order)."""
    for name in UNSUPPORTED_WARPERS:
        value = getattr(config, name, None)
        if value is not None and not (name == "typical_p" and value >= 1.0):
            raise ValueError(f"generation config sets {name}={value}, which tokenmaxx's sampling does not support; "
                             "supported: temperature, top_k, top_p, min_p")
    if config.temperature is not None and config.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature} (use do_sample=False)")
    if config.top_p is not None and not 0 < config.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {config.top_p}")
    if config.top_k is not None and config.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {config.top_k}")
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    return warpers


def target_probs(logits: torch.Tensor, warpers: LogitsProcessorList) -> torch.Tensor:
    """logits [..., V] -> p [..., V] in float32 after the warpers."""
    flat = logits.reshape(-1, logits.shape[-1]).float()  # [M, V]
    return warpers(None, flat).softmax(dim=-1).reshape(logits.shape)


def _uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1), made on the generator's device."""
    return float(torch.rand((), generator=generator, device=generator.device))


def sample(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token from p [V] (the generator on p's device)."""
    return int(torch.multinomial(p, 1, generator=generator))


def accept_sampling(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers, warpers: LogitsProcessorList,
                    generator: torch.Generator) -> Accepted:
    """Lossless multi-draft acceptance over the tree (see the module docstring for the rule and the proof).

    tokens: [N] tree tokens; logits: [N, V] backbone logits at each node.
    """
    node, path = 0, [0]
    p = target_probs(logits[0], warpers)  # [V]
    while True:
        for child in buffers.children[node]:
            x = int(tokens[child])
            if _uniform(generator) < p[x]:  # q = delta(x): min(1, p(x)/q(x)) = p(x)
                node = child
                path.append(child)
                p = target_probs(logits[child], warpers)
                break
            p[x] = 0.0  # residual max(0, p - q), renormalised
            p = p / p.sum()
        else:
            bonus = sample(p, generator)
            break
    nodes = torch.tensor(path, dtype=torch.long, device=logits.device)  # [m+1]
    return Accepted(nodes=nodes, tokens=tokens[nodes[1:]].tolist() + [bonus])


def accept_typical(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers, warpers: LogitsProcessorList,
                   generator: torch.Generator, rule: TypicalAcceptance) -> Accepted:
    """Medusa's typical acceptance (lossy): longest path whose candidates are all 'typical' under p at their parent."""
    p = target_probs(logits, warpers)  # [N, V]
    entropy = -(p * p.clamp_min(1e-12).log()).sum(dim=-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, rule.posterior_threshold),
                              rule.posterior_alpha * torch.exp(-entropy))  # [N]
    retrieve = buffers.to(p.device).retrieve  # [P, D+1]
    safe = retrieve.clamp(min=0)
    parents, children = safe[:, :-1], safe[:, 1:]
    prob = p[parents, tokens[children]]  # [P, D]: p at the parent of each candidate
    ok = (prob > threshold[parents]) & (retrieve[:, 1:] >= 0)
    accepted_len = ok.long().cumprod(dim=1).sum(dim=1)  # [P]
    best = int(accepted_len.argmax())
    nodes = retrieve[best, : int(accepted_len[best]) + 1]
    return Accepted(nodes=nodes, tokens=tokens[nodes[1:]].tolist() + [sample(p[nodes[-1]], generator)])


def make_generator(seed: int | None, generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The random source of a sampling generation on ``device`` (the backbone's, where the probabilities are): the
    caller's ``generator`` (which must be on that device), or a new one seeded with ``seed`` (None: a random seed
    from torch's global generator)."""
    if generator is not None and seed is not None:
        raise ValueError("pass either seed= or generator=, not both")
    if generator is not None:
        if generator.device != device:
            raise ValueError(f"generator= is on {generator.device} but the backbone is on {device}: make it with "
                             f"torch.Generator(device={str(device)!r})")
        return generator
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(2**62, (), device="cpu")))
    return gen

