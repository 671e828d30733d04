"""The serving engine (`runners.serving`): requests join and leave a fixed batch, stream, stop, cancel, fail alone.

A tiny random Llama (2 layers, hidden 32) behind a one-character-per-token tokenizer keeps compiles short and the
streamed text exact. One set of engine options (3 slots, prompts and outputs of at most 16 tokens) is shared, so
the engine's programs compile once per process; `LLM.generate` on the same model is the reference.
"""
from __future__ import annotations

import threading
import time

import pytest

from specjax.config import SamplingParams
from specjax.requests import RequestError
from specjax.runners import serving
from specjax.runners.serving import (Delta, EngineOptions, EngineStoppedError, Failed, Finished, QueueFullError,
                                     ServingEngine)

from serve_helpers import tiny_llm

OPTIONS = EngineOptions(max_batch=3, max_prompt_tokens=16, max_tokens=16, max_queue=8, step_chunk=2)


PROMPTS = ["hello there", "abcabcabc", "x", "the quick brown", "0123456789", "zz top", "q?"]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.fixture(scope="module")
def engine(llm):
    eng = ServingEngine(llm, None, OPTIONS).start()
    yield eng
    eng.shutdown()


def reference(llm, prompt: str, **sampling):
    """LLM.generate's output for one prompt, alone."""
    return llm.generate(prompt, SamplingParams(**sampling))[0]


def collect(engine, prompt, llm, **sampling):
    """Submit one request; returns (handle, events list, done Event)."""
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if not isinstance(ev, Delta):
            done.set()

    h = engine.submit(llm.tokenizer.encode(prompt), SamplingParams(**sampling), on_event)
    return h, events, done


def finished(events) -> serving.Result:
    assert isinstance(events[-1], Finished), events[-1]
    assert sum(isinstance(e, (Finished, Failed)) for e in events) == 1
    return events[-1].result


def test_concurrent_requests_match_one_at_a_time_and_compile_nothing(llm, engine):
    """7 requests on 3 slots (they join as others leave): each gets LLM.generate's greedy tokens alone, its
    streamed pieces join to its text, and serving them compiles nothing after the warm-up."""
    before = engine.compiles
    subs = [collect(engine, p, llm, max_tokens=3 + (i * 5) % 14, temperature=0) for i, p in enumerate(PROMPTS)]
    for _, events, done in subs:
        assert done.wait(60)
    assert engine.compiles == before
    reasons = set()
    for (h, events, _), p in zip(subs, PROMPTS):
        r = finished(events)
        ref = reference(llm, p, max_tokens=h.sampling.max_new_tokens, temperature=0)
        assert r.token_ids == ref.token_ids and r.text == ref.text
        assert r.finish_reason == ref.finish_reason
        assert "".join(e.text for e in events[:-1]) == r.text
        assert r.prompt_tokens == len(p) and r.completion_tokens == len(r.token_ids)
        assert 0 <= r.queue_time <= r.time_to_first_token <= r.e2e_latency
        assert r.spec is None
        reasons.add(r.finish_reason)
    assert "length" in reasons
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_short_prompts_use_smaller_prefill_buckets_with_the_same_tokens(llm):
    """A plain engine prefills a prompt in the smallest of its prompt buckets that holds it (16, 32, 64, its own);
    every bucket compiles at warm-up, and the tokens are LLM.generate's whatever the bucket."""
    eng = ServingEngine(llm, None, EngineOptions(max_batch=2, max_prompt_tokens=200, max_tokens=6)).start()
    try:
        assert eng.progs.prompt_buckets == (16, 32, 64, 256)
        assert [eng.progs.bucket_for(n) for n in (1, 16, 17, 33, 64, 65, 200)] == [16, 16, 32, 64, 64, 256, 256]
        before = eng.compiles
        prompts = ["x" * n for n in (3, 20, 40, 150)]  # one prompt per bucket
        results = [eng.generate(llm.tokenizer.encode(p), SamplingParams(max_tokens=6, temperature=0))[0]
                   for p in prompts]
        assert eng.compiles == before
        for p, r in zip(prompts, results):
            assert r.token_ids == reference(llm, p, max_tokens=6, temperature=0).token_ids
    finally:
        eng.shutdown()
    spec = ServingEngine(llm, {"method": "ngram"}, EngineOptions(max_batch=2, max_prompt_tokens=200, max_tokens=6))
    assert spec.progs.prompt_buckets == (256,)  # a speculative row's history is sized by the prompt bucket


