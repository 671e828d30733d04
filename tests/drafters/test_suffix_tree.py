"""Tests for the suffix-decoding index (specjax.drafters.suffix_tree).

Counts are checked against a brute-force substring counter, proposals against hand-computed trees and against a
brute-force optimum (sum of the top path probabilities), so a wrong count, a wrong probability, a wrong budget or
an over-eager pruning all fail a test.
"""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.drafters.suffix_tree import (
    Proposal,
    SuffixDecodingError,
    SuffixIndex,
    proposal_as_chain,
    proposal_to_fixed,
    speculate,
)

A, B, C = 0, 1, 2


# ---------------------------------------------------------------------------- brute-force references


def naive_counts(seqs, max_depth):
    """count(x) for every substring x of length <= max_depth of the sequences."""
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(max_depth, len(s) - i) + 1):
                counts[tuple(s[i : i + n])] += 1
    return dict(counts)


def naive_groups(counts, ctx, max_depth):
    """[(shortest L, longest L)] of the context suffixes that occur with a continuation, grouped by count."""
    groups, last = [], None
    for n in range(1, min(max_depth - 1, len(ctx)) + 1):
        s = tuple(ctx[len(ctx) - n :])
        if not any(len(k) == n + 1 and k[:n] == s for k in counts):
            break
        if counts[s] == last:
            groups[-1] = (groups[-1][0], n)
        else:
            groups.append((n, n))
            last = counts[s]
    return groups


def naive_best(seq_sets, ctx, max_depth, max_spec_tokens, factor, min_prob, max_nodes, max_draft_depth=None):
    """(best score, [(index, match length) achieving it]) by enumerating every continuation of every group."""
    results = []
    for which, seqs in enumerate(seq_sets):
        counts = naive_counts(seqs, max_depth)
        for shortest, longest in naive_groups(counts, ctx, max_depth):
            budget = min(max_spec_tokens, int(factor * longest + 1e-6), max_nodes)
            s = tuple(ctx[len(ctx) - shortest :])
            deepest = shortest + (max_depth if max_draft_depth is None else max_draft_depth)
            probs = sorted(
                (c / counts[s] for k, c in counts.items() if shortest < len(k) <= deepest and k[:shortest] == s),
                reverse=True,
            )
            score = sum(p for p in probs[:budget] if p >= min_prob)
            if budget and score > 0:
                results.append((score, which, longest))
    if not results:
        return 0.0, []
    best = max(r[0] for r in results)
    return best, [(w, n) for sc, w, n in results if sc > best - 1e-6]


def build(seqs, max_depth=24, **kw):
    ix = SuffixIndex(max_depth, **kw)
    for i, s in enumerate(seqs):
        ix.add_sequence(i, s)
    return ix


def check_tree(p: Proposal):
    """Structural invariants of a proposal: shapes, dtypes, topological order, sibling order, monotone scores."""
    n = p.tokens.shape[0]
    assert p.tokens.dtype == np.int32 and p.parents.dtype == np.int32 and p.scores.dtype == np.float32
    assert p.parents.shape == (n,) and p.scores.shape == (n,)
    for i in range(n):
        par = int(p.parents[i])
        assert -1 <= par < i
        if par >= 0:
            assert p.scores[i] <= p.scores[par] + 1e-7
    for par in set(p.parents.tolist()):
        sib = p.scores[p.parents == par]
        assert np.all(np.diff(sib) <= 1e-7), "siblings must be sorted by descending score"
    # No two siblings may carry the same token: each would be a separate copy of one continuation.
    pairs = list(zip(p.parents.tolist(), p.tokens.tolist()))
    assert len(pairs) == len(set(pairs))


# ---------------------------------------------------------------------------- hand-made trees


def test_repetition_predicts_the_continuation():
    seq = [A, B, C, A, B, C, A, B]
    ix = build([seq])
    assert ix.count([A, B]) == 3 and ix.count([A, B, C]) == 2 and ix.count([B, C, A, B]) == 2
    assert ix.count([C, A, B, C, A, B]) == 1 and ix.count([C, C]) == 0
    p = speculate([ix], seq, max_spec_tokens=8, max_nodes=8)
    # "c a b" (count 2, its last occurrence is the context itself, which has no continuation yet) is followed by
    # "c a b" once: each draft token has path probability 1/2. The suffix matches 5 tokens ("a b c a b").
    assert p.tokens.tolist() == [C, A, B]
    assert p.parents.tolist() == [-1, 0, 1]
    np.testing.assert_allclose(p.scores, [0.5, 0.5, 0.5])
    assert p.match_length == 5


