"""Drafters and the speculative engine's bookkeeping, on tiny random models (fast).

* n-gram lookup against a plain-Python reference and hand-made histories (longest n first, latest match,
  continuation cut at the history end, no match).
* The draft-model drafter's KV cache after rejections and back-off steps: its next proposal equals the proposal
  of a fresh draft prefilled on the same history.
* The suffix drafter's host state: the tree it proposes from the prompt index, the request's own output and the
  global index.
* Engine: greedy speculative output equals plain greedy output for batches whose rows accept different counts,
  stop tokens inside an accepted run, max_new_tokens that is not a multiple of gamma + 1, static trees from
  `tree.from_choices` (accepted paths through non-first siblings, non-contiguous node indices, depth positions),
  dynamic suffix trees, and the adaptive back-off.

The oracle drafters know the target's plain greedy continuation, so the number of accepted tokens per step is
designed, not hoped for: each step one node is chosen whose root path carries the right tokens, every other node
carries a wrong one.
"""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import engine, spec_engine
from specjax.backoff import Adaptive
from specjax.config import SamplingParams
from specjax.drafters.base import DraftContext, Proposal, Stateless
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.suffix import SuffixDrafter, SuffixHostState
from specjax.drafters.suffix_tree import SuffixIndex
from specjax.tree import TreeSpec, chain, from_choices

from spec_helpers import (make_sampling, outputs, run_plain, run_spec, run_suffix, spec_start, tiny_buckets,
                          tiny_config, tiny_llm, tiny_params)

V = 64
BATCH = 4
MAX_NEW = 32
BUCKETS = tiny_buckets(BATCH, prompt_len=16, max_new=MAX_NEW, extra=16)
PROMPTS = [
    [7, 3, 9, 12, 40],
    [1, 2, 3, 4, 5, 6, 1, 2],
    [33, 17, 50, 2, 61, 8, 8, 19, 44, 5, 21],
    [9, 9, 10, 11, 9, 9, 10, 11, 9, 9, 10, 11, 9, 9],
]


@pytest.fixture(scope="module")
def target():
    config = tiny_config(V)
    return config, tiny_params(config, seed=0)


@pytest.fixture(scope="module")
def draft():
    config = tiny_config(V, num_layers=1)
    return config, tiny_params(config, seed=1)


@pytest.fixture(scope="module")
def plain_greedy(target):
    """Plain greedy outputs (no stop ids, MAX_NEW tokens) of PROMPTS."""
    config, params = target
    outs, finish = outputs(run_plain(params, config, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW)),
                           len(PROMPTS))
    assert all(len(o) == MAX_NEW for o in outs) and np.all(finish == engine.FINISH_LENGTH)
    return outs


