"""The heads' training objective: shifted self-distilled targets, per-head CE and/or KL, weights decaying with k.

Head offset rule: head k (k = 1..K) reading the backbone's hidden state at position t targets the token at t+k+1
(the backbone itself, reading t, predicts t+1). ``shifted_targets`` is the one place the rule is applied; the depth d
of a sequential kind (EAGLE-3, MTP) at anchor t follows it as head k = d.

A sequence is prompt + answer (the backbone's own answer); only targets inside the answer are trained. With
``loss="kl"`` head k at t is pulled towards the backbone's own next-token distribution at position t+k (which is the
backbone's prediction of the same token t+k+1), computed from the cached hidden state through the frozen lm_head,
or, where the run's features give it (``given_teacher``: recorded traffic keeps the backbone's top-k), the given
top-k renormalised over the loss vocabulary (``sparse_teacher``); a position without one is taught its own token.

Letters: B batch, T time, K heads (the draft depth of the sequential kinds), V vocabulary, H hidden size, n selected
positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .linear_ce import linear_cross_entropy

STATS = ("ce", "kl", "top1", "count")  # rows of the per-head stats tensor returned by HeadsObjective


def head_offset(k: int) -> int:
    """Head k at position t targets token t + head_offset(k) = t+k+1."""
    return k + 1


def shifted_targets(input_ids: torch.Tensor, answer_start: torch.Tensor, lengths: torch.Tensor,
                    num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of every head at every position, and where they are trained.

    input_ids: [B, T] (right-padded); answer_start: [B] first answer position; lengths: [B] real length.
    Returns targets [K, B, T] long (0 where undefined) and valid [K, B, T] bool: target position inside the answer.
    """
    bsz, seq = input_ids.shape
    device = input_ids.device
    targets = torch.zeros(num_heads, bsz, seq, dtype=torch.long, device=device)
    valid = torch.zeros(num_heads, bsz, seq, dtype=torch.bool, device=device)
    positions = torch.arange(seq, device=device)  # [T]
    for k in range(1, num_heads + 1):
        off = head_offset(k)
        if off >= seq:
            break
        targets[k - 1, :, : seq - off] = input_ids[:, off:]
        target_pos = positions + off  # [T]
        valid[k - 1] = (target_pos[None] >= answer_start[:, None]) & (target_pos[None] < lengths[:, None])
    return targets, valid


def head_weights(num_heads: int, decay: float) -> list[float]:
    """Loss weight of head k: decay**(k-1)."""
    return [decay ** (k - 1) for k in range(1, num_heads + 1)]


