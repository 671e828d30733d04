"""Plain decoding as a variant of the host driver (`runners.base`): `engine.prefill`, then `engine.decode_loop`
to the end, or in chunks of a few steps with new text handed to a callback (streaming)."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.backoff import NO_LIMIT
from specjax.buckets import make_buckets
from specjax.runners.base import DeviceVariant

STREAM_CHUNK = 4  # decode steps between two looks at the output while streaming


class PlainVariant(DeviceVariant):
    """stream: called as stream(prompt_index, new_text) while decoding, every `chunk` steps."""

    def __init__(self, llm, stream: Callable[[int, str], None] | None = None, chunk: int = STREAM_CHUNK):
        self.llm, self.stream, self.chunk = llm, stream, chunk

    def buckets(self, n, max_prompt, max_new, num_stop):
        return make_buckets(n, max_prompt, max_new, num_stop=num_stop)

    def prefill(self, b, tokens, lens, active, sampling):
        return engine.prefill(self.llm.params, self.llm.config, b, tokens, lens, active, sampling)

    def dec(self, state):
        return state

    def with_dec(self, state, dec):
        return dec

    def _run(self, state, sampling, steps: int):
        return engine.decode_loop(self.llm.params, self.llm.config, state, sampling, jnp.int32(steps),
                                  attention_fn=self.llm.attention_fn)

    def loop(self, b, state, sampling, ids):
        if self.stream is None:
            return self._run(state, sampling, NO_LIMIT)
        from specjax.models.tokenizer import IncrementalDecoder

        n = len(ids)
        decoders = [IncrementalDecoder(self.llm.tokenizer) for _ in range(n)]
        seen = np.zeros(n, int)
        while True:
            new = np.asarray(state.num_new)[:n]
            toks = np.asarray(state.out_tokens)[:n]
            for i in range(n):
                text = "".join(decoders[i].push(int(t)) for t in toks[i, seen[i]:new[i]])
                if text:
                    self.stream(i, text)
            seen = new
            if not np.any(np.asarray(state.finish)[:n] == engine.FINISH_RUNNING):
                return state
            state = self._run(state, sampling, self.chunk)

    def until_free(self, b, state, sampling, max_steps: int):
        return engine.decode_until_free(self.llm.params, self.llm.config, state, sampling, np.int32(max_steps),
                                        attention_fn=self.llm.attention_fn)
