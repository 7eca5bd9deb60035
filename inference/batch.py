"""Speculative rounds over a batch: every row drafts its own tree, ONE backbone forward verifies all of them, each row
accepts and commits its own length.

Layout of the backbone's cache (transformers' ``DynamicCache``, rows [B, heads, C, dim]): the prompts are
left-padded, so after the prefill every row's entries end at the same index; from then on each row keeps its own
length L_b. A round appends every row's tree at the common end W = max L_b (trees padded to a common node count with
nodes that see only themselves), then each row gathers its accepted path to L_b..L_b+m_b, and the cache is cropped
to the new max L_b. A row that accepted less than the longest holds stale entries between its L_b and W ("holes"):
``live`` [B, C] marks each row's live entries, and the verify mask lets a node see exactly its row's live prefix and
its own ancestors. Position ids are per row (its real tokens so far, plus the node's depth), so a row computes what it
would alone. Holes were chosen over compacting every row to a common length each round (a copy of the whole cache
per round, or per-row shifts of it) because they cost nothing but mask columns: at most the spread of the rows'
accepted lengths since the last crop, which a crop to max L_b removes for the longest row each round.

A row that finishes (EOS, its ``max_new_tokens``) leaves the batch: its cache rows are dropped, so later rounds
neither verify nor attend for it.

The prefill runs in groups of rows of similar prompt length where the measured latency says padding costs time
(``prefill_groups``), assembled into the one left-padded cache. The rows' proposals run in lockstep
(``drafting.propose_rows``): each tree level of every row's draft is one module pass for the batch.

Letters: B rows, N tree nodes (common, padded), C cache entries, V vocabulary, F features the drafter reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from tokenmaxx.heads.drafting import Draft, Outcome, Prefill, propose_rows
from tokenmaxx.heads.machine import clock
from tokenmaxx.heads.modeling import backbone_features

from .costs import Costs, VerifyLatency, interpolate
from .decoding import Accepted, accept_greedy
from .forward import ForwardContext
from .loop import GenerationStats, Throughput, _emitted, _last_logits_only

Accept = Callable[[torch.Tensor, torch.Tensor, object], Accepted]


@dataclass
class LoadGate:
    """Whether a round of the batch drafts at all, on the measured costs.

    A drafting round of B rows verifies about ``nodes`` nodes a row and runs the rows' proposals (together,
    ``drafting.propose_rows``): it yields B x tau tokens in verify(B x nodes) + propose(B) seconds; a plain round
    yields B tokens in verify(B). Drafting goes on while it is the faster of the two by these running means (decayed,
    from the batch's drafting rounds; an optimistic start drafts the first rounds); otherwise the round is plain
    batched decoding, except one that drafts to keep the means current: ``explore_every`` plain rounds after drafting
    last won, then twice as many after each exploration that did not win it back, up to ``max_interval`` (a batch too
    large for drafting to pay pays for an exploration ever more rarely). The time of a round comes from the latency
    table, never a clock, so a seeded generation repeats itself."""

    latency: VerifyLatency
    # seconds of a round's proposals by rows (``Costs.propose_time``)
    propose: Callable[[int], float] = lambda rows: 0.0
    decay: float = 0.8
    explore_every: int = 8
    max_interval: int = 64
    tau: float = 2.0  # decayed mean tokens a row per drafting round
    nodes: float = 4.0  # decayed mean nodes a row per drafting round (the forward's: every row padded to the largest)
    _plain: int = 0  # plain rounds since the last drafting one
    _interval: int = 0  # plain rounds before the next exploration (0: explore_every)

    def draft(self, rows: int, prefix_len: int) -> bool:
        table = self.latency.at(prefix_len)
        drafting = rows * self.tau / (interpolate(table, rows * self.nodes) + self.propose(rows))
        plain = rows / interpolate(table, rows)
        interval = self._interval or self.explore_every
        if drafting >= plain:
            self._plain, self._interval = 0, self.explore_every
            return True
        if self._plain + 1 >= interval:  # an exploration; the next one waits longer unless drafting wins meanwhile
            self._plain, self._interval = 0, min(2 * interval, max(self.max_interval, self.explore_every))
            return True
        self._plain += 1
        return False

    def update(self, tau: float, nodes: float) -> None:
        """After a drafting round: its tokens a row and the nodes it verified a row (the largest row's)."""
        self.tau = self.decay * self.tau + (1 - self.decay) * tau
        self.nodes = self.decay * self.nodes + (1 - self.decay) * nodes


@dataclass
class BatchStats(Throughput):
    """Statistics of a batched generation: per row (``rows``, a ``GenerationStats`` each: its rounds, tokens, tau),
    and the batch's own forwards and time."""

    rows: list[GenerationStats]
    forwards: int = 0  # backbone forwards after the prefill (each verifies every active row's tree)
    drafting_forwards: int = 0  # of those, the rounds whose rows drafted (the others: plain batched decoding)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    active_per_forward: list[int] = field(default_factory=list)  # rows still generating at each forward
    nodes_per_forward: list[int] = field(default_factory=list)  # each forward's tree size per row (the largest row's)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "forwards": self.forwards,
                "drafting_forwards": self.drafting_forwards, "new_tokens": self.new_tokens,
                "mean_nodes": sum(self.nodes_per_forward) / max(self.forwards, 1),
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "wall_seconds": self.wall_seconds, "tokens_per_s": self.tokens_per_s}


def batched_decode(model, drafters: Sequence, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   max_new_tokens: Sequence[int], accept: Accept | Sequence[Accept],
                   choose_root: Callable[[torch.Tensor, int], int], eos: set[int],
                   forward: ForwardContext | None = None,
                   costs: Costs | None = None) -> tuple[list[list[int]], BatchStats]:
    """Generate for B left-padded prompts at once: input_ids [B, T], attention_mask [B, T] (1 for real tokens, 0 for
    the left padding); one drafter per row (``drafting.Drafter``), each row's ``max_new_tokens`` and acceptance rule
    (one for all, or one per row); ``choose_root(logits [V], row)`` picks a row's first token. Returns each row's
    new tokens and the statistics. Each row's tokens are what ``speculative_decode`` would give it alone.
    ``costs``: this machine's measured costs; with a latency table the batch's load decides each round whether the
    rows draft at all (``LoadGate``) and the budget drafters price their nodes at it; None: every round drafts."""
    batch = input_ids.shape[0]
    if len(drafters) != batch or len(max_new_tokens) != batch:
        raise ValueError(f"{batch} rows need {batch} drafters and max_new_tokens, got {len(drafters)} and "
                         f"{len(max_new_tokens)}")
    accepts = list(accept) if isinstance(accept, (list, tuple)) else [accept] * batch
    device = model.get_output_embeddings().weight.device
    forward = forward or ForwardContext()
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device=device, dtype=torch.bool)
    # a row's own times are not measured (the batch is timed as a whole): None
    stats = BatchStats(rows=[GenerationStats(timed=False, prefill_seconds=None, decode_seconds=None)
                             for _ in range(batch)])
    feature_layers = drafters[0].feature_layers

    start = clock(device)
    lengths = attention_mask.sum(1).tolist()  # real prompt tokens per row
    table = costs.latency.at(0) if costs is not None and costs.latency else None
    cache, hidden, last_logits = _prefill(model, input_ids, attention_mask, prefill_groups(lengths, table),
                                          feature_layers)
    roots = [choose_root(last_logits[b], b) for b in range(batch)]
    width = hidden.shape[1]  # W: the longest prompt; every row's entries end there
    for b, drafter in enumerate(drafters):
        real = slice(width - lengths[b], width)
        drafter.start(Prefill(input_ids=input_ids[b, input_ids.shape[1] - lengths[b]:], hidden=hidden[b, real],
                              root=roots[b]))
    stats.prefill_seconds = clock(device) - start

    new_tokens = [[root] for root in roots]
    rows = list(range(batch))  # the batch's rows still generating, by their index in the inputs
    live = attention_mask[:, attention_mask.shape[1] - width:].clone()  # [B', C] each active row's live entries
    ends = [width] * batch  # per active row: cache index after its last live entry (L_b)
    next_pos = list(lengths)  # per active row: position id of its root
    gate = LoadGate(costs.latency, costs.propose_time) if costs is not None and costs.latency else None
    start = clock(device)
    while True:
        keep = [i for i, row in enumerate(rows) if not _done(new_tokens[row], max_new_tokens[row], eos)]
        if len(keep) < len(rows):  # finished rows leave the batch
            rows = [rows[i] for i in keep]
            if not rows:
                break
            index = torch.tensor(keep, device=device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            live, ends, next_pos = live.index_select(0, index), [ends[i] for i in keep], [next_pos[i] for i in keep]
        for row in rows:  # the load each row's trees are priced at (budget drafters; others draft as they do)
            if hasattr(drafters[row], "share_forward"):
                drafters[row].share_forward(len(rows))
        drafting = gate is None or gate.draft(len(rows), max(ends))
        # a plain round proposes nothing (room 0: the root alone)
        drafts = propose_rows([drafters[row] for row in rows], [new_tokens[row][-1] for row in rows],
                              [max_new_tokens[row] - len(new_tokens[row]) - 1 if drafting else 0 for row in rows])
        verified_logits, verified_hidden = _verify(model, cache, live, ends, next_pos, drafts, forward,
                                                   feature_layers)
        stats.forwards += 1
        stats.active_per_forward.append(len(rows))
        stats.nodes_per_forward.append(verified_logits.shape[1])
        common = cache.get_seq_length() - verified_logits.shape[1]  # W: where every row's tree was appended
        if all(accepts[row] is accept_greedy for row in rows):  # every row greedy: one read for the batch
            results = accept_rows_greedy(drafts, verified_logits)
        else:
            results = [accepts[row](draft.tokens, verified_logits[i, :draft.num_nodes], draft.buffers)
                       for i, (row, draft) in enumerate(zip(rows, drafts))]
        live = _commit(cache, live, ends, common, results)
        stats.drafting_forwards += drafting
        if drafting and gate is not None:
            gate.update(sum(len(a.path) for a in results) / len(results), verified_logits.shape[1])
        for i, row in enumerate(rows):
            accepted, draft = results[i], drafts[i]
            emitted = _emitted(accepted.tokens, max_new_tokens[row] - len(new_tokens[row]), eos)
            outcome = Outcome(draft=draft, nodes=accepted.nodes, tokens=accepted.tokens,
                              hidden=verified_hidden[i, accepted.nodes], emitted=emitted, path=accepted.path,
                              token_ids=accepted.token_ids)
            drafters[row].observe(outcome)
            stats.rows[row].record(outcome, [])
            new_tokens[row].extend(emitted)
            next_pos[i] += len(accepted.path)
    stats.decode_seconds = clock(device) - start
    for row, tokens in enumerate(new_tokens):
        stats.rows[row].new_tokens = len(tokens)
        stats.rows[row].finish()
    return new_tokens, stats


def prefill_groups(lengths: Sequence[int], latency: dict[int, float] | None) -> list[list[int]]:
    """The rows' prefills as groups of rows, each one left-padded forward: the grouping of the rows sorted by length
    whose forwards cost least on ``latency`` (seconds per token count, ``VerifyLatency.at``; a group of g rows padded
    to its longest prompt L costs what g x L tokens cost, extrapolated past the measured sizes). Where a forward's
    cost grows with its tokens (a CPU), rows of very different lengths get their own forwards instead of paying for
    the padding; where it stays flat (a GPU's small batches), one forward holds them all. None: one forward for all
    rows, as the model computes a batch."""
    if latency is None or len(lengths) == 1:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda b: lengths[b])
    ordered = [lengths[b] for b in order]
    best, cut = [0.0], [0]  # best[i]: the cheapest prefill of the i shortest rows; cut[i]: where its last group starts
    for i in range(1, len(order) + 1):
        choice = min(range(i), key=lambda j: best[j] + interpolate(latency, (i - j) * ordered[i - 1]))
        best.append(best[choice] + interpolate(latency, (i - choice) * ordered[i - 1]))
        cut.append(choice)
    groups, end = [], len(order)
    while end:
        groups.append(sorted(order[cut[end]:end]))
        end = cut[end]
    return groups[::-1]


