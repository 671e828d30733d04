"""The built-in rows of the kernel table (`specjax.backends.ops`): every op and each of its implementations.

    op              implementation   platforms           priority  notes
    matmul          kernel           cpu                 100       C++ small_matmul; auto: row limits
                    xla              all                 0         XLA's dot_general
    quant_matmul    kernel           cpu                 100       C++ quant_matmul, any number of rows
                    xla              all                 0         int8: dot then scale; others dequantize + dot
    gguf_matmul     kernel_q8        cpu                 110       C++ gguf_matmul_q8: activations rounded to int8
                                                                   (as llama.cpp), integer dot products; Q4_K,
                                                                   Q6_K, Q5_0, Q8_0; auto: CPUs with AVX-512 VNNI
                    kernel           cpu                 100       C++ gguf_matmul: GGUF blocks as stored (Q4_0 ..
                                                                   Q8_0, Q4_K, Q5_K, Q6_K), any number of rows,
                                                                   equal to the dequantized float32 product
                    xla              all                 0         the blocks dequantized in the forward + dot
    attention       kernel           cpu                 100       C++ prefix_attention; auto: <= 128 new tokens;
                                                                   no sliding window
                    xla              all                 0         prefix_tree_attention (sliding window too)
    kv_write        kernel           cpu                 100       C++ kv_write, in place; auto: 16-bit caches
                    xla              all                 0         XLA's scatter
    tree_attention  pallas_triton    gpu (interpret: any) 100      attention over a cache that already holds the
                    pallas_tpu       tpu (interpret: any) 100      new tokens; what attention_impl names
                    reference        all                 10
                    lse_merge        cpu, gpu, tpu       5         gathers the tree rows, hence not on neuron
The C++ kernels are custom calls (never under a mesh) and need the compiled library; on Neuron (and wherever no
kernel is registered) the XLA implementations run, which is the Neuron policy's choice: no custom calls, and
`backends.jaxpr_check` checks the rest of its compile rules.
"""
from __future__ import annotations

from specjax.backends.ops import define_op, register
from specjax.kernels import cpu_attention, cpu_kv_write, cpu_matmul, cpu_quant_matmul, gguf_matmul, xla

KERNEL = 100  # a kernel wins over XLA wherever it is supported and preferred

define_op("matmul", "matmul(x [..., K], w [N, K], *, out_dtype=None, weight_first=False) -> [..., N]")
register("matmul", "xla", xla.matmul_t)
register("matmul", "kernel", cpu_matmul.kernel_matmul_t, ("cpu",), cpu_matmul.is_supported, priority=KERNEL,
         prefers=cpu_matmul.prefers, custom_call=True, needs_build=("matmul", "XLA's dot"))

define_op("quant_matmul", "quant_matmul(x [..., K], codes, scale, minimum, *, kind, group, out_dtype=None) "
                          "-> [..., N]")
register("quant_matmul", "xla", cpu_quant_matmul.xla_quant_matmul)
register("quant_matmul", "kernel", cpu_quant_matmul.kernel_quant_matmul, ("cpu",), cpu_quant_matmul.is_supported,
         priority=KERNEL, custom_call=True, needs_build=("quantized matmul", "XLA's dot on dequantized weights"))

define_op("gguf_matmul", "gguf_matmul(x [..., K], blocks uint8 [N, row_bytes], *, type_name, out_dtype=None) "
                         "-> [..., N]")
register("gguf_matmul", "xla", gguf_matmul.xla_gguf_matmul)
register("gguf_matmul", "kernel", gguf_matmul.kernel_gguf_matmul, ("cpu",), gguf_matmul.is_supported,
         priority=KERNEL, custom_call=True, needs_build=("GGUF-block matmul", "XLA's dot on dequantized blocks"))
# Activations rounded to int8 (lossy, as llama.cpp's CPU backend): ahead of the float32 decoding where the CPU has
# integer dot products; SPECJAX_KERNELS=gguf_matmul=kernel keeps the products equal to the dequantized model's.
register("gguf_matmul", "kernel_q8", gguf_matmul.q8_kernel_gguf_matmul, ("cpu",), gguf_matmul.q8_is_supported,
         priority=KERNEL + 10, prefers=gguf_matmul.q8_prefers, custom_call=True,
         needs_build=("GGUF-block matmul", "XLA's dot on dequantized blocks"))

