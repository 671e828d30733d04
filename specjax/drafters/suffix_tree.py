"""Host-side index for suffix decoding: model-free draft trees from earlier occurrences of the context's suffix.

The method (SuffixDecoding, Oliaro et al. 2024, as used by Arctic Inference and vLLM) keeps token statistics for
every substring of length <= `max_depth` of some token sequences: one index per request (its prompt and what it has
generated so far) and one global index (outputs of earlier requests, bounded, FIFO). At each decoding step it looks
up the last tokens of the context, and proposes the continuations that followed them most often, as a tree that the
target model verifies in one step. Verification makes the method lossless; the index only decides what is worth
verifying.

`SuffixIndex` is a trie of bounded depth: node `x` (a token string, |x| <= max_depth) holds count(x) = the number of
occurrences of x in the indexed sequences. The probability of child `x + [t]` is count(x + [t]) / count(x), so the
path probability of a draft `y` after the matched suffix `s` telescopes to count(s + y) / count(s).

Memory: a plain bounded-depth trie of N tokens has up to N * max_depth nodes (1.2 M Python objects for a 50k-token
global cache). To stay near O(N) for text that does not repeat, a node that only one occurrence passes through is a
*tail*: it stores a reference (sequence, start) instead of children, and the rest of that occurrence's window is
read from the sequence itself. A tail is expanded one level at a time when a second occurrence arrives ("split").
Invariant: a tail has count 1, and the only window whose path passes through it is its owner.

Everything here is pure Python + NumPy and runs on the host between jitted verify steps.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple, Sequence

import numpy as np

from specjax.errors import SpecjaxError

__all__ = [
    "Proposal",
    "SuffixDecodingError",
    "SuffixIndex",
    "proposal_as_chain",
    "proposal_to_fixed",
    "speculate",
]

# Slack for comparing float upper bounds against scores: pruning must never drop a candidate that an exhaustive
# search would have kept because of rounding in a different summation order.
_PRUNE_EPS = 1e-9


class SuffixDecodingError(SpecjaxError, ValueError):
    """Bad argument to the suffix-decoding index or proposer."""


class Proposal(NamedTuple):
    """A draft tree, rooted at the last context token (which is not part of it).

    tokens: [n] int32, nodes in topological order (parents before children), siblings by descending score.
    parents: [n] int32, index of the parent node, -1 for children of the root.
    scores: [n] float32, path probability of each node (product of count(child) / count(parent) along the path).
    match_length: number of context tokens that matched the index (0 when there is no proposal).
    """

    tokens: np.ndarray
    parents: np.ndarray
    scores: np.ndarray
    match_length: int


def _empty_proposal() -> Proposal:
    return Proposal(
        tokens=np.zeros((0,), np.int32),
        parents=np.zeros((0,), np.int32),
        scores=np.zeros((0,), np.float32),
        match_length=0,
    )


class _Seq:
    """One indexed sequence.

    tokens: the tokens, a live list (tails read their implicit continuation from it).
    active: node id of each window still shorter than max_depth, for window starts base, base + 1, ...,
        len(tokens) - 1. The node is the window's own tail, or the explicit node at depth == window length.
    uid: internal owner id stored in the tails of this sequence.
    """

    __slots__ = ("tokens", "active", "base", "uid")

    def __init__(self, uid: int) -> None:
        self.tokens: list[int] = []
        self.active: list[int] = []
        self.base = 0
        self.uid = uid


def _token_list(tokens, what: str) -> list[int]:
    """Validates a 1-D sequence of non-negative integer token ids and returns it as a list of Python ints."""
    if isinstance(tokens, (list, tuple)):
        if any(isinstance(t, (float, np.floating)) for t in tokens):
            raise SuffixDecodingError(f"{what} must contain integer token ids, not floats")
        try:
            out = [int(t) for t in tokens]
        except (TypeError, ValueError):
            raise SuffixDecodingError(f"{what} must contain integer token ids; got {tokens!r:.80}") from None
    else:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise SuffixDecodingError(f"{what} must be a 1-D sequence of token ids; got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise SuffixDecodingError(f"{what} must have an integer dtype; got {arr.dtype}")
        out = arr.tolist()
    if out and min(out) < 0:
        raise SuffixDecodingError(f"{what} contains a negative token id ({min(out)}); strip padding before indexing")
    return out


class SuffixIndex:
    """Bounded-depth suffix trie with occurrence counts over token sequences, supporting append and removal.

    Args:
        max_depth: longest indexed substring. A match of length L leaves room for max_depth - L draft levels.
        max_sequences: if set, `add_sequence` evicts the oldest sequence (FIFO) once this many are indexed; meant
            for the global cache of earlier outputs. None keeps everything.

    Nodes live in flat lists indexed by node id (0 is the root) rather than one Python object each: children dicts
    then map int -> int, which CPython's garbage collector does not track, so a large index adds no multi-ms
    collector pauses to the decoding loop. Freed ids are reused.
    """

    def __init__(self, max_depth: int = 24, max_sequences: int | None = None) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 2:
            raise SuffixDecodingError(f"max_depth must be an int >= 2 (match + 1 draft token); got {max_depth!r}")
        if max_sequences is not None and (
            isinstance(max_sequences, bool) or not isinstance(max_sequences, (int, np.integer)) or max_sequences < 1
        ):
            raise SuffixDecodingError(f"max_sequences must be None or an int >= 1; got {max_sequences!r}")
        self.max_depth = int(max_depth)
        self.max_sequences = None if max_sequences is None else int(max_sequences)
        # Per node: occurrence count, children {token: node} or None, depth, owner uid of a tail (-1 = explicit
        # node) and the owner's window start. Root count = number of indexed tokens (windows).
        self._cnt: list[int] = [0]
        self._kids: list[dict[int, int] | None] = [None]
        self._dep: list[int] = [0]
        self._own: list[int] = [-1]
        self._start: list[int] = [0]
        self._free: list[int] = []
        self._seqs: dict[int, _Seq] = {}  # user seq_id -> sequence; insertion order = FIFO eviction order
        self._owners: dict[int, _Seq] = {}  # uid -> sequence
        self._next_uid = 0

    # ------------------------------------------------------------------ updates

    def add_sequence(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Indexes a new sequence `tokens` [n] under `seq_id` (which must not be indexed yet)."""
        if seq_id in self._seqs:
            raise SuffixDecodingError(f"seq_id {seq_id!r} is already indexed; use extend() to append or remove() first")
        toks = _token_list(tokens, "tokens")
        if self.max_sequences is not None:
            while len(self._seqs) >= self.max_sequences:
                self.remove(next(iter(self._seqs)))
        seq = _Seq(self._next_uid)
        self._next_uid += 1
        self._seqs[seq_id] = seq
        self._owners[seq.uid] = seq
        self._append(seq, toks)

    def extend(self, seq_id: int, new_tokens: Sequence[int]) -> None:
        """Appends `new_tokens` [m] to the indexed sequence `seq_id`; O(m * max_depth)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise SuffixDecodingError(f"seq_id {seq_id!r} is not indexed; call add_sequence() first")
        self._append(seq, _token_list(new_tokens, "new_tokens"))

    def remove(self, seq_id: int) -> None:
        """Removes sequence `seq_id` and all its counts; O(len * shared depth)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise SuffixDecodingError(f"seq_id {seq_id!r} is not indexed; nothing to remove")
        del self._owners[seq.uid]
        cnt, kids = self._cnt, self._kids
        toks, depth = seq.tokens, self.max_depth
        n = len(toks)
        cnt[0] -= n
        for i in range(n):
            node = 0
            for j in range(i, min(n, i + depth)):
                parent = node
                node = kids[parent][toks[j]]
                cnt[node] -= 1
                if cnt[node] == 0:
                    # Only this window went through `node`, so its whole subtree (tails included) was its own.
                    del kids[parent][toks[j]]
                    if not kids[parent]:
                        kids[parent] = None
                    self._release(node)
                    break

    def _release(self, node: int) -> None:
        kids, own, free = self._kids, self._own, self._free
        stack = [node]
        while stack:
            x = stack.pop()
            if kids[x]:
                stack.extend(kids[x].values())
            kids[x] = None
            own[x] = -1
            free.append(x)

    def _new(self, depth: int, uid: int, start: int) -> int:
        """A new tail node (count 1) owned by window `start` of sequence `uid`."""
        if self._free:
            x = self._free.pop()
            self._cnt[x] = 1
            self._dep[x] = depth
            self._own[x] = uid
            self._start[x] = start
            return x
        self._cnt.append(1)
        self._kids.append(None)
        self._dep.append(depth)
        self._own.append(uid)
        self._start.append(start)
        return len(self._cnt) - 1

    def _append(self, seq: _Seq, new_tokens: list[int]) -> None:
        # Per token: every window shorter than max_depth grows by it, and a new window starts at it. A window sitting
        # on its own tail grows for free (the tail reads the live token list); the others take one trie step.
        toks, act, depth = seq.tokens, seq.active, self.max_depth
        own, cnt, kids, step = self._own, self._cnt, self._kids, self._step
        for t in new_tokens:
            toks.append(t)
            base = seq.base
            for k in range(len(act)):
                node = act[k]
                # An explicit node is at depth == the window's length before this token. (A split by another window
                # of this sequence turns the window's tail into a deeper tail: it never leaves it explicit.)
                if own[node] < 0:
                    children = kids[node]
                    child = None if children is None else children.get(t)
                    if child is not None and own[child] < 0:  # the common case, inlined from _step
                        cnt[child] += 1
                        act[k] = child
                    else:
                        act[k] = step(node, t, seq, base + k)
            act.append(step(0, t, seq, len(toks) - 1))
            if len(toks) - base >= depth:  # the oldest window just reached max_depth: it is complete
                del act[0]
                seq.base = base + 1
        self._cnt[0] += len(new_tokens)

    def _step(self, node: int, t: int, seq: _Seq, start: int) -> int:
        """Counts window `start` of `seq` one level deeper, below `node`, with token `t`; returns the new node."""
        children = self._kids[node]
        if children is None:
            child = self._new(self._dep[node] + 1, seq.uid, start)
            self._kids[node] = {t: child}
            return child
        child = children.get(t)
        if child is None:
            child = children[t] = self._new(self._dep[node] + 1, seq.uid, start)
            return child
        if self._own[child] >= 0:
            self._split(child)
        self._cnt[child] += 1
        return child

    def _split(self, node: int) -> None:
        """Turns tail `node` into an explicit node whose one child is the owner's tail one level deeper."""
        owner = self._owners[self._own[node]]
        start, d = self._start[node], self._dep[node]
        self._own[node] = -1
        toks = owner.tokens
        if d < self.max_depth and start + d < len(toks):
            child = self._new(d + 1, owner.uid, start)
            self._kids[node] = {toks[start + d]: child}
            k = start - owner.base
            if 0 <= k < len(owner.active):  # keep the owner's growing window pointed at its (new) tail
                owner.active[k] = child

    # ------------------------------------------------------------------ queries

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        """Number of indexed sequences."""
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        """Indexed sequence ids, oldest first (the FIFO eviction order)."""
        return list(self._seqs)

    @property
    def num_tokens(self) -> int:
        """Total number of indexed tokens."""
        return self._cnt[0]

    @property
    def num_nodes(self) -> int:
        """Number of explicit trie nodes, root excluded (a memory measure)."""
        return len(self._cnt) - len(self._free) - 1

    def tokens(self, seq_id: int) -> list[int]:
        """A copy of the tokens indexed under `seq_id`."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise SuffixDecodingError(f"seq_id {seq_id!r} is not indexed")
        return list(seq.tokens)

    def count(self, pattern: Sequence[int]) -> int:
        """Number of occurrences of `pattern` (1 <= len <= max_depth) in the indexed sequences."""
        pat = _token_list(pattern, "pattern")
        if not 1 <= len(pat) <= self.max_depth:
            raise SuffixDecodingError(f"pattern length must be in [1, max_depth={self.max_depth}]; got {len(pat)}")
        cur = self._walk(pat)
        if cur is None:
            return 0
        return 1 if self._own[cur[0]] >= 0 else self._cnt[cur[0]]

    def substring_counts(self) -> dict[tuple[int, ...], int]:
        """Every indexed substring (length <= max_depth) with its count; O(N * max_depth), for tests and debugging."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while stack:
            node, path = stack.pop()
            if self._own[node] >= 0:
                toks, start = self._owners[self._own[node]].tokens, self._start[node]
                for j in range(start + self._dep[node], min(len(toks), start + self.max_depth)):
                    path = path + (toks[j],)
                    out[path] = 1
            elif self._kids[node]:
                for t, child in self._kids[node].items():
                    key = path + (t,)
                    out[key] = self._cnt[child]
                    stack.append((child, key))
        return out

    def _walk(self, pattern: list[int]) -> tuple[int, int] | None:
        """Cursor (node, extra) for `pattern`: `extra` > 0 means `extra` tokens below tail `node`; None if absent."""
        own, kids = self._own, self._kids
        node, extra = 0, 0
        for t in pattern:
            uid = own[node]
            if uid >= 0:
                toks, start = self._owners[uid].tokens, self._start[node]
                pos = start + self._dep[node] + extra
                if pos < len(toks) and pos < start + self.max_depth and toks[pos] == t:
                    extra += 1
                    continue
                return None
            children = kids[node]
            if children is None:
                return None
            node = children.get(t)
            if node is None:
                return None
        return node, extra

    def _has_continuation(self, node: int, extra: int) -> bool:
        uid = self._own[node]
        if uid >= 0:
            return self._dep[node] + extra < min(self.max_depth, len(self._owners[uid].tokens) - self._start[node])
        return bool(self._kids[node])

    def _match_groups(self, ctx: list[int]) -> list[tuple[int, int, int, int]]:
        """Suffixes of `ctx` that occur with a continuation, grouped by count: [(shortest L, node, extra, longest L)]
        per distinct count, L ascending.

        "Occurs with a continuation" is closed under shortening the suffix, so the scan stops at the first L that
        fails. Counts never grow with L; when count(ctx[-L:]) == count(ctx[-L-1:]), every occurrence of ctx[-L:] is
        an occurrence of ctx[-L-1:], so both predict the same continuations: the group's evidence is a match of its
        longest length, while the trie node of its shortest suffix has the most depth room (max_depth - L) left.
        """
        own, cnt = self._own, self._cnt
        groups: list[tuple[int, int, int, int]] = []
        last_count = -1
        limit = min(self.max_depth - 1, len(ctx))
        for length in range(1, limit + 1):
            cur = self._walk(ctx[len(ctx) - length :])
            if cur is None or not self._has_continuation(*cur):
                break
            node, extra = cur
            uid = own[node]
            longest = length
            if uid >= 0:
                # A tail: ctx[-length:] occurs once, at the start of the tail's window. Longer suffixes can only
                # match that same occurrence extended to the left, so compare tokens instead of walking the trie.
                toks, at = self._owners[uid].tokens, self._start[node] + length  # `at`: end of the occurrence
                while longest < limit and at > longest and toks[at - longest - 1] == ctx[-longest - 1]:
                    longest += 1
            c = 1 if uid >= 0 else cnt[node]
            if c == last_count:
                groups[-1] = groups[-1][:3] + (longest,)
            else:
                groups.append((length, node, extra, longest))
                last_count = c
            if uid >= 0:
                break
        return groups

    def _grow(self, node: int, extra: int, budget: int, min_prob: float, max_levels: int, floor: float):
        """Best-first draft tree below cursor (node, extra): at most `budget` nodes and `max_levels` levels, every
        node with probability >= min_prob, in pop order (topological, siblings by descending probability).
        Returns (tokens, parents, probs, score), or None if the tree is empty or cannot reach a score >= floor."""
        cnt, kids, own, dep, start_of, owners = self._cnt, self._kids, self._own, self._dep, self._start, self._owners
        depth_cap = self.max_depth
        out_tok: list[int] = []
        out_par: list[int] = []
        out_p: list[float] = []
        out_dep: list[int] = []
        heap: list[tuple] = []
        tie = 0  # FIFO among equal probabilities: deterministic, and keeps siblings in their sorted order
        heappush, heappop = heapq.heappush, heapq.heappop

        def push_children(cnode: int, cextra: int, parent: int, p: float) -> None:
            nonlocal tie
            uid = own[cnode]
            if uid >= 0:
                toks, st = owners[uid].tokens, start_of[cnode]
                pos = st + dep[cnode] + cextra
                if pos < len(toks) and pos < st + depth_cap:
                    tie += 1  # one implicit child, count 1 / 1: same probability
                    heappush(heap, (-p, tie, parent, toks[pos], cnode, cextra + 1, None, 0, 0.0))
                return
            children = kids[cnode]
            if not children:
                return
            base = p / cnt[cnode]
            # (-count, token, node): most frequent first, then the smaller token id, by plain tuple order.
            sibs = [(-cnt[c], t, c) for t, c in children.items() if cnt[c] * base >= min_prob]
            if not sibs:
                return
            room = budget - len(out_tok)  # siblings past this rank can never be drafted
            if len(sibs) > room:
                sibs = heapq.nsmallest(room, sibs)
            elif len(sibs) > 1:
                sibs.sort()
            # Only the best sibling enters the heap; the next one follows when it is popped (lazy k-best), so a
            # wide node costs one selection, not a heap entry per child.
            c0, t0, n0 = sibs[0]
            tie += 1
            heappush(heap, (c0 * base, tie, parent, t0, n0, 0, sibs, 0, base))

        push_children(node, extra, -1, 1.0)
        score = 0.0
        while heap:
            negp, _, parent, tok, cnode, cextra, sibs, k, base = heappop(heap)
            p = -negp
            # Every later node has probability <= p, so this bounds the final score.
            if score + (budget - len(out_tok)) * p < floor - _PRUNE_EPS:
                return None
            idx = len(out_tok)
            out_tok.append(tok)
            out_par.append(parent)
            out_p.append(p)
            out_dep.append(1 if parent < 0 else out_dep[parent] + 1)
            score += p
            if idx + 1 >= budget:
                break
            if sibs is not None and k + 1 < len(sibs):
                c1, t1, n1 = sibs[k + 1]
                tie += 1
                heappush(heap, (c1 * base, tie, parent, t1, n1, 0, sibs, k + 1, base))
            if out_dep[idx] < max_levels:
                push_children(cnode, cextra, idx, p)
        if not out_tok or score < floor - _PRUNE_EPS:
            return None
        return out_tok, out_par, out_p, score


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise SuffixDecodingError(f"{name} must be an int >= {lo}; got {value!r}")
    return int(value)


