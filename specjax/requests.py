"""Requests in and results out, below every runner: normalise and encode prompts, check each request against the
context before anything compiles, stop ids and sampling arrays, padding, and the RequestOutput of a finished row.

Pure functions of what they need (tokenizer, vocabulary size, context length); none takes the LLM.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from specjax.config import SamplingParams
from specjax.engine import FINISH_LENGTH, FINISH_STOP
from specjax.errors import SpecjaxError
from specjax.sampling import SamplingArrays

FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}

PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]]


class RequestError(SpecjaxError, ValueError):
    """A request cannot be served as given; the message says which one and how to fix it."""


@dataclasses.dataclass
class RequestMetrics:
    prompt_tokens: int
    new_tokens: int
    time_to_first_token: float  # seconds: prefill + first token of the batch this request ran in
    total_time: float  # seconds, end to end for the batch
    tokens_per_s: float  # new_tokens / total_time
    # Speculative decoding only (None for plain decoding):
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None  # alpha = accepted / drafted
    mean_accepted_length: float | None = None  # tau = 1 + accepted / verify steps (`tau`); plain steps not counted
    tokens_per_forward: float | None = None  # (accepted + forwards) / forwards after prefill; plain steps counted
    verify_steps: int | None = None
    target_forwards: int | None = None  # prefill + verify steps + plain steps
    per_position_acceptance: list[float] | None = None  # accepted / drafted at depth 1, 2, ...
    per_position_accepted: list[int] | None = None
    per_position_drafted: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    lossy: bool = False


@dataclasses.dataclass
class RequestOutput:
    prompt: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    metrics: RequestMetrics


# ------------------------------------------------------------------------------------------------ input


def normalise(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """(prompts as a list, one SamplingParams per prompt) from what `LLM.generate` accepts."""
    if not isinstance(prompts, (str, Sequence)):
        raise RequestError(f"prompts must be a string, a list of token ids, chat messages, or a list of those; "
                           f"got {type(prompts).__name__}")
    single = isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (Mapping, int, np.integer)))
    prompts = [prompts] if single else list(prompts)
    if not prompts:
        raise RequestError("no prompts given")
    if sampling_params is None or isinstance(sampling_params, (SamplingParams, Mapping)):
        params = [SamplingParams.from_user(sampling_params)] * len(prompts)
    else:
        params = [SamplingParams.from_user(p) for p in sampling_params]
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
    return prompts, params


def encode_prompt(tokenizer, vocab_size: int, prompt: PromptLike, chat: bool | None) -> list[int]:
    """Token ids of one prompt: text (wrapped in the chat template when `chat`), chat messages, or token ids
    (checked against the vocabulary [0, vocab_size))."""
    if isinstance(prompt, str):
        if chat:
            return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        return tokenizer.encode(prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return tokenizer.encode(tokenizer.apply_chat_template(list(prompt)))
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return ids
    raise RequestError(
        "a prompt must be a non-empty string, a list of token ids, or a list of chat messages "
        f"({{'role': ..., 'content': ...}}); got {type(prompt).__name__} {str(prompt)[:40]!r}"
    )


def check_request(i, ids: list[int], sp: SamplingParams, extra: int, max_context: int) -> None:
    """Raise RequestError unless request `i` (prompt `ids`, `sp.max_new_tokens` new tokens and `extra`
    speculative KV slots) fits a context of `max_context` tokens."""
    if not ids:
        raise RequestError(f"prompt {i} is empty after tokenization")
    need = len(ids) + sp.max_new_tokens + extra
    if len(ids) >= max_context:
        raise RequestError(
            f"prompt {i} has {len(ids)} tokens, more than the context of {max_context}; shorten it")
    if extra and len(ids) + 1 + extra > max_context:
        raise RequestError(
            f"prompt {i}: {len(ids)} prompt tokens + {extra} speculative slots leave no room for a new token "
            f"in the context of {max_context}; lower num_speculative_tokens (or the tree size) to at most "
            f"{max(0, max_context - len(ids) - 2)}, or raise max_context")
    if need > max_context:
        raise RequestError(
            f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {sp.max_new_tokens}"
            + (f" + {extra} speculative slots" if extra else "")
            + f" = {need} exceeds the context of {max_context}; lower max_new_tokens to "
            f"{max(0, max_context - len(ids) - extra)} or less")


def check_requests(ids: list[list[int]], params: list[SamplingParams], extra: int, max_context: int) -> None:
    """`check_request` for every request, numbered from 0."""
    for i, (t, sp) in enumerate(zip(ids, params)):
        check_request(i, t, sp, extra, max_context)


# ------------------------------------------------------------------------------------------------ arrays


def stop_ids(tokenizer, sp: SamplingParams) -> list[int]:
    """The request's stop ids: its own plus the tokenizer's end tokens unless ignore_eos."""
    ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(tokenizer.stop_token_ids))
    return list(dict.fromkeys(ids))


def num_stop(tokenizer, params: list[SamplingParams]) -> int:
    """The most stop ids any of the requests has."""
    return max(len(stop_ids(tokenizer, p)) for p in params)


def sampling_arrays(tokenizer, params: list[SamplingParams], batch: int, num_stop: int) -> SamplingArrays:
    """The per-request sampling values as [batch] arrays (stop ids [batch, num_stop], -1 padded); rows past
    len(params) repeat the last request's values."""
    params = list(params) + [params[-1]] * (batch - len(params))

    def stops(sp: SamplingParams) -> list[int]:
        ids = stop_ids(tokenizer, sp)
        if len(ids) > num_stop:
            raise RequestError(f"{len(ids)} stop token ids do not fit the {num_stop} slots of this bucket")
        return ids + [-1] * (num_stop - len(ids))

    # NumPy then one device_put: jnp.asarray would compile small conversion programs per new shape.
    return jax.device_put(SamplingArrays(
        temperature=np.asarray([p.temperature for p in params], np.float32),
        top_k=np.asarray([p.top_k for p in params], np.int32),
        top_p=np.asarray([p.top_p for p in params], np.float32),
        seed=np.asarray([p.seed % (2 ** 32) for p in params], np.uint32),
        max_new_tokens=np.asarray([p.max_new_tokens for p in params], np.int32),
        stop_ids=np.asarray([stops(p) for p in params], np.int32),
    ))