def reference_rows(prompts, outs, width: int) -> jnp.ndarray:
    """[B, width] int32: each row the prompt followed by its greedy continuation (zero padded)."""
    ref = np.zeros((BATCH, width), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = (list(p) + list(o))[:width]
        ref[i, :len(seq)] = seq
    return jnp.asarray(ref)


# ------------------------------------------------------------------------------------------------- n-gram


def ngram_reference(hist: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup, written the obvious way: for n = max..min, the latest earlier occurrence of the last n
    tokens (with at least one token after it) wins; propose up to gamma tokens that follow it, stopping at the
    end of the history."""
    h = len(hist)
    for n in range(max_n, min_n - 1, -1):
        if h <= n:
            continue
        key = hist[h - n:]
        for i in range(h - n - 1, -1, -1):
            if hist[i:i + n] == key:
                return hist[i + n:i + n + gamma]
    return []


def ngram_propose(drafter: NgramDrafter, hists: list[list[int]], width: int = 32, pad_token: int | None = None):
    """Run the drafter on histories (right-padded to `width`; padding repeats the last token unless pad_token is
    given, so a lookup that reads past the history end would find spurious matches). Returns (tokens, valid)."""
    B = len(hists)
    hist = np.zeros((B, width), np.int32)
    for b, h in enumerate(hists):
        hist[b, :len(h)] = h
        hist[b, len(h):] = h[-1] if pad_token is None else pad_token
    hlen = np.asarray([len(h) for h in hists], np.int32)
    last = np.asarray([h[-1] for h in hists], np.int32)
    ctx = DraftContext(jnp.asarray(hist), jnp.asarray(hlen), jnp.asarray(last), jnp.asarray(hlen - 1),
                       make_sampling(B), jnp.zeros((B,), jnp.int32), None)
    prop, _ = jax.jit(lambda c: drafter.propose({}, (), c))(ctx)
    tokens, valid = np.asarray(prop.tokens), np.asarray(prop.valid)
    assert np.array_equal(tokens[:, 0], last) and valid[:, 0].all(), "node 0 must be the root (last token)"
    assert np.array_equal(np.asarray(prop.parents), np.broadcast_to(np.arange(-1, drafter.num_speculative_tokens),
                                                                    tokens.shape)), "an n-gram draft is a chain"
    return tokens, valid


def proposed(tokens, valid, b: int) -> list[int]:
    v = valid[b, 1:]
    assert not np.any(v[np.argmin(v):]) or v.all(), f"row {b}: valid nodes must be a prefix of the chain: {v}"
    return tokens[b, 1:][v].tolist()


def test_ngram_prefers_the_longest_n_even_over_a_later_shorter_match():
    # last 3 tokens [1, 2, 3] occur at the start (continuation 10 11 12 13); the 1-gram [3] also occurs later,
    # followed by 20 21 9 1.
    hist = [1, 2, 3, 10, 11, 12, 13, 3, 20, 21, 9, 1, 2, 3]
    tokens, valid = ngram_propose(NgramDrafter(4, 1, 3), [hist])
    assert proposed(tokens, valid, 0) == [10, 11, 12, 13]
    tokens, valid = ngram_propose(NgramDrafter(4, 1, 1), [hist])
    assert proposed(tokens, valid, 0) == [20, 21, 9, 1]


def test_ngram_takes_the_latest_match_and_cuts_at_the_history_end():
    # [4, 5] occurs at 0 (followed by 1 4 5 2) and at 3 (followed by 2 4 5, then the history ends).
    hist = [4, 5, 1, 4, 5, 2, 4, 5]
    tokens, valid = ngram_propose(NgramDrafter(4, 1, 3), [hist])
    assert proposed(tokens, valid, 0) == [2, 4, 5]
    assert valid[0].tolist() == [True, True, True, True, False]


def test_ngram_without_a_match_proposes_nothing():
    hists = [[1, 2, 3, 4, 5], [7], [8, 8]]
    tokens, valid = ngram_propose(NgramDrafter(3, 1, 3), hists)
    assert not valid[0, 1:].any() and not valid[1, 1:].any()
    assert proposed(tokens, valid, 2) == [8]          # [8] then the end of the history
    # only a 1-gram matches, and 1-grams are switched off
    tokens, valid = ngram_propose(NgramDrafter(3, 2, 3), [[5, 6, 7, 5]])
    assert not valid[0, 1:].any()


@pytest.mark.parametrize("gamma,min_n,max_n", [(4, 1, 3), (2, 2, 4), (6, 1, 1), (3, 3, 3)])
def test_ngram_matches_the_reference_on_random_histories(gamma, min_n, max_n):
    rng = np.random.default_rng(gamma * 100 + min_n * 10 + max_n)
    hists = [rng.integers(0, 3, size=int(rng.integers(1, 25))).tolist() for _ in range(64)]
    # padding with a token that is in the vocabulary, so reading past hist_len would create false matches
    tokens, valid = ngram_propose(NgramDrafter(gamma, min_n, max_n), hists, pad_token=0)
    found = 0
    for b, h in enumerate(hists):
        want = ngram_reference(h, gamma, min_n, max_n)
        assert proposed(tokens, valid, b) == want, f"history {h}: got {proposed(tokens, valid, b)}, want {want}"
        found += bool(want)
    assert found > 10, "the random histories should often have matches"


# ------------------------------------------------------------------------------------------------- oracle drafter


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Stateless):
    """Drafts a static tree with knowledge of the target's greedy continuation (dparams["ref"] [B, R]).

    Each step designates one node t: the nodes on t's root path carry the correct greedy tokens, every other
    node a token that is wrong at its depth ((right + 1 + sibling rank) mod V, so siblings differ). Greedy
    verification must then accept exactly depth(t) tokens. dparams["pick"] [B] chooses t per row (data, so
    one compiled loop serves every variant): PICK_CYCLE (t moves with the step and the row), PICK_ROW
    (t = row index: rows accept different counts), PICK_DEEPEST (t = last node: a chain is accepted in full).
    """

    tree: TreeSpec
    rank: tuple  # [N] sibling rank of each node (root -1)
    vocab_size: int
    mode: str = "deterministic"
    features: tuple = ()

    def designated(self, pick: jnp.ndarray, ctx: DraftContext) -> jnp.ndarray:
        N = self.tree.num_nodes
        rows = jnp.arange(ctx.last_token.shape[0])
        return jnp.where(pick == PICK_CYCLE, (ctx.step * 5 + rows * 3) % N,
                         jnp.where(pick == PICK_ROW, rows % N, N - 1))

    def propose(self, dparams, dstate, ctx: DraftContext):
        ref = dparams["ref"]
        B, R = ref.shape
        N = self.tree.num_nodes
        depth = jnp.asarray(self.tree.depth)
        on_path = jnp.asarray(self.tree.ancestor_mask)[self.designated(dparams["pick"], ctx)]  # [B, N]
        pos = ctx.hist_len[:, None] - 1 + depth[None, :]  # ref index of the right token at each node's depth
        right = jnp.take_along_axis(ref, jnp.clip(pos, 0, R - 1), axis=1)
        wrong = (right + 1 + jnp.maximum(jnp.asarray(self.rank), 0)[None, :]) % self.vocab_size
        tokens = jnp.where(on_path, right, wrong).at[:, 0].set(ctx.last_token).astype(jnp.int32)
        parents = jnp.broadcast_to(jnp.asarray(self.tree.parents_array), (B, N))
        return Proposal(tokens, parents, jnp.ones((B, N), bool), None), dstate


PICK_CYCLE, PICK_ROW, PICK_DEEPEST = 0, 1, 2
CHAIN_ORACLE = OracleDrafter(chain(4), (-1, 0, 0, 0, 0), V)


def oracle_params(plain_greedy, pick: int) -> dict:
    return {"ref": reference_rows(PROMPTS, plain_greedy, BUCKETS.capacity),
            "pick": jnp.full((BATCH,), pick, jnp.int32)}


TREE_CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (1, 0, 0), (1, 1, 0),
                (1, 1, 0, 0), (2, 0, 0), (2, 0, 0, 0))


def spec_greedy(target, drafter, dparams, prompts=PROMPTS, sampling=None, adaptive=None):
    config, params = target
    sampling = make_sampling(BATCH, max_new=MAX_NEW) if sampling is None else sampling
    state = run_spec(params, config, dparams, drafter, BUCKETS, prompts, sampling, adaptive=adaptive)
    outs, finish = outputs(state.dec, len(prompts))
    return outs, finish, state


def assert_equal_outputs(got, want, what: str):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{what}, row {i}: speculative {g} != plain {w}"


def test_rows_with_different_accept_counts_match_plain_greedy(target, plain_greedy):
    config, params = target
    dparams = oracle_params(plain_greedy, PICK_ROW)  # row b accepts exactly b tokens per verify step
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    # six steps: no row has finished yet (row 3 needs 8), so every step accepted its designed count
    part = run_spec(params, config, dparams, CHAIN_ORACLE, BUCKETS, PROMPTS, sampling, max_steps=6)
    assert np.asarray(part.stats.verify_steps).tolist() == [6] * BATCH
    assert np.asarray(part.stats.accepted).tolist() == [0, 6, 12, 18]
    assert np.asarray(part.dec.num_new).tolist() == [1 + 6 * (b + 1) for b in range(BATCH)]
    outs, finish, state = spec_greedy(target, CHAIN_ORACLE, dparams)
    assert_equal_outputs(outs, plain_greedy, "oracle chain, per-row accept counts")
    # rows that accept more finish in fewer steps; all of them emitted exactly MAX_NEW tokens
    steps = np.asarray(state.stats.verify_steps)
    assert steps.tolist() == [-(-(MAX_NEW - 1) // (b + 1)) for b in range(BATCH)], steps
    assert np.all(finish == engine.FINISH_LENGTH)


def test_static_tree_from_choices_matches_plain_greedy(target, plain_greedy):
    tree, rank = from_choices(TREE_CHOICES)
    drafter = OracleDrafter(tree, tuple(int(r) for r in rank), V)
    dparams = oracle_params(plain_greedy, PICK_CYCLE)
    config, params = target
    # six steps (at most 5 tokens each: no row finishes): the walk accepted exactly the designated paths
    k = 6
    part = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW),
                    max_steps=k)
    designed = [sum(int(tree.depth[(step * 5 + b * 3) % tree.num_nodes]) for step in range(1, k + 1))
                for b in range(BATCH)]
    assert np.asarray(part.stats.accepted).tolist() == designed
    outs, _, state = spec_greedy(target, drafter, dparams)
    assert_equal_outputs(outs, plain_greedy, "oracle tree")
    pos_acc = np.asarray(state.stats.pos_accepted).sum(0)
    # depth-4 nodes were accepted (paths such as 2 -> 7 -> 11 -> 13 through non-first siblings: the K/V of
    # non-contiguous nodes was compacted and their positions were prefix + depth)
    assert pos_acc.shape == (tree.max_depth,) and np.all(pos_acc > 0), pos_acc


def test_stop_token_inside_an_accepted_run(target, plain_greedy):
    """The stop token is an accepted draft token in the middle of a run: the output ends right there."""
    gamma = 4
    config, params = target
    row = 2
    out = plain_greedy[row]
    # with every draft accepted, output position k (k >= 1) is a drafted (not bonus) token iff (k-1) % 5 < 4
    cands = [k for k in range(1, MAX_NEW - 1) if (k - 1) % (gamma + 1) < gamma and out[k] not in out[:k]]
    assert cands, f"no stop candidate in {out}; change the test model"
    k = cands[0]
    stop = out[k]
    sampling = make_sampling(BATCH, max_new=MAX_NEW, stop_ids=[stop])
    plain, plain_finish = outputs(run_plain(params, config, BUCKETS, PROMPTS, sampling), len(PROMPTS))
    assert plain[row] == out[:k + 1] and plain_finish[row] == engine.FINISH_STOP
    outs, finish, state = spec_greedy(target, CHAIN_ORACLE, oracle_params(plain_greedy, PICK_DEEPEST),
                                      sampling=sampling)
    assert_equal_outputs(outs, plain, "stop token")
    assert np.array_equal(finish, plain_finish)
    assert np.all(np.asarray(state.dec.out_tokens)[row, k + 1:] == -1), "tokens after the stop were written"


def test_exact_max_new_tokens(target, plain_greedy):
    """Per-row budgets 1, 2, 7, 13 with gamma = 4 (5 tokens per step): never overshoot."""
    budgets = [1, 2, 7, 13]
    sampling = make_sampling(BATCH, max_new=budgets)
    outs, finish, state = spec_greedy(target, CHAIN_ORACLE, oracle_params(plain_greedy, PICK_DEEPEST),
                                      sampling=sampling)
    for i, n in enumerate(budgets):
        assert outs[i] == plain_greedy[i][:n], f"row {i} (max_new {n}): {outs[i]}"
    assert np.all(finish == engine.FINISH_LENGTH)
    toks = np.asarray(state.dec.out_tokens)
    assert all(np.all(toks[i, n:] == -1) for i, n in enumerate(budgets)), "tokens written past max_new_tokens"


def test_api_stop_and_length_through_generate(target):
    """Through `LLM.generate` with the n-gram drafter: same tokens as plain, finish reasons 'stop' / 'length'."""
    config, params = target
    llm = tiny_llm(config, params)
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[0]]  # batch bucket 4: one padding row
    # max_new 16 and 7 share one shape bucket (one plain and one speculative compile)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    spec_cfg = {"method": "ngram", "num_speculative_tokens": 4}
    out0 = plain[0].token_ids
    stop = next((t for k, t in enumerate(out0) if k >= 3 and t not in out0[:k]), None)
    assert stop is not None, f"no fresh token after position 3 in {out0}; change the test prompt"
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=7),
               SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop])):
        want = llm.generate(prompts, sp)
        got = llm.generate(prompts, sp, speculative_config=spec_cfg)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert g.metrics.verify_steps is not None and g.metrics.accepted <= g.metrics.drafted
        if sp.stop_token_ids:
            assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
        else:
            assert [len(g.token_ids) for g in got] == [7] * 3 and {g.finish_reason for g in got} == {"length"}


# ------------------------------------------------------------------------------------------------- real drafters


ADAPTIVE = {
    "always": None,
    "backoff": Adaptive(min_gain=5.0, probe_every=2, max_gap_factor=1),  # probes every 3rd step
}


def test_ngram_greedy_matches_plain(target, plain_greedy):
    outs, _, state = spec_greedy(target, NgramDrafter(4, 1, 3), {})
    assert_equal_outputs(outs, plain_greedy, "ngram")
    assert np.asarray(state.stats.accepted).sum() > 0, "n-gram drafts were never accepted: nothing was tested"


@pytest.mark.parametrize("adaptive", list(ADAPTIVE))
def test_draft_model_greedy_matches_plain(target, draft, plain_greedy, adaptive):
    dcfg, dparams = draft
    drafter = DraftModelDrafter(dcfg, 3, V)
    outs, _, state = spec_greedy(target, drafter, {"params": dparams}, adaptive=ADAPTIVE[adaptive])
    assert_equal_outputs(outs, plain_greedy, f"draft model ({adaptive})")
    acc, dr = np.asarray(state.stats.accepted).sum(), np.asarray(state.stats.drafted).sum()
    assert 0 < acc < dr, f"accepted {acc} of {dr}: the test needs both acceptances and rejections"


def test_greedy_rows_next_to_sampled_rows(target, draft, plain_greedy):
    """Temperature is per row: greedy rows of a batch whose other rows sample still equal plain greedy."""
    dcfg, dparams = draft
    sampling = make_sampling(BATCH, temperature=[0.0, 1.0, 0.0, 1.0], seed=[1, 2, 3, 4], max_new=MAX_NEW)
    outs, _, state = spec_greedy(target, DraftModelDrafter(dcfg, 3, V), {"params": dparams}, sampling=sampling)
    assert outs[0] == plain_greedy[0] and outs[2] == plain_greedy[2]
    assert outs[1] != plain_greedy[1] or outs[3] != plain_greedy[3], "the sampled rows decoded greedily"


def test_suffix_greedy_matches_plain(target, plain_greedy):
    config, params = target
    drafter = SuffixDrafter(num_speculative_tokens=6, max_tree_depth=4)
    state, glob = run_suffix(params, config, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW))
    outs, _ = outputs(state.dec, len(PROMPTS))
    assert_equal_outputs(outs, plain_greedy, "suffix (fresh global index)")
    assert np.asarray(state.stats.accepted).sum() > 0
    # second run: the global index now holds the first run's outputs, so whole continuations are proposed
    state2, _ = run_suffix(params, config, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW), glob)
    outs2, _ = outputs(state2.dec, len(PROMPTS))
    assert_equal_outputs(outs2, plain_greedy, "suffix (warm global index)")
    assert np.asarray(state2.stats.accepted).sum() > np.asarray(state.stats.accepted).sum()


def test_suffix_host_loop_backs_off_and_stays_exact(target, plain_greedy, monkeypatch):
    """The host loop's back-off (a break-even no row reaches, a probe every 3rd step) decodes plainly between
    probes and still equals plain greedy output."""
    from specjax.runners import speculative

    config, params = target
    # The host loop recalibrates its break-even from the measured cost of a verify step against a plain one. On
    # a loaded machine those wall times made verification look cheap and the rows kept speculating; a clock that
    # advances 1 per plain step and 10 per verify step makes the break-even 9 accepted tokens, which no row reaches.
    clock = [0.0]
    steps = {"plain_step_jit": 1.0, "plain_steps_jit": 1.0, "verify_accept_jit": 10.0}

    def ticking(name):
        real = getattr(spec_engine, name)

        def step(*args, **kwargs):
            # plain_steps_jit runs a backed-off stretch: its 7th argument is the number of plain steps
            clock[0] += steps[name] * (int(args[6]) if name == "plain_steps_jit" else 1)
            return real(*args, **kwargs)
        return step

    for name in steps:
        monkeypatch.setattr(spec_engine, name, ticking(name))
    monkeypatch.setattr(speculative, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    drafter = SuffixDrafter(num_speculative_tokens=6, max_tree_depth=4)
    backoff = Adaptive(min_gain=5.0, probe_every=2)
    state, _ = run_suffix(params, config, drafter, BUCKETS, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW),
                          adaptive=backoff)
    outs, _ = outputs(state.dec, len(PROMPTS))
    assert_equal_outputs(outs, plain_greedy, "suffix (backing off)")
    plain = np.asarray(state.stats.plain_steps)[:len(PROMPTS)]
    verify = np.asarray(state.stats.verify_steps)[:len(PROMPTS)]
    assert plain.min() > 0 and verify.min() > 0, f"plain steps {plain}, verify steps {verify}"
    assert np.all(plain > verify), "backed-off rows must mostly decode plainly"


def test_verify_sizes_are_doubling_node_counts_ending_at_the_tree():
    assert spec_engine.verify_sizes(chain(1)) == (2,)
    assert spec_engine.verify_sizes(chain(4)) == (2, 3, 5)
    assert spec_engine.verify_sizes(chain(8)) == (2, 3, 5, 9)
    assert spec_engine.verify_sizes(SuffixDrafter(num_speculative_tokens=6, max_tree_depth=4).tree) == (2, 3, 5, 7)


def _proposal(rows: list[list[int]], tree: TreeSpec) -> Proposal:
    """Chains as a [B, N] proposal: row b drafts rows[b] after the root (token 0 = placeholder root)."""
    N = tree.num_nodes
    tokens = np.zeros((len(rows), N), np.int32)
    valid = np.zeros((len(rows), N), bool)
    parents = np.tile(np.asarray(tree.parents_array), (len(rows), 1))
    for b, r in enumerate(rows):
        tokens[b, 1:1 + len(r)] = r
        valid[b, :1 + len(r)] = True
    return Proposal(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(valid), None)


def test_trim_proposal_picks_the_smallest_size_holding_every_row():
    tree = chain(8)
    sizes = spec_engine.verify_sizes(tree)
    cut, t = spec_engine.trim_proposal(_proposal([[5], [], [6, 7]], tree), tree, sizes)
    assert cut.tokens.shape == (3, 3) and t.max_depth == 2
    np.testing.assert_array_equal(np.asarray(cut.tokens[2]), [0, 6, 7])
    np.testing.assert_array_equal(np.asarray(cut.valid[1]), [True, False, False])
    cut, t = spec_engine.trim_proposal(_proposal([[5, 6, 7, 8]], tree), tree, sizes)
    assert cut.tokens.shape == (1, 5) and t.max_depth == 4
    full = _proposal([[1] * 6], tree)
    cut, t = spec_engine.trim_proposal(full, tree, sizes)
    assert cut is full and t is tree
    with pytest.raises(ValueError, match="deterministic"):
        spec_engine.trim_proposal(full._replace(q=jnp.zeros((1, 9, V))), tree, sizes)


def test_suffix_compiles_every_verify_size_before_its_first_step(target):
    """The host loop compiles each cut size up front: the first call compiles exactly one verify per size (a
    bucket no other test uses, so nothing was cached), and a second call with other prompts compiles none."""
    config, params = target
    drafter = SuffixDrafter(num_speculative_tokens=5, max_tree_depth=5)
    buckets = tiny_buckets(BATCH, prompt_len=16, max_new=24, extra=16)
    sampling = make_sampling(BATCH, max_new=20)
    before = spec_engine.verify_accept_jit._cache_size()
    run_suffix(params, config, drafter, buckets, PROMPTS, sampling)
    assert spec_engine.verify_accept_jit._cache_size() - before == len(spec_engine.verify_sizes(drafter.tree)) == 4
    run_suffix(params, config, drafter, buckets, [p[::-1] for p in PROMPTS], sampling)
    assert spec_engine.verify_accept_jit._cache_size() - before == 4


def test_trimmed_verify_equals_the_full_verify(target, plain_greedy):
    """Verifying a proposal cut to its used nodes gives the same emitted tokens, counters and committed cache as
    verifying it padded to the drafter's whole tree (greedy; rows accept 2, 0, 1 and 0 drafted tokens)."""
    config, params = target
    drafter = SuffixDrafter(num_speculative_tokens=8, max_tree_depth=8)
    tree = drafter.tree
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    # Row 0 drafts its true next 3 tokens with the third wrong; row 2 one right token; rows 1 and 3 nothing
    # right. plain_greedy[b][0] is emitted by the prefill, so the drafts continue from plain_greedy[b][1].
    rows = [[plain_greedy[0][1], plain_greedy[0][2], (plain_greedy[0][3] + 1) % V], [],
            [plain_greedy[2][1]], [(plain_greedy[3][1] + 1) % V]]
    results = []
    for cut in (False, True):
        state = spec_start(params, config, {}, drafter, BUCKETS, PROMPTS, sampling)
        proposal = _proposal(rows, tree)
        proposal = proposal._replace(tokens=proposal.tokens.at[:, 0].set(state.dec.last_token))
        t = tree
        if cut:
            proposal, t = spec_engine.trim_proposal(proposal, tree, spec_engine.verify_sizes(tree))
            assert proposal.tokens.shape[1] == 5
        results.append(spec_engine.verify_accept_jit(params, config, t, drafter.mode, state, proposal, sampling))
    full, cut = results
    np.testing.assert_array_equal(np.asarray(full.stats.accepted), [2, 0, 1, 0])
    for a, b in zip(jax.tree_util.tree_leaves(full.stats), jax.tree_util.tree_leaves(cut.stats)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(full.dec.out_tokens), np.asarray(cut.dec.out_tokens))
    np.testing.assert_array_equal(np.asarray(full.dec.cache.lengths), np.asarray(cut.dec.cache.lengths))
    lengths = np.asarray(full.dec.cache.lengths)
    for kf, kc in zip(full.dec.cache.k + full.dec.cache.v, cut.dec.cache.k + cut.dec.cache.v):
        for b in range(BATCH):
            np.testing.assert_allclose(np.asarray(kf[b, :, :lengths[b]]), np.asarray(kc[b, :, :lengths[b]]),
                                       rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- draft KV cache


@pytest.mark.parametrize("adaptive", list(ADAPTIVE))
@pytest.mark.parametrize("steps", [1, 3, 6])
def test_draft_cache_after_rejections_equals_a_fresh_prefill(target, draft, steps, adaptive):
    """After `steps` engine steps (sampling at temperature 1, so drafts are rejected at varying depths), the
    draft's next proposal (tokens and q) equals that of a fresh draft prefilled on the same history."""
    config, params = target
    dcfg, dp = draft
    drafter = DraftModelDrafter(dcfg, 3, V)
    dparams = {"params": dp}
    sampling = make_sampling(BATCH, temperature=1.0, seed=[11, 12, 13, 14], max_new=MAX_NEW)
    state = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, sampling, max_steps=steps,
                     adaptive=ADAPTIVE[adaptive])
    hist_len = np.asarray(state.prompt_lens + state.dec.num_new)
    L = np.asarray(state.dec.cache.lengths)
    assert np.array_equal(L, hist_len - 1), "target cache must hold every token but the last emitted one"
    assert np.all(np.asarray(state.dec.finish) == engine.FINISH_RUNNING)
    got, _ = spec_engine.propose_jit(dparams, drafter, state, sampling)
    fresh = drafter.init(dparams, params, state.history, jnp.asarray(L), BUCKETS.capacity)
    want, _ = spec_engine.propose_jit(dparams, drafter, state._replace(dstate=fresh), sampling)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.q), np.asarray(want.q), atol=2e-5)
    if steps == 6 and adaptive == "always":
        acc, dr = np.asarray(state.stats.accepted).sum(), np.asarray(state.stats.drafted).sum()
        assert 0 < acc < dr, f"accepted {acc} of {dr}: no rejection happened, the check proves nothing"
    if adaptive == "backoff" and steps >= 3:
        assert np.asarray(state.stats.plain_steps).sum() > 0, "back-off never decoded plainly"


