"""`specjax batch`: offline generation over a JSONL file with continuous batching; resumable and crash-safe.

Input, one JSON object per line (other keys are ignored):

    {"id": "q1", "prompt": "Translate to French: cheese", "sampling": {"temperature": 0.7, "max_tokens": 64}}
    {"id": 2, "messages": [{"role": "user", "content": "Hi"}]}

`id` (string or integer) is required and unique; `prompt` is raw text (or a list of token ids), `messages` a chat
conversation rendered with the model's chat template; `sampling` holds SamplingParams fields laid over the job's
defaults. Output: one line per finished request, in completion order:

    {"id": "q1", "text": ..., "token_ids": [...], "finish_reason": "stop", "metrics": {...}}

Continuous batching: the job is a scheduler over the continuous-batching engine (`runners.serving`, the
loop the server runs too), driven on this thread: it reads the input, keeps at most B requests in the engine,
writes each result as it finishes and refills the slot with the next request. Every shape is fixed for the whole
job (prompt bucket from the longest prompt of the input file, output bucket from its largest max_new_tokens), so a
job compiles the engine's programs (prefill, insert, loop) once and never again, whatever the mix of requests.
With backend 'neuron' the loop is the NeuronRunner's straight-line fused step (`serving.programs`). The files are
`runners.batch_io`. A line's `stop` strings end its output as in `LLM.generate`; `n` and `logprobs` are ignored
(one sample per line).

Crash safety: each result is one `write()` of one line, then fsync. On start the output is read back: ids
already there are skipped, and a torn last line (no newline, or not JSON) is cut off before appending. A crash
loses at most the requests in flight. An exclusive lock on the output stops two runs from writing to it.
The input file is only ever read. SIGTERM drains: no new request starts, the running ones are written, the job
returns (`JobSummary.stopped`); a second SIGTERM stops at once. A write that fails (a full disk, a file-size
limit) is cut back to the last whole line and ends the job with a BatchError; a rerun resumes.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time

import numpy as np

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.requests import RequestError, check_request, encode_prompt, num_stop, uses_options
from specjax.runners.batch_io import BatchError, JobSummary, Request, ResultFile, check_paths, read_requests

# JAX and the engines are imported where they are used: `specjax --help` builds the batch command's argument
# parser and should not pay for importing JAX.


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
    extra = 0
    # A model on a device mesh runs every program under it (`LLM.on_mesh`); the slots spread over its data axis.
    on_mesh = llm.on_mesh
    if spec.enabled:
        with on_mesh():
            drafter, _ = drafter_for(llm, spec)  # built once per LLM: the engine reuses it
        if drafter.capabilities.host_side:
            raise BatchError(f"speculative method {spec.method!r} drafts on the host and cannot run inside the "
                             "batch decode loop; use 'ngram' or 'draft_model'")
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
        # Shapes from every valid request, finished ones included: a resumed job compiles the same shapes as the
        # first run, so its outputs are bit-identical to an uninterrupted run (sampled speculative jobs only with
        # adaptive: false: the back-off's measured break-even decides which steps verify, and with it which random
        # numbers a sampled step draws). B from every valid request too (not only those left), for the same reason.
        from specjax.runners.serving import EngineOptions, ServingEngine

        options = EngineOptions(max_batch=min(batch_size, len(valid)),
                                max_prompt_tokens=max(len(r.token_ids) for r in valid),
                                max_tokens=max(r.sampling.max_new_tokens for r in valid), max_queue=len(todo),
                                step_chunk=max_steps, max_stop_ids=max(1, num_stop(llm.tokenizer, [r.sampling for r in valid])),
                                all_options=uses_options([r.sampling for r in todo]), context_per_request=True)
        try:
            engine = ServingEngine(llm, spec if spec.enabled else None, options)
        except RequestError as e:
            raise BatchError(str(e)) from None
        with on_mesh():
            from specjax.runners.base import check_memory

            check_memory(llm, engine.progs.bB, engine.progs.variant, "this batch job")
        engine.start(warmup=False, thread=False)
        try:
            with GracefulStop(say) as stop:
                _schedule(llm, engine, todo, out, summary, progress, err, stop, say)
        finally:
            engine.shutdown()
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


def _schedule(llm, engine, todo, out: ResultFile, summary: JobSummary, progress, err, stop: GracefulStop,
              say) -> None:
    """Feed `todo` to the engine, at most its B slots' worth at a time, and write each result as it finishes,
    before its slot takes the next request (so a crash or a SIGTERM leaves at most B requests unwritten). With
    `stop` requested (SIGTERM), no new request starts and this returns once the running ones are written."""
    from specjax.runners.serving import Failed

    ended: list = []
    in_engine = 0
    bar = _progress_bar(len(todo), err) if progress else None
    t0 = time.perf_counter()
    try:
        while True:
            if stop.requested:
                # SIGTERM: admit nothing new, finish what runs, then return (the rest is resumable).
                todo.clear()
                summary.stopped = True
            while todo and in_engine < engine.batch:
                r = todo.popleft()
                # One sample per line, as the job always wrote (n and logprobs are not part of a result line).
                sp = dataclasses.replace(r.sampling, n=1, logprobs=None)
                engine.submit(r.token_ids, sp, lambda ev, r=r: ended.append((r, ev)),
                              request_id=str(r.id), stream=False)
                in_engine += 1
            if not in_engine:
                return
            engine.step()
            for r, ev in ended:
                in_engine -= 1
                if isinstance(ev, Failed):  # not written: a rerun tries it again
                    summary.failed += 1
                    say(f"id {r.key}: {ev.message}; not written (a rerun tries it again)")
                    continue
                out.write(_record(r, ev.result, summary))
                summary.completed += 1
            if ended and bar is not None:
                bar.update(len(ended))
                post = {"tok/s": f"{summary.new_tokens / max(time.perf_counter() - t0, 1e-9):.1f}"}
                if summary.speculative:
                    post["acc"] = f"{summary.acceptance_rate:.2f}"
                bar.set_postfix(post, refresh=True)
            ended.clear()
    finally:
        if bar is not None:
            bar.close()


def _record(req: Request, res, summary: JobSummary) -> dict:
    """The output line of a finished request (`serving.Result`)."""
    metrics = {"prompt_tokens": res.prompt_tokens, "new_tokens": res.completion_tokens,
               "time_s": round(res.e2e_latency - res.queue_time, 4)}
    summary.new_tokens += res.completion_tokens
    m = res.spec
    if m is not None:
        plain = m["target_forwards"] - m["verify_steps"] - 1  # forwards = verify + plain + the prefill
        metrics.update(drafted=m["drafted"], accepted=m["accepted"], acceptance_rate=round(m["acceptance_rate"], 4),
                       tau=round(m["mean_accepted_length"], 4),
                       tokens_per_forward=round(m["tokens_per_forward"], 4), verify_steps=m["verify_steps"],
                       plain_steps=plain)
        if m["lossy"]:
            metrics["lossy"] = True
        summary.drafted += m["drafted"]
        summary.accepted += m["accepted"]
        summary.verify_steps += m["verify_steps"]
        summary.plain_steps += plain
    record = {"id": req.id, "text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
              "metrics": metrics}
    if res.finish_reason == "error":
        record["error"] = ("the model produced NaN or infinite logits; this request stopped without sampling from "
                           "them (a corrupt checkpoint, or a dtype that overflows)")
    return record


def _progress_bar(total: int, err):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: without it only the summary is printed
        return None
    return tqdm(total=total, desc="batch", unit="req", file=err, dynamic_ncols=True)