X, Y, T1, T2, T3, OTHER = 10, 11, 20, 21, 22, 99
BRANCHY = [[X, Y, T1], [X, Y, T1], [X, Y, T2], [X, Y, T1, T3]]


def test_counts_and_probabilities_of_a_branching_tree():
    ix = build(BRANCHY)
    assert ix.count([X, Y]) == 4 and ix.count([X, Y, T1]) == 3 and ix.count([Y, T2]) == 1
    # Match "x y" (length 2): budget floor(2 * factor). T1: 3/4, T2: 1/4, T1 -> T3: 3/4 * 1/3 = 1/4.
    p = speculate([ix], [OTHER, X, Y], max_spec_tokens=8, max_spec_factor=2.0, min_token_prob=0.1, max_nodes=8)
    assert p.tokens.tolist() == [T1, T2, T3]
    assert p.parents.tolist() == [-1, -1, 0]
    np.testing.assert_allclose(p.scores, [0.75, 0.25, 0.25])
    assert p.match_length == 2
    check_tree(p)


def test_speculation_length_grows_with_match_length():
    seq = list(range(100, 140))  # all distinct: every match is unique and every path probability is 1
    ix = build([seq])
    for factor in (1.0, 0.5, 2.0):
        for n in range(1, 10):
            ctx = [OTHER] + seq[10 - n : 10]  # exactly n context tokens match
            p = speculate([ix], ctx, max_spec_tokens=12, max_spec_factor=factor, max_nodes=64)
            want = min(12, int(factor * n + 1e-6))
            assert p.match_length == (n if want else 0)
            assert p.tokens.tolist() == seq[10 : 10 + want]
            assert p.parents.tolist() == list(range(-1, want - 1))
            np.testing.assert_allclose(p.scores, np.ones(want))


def test_match_longer_than_the_trie_depth_is_capped():
    seq = list(range(100, 160))
    ix = build([seq], max_depth=8)
    p = speculate([ix], seq[:30], max_spec_tokens=32, max_spec_factor=4.0, max_nodes=32)
    # Matches are capped at max_depth - 1 = 7 tokens; since "100..129" occurs once, the tree is grown from the
    # shortest unique suffix ("129", 1 token), which leaves 7 levels of room below it.
    assert p.match_length == 7
    assert p.tokens.tolist() == seq[30:37]


def test_a_confident_short_match_beats_a_vague_long_match():
    P, Q, R = 30, 31, 32
    # "p q" (count 3) is followed by T1, T2, T3 once each; "q" alone (count 11) by T1 nine times.
    ix = build([[R, Q, T1]] * 8 + [[P, Q, T1], [P, Q, T2], [P, Q, T3]])
    p = speculate([ix], [P, Q], max_spec_tokens=8, max_spec_factor=1.0, min_token_prob=0.1, max_nodes=8)
    # Match 2 may draft 2 tokens worth 1/3 + 1/3; match 1 drafts one worth 9/11, which is more.
    assert p.tokens.tolist() == [T1] and p.match_length == 1
    np.testing.assert_allclose(p.scores, [9 / 11])


def test_equal_scores_report_the_longest_match():
    P, Q, R, S = 30, 31, 32, 33
    # "q", "p q" and "s p q" all predict T1 with certainty, and nothing after it: score 1 for every match length.
    ix = build([[S, P, Q, T1], [R, P, Q, T1], [R, Q, T1]], max_depth=4)
    p = speculate([ix], [S, P, Q], max_spec_tokens=8, max_spec_factor=2.0, max_nodes=8)
    assert p.tokens.tolist() == [T1] and p.match_length == 3


def test_min_token_prob_prunes():
    ix = build(BRANCHY)
    kw = dict(max_spec_tokens=8, max_spec_factor=2.0, max_nodes=8)
    assert speculate([ix], [X, Y], min_token_prob=0.3, **kw).tokens.tolist() == [T1]
    assert speculate([ix], [X, Y], min_token_prob=0.25, **kw).tokens.tolist() == [T1, T2, T3]
    empty = speculate([ix], [X, Y], min_token_prob=0.8, **kw)
    assert empty.tokens.shape == (0,) and empty.match_length == 0


