"""Tree-verified speculative decoding: draft -> verify -> accept -> commit -> observe, with output equal to the
backbone's own. Start with ``SpeculativeGenerator``.

The method (``loop``, ``drafting``, ``budget``, ``lookup``, ``decoding``, ``sampling``) measures nothing; what it
uses of this machine's speed is handed to it as a value (``Costs``, ``Runner``), made by ``measure``."""

from tokenmaxx.heads.tree import Tree, TreeBuffers, chain, default_tree, parse_tree, sparse_tree

from .budget import BudgetDrafter, GateConfig
from .costs import Costs, VerifyLatency
from .decoding import Accepted, Verified, accept_greedy, commit, verify
from .drafting import DEFAULT_DRAFT, DRAFT_MODES, Drafter, DraftSettings, make_drafter
from .generator import (DEFAULT_DTYPE, EmulatedBf16Warning, EmulatedDtypeWarning, GenerationOutput, GenerationStats,
                        RawTextPromptWarning, SpeculativeGenerator)
from .lookup import LookupConfig
from .measure import measure_costs
from .online import OnlineAdapt
from .runner import Runner
from .sampling import TypicalAcceptance, accept_sampling, accept_typical

__all__ = ["Tree", "TreeBuffers", "chain", "default_tree", "parse_tree", "sparse_tree", "BudgetDrafter", "GateConfig",
           "Costs", "VerifyLatency", "Accepted", "Verified", "accept_greedy", "commit", "verify", "DEFAULT_DRAFT",
           "DRAFT_MODES", "Drafter", "DraftSettings", "make_drafter", "Runner", "DEFAULT_DTYPE",
           "EmulatedBf16Warning", "EmulatedDtypeWarning", "GenerationOutput", "GenerationStats", "RawTextPromptWarning",
           "SpeculativeGenerator", "LookupConfig",
           "measure_costs", "OnlineAdapt", "TypicalAcceptance", "accept_sampling", "accept_typical"]
