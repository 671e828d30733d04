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
checks for free slots after every call.

Crash safety: each result is one `write()` of one line, then fsync. On start the output is read back: ids
already there are skipped, and a torn last line (no newline, or not JSON) is cut off before appending. A crash
loses at most the requests in flight. An exclusive lock on the output stops two runs from writing to it.
The input file is only ever read.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import fcntl
import functools
import json
import os
import sys
import time
import types
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from specjax.config import ConfigError, SamplingParams, SpeculativeConfig, merge
from specjax.errors import SpecjaxError

# JAX and the engines are imported where they are used: `specjax --help` builds this module's argument parser and
# should not pay for importing JAX.
_NOT_JSONL_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow", ".xlsx", ".xls", ".pkl", ".pickle")


class BatchError(SpecjaxError, ValueError):
    """The job cannot start: unreadable or non-JSONL input, unwritable output, unsupported method."""


@dataclasses.dataclass
class Request:
    """One valid input line."""

    id: str | int
    key: str  # json.dumps(id): 1 and "1" are different ids, as in the file
    line: int  # 1-based line number in the input
    prompt: Any  # text, token ids, or chat messages
    is_chat: bool  # prompt came from `messages`
    sampling: SamplingParams
    token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class JobSummary:
    """What a `run_job` call did. Token counts and timings cover this run only (not earlier, resumed runs)."""

    requests: int = 0  # valid requests in the input
    already_done: int = 0  # found in the output and skipped
    completed: int = 0  # finished and written by this run
    skipped_lines: int = 0  # bad input lines (reported on stderr)
    new_tokens: int = 0
    wall_time: float = 0.0  # seconds, compilation included
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    speculative: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per target forward after prefill: (accepted + forwards) / forwards."""
        fwd = self.verify_steps + self.plain_steps
        return (self.accepted + fwd) / fwd if fwd else 1.0

    def format(self) -> str:
        parts = [f"{self.completed} requests done ({self.already_done} already in the output, "
                 f"{self.skipped_lines} bad input lines skipped)",
                 f"{self.new_tokens} tokens in {self.wall_time:.1f} s = {self.tokens_per_s:.1f} tok/s"]
        if self.speculative:
            parts.append(f"acceptance {self.acceptance_rate:.3f}, tau {self.tau:.2f}")
        return "; ".join(parts)


# ----------------------------------------------------------------------------------------------------- input


def check_input(path: str) -> None:
    """Raise BatchError unless `path` is a readable JSONL file: at least one line must be a JSON object, and the
    file must not be a JSON array, a CSV or another table format. Reads only up to the first object line."""
    if not os.path.exists(path):
        raise BatchError(f"input {path!r} does not exist")
    if os.path.isdir(path):
        raise BatchError(f"input {path!r} is a directory; give a .jsonl file")
    if path.lower().endswith(_NOT_JSONL_SUFFIXES):
        raise BatchError(f"input {path!r}: unsupported format {os.path.splitext(path)[1]!r}; write JSONL, one "
                         '{"id": ..., "prompt": ...} object per line')
    try:
        with open(path, "rb") as f:
            first = None
            for raw in f:
                text = raw.strip()
                if not text:
                    continue
                if first is None:
                    first = text
                    if text.startswith(b"["):
                        raise BatchError(f"input {path!r} is a JSON array; write JSONL instead: one object per line "
                                         "(e.g. jq -c '.[]' in.json > in.jsonl)")
                try:
                    if isinstance(json.loads(text), dict):
                        return
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass
    except OSError as e:
        raise BatchError(f"cannot read input {path!r}: {e.strerror}") from None
    if first is not None:
        raise BatchError(f"input {path!r} is not JSONL: no line is a JSON object; write one "
                         '{"id": ..., "prompt": ...} object per line')


def read_requests(path: str, defaults: SamplingParams, report: Callable[[int, str], None],
                  prepare: Callable[[Request], None] | None = None) -> tuple[list[Request], int]:
    """Parse the input JSONL into requests; every bad line is reported as report(line_number, message) and
    skipped, in line order. Returns (requests, number of bad lines).

    prepare(request): further per-request work (tokenization, context checks) that raises ValueError for a bad
    request; its message is reported like a parse error.

    A line without `seed` in its sampling gets a seed derived from the job's seed and its id, so repeated prompts
    under different ids sample independently and a resumed job draws exactly the same tokens.
    """
    with open(path, "rb") as f:
        data = f.read()
    requests: list[Request] = []
    seen: dict[str, int] = {}
    bad = 0
    # Split on b"\n" only: str.splitlines would also split inside JSON strings holding U+2028 and friends.
    for n, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        problem, req = _parse_line(raw, n, defaults, seen)
        if req is not None and prepare is not None:
            try:
                prepare(req)
            except ValueError as e:
                problem = f"{e}; skipped"
        if problem:
            report(n, problem)
            bad += 1
        else:
            requests.append(req)
    return requests, bad


def _parse_line(raw: bytes, n: int, defaults: SamplingParams, seen: dict[str, int]):
    """(problem, None) or (None, Request) for one non-blank input line."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text; skipped", None
    except json.JSONDecodeError as e:
        return f"malformed JSON ({e.msg} at column {e.colno}); skipped", None
    if not isinstance(obj, dict):
        return f"expected a JSON object, got a {type(obj).__name__}; skipped", None
    if "id" not in obj:
        return "missing 'id'; every line needs a unique string or integer id; skipped", None
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return f"'id' must be a string or an integer, got {json.dumps(rid)}; skipped", None
    key = json.dumps(rid)
    if key in seen:
        return f"duplicate id {key} (first used on line {seen[key]}); skipped", None
    seen[key] = n
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return ("needs exactly one of 'prompt' (text) and 'messages' (chat list)" +
                ("; it has both" if has_prompt else "") + "; skipped"), None
    prompt = obj["prompt"] if has_prompt else obj["messages"]
    if has_prompt and not (isinstance(prompt, str) and prompt or _is_token_list(prompt)):
        return "'prompt' must be non-empty text or a list of token ids; skipped", None
    if has_messages and not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects; skipped", None
    user = obj.get("sampling")
    if user is None:
        user = {}
    if not isinstance(user, dict):
        return f"'sampling' must be an object of sampling fields, got a {type(user).__name__}; skipped", None
    try:
        sp = merge(defaults, user)
    except ConfigError as e:
        return f"{e.under('sampling')}; skipped", None
    if "seed" not in user:
        sp = dataclasses.replace(sp, seed=zlib.crc32(f"{defaults.seed}:{key}".encode()) & 0x7FFFFFFF)
    return None, Request(rid, key, n, prompt, has_messages, sp)