def test_max_nodes_keeps_the_most_likely_nodes():
    # After X: T1 x4, T2 x3, T3 x2, OTHER x1, each followed by its own distinct token.
    seqs = [[X, T1, 50]] * 4 + [[X, T2, 51]] * 3 + [[X, T3, 52]] * 2 + [[X, OTHER, 53]]
    ix = build(seqs)
    kw = dict(max_spec_tokens=20, max_spec_factor=20.0, min_token_prob=0.0)
    full = speculate([ix], [X], max_nodes=20, **kw)
    assert full.tokens.tolist() == [T1, 50, T2, 51, T3, 52, OTHER, 53]
    np.testing.assert_allclose(full.scores, [0.4, 0.4, 0.3, 0.3, 0.2, 0.2, 0.1, 0.1])
    check_tree(full)
    for m in range(0, 9):
        p = speculate([ix], [X], max_nodes=m, **kw)
        assert p.tokens.tolist() == full.tokens.tolist()[:m]
        assert p.parents.tolist() == full.parents.tolist()[:m]
    assert speculate([ix], [X], max_nodes=5, **dict(kw, max_spec_tokens=3)).tokens.shape == (3,)
    flat = speculate([ix], [X], max_nodes=20, max_draft_depth=1, **kw)
    assert flat.tokens.tolist() == [T1, T2, T3, OTHER] and flat.parents.tolist() == [-1, -1, -1, -1]
    np.testing.assert_allclose(flat.scores, [0.4, 0.3, 0.2, 0.1])


def test_request_index_wins_ties_and_the_better_index_wins_otherwise():
    req = build([[X, Y, T1]])
    glob = build([[X, Y, T2]])
    kw = dict(max_spec_tokens=4, max_nodes=4)
    assert speculate([req, glob], [X, Y], **kw).tokens.tolist() == [T1]
    assert speculate([glob, req], [X, Y], **kw).tokens.tolist() == [T2]
    strong = build([[X, Y, T2, T3, T1]])  # same match, but two more draft tokens of probability 1
    assert speculate([req, strong], [X, Y], **kw).tokens.tolist() == [T2, T3]


def test_no_match_gives_an_empty_proposal():
    ix = build([[1, 2, 3]])
    for ctx in ([], [7], [3], np.zeros((0,), np.int32)):
        p = speculate([ix], ctx, max_spec_tokens=4, max_nodes=4)
        assert p.tokens.shape == (0,) and p.parents.shape == (0,) and p.scores.shape == (0,)
        assert p.match_length == 0
    assert speculate([], [1, 2], max_spec_tokens=4, max_nodes=4).tokens.shape == (0,)


def test_numpy_context_and_numpy_tokens_are_accepted():
    seq = np.array([A, B, C, A, B, C, A, B], np.int64)
    ix = SuffixIndex()
    ix.add_sequence(0, seq[:3])
    ix.extend(0, seq[3:])
    p = speculate([ix], seq.astype(np.int32), max_spec_tokens=8, max_nodes=8)
    assert p.tokens.tolist() == [C, A, B]


# ---------------------------------------------------------------------------- updates


def test_remove_restores_counts_exactly():
    seqs = [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2, 3, 1, 2, 3], [5, 1, 2, 3, 5], [1, 2, 3, 1, 2, 4]]
    ix = build(seqs, max_depth=5)
    ix.remove(1)
    fresh = SuffixIndex(5)
    for i in (0, 2, 3):
        fresh.add_sequence(i, seqs[i])
    assert ix.substring_counts() == fresh.substring_counts() == naive_counts([seqs[i] for i in (0, 2, 3)], 5)
    assert ix.num_tokens == fresh.num_tokens == 17
    for ctx in ([1, 2], [2, 3, 1], [5], [3, 1, 2]):
        a = speculate([ix], ctx, max_spec_tokens=6, max_nodes=6, min_token_prob=0.0)
        b = speculate([fresh], ctx, max_spec_tokens=6, max_nodes=6, min_token_prob=0.0)
        assert a.tokens.tolist() == b.tokens.tolist() and a.scores.tolist() == b.scores.tolist()
    for i in (0, 2, 3):
        ix.remove(i)
    assert ix.substring_counts() == {} and ix.num_nodes == 0 and ix.num_tokens == 0


