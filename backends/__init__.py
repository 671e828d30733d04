"""specjax backends: per-platform attention selection and compile policies."""
from specjax.backends.registry import (
    ATTENTION_NAMES,
    COMPILE_POLICIES,
    PLATFORMS,
    AttentionFn,
    AttentionImpl,
    AttentionUnavailableError,
    CompilePolicy,
    available_attention,
    get_attention,
    get_compile_policy,
    normalize_platform,
    register_attention,
    registered_attention,
)

__all__ = [
    "ATTENTION_NAMES",
    "COMPILE_POLICIES",
    "PLATFORMS",
    "AttentionFn",
    "AttentionImpl",
    "AttentionUnavailableError",
    "CompilePolicy",
    "available_attention",
    "get_attention",
    "get_compile_policy",
    "normalize_platform",
    "register_attention",
    "registered_attention",
]
