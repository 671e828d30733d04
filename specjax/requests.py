"""Requests in and results out, below every runner: normalise and encode prompts, check each request against the
context before anything compiles, stop ids and sampling arrays, padding, and the RequestOutput of a finished row.

Host-side sampling options live here too, as pure functions: one row per sample (`expand_samples`: `n`, fresh
seeds), stop strings (`stop_scan` / `safe_prefix_len` for streams, `truncate_at_stop` for a finished row) and
the vLLM-shaped outputs (`CompletionOutput`, `RequestOutput.outputs`).

Pure functions of what they need (tokenizer, vocabulary size, context length); none takes the LLM.
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from specjax.config import SamplingParams
from specjax.engine import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from specjax.errors import SpecjaxError
from specjax.models.tokenizer import lone_surrogate
from specjax.sampling import SamplingArrays

FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}

PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]] | Mapping[str, Any]


class RequestError(SpecjaxError, ValueError):
    """A request cannot be served as given; the message says which one and how to fix it."""


@dataclasses.dataclass
class RequestMetrics:
    prompt_tokens: int
    new_tokens: int
    time_to_first_token: float  # seconds: prefill + first token of the batch this request ran in
    total_time: float  # seconds from the batch's start to this request's last token (`runners.base.row_times`)
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
    # Seconds of the call XLA spent compiling programs (or reading them from the persistent cache), included in
    # time_to_first_token / total_time; 0 once the shapes are warm (`specjax.compile_time`).
    compile_time: float = 0.0


@dataclasses.dataclass
class Logprob:
    """One entry of `CompletionOutput.logprobs` (vLLM's shape): the token's log-probability under the processed
    distribution, its rank in it (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput).

    index: the sample's number among the request's n. token_ids: the emitted tokens (with stop strings, up to
    and including the one that completed the first stop string); text: their text, cut before the stop string.
    cumulative_logprob / logprobs: only when the request asked for logprobs (None otherwise); logprobs holds one
    {token id: Logprob} per emitted token: the emitted token and the k most likely ones. finish_reason: "stop"
    (end token, stop id or stop string), "length", or "error" (the model produced NaN or infinite logits: the
    sample stopped without sampling from them, with a `NonFiniteLogitsWarning`); stop_reason: the stop string or stop token id that ended
    it (None for the tokenizer's end token or a length finish). seed: the seed the sample was drawn with (a
    fresh one when the request's seed was None): passing it back reproduces the sample. metrics: this sample's.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    seed: int | None = None
    metrics: RequestMetrics | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt (vLLM's RequestOutput): `outputs` holds its n samples. text, token_ids and
    finish_reason read the first sample's (the fields of earlier specjax versions); metrics are the first
    sample's when n = 1, all samples' together otherwise (`merge_metrics`)."""

    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    request_id: str = "0"
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


# ------------------------------------------------------------------------------------------------ input


def normalise(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """(prompts as a list, one SamplingParams per prompt) from what `LLM.generate` accepts."""
    if is_prompt_dict(prompts):
        prompts = [prompts]
    _refuse_bytes(prompts)
    if not isinstance(prompts, (str, Sequence)):
        raise RequestError(f"prompts must be a string, a list of token ids, chat messages, or a list of those; "
                           f"got {type(prompts).__name__}")
    single = isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (Mapping, int, np.integer))
        and not is_prompt_dict(prompts[0]))
    prompts = [prompts] if single else list(prompts)
    if not prompts:
        raise RequestError("no prompts given")
    return prompts, per_prompt_params(sampling_params, len(prompts))


def _refuse_bytes(prompt) -> None:
    # bytes are a Sequence of ints: without this check b"Hello" would be read as the token ids 72, 101, ...
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError("a prompt is bytes; decode it to text first (e.g. data.decode('utf-8')), or pass token "
                           "ids as a list of ints")


def check_text(text: str, where: str) -> str:
    """Raise RequestError for text that is not valid Unicode (a lone surrogate, which UTF-8 cannot encode and
    the tokenizer would reject with an internal message); return the text."""
    bad = lone_surrogate(text)
    if bad:
        raise RequestError(f"{where} contains a lone surrogate (U+{ord(bad.group()):04X}) at character "
                           f"{bad.start()}, which is not valid Unicode; fix the text's encoding (e.g. decode with "
                           "errors='replace')")
    return text


def is_prompt_dict(x) -> bool:
    """vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [...]} (not a chat message: no 'role')."""
    return isinstance(x, Mapping) and "role" not in x and ("prompt" in x or "prompt_token_ids" in x)


def per_prompt_params(sampling_params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from None, one SamplingParams or dict for all, or one per prompt."""
    if sampling_params is None or isinstance(sampling_params, (SamplingParams, Mapping)):
        return [SamplingParams.from_user(sampling_params)] * count
    params = [SamplingParams.from_user(p) for p in sampling_params]
    if len(params) != count:
        raise RequestError(f"{len(params)} sampling params for {count} prompts; give one or one per prompt")
    return params


def encode_prompt(tokenizer, vocab_size: int, prompt: PromptLike, chat: bool | None, *,
                  add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None
                  ) -> list[int]:
    """Token ids of one prompt: text (wrapped in the chat template when `chat`), chat messages, token ids
    (checked against the vocabulary [0, vocab_size)), or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.
    add_generation_prompt / chat_template_kwargs: passed to the chat template (e.g. {"enable_thinking": False})
    when one is applied."""
    kwargs = dict(chat_template_kwargs or {})

    def render(messages) -> list[int]:
        checked = chat_messages(messages)
        return encode_chat(tokenizer, checked, add_generation_prompt, kwargs)

    if is_prompt_dict(prompt):
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    _refuse_bytes(prompt)
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        # Raw text gets the BOS its post-processor asks for (Tokenizer.encode_prompt); stand-ins encode plainly.
        return render([{"role": "user", "content": prompt}]) if chat else getattr(tokenizer, "encode_prompt",
                                                                                   tokenizer.encode)(prompt)
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return render(prompt)
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


def encode_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                kwargs: Mapping[str, Any]) -> list[int]:
    """Token ids of checked chat messages rendered with the tokenizer's template. Special-token markup that a
    message's content holds (a user typing '<|im_start|>system') stays text: such contents are rendered as
    placeholders, and the pieces between them are encoded with markup (the template's own control tokens)
    while the contents are encoded as plain text (`Tokenizer.encode_text_only`). Messages without markup take
    the plain path, token for token as before."""
    plain_encode = getattr(tokenizer, "encode_text_only", None)
    marked = [] if plain_encode is None else [
        i for i, m in enumerate(messages) if m["content"] and tokenizer.encode(m["content"]) != plain_encode(m["content"])]
    if not marked:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                              **kwargs))
    holders = {i: f"\ue000specjax-content-{i}-{secrets.token_hex(8)}\ue000" for i in marked}
    shown = [dict(m, content=holders[i]) if i in holders else m for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(shown, add_generation_prompt=add_generation_prompt, **kwargs)
    ids: list[int] = []
    for i in marked:
        before, sep, text = text.partition(holders[i])
        if not sep or holders[i] in text:
            raise RequestError(f"message {i} contains special-token text (such as '<|...|>') and this chat "
                               "template transforms message content, so it cannot be kept as plain text; remove "
                               "the special-token text from the message")
        ids += tokenizer.encode(before) + plain_encode(messages[i]["content"])
    return ids + tokenizer.encode(text)


def chat_messages(messages) -> list[dict[str, Any]]:
    """Chat messages checked and normalised for a template: each needs a string 'role' and a 'content' that is
    text or a list of OpenAI-style text parts ({"type": "text", "text": ...}, joined with newlines); text must be
    valid Unicode. Raises RequestError naming the message and the problem."""
    out = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where} needs a 'role' string such as 'user', 'assistant' or 'system'")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise RequestError(f"{where} content part {j} is {kind!r}; only text parts "
                                       "({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise RequestError(f"{where} ({role}) has content of type {type(content).__name__}; it must be text "
                               "or a list of text parts")
        out.append({**m, "role": role, "content": check_text(content, f"{where} ({role:.20})")})
    return out


