"""The continuous-batching engine: the one slot loop behind `specjax serve`, `specjax batch` (`runners.batch`
schedules a job's requests onto it) and `LLM.generate`'s queue (`run_queued`). A fixed-size batch that requests
join and leave at step-chunk boundaries, over the programs of `programs` (prefill at batch 1, `insert_row` into a
free slot, `until_free` for a few steps). A server runs the loop on the engine's own thread (`start`); an offline
caller can run it on its own thread, one pass at a time (`start(thread=False)`, then `step`).

Every shape is fixed for the engine's life (prompt bucket from `EngineOptions.max_prompt_tokens`, output bucket
from `max_tokens`, B = `max_batch`, stop-id slots), so the programs compile once, at `start` (warm-up), and never
again whatever the mix of requests. Each request has its own temperature, top_p, top_k, seed, max_tokens, stop
strings and stop token ids (`SamplingParams`, n = 1); the engine has one speculative config.

Threads: `submit` / `cancel` / `drain` may be called from any thread (the HTTP layer's event loop); they touch
only a lock-guarded queue. The engine thread does all JAX work and reports to each request through its
`on_event(event)` callback (called on the engine thread: `Delta`, then exactly one `Finished` or `Failed`). After
each chunk of steps it reads the output of every running slot, turns new tokens into text (one incremental
detokenizer per slot) and holds back what could still become a stop string (`requests.StopStream`). A slot is
freed when its row finishes on the device, a stop string completes (the row is marked finished on the device,
`release_rows`), its request is cancelled, or its callback raises.

Trouble stays local: a request whose prefill or host-side processing fails gets `Failed` and its slot is freed;
a failure of a batch-wide program fails the requests running in it, and the engine starts over from an empty
batch. The waiting queue is bounded (`QueueFullError`), and `drain` stops new submissions, lets what was
admitted run until a deadline, then cancels the rest.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import traceback
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.engine import FINISH_LENGTH, FINISH_RUNNING
from specjax.errors import SpecjaxError
from specjax.requests import (CompletionOutput, RequestError, StopStream, check_request, finish_completion,
                              finish_name, fresh_seed, num_stop, pad_prompts, sampling_arrays, spec_metrics, stop_ids,
                              uses_options)


class QueueFullError(SpecjaxError, RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineStoppedError(SpecjaxError, RuntimeError):
    """The engine is draining, stopped or failed and takes no new requests (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Fixed for the engine's life.

    max_batch: slots decoded together (B). max_prompt_tokens: longest prompt (tokens) a request may have (the
    prompt bucket is this rounded up). max_tokens: the most new tokens a request may ask for (output bucket).
    max_queue: requests waiting for a slot at most; more are refused (`QueueFullError`). step_chunk: decode
    steps (plain, or speculative: verify or backed-off plain) between host check-ins at most: streams get text
    and new requests join this often. max_stop_ids: stop token ids per request, the tokenizer's end tokens
    included. all_options: the slots' sampling arrays always carry min_p, min_tokens and the penalties, so any
    request may use them without a new program; False (an offline run whose requests are all known and use none)
    leaves them out of the programs, and a request that uses one is refused. context_per_request: check the
    model's context per request (its prompt plus its max_tokens) instead of for the longest prompt with the largest
    max_tokens: an offline run whose shapes come from known requests, where those two may belong to different ones.
    """

    max_batch: int = 16
    max_prompt_tokens: int = 1024
    max_tokens: int = 256
    max_queue: int = 64
    step_chunk: int = 4
    max_stop_ids: int = 8
    all_options: bool = True
    context_per_request: bool = False
    share_prefix: tuple[int, ...] = ()

    def __post_init__(self):
        for name, low in (("max_batch", 1), ("max_prompt_tokens", 1), ("max_tokens", 1), ("max_queue", 0),
                          ("step_chunk", 1), ("max_stop_ids", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(f"invalid {name}={value!r}: must be an integer >= {low}")
        if not isinstance(self.share_prefix, tuple) or not all(isinstance(t, int) for t in self.share_prefix):
            raise RequestError("invalid share_prefix: must be a tuple of token ids")


# ----------------------------------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text of a request's output (pieces join to `Finished.result.text`)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request. finish_reason "stop" (end token, stop id or stop string) or "length"; stop_reason the
    stop string or own stop token id that ended it. spec: the speculative metrics of `requests.spec_metrics`
    (None without speculation). Times in seconds from submission: queue_time until its prefill started,
    time_to_first_token until its first token was read, e2e_latency until it finished."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    seed: int | None
    spec: dict | None
    queue_time: float
    time_to_first_token: float
    e2e_latency: float


@dataclasses.dataclass(frozen=True)
class Finished:
    result: Result


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request ended without a result. reason: "cancelled" (by the client), "shutdown" (the engine's
    deadline passed) or "error" (its generation failed; message says how)."""

    reason: str
    message: str


Event = Delta | Finished | Failed


class EngineObserver:
    """Hooks the engine calls on its own thread (metrics); the defaults do nothing."""

    def first_token(self, seconds: float) -> None:
        """A request's first token was read, `seconds` after it was submitted."""

    def finished(self, result: Result) -> None:
        """A request finished with a result."""

    def failed(self, reason: str) -> None:
        """A request ended without a result (`Failed.reason`)."""


class Handle:
    """One submitted request (returned by `submit`; pass it to `cancel`)."""

    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 on_event: Callable[[Event], None], stream: bool = True):
        self.request_id = request_id
        self.stream = stream
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.on_event = on_event
        self.arrival = time.perf_counter()
        self.admitted: float | None = None
        self.first: float | None = None
        self.done = False
        # Per-slot host state while running: tokens read so far, incremental detokenizer, stop-string hold-back.
        self.seen = 0
        self.decoder = None
        self.stops = StopStream(sampling.stop)