def test_fifo_eviction():
    ix = SuffixIndex(6, max_sequences=2)
    seqs = {7: [1, 2, 3, 4], 8: [2, 3, 4, 5], 9: [3, 4, 5, 6]}
    for k, s in seqs.items():
        ix.add_sequence(k, s)
    assert ix.seq_ids == [8, 9] and 7 not in ix and len(ix) == 2
    assert ix.substring_counts() == naive_counts([seqs[8], seqs[9]], 6)


token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=14)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(token_lists, st.lists(st.integers(0, 14), max_size=3)), min_size=1, max_size=4),
    max_depth=st.integers(2, 6),
    ctx=token_lists,
)
def test_extend_equals_add_sequence_of_the_concatenation(seqs, max_depth, ctx):
    grown, whole = SuffixIndex(max_depth), SuffixIndex(max_depth)
    full = []
    for i, (tokens, cuts) in enumerate(seqs):
        grown.add_sequence(i, [])
        whole.add_sequence(i, tokens)
        full.append(tokens)
    # Interleave the appends of different sequences: tails of one sequence are split by another one's growth.
    pieces = []
    for i, (tokens, cuts) in enumerate(seqs):
        edges = sorted({0, len(tokens), *[min(c, len(tokens)) for c in cuts]})
        pieces += [(j, i, tokens[a:b]) for j, (a, b) in enumerate(zip(edges, edges[1:]))]
    for _, i, piece in sorted(pieces, key=lambda x: (x[0], x[1])):
        grown.extend(i, piece)
    want = naive_counts(full, max_depth)
    assert grown.substring_counts() == want
    assert whole.substring_counts() == want
    assert grown.num_tokens == whole.num_tokens == sum(map(len, full))
    kw = dict(max_spec_tokens=5, max_spec_factor=2.0, min_token_prob=0.05, max_nodes=6)
    a, b = speculate([grown], ctx, **kw), speculate([whole], ctx, **kw)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert a.scores.tolist() == b.scores.tolist() and a.match_length == b.match_length


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(token_lists, min_size=2, max_size=5),
    drop=st.integers(0, 4),
    more=token_lists,
    max_depth=st.integers(2, 6),
)
def test_remove_then_extend_matches_a_fresh_index(seqs, drop, more, max_depth):
    drop %= len(seqs)
    ix = build(seqs, max_depth)
    ix.remove(drop)
    keep = [i for i in range(len(seqs)) if i != drop]
    ix.extend(keep[0], more)  # growth after a removal must still count exactly
    final = {i: list(seqs[i]) for i in keep}
    final[keep[0]] += more
    assert ix.substring_counts() == naive_counts(final.values(), max_depth)


# ---------------------------------------------------------------------------- proposals vs brute force


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    req=st.lists(st.integers(0, 3), min_size=0, max_size=24),
    glob=st.lists(st.lists(st.integers(0, 3), max_size=16), max_size=3),
    ctx_len=st.integers(0, 10),
    max_depth=st.integers(2, 8),
    max_spec_tokens=st.integers(0, 8),
    factor=st.sampled_from([0.5, 1.0, 2.5]),
    min_prob=st.sampled_from([0.0, 0.1234, 0.3141]),  # not a ratio of small counts: no float ties at the cutoff
    max_nodes=st.integers(0, 8),
    max_draft_depth=st.sampled_from([None, 1, 2, 3]),
)
def test_proposal_is_optimal_and_consistent_with_counts(
    req, glob, ctx_len, max_depth, max_spec_tokens, factor, min_prob, max_nodes, max_draft_depth
):
    # The context is the request itself (as in decoding, where the per-request index holds prompt + output).
    ctx = req[len(req) - ctx_len :] if ctx_len else []
    ix_req, ix_glob = build([req], max_depth), build(glob, max_depth)
    kw = dict(max_spec_tokens=max_spec_tokens, max_spec_factor=factor, min_token_prob=min_prob, max_nodes=max_nodes)
    p = speculate([ix_req, ix_glob], ctx, max_draft_depth=max_draft_depth, **kw)
    check_tree(p)
    n = p.tokens.shape[0]
    assert n <= min(max_spec_tokens, max_nodes)
    assert n <= int(factor * p.match_length + 1e-6)
    assert np.all(p.scores >= np.float32(min_prob) * (1 - 1e-6))
    depth = np.zeros(n, np.int64)
    for i in range(n):
        depth[i] = 1 if p.parents[i] < 0 else depth[p.parents[i]] + 1
    assert max_draft_depth is None or n == 0 or depth.max() <= max_draft_depth
    best, winners = naive_best(
        [[req], glob], ctx, max_depth, max_spec_tokens, factor, min_prob, max_nodes, max_draft_depth
    )
    assert float(np.sum(p.scores, dtype=np.float64)) == pytest.approx(best, abs=1e-5)
    if n:
        assert any(m == p.match_length for _, m in winners)
        # Every path probability telescopes to count(suffix + path) / count(suffix) in a winning index (when both
        # indexes tie on the best score, either one's tree may be the proposal).
        def telescopes(which: int) -> bool:
            counts = naive_counts([[req], glob][which], max_depth)
            shortest = [a for a, b in naive_groups(counts, ctx, max_depth) if b == p.match_length]
            if not shortest:
                return False
            s = tuple(ctx[len(ctx) - shortest[0] :])
            for i in range(n):
                path, j = [], i
                while j >= 0:
                    path.append(int(p.tokens[j]))
                    j = int(p.parents[j])
                want = counts.get(s + tuple(reversed(path)), 0) / counts.get(s, 1)
                if p.scores[i] != pytest.approx(want, rel=1e-5):
                    return False
            return True

        assert any(telescopes(w) for w, m in winners if m == p.match_length)


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(token_lists, min_size=1, max_size=3), ctx=token_lists, max_depth=st.integers(2, 7))
def test_match_groups_match_brute_force(seqs, ctx, max_depth):
    ix = build(seqs, max_depth)
    got = [(g[0], g[3]) for g in ix._match_groups(ctx)]
    assert got == naive_groups(naive_counts(seqs, max_depth), ctx, max_depth)