def _prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, groups: list[list[int]],
             feature_layers) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """The prefill of left-padded rows input_ids [B, T] in ``groups`` (``prefill_groups``), each group one forward
    padded to its own longest prompt, assembled into one cache left-padded to the longest prompt W. Returns the cache
    (rows [B, heads, W, dim]), the features [B, W, F] and the last position's logits [B, V]."""
    batch, total = input_ids.shape
    width = int(attention_mask.sum(1).max())  # W (columns of padding in every row are dropped)
    parts = []
    for group in groups:
        index = torch.tensor(group, device=input_ids.device)
        ids, mask = input_ids[index, total - width:], attention_mask[index, total - width:]
        own = int(mask.sum(1).max())  # the group's longest prompt
        ids, mask = ids[:, width - own:], mask[:, width - own:]
        cache = DynamicCache(config=model.config)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, past_key_values=cache,
                    use_cache=True, output_hidden_states=True, **_last_logits_only(model, own))
        parts.append((index, own, cache, backbone_features(out.hidden_states, feature_layers), out.logits[:, -1]))
    if len(parts) == 1:
        _, _, cache, hidden, logits = parts[0]
        return cache, hidden, logits
    index, own, first, hidden_part, logits_part = parts[0]
    hidden = hidden_part.new_zeros(batch, width, hidden_part.shape[-1])
    logits = logits_part.new_empty(batch, logits_part.shape[-1])
    cache = DynamicCache(config=model.config)
    for layer_idx, layer in enumerate(first.layers):  # zeros in the padding: masked, never read
        shape = (batch, layer.keys.shape[1], width, layer.keys.shape[-1])
        cache.update(layer.keys.new_zeros(shape), layer.values.new_zeros(shape[:-1] + layer.values.shape[-1:]),
                     layer_idx)
    for index, own, part, hidden_part, logits_part in parts:
        for layer, done in zip(cache.layers, part.layers):
            layer.keys[index, :, width - own:] = done.keys
            layer.values[index, :, width - own:] = done.values
        hidden[index, width - own:] = hidden_part
        logits[index] = logits_part
    return cache, hidden, logits


