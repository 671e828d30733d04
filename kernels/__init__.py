"""specjax kernels: verify (tree) attention implementations.

The jnp reference and the LSE-merge fallback are imported here; the Pallas kernels live in
`specjax.kernels.pallas.tree_attention_gpu` (Triton) and `specjax.kernels.pallas.tree_attention_tpu` (Mosaic) and
are normally reached through `specjax.backends.get_attention`.

Every implementation of every op the model runs lives here; which one runs is the kernel table's choice
(`specjax.backends.ops`, docs/kernels.md). `specjax.kernels.xla` holds XLA's projection and decode/verify attention;
the C++ CPU kernels (XLA FFI, compiled on first use by `specjax.kernels.cpu_build`) are `cpu_matmul` (few-row
products), `cpu_quant_matmul` (weight-only quantized products), `cpu_attention` (decode and verify attention over
the committed KV cache) and `cpu_kv_write` (in-place cache writes).
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