# ---------------------------------------------------------------------------- fixed-size and chain views


def _proposal(tokens, parents, scores, match_length=3):
    return Proposal(
        np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(scores, np.float32), match_length
    )


def test_proposal_to_fixed_pads_and_shifts():
    p = _proposal([7, 8, 9], [-1, -1, 0], [0.6, 0.3, 0.5])
    tokens, parents, valid = proposal_to_fixed(p, 6)
    assert tokens.dtype == np.int32 and parents.dtype == np.int32 and valid.dtype == bool
    assert tokens.tolist() == [0, 7, 8, 9, 0, 0]
    assert parents.tolist() == [-1, 0, 0, 1, 0, 0]
    assert valid.tolist() == [True, True, True, True, False, False]
    # Truncation keeps a prefix, which stays a tree because parents come first.
    tokens, parents, valid = proposal_to_fixed(p, 3)
    assert tokens.tolist() == [0, 7, 8] and parents.tolist() == [-1, 0, 0] and valid.all()
    tokens, parents, valid = proposal_to_fixed(_proposal([], [], []), 3)
    assert tokens.tolist() == [0, 0, 0] and parents.tolist() == [-1, 0, 0] and valid.tolist() == [True, False, False]
    with pytest.raises(SuffixDecodingError, match="num_nodes"):
        proposal_to_fixed(p, 0)


def test_proposal_as_chain_takes_the_best_path_not_the_greedy_one():
    # Root children: 7 (0.6, leaf) and 8 (0.4) whose child 9 (0.4) makes its path worth 0.8 > 0.6.
    p = _proposal([7, 8, 9], [-1, -1, 1], [0.6, 0.4, 0.4])
    c = proposal_as_chain(p)
    assert c.tokens.tolist() == [8, 9] and c.parents.tolist() == [-1, 0] and c.match_length == 3
    np.testing.assert_allclose(c.scores, [0.4, 0.4])
    # Equal path values: the first (higher-score) sibling wins.
    tie = proposal_as_chain(_proposal([7, 8], [-1, -1], [0.5, 0.5]))
    assert tie.tokens.tolist() == [7]
    ix = build(BRANCHY)
    tree = speculate([ix], [X, Y], max_spec_tokens=8, max_spec_factor=2.0, max_nodes=8)
    chain = proposal_as_chain(tree)
    assert chain.tokens.tolist() == [T1, T3] and chain.parents.tolist() == [-1, 0]
    assert proposal_as_chain(_proposal([], [], [])).tokens.shape == (0,)


