"""The Python API: `LLM(model=...)` and `llm.generate(prompts, SamplingParams(...), speculative_config=...)`.

This is the host side: it tokenizes, checks every request before anything is compiled, picks the shape
buckets, turns per-request values into arrays and calls the jitted entry points of `specjax.engine` (plain) or
`specjax.spec_engine` (speculative). It keeps no decoding state between calls.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig
from specjax.models.loading import DEFAULT_MODEL, load_model
from specjax.models.llama import fuse_projections
from specjax.sampling import SamplingArrays
from specjax.errors import SpecjaxError

FINISH_NAMES = {engine.FINISH_STOP: "stop", engine.FINISH_LENGTH: "length"}


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
    mean_accepted_length: float | None = None  # tau = (accepted + verify steps) / verify steps
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


PromptLike = str | Sequence[int] | Sequence[Mapping[str, str]]


class LLM:
    """A loaded model ready to generate. Holds only immutable things: config, params, tokenizer."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", *, backend: str = "auto",
                 attention_impl: str = "auto", max_context: int | None = None, attention_interpret: bool = False):
        """backend: 'auto' | 'cpu' | 'gpu' | 'tpu' run the default program; 'neuron' runs the Neuron-policy
        program (fused unrolled steps looped from the host, buckets compiled ahead of time), on CPU when the
        Neuron SDK is absent. attention_interpret runs Pallas kernels in interpret mode (testing on CPU)."""
        loaded = load_model(model, dtype)
        self.model_spec = model
        self.dtype = dtype
        self.config = loaded.config
        # The inference layout (fused, [out, in] projections): 10-25% faster target forwards on XLA:CPU.
        self.params = fuse_projections(loaded.params)
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.max_context = min(max_context or loaded.config.max_position_embeddings,
                               loaded.config.max_position_embeddings)
        self.backend = backend
        self.attention_impl = attention_impl
        self._attention_fn = resolve_attention(attention_impl, backend, attention_interpret)
        self._drafters: dict = {}

    # ------------------------------------------------------------------------------------ input handling
    def encode_prompt(self, prompt: PromptLike, chat: bool | None) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
            return ids
        raise RequestError(
            "a prompt must be a non-empty string, a list of token ids, or a list of chat messages "
            f"({{'role': ..., 'content': ...}}); got {type(prompt).__name__} {str(prompt)[:40]!r}"
        )

    def _normalise(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
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

    def _check(self, i: int, ids: list[int], sp: SamplingParams, extra: int) -> None:
        if not ids:
            raise RequestError(f"prompt {i} is empty after tokenization")
        need = len(ids) + sp.max_new_tokens + extra
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt {i} has {len(ids)} tokens, more than the context of {self.max_context}; shorten it")
        if extra and len(ids) + 1 + extra > self.max_context:
            raise RequestError(
                f"prompt {i}: {len(ids)} prompt tokens + {extra} speculative slots leave no room for a new token "
                f"in the context of {self.max_context}; lower num_speculative_tokens (or the tree size) to at most "
                f"{max(0, self.max_context - len(ids) - 2)}, or raise max_context")
        if need > self.max_context:
            raise RequestError(
                f"prompt {i}: {len(ids)} prompt tokens + max_new_tokens {sp.max_new_tokens}"
                + (f" + {extra} speculative slots" if extra else "")
                + f" = {need} exceeds the context of {self.max_context}; lower max_new_tokens to "
                f"{max(0, self.max_context - len(ids) - extra)} or less")

    def stop_ids(self, sp: SamplingParams) -> list[int]:
        """The request's stop ids: its own plus the tokenizer's end tokens unless ignore_eos."""
        ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.tokenizer.stop_token_ids))
        return list(dict.fromkeys(ids))

    def num_stop(self, params: list[SamplingParams]) -> int:
        return max(len(self.stop_ids(p)) for p in params)

    def sampling_arrays(self, params: list[SamplingParams], batch: int, num_stop: int) -> SamplingArrays:
        pad = batch - len(params)
        params = params + [params[-1]] * pad

        def stops(sp: SamplingParams) -> list[int]:
            ids = self.stop_ids(sp)
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

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, speculative_config=None, *, chat: bool | None = None,
                 stream: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch.

        prompts: a string, a list of token ids, a list of chat messages, or a list of any of these.
        sampling_params: one SamplingParams (or dict) for all, or one per prompt.
        speculative_config: None (plain decoding), a dict such as {"method": "ngram", "num_speculative_tokens": 4},
        or a SpeculativeConfig.
        chat: wrap plain-string prompts in the model's chat template (default: no, like vLLM's generate).
        stream: called as stream(prompt_index, new_text) while decoding (plain decoding, from the host).
        """
        prompts, params = self._normalise(prompts, sampling_params)
        spec = SpeculativeConfig.from_user(speculative_config)
        ids = [self.encode_prompt(p, chat) for p in prompts]
        if self.backend == "neuron":
            from specjax.backends.neuron import generate_neuron

            outs = generate_neuron(self, ids, params, spec if spec.enabled else None)
            for o, p in zip(outs, prompts):
                o.prompt = p
            return outs
        if spec.enabled:
            from specjax.runners import speculative as spec_api

            return spec_api.generate(self, prompts, ids, params, spec)
        for i, (t, sp) in enumerate(zip(ids, params)):
            self._check(i, t, sp, 0)
        return self._generate_plain(prompts, ids, params, stream)

    def _generate_plain(self, prompts, ids, params, stream=None) -> list[RequestOutput]:
        n = len(ids)
        b = engine.make_buckets(n, max(map(len, ids)), max(p.max_new_tokens for p in params),
                                num_stop=self.num_stop(params))
        tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
        sampling = self.sampling_arrays(params, b.batch, b.num_stop)
        t0 = time.perf_counter()
        state = engine.prefill(self.params, self.config, b, tokens, lens, active, sampling)
        jax.block_until_ready(state.last_token)
        ttft = time.perf_counter() - t0
        if stream is None:
            state = engine.decode_loop(self.params, self.config, state, sampling, jnp.int32(2 ** 30),
                                       attention_fn=self._attention_fn)
        else:
            state = self._stream(state, sampling, n, stream)
        out_tokens = np.asarray(state.out_tokens)
        num_new = np.asarray(state.num_new)
        finish = np.asarray(state.finish)
        total = time.perf_counter() - t0
        return [self._output(prompts[i], ids[i], out_tokens[i, :num_new[i]], finish[i], ttft, total)
                for i in range(n)]

    def _stream(self, state, sampling, n, callback, chunk: int = 4):
        from specjax.models.tokenizer import IncrementalDecoder

        decoders = [IncrementalDecoder(self.tokenizer) for _ in range(n)]
        seen = np.zeros(n, int)
        while True:
            new = np.asarray(state.num_new)[:n]
            toks = np.asarray(state.out_tokens)[:n]
            for i in range(n):
                text = "".join(decoders[i].push(int(t)) for t in toks[i, seen[i]:new[i]])
                if text:
                    callback(i, text)
            seen = new
            if not np.any(np.asarray(state.finish)[:n] == engine.FINISH_RUNNING):
                return state
            state = engine.decode_loop(self.params, self.config, state, sampling, jnp.int32(chunk),
                                       attention_fn=self._attention_fn)

    def _output(self, prompt, prompt_ids, new_ids, finish, ttft, total, **spec_metrics) -> RequestOutput:
        new_ids = [int(t) for t in new_ids]
        metrics = RequestMetrics(
            prompt_tokens=len(prompt_ids), new_tokens=len(new_ids), time_to_first_token=ttft, total_time=total,
            tokens_per_s=len(new_ids) / total if total > 0 else float("nan"), **spec_metrics)
        return RequestOutput(prompt, list(prompt_ids), new_ids, self.tokenizer.decode(new_ids),
                             FINISH_NAMES.get(int(finish), "length"), metrics)


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


def resolve_attention(attention_impl: str, backend: str, interpret: bool = False):
    """The verify-attention function for this platform (None = the XLA reference inside the model)."""
    if attention_impl in ("auto", "reference") and backend in ("auto", "cpu", "neuron") and not interpret:
        if attention_impl == "reference" or jax.default_backend() == "cpu":
            return None
    try:
        from specjax.backends.registry import get_attention
    except ImportError as e:  # pragma: no cover - the registry ships with specjax
        raise ConfigError(f"backend registry unavailable: {e}") from None
    return get_attention(attention_impl, interpret=interpret)