def speculate(
    indexes: Sequence[SuffixIndex],
    context: Sequence[int],
    *,
    max_spec_tokens: int,
    max_spec_factor: float = 1.0,
    min_token_prob: float = 0.1,
    max_nodes: int,
    max_draft_depth: int | None = None,
) -> Proposal:
    """Proposes a draft tree continuing `context` [T] from the suffix indexes.

    Per index (pass the per-request index first, then the global one), the suffixes context[-L:], 1 <= L <
    max_depth, that occur followed by at least one token are grouped by occurrence count: equal counts mean every
    occurrence of the shorter suffix extends to the longer one, so a group predicts one distribution and is a match
    of its longest length L. Each group grows one tree, best-first by path probability, from the trie node of its
    shortest suffix (the most depth room left), with
    - number of draft nodes <= min(max_spec_tokens, floor(max_spec_factor * L), max_nodes): longer matches may
      speculate more tokens;
    - every node's path probability >= min_token_prob;
    - tree depth <= max_draft_depth (None: only the index's depth room limits it), for verify steps compiled
      for a fixed depth.
    The tree with the highest score (sum of path probabilities = expected number of accepted tokens under the
    index's statistics) wins; ties go to the earlier index, then to the longer match. Branch-and-bound skips groups
    that cannot win; the result equals the exhaustive search over groups. (Arctic Inference instead grows one tree
    per L from that L's own node; for every L, its group's tree has the same statistics with at least the same
    budget and depth room, so it scores at least as high.)

    Returns an empty Proposal (n = 0, match_length 0) when nothing matches.
    """
    max_spec_tokens = _check_int("max_spec_tokens", max_spec_tokens, 0)
    max_nodes = _check_int("max_nodes", max_nodes, 0)
    levels = max_nodes if max_draft_depth is None else _check_int("max_draft_depth", max_draft_depth, 0)
    try:
        factor = float(max_spec_factor)
        min_prob = float(min_token_prob)
    except (TypeError, ValueError):
        raise SuffixDecodingError("max_spec_factor and min_token_prob must be numbers") from None
    if not factor >= 0.0:
        raise SuffixDecodingError(f"max_spec_factor must be >= 0; got {max_spec_factor!r}")
    if not 0.0 <= min_prob <= 1.0:
        raise SuffixDecodingError(f"min_token_prob must be in [0, 1]; got {min_token_prob!r}")
    indexes = list(indexes)
    for ix in indexes:
        if not isinstance(ix, SuffixIndex):
            raise SuffixDecodingError(f"indexes must be SuffixIndex objects; got {type(ix).__name__}")
    if not indexes or max_spec_tokens == 0 or max_nodes == 0 or levels == 0:
        return _empty_proposal()
    # Only the last max_depth - 1 tokens can ever match; slice before converting a long context.
    tail = max(ix.max_depth for ix in indexes) - 1
    if isinstance(context, (list, tuple)):
        ctx = _token_list(context[len(context) - tail :] if len(context) > tail else context, "context")
    else:
        arr = np.asarray(context)
        if arr.ndim != 1:
            raise SuffixDecodingError(f"context must be a 1-D sequence of token ids; got shape {arr.shape}")
        ctx = _token_list(arr[-tail:], "context")

    best = None  # (tokens, parents, probs, match length)
    best_score = 0.0
    for ix in indexes:
        groups = []
        for shortest, node, extra, longest in ix._match_groups(ctx):
            budget = min(max_spec_tokens, int(factor * longest + 1e-6), max_nodes)
            # Every node has probability <= 1 and every tree level sums to <= 1: bounded by nodes and by levels.
            if budget > 0:
                groups.append((min(budget, levels, ix.max_depth - shortest), longest, budget, node, extra))
        groups.sort(key=lambda g: (-g[0], -g[1]))
        local_best = 0  # match length of the best proposal if it came from this index
        for bound, longest, budget, node, extra in groups:
            if bound < best_score - _PRUNE_EPS:
                break
            grown = ix._grow(node, extra, budget, min_prob, levels, best_score)
            if grown is None:
                continue
            toks, pars, probs, score = grown
            if local_best:
                wins = score > best_score or (score == best_score and longest > local_best)
            else:
                wins = best is None or score > best_score
            if wins:
                best, best_score, local_best = (toks, pars, probs, longest), score, longest
    if best is None:
        return _empty_proposal()
    toks, pars, probs, length = best
    return Proposal(
        tokens=np.asarray(toks, np.int32),
        parents=np.asarray(pars, np.int32),
        scores=np.asarray(probs, np.float32),
        match_length=int(length),
    )