# ---------------------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(SuffixDecodingError, match="max_depth"):
        SuffixIndex(1)
    with pytest.raises(SuffixDecodingError, match="max_sequences"):
        SuffixIndex(4, max_sequences=0)
    ix = SuffixIndex(4)
    ix.add_sequence(0, [1, 2])
    with pytest.raises(SuffixDecodingError, match="already indexed"):
        ix.add_sequence(0, [3])
    with pytest.raises(SuffixDecodingError, match="add_sequence"):
        ix.extend(1, [3])
    with pytest.raises(SuffixDecodingError, match="not indexed"):
        ix.remove(5)
    with pytest.raises(SuffixDecodingError, match="negative"):
        ix.extend(0, [-1])
    with pytest.raises(SuffixDecodingError, match="float"):
        ix.extend(0, [1.5])
    with pytest.raises(SuffixDecodingError, match="integer dtype"):
        ix.extend(0, np.array([1.0, 2.0]))
    with pytest.raises(SuffixDecodingError, match="1-D"):
        speculate([ix], np.zeros((2, 2), np.int32), max_spec_tokens=2, max_nodes=2)
    with pytest.raises(SuffixDecodingError, match="min_token_prob"):
        speculate([ix], [1], max_spec_tokens=2, max_nodes=2, min_token_prob=1.5)
    with pytest.raises(SuffixDecodingError, match="max_draft_depth"):
        speculate([ix], [1], max_spec_tokens=2, max_nodes=2, max_draft_depth=-1)
    with pytest.raises(SuffixDecodingError, match="max_spec_tokens"):
        speculate([ix], [1], max_spec_tokens=-1, max_nodes=2)
    with pytest.raises(SuffixDecodingError, match="SuffixIndex"):
        speculate([[1, 2]], [1], max_spec_tokens=2, max_nodes=2)
    assert issubclass(SuffixDecodingError, ValueError)
    assert ix.tokens(0) == [1, 2]  # failed calls leave the index untouched


# ---------------------------------------------------------------------------- timing (printed, not asserted)


def _synthetic_text(rng, n, phrases):
    """Zipf-distributed tokens mixed with a Zipf-distributed pool of repeated phrases: text-like repetition."""
    out = []
    while len(out) < n:
        if rng.random() < 0.6:
            out += phrases[min(int(rng.zipf(1.3)) - 1, len(phrases) - 1)]
        else:
            out += np.minimum(rng.zipf(1.2, rng.integers(1, 6)), 31999).tolist()
    return out[:n]


def test_timing_2000_token_context_50k_token_index(capsys):
    rng = np.random.default_rng(0)
    phrases = [np.minimum(rng.zipf(1.2, rng.integers(3, 16)), 31999).tolist() for _ in range(2000)]
    outputs = [_synthetic_text(rng, 500, phrases) for _ in range(100)]
    t0 = time.perf_counter()
    glob = build(outputs, max_depth=24, max_sequences=100)
    t_build = (time.perf_counter() - t0) / glob.num_tokens
    ctx = _synthetic_text(rng, 2000, phrases)
    t0 = time.perf_counter()
    req = build([ctx[:1800]], max_depth=24)
    t_prompt = (time.perf_counter() - t0) / 1800
    t_spec, t_ext, sizes = [], [], []
    for pos in range(1800, 2000):
        c = np.asarray(ctx[:pos], np.int32)
        t0 = time.perf_counter()
        p = speculate([req, glob], c, max_spec_tokens=16, max_spec_factor=1.0, min_token_prob=0.1, max_nodes=16)
        t_spec.append(time.perf_counter() - t0)
        sizes.append(p.tokens.shape[0])
        t0 = time.perf_counter()
        req.extend(0, [ctx[pos]])
        t_ext.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    glob.add_sequence(100, _synthetic_text(rng, 500, phrases))  # evicts sequence 0 (FIFO)
    t_evict = time.perf_counter() - t0
    t_spec = np.asarray(t_spec) * 1e6
    with capsys.disabled():
        print(
            f"\n[suffix_tree timing] index {glob.num_tokens} tokens ({glob.num_nodes} nodes), context 2000: "
            f"speculate median {np.median(t_spec):.0f} us, mean {t_spec.mean():.0f} us, p90 "
            f"{np.percentile(t_spec, 90):.0f} us, mean draft {np.mean(sizes):.1f} nodes | build "
            f"{t_build * 1e6:.1f} us/token, prompt {t_prompt * 1e6:.1f} us/token, extend(1 token) "
            f"{np.median(t_ext) * 1e6:.1f} us, add 500 + evict 500 {t_evict * 1e3:.1f} ms"
        )