def accept_rows_greedy(drafts: list[Draft], logits: torch.Tensor) -> list[Accepted]:
    """``decoding.accept_greedy`` for every row of a batch at once, read back in one read: drafts' trees of up to N
    nodes (their paths padded to a common count and depth with -1) and the forward's logits [B', N, V]."""
    device = logits.device
    rows, n = len(drafts), logits.shape[1]
    depth = max(d.buffers.depth for d in drafts)
    paths = max(d.buffers.retrieve.shape[0] for d in drafts)
    retrieve = torch.full((rows, paths, depth + 1), -1, dtype=torch.long, device=device)  # [B', P, D+1]
    tokens = torch.zeros(rows, n, dtype=torch.long, device=device)  # [B', N]
    for i, draft in enumerate(drafts):
        own = draft.buffers.to(device).retrieve
        retrieve[i, : own.shape[0], : own.shape[1]] = own
        tokens[i, : draft.num_nodes] = draft.tokens
    predicted = logits.max(dim=-1).indices  # [B', N] (max: argmax's first-index ties, as accept_greedy)
    safe = retrieve.clamp(min=0)
    flat = safe.flatten(1)  # [B', P*(D+1)]
    nodes_tok = tokens.gather(1, flat).view_as(safe)  # [B', P, D+1]
    nodes_pred = predicted.gather(1, flat).view_as(safe)
    correct = (nodes_tok[..., 1:] == nodes_pred[..., :-1]) & (retrieve[..., 1:] >= 0)  # [B', P, D]
    accepted_len = correct.long().cumprod(dim=-1).sum(dim=-1)  # [B', P]
    best = accepted_len.argmax(dim=1)  # [B']
    index = torch.arange(rows, device=device)
    row, m = safe[index, best], accepted_len[index, best]  # [B', D+1], [B']
    bonus = predicted.gather(1, row.gather(1, m[:, None]))  # [B', 1]
    candidates = tokens.gather(1, row[:, 1:])  # [B', D]
    read = torch.cat([m[:, None], row, candidates, bonus], dim=1).tolist()  # one read: [B', 1 + D+1 + D + 1]
    width = depth + 1
    out = []
    for i, values in enumerate(read):
        length = values[0]
        out.append(Accepted(nodes=row[i, : length + 1], tokens=values[1 + width: 1 + width + length] + values[-1:],
                            path=values[1: 2 + length],
                            token_ids=torch.cat([candidates[i, :length], bonus[i]])))
    return out