def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


# ----------------------------------------------------------------------------------------------------- output


class ResultFile:
    """The output JSONL, opened for appending under an exclusive lock, with a torn last line repaired.

    `done` holds the keys (json.dumps(id)) of the results already in the file.
    """

    def __init__(self, path: str, note: Callable[[str], None] = lambda msg: None):
        self.path = path
        self.fd = open_output(path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise BatchError(f"output {path!r} is being written by another running job; wait for it or pick "
                             "another output file") from None
        try:
            self.done = self._repair(note)
        except BaseException:
            self.close()
            raise

    def _repair(self, note) -> set[str]:
        size = os.fstat(self.fd).st_size
        data = os.pread(self.fd, size, 0) if size else b""
        keep = data.rfind(b"\n") + 1  # bytes of newline-terminated lines
        lines = data[:keep].split(b"\n")[:-1]
        done: set[str] = set()
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            obj = _result_object(line)
            if obj is None:
                if n == len(lines):  # a torn final write that happened to end in a newline byte
                    keep -= len(line) + 1
                    break
                raise BatchError(f"output {self.path!r} line {n} is not a result line of specjax batch; remove it "
                                 "or choose another output file")
            done.add(json.dumps(obj["id"]))
        if keep < size:
            os.ftruncate(self.fd, keep)
            os.fsync(self.fd)
            note(f"output {self.path!r}: removed an incomplete last line ({size - keep} bytes) left by an "
                 "interrupted run")
        return done

    def write(self, record: dict) -> None:
        """Append one result as one line: a single write() (looped only if the OS writes less), then fsync."""
        data = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)
        self.done.add(json.dumps(record["id"]))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also releases the lock
            self.fd = -1


def _result_object(line: bytes) -> dict | None:
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) and "id" in obj else None


def open_output(path: str) -> int:
    """An O_APPEND file descriptor for `path` (created if missing); BatchError when it cannot be written."""
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except FileNotFoundError:
        raise BatchError(f"cannot write output {path!r}: directory "
                         f"{os.path.dirname(os.path.abspath(path))!r} does not exist; create it first") from None
    except IsADirectoryError:
        raise BatchError(f"output {path!r} is a directory; give a file path such as {path.rstrip('/')}/out.jsonl"
                         ) from None
    except PermissionError:
        raise BatchError(f"cannot write output {path!r}: permission denied; pick a writable location") from None
    except OSError as e:
        raise BatchError(f"cannot write output {path!r}: {e.strerror}") from None


