"""specjax: lossless speculative decoding for LLMs in JAX.

`LLM` and `SamplingParams` are the public entry points; everything below them is pure functions
(`specjax.models.llama.forward`, `specjax.acceptance.accept_tree`, `specjax.spec_engine.spec_step`, ...).
"""
__version__ = "0.1.0"

import os as _os

# XLA:CPU's default copy insertion copies every loop-carried buffer that enters a `lax.cond` branch which updates
# it: the speculative loop's cond (plain step or verify step) copied the whole KV cache twice per step, which made
# a fully backed-off speculative loop slower than plain decoding at large batch (reports/batch_cpu_region/README.md
# has the figures). Region analysis proves the copies unnecessary. XLA reads XLA_FLAGS when the first backend
# starts, so this must run before any computation;
# it is skipped when the user set the flag, and for jaxlib releases other than the pinned 0.10 line, whose flag
# parser may not know it (an unknown flag aborts the process). SPECJAX_XLA_FLAGS=0 turns it off.
_REGION_FLAG = "xla_cpu_copy_insertion_use_region_analysis"


def _set_xla_flags() -> None:
    if _os.environ.get("SPECJAX_XLA_FLAGS", "1") == "0" or _REGION_FLAG in _os.environ.get("XLA_FLAGS", ""):
        return
    try:
        from importlib.metadata import version

        if not version("jaxlib").startswith("0.10."):
            return
    except Exception:  # jaxlib missing or unreadable metadata: leave XLA alone
        return
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + f" --{_REGION_FLAG}=true").strip()


_set_xla_flags()

from specjax.config import SamplingParams, SpeculativeConfig  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402


def __getattr__(name):
    # LLM pulls in JAX and the model code; import it on first use so `import specjax` stays cheap.
    if name == "LLM":
        from specjax.api import LLM

        return LLM
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "SpecjaxError", "SpeculativeConfig", "__version__"]
