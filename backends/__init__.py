"""specjax backends: the kernel table (`specjax.backends.ops`: every op's implementations, one selection rule per
platform and op, the SPECJAX_KERNELS override; rows in `specjax.backends.table`), named verify attention for
`attention_impl` (`registry`) and per-platform compile policies."""
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
