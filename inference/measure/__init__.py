"""Measuring this machine for the method: what a round's parts cost here, and the trees that pay.

Nothing in the method (``loop``, the drafters, ``decoding``) imports this package; it is handed what was measured as
a value (``costs.Costs``, ``forward.ForwardContext``). Each measurement is cached per backbone, heads and machine
(``store``), so it runs once:

- ``small_rows``: the tree sizes whose verifies are faster with the linear layers transposed (CPU BLAS);
- ``latency``: verify seconds per node count (``costs.VerifyLatency``) and the heads' proposing seconds;
- ``autotune`` / ``tree_search``: ``tree="auto"``, the heads' tree settings with the best expected tokens/s.

``measure_costs`` makes the ``Costs`` that ``SpeculativeGenerator.create(..., costs="auto")`` hands the method.
"""

from __future__ import annotations

from pathlib import Path

from ..costs import Costs
from .autotune import Calibration, is_auto, resolve_auto
from .latency import cached_latency, cached_propose_cost
from .small_rows import cached_small_rows


def measure_costs(model, heads=None, tree=None, draft_vocab: bool = True, small_rows: dict | None = None,
                  cache_root: Path | None = None, refresh: bool = False) -> Costs:
    """This machine's ``Costs`` for drafting with ``heads`` (their tree settings ``tree``, parsed; None: their own)
    on ``model``: the small-row plan of the verifies, and with heads the verify latency and the heads' proposing
    seconds. Each part is read from the cache when it was measured before (``refresh``: measure again).
    ``small_rows``: a plan already measured (skips reading it again). Without heads (lookup drafting) only the plan:
    lookup drafts cost nothing to propose and its branches are not sized by the latency."""
    plan = small_rows if small_rows is not None else cached_small_rows(model, cache_root, refresh)
    if heads is None:
        return Costs(small_rows=plan)
    latency = cached_latency(model, cache_root, refresh, small_rows=plan)
    propose = cached_propose_cost(model, heads, tree, draft_vocab, cache_root, refresh)
    return Costs(latency=latency, propose_seconds=propose, small_rows=plan)


__all__ = ["Calibration", "Costs", "cached_latency", "cached_propose_cost", "cached_small_rows", "is_auto",
           "measure_costs", "resolve_auto"]
