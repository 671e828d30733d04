"""`LLM` as vLLM users drive it, on a tiny random model, with speculation off and on.

* outputs: `RequestOutput.outputs[i]` are CompletionOutputs; text / token_ids / finish_reason alias outputs[0].
* stop strings: a stop string spanning tokens cuts the text before it and keeps the tokens up to the one that
  completed it, the same for plain decoding, n-gram and a draft model that accepts everything (so one verify
  step emits tokens past the stop, which must be dropped); streamed pieces join to the cut text.
* n and seeds: n = 4 at T = 1 gives 4 different samples, the same on a second run; greedy n = 2 gives two equal
  ones; seed None gives fresh samples whose recorded seed reproduces them.
* max_num_seqs: past N rows, prompts queue through continuous batching at batch N, with the same outputs as one
  batch (greedy and seeded samples), and short requests do not wait for long ones.
* chat: one conversation or several, chat_template_kwargs and add_generation_prompt reach the template.
* LLM(model=..., speculative_config=...): the default speculative config, overridden per call; bad arguments
  are ConfigErrors.
* warmup: the first real call of the warmed shapes compiles nothing.
* logprobs: equal for plain and speculative runs of the same tokens, equal to a NumPy log-softmax of the
  target's logits, every sampled token finite under its processed distribution.
* refusals: a stream with n > 1 samples per prompt raises RequestError.
"""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from spec_helpers import last_logits, save_hf_llama, tiny_config, tiny_llm, tiny_params
from specjax import engine, spec_engine
from specjax.api import LLM, CompletionOutput, RequestOutput
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.requests import RequestError

V = 64
MOTIF = [5, 17, 33, 2, 41, 9]
PROMPTS = [MOTIF * 2 + [1, 2], MOTIF + [5]]  # both in the 16-token prompt bucket
NEW = 16


class TextTokenizer:
    """Token t decodes to two letters (so stop strings can start inside a token); text encodes one id per
    character; a chat template that shows its arguments in the rendered text."""

    A = "abcdefghijklmnopqrstuvwxyz"
    stop_token_ids = ()

    def __init__(self):
        self.template_calls = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.A[t % 26] + self.A[(t * 7 + 3) % 26] for t in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % V for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **variables) -> str:
        self.template_calls.append((add_generation_prompt, variables))
        text = "".join(f"{m['role'][0]}:{m['content']}" for m in messages)
        return text + (">" if add_generation_prompt else "") + "+" * len(variables)


pytestmark = pytest.mark.usefixtures("fast_xla_compiles")


@pytest.fixture(scope="module")
def model():
    config = tiny_config(V)
    return config, tiny_params(config, seed=3)


@pytest.fixture(scope="module")
def llm(model):
    llm = tiny_llm(*model)
    llm.tokenizer = TextTokenizer()
    return llm


@pytest.fixture(scope="module")
def specs(model, tmp_path_factory):
    """Speculative configs without back-off: n-gram (1-token keys), and a draft model that is a copy of the
    target, so greedy drafts are always accepted and every verify step emits several tokens."""
    path = save_hf_llama(str(tmp_path_factory.mktemp("draft")), *model)
    return {
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False),
        "self_draft": SpeculativeConfig(method="draft_model", model=path, num_speculative_tokens=3, adaptive=False),
    }


METHODS = [None, "ngram", "self_draft"]
# The draft-model loop is the slowest to compile: where n-gram already covers speculation, it runs in the slow set.
FAST_METHODS = [None, "ngram", pytest.param("self_draft", marks=pytest.mark.slow)]


def spec_of(specs, method):
    return None if method is None else specs[method]