@pytest.mark.parametrize("catch_up", [8, 0])
def test_draft_cache_after_a_long_back_off_equals_a_fresh_prefill(target, draft, catch_up):
    """A 20-step back-off (deferred: the plain steps' tokens reach the draft before the next proposal, 8 at a
    time; catch_up 0: one draft forward per plain step), then a probe and two plain steps:
    the draft's next proposal equals that of a fresh draft prefilled on the same history."""
    config, params = target
    dcfg, dp = draft
    drafter = DraftModelDrafter(dcfg, 3, V, catch_up=catch_up)
    dparams = {"params": dp}
    sampling = make_sampling(BATCH, temperature=1.0, seed=[11, 12, 13, 14], max_new=MAX_NEW)
    state = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, sampling, max_steps=23,
                     adaptive=Adaptive(min_gain=5.0, probe_every=20, max_gap_factor=1))
    assert np.asarray(state.stats.plain_steps).min() >= 20 and np.asarray(state.stats.verify_steps).min() == 2
    assert np.all(np.asarray(state.dec.finish) == engine.FINISH_RUNNING)
    L = np.asarray(state.dec.cache.lengths)
    if catch_up:
        assert np.all(L - 1 - np.asarray(state.dstate.lengths) > 0), "nothing pending: the catch-up is untested"
    got, _ = spec_engine.propose_jit(dparams, drafter, state, sampling)
    fresh = drafter.init(dparams, params, state.history, jnp.asarray(L), BUCKETS.capacity)
    want, _ = spec_engine.propose_jit(dparams, drafter, state._replace(dstate=fresh), sampling)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.q), np.asarray(want.q), atol=2e-5)


