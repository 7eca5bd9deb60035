"""Tree-verified speculative decoding: draft -> verify -> accept -> commit -> observe, with output equal to the
backbone's own. Start with ``SpeculativeGenerator``."""

from tokenmaxx.heads.tree import Tree, TreeBuffers, chain, default_tree, parse_tree, sparse_tree

from .decoding import Accepted, Verified, accept_greedy, commit, verify
from .drafting import DEFAULT_DRAFT, DRAFT_MODES, Drafter, make_drafter
from .generator import DEFAULT_DTYPE, EmulatedBf16Warning, GenerationOutput, GenerationStats, SpeculativeGenerator
from .lookup import LookupConfig
from .sampling import TypicalAcceptance, accept_sampling, accept_typical

__all__ = ["Tree", "TreeBuffers", "chain", "default_tree", "parse_tree", "sparse_tree", "Accepted", "Verified",
           "accept_greedy", "commit", "verify", "DEFAULT_DRAFT", "DRAFT_MODES", "Drafter", "make_drafter",
           "DEFAULT_DTYPE", "EmulatedBf16Warning", "GenerationOutput", "GenerationStats", "SpeculativeGenerator",
           "LookupConfig", "TypicalAcceptance", "accept_sampling", "accept_typical"]
