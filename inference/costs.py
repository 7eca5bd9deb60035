"""What was measured about this machine, handed to the method as one value: ``Costs``.

The method (the decode loop, the drafters, verify / accept / commit) measures nothing. What it may use of this
machine's speed comes in a ``Costs``:

- ``latency``: seconds of one tree-verify forward per node count, at a few cache lengths (``VerifyLatency``). With it
  the heads' and hybrid trees are cut per round to the nodes worth their verify time (``budget.share_lists``);
  without it every round verifies the whole tree.
- ``propose_seconds``: seconds one proposal of the heads takes. With ``latency`` it prices the heads' rounds, and
  heads that do not earn it sit rounds out (``budget.HeadsGate``). ``propose_rows``: the seconds of several rows'
  proposals run together (a batch's, whose module passes are batched), which a batch's load gate prices its
  drafting rounds at (``loop.LoadGate``).
- ``small_rows``: the tree sizes whose verifies compute (some of) the backbone's linear layers as ``(W @ x^T)^T``
  (``runner.transposed_linears``), where this CPU's BLAS is faster that way.

``tokenmaxx.inference.measure.measure_costs`` measures them (once per backbone, heads and machine, then cached);
``SpeculativeGenerator.create`` / ``from_pretrained`` call it for ``costs="auto"``. Tests and benchmarks build a
``Costs`` by hand. ``costs=None`` is the unmeasured method: whole trees, every forward as the model computes it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping

from .runner import as_plan


def interpolate(latency: Mapping[int, float], n: int) -> float:
    """Verify latency of n tokens, linearly interpolated between measured sizes (extrapolated past the ends)."""
    if n in latency:
        return latency[n]
    sizes = sorted(latency)
    if len(sizes) == 1:
        return latency[sizes[0]]
    i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)  # n's segment; outside: the nearest end's
    lo, hi = sizes[i - 1], sizes[i]
    return latency[lo] + (latency[hi] - latency[lo]) * (n - lo) / (hi - lo)


@dataclass(frozen=True)
class VerifyLatency:
    """Verify latency per node count at a few cache lengths: attention over the cache makes each extra node dearer in
    a long context."""

    tables: Mapping[int, Mapping[int, float]]  # cached tokens -> {nodes: seconds} (fitted: never decreasing in nodes)

    def __post_init__(self):
        if not self.tables or any(not table for table in self.tables.values()):
            raise ValueError("a verify latency needs at least one table of at least one node count")
        bad = [(p, n, s) for p, table in self.tables.items() for n, s in table.items() if n < 1 or not s >= 0]
        if bad:
            raise ValueError(f"verify latency entries must be (nodes >= 1: seconds >= 0), got {bad[:3]}")

    def at(self, prefix_len: int, rows: int = 1) -> dict[int, float]:
        """The table for a cache of ``prefix_len`` tokens: linear in the cache length between the measured lengths,
        extended along the last segment past the longest, and the shortest's table below it.

        ``rows``: trees of that many rows verified in one forward (``loop.decode``). n nodes a row then
        cost what ``rows * n`` tokens cost one row (the forward's work is its token count; each row's attention
        over its own cache is what one row's is), so each node is ``rows`` times dearer: the budgets shrink as the
        batch grows, down to the root alone (plain batched decoding) where no node pays."""
        lengths = sorted(self.tables)
        if prefix_len <= lengths[0] or len(lengths) == 1:
            table = dict(self.tables[lengths[0]])
        else:
            hi = next((length for length in lengths if length >= prefix_len), lengths[-1])
            lo = lengths[lengths.index(hi) - 1]
            w = (prefix_len - lo) / (hi - lo)
            # a blend of never-decreasing tables never decreases; a table with the dips of a small-row plan keeps them
            table = {n: (1 - w) * self.tables[lo][n] + w * self.tables[hi][n] for n in sorted(self.tables[lo])}
        if rows == 1:
            return table
        return {n: interpolate(table, rows * n) for n in range(1, max(table) + 1)}


@dataclass(frozen=True)
class Costs:
    """This machine's measured costs (see the module docstring). Every field is optional: a ``Costs()`` is the
    unmeasured method, like ``costs=None``."""

    latency: VerifyLatency | None = None
    propose_seconds: float | None = None
    small_rows: Mapping[int, str] = field(default_factory=dict)  # rows -> "all" | "head" | "body"
    # R -> seconds of R rows' proposals run together (``drafting.propose_rows``), R >= 2; empty: R x propose_seconds
    propose_rows: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.propose_seconds is not None and not self.propose_seconds >= 0:
            raise ValueError(f"propose_seconds must be >= 0 seconds, got {self.propose_seconds!r}")
        bad = {r: s for r, s in dict(self.propose_rows).items()
               if not isinstance(r, int) or isinstance(r, bool) or r < 2 or not s >= 0}
        if bad or (self.propose_rows and self.propose_seconds is None):
            raise ValueError(f"propose_rows must map rows >= 2 to seconds >= 0, beside a propose_seconds for one row; "
                             f"got {dict(self.propose_rows)!r} with propose_seconds={self.propose_seconds!r}")
        object.__setattr__(self, "propose_rows", {int(r): float(s) for r, s in dict(self.propose_rows).items()})
        object.__setattr__(self, "small_rows", as_plan(self.small_rows))  # checked, as a plain dict

    def propose_time(self, rows: int) -> float:
        """Seconds of one round's proposals for ``rows`` rows: between the measured row counts linearly (extended
        along the last segment), rows x one row's without them; 0 when proposing was not measured."""
        if self.propose_seconds is None:
            return 0.0
        if rows == 1 or not self.propose_rows:
            return rows * self.propose_seconds
        return interpolate({1: self.propose_seconds, **self.propose_rows}, rows)