def pad_prompts(ids: list[list[int]], batch: int, length: int):
    """Right-pad token lists into [batch, length] int32, with lengths [batch] and active [batch] bool."""
    tokens = np.zeros((batch, length), np.int32)
    lens = np.ones((batch,), np.int32)
    active = np.zeros((batch,), bool)
    for i, t in enumerate(ids):
        tokens[i, :len(t)] = t
        lens[i] = len(t)
        active[i] = True
    return jax.device_put((tokens, lens, active))


# ------------------------------------------------------------------------------------------------ output


def finish_name(finish) -> str:
    """"stop" or "length" for an engine FINISH_* code."""
    return FINISH_NAMES.get(int(finish), "length")


def build_output(tokenizer, prompt, prompt_ids, new_ids, finish, ttft: float, total: float,
                 **spec: Any) -> RequestOutput:
    """The RequestOutput of one finished row: new_ids the emitted tokens, finish its FINISH_* code, ttft/total
    seconds of its batch; `spec` the speculative metrics (`spec_metrics`)."""
    new_ids = [int(t) for t in new_ids]
    metrics = RequestMetrics(
        prompt_tokens=len(prompt_ids), new_tokens=len(new_ids), time_to_first_token=ttft, total_time=total,
        tokens_per_s=len(new_ids) / total if total > 0 else float("nan"), **spec)
    return RequestOutput(prompt, list(prompt_ids), new_ids, tokenizer.decode(new_ids), finish_name(finish), metrics)


def _tokens_per_step(accepted: float, steps: int) -> float:
    """1 + accepted / steps: every target forward yields one token of its own plus the drafts it accepted; 1.0
    when there was no step. The two metrics below differ only in which steps they count."""
    return 1.0 + accepted / steps if steps > 0 else 1.0


def tau(accepted: float, verify_steps: int) -> float:
    """Mean accepted length: tokens per verify step, 1 + accepted / verify_steps (Leviathan et al. 2023, vLLM);
    1.0 when there was no verify step. Plain (backed-off) steps are not verify steps and do not count, so tau
    measures the drafter, not the speed: 4 accepted in 1 verify step is 5.0 however many plain steps followed."""
    return _tokens_per_step(accepted, verify_steps)


def tokens_per_forward(accepted: float, forwards: int) -> float:
    """New tokens per decoding target forward, prefill excluded: (accepted + forwards) / forwards, where forwards
    counts verify and plain steps alike; 1.0 when there was none. This is the figure that bounds the speedup:
    4 accepted over 1 verify + 26 plain steps is 31 / 27."""
    return _tokens_per_step(accepted, forwards)


def spec_metrics(stats, i: int, draft_time, verify_time, lossy: bool) -> dict:
    """The speculative RequestMetrics fields of row `i` from SpecStats (host or device arrays)."""
    steps = int(stats.verify_steps[i])
    plain = int(stats.plain_steps[i])
    drafted = int(stats.drafted[i])
    accepted = int(stats.accepted[i])
    pd = np.asarray(stats.pos_drafted[i])
    pa = np.asarray(stats.pos_accepted[i])
    return dict(
        drafted=drafted, accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        # a plain step (nothing proposed anywhere in the batch) is a forward but not a verify step
        mean_accepted_length=tau(accepted, steps), tokens_per_forward=tokens_per_forward(accepted, steps + plain),
        verify_steps=steps, target_forwards=steps + plain + 1,
        per_position_acceptance=[float(a / d) if d else 0.0 for a, d in zip(pa, pd)],
        per_position_accepted=[int(a) for a in pa], per_position_drafted=[int(d) for d in pd],
        draft_time=draft_time, verify_time=verify_time, lossy=lossy,
    )
