"""The one host driver: check -> bucket -> pad -> sampling arrays -> prefill (timed: TTFT) -> device loop -> outputs.

Every way of generating for a batch of requests (plain, speculative, Neuron) runs `generate` with a variant that
supplies the parts that differ; the continuous-batching scheduler (`runners.batch`) uses the same variants'
`prefill` and `until_free`. A variant has:

  extra_slots                                     KV slots a step writes past the committed length (0: plain)
  stream                                          None, or stream(prompt_index, new_text): `generate` streams
  buckets(n, max_prompt, max_new, num_stop)       -> Buckets (compiled ahead of time where the policy wants)
  prefill(b, tokens [B, P], lens [B], active [B], sampling) -> state (first token emitted)
  dec(state) -> DecodeState;  with_dec(state, dec) -> state
  loop(b, state, sampling, ids)                   -> state with every real row finished
  chunks(b, state, sampling, ids)                 -> generator (streaming, `stream_events`): yields what the host
                                                     may read of the output after each chunk of steps (`Progress`
                                                     copies, or the DecodeState itself before the next step runs)
                                                     and returns the state with every real row finished
  until_free(b, state, sampling, max_steps)       -> state after running until a slot frees up (batch scheduler)
  state_shapes(b, sampling)                       -> the state's ShapeDtypeStructs, nothing run or compiled
  tracing()                                       -> the context entry points are traced in
  finish(state, new_ids)                          -> per-row extra metrics (dicts), after the loop

Streaming runs the same compiled loop as `loop`, a few steps per call (the step count is a traced argument), so
it compiles nothing more, one call ahead of the host (`chunk_views`): while chunk k + 1 runs, the host turns chunk
k's new tokens into text (`TextStream`).

`llm` is anything with the public attributes of `specjax.api.LLM`: params, config, tokenizer, max_context,
attention_fn, runtime, dtype.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Generator, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import compile_time
from specjax.drafters.base import capabilities_of
from specjax.engine import FINISH_RUNNING
from specjax.requests import RequestOutput, build_output, check_requests, num_stop, pad_prompts, sampling_arrays

# Steps per loop call while streaming: plain decode steps (STREAM_CHUNK), speculative steps, verify or
# backed-off plain (SPEC_STREAM_CHUNK). A speculative loop call costs more to enter than a plain one and a
# speculative step emits tau tokens, so it streams in longer chunks. Measured with `python -m
# specjax.tools.stream_bench` on SmolLM2-135M (CPU): reports/streaming_cpu/README.md.
STREAM_CHUNK = 4
SPEC_STREAM_CHUNK = 8

Event = tuple[int, str]  # (prompt index, new text)


class Progress(NamedTuple):
    """What a stream reads of a DecodeState, as copies that outlive the next loop call's donation."""

    out_tokens: jax.Array  # [B, max_new] int32
    num_new: jax.Array  # [B] int32
    finish: jax.Array  # [B] int32 FINISH_*


@jax.jit
def progress(out_tokens, num_new, finish) -> Progress:
    """Copies of a DecodeState's out_tokens [B, max_new], num_new [B] and finish [B]. Jitted (one tiny program
    per bucket); jnp.copy keeps them new buffers: the next loop call donates the originals."""
    return Progress(jnp.copy(out_tokens), jnp.copy(num_new), jnp.copy(finish))


def chunk_views(run: Callable, state, dec_of: Callable) -> Generator[Progress, None, object]:
    """Drive run(state) -> state (one loop call of a few steps, state donated) until every row finished, one
    call ahead of the host: after chunk k is dispatched, a `progress` copy of its output and chunk k + 1 are
    dispatched, and only then is the copy yielded, so the device runs chunk k + 1 while the host reads chunk k
    (waiting for chunk k alone) and turns it into text; the host's wake-up and Python time never idle the
    device. Once every row finished, the call already dispatched runs no step. dec_of(state) -> DecodeState.
    Returns the finished state."""
    state = run(state)
    while True:
        dec = dec_of(state)
        view = progress(dec.out_tokens, dec.num_new, dec.finish)
        state = run(state)
        yield view
        if not any_running(view):
            return state