# ------------------------------------------------------------------------------------------------- suffix host state


def test_build_drafter_honours_every_suffix_setting(target):
    from specjax.runners.speculative import drafter_for
    from specjax.config import SpeculativeConfig

    llm = tiny_llm(*target)
    first, _ = drafter_for(llm, SpeculativeConfig(method="suffix", suffix_min_token_prob=0.1))
    second, _ = drafter_for(llm, SpeculativeConfig(method="suffix", suffix_min_token_prob=0.5,
                                                               suffix_max_depth=12))
    assert first.min_token_prob == 0.1
    assert (second.min_token_prob, second.max_depth) == (0.5, 12)


def _fake_state(history: list[list[int]], prompt_lens: list[int], last: list[int], width: int = 48):
    B = len(history)
    hist = np.zeros((B, width), np.int32)
    for b, h in enumerate(history):
        hist[b, :len(h)] = h
    num_new = np.asarray([len(h) - p for h, p in zip(history, prompt_lens)], np.int32)
    dec = types.SimpleNamespace(num_new=jnp.asarray(num_new), last_token=jnp.asarray(last, jnp.int32))
    return types.SimpleNamespace(history=jnp.asarray(hist), prompt_lens=jnp.asarray(prompt_lens, jnp.int32),
                                 dec=dec)


