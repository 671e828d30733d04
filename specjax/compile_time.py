"""Compilation seen apart from decoding: the seconds JAX spends tracing, lowering and compiling (or loading from
the persistent cache) inside a block, from `jax.monitoring`'s duration events, and an optional line per compiled
program while it happens, so a user watching a first generation knows why it is slow.

`RequestMetrics.compile_time` carries the block's total; the time-to-first-token and tokens/s figures still
include it (they are what the caller waited), and `compile_time` says how much of that was compilation.
Progress lines go to stderr when it is a terminal, or when SPECJAX_PROGRESS=1 (0 silences them).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache",
}


class CompileTime:
    """Seconds spent in each compilation phase inside a `watch` block (this thread only)."""

    def __init__(self) -> None:
        self.seconds = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "cache": 0.0}
        self.programs = 0  # backend compilations

    @property
    def total(self) -> float:
        """XLA compile and cache-read seconds: those events never nest, while trace and lower events of nested
        functions count in their callers too, so adding them would count the same time twice."""
        return self.seconds["compile"] + self.seconds["cache"]


def progress_enabled() -> bool:
    """Progress lines on stderr: SPECJAX_PROGRESS=1/0 decides, else whether stderr is a terminal."""
    flag = os.environ.get("SPECJAX_PROGRESS")
    if flag is not None:
        return flag.strip() not in ("", "0", "false", "no")
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def say(message: str) -> None:
    """One progress line on stderr (only when `progress_enabled`)."""
    if progress_enabled():
        print(f"specjax: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def watch(report: Callable[[str], None] | None = None) -> Iterator[CompileTime]:
    """Collect compilation seconds of the calling thread inside the block; with `report`, call it with a line
    for every program compiled that took a second or more."""
    import jax

    acc = CompileTime()
    me = threading.get_ident()

    def listener(event: str, duration: float, **kwargs) -> None:
        phase = _EVENTS.get(event)
        if phase is None or threading.get_ident() != me:
            return
        acc.seconds[phase] += duration
        if phase == "compile":
            acc.programs += 1
            if report is not None and duration >= 1.0:
                report(f"compiled {kwargs.get('fun_name', 'a program')} in {duration:.1f} s")

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield acc
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
