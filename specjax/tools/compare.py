"""One config on several backends / devices / attention implementations, or several methods, side by side, with
greedy outputs cross-checked for equality (the command line is `specjax.cli.compare`).

A target is `platform[:attention_impl]`, e.g. `cpu`, `cpu:lse_merge`, `gpu:pallas`, `tpu`, `neuron`. Platforms
that are not present are reported and skipped (on this project's CI only `cpu` and the Neuron policy on CPU
exist). Timing excludes compilation (every target runs the prompts once untimed first).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Sequence

import jax

from specjax.config import SamplingParams, SpeculativeConfig
from specjax.tools.bench import BenchPrompt


def _device_context(platform: str):
    """(context manager placing arrays on `platform`, None) or (None, why it is missing)."""
    if platform == "neuron":
        return contextlib.nullcontext(), None
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        return None, f"platform {platform!r} is not present on this machine"
    return jax.default_device(devices[0]), None


def run_targets(model: str, dtype: str, prompts: Sequence[BenchPrompt], targets: Sequence[str],
                methods: Sequence[tuple[str, SpeculativeConfig | None]], sp: SamplingParams,
                log=lambda msg: print(msg, file=sys.stderr)) -> tuple[list[dict], tuple[str, str] | None]:
    """Every (target, method) over the first turns of `prompts` at batch 1. Returns (one row per pair with
    tokens/s and `greedy_equal_to_first`, the (target, method) key every output is compared against, or None
    when no target was present)."""
    from specjax.api import LLM

    rows = []
    outputs: dict[tuple[str, str], list] = {}
    msgs = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
    for target in targets:
        platform, _, impl = target.partition(":")
        ctx, why = _device_context(platform)
        if ctx is None:
            log(f"{target}: skipped ({why})")
            continue
        with ctx:
            llm = LLM(model, dtype, backend=platform, attention_impl=impl or "auto")
            for label, spec in methods:
                llm.generate(msgs[:1], sp, spec)  # compile
                toks, secs, ids = 0, 0.0, []
                for m in msgs:
                    t = time.perf_counter()
                    o = llm.generate([m], sp, spec)[0]
                    secs += time.perf_counter() - t
                    toks += o.metrics.new_tokens
                    ids.append(o.token_ids)
                outputs[(target, label)] = ids
                rows.append({"target": target, "method": label, "tokens_per_s": toks / secs, "new_tokens": toks,
                             "lossy": bool(spec is not None and spec.is_lossy)})
                log(f"{target:>16} {label:>20}: {toks / secs:7.1f} tok/s")
    ref_key = next(iter(outputs), None)
    for r in rows:
        r["greedy_equal_to_first"] = outputs[(r["target"], r["method"])] == outputs[ref_key]
    return rows, ref_key
