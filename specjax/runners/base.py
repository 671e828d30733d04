"""The one host driver: check -> bucket -> pad -> sampling arrays -> prefill (timed: TTFT) -> device loop -> outputs.

Every way of generating for a batch of requests (plain, speculative, Neuron) runs `generate` with a variant that
supplies the parts that differ; the continuous-batching scheduler (`runners.batch`) uses the same variants'
`prefill` and `until_free`. A variant has:

  extra_slots                                     KV slots a step writes past the committed length (0: plain)
  buckets(n, max_prompt, max_new, num_stop)       -> Buckets (compiled ahead of time where the policy wants)
  prefill(b, tokens [B, P], lens [B], active [B], sampling) -> state (first token emitted)
  dec(state) -> DecodeState;  with_dec(state, dec) -> state
  loop(b, state, sampling, ids)                   -> state with every real row finished
  until_free(b, state, sampling, max_steps)       -> state after running until a slot frees up (batch scheduler)
  state_shapes(b, sampling)                       -> the state's ShapeDtypeStructs, nothing run or compiled
  tracing()                                       -> the context entry points are traced in
  finish(state, new_ids)                          -> per-row extra metrics (dicts), after the loop

`llm` is anything with the public attributes of `specjax.api.LLM`: params, config, tokenizer, max_context,
attention_fn, runtime, dtype.
"""
from __future__ import annotations

import contextlib
import functools
import time

import jax
import jax.numpy as jnp

from specjax.requests import RequestOutput, build_output, check_requests, num_stop, pad_prompts, sampling_arrays


def generate(llm, prompts, ids: list[list[int]], params: list, variant) -> list[RequestOutput]:
    """Generate for `ids` (token lists, one per prompt; `prompts` as the user gave them) with one variant."""
    check_requests(ids, params, variant.extra_slots, llm.max_context)
    n = len(ids)
    b = variant.buckets(n, max(map(len, ids)), max(p.max_new_tokens for p in params),
                        num_stop(llm.tokenizer, params))
    tokens, lens, active = pad_prompts(ids, b.batch, b.prompt_len)
    sampling = sampling_arrays(llm.tokenizer, params, b.batch, b.num_stop)
    t0 = time.perf_counter()
    state = variant.prefill(b, tokens, lens, active, sampling)
    jax.block_until_ready(variant.dec(state).last_token)
    ttft = time.perf_counter() - t0
    state = variant.loop(b, state, sampling, ids)
    dec = variant.dec(state)
    out_tokens, num_new, finish = jax.device_get((dec.out_tokens, dec.num_new, dec.finish))  # waits for the loop
    total = time.perf_counter() - t0
    new = [out_tokens[i, :num_new[i]].tolist() for i in range(n)]
    extra = variant.finish(state, new)
    return [build_output(llm.tokenizer, prompts[i], ids[i], new[i], finish[i], ttft, total, **extra[i])
            for i in range(n)]


class DeviceVariant:
    """What the device variants share: the state's shapes from an abstract prefill, the default tracing
    context, no extra metrics."""

    extra_slots = 0

    def state_shapes(self, b, sampling):
        B, P = b.batch, b.prompt_len
        with self.tracing():
            return jax.eval_shape(functools.partial(self.prefill, b), jax.ShapeDtypeStruct((B, P), jnp.int32),
                                  jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_),
                                  sampling)

    def tracing(self):
        return contextlib.nullcontext()

    def finish(self, state, new_ids: list[list[int]]) -> list[dict]:
        return [{} for _ in new_ids]