def first_stop(tok, ids, stop):
    """Reference: the shortest prefix of ids whose text holds `stop`, and that text cut before it."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if stop in text:
            return ids[:k], text[:text.index(stop)]
    return None


# ------------------------------------------------------------------------------------------------ outputs


def test_outputs_are_vllm_shaped(llm):
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))
    assert len(out) == 2 and all(isinstance(o, RequestOutput) for o in out)
    for i, o in enumerate(out):
        (c,) = o.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and o.request_id == str(i)
        assert (o.text, o.token_ids, o.finish_reason) == (c.text, c.token_ids, c.finish_reason)
        assert len(c.token_ids) == NEW and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == llm.tokenizer.decode(c.token_ids)
        assert c.logprobs is None and c.cumulative_logprob is None and c.seed is not None
        assert o.prompt == PROMPTS[i] and o.prompt_token_ids == PROMPTS[i] and o.metrics.new_tokens == NEW


# ------------------------------------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("method", METHODS)
def test_stop_string_spanning_tokens(llm, specs, method):
    tok = llm.tokenizer
    full = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))]
    # Last letter of token 3, tokens 4 and 5, first letter of token 6: starts and ends inside tokens.
    stops = [tok.decode(ids)[7:14] for ids in full]
    want = [first_stop(tok, ids, s) for ids, s in zip(full, stops)]
    assert all(w is not None and len(w[0]) < NEW for w in want)
    params = [SamplingParams(max_tokens=NEW, stop=s) for s in stops]
    out = llm.generate(PROMPTS, params, spec_of(specs, method))
    for o, (ids, text), s in zip(out, want, stops):
        assert o.token_ids == ids and o.text == text
        assert o.finish_reason == "stop" and o.outputs[0].stop_reason == s
        assert o.metrics.new_tokens == len(ids)
    if method == "self_draft":
        # Several tokens per verify step: the device ran past each stop string, and those tokens are gone.
        assert all(o.metrics.accepted >= 2 * o.metrics.verify_steps for o in out)


@pytest.mark.parametrize("method", FAST_METHODS)
def test_streamed_text_with_stop_strings_joins_to_the_output(llm, specs, method):
    tok = llm.tokenizer
    full = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))
    params = [SamplingParams(max_tokens=NEW, stop=[tok.decode(o.token_ids)[9:12], "zzzz"]) for o in full]
    pieces = {0: [], 1: []}
    out = llm.generate(PROMPTS, params, spec_of(specs, method), stream=lambda i, t: pieces[i].append(t))
    quiet = llm.generate(PROMPTS, params, spec_of(specs, method))
    for i, o in enumerate(out):
        assert "".join(pieces[i]) == o.text == quiet[i].text and o.finish_reason == "stop"
        assert all(p for p in pieces[i])


# ------------------------------------------------------------------------------------------------ n and seeds


@pytest.mark.parametrize("method", FAST_METHODS)
def test_n_samples_with_one_seed_differ_and_repeat(llm, specs, method):
    sp = SamplingParams(max_tokens=NEW, temperature=1.0, n=4, seed=7)
    (a,) = llm.generate([PROMPTS[0]], sp, spec_of(specs, method))
    (b,) = llm.generate([PROMPTS[0]], sp, spec_of(specs, method))
    samples = [c.token_ids for c in a.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3] and [c.seed for c in a.outputs] == [7, 8, 9, 10]
    assert len({tuple(s) for s in samples}) == 4
    assert samples == [c.token_ids for c in b.outputs]
    assert a.metrics.new_tokens == 4 * NEW  # the request's metrics count all its samples


@pytest.mark.parametrize("method", METHODS)
def test_greedy_n_samples_are_equal(llm, specs, method):
    (o,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW, n=2), spec_of(specs, method))
    (plain,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=NEW))
    assert o.outputs[0].token_ids == o.outputs[1].token_ids == plain.token_ids


@pytest.mark.parametrize("method", [None, pytest.param("self_draft", marks=pytest.mark.slow)])
def test_seed_none_is_fresh_and_the_recorded_seed_reproduces(llm, specs, method):
    (a,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW, temperature=1.0, n=4), spec_of(specs, method))
    (b,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW, temperature=1.0, n=4), spec_of(specs, method))
    seeds = [c.seed for c in a.outputs] + [c.seed for c in b.outputs]
    assert len(set(seeds)) == 8 and a.token_ids != b.token_ids
    # Each sample's recorded seed, passed back, gives that sample again (rows of one batch are independent).
    again = llm.generate([PROMPTS[0]] * 4, [SamplingParams(max_tokens=NEW, temperature=1.0, seed=c.seed)
                                            for c in a.outputs], spec_of(specs, method))
    assert [o.token_ids for o in again] == [c.token_ids for c in a.outputs]


# ------------------------------------------------------------------------------------------------ batching


@pytest.mark.parametrize("method", FAST_METHODS)
def test_max_num_seqs_queues_rows_through_continuous_batching(llm, specs, method, monkeypatch):
    """Past max_num_seqs the rows queue through the serving engine's continuous batching at batch N: the
    outputs equal one uncapped batch's (greedy, and sampled with seeds), streams join to the texts, n samples
    are rows too, and a short request never waits for a long one (it finishes first whatever its position)."""
    from specjax.runners import serving

    spec = spec_of(specs, method)
    prompts = [MOTIF[i:] + [i] for i in range(4)]
    sp = SamplingParams(max_tokens=NEW)
    whole = llm.generate(prompts, sp, spec)
    batches, ended = [], []
    Engine, end = serving.ServingEngine, serving.ServingEngine._end

    def engine(llm_, speculative, options, *a, **k):
        batches.append(options.max_batch)
        return Engine(llm_, speculative, options, *a, **k)

    def record_end(self, h, event):
        if not h.done and isinstance(event, serving.Finished):
            ended.append(int(h.request_id))
        return end(self, h, event)

    monkeypatch.setattr(serving, "ServingEngine", engine)
    monkeypatch.setattr(serving.ServingEngine, "_end", record_end, raising=False)
    monkeypatch.setattr(Engine, "_end", record_end)
    monkeypatch.setattr(llm, "max_num_seqs", 2)
    pieces = {}
    capped = llm.generate(prompts, sp, spec, stream=lambda i, t: pieces.setdefault(i, []).append(t))
    assert batches == [2]
    assert [o.token_ids for o in capped] == [o.token_ids for o in whole]
    assert {i: "".join(p) for i, p in pieces.items()} == {i: o.text for i, o in enumerate(capped)}
    assert all(o.metrics.new_tokens == NEW and o.metrics.total_time > 0 for o in capped)
    # Samples are rows too: 3 prompts x n = 2 -> 6 rows, gathered back per prompt.
    both = llm.generate(prompts[:3], SamplingParams(max_tokens=NEW, n=2), spec)
    assert all(len(o.outputs) == 2 for o in both)
    assert [o.outputs[1].token_ids for o in both] == [o.token_ids for o in whole[:3]]
    if method is None:
        # Plain sampled rows keep their seeds' samples (a row's random numbers depend on its seed and step only;
        # with speculation, which steps verify depends on the whole batch, so only the distribution is kept).
        hot = [SamplingParams(max_tokens=NEW, temperature=1.0, seed=s) for s in range(4)]
        monkeypatch.setattr(llm, "max_num_seqs", None)
        free = llm.generate(prompts, hot)
        monkeypatch.setattr(llm, "max_num_seqs", 2)
        assert [o.token_ids for o in llm.generate(prompts, hot)] == [o.token_ids for o in free]
    # One long request first, three short ones after it, two slots: the short ones cycle through the second
    # slot and all finish before the long one (in batches of two, the last short one would finish after it).
    ended.clear()
    mixed = [SamplingParams(max_tokens=NEW, ignore_eos=True)] + [SamplingParams(max_tokens=2, ignore_eos=True)] * 3
    out = llm.generate(prompts, mixed, spec)
    assert [len(o.token_ids) for o in out] == [NEW, 2, 2, 2]
    assert ended[-1] == 0 and sorted(ended) == [0, 1, 2, 3]

# ------------------------------------------------------------------------------------------------ chat


def test_chat_renders_conversations_with_template_arguments(llm):
    tok = llm.tokenizer
    conv = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=NEW)
    one, two = llm.chat([conv, conv[1:]], sp, chat_template_kwargs={"enable_thinking": False})
    assert tok.template_calls[-1] == (True, {"enable_thinking": False})
    ids = tok.encode(tok.apply_chat_template(conv, enable_thinking=False))
    assert one.prompt_token_ids == ids and one.prompt == conv and two.prompt == conv[1:]
    assert one.token_ids == llm.generate([ids, ids], sp)[0].token_ids
    plain = llm.chat([conv[1:], conv], sp, add_generation_prompt=False)
    assert tok.template_calls[-1] == (False, {}) and plain[0].prompt_token_ids == tok.encode("u:hi")
    with pytest.raises(RequestError, match="one conversation"):
        llm.chat("hi")


# ------------------------------------------------------------------------------------------------ construction


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Hugging Face directory: a tiny Llama over the byte-level test tokenizer (256 bytes + 3 specials)."""
    from helpers import write_byte_tokenizer

    config = tiny_config(259)
    path = save_hf_llama(str(tmp_path_factory.mktemp("tiny")), config, tiny_params(config, seed=5))
    write_byte_tokenizer(path)
    return path


