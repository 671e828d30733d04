"""min_p, min_tokens and the presence / frequency / repetition penalties inside the decode loops, plain and
speculative, on a tiny random model through `LLM.generate`.

* Plain greedy decoding with every option on equals a reference built from scratch: one teacher-forced forward
  over prompt + output per token, the penalties and the min_tokens ban applied in NumPy (vLLM's rules).
* Greedy speculative decoding with the same options equals plain greedy decoding, token for token, for n-gram,
  a draft model (the target as its own draft, so long drafts are proposed and accepted), Medusa-free EAGLE trees
  and suffix decoding. With the path counts of the verify pass planted wrong (each node penalized as if its
  drafted ancestors had not been emitted), the same comparison fails: the check has teeth.
* Sampled speculative decoding keeps plain decoding's distribution with penalties on: the number of repeated
  tokens among the first six over many seeds, two-sample chi-square against plain decoding; the planted bug is
  caught by the same test.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specjax import spec_engine
from specjax.config import SamplingParams, SpeculativeConfig
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.eagle import EagleDrafter
from specjax.heads.eagle import head_config, init_from_target

from spec_helpers import last_logits, tiny_config, tiny_llm, tiny_params

V = 64
EOS = 5
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3, 4, 1, 2, 3], [40, 41]]
OPTIONS = dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=6, min_p=0.05)


@pytest.fixture(scope="module")
def setup():
    config = tiny_config(V)
    # Peaky logits: greedy runs repeat themselves, so the penalties change what comes out.
    params = tiny_params(config, seed=11, logit_scale=3.0)
    llm = tiny_llm(config, params, stop_token_ids=(EOS,))
    specs = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                                        prompt_lookup_max=3, adaptive=False),
             "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_max_depth=8,
                                         adaptive=False)}
    self_draft = SpeculativeConfig(method="draft_model", model="tiny-self", num_speculative_tokens=4, adaptive=False)
    llm.runtime.drafters[self_draft] = (DraftModelDrafter(config, 4, V), {"params": params})
    specs["draft_model"] = self_draft
    hcfg = head_config(config, "eagle")
    head = init_from_target(hcfg, params, -1)
    eagle = SpeculativeConfig(method="eagle", model="tiny-eagle", adaptive=False)
    llm.runtime.drafters[eagle] = (EagleDrafter(hcfg, top_k=3, depth=3, total_tokens=8),
                                   {"head": head, "embed": params["embed"], "lm_head": params["lm_head"]})
    specs["eagle"] = eagle
    return llm, params, config, specs


def _reference(params, config, prompt, n, o):
    """Greedy decoding from scratch with the options `o` (dict as OPTIONS, min_p is moot for greedy)."""
    out = []
    for _ in range(n):
        x = last_logits(params, config, list(prompt) + out).astype(np.float64)
        counts = np.bincount(np.asarray(out, np.int64), minlength=V)[:V]
        seen = (counts > 0) | np.isin(np.arange(V), prompt)
        rp = o.get("repetition_penalty", 1.0)
        x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
        x = x - o.get("frequency_penalty", 0.0) * counts - o.get("presence_penalty", 0.0) * (counts > 0)
        if len(out) < o.get("min_tokens", 0):
            x[EOS] = -np.inf
        out.append(int(np.argmax(x)))
        if out[-1] == EOS:
            break
    return out


def _generate(llm, sp, spec=None):
    return [o.token_ids for o in llm.generate(PROMPTS, sp, speculative_config=spec or {"method": None})]


def test_plain_greedy_with_every_option_equals_a_reference_from_scratch(setup):
    llm, params, config, _ = setup
    sp = SamplingParams(max_new_tokens=14, **OPTIONS)
    got = _generate(llm, sp)
    for prompt, ids in zip(PROMPTS, got):
        assert ids == _reference(params, config, prompt, 14, OPTIONS)
    assert got != _generate(llm, SamplingParams(max_new_tokens=14))  # the options changed the output


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_greedy_speculative_with_options_equals_plain(setup, method):
    llm, _, _, specs = setup
    sp = SamplingParams(max_new_tokens=24, **OPTIONS)
    want = _generate(llm, sp)
    outs = llm.generate(PROMPTS, sp, speculative_config=specs[method])
    assert [o.token_ids for o in outs] == want, method
    assert sum(o.metrics.verify_steps for o in outs) > 0, f"{method}: nothing verified, the verify path is untested"
    if method == "draft_model":  # the target drafting for itself: penalized nodes deep in the chain are accepted
        assert sum(o.metrics.accepted for o in outs) > 0


def _ignore_paths(monkeypatch):
    """The planted bug: each tree node penalized with the output counts alone."""
    import jax.numpy as jnp

    monkeypatch.setattr(spec_engine, "path_counts", lambda base, tokens, mask: jnp.broadcast_to(
        base[:, None, :], (tokens.shape[0], tokens.shape[1], base.shape[-1])))


def test_wrong_path_counts_are_caught(setup, monkeypatch):
    import jax

    llm, _, _, specs = setup
    sp = SamplingParams(max_new_tokens=24, presence_penalty=0.0, frequency_penalty=2.0, repetition_penalty=1.0)
    want = _generate(llm, sp)
    jax.clear_caches()
    _ignore_paths(monkeypatch)
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, sp, speculative_config=specs["draft_model"])]
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert got != want, "verification that ignores the drafted path still matched plain decoding"


def _repeats(llm, spec, seeds, sp):
    """Per seed: how many of tokens 1..5 repeat an earlier output token, the quantity penalties act on (a
    sample from the joint distribution of the first six tokens, reduced to one number)."""
    params = [SamplingParams(temperature=1.0, seed=int(s), max_new_tokens=6, ignore_eos=True, **sp) for s in seeds]
    outs = llm.generate([PROMPTS[0]] * len(seeds), params, speculative_config=spec or {"method": None})
    toks = [o.token_ids for o in outs]
    return np.asarray([sum(t[j] in t[:j] for j in range(1, 6)) for t in toks])


def _two_sample_pvalue(a, b):
    keys = np.union1d(a, b)
    table = np.stack([[np.sum(a == k) for k in keys], [np.sum(b == k) for k in keys]])
    table = table[:, table.sum(0) >= 10]
    return stats.chi2_contingency(table)[1]


@pytest.mark.slow
def test_sampled_speculation_keeps_the_penalized_distribution(setup, monkeypatch):
    """Two-sample chi-square of the repeat count over 1000 seeds each, plain against the target drafting for
    itself (long accepted chains, so most tokens come from deep tree nodes)."""
    import jax

    llm, _, _, specs = setup
    # Negative penalties make repeats likely: wrong counts along a drafted path then change the odds a lot.
    sp = dict(frequency_penalty=-2.0, presence_penalty=-1.0, repetition_penalty=0.8)
    n = 1000
    plain = _repeats(llm, None, np.arange(n), sp)
    spec = _repeats(llm, specs["draft_model"], np.arange(n, 2 * n), sp)
    p_ok = _two_sample_pvalue(plain, spec)
    assert p_ok > 1e-3, f"speculative sampling with penalties differs from plain: p={p_ok:.2g}"
    jax.clear_caches()
    _ignore_paths(monkeypatch)
    try:
        wrong = _repeats(llm, specs["draft_model"], np.arange(2 * n, 3 * n), sp)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _two_sample_pvalue(plain, wrong) < 1e-3, "the planted bug went unnoticed: the test has no power"