def test_a_shared_prefix_is_prefilled_once_and_prompts_after_it_get_their_tokens(llm, monkeypatch):
    """share_prefix: the prefix's KV is computed at start; a prompt that begins with it runs only its suffix
    (`prefill_after`), any other prompt its whole prefill; no compile after warm-up; greedy tokens as alone."""
    pre = "You are a helpful assistant. "
    enc = llm.tokenizer.encode
    options = EngineOptions(max_batch=2, max_prompt_tokens=100, max_tokens=6, share_prefix=tuple(enc(pre)))
    eng = ServingEngine(llm, None, options).start()
    calls = []
    real = eng.progs.prefill_after
    monkeypatch.setattr(eng.progs, "prefill_after", lambda *a: calls.append(1) or real(*a))
    try:
        before = eng.compiles
        prompts = [pre + "hi", pre + "x" * 50, "no prefix here", pre[:10]]
        results = [eng.generate(enc(p), SamplingParams(max_tokens=6, temperature=0))[0] for p in prompts]
        assert eng.compiles == before
        assert len(calls) == 2  # the two prompts that begin with the prefix
        for p, r in zip(prompts, results):
            assert r.token_ids == reference(llm, p, max_tokens=6, temperature=0).token_ids, p
    finally:
        eng.shutdown()
    with pytest.raises(RequestError, match="share_prefix needs plain decoding"):
        ServingEngine(llm, {"method": "ngram"}, options)
    assert serving.common_prefix([enc(pre + "a"), enc(pre + "bc"), enc(pre)]) == tuple(enc(pre))[:-1]
    assert serving.common_prefix([enc("abc"), enc("abd")]) == ()  # shorter than 8 tokens: not shared


def test_stop_strings_cut_like_generate_and_are_never_streamed(llm, engine):
    """A stop string taken from the middle of a greedy output: the text is cut before it as LLM.generate cuts it,
    finish_reason is 'stop', the slot is freed early, and no streamed piece shows any part of it."""
    full = reference(llm, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True)
    stop = full.text[6:8]
    ref = reference(llm, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "never-seen"])
    _, events, done = collect(engine, PROMPTS[0], llm, max_tokens=16, temperature=0, ignore_eos=True,
                              stop=[stop, "never-seen"])
    assert done.wait(60)
    r = finished(events)
    assert (r.text, r.token_ids) == (ref.text, ref.token_ids)
    assert r.finish_reason == "stop" and r.stop_reason == stop and stop not in r.text
    assert "".join(e.text for e in events[:-1]) == r.text
    assert len(r.token_ids) < 16


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(llm, engine):
    """temperature > 0 with a seed: the same tokens alone, next to other requests, and from LLM.generate."""
    kw = dict(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _ = engine.generate(llm.tokenizer.encode("abc"), SamplingParams(**kw), timeout=60)
    others = [collect(engine, p, llm, max_tokens=16, temperature=0.7) for p in PROMPTS[:3]]
    beside, _ = engine.generate(llm.tokenizer.encode("abc"), SamplingParams(**kw), timeout=60)
    for _, _, done in others:
        assert done.wait(60)
    assert alone.token_ids == beside.token_ids == reference(llm, "abc", **kw).token_ids
    assert alone.seed == 1234
    other_seed, _ = engine.generate(llm.tokenizer.encode("abc"), SamplingParams(**dict(kw, seed=99)), timeout=60)
    assert other_seed.token_ids != alone.token_ids
    unseeded, _ = engine.generate(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=4, temperature=1.0),
                                  timeout=60)
    assert unseeded.seed is not None  # fixed at submission, so the request keeps it while others come and go