def _check_proposal(proposal: Proposal) -> None:
    if not isinstance(proposal, Proposal):
        raise SuffixDecodingError(f"expected a Proposal; got {type(proposal).__name__}")
    n = proposal.tokens.shape[0]
    if proposal.parents.shape != (n,) or proposal.scores.shape != (n,):
        raise SuffixDecodingError("Proposal tokens, parents and scores must all have shape [n]")


def proposal_to_fixed(proposal: Proposal, num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pads a proposal to a static node budget for the jitted verify step.

    Returns tokens [num_nodes] int32, parents [num_nodes] int32, valid [num_nodes] bool. Node 0 is the root
    placeholder (the last context token; token left 0 for the caller to fill, parent -1, valid). Proposal node i
    becomes node i + 1 and parent indices are shifted to match. Padding nodes have token 0, parent 0, valid False.
    A proposal with more than num_nodes - 1 nodes is truncated to its first nodes: they are topologically ordered
    and best-first, so the result is still a tree, holding the most likely nodes.
    """
    _check_proposal(proposal)
    num_nodes = _check_int("num_nodes", num_nodes, 1)
    tokens = np.zeros((num_nodes,), np.int32)
    parents = np.zeros((num_nodes,), np.int32)
    valid = np.zeros((num_nodes,), bool)
    parents[0] = -1
    m = min(proposal.tokens.shape[0], num_nodes - 1)
    tokens[1 : m + 1] = proposal.tokens[:m]
    parents[1 : m + 1] = proposal.parents[:m] + 1
    valid[: m + 1] = True
    return tokens, parents, valid


def proposal_as_chain(proposal: Proposal) -> Proposal:
    """The root-to-node path of `proposal` with the largest sum of scores (expected accepted tokens for chain
    verification; ties go to the higher-score sibling). Returns a Proposal with parents [-1, 0, 1, ...]."""
    _check_proposal(proposal)
    n = proposal.tokens.shape[0]
    if n == 0:
        return proposal
    scores = proposal.scores.astype(np.float64)
    parents = proposal.parents.tolist()
    value = scores.tolist()  # value[i]: best path sum from node i down
    best_child = [-1] * (n + 1)  # slot n is the root
    best_value = [-1.0] * (n + 1)
    # Children come after parents, so a reverse sweep finishes every subtree before its parent; ">=" lets the
    # lower index (the higher-score sibling) win ties, since it is visited later.
    for i in range(n - 1, -1, -1):
        if best_child[i] >= 0:
            value[i] += best_value[i]
        p = parents[i] if parents[i] >= 0 else n
        if value[i] >= best_value[p]:
            best_value[p], best_child[p] = value[i], i
    path = []
    node = best_child[n]
    while node >= 0:
        path.append(node)
        node = best_child[node]
    path_arr = np.asarray(path, np.int64)
    return Proposal(
        tokens=proposal.tokens[path_arr].astype(np.int32),
        parents=np.arange(-1, len(path) - 1, dtype=np.int32),
        scores=proposal.scores[path_arr].astype(np.float32),
        match_length=proposal.match_length,
    )