def run_to_end(steps: Generator):
    """The return value of a generator run to its end, what it yields dropped (a `chunks` loop, not streamed)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def generate(llm, prompts, ids: list[list[int]], params: list, variant) -> list[RequestOutput]:
    """Generate for `ids` (token lists, one per prompt; `prompts` as the user gave them) with one variant. With
    `variant.stream` set, new text is handed to stream(prompt_index, new_text) while decoding (`stream_events`)."""
    if variant.stream is not None:
        return drain(stream_events(llm, prompts, ids, params, variant), variant.stream)
    with compile_time.watch(compile_time.say) as ct:
        b, sampling, state, t0, ttft = _start(llm, ids, params, variant)
        state = variant.loop(b, state, sampling, ids)
        return _with_compile_time(_outputs(llm, prompts, ids, variant, state, t0, ttft), ct)


def _with_compile_time(outs: list[RequestOutput], ct) -> list[RequestOutput]:
    for o in outs:
        o.metrics.compile_time = ct.total
    return outs


def stream_events(llm, prompts, ids: list[list[int]], params: list,
                  variant) -> Generator[Event, None, list[RequestOutput]]:
    """`generate` as a generator: yields (prompt_index, new_text) events while decoding, and returns (as the
    generator's return value, `outs = yield from stream_events(...)`) the same RequestOutputs `generate` returns.
    The texts of one prompt's events, joined, are its output's text. Events come after the prefill (the first
    token) and after every `variant.chunks` chunk of steps; the host looks at the output only between chunks,
    so the device runs `chunk` steps uninterrupted. Time the caller spends between events counts in the
    outputs' total_time."""
    with compile_time.watch(compile_time.say) as ct:
        return (yield from _stream_events(llm, prompts, ids, params, variant, ct))


def _stream_events(llm, prompts, ids, params, variant, ct):
    b, sampling, state, t0, ttft = _start(llm, ids, params, variant)
    text = TextStream(llm.tokenizer, len(ids))
    yield from text.push(variant.dec(state))
    steps = variant.chunks(b, state, sampling, ids)
    while True:
        try:
            view = next(steps)
        except StopIteration as done:
            state = done.value
            break
        yield from text.push(view)
    yield from text.push(variant.dec(state))
    outs = _with_compile_time(_outputs(llm, prompts, ids, variant, state, t0, ttft), ct)
    yield from text.finish([o.text for o in outs])
    return outs


def drain(events: Generator[Event, None, list[RequestOutput]], stream: Callable[[int, str], None]):
    """Call stream(prompt_index, new_text) for every event of a `stream_events` generator; return its outputs."""
    while True:
        try:
            i, piece = next(events)
        except StopIteration as done:
            return done.value
        stream(i, piece)


def _start(llm, ids, params, variant):
    """Check, bucket, pad and prefill. Returns (buckets, sampling arrays, state, start time, TTFT seconds)."""
    check_requests(ids, params, variant.extra_slots, llm.max_context)
    n = len(ids)
    b = variant.buckets(n, max(map(len, ids)), max(p.max_new_tokens for p in params),
                        num_stop(llm.tokenizer, params))
    check_memory(llm, b, variant)
    tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
    sampling = sampling_arrays(llm.tokenizer, params, b.batch, b.num_stop, ids, llm.config.vocab_size)
    t0 = time.perf_counter()
    state = variant.prefill(b, tokens, lens, active, sampling)
    jax.block_until_ready(variant.dec(state).last_token)
    return b, sampling, state, t0, time.perf_counter() - t0


def check_memory(llm, b, variant, what: str = "this generation") -> None:
    """`memory.preflight` for a variant's buckets: the target's cache, a draft model's, a verify pass's buffers."""
    from specjax.memory import preflight

    draft_config = capabilities_of(variant.drafter).draft_config
    itemsize = np.dtype(jnp.dtype(llm.dtype)).itemsize
    preflight(llm.config, b, itemsize, max(1, variant.extra_slots), draft_config, what=what)


def _outputs(llm, prompts, ids, variant, state, t0: float, ttft: float) -> list[RequestOutput]:
    """The RequestOutputs of a finished state (waits for the loop: `total_time` ends here)."""
    n = len(ids)
    dec = variant.dec(state)
    out_tokens, num_new, finish = jax.device_get((dec.out_tokens, dec.num_new, dec.finish))
    total = time.perf_counter() - t0
    new = [out_tokens[i, :num_new[i]].tolist() for i in range(n)]
    extra = variant.finish(state, new)
    ends = row_times(ttft, total, [row_steps(new[i], extra[i]) for i in range(n)])
    return [build_output(llm.tokenizer, prompts[i], ids[i], new[i], finish[i], ttft, ends[i], **extra[i])
            for i in range(n)]


def row_steps(new_ids: list[int], extra: dict) -> int:
    """Decode steps a row ran after the prefill: its target forwards past the prefill when the variant counts
    them (speculative: verify + plain steps while it ran), else one per token past the prefill's first."""
    forwards = extra.get("target_forwards")
    return max(0, (forwards if forwards is not None else len(new_ids)) - 1)


def row_times(ttft: float, total: float, steps: list[int]) -> list[float]:
    """Each row's own end-to-end seconds inside one fixed batch: the batch's time to first token plus the share
    of its decode time that ran before the row's last step. The rows step together and every step of the
    batch costs the same whichever rows still run, so a row that stops at step k of K finished k / K of the
    way; the longest row gets the batch's whole time."""
    longest = max(steps, default=0)
    if longest == 0:
        return [total] * len(steps)
    return [ttft + (total - ttft) * k / longest for k in steps]


def any_running(dec) -> bool:
    """Whether any row of a DecodeState (or `Progress`) is still running (waits for the device)."""
    return bool(np.any(np.asarray(dec.finish) == FINISH_RUNNING))


class TextStream:
    """The text of each of a batch's first n rows as it grows: `push` turns the tokens emitted since the last
    push into (row, new_text) events through one `models.tokenizer.IncrementalDecoder` per row (a character
    split across tokens is held back until complete); `finish` sends what the final texts hold beyond what was
    sent, so that a row's events always add up to its output's text."""

    def __init__(self, tokenizer, n: int):
        from specjax.models.tokenizer import IncrementalDecoder

        self.decoders = [IncrementalDecoder(tokenizer) for _ in range(n)]
        self.seen = [0] * n  # tokens of each row pushed into its decoder
        self.sent = [""] * n  # text of each row handed out

    def push(self, dec) -> Iterator[Event]:
        """Events for the tokens a DecodeState (or `Progress`) holds beyond the last push. Copies out_tokens
        [B, max_new] and num_new [B] to the host (np.array: owned copies, so no host view pins a buffer that a
        loop call donates)."""
        toks, num = (np.array(a) for a in jax.device_get((dec.out_tokens, dec.num_new)))
        events = []
        for i, d in enumerate(self.decoders):
            piece = "".join(d.push(int(t)) for t in toks[i, self.seen[i]:num[i]])
            self.seen[i] = int(num[i])
            if piece:
                self.sent[i] += piece
                events.append((i, piece))
        return iter(events)

    def finish(self, texts: list[str]) -> Iterator[Event]:
        """The last event of each row: its final text beyond what was sent (text held back as an incomplete
        character, or nothing). When the final text does not start with what was sent (a tokenizer whose
        decoding of a longer run rewrites earlier text), the decoder's own remainder is sent instead."""
        events = []
        for i, (d, full) in enumerate(zip(self.decoders, texts)):
            rest = full[len(self.sent[i]):] if full.startswith(self.sent[i]) else d.flush()
            if rest:
                self.sent[i] += rest
                events.append((i, rest))
        return iter(events)


class DeviceVariant:
    """What the device variants share: the state's shapes from an abstract prefill, the default tracing
    context, no extra metrics, no stream, and streaming in one chunk (the whole loop: the text comes at the
    end) unless a variant runs its loop in chunks."""

    extra_slots = 0
    stream = None
    drafter = None  # the speculative variants' drafter; plain decoding has none
    # A row's state has the same shapes whatever its prompt bucket (nothing in it is sized by the prompt), so the
    # slot loop may prefill a short prompt in a smaller bucket than the engine's and insert it all the same.
    prompt_free_state = False
    # The back-off rule of a speculative variant (`backoff.Adaptive`); None: always speculate, or plain decoding.
    adaptive = None
    # The variant can prefill a prompt's suffix on top of a computed prefix's KV (`prefill_after`).
    shares_prefix = False

    def state_shapes(self, b, sampling):
        B, P = b.batch, b.prompt_len
        with self.tracing():
            return jax.eval_shape(functools.partial(self.prefill, b), jax.ShapeDtypeStruct((B, P), jnp.int32),
                                  jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_),
                                  sampling)

    def tracing(self):
        return contextlib.nullcontext()

    def slot_break_even(self, b, state, sampling) -> float | None:
        """The back-off break-even at the slot loop's batch, measured on a dummy row (`SpecVariant`); None: the
        variant has no back-off to calibrate."""
        return None

    def chunks(self, b, state, sampling, ids):
        yield from ()  # nothing to show before the loop ends: the text comes with the outputs
        return self.loop(b, state, sampling, ids)

    def finish(self, state, new_ids: list[list[int]]) -> list[dict]:
        return [{} for _ in new_ids]
