"""Memory preflight: before a generation allocates its KV caches, estimate what it needs and refuse, with the
numbers, when it cannot fit the device.

The estimate covers what a request adds on top of the resident weights: the target's KV cache (2 x layers x
batch x capacity x KV heads x head size, in the cache dtype; an int8 cache's entries take one byte plus a float32
scale per token and KV head, `kv_token_bytes`), a draft model's own cache, and the largest
transient buffers of one step (the verify pass's logits and their processed copies, [batch, nodes, vocab]
float32, and the attention scores of a prefill chunk or a verify pass, [batch, heads, rows, capacity]
float32). It is a floor, not a bound: a job it admits can still run out of memory, but one it refuses would
certainly have failed, after compiling for a while and with an allocator message naming one buffer.

Available memory: on accelerators, the device allocator's limit minus its bytes in use (the weights already
placed); on CPU, the kernel's MemAvailable (the weights are already resident too). `SPECJAX_MEMORY_LIMIT`
(bytes, or with a K/M/G/T suffix) overrides it, e.g. to keep a job inside a container's share.
"""
from __future__ import annotations

import dataclasses
import os

from specjax.errors import SpecjaxError


class ResourceError(SpecjaxError, MemoryError):
    """A request would not fit the device's memory; the message gives the estimate and what to lower."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    kv_cache: int  # bytes: target KV cache
    draft_cache: int  # bytes: a draft model's KV cache (0 for other drafters)
    activations: int  # bytes: the largest transient buffers of one step

    @property
    def total(self) -> int:
        return self.kv_cache + self.draft_cache + self.activations


def kv_token_bytes(config, itemsize: int, kv_dtype: str | None = None) -> int:
    """Bytes one token takes in a KV cache: K and V, every layer and KV head; head_dim values of `itemsize` bytes
    (kv_dtype None), or for 'int8' head_dim one-byte values and one float32 scale (`specjax.kv_cache`)."""
    per_head = {None: config.head_dim * itemsize, "int8": config.head_dim + 4}[kv_dtype]
    return 2 * config.num_layers * config.num_kv_heads * per_head


def kv_bytes(config, batch: int, capacity: int, itemsize: int, kv_dtype: str | None = None) -> int:
    """Bytes of a KV cache: K and V, every layer, [batch, kv_heads, capacity, head_dim] (and the scales of an
    int8 cache, kv_dtype 'int8')."""
    return batch * capacity * kv_token_bytes(config, itemsize, kv_dtype)


def estimate(config, buckets, itemsize: int, tree_nodes: int = 1, draft_config=None) -> Estimate:
    """What a generation over `buckets` (batch, capacity, prompt bucket and prefill chunk, the target cache's
    kv_dtype) adds to the resident weights of a target with LlamaConfig `config` whose params hold `itemsize`-byte
    values, verifying `tree_nodes` nodes per step (1: plain decoding); draft_config: a draft model's LlamaConfig,
    or None (its cache is in the params' dtype)."""
    B, cap = buckets.batch, buckets.capacity
    kv_dtype = buckets.kv_dtype
    rows = max(tree_nodes, buckets.prefill_chunk or buckets.prompt_len)
    logits = 3 * B * max(tree_nodes, 1) * config.vocab_size * 4  # logits, processed probabilities, one copy
    scores = 2 * B * config.num_heads * rows * cap * 4  # scores and their softmax
    # An int8 cache is attended to one layer at a time, read back as K and V in the params' dtype.
    read_back = 0 if kv_dtype is None else 2 * B * config.num_kv_heads * cap * config.head_dim * itemsize
    draft = kv_bytes(draft_config, B, cap, itemsize) if draft_config is not None else 0
    return Estimate(kv_bytes(config, B, cap, itemsize, kv_dtype), draft, logits + scores + read_back)


def parse_bytes(text: str) -> int:
    """'3000000', '512M', '24G', '1.5T' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise ResourceError(f"SPECJAX_MEMORY_LIMIT={text!r} is not a size; use bytes or e.g. '24G'") from None
    return int(value * scale)


def available_bytes(device=None) -> int | None:
    """Bytes free for new buffers on `device` (default: the first JAX device), None when unknown."""
    limit = os.environ.get("SPECJAX_MEMORY_LIMIT")
    if limit:
        return parse_bytes(limit)
    import jax

    device = device or jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator statistics (CPU) raise or return None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 27 else f"{n / 2 ** 20:.1f} MiB"


def preflight(config, buckets, itemsize: int, tree_nodes: int = 1, draft_config=None, *, what: str = "this generation",
              available: int | None = None) -> Estimate:
    """Raise ResourceError when `estimate(...)` exceeds the memory available (`available_bytes` unless given);
    return the estimate. Unknown availability admits everything."""
    est = estimate(config, buckets, itemsize, tree_nodes, draft_config)
    free = available_bytes() if available is None else available
    if free is not None and est.total > free:
        parts = [f"KV cache {_gib(est.kv_cache)} (batch {buckets.batch} x {buckets.capacity} slots x "
                 f"{config.num_layers} layers{', int8' if buckets.kv_dtype == 'int8' else ''})"]
        if est.draft_cache:
            parts.append(f"draft model cache {_gib(est.draft_cache)}")
        parts.append(f"step buffers {_gib(est.activations)}")
        raise ResourceError(
            f"{what} needs about {_gib(est.total)} beyond the loaded weights ({', '.join(parts)}), but only "
            f"{_gib(max(free, 0))} is available; lower max_tokens or the prompt length (the KV slots), the batch "
            "(max_num_seqs / --batch-size), or the draft tree size")
    return est