def check_paths(input_path: str, output_path: str) -> None:
    """Everything about the two files that can fail before any work: input readable JSONL, output writable
    (created empty if missing) and not the input itself."""
    check_input(input_path)
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise BatchError(f"output {output_path!r} is the input file; write results to another file")
    os.close(open_output(output_path))


# ----------------------------------------------------------------------------------------------------- device


@functools.cache
def _jitted() -> types.SimpleNamespace:
    """The job's jitted entry points (built once, on first use):

    insert_row(state, row, slot): copy the batch-1 state `row` into row `slot` (traced int32) of the batch state.
        Every leaf of DecodeState / SpecState is batch-first (KV cache [B, Hkv, S, D] per layer, lengths [B],
        output [B, max_new], history [B, Hc], stats [B] / [B, D], drafter caches), so one scatter per leaf moves
        a whole request. `state` is donated: the caches are updated in place.
    decode_until_free(params, config, state, sampling, max_steps, attention_fn): plain decoding of every slot
        until one finishes (or `max_steps`, traced). `state` donated.
    spec_until_free(params, config, dparams, drafter, state, sampling, max_steps, attention_fn, adaptive): the
        same with speculative steps. `state` donated.
    """
    import jax
    import jax.numpy as jnp

    from specjax import engine, spec_engine

    def insert_row(state, row, slot):
        return jax.tree_util.tree_map(lambda a, r: a.at[slot].set(r[0]), state, row)

    def until_free(finish_of, step_fn, state, max_steps):
        # Stop as soon as a running row finishes: the host then refills that slot (and writes its result) at
        # the earliest step, instead of letting it idle until a fixed chunk of steps ends.
        count = lambda st: jnp.sum(finish_of(st) == engine.FINISH_RUNNING)
        start = count(state)

        def cond(carry):
            st, i = carry
            n = count(st)
            return (n == start) & (n > 0) & (i < max_steps)

        def body(carry):
            st, i = carry
            return step_fn(st), i + 1

        return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))[0]

    def decode_until_free(params, config, state, sampling, max_steps, attention_fn=None):
        step = lambda st: engine.decode_step(params, config, st, sampling, attention_fn)
        return until_free(lambda st: st.finish, step, state, max_steps)

    def spec_until_free(params, config, dparams, drafter, state, sampling, max_steps, attention_fn=None,
                        adaptive=None):
        step = lambda st: spec_engine.spec_step(params, config, dparams, drafter, st, sampling, attention_fn,
                                                adaptive=adaptive)
        return until_free(lambda st: st.dec.finish, step, state, max_steps)

    return types.SimpleNamespace(
        insert_row=jax.jit(insert_row, donate_argnames=("state",)),
        decode_until_free=jax.jit(decode_until_free, static_argnames=("config", "attention_fn"),
                                  donate_argnames=("state",)),
        spec_until_free=jax.jit(spec_until_free, static_argnames=("config", "drafter", "attention_fn", "adaptive"),
                                donate_argnames=("state",)),
    )


class _Programs:
    """The three compiled programs of a job on a JAX platform with data-dependent loops (CPU, GPU, TPU).

    prefill(tokens [1, P], lens [1], active [1], sampling [1]) -> batch-1 state (first token emitted)
    empty(sampling [B]) -> batch-B state with every slot finished (free)
    insert(state, row, slot) -> state with the batch-1 `row` in slot `slot`
    advance(state, sampling [B], max_steps) -> state after running until a slot frees up
    """

    def __init__(self, llm, buckets, batch: int, drafter=None, dparams=None, adaptive=None):
        self.llm, self.drafter, self.dparams, self.adaptive = llm, drafter, dparams, adaptive
        self.b1 = dataclasses.replace(buckets, batch=1)
        self.bB = dataclasses.replace(buckets, batch=batch)

    def _prefill(self, buckets, tokens, lens, active, sampling):
        from specjax import engine, spec_engine

        llm = self.llm
        if self.drafter is None:
            return engine.prefill(llm.params, llm.config, buckets, tokens, lens, active, sampling)
        return spec_engine.spec_prefill(llm.params, llm.config, self.dparams, self.drafter, buckets, tokens, lens,
                                        active, sampling)

    def prefill(self, tokens, lens, active, sampling):
        return self._prefill(self.b1, tokens, lens, active, sampling)

    def empty(self, sampling):
        import jax
        import jax.numpy as jnp

        from specjax import engine

        B, P = self.bB.batch, self.bB.prompt_len
        # The batch-B state's structure, without running (or compiling) a batch-B prefill.
        shapes = jax.eval_shape(functools.partial(self._prefill, self.bB), jax.ShapeDtypeStruct((B, P), jnp.int32),
                                jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_), sampling)
        state = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        done = jnp.full((B,), engine.FINISH_LENGTH, jnp.int32)
        if self.drafter is None:
            return state._replace(finish=done)
        return state._replace(dec=state.dec._replace(finish=done))

    def insert(self, state, row, slot: int):
        return _jitted().insert_row(state, row, np.int32(slot))

    def advance(self, state, sampling, max_steps: int):
        llm, steps = self.llm, np.int32(max_steps)
        if self.drafter is None:
            return _jitted().decode_until_free(llm.params, llm.config, state, sampling, steps,
                                               attention_fn=llm._attention_fn)
        return _jitted().spec_until_free(llm.params, llm.config, self.dparams, self.drafter, state, sampling, steps,
                                         attention_fn=llm._attention_fn, adaptive=self.adaptive)


