"""Prompt-lookup branches: suffix matching, merging into the heads' tree, hybrid output identical to greedy."""

import pytest
import torch
from helpers import repeating_prompts, greedy_reference, random_heads

from tokenmaxx.inference import SpeculativeGenerator, Tree
from tokenmaxx.heads.drafting import HEADS, LOOKUP
from tokenmaxx.heads.tree import host_tree
from tokenmaxx.inference.budget import BudgetDrafter
from tokenmaxx.inference.lookup import LookupConfig, LookupDrafter, NgramIndex, merge_lists


def _index(tokens, max_ngram=3):
    index = NgramIndex(max_ngram)
    index.extend(tokens)
    return index


def test_longest_suffix_wins_and_most_recent_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    seq = [5, 6, 7, 1, 9, 6, 7, 2, 4, 5, 6, 7]
    # suffix (5, 6, 7) occurred at 0..2 -> continuation from 3; (6, 7) more recently at 5..6 -> would give [2, 4]
    assert _index(seq).continuation(3) == [1, 9, 6]
    assert _index(seq, max_ngram=2).continuation(2) == [2, 4]  # only bigrams: most recent (6, 7)


def test_no_match_and_min_ngram():
    assert _index([1, 2, 3, 4]).continuation(4) == []
    seq = [8, 3, 9, 3]  # unigram (3,) occurred at 1 -> [9, 3]; bigram (9, 3) never before
    assert _index(seq).continuation(2, min_ngram=1) == [9, 3]
    assert _index(seq).continuation(2, min_ngram=2) == []


def test_index_grows_incrementally():
    index = _index([1, 2, 3])
    assert index.continuation(2) == []
    index.extend([1, 2])
    assert index.continuation(2) == [3, 1]  # (1, 2) at 0..1 -> 3, then 1
    index.extend([3])
    assert index.continuation(5) == [1, 2, 3]  # (1, 2, 3) at 0..2 -> the rest


def test_distinct_continuations_most_recent_first():
    #      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    seq = [5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 1, 2, 5, 6]
    # (5, 6) ended at 2, 6, 10 (and is the suffix): continuations from 10 ([1, 2]), 6 ([3, 4]); 2 repeats [1, 2]
    assert _index(seq, max_ngram=2).continuations(2, count=3) == (2, [[1, 2], [3, 4]])
    assert _index(seq, max_ngram=2).continuations(2, count=1) == (2, [[1, 2]])
    assert _index(seq, max_ngram=2).continuations(3, count=3) == (2, [[1, 2, 5], [3, 4, 5]])
    # the longest matching n-gram decides, its occurrences only: the suffix trigram (2, 5, 6) occurred once, at 3..5
    assert _index(seq, max_ngram=3).continuations(2, count=3) == (3, [[3, 4]])
    assert _index([1, 2, 3]).continuations(2, count=3) == (0, [])
    assert _index([1, 2, 3, 2]).continuations(2, count=3) == (1, [[3, 2]])  # unigram (2,) at 1


def test_suffix_never_matches_itself():
    assert _index([4, 4]).continuation(3, min_ngram=1) == [4]  # (4,) at 0 -> next is 4
    assert _index([7]).continuation(3, min_ngram=1) == []


def merge_branch(tokens, buffers, branch):
    """A heads tree of tensors with one lookup branch merged in: (tokens, buffers, sources)."""
    toks, parents, sources, _ = merge_lists(tokens.tolist(), buffers.parents.tolist(), [branch])
    out_buffers, (merged, merged_sources) = host_tree(tokens.device, parents, toks, sources)
    return merged.long(), out_buffers, merged_sources.long()


def test_merge_dedupes_a_branch_that_coincides_with_a_head_path():
    tree = Tree([(0,), (1,), (0, 0)])  # nodes: 0 root, 1 (0,), 2 (1,), 3 (0, 0)
    tokens = torch.tensor([50, 10, 11, 20])  # (0,)=10, (1,)=11, (0,0)=20
    merged, buffers, sources = merge_branch(tokens, tree.buffers, [10, 20, 30])
    assert merged.tolist() == [50, 10, 11, 20, 30]  # shares 10 -> 20, adds 30 below node 3
    assert buffers.parents.tolist() == [0, 0, 0, 1, 3]
    assert sources.tolist() == [HEADS, HEADS | LOOKUP, HEADS, HEADS | LOOKUP, LOOKUP]
    assert buffers.depths.tolist() == [0, 1, 1, 2, 3]
    assert buffers.attn_mask[4].tolist() == [True, True, False, True, True]
    # a branch entirely inside the tree adds nothing
    same, same_buffers, sources = merge_branch(tokens, tree.buffers, [11])
    assert same.tolist() == tokens.tolist() and same_buffers.parents.tolist() == tree.buffers.parents.tolist()
    # a branch that departs at the root becomes a new child of the root
    _, buffers, _ = merge_branch(tokens, tree.buffers, [12, 13])
    assert buffers.parents.tolist() == [0, 0, 0, 1, 0, 4]
    assert buffers.children[0] == (1, 2, 4)


@pytest.mark.parametrize("draft", ["hybrid", "lookup"])
def test_lookup_drafting_matches_greedy_with_random_heads(model, draft):
    heads = random_heads(model) if draft == "hybrid" else None
    # whole trees (costs=None): the assertion is about the branches, not about this machine's sizing
    gen = SpeculativeGenerator(model, heads, draft=draft, lookup=LookupConfig(min_ngram=1, start_len=4))
    fired = 0
    for input_ids, max_new in repeating_prompts(model.config.vocab_size, seed=4):
        out = gen.generate(input_ids, max_new_tokens=max_new)
        assert out.sequences.tolist() == greedy_reference(model, input_ids, max_new).tolist()
        fired += out.stats.accepted_by_source["lookup"] + out.stats.accepted_by_source["both"]
    assert fired > 0  # lookup branches were really accepted


def test_bad_draft_settings(model):
    with pytest.raises(ValueError, match="unknown draft mode 'both'"):
        SpeculativeGenerator(model, random_heads(model), draft="both")
    with pytest.raises(ValueError, match="needs heads"):
        SpeculativeGenerator(model, None, draft="hybrid")
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        LookupConfig(min_ngram=4, max_ngram=3)
    # each drafter's default shortest n-gram: 1 for hybrid (valued per match length), 2 for lookup alone
    assert BudgetDrafter(random_heads(model).drafter(model), lookup=LookupConfig()).min_ngram == 1
    assert LookupDrafter().min_ngram == 2
    assert LookupDrafter(LookupConfig(min_ngram=3)).min_ngram == 3
    assert LookupConfig(min_ngram=3).shortest_ngram("hybrid") == 3


def test_branch_length_rule():
    cfg = LookupConfig(start_len=8, min_len=2, max_len=16)
    assert cfg.next_len(8, proposed=8, accepted=8) == 10
    assert cfg.next_len(16, proposed=16, accepted=16) == 16
    assert cfg.next_len(8, proposed=8, accepted=3) == 7
    assert cfg.next_len(2, proposed=2, accepted=0) == 2
