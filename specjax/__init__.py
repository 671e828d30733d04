"""specjax: lossless speculative decoding for LLMs in JAX."""
__version__ = "0.1.0"
