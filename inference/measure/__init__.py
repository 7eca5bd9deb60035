"""Measuring this machine for the method: what a round's parts cost here, and the trees that pay.

Nothing in the method (``loop``, the drafters, ``decoding``) imports this package; it is handed what was measured as
a value (``costs.Costs``, ``runner.Runner``). Each measurement is cached per backbone, heads and machine
(``store``), so it runs once:

- ``small_rows``: the tree sizes whose verifies are faster with the linear layers transposed (CPU BLAS);
- ``latency``: verify seconds per node count (``costs.VerifyLatency``) and the heads' proposing seconds (one row's,
  and several rows' together);
- ``autotune`` / ``tree_search``: ``tree="auto"``, the heads' tree settings with the best expected tokens/s.

``measure_costs`` makes the ``Costs`` that ``SpeculativeGenerator.create(..., costs="auto")`` hands the method.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tokenmaxx.heads import backbone_identity, cache_dir
from tokenmaxx.heads.machine import clock, device_name

from ..costs import Costs
from .autotune import Calibration, is_auto, resolve_auto
from .latency import (LATENCY_SIZES, PREFIX_LENS, PROPOSE_ROWS, cached_latency, cached_propose_cost,
                      cached_propose_rows, latency_path, propose_path)
from .small_rows import SMALL_ROW_SIZES, cached_small_rows, read_plan, small_rows_path


def measure_costs(model, heads=None, tree=None, draft_vocab: bool = True, small_rows: dict | None = None,
                  cache_root: Path | None = None, refresh: bool = False, announce: bool = True) -> Costs:
    """This machine's ``Costs`` for drafting with ``heads`` (their tree settings ``tree``, parsed; None: their own)
    on ``model``: the small-row plan of the verifies, and with heads the verify latency and the heads' proposing
    seconds. Each part is read from the cache when it was measured before (``refresh``: measure again).
    ``small_rows``: a plan already measured (skips reading it again). Without heads (lookup drafting) only the plan:
    lookup drafts cost nothing to propose and its branches are not sized by the latency. ``announce``: say in one
    line what is about to be measured (``announce_measuring``), if anything."""
    if announce:
        announce_measuring(model, heads, tree, draft_vocab, small_rows, cache_root, refresh)
    plan = small_rows if small_rows is not None else cached_small_rows(model, cache_root, refresh)
    if heads is None:
        return Costs(small_rows=plan)
    latency = cached_latency(model, cache_root, refresh, small_rows=plan)
    propose = cached_propose_cost(model, heads, tree, draft_vocab, cache_root, refresh)
    together = cached_propose_rows(model, heads, tree, draft_vocab, cache_root, refresh)
    return Costs(latency=latency, propose_seconds=propose, small_rows=plan, propose_rows=together)


SKIP_FLAG = "tokenmaxx generate --no_adaptive_budget"  # what skips the measuring on the command line
PROBE_PREFIX, PROBE_NODES = 512, 16  # the verify the estimate times: a mid-sized tree over a mid-sized prefix


def _duration(forwards: int, model) -> str:
    """About how long ``forwards`` verify-sized backbone forwards take here, from one timed after a warm-up (a prefill
    of ``PROBE_PREFIX`` tokens and two verifies of ``PROBE_NODES``: a second or so, against minutes)."""
    device = model.get_output_embeddings().weight.device
    context = getattr(model.config, "max_position_embeddings", None) or PROBE_PREFIX + PROBE_NODES
    prefix = max(1, min(PROBE_PREFIX, context - PROBE_NODES))
    ids = torch.zeros(1, prefix + PROBE_NODES, dtype=torch.long, device=device)
    with torch.inference_mode():
        cache = model(ids[:, :prefix], use_cache=True).past_key_values
        for _ in range(2):  # the first warms up
            start = clock(device)
            model(ids[:, prefix:], past_key_values=cache, use_cache=True)
            seconds = (clock(device) - start) * forwards
            cache.crop(-PROBE_NODES)  # (transformers 5: a negative count removes that many positions)
    minutes = round(seconds / 60)
    return "under a minute" if minutes < 1 else f"about {minutes} minute{'s' if minutes > 1 else ''}"


def announce_measuring(model, heads=None, tree=None, draft_vocab: bool = True, small_rows: dict | None = None,
                       cache_root: Path | None = None, refresh: bool = False) -> str | None:
    """One line on stderr before ``measure_costs`` measures anything: what it measures and why, about how long it
    takes here (one verify timed), where it is cached and how to skip it; nothing (None) when every part is read
    from the cache. Returns the line."""
    parts, forwards = [], 0
    plan_path = small_rows_path(model, cache_root) if small_rows is None else None
    if plan_path is not None and (refresh or not plan_path.is_file()):
        parts.append("which small verifies run faster with transposed products")
        forwards += 8 * len(SMALL_ROW_SIZES) * 4  # rounds x sizes x ways (``measure_small_rows``)
    if heads is not None:
        # the latency's key holds the small-row plan: while the plan is still to be measured, so is the latency
        plan_known = small_rows is not None or plan_path is None or (plan_path.is_file() and not refresh)
        if plan_known and not refresh:
            plan = small_rows if small_rows is not None else {} if plan_path is None else read_plan(plan_path)
            latency_missing = not latency_path(model, plan, PREFIX_LENS, cache_root).is_file()
        else:
            latency_missing = True
        if latency_missing:
            parts.append(f"the verify latency of 1-{max(LATENCY_SIZES)} tree nodes over "
                         f"{' and '.join(map(str, PREFIX_LENS))} cached tokens")
            forwards += 7 * len(LATENCY_SIZES) * len(PREFIX_LENS)
        if refresh or not propose_path(model, heads, tree, draft_vocab, cache_root).is_file():
            parts.append("the heads' proposing time")
            forwards += 48 + 24
        if refresh or not propose_path(model, heads, tree, draft_vocab, cache_root, rows=True).is_file():
            parts.append(f"the proposing time of {' and '.join(map(str, PROPOSE_ROWS))} rows together")
            forwards += sum(24 + rows + 1 for rows in PROPOSE_ROWS)
    if not parts:
        return None
    ident, _ = backbone_identity(model)
    weight = model.get_output_embeddings().weight
    line = (f"tokenmaxx: measuring this machine once for {ident or type(model).__name__} "
            f"({str(weight.dtype).removeprefix('torch.')}, {device_name(weight.device)}): {'; '.join(parts)}, so "
            f"that each round's draft tree is sized to what a verify costs here: {_duration(forwards, model)}. "
            f"Cached in {cache_root or cache_dir() / 'calibration'} and reused for this backbone, dtype and machine; "
            f"costs=None skips it ({SKIP_FLAG} on the command line)")
    print(line, file=sys.stderr)
    return line


__all__ = ["announce_measuring", "Calibration", "Costs", "cached_latency", "cached_propose_cost", "cached_small_rows", "is_auto",
           "measure_costs", "resolve_auto"]