# ----------------------------------------------------------------------------------------------------- device


@jax.jit
def release_rows(finish, mask):
    """finish [B] int32 FINISH_* with the running rows where mask [B] bool is set marked FINISH_LENGTH: they take
    no more tokens, and the batch loop (`until_free`) no longer counts them, so their slots can be refilled. A
    freed row's cache is left as it is: `insert_row` overwrites the whole row."""
    return jnp.where(mask & (finish == FINISH_RUNNING), jnp.int32(FINISH_LENGTH), finish)


class SlotPrograms:
    """The compiled programs of the slot loop, over one host-driver variant (plain, speculative or Neuron):

    prefill(tokens [1, P], lens [1], active [1], sampling [1]) -> batch-1 state (first token emitted), P one of
        `prompt_buckets` (`bucket_for` a prompt's length)
    empty(sampling [B]) -> batch-B state with every slot finished (free)
    insert(state, row, slot) -> state with the batch-1 `row` in slot `slot`
    advance(state, sampling [B], max_steps) -> state after running until a slot frees up
    """

    def __init__(self, variant, buckets, batch: int):
        self.variant = variant
        self.drafter = variant.drafter
        self.b1 = dataclasses.replace(buckets, batch=1)
        self.bB = dataclasses.replace(buckets, batch=batch)
        self.floor: float | None = None  # the back-off break-even at batch B (`calibrate`); None = the default
        # A prompt shorter than the engine's bucket is prefilled in the smallest of these that holds it: a
        # prefill costs its bucket's tokens up to PREFILL_CHUNK (longer buckets are prefilled per row in chunks,
        # which costs a row its own length), so a 20-token chat prompt on a 1024-token server pays 32, not 128.
        P = buckets.prompt_len
        self.prompt_buckets = tuple(b for b in (16, 32, 64) if b < P) + (P,) if variant.prompt_free_state else (P,)

    def bucket_for(self, n: int) -> int:
        """The prompt bucket a prompt of n tokens is prefilled in."""
        return next(b for b in self.prompt_buckets if b >= n)

    def prefill(self, tokens, lens, active, sampling):
        P = tokens.shape[1]
        b1 = self.b1 if P == self.b1.prompt_len else dataclasses.replace(self.b1, prompt_len=P, prefill_chunk=0)
        return self.variant.prefill(b1, tokens, lens, active, sampling)

    def empty(self, sampling):
        from specjax import engine

        # The batch-B state's structure, without running (or compiling) a batch-B prefill.
        shapes = self.variant.state_shapes(self.bB, sampling)
        with self.variant.tracing():
            state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            done = jnp.full((self.bB.batch,), engine.FINISH_LENGTH, jnp.int32)
            return self.variant.with_dec(state, self.variant.dec(state)._replace(finish=done))

    def suffix_buckets(self, prefix_len: int) -> tuple[int, ...]:
        """The buckets a prompt's suffix after a shared prefix of prefix_len tokens may be prefilled in
        (`prefill_after`): the short ones that fit the cache after the prefix."""
        if not self.variant.shares_prefix:
            return ()
        return tuple(b for b in self.prompt_buckets if b <= 64 and prefix_len + b <= self.b1.capacity)

    def prefill_after(self, prefix, tokens, lens, active, sampling):
        """prefill for a prompt whose first tokens' KV is the batch-1 cache `prefix`: tokens [1, S] are the rest."""
        return self.variant.prefill_after(self.b1, prefix, tokens, lens, active, sampling)

    def insert(self, state, row, slot: int):
        from specjax import engine

        with self.variant.tracing():
            return engine.insert_row(state, row, np.int32(slot))

    def advance(self, state, sampling, max_steps: int):
        if self.floor is None:
            return self.variant.until_free(self.bB, state, sampling, max_steps)
        return self.variant.until_free(self.bB, state, sampling, max_steps, self.floor)

    def calibrate(self, llm, all_options: bool) -> float | None:
        """Measure the back-off break-even at batch B before the first request (a verify pass over B rows costs
        more plain steps than at batch 1, so a drafter that pays alone can cost a full batch): one dummy row
        (cycling token ids, ignore_eos) in slot 0 of an empty state runs timed speculative and plain steps
        (`SpecVariant.slot_break_even`), then the state is dropped. Kept in `llm.runtime` per (config, B), so a
        second job or engine of the same shape does not measure again. A no-op for plain decoding, a variant
        without a back-off rule, or the Neuron policy."""
        v = self.variant
        if v.adaptive is None:
            return None
        B, P, n_stop, V = self.bB.batch, self.bB.prompt_len, self.bB.num_stop, llm.config.vocab_size
        ids = [(i % max(1, V - 1)) + 1 for i in range(min(16, P))]
        sp = SamplingParams(max_new_tokens=self.bB.max_new, ignore_eos=True, seed=0)
        tokens, lens, active = pad_prompts([ids], 1, P)
        row = self.prefill(tokens, lens, active, sampling_arrays(llm.tokenizer, [sp], 1, n_stop, [ids], V,
                                                                 all_options))
        sampling = sampling_arrays(llm.tokenizer, [sp] * B, B, n_stop, [ids] * B, V, all_options)
        state = self.insert(self.empty(sampling), row, 0)
        self.floor = v.slot_break_even(self.bB, state, sampling)
        return self.floor