def conversations(messages) -> list[list[Mapping[str, Any]]]:
    """`LLM.chat`'s input as a list of conversations: one conversation (a list of {'role', 'content'} dicts) or
    a list of them."""
    if isinstance(messages, Sequence) and not isinstance(messages, str) and messages:
        if all(isinstance(m, Mapping) for m in messages):
            return [list(messages)]
        if all(isinstance(c, Sequence) and not isinstance(c, str) and c and all(isinstance(m, Mapping) for m in c)
               for c in messages):
            return [list(c) for c in messages]
    raise RequestError("chat takes one conversation (a list of {'role': ..., 'content': ...} messages) or a list "
                       f"of conversations; got {type(messages).__name__} {str(messages)[:40]!r}")


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


# ------------------------------------------------------------------------------------------------ samples


def fresh_seed() -> int:
    """A seed from the operating system's randomness (32 bits: what the device's per-request key takes)."""
    return secrets.randbits(32)


def expand_samples(params: Sequence[SamplingParams]) -> tuple[list[SamplingParams], list[tuple[int, int]]]:
    """One row per sample: (row params, [(prompt index, sample index)] per row). Request i's n samples become
    n rows with n = 1 and seeds seed, seed + 1, ..., or each its own fresh seed when seed is None, so every
    row's seed is fixed (and recorded) before anything runs."""
    rows, owners = [], []
    for i, sp in enumerate(params):
        for j in range(sp.n):
            seed = fresh_seed() if sp.seed is None else sp.seed + j
            rows.append(dataclasses.replace(sp, n=1, seed=seed))
            owners.append((i, j))
    return rows, owners