def teacher_rows(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions' backbone distributions the KL needs, and where head k at t finds its teacher row.

    valid: [K, B, T]. Returns need [B, T] bool (positions s = t+k used as a teacher) and row [K, B, T] long: the
    index among the needed positions (in ``hidden[need]`` order) of head k's teacher at t, -1 where not valid.
    """
    num_heads, bsz, seq = valid.shape
    device = valid.device
    need = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
    for k in range(1, num_heads + 1):
        need[:, k:] |= valid[k - 1, :, : seq - k]  # teacher of head k at t sits at t+k
    index = torch.full((bsz, seq), -1, dtype=torch.long, device=device)
    index[need] = torch.arange(int(need.sum()), device=device)
    row = torch.full((num_heads, bsz, seq), -1, dtype=torch.long, device=device)
    for k in range(1, num_heads + 1):
        row[k - 1, :, : seq - k] = torch.where(valid[k - 1, :, : seq - k], index[:, k:], -1)
    return need, row


def gives_teacher(features) -> bool:
    """Whether a run's features give a KL teacher per batch (``features.teacher(batch)``: top-k ids and log-probs
    [B, W, k], -inf where absent; adapt's recorded traffic)."""
    return callable(getattr(features, "teacher", None))


def sparse_teacher(given: tuple[torch.Tensor, torch.Tensor] | None, need: torch.Tensor, input_ids: torch.Tensor,
                   size: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """Dense teacher log-probs [m, size] at the needed positions (``need`` [B, T], m of them, in ``teacher_rows``
    order) from a given top-k: ids and log-probs [B, T, k] (-inf where a slot or a position has none) or None.

    The top-k tokens inside the loss vocabulary (``index``: token id -> position in it, -1 outside; None: every
    token, positions = ids) keep their log-probs, renormalised over them; the others get probability 0 (a finite
    -1e4, so that 0 * log 0 terms stay 0). A position whose top-k holds none of the vocabulary's tokens is taught
    its own next token (one-hot: the KL is then the cross-entropy).
    """
    device = input_ids.device
    nxt = torch.cat([input_ids[:, 1:], input_ids.new_zeros(input_ids.shape[0], 1)], dim=1)[need]  # [m]
    m = nxt.numel()
    if given is None:
        ids = nxt[:, None]
        logp = torch.zeros(m, 1, dtype=torch.float32, device=device)
    else:
        ids, logp = given[0][need].to(device, torch.long), given[1][need].to(device, torch.float32)  # [m, k]
    pos = ids if index is None else index[ids]
    keep = (pos >= 0) & torch.isfinite(logp)
    lone = ~keep.any(-1)  # [m]: nothing of the top-k in the vocabulary, or no top-k recorded: the token itself
    if lone.any():
        own = nxt[lone] if index is None else index[nxt[lone]]
        pos, logp, keep = pos.clone(), logp.clone(), keep.clone()
        pos[lone, 0], logp[lone, 0], keep[lone] = own.clamp(min=0), 0.0, False
        keep[lone, 0] = True
    logp = torch.where(keep, logp, float("-inf"))
    logp = logp - logp.logsumexp(-1, keepdim=True)
    teacher = torch.full((m, size), -1e4, dtype=torch.float32, device=device)
    rows = torch.arange(m, device=device)[:, None].expand_as(pos)
    teacher[rows[keep], pos[keep]] = logp[keep]
    return teacher


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None,
                         rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unfused reference of ``linear_cross_entropy`` on materialised logits [N, V] (heads with their own lm_heads,
    held-out metrics). targets, rows [N]; teacher [M, V] fp32 log-probs. Returns ce [N], kl [N], hit [N]."""
    log_q = F.log_softmax(logits.float(), dim=-1)  # [N, V]
    ce = -log_q.gather(1, targets[:, None]).squeeze(1)
    kl = torch.zeros_like(ce)
    if teacher is not None:
        log_p = teacher[rows]  # [N, V]
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    with torch.no_grad():
        hit = -ce >= log_q.amax(-1)  # the target is a top-1 token
    return ce, kl, hit


@dataclass
class Selection:
    """The positions of a batch where some head trains (n of them), with what they are scored against."""

    selected: torch.Tensor  # [B, T] bool: some head has a target here
    targets: torch.Tensor  # [K, n] long (0 where not valid)
    valid: torch.Tensor  # [K, n] bool
    teacher: torch.Tensor | None  # [m, V] fp32 log-probs of the backbone's own distributions (KL losses), or None
    row: torch.Tensor | None  # [K, n] index into teacher (-1 where not valid), or None
    in_vocab: torch.Tensor | None = None  # [K, n] bool: the target is in the loss vocabulary (None: all tokens are)

    @property
    def trained(self) -> torch.Tensor:
        """[K, n] bool: rows the loss scores (a valid target inside the loss vocabulary)."""
        return self.valid if self.in_vocab is None else self.valid & self.in_vocab


class HeadsObjective(nn.Module):
    """What DeepSpeed wraps: the heads (the only parameters) and their loss. The frozen lm_head and input embedding
    are passed per call, never registered here, so DeepSpeed neither casts, broadcasts nor checkpoints any backbone
    weight.

    The heads say what they compute (``DraftHeads.training_states``): per position for Medusa heads (only the
    selected positions are run), for sequential (MTP, EAGLE-3) heads depth 1 over the whole [B, T] batch (their
    depths attend over the sequence and read the tokens) and the deeper depths at the selected anchors; either way
    the result is [K, n, H] at the selected positions, and depth d obeys head k = d's offset rule.

    Heads that share the backbone's lm_head are scored through ``linear_cross_entropy`` on these states without
    materialising [K, n, V] logits; other heads through their logits.

    ``vocab`` (token ids, e.g. the heads' draft vocabulary): score over those tokens only, the distribution being
    the softmax over them (what drafting with that vocabulary ranks). Targets outside it are not trained; the
    targets and the KL teacher are re-indexed into it (``Selection.targets`` then holds positions in ``vocab``).

    ``given_teacher``: the KL teacher is the top-k the run's features give per batch (``forward``'s ``given``;
    ``sparse_teacher``), not the backbone's distribution computed from the final state (kept only for a KL loss:
    a cross-entropy run reads no teacher).
    """

    def __init__(self, heads: nn.Module, loss: str = "ce", head_decay: float = 0.8,
                 vocab: torch.Tensor | None = None, given_teacher: bool = False):
        super().__init__()
        self.heads = heads
        self.loss_kind = loss
        self.given_teacher = given_teacher and loss != "ce"
        self.weights = head_weights(heads.config.num_heads, head_decay)  # plain floats: not a checkpointed buffer
        self.fused = heads.config.share_lm_head  # scored through the frozen lm_head's weight (linear_cross_entropy)
        # plain attributes, not buffers: nothing here is trained or checkpointed
        self.vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long).flatten()
        if self.vocab is not None:
            distinct = self.vocab.unique().numel()
            if self.vocab.numel() == 0 or distinct != self.vocab.numel():
                raise ValueError(f"the loss vocabulary must be distinct token ids, got {self.vocab.numel()} ids with "
                                 f"{distinct} distinct")
        self._tables_key = self._tables = None  # see ``vocab_tables``, and which lm_head weight they were made from
        # heads that read other hidden states than the final-normed one (EAGLE-3) get it appended for the KL teacher:
        # their features are then [.., F + H], the last H columns the final state (``feature_layers`` says which)
        self.teacher_appended = loss != "ce" and heads.feature_layers is not None and not self.given_teacher

    def feature_layers(self, final: int) -> list[int] | None:
        """The backbone hidden states a batch's features hold (None: the final-normed state alone): the heads' own,
        and for the KL teacher the final state ``final`` after them where the heads do not read it."""
        layers = self.heads.feature_layers
        return [*layers, final] if self.teacher_appended else (None if layers is None else list(layers))

    def _split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the heads read, the final-normed state the teacher is computed from) of a batch's features."""
        if not self.teacher_appended:
            return hidden, hidden
        size = self.heads.config.hidden_size
        return hidden[..., :-size], hidden[..., -size:]

    def vocab_tables(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``vocab``: the lm_head rows at it [Vd, H] and token id -> position in it (-1 outside) [V]; built once
        per lm_head weight."""
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), weight.device)
        if self._tables_key != key:
            if int(self.vocab.max()) >= weight.shape[0]:
                raise ValueError(f"loss vocabulary has token id {int(self.vocab.max())}, but the lm_head has only "
                                 f"{weight.shape[0]} rows")
            vocab = self.vocab.to(weight.device)
            index = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
            index[vocab] = torch.arange(vocab.numel(), device=weight.device)
            self._tables, self._tables_key = (weight.detach()[vocab], index), key
        return self._tables

    def projection(self, lm_head: nn.Module) -> torch.Tensor:
        """The weight the heads' states are scored with: the lm_head's [V, H], or its rows at ``vocab`` [Vd, H]."""
        return lm_head.weight if self.vocab is None else self.vocab_tables(lm_head)[0]

    def _project(self, states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits over the loss vocabulary of final-normed states [..., H] through the frozen lm_head."""
        if self.vocab is None:
            return lm_head(states)
        if getattr(lm_head, "bias", None) is not None:
            return lm_head(states)[..., self.vocab.to(states.device)]
        return F.linear(states, self.projection(lm_head))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, answer_start: torch.Tensor,
                lengths: torch.Tensor, lm_head: nn.Module, embed: nn.Module | None = None,
                norm: torch.Tensor | None = None,
                given: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H] final-normed backbone states; input_ids [B, T]; answer_start, lengths [B]; embed: the
        backbone's input embedding (sequential heads read tokens through it); norm: see ``loss``; given: the batch's
        top-k teacher (``given_teacher``).

        Returns (weighted loss scalar, stats [len(STATS), K] detached: mean CE, mean KL, top-1 hits, target count).
        """
        sel = self.select(hidden, input_ids, answer_start, lengths, lm_head, given)
        num_heads, n = sel.targets.shape
        trained = sel.trained
        safe = torch.where(trained, sel.targets, 0).flatten()  # [K*n] (other rows get weight 0 below)
        rows = None if sel.row is None else sel.row.clamp(min=0).flatten()
        if self.fused and getattr(lm_head, "bias", None) is None:
            states = self.head_states(hidden, input_ids, sel.selected, embed)  # [K, n, H]
            ce, kl, hit = linear_cross_entropy(states.reshape(num_heads * n, -1), self.projection(lm_head), safe,
                                               sel.teacher, rows)
        else:
            logits = self.head_logits(hidden, input_ids, sel.selected, lm_head, embed)  # [K, n, V]
            ce, kl, hit = logits_cross_entropy(logits.reshape(num_heads * n, -1), safe, sel.teacher, rows)
        shape = (num_heads, n)
        return self.loss(ce.view(shape), kl.view(shape), hit.view(shape), trained, norm)

    def target_counts(self, input_ids: torch.Tensor, answer_start: torch.Tensor, lengths: torch.Tensor,
                      lm_head: nn.Module) -> torch.Tensor:
        """Rows the loss scores per head in a batch [K] (``Selection.trained`` counted, without any features)."""
        targets, valid = shifted_targets(input_ids, answer_start, lengths, len(self.weights))  # [K, B, T] x2
        if self.vocab is not None:
            valid = valid & (self.vocab_tables(lm_head)[1][targets] >= 0)
        return valid.sum((1, 2))

    def head_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, selected: torch.Tensor,
                    embed: nn.Module | None) -> torch.Tensor:
        """Every head's state before the vocabulary projection at the selected positions [K, n, H] (heads' dtype).

        hidden [B, T, H]; input_ids [B, T]; selected [B, T] bool; embed: the backbone's input embedding.
        """
        dtype = next(self.heads.parameters()).dtype
        return self.heads.training_states(self._split(hidden)[0].to(dtype), input_ids, embed, selected)

    def head_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor, selected: torch.Tensor, lm_head: nn.Module,
                    embed: nn.Module | None) -> torch.Tensor:
        """Every head's logits at the selected positions [K, n, V] (V: the loss vocabulary's size; same arguments as
        ``head_states``)."""
        states = self.head_states(hidden, input_ids, selected, embed)
        if self.fused:
            return self._project(states, lm_head)
        logits = self.heads.project(states, lm_head)
        return logits if self.vocab is None else logits[..., self.vocab.to(logits.device)]

    def select(self, hidden: torch.Tensor, input_ids: torch.Tensor, answer_start: torch.Tensor,
               lengths: torch.Tensor, lm_head: nn.Module,
               given: tuple[torch.Tensor, torch.Tensor] | None = None) -> Selection:
        """The positions where some head trains, with their targets and KL teacher rows (the backbone's own
        distributions, through the frozen lm_head, or the given top-k (``given_teacher``), for ``loss`` "kl" and
        "ce+kl")."""
        num_heads = len(self.weights)
        targets, valid = shifted_targets(input_ids, answer_start, lengths, num_heads)  # [K, B, T] x2
        selected = valid.any(0)  # [B, T]
        teacher = row = None
        if self.loss_kind != "ce":
            dtype = next(self.heads.parameters()).dtype
            need, row = teacher_rows(valid)  # [B, T], [K, B, T]
            with torch.no_grad():
                if self.given_teacher:
                    index = None if self.vocab is None else self.vocab_tables(lm_head)[1]
                    size = lm_head.weight.shape[0] if self.vocab is None else self.vocab.numel()
                    teacher = sparse_teacher(given, need, input_ids, size, index)  # [m, V]
                else:
                    final = self._split(hidden)[1]
                    teacher = F.log_softmax(self._project(final[need].to(dtype), lm_head).float(), dim=-1)  # [m, V]
            row = row[:, selected]  # [K, n]
        targets = targets[:, selected]  # [K, n]
        in_vocab = None
        if self.vocab is not None:
            targets = self.vocab_tables(lm_head)[1][targets]
            in_vocab = targets >= 0
            targets = targets.clamp(min=0)
        return Selection(selected, targets, valid[:, selected], teacher, row, in_vocab)

    def loss(self, ce: torch.Tensor, kl: torch.Tensor, hit: torch.Tensor, valid: torch.Tensor,
             norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row ce, kl, top-1 hit, valid [K, n] -> (loss, stats [len(STATS), K]).

        loss = sum_k w_k * mean over head k's valid rows of its loss / sum_k w_k, over heads with targets here.
        ``norm`` [K]: divide head k's summed loss by norm[k] instead of this batch's count (heads with norm 0 drop
        out). The trainer passes a step's count per micro-batch (``target_counts`` summed over the step, divided by
        its micro-batches), so that after gradient accumulation every target of the step weighs the same, whatever
        batch it fell in (the batches of a step are grouped by length, so their counts differ systematically).
        """
        mask = valid.float()  # [K, n]
        count = mask.sum(1)  # [K]
        denom = count if norm is None else norm.to(count)
        weights = torch.tensor(self.weights, device=count.device) * (denom > 0)  # [K]
        scale = (weights / denom.clamp(min=1e-6) / weights.sum().clamp(min=1e-12))[:, None] * mask  # [K, n]
        total = (ce * 0.0).sum()  # a zero that keeps the graph even when no head has a target
        if self.loss_kind in ("ce", "ce+kl"):
            total = total + (ce * scale).sum()
        if self.loss_kind in ("kl", "ce+kl"):
            total = total + (kl * scale).sum()
        stats = torch.stack([(ce.detach() * mask).sum(1), (kl.detach() * mask).sum(1),
                             (hit & valid).sum(1).float(), count])  # [4, K]
        stats[:2] /= count.clamp(min=1)
        return total, stats