def test_speculative_config_at_construction_is_the_default(model_dir, monkeypatch):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    assert LLM(model_dir).max_num_seqs == 256  # vLLM's default cap: a thousand prompts never make one batch
    llm = LLM(model_dir, speculative_config=ngram, max_num_seqs=4)
    assert llm.speculative_config == SpeculativeConfig.from_user(ngram) and llm.max_num_seqs == 4
    seen = []

    class Ran(Exception):
        pass

    def spy(prompts, ids, params, spec, stream):  # what the runner would get; nothing compiles
        seen.append(spec)
        raise Ran

    monkeypatch.setattr(llm, "_run", spy)
    for override in (None, {"method": None}, {"method": "ngram", "num_speculative_tokens": 2}):
        with pytest.raises(Ran):
            llm.generate("abc", SamplingParams(max_tokens=4), override)
    assert seen == [SpeculativeConfig.from_user(ngram), SpeculativeConfig(),
                    SpeculativeConfig(method="ngram", num_speculative_tokens=2)]
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(model_dir, max_num_seqs=0)
    with pytest.raises(ConfigError, match="did you mean 'num_speculative_tokens'"):
        LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_token": 3})


@pytest.mark.slow
def test_warmup_compiles_what_the_first_call_needs(llm):
    # Buckets no other test here uses (prompts of 17-32 tokens, 33-64 new), so the warm-up has work to do.
    fns = [engine.prefill, engine.decode_loop, spec_engine.spec_prefill, spec_engine.spec_loop]
    adaptive = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    before = [f._cache_size() for f in fns]
    seconds = llm.warmup(max_tokens=40, prompt_tokens=20, batch_size=2)
    llm.warmup(max_tokens=40, speculative_config=adaptive, prompt_tokens=20, batch_size=2)
    warmed = [f._cache_size() for f in fns]
    assert seconds > 0 and all(w > b for w, b in zip(warmed, before))
    # The back-off break-even measured on this hardware is kept; what the dummy prompts taught is not.
    assert (adaptive, 2) in llm.runtime.break_even and (adaptive, 2) not in llm.runtime.gain_priors
    # Other prompt lengths, output lengths and sampling values in the same buckets: nothing compiles.
    prompts = [[3, 4] * 9, [4, 5, 6] * 10]
    llm.generate(prompts, SamplingParams(max_tokens=35, temperature=0.5))
    llm.generate(prompts, SamplingParams(max_tokens=40), adaptive)
    assert [f._cache_size() for f in fns] == warmed