def _neuron_batch(batch: int) -> int:
    from specjax.backends.neuron import NEURON_BATCHES

    fits = [b for b in NEURON_BATCHES if b >= batch]
    if not fits:
        raise BatchError(f"batch size {batch} exceeds the largest Neuron batch bucket ({NEURON_BATCHES[-1]}); "
                         f"use --batch-size {NEURON_BATCHES[-1]} or less")
    return fits[0]


class _NeuronPrograms(_Programs):
    """The same job under the Neuron compile policy: the NeuronRunner's ahead-of-time compiled prefill (batch 1)
    and straight-line fused step (batch B, no cond, no data-dependent loop), and the insert traced under the
    Neuron policy. The host checks for free slots after every fused call."""

    def __init__(self, llm, buckets, batch, drafter=None, dparams=None, steps_per_call: int = 4):
        from specjax.backends import neuron

        self.neuron = neuron
        tree_nodes = 1 if drafter is None else drafter.tree.num_nodes
        b1 = neuron.bucket_for(1, buckets.prompt_len, buckets.max_new, tree_nodes, buckets.num_stop)
        super().__init__(llm, b1, batch, drafter, dparams, None)
        self.runner = neuron.runner_for(llm, drafter, dparams, steps_per_call)
        self.runner.warmup([self.b1, self.bB])

    def prefill(self, tokens, lens, active, sampling):
        return self.runner.prefill(self.b1, tokens, lens, active, sampling)

    def empty(self, sampling):
        with self.neuron.neuron_tracing(self.runner.policy):
            return super().empty(sampling)

    def insert(self, state, row, slot: int):
        with self.neuron.neuron_tracing(self.runner.policy):
            return _jitted().insert_row(state, row, np.int32(slot))

    def advance(self, state, sampling, max_steps: int):
        return self.runner.step(self.bB, state, sampling)


# ----------------------------------------------------------------------------------------------------- the job


def run_job(llm, input_path: str, output_path: str, *, sampling: SamplingParams | dict | None = None,
            speculative: SpeculativeConfig | dict | None = None, batch_size: int = 8, chat: bool = False,
            max_steps: int = 32, progress: bool = True, err=None) -> JobSummary:
    """Generate for every request of `input_path` not yet in `output_path`, appending one line per result.

    llm: a specjax.api.LLM (or an object with the same attributes).
    sampling: the job's default SamplingParams; a line's `sampling` object overrides fields of it.
    speculative: None (plain decoding) or a SpeculativeConfig/dict with a device drafter (ngram, draft_model).
    batch_size: slots decoded together (B); finished slots are refilled with new requests.
    chat: wrap plain-text `prompt`s in the model's chat template (`messages` always are).
    max_steps: decode steps between host check-ins at most (the loop returns earlier when a slot finishes).
    progress: show a tqdm progress bar on `err`.
    err: stream for problems, progress and the summary (default sys.stderr).
    Raises BatchError before any work when the files or the method cannot be used; bad lines only warn.
    """
    from specjax import engine
    from specjax.runners import speculative as spec_api

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
    if spec.enabled:
        drafter, dparams = spec_api.build_drafter(llm, spec)
        if getattr(drafter, "host_side", False):
            raise BatchError(f"speculative method {spec.method!r} drafts on the host and cannot run inside the "
                             "batch decode loop; use 'ngram' or 'draft_model'")
        adaptive = spec_api.adaptive_rule(drafter, spec)
        extra = drafter.tree.num_nodes

    summary = JobSummary(speculative=spec.enabled)
    out = ResultFile(output_path, say)
    try:
        def prepare(r: Request) -> None:  # RequestError / TokenizerError (ValueErrors) are reported by the reader
            r.token_ids = llm.encode_prompt(r.prompt, True if r.is_chat else chat)
            llm._check(r.key, r.token_ids, r.sampling, extra)

        valid, summary.skipped_lines = read_requests(
            input_path, defaults, lambda n, msg: say(f"{input_path}:{n}: {msg}"), prepare)
        summary.requests = len(valid)
        todo = collections.deque(r for r in valid if r.key not in out.done)
        summary.already_done = len(valid) - len(todo)
        if not todo:
            summary.wall_time = time.perf_counter() - t_start
            say(summary.format())
            return summary
        # Buckets from every valid request, finished ones included: a resumed job compiles the same shapes as
        # the first run, so its outputs are bit-identical to an uninterrupted run.
        stops = lambda sp: len(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(llm.tokenizer.stop_token_ids)))
        buckets = engine.make_buckets(1, max(len(r.token_ids) for r in valid),
                                      max(r.sampling.max_new_tokens for r in valid), extra_slots=extra,
                                      num_stop=max(stops(r.sampling) for r in valid))
        # B from every valid request too (not only those left), for the same reason.
        B = min(batch_size, len(valid))
        if getattr(llm, "backend", None) == "neuron":
            progs = _NeuronPrograms(llm, buckets, _neuron_batch(B), drafter, dparams)
        else:
            progs = _Programs(llm, buckets, B, drafter, dparams, adaptive)
        _decode(llm, progs, todo, progs.bB.batch, out, summary, spec, max_steps, progress, err)
    finally:
        out.close()
        summary.wall_time = time.perf_counter() - t_start
    say(summary.format())
    return summary