def test_cancel_frees_the_row_for_the_next_request(llm, engine):
    """A request cancelled after its first text (from its own callback, so before the next chunk runs) ends with
    Failed('cancelled') and no more text, and its slot takes the next waiting request."""
    events, done = [], threading.Event()
    handle = []

    def on_event(ev):
        events.append(ev)
        if isinstance(ev, Delta) and len(events) == 1:
            engine.cancel(handle[0])
        if not isinstance(ev, Delta):
            done.set()

    long = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    handle.append(engine.submit(llm.tokenizer.encode("abc"), long, on_event))
    assert done.wait(60)
    assert isinstance(events[-1], Failed) and events[-1].reason == "cancelled"
    assert sum(len(e.text) for e in events[:-1]) < 16
    assert engine.num_running == 0
    r, _ = engine.generate(llm.tokenizer.encode("abc"), long, timeout=60)
    assert r.token_ids == reference(llm, "abc", max_tokens=16, temperature=0, ignore_eos=True).token_ids
    engine.cancel(handle[0])  # cancelling an ended request does nothing


def test_a_failing_callback_cancels_only_its_request(llm, engine):
    def broken(ev):
        raise OSError("client went away")

    engine.submit(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), broken)
    r, _ = engine.generate(llm.tokenizer.encode("xyz"), SamplingParams(max_tokens=8, temperature=0), timeout=60)
    assert r.token_ids == reference(llm, "xyz", max_tokens=8, temperature=0).token_ids
    deadline = time.time() + 30
    while engine.num_running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0 and engine.alive


def test_a_failing_prefill_fails_only_its_request(llm, engine, monkeypatch):
    real = engine.progs.prefill

    def flaky(tokens, lens, active, sampling):
        if int(tokens[0, 0]) == llm.tokenizer.encode("!")[0]:
            raise FloatingPointError("injected prefill failure")
        return real(tokens, lens, active, sampling)

    monkeypatch.setattr(engine.progs, "prefill", flaky)
    bad = collect(engine, "!bad", llm, max_tokens=8, temperature=0)
    good = [collect(engine, p, llm, max_tokens=8, temperature=0) for p in PROMPTS[:4]]
    for _, _, done in [bad] + good:
        assert done.wait(60)
    fail = bad[1][-1]
    assert isinstance(fail, Failed) and fail.reason == "error" and "injected prefill failure" in fail.message
    for (_, events, _), p in zip(good, PROMPTS):
        assert finished(events).token_ids == reference(llm, p, max_tokens=8, temperature=0).token_ids
    assert engine.alive


def test_a_failing_batch_step_fails_the_running_requests_and_serving_goes_on(llm, engine, monkeypatch):
    real = engine.progs.advance
    calls = []

    def once(state, sampling, max_steps):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return real(state, sampling, max_steps)

    monkeypatch.setattr(engine.progs, "advance", once)
    _, events, done = collect(engine, "abc", llm, max_tokens=16, temperature=0, ignore_eos=True)
    assert done.wait(60)
    assert isinstance(events[-1], Failed) and "injected device failure" in events[-1].message
    r, _ = engine.generate(llm.tokenizer.encode("abc"), SamplingParams(max_tokens=16, temperature=0,
                                                                       ignore_eos=True), timeout=60)
    assert r.token_ids == reference(llm, "abc", max_tokens=16, temperature=0, ignore_eos=True).token_ids
    assert engine.alive


def test_penalties_and_min_tokens_join_the_running_batch_and_match_generate(llm, engine):
    """Requests with penalties, min_tokens and min_p run beside plain ones in the same batch, compile nothing
    new, and each gets LLM.generate's tokens for the same options."""
    before = engine.compiles
    opts = [dict(repetition_penalty=0.5, frequency_penalty=-2.0), dict(min_tokens=5, presence_penalty=1.5), {},
            dict(min_p=0.2, temperature=0.8, seed=3)]
    subs = [collect(engine, p, llm, max_tokens=9, ignore_eos=False, **({"temperature": 0} | o))
            for p, o in zip(PROMPTS, opts)]
    for _, _, done in subs:
        assert done.wait(60)
    assert engine.compiles == before
    for (h, events, _), p, o in zip(subs, PROMPTS, opts):
        ref = reference(llm, p, max_tokens=9, **({"temperature": 0} | o))
        assert finished(events).token_ids == ref.token_ids, o
    plain = reference(llm, PROMPTS[0], max_tokens=9, temperature=0)
    assert plain.token_ids != finished(subs[0][1]).token_ids  # the penalties changed the output


