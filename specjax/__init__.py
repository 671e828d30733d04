"""specjax: lossless speculative decoding for LLMs in JAX.

`LLM` and `SamplingParams` are the public entry points; everything below them is pure functions
(`specjax.models.llama.forward`, `specjax.acceptance.accept_tree`, `specjax.spec_engine.spec_step`, ...).
"""
__version__ = "0.1.0"

from specjax.config import SamplingParams, SpeculativeConfig  # noqa: E402


def __getattr__(name):
    # LLM pulls in JAX and the model code; import it on first use so `import specjax` stays cheap.
    if name == "LLM":
        from specjax.api import LLM

        return LLM
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "__version__"]