def programs(llm, buckets, batch: int, drafter=None, dparams=None, adaptive=None, spec=None) -> SlotPrograms:
    """The engine's programs for a drafter (None: plain decoding): under the Neuron policy when llm.backend is
    'neuron' (the NeuronRunner's ahead-of-time compiled prefill at batch 1 and straight-line fused step at a
    Neuron batch bucket, 4 steps a call), else the plain or speculative variant."""
    if llm.backend == "neuron":
        from specjax.backends import neuron
        from specjax.runners.neuron import NeuronVariant

        tree_nodes = 1 if drafter is None else drafter.tree.num_nodes
        b1 = neuron.bucket_for(1, buckets.prompt_len, buckets.max_new, tree_nodes, buckets.num_stop)
        progs = SlotPrograms(NeuronVariant(llm, drafter, dparams, steps_per_call=4), b1, _neuron_batch(batch))
        progs.variant.runner.warmup([progs.b1, progs.bB])
        return progs
    if drafter is None:
        from specjax.runners.plain import PlainVariant

        return SlotPrograms(PlainVariant(llm), buckets, batch)
    from specjax.runners.speculative import SpecVariant

    return SlotPrograms(SpecVariant(llm, drafter, dparams, adaptive=adaptive, spec=spec), buckets, batch)


def _neuron_batch(batch: int) -> int:
    from specjax.backends.neuron import NEURON_BATCHES

    fits = [b for b in NEURON_BATCHES if b >= batch]
    if not fits:
        raise RequestError(f"batch size {batch} exceeds the largest Neuron batch bucket ({NEURON_BATCHES[-1]}); "
                         f"use --batch-size {NEURON_BATCHES[-1]} or less")
    return fits[0]


# ----------------------------------------------------------------------------------------------------- engine