def test_bad_requests_name_the_problem(llm, engine):
    enc = llm.tokenizer.encode
    cases = [(enc("a" * 17), {}, "17 tokens"), (enc("a"), {"max_tokens": 17}, "max_tokens=17"),
             (enc("a"), {"n": 2}, "n=2"), ([], {}, "empty"),
             (enc("a"), {"stop_token_ids": tuple(range(8))}, "stop_token_ids")]
    for ids, kw, word in cases:
        with pytest.raises(RequestError, match=word):
            engine.submit(ids, SamplingParams(**dict({"max_tokens": 4}, **kw)), lambda ev: None)
    assert engine.num_waiting == 0


def test_full_queue_refuses_and_shutdown_fails_what_waits(llm):
    """An engine not yet started keeps what is submitted waiting: the queue's bound holds, and shutting down
    ends every waiting request with Failed('shutdown'); a stopped engine takes nothing more."""
    eng = ServingEngine(llm, None, EngineOptions(**dict(vars(OPTIONS), max_queue=2)))
    ends = []
    for _ in range(2):
        eng.submit([1, 2], SamplingParams(max_tokens=2), ends.append)
    with pytest.raises(QueueFullError, match="--max-queue 2"):
        eng.submit([1, 2], SamplingParams(max_tokens=2), ends.append)
    assert eng.num_waiting == 2
    assert eng.shutdown() is True
    assert [e.reason for e in ends] == ["shutdown", "shutdown"]
    with pytest.raises(EngineStoppedError):
        eng.submit([1, 2], SamplingParams(max_tokens=2), ends.append)


def test_drain_finishes_admitted_work_and_a_deadline_cancels_the_rest(llm, monkeypatch):
    """drain: no new requests, those submitted finish; shutdown with a short deadline cancels what is still
    running when it passes (steps slowed down here so that one is)."""
    eng = ServingEngine(llm, None, OPTIONS).start()
    try:
        h, events, done = collect(eng, "abc", llm, max_tokens=8, temperature=0)
        eng.drain()
        with pytest.raises(EngineStoppedError, match="shutting down"):
            eng.submit([1], SamplingParams(max_tokens=2), lambda ev: None)
        assert done.wait(60) and isinstance(events[-1], Finished)
    finally:
        assert eng.shutdown(deadline=10) is True
    assert not eng.alive

    eng = ServingEngine(llm, None, OPTIONS).start()
    real = eng.progs.advance
    monkeypatch.setattr(eng.progs, "advance", lambda *a: (time.sleep(0.05), real(*a))[1])
    _, events, done = collect(eng, "abc", llm, max_tokens=16, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    assert eng.shutdown(deadline=0.1) is False
    assert time.perf_counter() - t < 5
    assert isinstance(events[-1], Failed) and events[-1].reason == "shutdown"


def test_options_that_do_not_fit_the_model_are_refused(llm):
    with pytest.raises(RequestError, match="exceeds the model's context of 512"):
        ServingEngine(llm, None, EngineOptions(max_prompt_tokens=400, max_tokens=200))
    with pytest.raises(RequestError, match="max_batch"):
        EngineOptions(max_batch=0)
    with pytest.raises(RequestError, match="drafts on the host"):
        ServingEngine(llm, {"method": "suffix"}, OPTIONS)


@pytest.mark.slow
def test_ngram_engine_is_lossless_and_reports_speculative_metrics(llm):
    """Greedy n-gram speculation in the serving batch gives plain decoding's tokens; each result carries its
    speculative metrics (drafted, accepted, tau, per position)."""
    eng = ServingEngine(llm, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                        OPTIONS).start()
    try:
        prompts = ["abcabcabcab", "xyxyxyxy", "hello hello", "0101010"]
        subs = [collect(eng, p, llm, max_tokens=16, temperature=0, ignore_eos=True) for p in prompts]
        for _, _, done in subs:
            assert done.wait(120)
        drafted = 0
        for (_, events, _), p in zip(subs, prompts):
            r = finished(events)
            assert r.token_ids == reference(llm, p, max_tokens=16, temperature=0, ignore_eos=True).token_ids
            m = r.spec
            assert m["mean_accepted_length"] == pytest.approx(1 + m["accepted"] / m["verify_steps"]
                                                              if m["verify_steps"] else 1.0)
            assert len(m["per_position_acceptance"]) == 3 and m["accepted"] == sum(m["per_position_accepted"])
            drafted += m["drafted"]
        assert drafted > 0
    finally:
        eng.shutdown()