define_op("attention", "attention(q [B, T, Hq, D], k_cache, v_cache [B, Hkv, S, D], k_new, v_new [B, T, Hkv, D], "
                       "lengths [B], tree_mask [B, T, T], *, scale, positions=None, window=None) -> [B, T, Hq, D]")
register("attention", "xla", xla.prefix_tree_attention)
register("attention", "kernel", cpu_attention.kernel_attention, ("cpu",), cpu_attention.is_supported,
         priority=KERNEL, prefers=cpu_attention.prefers, custom_call=True,
         needs_build=("attention", "XLA's attention"))

define_op("kv_write", "kv_write(cache [B, H, S, D], new [B, T, H, D] in the cache's dtype, lengths [B]) -> cache")
register("kv_write", "xla", cpu_kv_write.kv_write_reference)
register("kv_write", "kernel", cpu_kv_write.kernel_kv_write, ("cpu",), cpu_kv_write.is_supported, priority=KERNEL,
         prefers=cpu_kv_write.prefers, custom_call=True, needs_build=("KV-cache write", "XLA's scatter"))


# tree_attention: the cache already holds the new tokens (see specjax.backends.registry for its callers).


def _reference(q, k, v, lengths, tree_mask, *, scale=None):
    from specjax.kernels.reference import tree_attention_reference

    return tree_attention_reference(q, k, v, lengths, tree_mask, scale=scale)


def _lse_merge(q, k, v, lengths, tree_mask, *, scale=None, prefix_impl="reference", interpret=False):
    from specjax.kernels.lse_merge import tree_attention_lse_merge

    return tree_attention_lse_merge(
        q, k, v, lengths, tree_mask, scale=scale, prefix_impl=prefix_impl, interpret=interpret
    )


def _triton(q, k, v, lengths, tree_mask, *, scale=None, block_sizes=None, interpret=False):
    from specjax.kernels.pallas.tree_attention_gpu import tree_attention_triton

    return tree_attention_triton(
        q, k, v, lengths, tree_mask, scale=scale, block_sizes=block_sizes, interpret=interpret
    )


def _triton_supported(q, k, v, lengths, tree_mask, **options) -> bool:
    from specjax.kernels.pallas.tree_attention_gpu import is_supported

    return is_supported(q, k, v, lengths, tree_mask)


def _tpu(q, k, v, lengths, tree_mask, *, scale=None, block_sizes=None, interpret=False):
    from specjax.kernels.pallas.tree_attention_tpu import tree_attention_tpu

    return tree_attention_tpu(q, k, v, lengths, tree_mask, scale=scale, block_sizes=block_sizes, interpret=interpret)


def _tpu_supported(q, k, v, lengths, tree_mask, **options) -> bool:
    from specjax.kernels.pallas.tree_attention_tpu import is_supported

    return is_supported(q, k, v, lengths, tree_mask)


define_op("tree_attention", "tree_attention(q [B, T, Hq, D], k, v [B, Hkv, S, D] holding the new tokens, "
                            "lengths [B], tree_mask [B, T, T], *, scale=None) -> [B, T, Hq, D]")
register("tree_attention", "reference", _reference, ("cpu", "gpu", "tpu", "neuron"), priority=10)
# lse_merge is the portable fallback; with its default jnp prefix it is not faster than the reference, so "auto"
# ranks it below (it gathers the tree rows, which Neuron is warned against, hence no neuron entry).
register("tree_attention", "lse_merge", _lse_merge, ("cpu", "gpu", "tpu"), priority=5, takes_interpret=True)
register("tree_attention", "pallas_triton", _triton, ("gpu",), _triton_supported, priority=100, interpretable=True)
register("tree_attention", "pallas_tpu", _tpu, ("tpu",), _tpu_supported, priority=100, interpretable=True)
