"""SamplingParams as vLLM users write it, and the host-side pieces behind it (no model, fast).

* fields: `max_tokens` reads back (both directions), `seed=None` by default, `stop` as a string or a list,
  `n`, `min_tokens`, `min_p`, `logprobs`, penalties; bad values and unknown names raise one-line ConfigErrors,
  unknown names with the closest real field (`stpo` -> `stop`) from Python, dicts and command-line overrides.
* stop strings: `stop_scan` / `stop_match` / `safe_prefix_len` against a brute-force reference on random texts,
  `StopStream` (any chunking of a stream joins to the cut text and never shows part of a stop string), and
  `truncate_at_stop` (a stop string spanning tokens keeps the token that completed it, drops the rest).
* samples: `expand_samples` seeds (seed + i, or fresh per row), `sampling_arrays` (None seeds, optional arrays
  built when a request uses them or when asked for, the prompt mask of the repetition penalty).
* the processed distribution: min-p against a NumPy reference and by chi-square through `sample`, min_tokens'
  stop-id ban, and the acceptance sampler lossless (chi-square) for a target processed with min-p;
  `token_logprobs` against NumPy; the penalties against a NumPy transcription of vLLM's rules, `path_counts`
  against counting each node's path by hand, neutral penalties bit-identical.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specjax import acceptance, requests
from specjax.config import ConfigError, RunConfig, SamplingParams, apply_overrides, from_dict, merge, to_dict
from specjax.sampling import SamplingArrays, banned_stops, sample, uniforms
from specjax import sampling as _sampling

# Jitted: eager dispatch of the bisection loops costs seconds per call on a CPU.
process_logits = jax.jit(_sampling.process_logits, static_argnames=("allow_cond",))
processed = jax.jit(_sampling.processed, static_argnames=("allow_cond",))
token_logprobs = jax.jit(_sampling.token_logprobs, static_argnames=("k",))


# ------------------------------------------------------------------------------------------------ fields


def test_max_tokens_is_a_readable_alias_both_ways():
    assert SamplingParams(max_tokens=64).max_tokens == 64
    assert SamplingParams(max_tokens=64).max_new_tokens == 64
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams().max_tokens == SamplingParams().max_new_tokens == 128
    assert SamplingParams(max_new_tokens=9, max_tokens=9).max_tokens == 9  # equal values do not conflict
    with pytest.raises(ConfigError, match="conflicts with max_new_tokens=10"):
        SamplingParams(max_new_tokens=10, max_tokens=5)
    assert dataclasses.replace(SamplingParams(max_tokens=12), top_k=3).max_tokens == 12
    assert from_dict(SamplingParams, {"max_tokens": 8}).max_tokens == 8
    assert merge(RunConfig(), {"sampling": {"max_tokens": 5}}).sampling.max_tokens == 5
    assert "max_tokens" not in to_dict(SamplingParams(max_tokens=3))  # one key in YAML, not two


def test_seed_defaults_to_none_and_stays_reproducible_when_given():
    assert SamplingParams().seed is None
    assert SamplingParams(seed=3).seed == 3
    assert apply_overrides(RunConfig(), ["sampling.seed=null"]).sampling.seed is None
    assert apply_overrides(RunConfig(), ["sampling.seed=11"]).sampling.seed == 11
    with pytest.raises(ConfigError, match="invalid seed=-1"):
        SamplingParams(seed=-1)


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert from_dict(SamplingParams, {"stop": "END"}).stop == ("END",)
    assert apply_overrides(RunConfig(), ["sampling.stop=END"]).sampling.stop == ("END",)
    assert apply_overrides(RunConfig(), ["sampling.stop=[a, 'b c']"]).sampling.stop == ("a", "b c")
    sp = SamplingParams(stop="x")
    assert from_dict(SamplingParams, to_dict(sp)) == sp and hash(sp) == hash(SamplingParams(stop=["x"]))
    with pytest.raises(ConfigError, match=r"invalid stop\[1\]=''"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(ConfigError, match="invalid stop="):
        SamplingParams(stop=[1])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(n=0), "invalid n=0"),
    (dict(min_tokens=-1), "invalid min_tokens=-1"),
    (dict(min_tokens=20, max_tokens=10), "must be <= max_new_tokens=10"),
    (dict(min_p=1.5), "invalid min_p=1.5"),
    (dict(min_p=-0.1), "invalid min_p=-0.1"),
    (dict(logprobs=-1), "invalid logprobs=-1"),
    (dict(logprobs=21), "invalid logprobs=21"),
    (dict(presence_penalty=3.0), "invalid presence_penalty=3.0"),
    (dict(repetition_penalty=0.0), "invalid repetition_penalty=0.0"),
])
def test_new_fields_are_range_checked(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SamplingParams(**kwargs)


def test_new_fields_defaults_and_values():
    sp = SamplingParams()
    assert (sp.n, sp.min_tokens, sp.min_p, sp.logprobs, sp.stop) == (1, 0, 0.0, None, ())
    assert not sp.has_penalties and SamplingParams(repetition_penalty=1.2).has_penalties
    sp = SamplingParams(n=4, min_tokens=3, min_p=0.05, logprobs=5)
    assert (sp.n, sp.min_tokens, sp.min_p, sp.logprobs) == (4, 3, 0.05, 5)


def test_unknown_field_suggests_the_closest_real_one():
    with pytest.raises(ConfigError, match=r"unknown key 'stpo' in SamplingParams \(did you mean 'stop'\?\)"):
        SamplingParams(stpo="x")
    with pytest.raises(ConfigError, match=r"did you mean 'stop'\?"):
        SamplingParams.from_user({"stpo": "x"})
    with pytest.raises(ConfigError, match=r"did you mean 'stop'\?"):
        apply_overrides(RunConfig(), ["sampling.stpo=x"])
    with pytest.raises(ConfigError, match=r"did you mean 'min_tokens'\?"):
        SamplingParams(min_token=2)
    # `stop` itself is a field now, not a typo of top_p.
    assert SamplingParams.from_user({"stop": "x"}).stop == ("x",)


# ------------------------------------------------------------------------------------------------ stop strings


def _brute_match(text: str, stops, start: int = 0):
    """Reference: read `text` one character at a time; the first stop string that ends (after `start`) wins,
    the longer one when two end together."""
    for end in range(max(start, 0) + 1, len(text) + 1):
        done = [s for s in stops if end >= len(s) and text[end - len(s):end] == s]
        if done:
            s = max(done, key=len)
            return end - len(s), s
    return None


def test_stop_scan_examples():
    assert requests.stop_scan("hello world", ["o w"]) == 4
    assert requests.stop_scan("hello", ["x"]) is None
    assert requests.stop_match("xabcb", ["abc", "b"]) == (2, "b")  # "b" completes first
    assert requests.stop_match("xabc", ["bc", "abc"]) == (1, "abc")  # both end together: the longer
    assert requests.stop_scan("abab", ["ab"], start=2) == 2  # the first "ab" ends at 2: ignored
    assert requests.safe_prefix_len("hello wo", ["world"]) == 6
    assert requests.safe_prefix_len("hello", ["world"]) == 5
    assert requests.safe_prefix_len("hello w", ["o w"]) == 4


@settings(max_examples=300, deadline=None)
@given(st.text("abc", max_size=12), st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 6))
def test_stop_match_equals_a_character_by_character_reference(text, stops, start):
    assert requests.stop_match(text, stops, start) == _brute_match(text, stops, start)


@settings(max_examples=300, deadline=None)
@given(st.text("abc", max_size=16), st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       st.lists(st.integers(0, 4), max_size=8))
def test_stop_stream_never_shows_a_stop_string_and_joins_to_the_cut_text(text, stops, cuts):
    bounds = sorted({0, len(text), *[min(c * 2, len(text)) for c in cuts]})
    stream = requests.StopStream(stops)
    shown = ""
    for a, b in zip(bounds, bounds[1:]):
        shown += stream.push(text[a:b])
        # What was shown can never turn out to hold (the start of) a stop string.
        cut = requests.stop_scan(text, stops)
        assert shown == text[:len(shown)] and (cut is None or len(shown) <= cut)
    cut = requests.stop_scan(text, stops)
    final = text if cut is None else text[:cut]
    assert shown + stream.close(final) == final


class LetterTokenizer:
    """Token t decodes to two letters, so a stop string can start inside one token and end in the next."""

    A = "abcdefghijklmnopqrstuvwxyz"

    def decode(self, ids) -> str:
        return "".join(self.A[t % 26] + self.A[(t * 7 + 3) % 26] for t in ids)


def test_truncate_at_stop_keeps_the_completing_token_and_cuts_the_text():
    tok = LetterTokenizer()
    ids = [0, 1, 2, 3, 4, 5]
    text = tok.decode(ids)  # "ad" "bk" "cr" "dy" "ef" "fm"
    stop = text[5:8]  # "krd": the end of token 1, token 2 and the start of token 3
    kept, cut, s = requests.truncate_at_stop(tok, ids, [stop])
    assert kept == [0, 1, 2, 3] and cut == text[:5] and s == stop
    kept, cut, _ = requests.truncate_at_stop(tok, ids, [stop], include_stop=True)
    assert kept == [0, 1, 2, 3] and cut == text[:8]
    assert requests.truncate_at_stop(tok, ids, ["zz"]) is None
    # A stop string completed within the first min_tokens tokens does not count; a later one does.
    ids2 = [0, 1, 0, 1]
    assert requests.truncate_at_stop(tok, ids2, ["adb"], min_tokens=0)[0] == [0, 1]
    assert requests.truncate_at_stop(tok, ids2, ["adb"], min_tokens=2)[0] == [0, 1, 0, 1]
    assert requests.truncate_at_stop(tok, ids2, ["adb"], min_tokens=2)[1] == "adbk"


def test_finish_completion_sets_reason_and_is_idempotent():
    tok = LetterTokenizer()
    m = requests.RequestMetrics(prompt_tokens=3, new_tokens=6, time_to_first_token=0.1, total_time=1.0,
                                tokens_per_s=6.0)
    comp = requests.CompletionOutput(0, tok.decode(range(6)), list(range(6)), None, None, "length", metrics=m)
    sp = SamplingParams(stop=["cr"])
    once = requests.finish_completion(tok, comp, sp)
    assert (once.text, once.token_ids, once.finish_reason, once.stop_reason) == ("adbk", [0, 1, 2], "stop", "cr")
    assert once.metrics.new_tokens == 3 and once.metrics.tokens_per_s == pytest.approx(3.0)
    assert requests.finish_completion(tok, once, sp) == once
    # A stop token id of the request's own is named as the stop reason; the tokenizer's end token is not.
    ended = dataclasses.replace(comp, finish_reason="stop")
    assert requests.finish_completion(tok, ended, SamplingParams(stop_token_ids=[5])).stop_reason == 5
    assert requests.finish_completion(tok, ended, SamplingParams()).stop_reason is None


def test_request_output_fields_alias_the_first_sample():
    m = requests.RequestMetrics(1, 2, 0.0, 1.0, 2.0)
    a = requests.CompletionOutput(0, "xy", [1, 2], None, None, "length", metrics=m)
    b = requests.CompletionOutput(1, "z", [3], None, None, "stop", metrics=m)
    out = requests.RequestOutput("p", [9], [a, b], m)
    assert (out.text, out.token_ids, out.finish_reason) == ("xy", [1, 2], "length")
    assert out.outputs[1].text == "z" and out.finished and a.finished()


class _TextTok:
    def encode(self, text):
        return [ord(c) for c in text]


def test_bytes_and_invalid_unicode_are_refused_before_tokenizing():
    tok = _TextTok()
    for bad in (b"Hello", bytearray(b"Hi")):
        with pytest.raises(requests.RequestError, match="a prompt is bytes; decode it"):
            requests.normalise(bad, None)
        with pytest.raises(requests.RequestError, match="a prompt is bytes"):
            requests.encode_prompt(tok, 300, bad, None)
    with pytest.raises(requests.RequestError, match=r"lone surrogate \(U\+D800\) at character 3"):
        requests.encode_prompt(tok, 70000, "Hi \ud800!", None)
    with pytest.raises(requests.RequestError, match=r"message 0 \(user\) contains a lone surrogate"):
        requests.encode_prompt(tok, 70000, [{"role": "user", "content": "x\udfff"}], None)
    # Valid if unusual text passes untouched: combining marks, right-to-left, ZWJ sequences, NUL.
    for text in ("e\u0301\u0301", "\u05e9\u05dc\u202e", "\U0001F468\u200d\U0001F469", "a\x00b"):
        assert requests.encode_prompt(tok, 200000, text, None) == [ord(c) for c in text]


def test_chat_messages_checked_and_text_parts_joined():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert requests.chat_messages(parts) == [{"role": "user", "content": "a\nb"}]
    for bad, pattern in [([{"role": "user", "content": None}], "content of type NoneType"),
                         ([{"role": "user", "content": 5}], "content of type int"),
                         ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                          "part 0 is 'image_url'; only text parts"),
                         ([{"content": "hi"}], "needs a 'role' string")]:
        with pytest.raises(requests.RequestError, match=pattern):
            requests.chat_messages(bad)


def test_vllm_prompt_dicts():
    tok = _TextTok()
    assert requests.encode_prompt(tok, 300, {"prompt_token_ids": [3, 4]}, None) == [3, 4]
    assert requests.encode_prompt(tok, 300, {"prompt": "hi"}, None) == [104, 105]
    prompts, params = requests.normalise({"prompt": "hi"}, None)
    assert prompts == [{"prompt": "hi"}] and len(params) == 1
    prompts, _ = requests.normalise([{"prompt": "a"}, {"prompt_token_ids": [1]}], None)
    assert len(prompts) == 2  # a list of prompt dicts is several prompts, not one conversation
    conv = [{"role": "user", "content": "hi"}]
    assert requests.normalise(conv, None)[0] == [conv]  # chat messages stay one conversation
    with pytest.raises(requests.RequestError, match="outside the vocabulary"):
        requests.encode_prompt(tok, 10, {"prompt_token_ids": [30]}, None)


def test_conversations_one_or_many():
    conv = [{"role": "user", "content": "hi"}]
    assert requests.conversations(conv) == [conv]
    assert requests.conversations([conv, conv]) == [conv, conv]
    for bad in ("hi", [], [conv, "x"], [[]]):
        with pytest.raises(requests.RequestError, match="one conversation"):
            requests.conversations(bad)


def test_merge_metrics_of_n_samples():
    def spec(new, drafted, accepted, steps, plain, total):
        return requests.RequestMetrics(5, new, 0.1 * total, total, new / total, drafted=drafted, accepted=accepted,
                                       verify_steps=steps, target_forwards=steps + plain + 1,
                                       per_position_accepted=[accepted, 0], per_position_drafted=[drafted, 0])
    m = requests.merge_metrics([spec(10, 4, 4, 1, 5, 2.0), spec(6, 6, 2, 3, 0, 1.0)])
    assert (m.new_tokens, m.drafted, m.accepted, m.verify_steps, m.target_forwards) == (16, 10, 6, 4, 11)
    assert m.mean_accepted_length == pytest.approx(1 + 6 / 4)  # tau over all verify steps
    assert m.tokens_per_forward == pytest.approx((6 + 9) / 9)  # prefills excluded
    assert m.tokens_per_s == pytest.approx(16 / 2.0) and m.time_to_first_token == pytest.approx(0.1)
    assert m.per_position_acceptance == [0.6, 0.0]
    plain = requests.RequestMetrics(5, 3, 0.1, 1.0, 3.0)
    assert requests.merge_metrics([plain]) is plain
    assert requests.merge_metrics([plain, plain]).verify_steps is None


# ------------------------------------------------------------------------------------------------ samples


def test_expand_samples_seeds():
    rows, owners = requests.expand_samples([SamplingParams(n=3, seed=10), SamplingParams(seed=4)])
    assert [r.seed for r in rows] == [10, 11, 12, 4] and all(r.n == 1 for r in rows)
    assert owners == [(0, 0), (0, 1), (0, 2), (1, 0)]
    rows, _ = requests.expand_samples([SamplingParams(n=4, temperature=1.0)])
    seeds = [r.seed for r in rows]
    assert all(s is not None for s in seeds) and len(set(seeds)) == 4
    again, _ = requests.expand_samples([SamplingParams(n=4, temperature=1.0)])
    assert [r.seed for r in again] != seeds  # fresh randomness per call


class _Tok:
    stop_token_ids = (7,)


def test_sampling_arrays_seeds_and_optional_arrays():
    tok = _Tok()
    greedy = requests.sampling_arrays(tok, [SamplingParams()], 1, 4)
    assert int(greedy.seed[0]) == 0 and greedy.min_p is None and greedy.min_tokens is None
    a = requests.sampling_arrays(tok, [SamplingParams(temperature=1.0)] * 3, 4, 4)
    b = requests.sampling_arrays(tok, [SamplingParams(temperature=1.0)] * 3, 4, 4)
    assert not np.array_equal(np.asarray(a.seed), np.asarray(b.seed))
    fixed = requests.sampling_arrays(tok, [SamplingParams(temperature=1.0, seed=2 ** 32 + 5)], 1, 4)
    assert int(fixed.seed[0]) == 5


def test_optional_arrays_built_when_used_or_asked_for():
    tok = _Tok()
    off = requests.sampling_arrays(tok, [SamplingParams()], 2, 4)
    assert off.min_p is None and off.repetition_penalty is None and off.prompt_mask is None
    with pytest.raises(ValueError, match="pass prompts and vocab_size"):
        requests.sampling_arrays(tok, [SamplingParams(repetition_penalty=1.2)], 1, 4)
    pen = requests.sampling_arrays(tok, [SamplingParams(repetition_penalty=1.2), SamplingParams()], 3, 4,
                                   [[1, 2, 2], [7]], 10)
    np.testing.assert_allclose(np.asarray(pen.repetition_penalty), [1.2, 1.0, 1.0])
    mask = np.asarray(pen.prompt_mask)
    assert mask.shape == (3, 10) and set(np.flatnonzero(mask[0])) == {1, 2} and set(np.flatnonzero(mask[1])) == {7}
    assert set(np.flatnonzero(mask[2])) == {7}  # padding rows repeat the last request
    every = requests.sampling_arrays(tok, [SamplingParams()], 1, 4, [[1]], 10, all_options=True)
    assert every.min_p is not None and every.min_tokens is not None and every.repetition_penalty is not None
    assert requests.uses_options([SamplingParams(), SamplingParams(presence_penalty=0.5)])
    assert not requests.uses_options([SamplingParams(temperature=0.5, top_k=3)])


# ------------------------------------------------------------------------------------------------ distributions


def _min_p_np(logits, temperature, min_p):
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p = np.where(p >= min_p * p.max(-1, keepdims=True), p, 0.0)
    return p / p.sum(-1, keepdims=True)


def _row(n, value, dtype):
    return jnp.full((n,), value, dtype)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_min_p_matches_numpy_reference(min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2.0, (5, 40)).astype(np.float32)
    got = np.asarray(process_logits(jnp.asarray(logits), _row(5, 0.8, jnp.float32), _row(5, 0, jnp.int32),
                                    _row(5, 1.0, jnp.float32), min_p=_row(5, min_p, jnp.float32)))
    np.testing.assert_allclose(got, _min_p_np(logits, 0.8, min_p), atol=1e-6)
    if min_p > 0:
        assert (got == 0).sum() > 0  # the filter did cut something: the test can fail


def test_min_p_per_row_and_greedy_rows_untouched():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2.0, (3, 30)).astype(np.float32))
    t = jnp.asarray([1.0, 1.0, 0.0], jnp.float32)
    got = np.asarray(process_logits(logits, t, _row(3, 0, jnp.int32), _row(3, 1.0, jnp.float32),
                                    min_p=jnp.asarray([0.2, 0.0, 0.5], jnp.float32)))
    off = np.asarray(process_logits(logits, t, _row(3, 0, jnp.int32), _row(3, 1.0, jnp.float32)))
    assert (got[0] == 0).sum() > (off[0] == 0).sum()
    np.testing.assert_array_equal(got[1:], off[1:])  # min_p 0 and the greedy row: bit-identical


def test_min_p_sampling_matches_distribution_chi_square():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.5, (1, 16)).astype(np.float32)
    probs = _min_p_np(logits, 1.0, 0.15)[0]
    n = 20000
    p = process_logits(jnp.asarray(np.repeat(logits, n, 0)), _row(n, 1.0, jnp.float32), _row(n, 0, jnp.int32),
                       _row(n, 1.0, jnp.float32), min_p=_row(n, 0.15, jnp.float32))
    toks = np.asarray(sample(p, uniforms(jnp.arange(n, dtype=jnp.uint32), jnp.int32(0), ())))
    counts = np.bincount(toks, minlength=16)
    assert counts[probs == 0].sum() == 0 and (probs == 0).any()
    expected = probs[probs > 0]
    _, pvalue = stats.chisquare(counts[probs > 0], n * expected / expected.sum())
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2g}"


def test_acceptance_is_lossless_for_a_min_p_target():
    """The acceptance sampler, given a target processed with min-p and a draft that ignores min-p (q is what
    it sampled from), emits tokens distributed as the min-p target: chi-square of the first emitted token
    over 20000 one-node chains. A target without min-p is rejected by the same test (it can fail)."""
    rng = np.random.default_rng(3)
    V, n = 12, 20000
    t_logits = rng.normal(0, 1.0, (V,)).astype(np.float32)
    d_logits = rng.normal(0, 1.0, (V,)).astype(np.float32)
    ones = _row(1, 1.0, jnp.float32)
    p_root = np.asarray(process_logits(jnp.asarray(t_logits[None]), ones, _row(1, 0, jnp.int32), ones,
                                       min_p=_row(1, 0.04, jnp.float32)))[0]
    q_root = np.asarray(jax.nn.softmax(jnp.asarray(d_logits)))
    seeds = jnp.arange(n, dtype=jnp.uint32)
    drafts = np.asarray(sample(jnp.broadcast_to(jnp.asarray(q_root), (n, V)), uniforms(seeds, jnp.int32(0), (), 1)))
    u = np.asarray(uniforms(seeds, jnp.int32(0), (3,), 2))
    tokens = np.stack([np.zeros(n, np.int32), drafts], 1)
    parents = np.tile(np.asarray([-1, 0], np.int32), (n, 1))
    valid = np.ones((n, 2), bool)

    def first_tokens(p_root):
        p = np.broadcast_to(np.stack([p_root, np.full(V, 1.0 / V, np.float32)]), (n, 2, V))
        q = np.broadcast_to(np.stack([q_root, q_root]), (n, 2, V))
        res = acceptance.accept_tree(tokens, parents, valid, p, q, u[:, :2], u[:, 2], mode="iid")
        acc = np.asarray(res.num_accepted) > 0
        return np.where(acc, drafts, np.asarray(res.next_token))

    assert 3 <= (p_root > 0).sum() < V  # min-p cut some tokens and left a distribution to test
    counts = np.bincount(first_tokens(p_root), minlength=V)
    assert counts[p_root == 0].sum() == 0
    expected = p_root[p_root > 0].astype(np.float64)
    _, pvalue = stats.chisquare(counts[p_root > 0], n * expected / expected.sum())
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2g}"
    plain = np.asarray(jax.nn.softmax(jnp.asarray(t_logits)))
    wrong = np.bincount(first_tokens(plain), minlength=V)
    assert wrong[p_root == 0].sum() > 0  # without min-p in p, cut tokens come out: the check above can fail


def _arrays(n, **kw):
    base = dict(temperature=_row(n, 1.0, jnp.float32), top_k=_row(n, 0, jnp.int32), top_p=_row(n, 1.0, jnp.float32),
                seed=_row(n, 0, jnp.uint32), max_new_tokens=_row(n, 8, jnp.int32),
                stop_ids=jnp.asarray([[3, 5, -1, -1]] * n, jnp.int32))
    base.update(kw)
    return SamplingArrays(**base)


def test_min_tokens_bans_stop_ids_until_enough_tokens():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(0, 1.0, (2, 3, 10)).astype(np.float32)).at[:, :, 3].set(9.0)
    s = _arrays(2, min_tokens=jnp.asarray([2, 0], jnp.int32), temperature=jnp.asarray([1.0, 0.0], jnp.float32))
    num_new = jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32)  # e.g. three chain positions of a verify pass
    ban = np.asarray(banned_stops(s, num_new, 10))
    assert ban[0, 0, [3, 5]].all() and ban[0, 1, [3, 5]].all() and not ban[0, 2].any() and not ban[1].any()
    p = np.asarray(processed(logits, s, num_new))
    assert (p[0, :2, 3] == 0).all() and (p[0, :2, 5] == 0).all() and p[0, 2, 3] > 0.5
    assert p[1, 0, 3] == 1.0  # greedy row without min_tokens: the stop id is its argmax
    g = _arrays(1, min_tokens=jnp.asarray([1], jnp.int32), temperature=jnp.asarray([0.0], jnp.float32))
    pg = np.asarray(processed(logits[:1, :1], g, jnp.zeros((1, 1), jnp.int32)))
    assert pg[0, 0, 3] == 0 and pg[0, 0].max() == 1.0  # greedy with the ban: the best allowed token
    np.testing.assert_array_equal(np.asarray(_sampling.greedy_tokens(logits[:1, :1], g, jnp.zeros((1, 1), jnp.int32))),
                                  np.argmax(pg, -1))  # the greedy shortcut picks what the one-hot picks
    with pytest.raises(ValueError, match="pass num_new"):
        _sampling.processed(logits, s)
    np.testing.assert_array_equal(np.asarray(processed(logits, _arrays(2))),
                                  np.asarray(process_logits(logits, *_arrays(2)[:3])))


def test_token_logprobs_match_numpy():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2.0, (2, 4, 20)).astype(np.float32)
    tokens = rng.integers(0, 20, (2, 4)).astype(np.int32)
    s = _arrays(2, temperature=jnp.asarray([0.7, 0.0], jnp.float32), top_k=jnp.asarray([5, 0], jnp.int32))
    chosen, rank, vals, ids = (np.asarray(a) for a in token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), s, 3))
    for b, (t, k) in enumerate([(0.7, 5), (1.0, 0)]):  # the greedy row is scored at temperature 1
        x = logits[b].astype(np.float64) / t
        if k:
            x = np.where(x >= np.sort(x, -1)[:, -k][:, None], x, -np.inf)
        ref = x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)
        np.testing.assert_allclose(chosen[b], np.take_along_axis(ref, tokens[b][:, None], 1)[:, 0], rtol=1e-5)
        np.testing.assert_allclose(vals[b], -np.sort(-ref, -1)[:, :3], rtol=1e-5)
        np.testing.assert_array_equal(ids[b], np.argsort(-ref, -1, kind="stable")[:, :3])
        finite = np.isfinite(chosen[b])
        np.testing.assert_array_equal(rank[b][finite], 1 + (ref > chosen[b][:, None]).sum(-1)[finite])


# ------------------------------------------------------------------------------------------------ penalties


def _penalties_np(logits, counts, prompt_mask, presence, frequency, repetition):
    """vLLM's order: repetition over prompt or output tokens, then frequency and presence over the output."""
    x = np.asarray(logits, np.float64).copy()
    seen = (counts > 0) | prompt_mask
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * (counts > 0)


