"""specjax kernels: verify (tree) attention implementations.

The jnp reference and the LSE-merge fallback are imported here; the Pallas kernels live in
`specjax.kernels.pallas.tree_attention_gpu` (Triton) and `specjax.kernels.pallas.tree_attention_tpu` (Mosaic) and
are normally reached through `specjax.backends.get_attention`.

`specjax.kernels.cpu_matmul` is the CPU kernel for the few-row products of decoding and verification (C++ through
XLA's FFI, compiled on first use), which the model's projections call on the CPU platform.
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