# ------------------------------------------------------------------------------------------------ logprobs


def test_logprobs_equal_for_plain_and_speculative_and_match_numpy(llm, specs, model):
    config, params = model
    sp = SamplingParams(max_tokens=NEW, logprobs=3)
    plain = llm.generate(PROMPTS, sp)
    for method in ("ngram", "self_draft"):
        spec = llm.generate(PROMPTS, sp, specs[method])
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
            assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob
    o = plain[0].outputs[0]
    assert len(o.logprobs) == NEW
    for j in range(3):  # greedy is scored at temperature 1: the model's own log-softmax
        x = last_logits(params, config, PROMPTS[0] + o.token_ids[:j]).astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        top = np.argsort(-ref)[:3]
        entry = o.logprobs[j]
        assert list(entry) == [int(t) for t in top]  # the emitted (greedy) token is the most likely one
        for r, t in enumerate(top):
            assert entry[int(t)].logprob == pytest.approx(ref[t], abs=1e-4) and entry[int(t)].rank == r + 1
        assert entry[int(t)].decoded_token == llm.tokenizer.decode([int(t)])
    assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(o.logprobs, o.token_ids)))


def test_sampled_tokens_have_finite_logprobs_under_their_filters(llm):
    sp = SamplingParams(max_tokens=NEW, temperature=0.8, top_k=4, seed=1, logprobs=0)
    (o,) = llm.generate([PROMPTS[0]], sp)
    lp = o.outputs[0].logprobs
    assert all(list(e) == [t] for e, t in zip(lp, o.token_ids))  # logprobs=0: the emitted token only
    assert all(np.isfinite(e[t].logprob) and 1 <= e[t].rank <= 4 for e, t in zip(lp, o.token_ids))


