"""Plain decoding as a variant of the host driver (`runners.base`): `engine.prefill`, then `engine.decode_loop`
to the end, or in chunks of a few steps while streaming (the same compiled loop: its step count is traced)."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.backoff import NO_LIMIT
from specjax.buckets import make_buckets
from specjax.runners.base import STREAM_CHUNK, DeviceVariant, chunk_views


class PlainVariant(DeviceVariant):
    """stream: called as stream(prompt_index, new_text) while decoding (`runners.base.generate`); chunk: decode
    steps per loop call while streaming."""

    prompt_free_state = True
    shares_prefix = True

    def __init__(self, llm, stream: Callable[[int, str], None] | None = None, chunk: int = STREAM_CHUNK):
        self.llm, self.stream, self.chunk = llm, stream, chunk

    def buckets(self, n, max_prompt, max_new, num_stop):
        return make_buckets(n, max_prompt, max_new, num_stop=num_stop, kv_dtype=self.llm.kv_cache_dtype)

    def prefill(self, b, tokens, lens, active, sampling):
        return engine.prefill(self.llm.params, self.llm.config, b, tokens, lens, active, sampling)

    def prefill_after(self, b, prefix, tokens, lens, active, sampling):
        return engine.prefill_after_prefix(self.llm.params, self.llm.config, prefix, tokens, lens, active, sampling,
                                           b.max_new)

    def dec(self, state):
        return state

    def with_dec(self, state, dec):
        return dec

    def _run(self, state, sampling, steps: int):
        return engine.decode_loop(self.llm.params, self.llm.config, state, sampling, jnp.int32(steps),
                                  attention_fn=self.llm.attention_fn)

    def loop(self, b, state, sampling, ids):
        return self._run(state, sampling, NO_LIMIT)

    def chunks(self, b, state, sampling, ids):
        return (yield from chunk_views(lambda st: self._run(st, sampling, self.chunk), state, lambda st: st))

    def until_free(self, b, state, sampling, max_steps: int):
        return engine.decode_until_free(self.llm.params, self.llm.config, state, sampling, np.int32(max_steps),
                                        attention_fn=self.llm.attention_fn)