def test_suffix_host_state_proposes_the_expected_tree():
    drafter = SuffixDrafter(num_speculative_tokens=8, max_tree_depth=8)
    N = drafter.tree.num_nodes
    assert N == 9
    # "1 2 3" occurs twice in the prompt, followed by 4 5 and 4 6; the first emitted token is 3
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2]
    other = [30, 31, 32, 33]
    host = SuffixHostState(drafter, SuffixIndex(drafter.max_depth), [prompt, other])
    state = _fake_state([prompt + [3], other + [34]], [len(prompt), len(other)], [3, 34])
    prop = host.propose(state, 2)
    tokens, parents, valid = (np.asarray(a) for a in (prop.tokens, prop.parents, prop.valid))
    # match length 3 -> budget 3 nodes: 4 (prob 1), then its children 5 and 6 (prob 1/2 each, smaller id first)
    assert tokens[0, :4].tolist() == [3, 4, 5, 6]
    assert parents[0, :4].tolist() == [-1, 0, 1, 1]
    assert valid[0].tolist() == [True] * 4 + [False] * (N - 4)
    assert tokens[1, 0] == 34 and valid[1].tolist() == [True] + [False] * (N - 1), "no match: root only"
    assert prop.q is None

    # the request's own output is indexed by observe(): after "... 6 1 2 3 4 6", "4 6" was followed by 1 2 3
    grown = prompt + [3, 4, 6]
    state = _fake_state([grown, other + [34]], [len(prompt), len(other)], [6, 34])
    host.observe(state, 2)
    prop = host.propose(state, 2)
    tokens, parents, valid = (np.asarray(a) for a in (prop.tokens, prop.parents, prop.valid))
    k = int(valid[0].sum())
    assert tokens[0, :k].tolist()[:4] == [6, 1, 2, 3] and parents[0, :4].tolist() == [-1, 0, 1, 2], tokens[0]

    # the global index serves a request with no match of its own
    glob = SuffixIndex(drafter.max_depth)
    glob.add_sequence(0, [30, 31, 32, 33, 34, 35, 36, 37])
    host2 = SuffixHostState(drafter, glob, [other])
    prop = host2.propose(_fake_state([other + [34]], [len(other)], [34]), 1)
    tokens, valid = np.asarray(prop.tokens), np.asarray(prop.valid)
    assert tokens[0, :int(valid[0].sum())].tolist() == [34, 35, 36, 37]