# ------------------------------------------------------------------------------------------------ refusals


def test_streaming_needs_one_sample_per_prompt(llm):
    with pytest.raises(RequestError, match="needs n = 1"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, n=2), stream=lambda i, t: None)


def test_compile_time_reported_apart_and_zero_when_warm():
    """A first call at a new shape reports the seconds it spent compiling (part of its TTFT); the same call
    again compiles nothing and reports 0."""
    from spec_helpers import tiny_config, tiny_llm, tiny_params

    config = tiny_config(40, num_layers=1)
    llm = tiny_llm(config, tiny_params(config, seed=9))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    t = time.perf_counter()
    first = llm.generate([[1, 2, 3]], sp)[0].metrics
    wall = time.perf_counter() - t
    again = llm.generate([[4, 5, 6]], sp)[0].metrics
    # Within the call's wall time (total_time starts at the prefill; compilation can come before it).
    assert 0 < first.compile_time <= wall
    assert again.compile_time == 0.0


@pytest.mark.parametrize("method", [None, "ngram"])
def test_rows_of_one_batch_get_their_own_end_to_end_time(method):
    """In one fixed batch a row that stops early reports the time to its own last step, not the batch's: a
    2-token request next to a 24-token one ends at about 1/23 of the decode, the long one at the batch's end."""
    config = tiny_config(V, num_layers=1)
    llm = tiny_llm(config, tiny_params(config, seed=3))
    spec = None if method is None else {"method": "ngram", "num_speculative_tokens": 3}
    short, long_ = (SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 24))
    llm.generate(PROMPTS, [short, long_], spec)  # compiles
    outs = llm.generate(PROMPTS, [short, long_], spec)
    ms, ml = outs[0].metrics, outs[1].metrics
    assert ms.time_to_first_token == ml.time_to_first_token
    assert ms.time_to_first_token <= ms.total_time < ml.total_time
    steps = [o.metrics.new_tokens - 1 if o.metrics.target_forwards is None else o.metrics.target_forwards - 1
             for o in outs]
    decode = ml.total_time - ml.time_to_first_token
    assert ms.total_time - ms.time_to_first_token == pytest.approx(decode * steps[0] / steps[1])
    assert ms.tokens_per_s == pytest.approx(2 / ms.total_time)
