"""Recording a generation's traffic for the heads (``generate(..., record=FOLDER)``; the store: ``heads.io.traffic``).

The decode loop already hands every drafter what the heads learn from: the prompt's states at the prefill
(``Prefill.hidden``) and, each round, the states at the accepted nodes with the tokens the round emitted
(``Outcome.hidden``, ``Outcome.emitted``), and the backbone's logits that chose each token (``Prefill.logits``,
``Outcome.logits``), of which a recording keeps the top ``TOPK`` as log-probabilities (the backbone's own
distribution, temperature 1, also for sampled rows: soft targets for the heads). ``Recording`` wraps a drafter and
keeps a copy of all of it as the loop passes it in, so recording touches no decode path and changes nothing it
computes: one prompt and every row of a batch are recorded alike, and the output is the same with recording on and
off. At the end of the call ``Recorder.write`` appends the rows to the store as one shard.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmaxx.heads.config import lookback
from tokenmaxx.heads.io import traffic

TOPK = 8  # the backbone's most likely next tokens a recording keeps at each answer position
PROMPT_KEPT = 1024  # the prompt's last positions a recording keeps: more than heads read by default (K + 1), so that
# adapt can give them a longer prompt context (``HeadsConfig.prompt_context``)


class Recording:
    """A drafter that keeps what the loop tells it (features and tokens of its row) and otherwise is the drafter it
    wraps: every other attribute is the wrapped drafter's."""

    def __init__(self, drafter, lookback: int):
        self._drafter, self._lookback = drafter, lookback
        self._ids: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []
        self._topk: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._prompt_len = 0

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def start(self, prefill) -> None:
        keep = max(0, prefill.input_ids.shape[0] - 1 - self._lookback)  # the prompt tail training reads
        self._prompt_len = prefill.input_ids.shape[0] - keep
        self._ids = [prefill.input_ids[keep:].clone(), torch.tensor([prefill.root], device=prefill.input_ids.device)]
        self._features = [prefill.hidden[keep:].clone()]
        self._topk = [] if prefill.logits is None else [_top(prefill.logits[None])]
        self._drafter.start(prefill)

    def observe(self, outcome) -> None:
        emitted = len(outcome.emitted)  # the accepted path cut where the output was (EOS, max_new_tokens)
        self._ids.append(outcome.token_ids[:emitted])
        self._features.append(outcome.hidden[:emitted])  # the states at the root and the kept accepted nodes
        if outcome.logits is not None and self._topk:
            self._topk.append(_top(outcome.logits[outcome.nodes[:emitted]]))  # what chose each emitted token
        else:
            self._topk = []  # a round without logits: the row has no top-k at all
        self._drafter.observe(outcome)

    def row(self, sampled: bool) -> traffic.TrafficRow:
        ids = torch.cat([t.to("cpu", torch.long) for t in self._ids])
        topk = {}
        if self._topk:
            topk = {"topk_ids": torch.cat([i for i, _ in self._topk]).to("cpu"),
                    "topk_logprobs": torch.cat([v for _, v in self._topk]).to("cpu")}
        return traffic.TrafficRow(ids=ids, prompt_len=self._prompt_len,
                                  features=torch.cat([f.to("cpu") for f in self._features]), sampled=sampled, **topk)


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, V] logits -> the ``TOPK`` most likely tokens [n, k] int32 and their log-probabilities [n, k] fp32."""
    logits = logits.float()
    values, ids = logits.topk(min(TOPK, logits.shape[-1]), dim=-1)
    return ids.to(torch.int32), values - logits.logsumexp(-1, keepdim=True)


class Recorder:
    """Recording for one generate call: ``wrap`` each row's drafter, then ``finish`` after the loop, which appends the
    rows to ``folder`` (opened, and checked against what is recorded now, before anything is generated; None: the
    rows are only returned, for online adaptation)."""

    def __init__(self, folder: str | Path | None, model, heads):
        if heads is None:
            raise ValueError("record= keeps the backbone states the heads read, for `tokenmaxx adapt`: it needs a "
                             "generator whose heads draft (draft='hybrid' or 'heads'); this one drafts without them")
        hidden = model.get_output_embeddings().weight.shape[1]
        layers = list(heads.feature_layers) if heads.feature_layers else None
        self.lookback = max(lookback(heads.config), PROMPT_KEPT - 1)
        meta = traffic.store_meta(model, layers, hidden * (len(layers) if layers else 1),
                                  model.get_output_embeddings().weight.dtype, self.lookback)
        self.folder = traffic.open_store(folder, meta) if folder is not None else None
        self.rows: list[Recording] = []

    def wrap(self, drafter) -> Recording:
        recording = Recording(drafter, self.lookback)
        self.rows.append(recording)
        return recording

    def finish(self, sampled: bool) -> list[traffic.TrafficRow]:
        """The call's rows, appended to the store as one new shard when there is one."""
        rows = [r.row(sampled) for r in self.rows if r._ids]
        if self.folder is not None:
            traffic.append(self.folder, rows)
        return rows
