"""Static shape buckets of a compiled program: the frozen `Buckets` (a static jit argument) and the rounding rule.

Below the engines and the backends: `engine` jits over Buckets, `backends.neuron` builds its power-of-two bucket
table from them, and neither needs the other.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static shapes of one compiled program."""

    batch: int  # sequences per call (padded with inactive rows)
    prompt_len: int  # padded prompt length
    max_new: int  # size of the output buffer (>= every request's max_new_tokens)
    capacity: int  # KV cache slots per sequence
    num_stop: int = 4  # stop-id slots per request
    # Prefill each row by itself in chunks of this many tokens, only as many chunks as its own prompt needs
    # (0 = the whole [B, prompt_len] block in one forward). See `prefill_core`.
    prefill_chunk: int = 0
    # The target's KV cache entries: None = the params' dtype, 'int8' = int8 with per-token, per-head scales
    # (specjax.kv_cache). Shape-setting like the rest: a program is traced once per cache layout.
    kv_dtype: str | None = None


PREFILL_CHUNK = 128  # tokens per prefill chunk when the prompt bucket is longer (fastest of 64-512 on CPU)


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, (n - 1)).bit_length())


def make_buckets(batch: int, max_prompt: int, max_new: int, extra_slots: int = 0, num_stop: int = 4,
                 kv_dtype: str | None = None) -> Buckets:
    """Round the request shapes up to buckets; `extra_slots` reserves room for speculative tokens. Prompt buckets
    longer than PREFILL_CHUNK are prefilled row by row in chunks (a short prompt next to a long one then costs its
    own length, not the long one's). kv_dtype: the target cache's (`Buckets.kv_dtype`)."""
    p = _pow2(max_prompt, 16)
    n = _pow2(max_new, 16)
    cap = -(-(p + n + extra_slots) // 128) * 128
    return Buckets(_pow2(batch, 1), p, n, cap, _pow2(max(num_stop, 1), 4),
                   PREFILL_CHUNK if p > PREFILL_CHUNK else 0, kv_dtype)
