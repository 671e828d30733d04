// specjax CPU kernels: the register tiles and the thread split shared by small_matmul.cc and prefix_attention.cc.
//
// tile / rows_tile / row_range compute y[t, o] = x[t, :] . w[o, :] for a block of weight rows o, holding up to
// 4 rows x 6 tokens of float32 accumulators in registers; the float32 and bfloat16 weight kinds differ only in how
// a step of the K axis is loaded. parallel_items shares work items between the calling thread and XLA's intra-op
// pool.
#ifndef SPECJAX_KERNELS_CPU_TILES_H_
#define SPECJAX_KERNELS_CPU_TILES_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

namespace ffi = xla::ffi;

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kLanes = 16;
constexpr int kRows = 4;         // weight rows per register tile
constexpr int kMaxTokens = 6;    // token rows per register tile: 4 x 6 accumulators + 4 weights + 1 input

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

// Asks for the cache line of each of the next tile's R weight rows at the step this tile is at, into L2: one
// tile ahead, so the distance grows with K and the request is in flight while this tile computes. Without it a
// 2-6 token block cost 30-45% more than one token over the same weights (the hardware prefetchers alone keep too
// few lines in flight once the loop does more than one multiply-add per weight); with it the 30 layers'
// projections of SmolLM2 (451 MB float32, two threads) took 16.5-18 ms for 1-2 tokens and about 20 ms for 5,
// against 22-26 and 26-31 ms without (benchmark in reports/decode_cpu/prefetch/). Prefetching past the end of
// the weight is harmless: a prefetch never faults.
template <int R, typename W>
inline void prefetch_next_tile(const W* w, int64_t K, int64_t o, int64_t k) {
  for (int r = 0; r < R; ++r) __builtin_prefetch(w + (o + R + r) * K + k, 0, 2);
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
      prefetch_next_tile<R>(w, K, o, k);
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
      prefetch_next_tile<R>(w, K, o, k);
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
inline void deinterleave(const float* x, float* out, int64_t M, int64_t K) {
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
// x_stride: elements of X from one token row to the next (default K: float rows; the int8-activation kernel passes
// one row descriptor per token, stride 1).
template <typename Kind, int R, typename W, typename X = float>
void rows_tile(const X* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t o, int64_t x_stride = -1) {
  const int64_t xs = x_stride < 0 ? K : x_stride;
  const int64_t tiles = (M + kMaxTokens - 1) / kMaxTokens;
  int64_t t0 = 0;
  for (int64_t c = 0; c < tiles; ++c) {
    const int tc = int((M - t0) / (tiles - c));  // even split: 13 tokens -> 5 + 4 + 4, not 6 + 6 + 1
    const X* xx = x + t0 * xs;
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

template <typename Kind, typename W, typename X = float>
void row_range(const X* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t a, int64_t b,
               int64_t x_stride = -1) {
  int64_t o = a;
  for (; o + kRows <= b; o += kRows) rows_tile<Kind, kRows>(x, w, y, M, K, N, o, x_stride);
  for (; o < b; ++o) rows_tile<Kind, 1>(x, w, y, M, K, N, o, x_stride);
}

// Runs fn(i) for every item i in [0, items). Items are claimed from one atomic counter by the calling thread and,
// when `threaded`, by helpers scheduled on XLA's intra-op pool. The caller then waits only for items already
// claimed, which are running, so it never waits on a helper that could not start because XLA keeps every pool
// thread busy with other independent operations (a first version that waited for its helpers deadlocked so).
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t items = 0;
};

template <typename Fn>
void parallel_items(ffi::ThreadPool& pool, int64_t items, bool threaded, Fn fn) {
  if (items <= 0) return;
  auto job = std::make_shared<Job>();
  job->items = items;
  auto work = [job, fn] {
    int64_t c;
    while ((c = job->next.fetch_add(1, std::memory_order_relaxed)) < job->items) {
      fn(c);
      job->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers =
      threaded ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1 : 0;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (job->done.load(std::memory_order_acquire) < job->items) std::this_thread::yield();
}

}  // namespace specjax_cpu

#endif  // SPECJAX_KERNELS_CPU_TILES_H_
