"""`specjax batch`: offline generation over a JSONL file with continuous batching; resumable and crash-safe.

Input, one JSON object per line (other keys are ignored):

    {"id": "q1", "prompt": "Translate to French: cheese", "sampling": {"temperature": 0.7, "max_tokens": 64}}
    {"id": 2, "messages": [{"role": "user", "content": "Hi"}]}

`id` (string or integer) is required and unique; `prompt` is raw text (or a list of token ids), `messages` a chat
conversation rendered with the model's chat template; `sampling` holds SamplingParams fields laid over the job's
defaults. Output: one line per finished request, in completion order:

    {"id": "q1", "text": ..., "token_ids": [...], "finish_reason": "stop", "metrics": {...}}

Continuous batching: B slots run in one compiled decode loop (plain or speculative); the loop returns to the
host as soon as a slot finishes, the host writes that result, prefills the next request alone (batch 1) and
copies its state into the free slot (`insert_row`). Every shape is fixed for the whole job (prompt bucket from
the longest prompt of the input file, output bucket from its largest max_new_tokens), so a job compiles three
programs (prefill, insert, loop) once and never again, whatever the mix of requests. With backend 'neuron'
the loop is the NeuronRunner's straight-line fused step instead (no cond, no data-dependent loop), and the host
checks for free slots after every call. The prefill and the loop are the host driver's variants
(`runners.plain`, `runners.speculative`, `runners.neuron`); the files are `runners.batch_io`.

Crash safety: each result is one `write()` of one line, then fsync. On start the output is read back: ids
already there are skipped, and a torn last line (no newline, or not JSON) is cut off before appending. A crash
loses at most the requests in flight. An exclusive lock on the output stops two runs from writing to it.
The input file is only ever read. SIGTERM drains: no new request starts, the running ones are written, the job
returns (`JobSummary.stopped`); a second SIGTERM stops at once. A write that fails (a full disk, a file-size
limit) is cut back to the last whole line and ends the job with a BatchError; a rerun resumes.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import time

import numpy as np

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.requests import (check_request, encode_prompt, finish_name, num_stop, pad_prompts, sampling_arrays,
                              uses_options)
from specjax.runners.batch_io import BatchError, JobSummary, Request, ResultFile, check_paths, read_requests

# JAX and the engines are imported where they are used: `specjax --help` builds the batch command's argument
# parser and should not pay for importing JAX.


# ----------------------------------------------------------------------------------------------------- device


class SlotPrograms:
    """The compiled programs of a job, over one host-driver variant (plain, speculative or Neuron):

    prefill(tokens [1, P], lens [1], active [1], sampling [1]) -> batch-1 state (first token emitted)
    empty(sampling [B]) -> batch-B state with every slot finished (free)
    insert(state, row, slot) -> state with the batch-1 `row` in slot `slot`
    advance(state, sampling [B], max_steps) -> state after running until a slot frees up
    """

    def __init__(self, variant, buckets, batch: int):
        self.variant = variant
        self.drafter = getattr(variant, "drafter", None)
        self.b1 = dataclasses.replace(buckets, batch=1)
        self.bB = dataclasses.replace(buckets, batch=batch)
        self.floor: float | None = None  # the back-off break-even at batch B (`calibrate`); None = the default

    def prefill(self, tokens, lens, active, sampling):
        return self.variant.prefill(self.b1, tokens, lens, active, sampling)

    def empty(self, sampling):
        import jax
        import jax.numpy as jnp

        from specjax import engine

        # The batch-B state's structure, without running (or compiling) a batch-B prefill.
        shapes = self.variant.state_shapes(self.bB, sampling)
        with self.variant.tracing():
            state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            done = jnp.full((self.bB.batch,), engine.FINISH_LENGTH, jnp.int32)
            return self.variant.with_dec(state, self.variant.dec(state)._replace(finish=done))

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
        if getattr(v, "adaptive", None) is None or not hasattr(v, "slot_break_even"):
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
    """The job's programs for a drafter (None: plain decoding): under the Neuron policy when llm.backend is
    'neuron' (the NeuronRunner's ahead-of-time compiled prefill at batch 1 and straight-line fused step at a
    Neuron batch bucket, 4 steps a call), else the plain or speculative variant."""
    if getattr(llm, "backend", None) == "neuron":
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
        raise BatchError(f"batch size {batch} exceeds the largest Neuron batch bucket ({NEURON_BATCHES[-1]}); "
                         f"use --batch-size {NEURON_BATCHES[-1]} or less")
    return fits[0]


# ----------------------------------------------------------------------------------------------------- the job


def run_job(llm, input_path: str, output_path: str, *, sampling: SamplingParams | dict | None = None,
            speculative: SpeculativeConfig | dict | None = None, batch_size: int = 8, chat: bool = False,
            max_steps: int = 32, progress: bool = True, err=None, select=None) -> JobSummary:
    """Generate for every request of `input_path` not yet in `output_path`, appending one line per result.

    llm: a specjax.api.LLM (or an object with the same attributes).
    sampling: the job's default SamplingParams; a line's `sampling` object overrides fields of it.
    speculative: None (plain decoding) or a SpeculativeConfig/dict with a device drafter (ngram, draft_model).
    batch_size: slots decoded together (B); finished slots are refilled with new requests.
    chat: wrap plain-text `prompt`s in the model's chat template (`messages` always are).
    max_steps: decode steps between host check-ins at most (the loop returns earlier when a slot finishes).
    progress: show a tqdm progress bar on `err`.
    err: stream for problems, progress and the summary (default sys.stderr).
    select: None (serve every request), or select(i, request) -> bool for the i-th valid request: this run
    serves only those (one process's share, `runners.distributed`); shapes still come from every valid request.
    Raises BatchError before any work when the files or the method cannot be used; bad lines only warn.
    """
    from specjax.buckets import make_buckets
    from specjax.backoff import adaptive_rule
    from specjax.runners.speculative import drafter_for

    err = err or sys.stderr
    t_start = time.perf_counter()
    if batch_size < 1:
        raise BatchError(f"batch size must be >= 1, got {batch_size}")
    if max_steps < 1:
        raise BatchError(f"max_steps must be >= 1, got {max_steps}")
    defaults = SamplingParams.from_user(sampling)
    spec = SpeculativeConfig.from_user(speculative)
    check_paths(input_path, output_path)
    say = lambda msg: print(f"specjax batch: {msg}", file=err, flush=True)
    drafter = dparams = adaptive = None
    extra = 0
    # A model on a device mesh runs every program under it (`LLM.on_mesh`); the slots spread over its data axis.
    on_mesh = getattr(llm, "on_mesh", contextlib.nullcontext)
    if spec.enabled:
        with on_mesh():
            drafter, dparams = drafter_for(llm, spec)
        if drafter.capabilities.host_side:
            raise BatchError(f"speculative method {spec.method!r} drafts on the host and cannot run inside the "
                             "batch decode loop; use 'ngram' or 'draft_model'")
        adaptive = adaptive_rule(drafter, spec)
        extra = drafter.tree.num_nodes

    summary = JobSummary(speculative=spec.enabled)
    out = ResultFile(output_path, say)
    try:
        def prepare(r: Request) -> None:  # RequestError / TokenizerError (ValueErrors) are reported by the reader
            r.token_ids = encode_prompt(llm.tokenizer, llm.config.vocab_size, r.prompt, True if r.is_chat else chat)
            check_request(r.key, r.token_ids, r.sampling, extra, llm.max_context)

        valid, summary.skipped_lines = read_requests(
            input_path, defaults, lambda n, msg: say(f"{input_path}:{n}: {msg}"), prepare)
        summary.requests = len(valid)
        mine = [r for i, r in enumerate(valid) if select is None or select(i, r)]
        summary.requests = len(mine)
        todo = collections.deque(r for r in mine if r.key not in out.done)
        summary.already_done = len(mine) - len(todo)
        if not todo:
            summary.wall_time = time.perf_counter() - t_start
            say(summary.format())
            return summary
        # Buckets from every valid request, finished ones included: a resumed job compiles the same shapes as
        # the first run, so its outputs are bit-identical to an uninterrupted run (sampled speculative jobs only
        # with adaptive: false: the back-off's measured break-even decides which steps verify, and with it
        # which random numbers a sampled step draws).
        buckets = make_buckets(1, max(len(r.token_ids) for r in valid), max(r.sampling.max_new_tokens for r in valid),
                               extra_slots=extra, num_stop=num_stop(llm.tokenizer, [r.sampling for r in valid]),
                               kv_dtype=getattr(llm, "kv_cache_dtype", None))
        # B from every valid request too (not only those left), for the same reason.
        B = min(batch_size, len(valid))
        with on_mesh():
            progs = programs(llm, buckets, B, drafter, dparams, adaptive, spec if spec.enabled else None)
            from specjax.runners.base import check_memory

            check_memory(llm, progs.bB, progs.variant, "this batch job")
            progs.calibrate(llm, uses_options([r.sampling for r in todo]))
            with GracefulStop(say) as stop:
                _decode(llm, progs, todo, progs.bB.batch, out, summary, spec, max_steps, progress, err, stop)
    finally:
        out.close()
        summary.wall_time = time.perf_counter() - t_start
    say(summary.format())
    return summary


class GracefulStop:
    """While active (a context manager, main thread only), the first SIGTERM sets `requested`: the job admits
    nothing new and returns once the requests in flight are written. A second SIGTERM stops at once
    (KeyboardInterrupt, as Ctrl-C)."""

    def __init__(self, say=None):
        self.requested = False
        self.say = say
        self._old = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.say is not None:
            self.say("SIGTERM: finishing the requests in flight, then stopping (send it again to stop now)")

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        import signal

        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        return False


def _decode(llm, progs: SlotPrograms, todo, B: int, out: ResultFile, summary: JobSummary, spec, max_steps, progress,
            err, stop: GracefulStop | None = None) -> None:
    """The host loop: collect finished slots, write them, refill free slots, advance the batch. With `stop`
    requested (SIGTERM), no new request starts and the loop returns when the running ones are written."""
    stop = stop or GracefulStop()
    import jax

    from specjax import engine

    P, n_stop = progs.bB.prompt_len, progs.bB.num_stop
    slots: list[Request | None] = [None] * B
    started = [0.0] * B
    filler = todo[0].sampling  # sampling values of free slots (never used: free slots are finished)
    slot_sampling = [filler] * B
    slot_prompts = [todo[0].token_ids] * B
    V = llm.config.vocab_size
    # Every slot's arrays carry the optional filters if any request left uses them: rows change, programs don't.
    opts = uses_options([r.sampling for r in todo])
    sampling = sampling_arrays(llm.tokenizer, slot_sampling, B, n_stop, slot_prompts, V, opts)
    state = progs.empty(sampling)
    bar = _progress_bar(len(todo), err) if progress else None
    dec = progs.variant.dec
    t0 = time.perf_counter()
    try:
        while True:
            finish = np.asarray(dec(state).finish)
            done = [s for s in range(B) if slots[s] is not None and finish[s] != engine.FINISH_RUNNING]
            if done:
                host = jax.device_get((dec(state).out_tokens, dec(state).num_new,
                                       None if progs.drafter is None else state.stats))
                now = time.perf_counter()
                for s in done:
                    out.write(_record(llm, slots[s], s, host, finish[s], now - started[s], spec, summary))
                    slots[s] = None
                    summary.completed += 1
                if bar is not None:
                    bar.update(len(done))
                    post = {"tok/s": f"{summary.new_tokens / max(now - t0, 1e-9):.1f}"}
                    if summary.speculative:
                        post["acc"] = f"{summary.acceptance_rate:.2f}"
                    bar.set_postfix(post, refresh=True)
            free = [s for s in range(B) if slots[s] is None]
            if stop.requested:
                # SIGTERM: admit nothing new, finish what runs, then return (the rest is resumable).
                todo.clear()
                summary.stopped = True
            if todo and free:
                for s in free[:len(todo)]:
                    r = todo.popleft()
                    tokens, lens, active = pad_prompts([r.token_ids], 1, P)
                    row = progs.prefill(tokens, lens, active, sampling_arrays(llm.tokenizer, [r.sampling], 1, n_stop,
                                                                              [r.token_ids], V, opts))
                    state = progs.insert(state, row, s)
                    slots[s], started[s], slot_sampling[s], slot_prompts[s] = r, time.perf_counter(), r.sampling, \
                        r.token_ids
                sampling = sampling_arrays(llm.tokenizer, slot_sampling, B, n_stop, slot_prompts, V, opts)
                continue  # a request can finish at prefill (one token, or a stop token first): collect it
            if all(r is None for r in slots):
                return
            state = progs.advance(state, sampling, max_steps)
    finally:
        if bar is not None:
            bar.close()


def _record(llm, req: Request, s: int, host, finish, seconds: float, spec, summary: JobSummary) -> dict:
    out_tokens, num_new, stats = host
    ids = [int(t) for t in out_tokens[s, :int(num_new[s])]]
    metrics = {"prompt_tokens": len(req.token_ids), "new_tokens": len(ids), "time_s": round(seconds, 4)}
    summary.new_tokens += len(ids)
    if stats is not None:
        from specjax.requests import spec_metrics

        m = spec_metrics(stats, s, None, None, spec.is_lossy)
        metrics.update(drafted=m["drafted"], accepted=m["accepted"], acceptance_rate=round(m["acceptance_rate"], 4),
                       tau=round(m["mean_accepted_length"], 4),
                       tokens_per_forward=round(m["tokens_per_forward"], 4), verify_steps=m["verify_steps"],
                       plain_steps=int(stats.plain_steps[s]))
        if m["lossy"]:
            metrics["lossy"] = True
        summary.drafted += m["drafted"]
        summary.accepted += m["accepted"]
        summary.verify_steps += m["verify_steps"]
        summary.plain_steps += int(stats.plain_steps[s])
    record = {"id": req.id, "text": llm.tokenizer.decode(ids), "token_ids": ids,
              "finish_reason": finish_name(finish), "metrics": metrics}
    if finish_name(finish) == "error":
        record["error"] = ("the model produced NaN or infinite logits; this request stopped without sampling from "
                           "them (a corrupt checkpoint, or a dtype that overflows)")
    return record


def _progress_bar(total: int, err):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: without it only the summary is printed
        return None
    return tqdm(total=total, desc="batch", unit="req", file=err, dynamic_ncols=True)