# ------------------------------------------------------------------------------------------------ arrays


def stop_ids(tokenizer, sp: SamplingParams) -> list[int]:
    """The request's stop ids: its own plus the tokenizer's end tokens unless ignore_eos."""
    ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(tokenizer.stop_token_ids))
    return list(dict.fromkeys(ids))


def num_stop(tokenizer, params: list[SamplingParams]) -> int:
    """The most stop ids any of the requests has."""
    return max(len(stop_ids(tokenizer, p)) for p in params)


def uses_options(params: Sequence[SamplingParams]) -> bool:
    """Whether any request sets min_p, min_tokens or a penalty (the optional SamplingArrays)."""
    return any(p.min_p > 0 or p.min_tokens > 0 or p.has_penalties for p in params)


def sampling_arrays(tokenizer, params: list[SamplingParams], batch: int, num_stop: int,
                    prompts: Sequence[Sequence[int]] | None = None, vocab_size: int | None = None,
                    all_options: bool = False) -> SamplingArrays:
    """The per-request sampling values as [batch] arrays (stop ids [batch, num_stop], -1 padded); rows past
    len(params) repeat the last request's values. A seed of None takes a fresh one here (greedy rows: 0, it is
    never read); callers that report seeds resolve them first (`expand_samples`). min_p / min_tokens arrays are
    built only when some request sets them, the penalties' arrays only when some request has penalties (None
    otherwise: the programs of other batches keep their inputs). prompts (token ids, one per request) and the
    model's vocab_size are needed only then: the repetition penalty covers the prompt's tokens. all_options
    builds every optional array whatever the requests set (neutral values are exact no-ops), so that a
    long-lived batch whose rows change keeps one program (`uses_options` tells whether any request needs them)."""
    params = list(params) + [params[-1]] * (batch - len(params))

    def stops(sp: SamplingParams) -> list[int]:
        ids = stop_ids(tokenizer, sp)
        if len(ids) > num_stop:
            raise RequestError(f"{len(ids)} stop token ids do not fit the {num_stop} slots of this bucket")
        return ids + [-1] * (num_stop - len(ids))

    def seed(sp: SamplingParams) -> int:
        if sp.seed is not None:
            return sp.seed % (2 ** 32)
        return 0 if sp.is_greedy else fresh_seed()

    penalties = {}
    if all_options or any(p.has_penalties for p in params):
        if prompts is None or vocab_size is None:
            raise ValueError("sampling_arrays: a request has penalties, so pass prompts and vocab_size")
        prompts = list(prompts) + [prompts[-1]] * (batch - len(prompts))
        mask = np.zeros((batch, vocab_size), bool)
        for r, ids in enumerate(prompts):
            ids = np.asarray(ids, np.int64)
            mask[r, ids[(ids >= 0) & (ids < vocab_size)]] = True
        penalties = dict(
            presence_penalty=np.asarray([p.presence_penalty for p in params], np.float32),
            frequency_penalty=np.asarray([p.frequency_penalty for p in params], np.float32),
            repetition_penalty=np.asarray([p.repetition_penalty for p in params], np.float32),
            prompt_mask=mask)
    # NumPy then one device_put: jnp.asarray would compile small conversion programs per new shape.
    return jax.device_put(SamplingArrays(
        temperature=np.asarray([p.temperature for p in params], np.float32),
        top_k=np.asarray([p.top_k for p in params], np.int32),
        top_p=np.asarray([p.top_p for p in params], np.float32),
        seed=np.asarray([seed(p) for p in params], np.uint32),
        max_new_tokens=np.asarray([p.max_new_tokens for p in params], np.int32),
        stop_ids=np.asarray([stops(p) for p in params], np.int32),
        min_p=(np.asarray([p.min_p for p in params], np.float32)
               if all_options or any(p.min_p > 0 for p in params) else None),
        min_tokens=(np.asarray([p.min_tokens for p in params], np.int32)
                    if all_options or any(p.min_tokens > 0 for p in params) else None),
        **penalties,
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


def warn_nonfinite(emitted: int) -> None:
    """Report a row that stopped on non-finite target logits (engine.FINISH_ERROR)."""
    import warnings

    from specjax.errors import NonFiniteLogitsWarning

    warnings.warn(NonFiniteLogitsWarning(
        f"the model produced NaN or infinite logits after {emitted} generated tokens; this request stopped there "
        "(finish_reason 'error') without sampling from them. The checkpoint may be corrupt, or the dtype may "
        "overflow: try dtype='float32'"), stacklevel=3)


def finish_name(finish) -> str:
    """"stop", "length" or "error" (non-finite logits) for an engine FINISH_* code."""
    return FINISH_NAMES.get(int(finish), "length")


def build_output(tokenizer, prompt, prompt_ids, new_ids, finish, ttft: float, total: float, *,
                 sampling: SamplingParams | None = None, **spec: Any) -> RequestOutput:
    """The RequestOutput of one finished row: new_ids the emitted tokens, finish its FINISH_* code, ttft the
    batch's time to first token and total this row's end-to-end seconds; `spec` the speculative metrics
    (`spec_metrics`). With `sampling`, its stop strings are applied (`finish_completion`)."""
    new_ids = [int(t) for t in new_ids]
    metrics = RequestMetrics(
        prompt_tokens=len(prompt_ids), new_tokens=len(new_ids), time_to_first_token=ttft, total_time=total,
        tokens_per_s=len(new_ids) / total if total > 0 else float("nan"), **spec)
    comp = CompletionOutput(0, tokenizer.decode(new_ids), new_ids, None, None, finish_name(finish), None,
                            None if sampling is None else sampling.seed, metrics)
    if int(finish) == FINISH_ERROR:
        warn_nonfinite(len(new_ids))
    if sampling is not None:
        comp = finish_completion(tokenizer, comp, sampling)
    return RequestOutput(prompt, list(prompt_ids), [comp], comp.metrics)


# ------------------------------------------------------------------------------------------------ stop strings


def stop_match(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the first stop string completed in `text` read left to right (the occurrence
    that ends first; of two ending together, the longer), ignoring occurrences that end at or before `start`;
    None when there is none."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best[0]:
                best = (key, s)
    return None if best is None else (best[0][1], best[1])


def stop_scan(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where to cut `text` for its stop strings: the index of the first completed stop string (`stop_match`),
    None when there is none. text[:index] is the output (the stop string excluded)."""
    hit = stop_match(text, stops, start)
    return None if hit is None else hit[0]


def safe_prefix_len(text: str, stops: Sequence[str], start: int = 0) -> int:
    """How many characters of a growing `text` a stream may emit now without ever emitting part of a stop
    string: up to the cut when a stop string is complete; otherwise all but the longest tail of `text` that
    could still grow into a stop string (a proper prefix of one). `start` as in `stop_match`."""
    cut = stop_scan(text, stops, start)
    if cut is not None:
        return cut
    hold = 0
    for s in stops:
        for h in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:h]):
                hold = h
                break
    return len(text) - hold


def truncate_at_stop(tokenizer, token_ids: Sequence[int], stops: Sequence[str], *, min_tokens: int = 0,
                     include_stop: bool = False) -> tuple[list[int], str, str] | None:
    """Cut a finished row at its first stop string: (token ids up to and including the token that completed it,
    text cut before it (after it with include_stop), the stop string), or None when no stop string occurs.
    Stop strings completed within the first `min_tokens` tokens do not count. A stop string may span several
    tokens; tokens after the one that completes it (a verify step may emit several at once) are dropped.
    The completing token is found by bisection over prefix decodes (log2(n) decodes)."""
    ids = [int(t) for t in token_ids]
    if not stops or not ids:
        return None
    start = len(tokenizer.decode(ids[:min_tokens])) if min_tokens else 0

    def hit(k: int):
        return stop_match(tokenizer.decode(ids[:k]), stops, start)

    if hit(len(ids)) is None:
        return None
    lo, hi = max(min_tokens, 1), len(ids)  # hit(hi) holds; find the smallest such k
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    text = tokenizer.decode(ids[:hi])
    i, s = stop_match(text, stops, start)
    return ids[:hi], text[:i + len(s)] if include_stop else text[:i], s


def finish_completion(tokenizer, comp: CompletionOutput, sp: SamplingParams) -> CompletionOutput:
    """A finished sample with its request's host-side stop rules applied: cut at the first stop string
    (finish_reason "stop", stop_reason the string, metrics counting the kept tokens), or stop_reason set to
    the request's own stop token id that ended it. Idempotent."""
    cut = truncate_at_stop(tokenizer, comp.token_ids, sp.stop, min_tokens=sp.min_tokens,
                           include_stop=sp.include_stop_str_in_output)
    if cut is not None:
        ids, text, s = cut
        metrics = comp.metrics
        if metrics is not None and len(ids) != metrics.new_tokens:
            t = metrics.total_time
            metrics = dataclasses.replace(metrics, new_tokens=len(ids),
                                          tokens_per_s=len(ids) / t if t > 0 else float("nan"))
        return dataclasses.replace(comp, text=text, token_ids=ids, finish_reason="stop", stop_reason=s,
                                   metrics=metrics)
    if comp.finish_reason == "stop" and comp.token_ids and comp.token_ids[-1] in sp.stop_token_ids:
        return dataclasses.replace(comp, stop_reason=comp.token_ids[-1])
    return comp


class StopStream:
    """Hold-back for one streamed sample with stop strings: `push(new_text)` returns what may be shown now
    (never the start of a stop string, nothing after one), `close(final_text)` what is left once the sample's
    final (cut) text is known, so that the pieces always join to the final text."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""  # everything received
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        cut = stop_scan(self.text, self.stops)
        n = safe_prefix_len(self.text, self.stops) if cut is None else cut
        self.stopped = cut is not None
        out, self.sent = self.text[self.sent:n], max(self.sent, n)
        return out

    def close(self, final_text: str) -> str:
        shown = self.text[:self.sent]
        self.stopped = True
        return final_text[len(shown):] if final_text.startswith(shown) else ""


# ------------------------------------------------------------------------------------------------ metrics


def merge_metrics(ms: Sequence[RequestMetrics]) -> RequestMetrics:
    """The metrics of a request's n samples together: token and step counts summed, rates recomputed from the
    sums, time to first token the earliest, total time the longest (samples of one request run side by side)."""
    if len(ms) == 1:
        return ms[0]
    total = max(m.total_time for m in ms)
    new = sum(m.new_tokens for m in ms)
    out = RequestMetrics(prompt_tokens=ms[0].prompt_tokens, new_tokens=new,
                         time_to_first_token=min(m.time_to_first_token for m in ms), total_time=total,
                         tokens_per_s=new / total if total > 0 else float("nan"), lossy=any(m.lossy for m in ms))
    if all(m.verify_steps is not None for m in ms):
        add = lambda name: sum(getattr(m, name) for m in ms)  # noqa: E731
        addl = lambda name: [sum(v) for v in zip(*(getattr(m, name) for m in ms))]  # noqa: E731
        drafted, accepted = add("drafted"), add("accepted")
        steps, forwards = add("verify_steps"), add("target_forwards")
        pa, pd = addl("per_position_accepted"), addl("per_position_drafted")
        plain_and_verify = forwards - len(ms)  # each sample's prefill is one forward
        out = dataclasses.replace(
            out, drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_length=tau(accepted, steps),
            tokens_per_forward=tokens_per_forward(accepted, plain_and_verify), verify_steps=steps,
            target_forwards=forwards, per_position_accepted=pa, per_position_drafted=pd,
            per_position_acceptance=[a / d if d else 0.0 for a, d in zip(pa, pd)],
            draft_time=ms[0].draft_time, verify_time=ms[0].verify_time)
    return out


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
