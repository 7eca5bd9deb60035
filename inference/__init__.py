"""Tree-verified speculative decoding: tree -> propose -> verify -> accept -> commit."""

from .tree import Tree, TreeBuffers, chain, default_tree, parse_tree, sparse_tree

__all__ = ["Tree", "TreeBuffers", "chain", "default_tree", "parse_tree", "sparse_tree"]

from .decoding import Accepted, Verified, accept_greedy, commit, propose, verify  # noqa: E402
from .generator import GenerationOutput, GenerationStats, SpeculativeGenerator  # noqa: E402

__all__ += ["Accepted", "Verified", "accept_greedy", "commit", "propose", "verify", "GenerationOutput",
            "GenerationStats", "SpeculativeGenerator"]

from .sampling import TypicalAcceptance, accept_sampling, accept_typical  # noqa: E402

__all__ += ["TypicalAcceptance", "accept_sampling", "accept_typical"]
