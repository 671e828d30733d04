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
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kRows = 4;         // weight rows per register tile
constexpr int kMaxTokens = 6;    // token rows per register tile: 4 x 6 accumulators + 4 weights + 1 input
constexpr int64_t kChunk = 64;   // weight rows per unit of work shared between threads

// A halving tree: 4 dependent vector adds. A left-to-right loop over the lanes would be a chain of 16 dependent
// scalar adds per accumulator, which at K = 576 costs more than the tile's multiply-adds.
inline float hsum(f32x16 v) {
  typedef float f32x8 __attribute__((vector_size(32)));
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 weights: one 16-wide step covers 16 consecutive k.
struct F32Weights {
  static constexpr int kStep = kLanes;
  template <int R, int TC>
  static void tile(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K,
                   int64_t N, int64_t o) {
    f32x16 acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) acc[r][t] = f32x16{};
    const int64_t kv = K - K % kStep;
    for (int64_t k = 0; k < kv; k += kStep) {
      f32x16 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load_f32(w + (o + r) * K + k);
      for (int t = 0; t < TC; ++t) {
        const f32x16 xv = load_f32(x + t * K + k);
        for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) {
        float s = hsum(acc[r][t]);
        for (int64_t k = kv; k < K; ++k) s += x[t * K + k] * w[(o + r) * K + k];
        y[t * N + o + r] = s;
      }
  }
};

// bfloat16 weights: one step loads 32 consecutive weights as 16 32-bit lanes. Shifting each lane left by 16 gives
// the even-k weights as float32, masking off its low half gives the odd-k ones: no shuffles, which would
// serialize on one execution port. The input is pre-split the same way (xe: even k, xo: odd k; see deinterleave).
struct BF16Weights {
  static constexpr int kStep = 2 * kLanes;
  template <int R, int TC>
  static void tile(const float* __restrict xs, const uint16_t* __restrict w, float* __restrict y, int64_t K,
                   int64_t N, int64_t o) {
    const int64_t kv = K - K % kStep;
    // Row t of the split input (stride K): even k at [0, kv/2), odd k at [kv/2, kv), the tail at [kv, K).
    const float* __restrict xe = xs;
    const float* __restrict xo = xs + kv / 2;
    const float* __restrict xt = xs + kv;
    f32x16 acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) acc[r][t] = f32x16{};
    const u32x16 hi_mask = u32x16{} + 0xFFFF0000u;
    for (int64_t k = 0; k < kv; k += kStep) {
      f32x16 we[R], wo[R];
      for (int r = 0; r < R; ++r) {
        u32x16 u;
        std::memcpy(&u, w + (o + r) * K + k, sizeof(u));
        const u32x16 e = u << 16, d = u & hi_mask;
        std::memcpy(&we[r], &e, sizeof(e));
        std::memcpy(&wo[r], &d, sizeof(d));
      }
      const int64_t j = k / 2;
      for (int t = 0; t < TC; ++t) {
        const f32x16 xev = load_f32(xe + t * K + j), xov = load_f32(xo + t * K + j);
        for (int r = 0; r < R; ++r) acc[r][t] += we[r] * xev + wo[r] * xov;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) {
        float s = hsum(acc[r][t]);
        for (int64_t k = kv; k < K; ++k) s += xt[t * K + (k - kv)] * bf16_to_f32(w[(o + r) * K + k]);
        y[t * N + o + r] = s;
      }
  }
};

// Rewrites each input row [K] as [even k of the vector part, odd k of the vector part, tail]: the order the
// bfloat16 tile reads. Same row length K, so row t still starts at t * K.
void deinterleave(const float* x, float* out, int64_t M, int64_t K) {
  const int64_t kv = K - K % BF16Weights::kStep;
  for (int64_t t = 0; t < M; ++t) {
    const float* src = x + t * K;
    float* dst = out + t * K;
    for (int64_t b = 0; b < kv; b += BF16Weights::kStep)
      for (int i = 0; i < kLanes; ++i) {
        dst[b / 2 + i] = src[b + 2 * i];
        dst[kv / 2 + b / 2 + i] = src[b + 2 * i + 1];
      }
    for (int64_t k = kv; k < K; ++k) dst[k] = src[k];
  }
}

// All M token rows against weight rows [o, o + R): token rows go in register tiles of at most kMaxTokens, while the
// R weight rows stay in L1 between tiles, so memory streams each weight row once.
template <typename Kind, int R, typename W>
void rows_tile(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t o) {
  const int64_t tiles = (M + kMaxTokens - 1) / kMaxTokens;
  int64_t t0 = 0;
  for (int64_t c = 0; c < tiles; ++c) {
    const int tc = int((M - t0) / (tiles - c));  // even split: 13 tokens -> 5 + 4 + 4, not 6 + 6 + 1
    const float* xx = x + t0 * K;
    float* yy = y + t0 * N;
    switch (tc) {
      case 1: Kind::template tile<R, 1>(xx, w, yy, K, N, o); break;
      case 2: Kind::template tile<R, 2>(xx, w, yy, K, N, o); break;
      case 3: Kind::template tile<R, 3>(xx, w, yy, K, N, o); break;
      case 4: Kind::template tile<R, 4>(xx, w, yy, K, N, o); break;
      case 5: Kind::template tile<R, 5>(xx, w, yy, K, N, o); break;
      default: Kind::template tile<R, 6>(xx, w, yy, K, N, o); break;
    }
    t0 += tc;
  }
}

template <typename Kind, typename W>
void row_range(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t a, int64_t b) {
  int64_t o = a;
  for (; o + kRows <= b; o += kRows) rows_tile<Kind, kRows>(x, w, y, M, K, N, o);
  for (; o < b; ++o) rows_tile<Kind, 1>(x, w, y, M, K, N, o);
}

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
};

template <typename Kind, typename W>
void run(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  auto job = std::make_shared<Job>();
  job->chunks = (N + kChunk - 1) / kChunk;
  auto work = [=] {
    int64_t c;
    while ((c = job->next.fetch_add(1, std::memory_order_relaxed)) < job->chunks) {
      const int64_t a = c * kChunk, b = std::min(N, a + kChunk);
      row_range<Kind>(x, w, y, M, K, N, a, b);
      job->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
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