def test_penalties_match_numpy_reference_and_neutral_rows_are_bit_identical():
    rng = np.random.default_rng(6)
    B, V = 4, 30
    logits = rng.normal(0, 2.0, (B, V)).astype(np.float32)
    out = rng.integers(0, V, (B, 6)).astype(np.int32)
    num_new = np.asarray([6, 3, 0, 6], np.int32)
    prompt_mask = rng.random((B, V)) < 0.2
    pres = np.asarray([0.5, 0.0, 1.0, 0.0], np.float32)
    freq = np.asarray([0.3, 0.0, 0.0, 0.0], np.float32)
    rep = np.asarray([1.3, 2.0, 1.5, 1.0], np.float32)
    s = _arrays(B, presence_penalty=jnp.asarray(pres), frequency_penalty=jnp.asarray(freq),
                repetition_penalty=jnp.asarray(rep), prompt_mask=jnp.asarray(prompt_mask))
    counts = np.asarray(_sampling.output_counts(jnp.asarray(out), jnp.asarray(num_new), V))
    ref_counts = np.stack([np.bincount(out[b, :num_new[b]], minlength=V) for b in range(B)])
    np.testing.assert_array_equal(counts, ref_counts)
    got = np.asarray(_sampling.penalize(jnp.asarray(logits), s, jnp.asarray(counts)))
    want = _penalties_np(logits, ref_counts, prompt_mask, pres[:, None], freq[:, None], rep[:, None])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[:3], logits[:3])  # the penalties did change something: the test can fail
    np.testing.assert_array_equal(got[3], logits[3])  # neutral values: bit-identical
    # Greedy follows the penalized logits, sampling their softmax.
    g = _arrays(B, temperature=_row(B, 0.0, jnp.float32), presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                prompt_mask=s.prompt_mask)
    np.testing.assert_array_equal(np.asarray(_sampling.greedy_tokens(jnp.asarray(logits), g, None, jnp.asarray(counts))),
                                  np.argmax(want, -1))
    p = np.asarray(processed(jnp.asarray(logits), s, None, jnp.asarray(counts)))
    e = np.exp(want - want.max(-1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="pass counts"):
        _sampling.processed(jnp.asarray(logits), s)


def test_path_counts_add_each_nodes_drafted_path():
    rng = np.random.default_rng(7)
    B, N, V = 2, 6, 9
    parents = np.asarray([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 2, 3, 4]], np.int32)
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    base = rng.integers(0, 3, (B, V)).astype(np.int32)
    from specjax.tree import ancestor_mask_from_parents

    mask = np.asarray(ancestor_mask_from_parents(jnp.asarray(parents), 5)) & (np.arange(N) > 0)[None, None, :]
    got = np.asarray(_sampling.path_counts(jnp.asarray(base), jnp.asarray(tokens), jnp.asarray(mask)))
    for b in range(B):
        for n in range(N):
            want = base[b].copy()
            m = n
            while m > 0:  # the node itself and its drafted ancestors, the root excluded
                want[tokens[b, m]] += 1
                m = parents[b, m]
            np.testing.assert_array_equal(got[b, n], want, err_msg=f"row {b} node {n}")


def test_token_logprobs_apply_penalties_over_the_tokens_before_each_position():
    rng = np.random.default_rng(8)
    T, V = 5, 12
    logits = rng.normal(0, 2.0, (1, T, V)).astype(np.float32)
    tokens = np.asarray([[3, 3, 4, 3, 1]], np.int32)
    prompt_mask = np.zeros((1, V), bool)
    prompt_mask[0, 1] = True
    s = _arrays(1, presence_penalty=_row(1, 0.4, jnp.float32), frequency_penalty=_row(1, 0.7, jnp.float32),
                repetition_penalty=_row(1, 1.5, jnp.float32), prompt_mask=jnp.asarray(prompt_mask))
    chosen = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), s, 2)[0])
    for j in range(T):
        counts = np.bincount(tokens[0, :j], minlength=V)
        x = _penalties_np(logits[0, j], counts, prompt_mask[0], 0.4, 0.7, 1.5)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        np.testing.assert_allclose(chosen[0, j], ref[tokens[0, j]], rtol=1e-5, atol=1e-5)