def _decode(llm, progs: _Programs, todo, B: int, out: ResultFile, summary: JobSummary, spec, max_steps, progress,
            err) -> None:
    """The host loop: collect finished slots, write them, refill free slots, advance the batch."""
    import jax

    from specjax import engine
    from specjax.api import pad_prompts

    P, num_stop = progs.bB.prompt_len, progs.bB.num_stop
    slots: list[Request | None] = [None] * B
    started = [0.0] * B
    filler = todo[0].sampling  # sampling values of free slots (never used: free slots are finished)
    slot_sampling = [filler] * B
    sampling = llm.sampling_arrays(slot_sampling, B, num_stop)
    state = progs.empty(sampling)
    bar = _progress_bar(len(todo), err) if progress else None
    dec = (lambda st: st) if progs.drafter is None else (lambda st: st.dec)
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
            if todo and free:
                for s in free[:len(todo)]:
                    r = todo.popleft()
                    tokens, lens, active = pad_prompts([r.token_ids], 1, P)
                    row = progs.prefill(tokens, lens, active, llm.sampling_arrays([r.sampling], 1, num_stop))
                    state = progs.insert(state, row, s)
                    slots[s], started[s], slot_sampling[s] = r, time.perf_counter(), r.sampling
                sampling = llm.sampling_arrays(slot_sampling, B, num_stop)
                continue  # a request can finish at prefill (one token, or a stop token first): collect it
            if all(r is None for r in slots):
                return
            state = progs.advance(state, sampling, max_steps)
    finally:
        if bar is not None:
            bar.close()


def _record(llm, req: Request, s: int, host, finish, seconds: float, spec, summary: JobSummary) -> dict:
    from specjax.api import FINISH_NAMES

    out_tokens, num_new, stats = host
    ids = [int(t) for t in out_tokens[s, :int(num_new[s])]]
    metrics = {"prompt_tokens": len(req.token_ids), "new_tokens": len(ids), "time_s": round(seconds, 4)}
    summary.new_tokens += len(ids)
    if stats is not None:
        from specjax.runners import speculative as spec_api

        m = spec_api.spec_metrics(stats, s, None, None, spec.is_lossy)
        metrics.update(drafted=m["drafted"], accepted=m["accepted"], acceptance_rate=round(m["acceptance_rate"], 4),
                       tau=round(m["mean_accepted_length"], 4), verify_steps=m["verify_steps"],
                       plain_steps=int(stats.plain_steps[s]))
        if m["lossy"]:
            metrics["lossy"] = True
        summary.drafted += m["drafted"]
        summary.accepted += m["accepted"]
        summary.verify_steps += m["verify_steps"]
        summary.plain_steps += int(stats.plain_steps[s])
    return {"id": req.id, "text": llm.tokenizer.decode(ids), "token_ids": ids,
            "finish_reason": FINISH_NAMES.get(int(finish), "length"), "metrics": metrics}


def _progress_bar(total: int, err):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: without it only the summary is printed
        return None
    return tqdm(total=total, desc="batch", unit="req", file=err, dynamic_ncols=True)