def _done(tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return tokens[-1] in eos or len(tokens) >= max_new_tokens


def _verify(model, cache, live: torch.Tensor, ends: list[int], next_pos: list[int], drafts: list[Draft],
            forward: ForwardContext, feature_layers) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over every active row's tree, appended at the cache's common end W. Trees are padded to the
    largest one's node count; a padding node sees only itself. Returns logits [B', N, V] and features [B', N, F]."""
    weight = model.get_output_embeddings().weight
    device, dtype = weight.device, weight.dtype
    rows, common = len(drafts), live.shape[1]
    n = max(d.num_nodes for d in drafts)
    tokens = torch.zeros(rows, n, dtype=torch.long, device=device)
    visible = torch.zeros(rows, n, common + n, dtype=torch.bool, device=device)  # [B', N, W+N]
    visible[:, :, :common] = live[:, None, :]
    depths = torch.zeros(rows, n, dtype=torch.long, device=device)
    pad_eye = torch.eye(n, dtype=torch.bool, device=device)
    for i, draft in enumerate(drafts):
        k = draft.num_nodes
        buffers = draft.buffers.to(device)
        tokens[i, :k] = draft.tokens
        depths[i, :k] = buffers.depths
        visible[i, :k, common: common + k] = buffers.attn_mask
        if k < n:  # padding nodes: themselves only (their rows are never read)
            visible[i, k:, :common] = False
            visible[i, k:, common:] = pad_eye[k:]
    bias = torch.zeros(rows, 1, n, common + n, dtype=dtype, device=device)
    bias.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    position_ids = torch.tensor(next_pos, device=device)[:, None] + depths  # [B', N]
    out = forward(model, input_ids=tokens, attention_mask=bias, position_ids=position_ids, past_key_values=cache,
                  use_cache=True, output_hidden_states=True)
    return out.logits, backbone_features(out.hidden_states, feature_layers)


def _commit(cache, live: torch.Tensor, ends: list[int], common: int, results: list[Accepted]) -> torch.Tensor:
    """Each row's accepted path from its tree (appended at ``common``) to its own end L_b, and the cache cropped to
    the longest row; ``ends`` follows in place. Returns the new live-entry mask [B', max L_b]."""
    new_ends = [end + len(acc.path) for end, acc in zip(ends, results)]
    longest = max(new_ends)
    # every row's moves as (row, to, from) triples, in one copy: two indexing ops a layer for the whole batch
    moves = [(i, end + j, common + node) for i, (end, acc) in enumerate(zip(ends, results))
             for j, node in enumerate(acc.path)]
    rows, dst, src = torch.tensor(moves, device=live.device).T  # [M] each
    for layer in cache.layers:
        layer.keys[rows, :, dst] = layer.keys[rows, :, src]  # (the right side is gathered before it is written)
        layer.values[rows, :, dst] = layer.values[rows, :, src]
    cache.crop(longest - cache.get_seq_length())
    grown = torch.zeros(live.shape[0], longest, dtype=torch.bool, device=live.device)
    width = min(live.shape[1], longest)
    grown[:, :width] = live[:, :width]
    grown[rows, dst] = True
    ends[:] = new_ends
    return grown