class ServingEngine:
    """Continuous batching for a server. llm: a specjax.api.LLM (or an object with its attributes);
    speculative: None (plain decoding) or a SpeculativeConfig / dict with a device drafter (ngram, draft_model,
    medusa, eagle, eagle3); observer: metric hooks (`EngineObserver`).

        engine = ServingEngine(llm, {"method": "ngram"}, EngineOptions(max_batch=8)).start()
        handle = engine.submit(ids, SamplingParams(max_tokens=32), on_event)
        result = engine.generate(ids, SamplingParams(max_tokens=32))      # blocking
        engine.shutdown(deadline=10.0)
    """

    def __init__(self, llm, speculative: SpeculativeConfig | dict | None = None,
                 options: EngineOptions | None = None, observer: EngineObserver | None = None):
        from specjax.backoff import adaptive_rule
        from specjax.buckets import make_buckets
        from specjax.runners.speculative import drafter_for

        self.llm = llm
        self.options = options or EngineOptions()
        self.observer = observer or EngineObserver()
        self.spec = SpeculativeConfig.from_user(speculative)
        drafter = dparams = adaptive = None
        extra = 0
        # A model on a device mesh traces and runs every program under it (`LLM.on_mesh`), here and in the engine
        # thread: the mesh context is per thread.
        self._on_mesh = llm.on_mesh
        if self.spec.enabled:
            with self._on_mesh():
                drafter, dparams = drafter_for(llm, self.spec)
            if drafter.capabilities.host_side:
                raise RequestError(f"speculative method {self.spec.method!r} drafts on the host and cannot run in "
                                   "the continuous batching loop; use ngram, draft_model, medusa, eagle or eagle3")
            adaptive = adaptive_rule(drafter, self.spec)
            extra = drafter.tree.num_nodes
        self.extra_slots = extra
        o = self.options
        need = o.max_prompt_tokens + o.max_tokens + extra
        if need > llm.max_context and not o.context_per_request:
            raise RequestError(f"max_prompt_tokens {o.max_prompt_tokens} + max_tokens {o.max_tokens}"
                               + (f" + {extra} speculative slots" if extra else "")
                               + f" = {need} exceeds the model's context of {llm.max_context}; lower one of them")
        buckets = make_buckets(1, o.max_prompt_tokens, o.max_tokens, extra_slots=extra, num_stop=o.max_stop_ids,
                               kv_dtype=llm.kv_cache_dtype)
        with self._on_mesh():
            self.progs = programs(llm, buckets, o.max_batch, drafter, dparams, adaptive,
                                  self.spec if self.spec.enabled else None)
        if o.share_prefix and not (self.progs.suffix_buckets(len(o.share_prefix))
                                   and len(o.share_prefix) < o.max_prompt_tokens):
            raise RequestError("share_prefix needs plain decoding and a prefix shorter than max_prompt_tokens; "
                               "drop share_prefix")
        self._prefix = None  # the shared prefix's batch-1 KV cache (`_prepare`)
        self.batch = self.progs.bB.batch
        self._filler = SamplingParams(max_new_tokens=1, seed=0)  # sampling values of free slots (never read)
        self._lock = threading.Condition()
        self._waiting: collections.deque[Handle] = collections.deque()
        self._cancel: set[Handle] = set()
        self._slots: list[Handle | None] = [None] * self.batch
        self._accepting = True
        self._deadline: float | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.failure: str | None = None  # why the engine stopped, when it failed
        self.compiles = 0  # XLA compilations in this process since `start` (flat after warm-up)
        self.warmup_seconds: float | None = None

    # ------------------------------------------------------------------------------------------- public API

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output a request may have."""
        return self.options.max_prompt_tokens + self.options.max_tokens

    @property
    def num_running(self) -> int:
        with self._lock:
            return sum(h is not None for h in self._slots)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes requests."""
        return self._thread is not None and self._thread.is_alive() and self._accepting and self.failure is None

    def check(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> SamplingParams:
        """Raise RequestError unless the request fits this engine (prompt and output buckets, context, stop-id
        slots, supported options); returns its SamplingParams with the seed fixed (a fresh one for a sampled
        request without seed, so that the request keeps it while others join and leave the batch)."""
        o = self.options
        if sampling.n != 1:
            raise RequestError(f"n={sampling.n} is not supported by the server; send n separate requests")
        if sampling.logprobs is not None:
            raise RequestError("logprobs are not supported by the server yet; leave logprobs unset")
        if len(prompt_ids) > o.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens, more than this server's limit of "
                               f"{o.max_prompt_tokens} (--max-prompt-tokens); shorten it")
        if sampling.max_new_tokens > o.max_tokens:
            raise RequestError(f"max_tokens={sampling.max_new_tokens} exceeds this server's limit of {o.max_tokens} "
                               "(--max-tokens); ask for fewer tokens")
        if not prompt_ids:
            raise RequestError("the prompt is empty (no tokens); send some text")
        check_request("of the request", list(prompt_ids), sampling, self.extra_slots, self.llm.max_context)
        n_stop = len(stop_ids(self.tokenizer, sampling))
        if n_stop > self.progs.bB.num_stop:
            raise RequestError(f"stop_token_ids: {n_stop} stop ids (the model's end tokens included) do not fit "
                               f"the server's {self.progs.bB.num_stop}; give fewer")
        if not o.all_options and uses_options([sampling]):
            raise RequestError("min_p, min_tokens and the penalties need an engine built with all_options=True")
        if sampling.seed is None and not sampling.is_greedy:
            sampling = dataclasses.replace(sampling, seed=fresh_seed())
        return sampling

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, on_event: Callable[[Event], None],
               request_id: str | None = None, stream: bool = True) -> Handle:
        """Queue a request (any thread). on_event(event) is called on the engine thread: `Delta`s, then one
        `Finished` or `Failed`; an exception it raises cancels the request. stream=False: no `Delta`s, and no text
        until the row ends (its stop strings then cut the result, as a non-streamed `LLM.generate` does). Raises RequestError (bad request),
        QueueFullError or EngineStoppedError; nothing is queued then."""
        ids = [int(t) for t in prompt_ids]
        sampling = self.check(ids, sampling)
        with self._lock:
            if not self._accepting or self._stop or self.failure is not None:
                raise EngineStoppedError("the server is shutting down and takes no new requests"
                                         if self.failure is None else f"the engine failed: {self.failure}")
            if len(self._waiting) >= self.options.max_queue:
                raise QueueFullError(f"the server is busy: {len(self._waiting)} requests are already waiting "
                                     f"(--max-queue {self.options.max_queue}); retry later")
            handle = Handle(request_id or f"req-{next(self._ids)}", ids, sampling, on_event, stream)
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Cancel a request (any thread): it is dropped from the queue or its slot is freed at the next step-chunk
        boundary, and it gets Failed("cancelled"). Nothing happens for a request that already ended."""
        with self._lock:
            if not handle.done:
                self._cancel.add(handle)
                self._lock.notify_all()

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, timeout: float | None = None
                 ) -> tuple[Result, list[str]]:
        """Submit and wait: (result, the streamed text pieces). Raises RuntimeError when the request failed."""
        done = threading.Event()
        pieces: list[str] = []
        end: list[Event] = []

        def on_event(ev: Event) -> None:
            if isinstance(ev, Delta):
                pieces.append(ev.text)
            else:
                end.append(ev)
                done.set()

        handle = self.submit(prompt_ids, sampling, on_event)
        if not done.wait(timeout):
            self.cancel(handle)
            raise TimeoutError(f"request {handle.request_id} did not finish within {timeout} s")
        if isinstance(end[0], Failed):
            raise RuntimeError(f"request {handle.request_id} failed ({end[0].reason}): {end[0].message}")
        return end[0].result, pieces

    def start(self, warmup: bool = True, thread: bool = True) -> "ServingEngine":
        """Start the engine thread; with `warmup`, compile every program first (returns once they are
        compiled). Raises whatever the warm-up raised. thread=False starts no thread: the caller runs the loop
        itself with `step` (on one thread, events delivered during its calls)."""
        if self._thread is not None or self._inline:
            raise RuntimeError("the engine was already started")
        jax.monitoring.register_event_duration_secs_listener(self._count_compile)
        if not thread:
            with self._on_mesh():
                self._prepare(warmup)
            self._inline = True
            return self
        ready = threading.Event()
        error: list[BaseException] = []

        def main():
            with self._on_mesh():
                try:
                    self._prepare(warmup)
                except BaseException as e:  # reported to start()'s caller
                    error.append(e)
                    self.failure = f"warm-up failed: {e}"
                    ready.set()
                    return
                ready.set()
                self._run()

        self._thread = threading.Thread(target=main, name="specjax-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if error:
            raise error[0]
        return self

    def step(self) -> bool:
        """One pass of the slot loop on the caller's thread (an engine started with thread=False): cancellations,
        admissions, a chunk of steps, read, finish; events are delivered before it returns. Returns whether any
        request is still running or waiting. A failure of a batch-wide program is raised to the caller."""
        if not self._inline:
            raise RuntimeError("step() drives an engine started with thread=False")
        with self._on_mesh():
            self._pass(wait=False)
        with self._lock:
            return bool(self._waiting) or any(h is not None for h in self._slots)

    def drain(self, deadline: float | None = None) -> None:
        """Take no new requests; those already submitted run on. With `deadline` (seconds from now), whatever
        has not finished by then is cancelled with Failed("shutdown")."""
        with self._lock:
            self._accepting = False
            if deadline is not None:
                at = time.perf_counter() + deadline
                self._deadline = at if self._deadline is None else min(self._deadline, at)
            self._lock.notify_all()

    def shutdown(self, deadline: float = 0.0) -> bool:
        """`drain(deadline)`, wait for every request to end, stop the engine thread. Returns whether every request
        finished by itself (none was ever cancelled at a drain deadline)."""
        self.drain(deadline)
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        else:  # never started: fail what waits
            self._fail_waiting("shutdown", "the server shut down before the request could run")
        try:
            jax.monitoring.unregister_event_duration_listener(self._count_compile)
        except (AssertionError, ValueError, AttributeError):  # not registered (never started)
            pass
        return self._shutdown_cancels == 0

    _shutdown_cancels = 0  # requests cancelled at a drain deadline
    _inline = False  # started with thread=False: the caller runs the loop (`step`)

    # ------------------------------------------------------------------------------------------- engine thread

    def _count_compile(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1

    def _prepare(self, warmup: bool) -> None:
        # The back-off break-even at this batch size, measured before any request runs (`calibrate`).
        self.progs.calibrate(self.llm, self.options.all_options)
        if self.options.share_prefix:
            row = self._prefill(list(self.options.share_prefix), self._filler)
            self._prefix = self.progs.variant.dec(row).cache
        self._state = self._empty()
        self._last_read = None  # the last host copy of the outputs, None when no slot is taken
        if warmup:
            t = time.perf_counter()
            self._warmup()
            self.warmup_seconds = time.perf_counter() - t

    def _sampling(self) -> object:
        """The [B] sampling arrays of the slots (free slots repeat the filler's values)."""
        params = [self._filler if h is None else h.sampling for h in self._slots]
        prompts = [[0] if h is None else h.prompt_ids for h in self._slots]
        # Every optional array is always there (min_p, min_tokens, penalties; neutral values are exact no-ops), so
        # requests that use them join the running batch without a new program.
        return sampling_arrays(self.tokenizer, params, self.batch, self.progs.bB.num_stop, prompts,
                               self.llm.config.vocab_size, all_options=self.options.all_options)

    def _empty(self):
        self._slot_sampling = self._sampling()
        return self.progs.empty(self._slot_sampling)

    def _warmup(self) -> None:
        """Run every program once on a dummy request, so that none compiles while serving."""
        P = self.progs.bB.prompt_len
        ids = [1] * min(8, P)
        sp = SamplingParams(max_new_tokens=min(2 * self.options.step_chunk + 1, self.options.max_tokens),
                            ignore_eos=True, seed=0)
        for P in self.progs.prompt_buckets[:-1]:  # the smaller prefill programs; the engine's own runs below
            jax.block_until_ready(self._prefill(ids, sp, P))
        if self._prefix is not None:
            for S in self.progs.suffix_buckets(len(self.options.share_prefix)):
                jax.block_until_ready(self._prefill(list(self.options.share_prefix) + ids, sp, suffix_bucket=S))
        row = self._prefill(ids, sp, self.progs.prompt_buckets[-1])
        self._state = self.progs.insert(self._state, row, 0)
        self._state = self.progs.advance(self._state, self._slot_sampling, self.options.step_chunk)
        self._read()
        self._release(np.ones(self.batch, bool))
        self._read()
        if self.progs.drafter is not None:
            jax.device_get(self._state.stats)

    def _prefill(self, ids: list[int], sp: SamplingParams, bucket: int | None = None,
                 suffix_bucket: int | None = None):
        """A request's batch-1 state: its prompt prefilled in `bucket` (default: the smallest that holds it), or,
        when it begins with the shared prefix, its suffix after the prefix's KV (in `suffix_bucket`, default: the
        smallest that holds it; the whole prompt when none does)."""
        sampling = sampling_arrays(self.tokenizer, [sp], 1, self.progs.bB.num_stop, [ids], self.llm.config.vocab_size,
                                   all_options=self.options.all_options)
        pre = self.options.share_prefix
        if self._prefix is not None and bucket is None and len(ids) > len(pre) and tuple(ids[:len(pre)]) == pre:
            rest = ids[len(pre):]
            S = suffix_bucket or next((b for b in self.progs.suffix_buckets(len(pre)) if b >= len(rest)), None)
            if S is not None:
                tokens, lens, active = pad_prompts([rest], 1, S)
                return self.progs.prefill_after(self._prefix, tokens, lens, active, sampling)
        tokens, lens, active = pad_prompts([ids], 1, bucket or self.progs.bucket_for(len(ids)))
        return self.progs.prefill(tokens, lens, active, sampling)

    def _read(self):
        """(out_tokens [B, max_new], num_new [B], finish [B]) on the host (waits for the device)."""
        dec = self.progs.variant.dec(self._state)
        return tuple(np.asarray(a) for a in jax.device_get((dec.out_tokens, dec.num_new, dec.finish)))

    def _release(self, mask: np.ndarray) -> None:
        """Mark the rows of mask [B] finished on the device (`release_rows`)."""
        v = self.progs.variant
        dec = v.dec(self._state)
        with v.tracing():
            finish = release_rows(dec.finish, jnp.asarray(mask))
        self._state = v.with_dec(self._state, dec._replace(finish=finish))

    def _emit(self, h: Handle, event: Event) -> bool:
        """Hand an event to its request; False when the callback raised (the caller then cancels it)."""
        try:
            h.on_event(event)
            return True
        except Exception:
            return False

    def _end(self, h: Handle, event: Finished | Failed) -> None:
        """A request's last event, once."""
        if h.done:
            return
        h.done = True
        self._emit(h, event)
        if isinstance(event, Finished):
            self.observer.finished(event.result)
        else:
            self.observer.failed(event.reason)

    def _fail_waiting(self, reason: str, message: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for h in waiting:
            self._end(h, Failed(reason, message))

    def _run(self) -> None:
        """Serve until stopped; a batch-wide failure fails the requests running in it and serving starts over
        from an empty batch (`_recover`)."""
        while True:
            try:
                self._serve()
                return
            except Exception as e:
                self._recover(e)
                if self.failure is not None:
                    self._cancel_all("error", f"the engine failed: {self.failure}")
                    return

    def _serve(self) -> None:
        """The engine thread's loop: passes until stopped."""
        while self._pass(wait=True):
            pass

    def _pass(self, wait: bool) -> bool:
        """One pass of the slot loop: cancellations, admissions, a chunk of steps, read and stream, finish. With
        `wait`, it first blocks until there is work. Returns False when the engine is to stop."""
        with self._lock:
            while wait and not (self._stop or self._waiting or self._cancel or any(h is not None for h in self._slots)):
                self._lock.wait()
            cancels, self._cancel = self._cancel, set()
            past_deadline = self._deadline is not None and time.perf_counter() >= self._deadline
            idle = not self._waiting and all(h is None for h in self._slots)
            stop_now = self._stop and (idle or past_deadline)
            gone = [h for h in self._waiting if h in cancels]
            for h in gone:
                self._waiting.remove(h)
            if past_deadline:
                self._deadline = None
        for h in gone:
            self._end(h, Failed("cancelled", "the request was cancelled"))
        if past_deadline:
            self._cancel_all("shutdown", "the server shut down before the request finished")
            self._last_read = None
        if stop_now:
            return False
        free = np.zeros(self.batch, bool)
        for s, h in enumerate(self._slots):
            if h is not None and h in cancels:
                free[s] = True
                self._vacate(s, Failed("cancelled", "the request was cancelled"))
        if free.any():
            self._release(free)
        admitted = self._admit()
        if not any(h is not None for h in self._slots):
            self._last_read = None
            return True
        if admitted or self._last_read is None:
            self._last_read = self._read()
        if np.any(self._last_read[2] == FINISH_RUNNING):
            self._state = self.progs.advance(self._state, self._slot_sampling, self.options.step_chunk)
        self._last_read = self._read()
        self._collect(self._last_read)
        return True

    def _admit(self) -> bool:
        """Prefill waiting requests into free slots (each alone, at batch 1), streaming each one's first token
        as it joins. Returns whether any joined."""
        joined = False
        for s in range(self.batch):
            if self._slots[s] is not None:
                continue
            with self._lock:
                if not self._waiting:
                    break
                h = self._waiting.popleft()
            h.admitted = time.perf_counter()
            try:
                row = self._prefill(h.prompt_ids, h.sampling)
                jax.block_until_ready(row)
            except Exception as e:  # this request's prefill failed: only it fails
                self._end(h, Failed("error", f"generation failed: {_describe(e)}"))
                continue
            from specjax.models.tokenizer import IncrementalDecoder

            h.decoder = IncrementalDecoder(self.tokenizer) if h.stream else None
            self._state = self.progs.insert(self._state, row, s)
            with self._lock:
                self._slots[s] = h
            joined = True
            # Its first token goes out now, not after every other admission's prefill (TTFT under a burst).
            self._collect(self._read())
        if joined:
            self._slot_sampling = self._sampling()
        return joined

    def _vacate(self, s: int, event: Finished | Failed) -> None:
        h = self._slots[s]
        with self._lock:
            self._slots[s] = None
        self._end(h, event)

    def _collect(self, read) -> None:
        """Stream each running slot's new text; finish the slots whose row ended or whose stop string completed."""
        toks, num, finish = read
        release = np.zeros(self.batch, bool)
        stats = None
        now = time.perf_counter()
        for s, h in enumerate(self._slots):
            if h is None:
                continue
            try:
                n = int(num[s])
                if h.first is None and n > 0:
                    h.first = now
                    self.observer.first_token(now - h.arrival)
                if h.stream:
                    piece = "".join(h.decoder.push(int(t)) for t in toks[s, h.seen:n])
                    h.seen = n
                    shown = h.stops.push(piece) if piece else ""
                    if shown and not self._emit(h, Delta(shown)):
                        release[s] = True
                        self._vacate(s, Failed("cancelled", "the request's receiver failed"))
                        continue
                ended = finish[s] != FINISH_RUNNING
                if not (ended or h.stops.stopped):
                    continue
                if self.progs.drafter is not None and stats is None:
                    stats = jax.device_get(self._state.stats)
                result = self._result(h, toks[s, :n].tolist(), int(finish[s]), stats, s, now)
                rest = h.stops.close(result.text) if h.stream else ""
                if rest and not self._emit(h, Delta(rest)):
                    release[s] = True
                    self._vacate(s, Failed("cancelled", "the request's receiver failed"))
                    continue
                if not ended:
                    release[s] = True  # a stop string ended it before the device did
                self._vacate(s, Finished(result))
            except Exception as e:  # this request's host-side processing failed: only it fails
                release[s] = finish[s] == FINISH_RUNNING
                self._vacate(s, Failed("error", f"generation failed: {_describe(e)}"))
        if release.any():
            self._release(release)

    def _result(self, h: Handle, ids: list[int], finish: int, stats, s: int, now: float) -> Result:
        sp = h.sampling
        comp = CompletionOutput(0, self.tokenizer.decode(ids), ids, None, None, finish_name(finish), None, sp.seed)
        comp = finish_completion(self.tokenizer, comp, sp)
        spec = None if stats is None else spec_metrics(stats, s, None, None, self.spec.is_lossy)
        if spec is not None:
            for k in ("draft_time", "verify_time"):
                spec.pop(k)
        return Result(h.request_id, comp.text, list(comp.token_ids), comp.finish_reason, comp.stop_reason,
                      len(h.prompt_ids), len(comp.token_ids), sp.seed, spec, h.admitted - h.arrival,
                      (h.first or now) - h.arrival, now - h.arrival)

    def _cancel_all(self, reason: str, message: str) -> None:
        """End every running and waiting request with Failed(reason) and free their slots."""
        mask = np.array([h is not None for h in self._slots])
        for s, h in enumerate(self._slots):
            if h is not None:
                if reason == "shutdown":
                    self._shutdown_cancels += 1
                self._vacate(s, Failed(reason, message))
        if reason == "shutdown":
            with self._lock:
                self._shutdown_cancels += len(self._waiting)
        self._fail_waiting(reason, message)
        if mask.any() and self.failure is None:
            try:
                self._release(mask)
            except Exception as e:
                self._recover(e)

    def _recover(self, error: Exception) -> None:
        """A batch-wide step failed: fail the running requests and start from an empty batch; when even that
        fails, the engine stops (`failure`) and fails everything waiting."""
        message = f"generation failed: {_describe(error)}"
        for s, h in enumerate(self._slots):
            if h is not None:
                self._vacate(s, Failed("error", message))
        self._last_read = None
        try:
            self._state = self._empty()
        except Exception as e:
            self.failure = _describe(e)
            self._fail_waiting("error", f"the engine failed: {self.failure}")


# ----------------------------------------------------------------------------------------------------- offline


def run_queued(llm, prompt_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], speculative,
               max_batch: int, on_text: Callable[[int, str], None] | None = None, step_chunk: int = 32,
               progress: bool = False, on_result: Callable[[int, Result], None] | None = None,
               share_prefix: bool = False) -> list[Result] | None:
    """Generate for every request with at most `max_batch` running at once, the rest queued: `LLM.generate`
    past max_num_seqs, and the distillation corpora (`specjax.train.generate`, `specjax.train.data`). A finished
    row's slot takes the next request at once (continuous batching), so a short request never waits for the
    longest one of a fixed batch. Shapes come from the requests (longest prompt, largest max_new_tokens), so every
    program compiles once for the call. The engine runs on this thread (`ServingEngine.step`), so every callback is
    called here.

    on_text(i, new_text): request i's text as it grows (the pieces join to its result's text); without it and
    without stop strings nothing is detokenized while decoding. step_chunk: steps between host check-ins at most
    (the loop returns earlier when a slot frees). progress: a tqdm bar over finished requests on stderr.
    on_result(i, result): request i finished; with it nothing is kept and None is returned (a corpus of many
    requests), else one Result per request, in order. share_prefix: with plain decoding, the prompts' common
    prefix is prefilled once (`EngineOptions.share_prefix`: for corpora, whose first tokens may then differ from
    `LLM.generate`'s in rounding). A request that fails raises its error; nothing is left running."""
    n = len(prompt_ids)
    params = list(params)
    options = EngineOptions(max_batch=max(1, min(max_batch, n)), max_prompt_tokens=max(map(len, prompt_ids)),
                            max_tokens=max(p.max_new_tokens for p in params), max_queue=n, step_chunk=step_chunk,
                            max_stop_ids=max(1, num_stop(llm.tokenizer, params)), all_options=uses_options(params),
                            context_per_request=True,
                            share_prefix=common_prefix(prompt_ids) if share_prefix and speculative is None else ())
    engine = ServingEngine(llm, speculative, options)
    events: collections.deque = collections.deque()
    results: list[Result | None] | None = None if on_result is not None else [None] * n
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="generate", unit="req", dynamic_ncols=True)
        except ImportError:  # tqdm is optional
            bar = None
    # Streamed rows are read as text while decoding, so a row whose stop string completes is released at once.
    stream = on_text is not None or any(p.stop for p in params)
    engine.start(warmup=False, thread=False)
    try:
        for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
            engine.submit(ids, sp, lambda ev, i=i: events.append((i, ev)), request_id=str(i), stream=stream)
        busy = True
        while busy or events:
            if not events:
                busy = engine.step()
            while events:
                i, ev = events.popleft()
                if isinstance(ev, Delta):
                    if on_text is not None:
                        on_text(i, ev.text)
                elif isinstance(ev, Failed):
                    raise RequestError(f"request {i} failed ({ev.reason}): {ev.message}")
                else:
                    if results is None:
                        on_result(i, ev.result)
                    else:
                        results[i] = ev.result
                    if bar is not None:
                        bar.update(1)
    finally:
        engine.shutdown(deadline=0.0)
        if bar is not None:
            bar.close()
    return results


def common_prefix(prompts: Sequence[Sequence[int]], minimum: int = 8) -> tuple[int, ...]:
    """The longest token prefix every prompt starts with, less one token (each prompt keeps a suffix); () when
    that is shorter than `minimum` tokens (not worth a program of its own)."""
    first = [int(t) for t in prompts[0]]
    n = len(first) - 1
    for p in prompts[1:]:
        m = min(n, len(p) - 1)
        n = next((i for i in range(m) if int(p[i]) != first[i]), m)
        if n < minimum:
            return ()
    return tuple(first[:n]) if n >= minimum else ()


def _describe(e: BaseException) -> str:
    """One line for an exception: its type and message (a SpecjaxError's message alone), last frame for others."""
    if isinstance(e, SpecjaxError):
        return str(e)
    frame = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" (at {frame[0].name})" if frame else ""
    return f"{type(e).__name__}: {e}{where}"
