"""specjax kernels: verify (tree) attention implementations.

The jnp reference and the LSE-merge fallback are imported here; the Pallas kernels live in
`specjax.kernels.pallas.tree_attention_gpu` (Triton) and `specjax.kernels.pallas.tree_attention_tpu` (Mosaic) and
are normally reached through `specjax.backends.get_attention`.

On the CPU platform the model calls two C++ kernels (XLA FFI, compiled on first use by `specjax.kernels.cpu_build`):
`specjax.kernels.cpu_matmul` for the few-row products of decoding and verification, and
`specjax.kernels.cpu_attention` for the attention of decode and verify blocks over the committed KV cache.
"""
from specjax.kernels.lse_merge import tree_attention_lse_merge
from specjax.kernels.reference import (
    prefix_attention_reference_lse,
    tree_attention_reference,
    tree_attention_reference_lse,
    visibility_mask,
)
from specjax.kernels.validation import (
    TreeAttentionInputError,
    UnsupportedConfigError,
    validate_tree_attention_inputs,
)

__all__ = [
    "TreeAttentionInputError",
    "UnsupportedConfigError",
    "prefix_attention_reference_lse",
    "tree_attention_lse_merge",
    "tree_attention_reference",
    "tree_attention_reference_lse",
    "validate_tree_attention_inputs",
    "visibility_mask",
]
