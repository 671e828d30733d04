// specjax CPU kernel: y[M, N] = x[M, K] . w[N, K]^T for the few-row products of decoding and verification.
//
// Why it exists: XLA:CPU runs a product with 2-16 rows (a verify block, a batch of 8 one-token rows) through a
// general matrix-product path that repacks the weight on every call, so a 5-token verify costs about twice a
// one-token step although both read the same weights; and it runs bfloat16 products by converting the weight to
// float32 first, so bfloat16 decoding is several times slower than float32. This kernel streams each weight row
// once, keeps up to 4 rows x 6 tokens of float32 accumulators in registers, and widens bfloat16 weights in
// registers, so a step reads 2 bytes per bfloat16 weight and a verify block costs close to a one-token step.
//
// Layout: x float32 [M, K] row-major; w float32 or bfloat16 [N, K] row-major (a weight stored [out, in], the
// inference layout of specjax.models.llama); y float32 [M, N]. Any M, N, K >= 0.
//
// Threads: the N rows are cut into chunks of 64 that the calling thread and helpers scheduled on XLA's intra-op
// pool claim from one atomic counter. The caller then waits only for chunks already claimed, which are running,
// so it never waits on a helper that could not start because XLA keeps every pool thread busy with other
// independent operations.
//
// Portable C++17 with GCC/Clang vector extensions: the compiler maps the 16-lane vectors to AVX-512, AVX2 or SSE
// (or NEON) for the machine it is built on. specjax builds it on first use (specjax/kernels/cpu_matmul.py).
#include <cstdint>
#include <vector>

#include "tiles.h"

namespace {

using namespace specjax_cpu;

constexpr int64_t kChunk = 64;  // weight rows per unit of work shared between threads

template <typename Kind, typename W>
void run(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  parallel_items(pool, chunks, true, [=](int64_t c) {
    const int64_t a = c * kChunk, b = std::min(N, a + kChunk);
    row_range<Kind>(x, w, y, M, K, N, a, b);
  });
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("small_matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K) return ffi::Error::InvalidArgument("small_matmul: x [M, K] and w [N, K] disagree on K");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (w.element_type() == ffi::F32) {
    run<F32Weights>(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(), M, K, N);
  } else if (w.element_type() == ffi::BF16) {
    std::vector<float> xs(static_cast<size_t>(M * K));
    deinterleave(x.typed_data(), xs.data(), M, K);
    run<BF16Weights>(pool, xs.data(), static_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), M, K, N);
  } else {
    return ffi::Error::InvalidArgument("small_matmul: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
