// specjax CPU kernel: y[M, N] = x[M, K] . dequantize(w)[N, K]^T where w is a GGUF tensor kept as the file stores
// it: each row is a run of ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; layouts as ggml-common.h
// defines them, the `gguf` package's quants.py being the readable description this code was checked against).
//
// Why: a 1.5B model kept in Q4_K reads 4.5 bits a weight; dequantizing it to bfloat16 reads 16. The kernel decodes
// each 32-value sub-block into float32 registers and multiplies it into the same register tiles, in the same k
// order and with the same horizontal sums as the float32 kernel (tiles.h). So:
//   - the result for one (token, weight row) does not depend on the number of tokens in the call: a plain decode
//     step and a verify block compute the same bits (exact greedy speculation);
//   - each decoded weight equals the reference dequantization bit for bit (every format's product of code and scale
//     is exact in float32 or rounds once, like the reference), so the product equals the float32 kernel run on the
//     dequantized weight.
// 4- and 5-bit codes are decoded through a per-sub-block table of their 16 or 32 possible values (one
// permutation per 16 weights instead of a convert and a multiply-add).
//
// Threads: chunks of 64 weight rows claimed from one atomic counter (tiles.h, parallel_items).
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "tiles.h"

namespace {

using namespace specjax_cpu;

constexpr int64_t kChunk = 64;


// 16 bytes zero-extended to 16 int32 lanes.
inline i32x16 bytes_u(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  i32x16 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  u8x16 c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector(c, i32x16);
#endif
}

// 16 bytes sign-extended to 16 int32 lanes.
inline i32x16 bytes_s(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  i32x16 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  return (bytes_u(p) ^ 0x80) - 0x80;
#endif
}

inline f32x16 to_f32(i32x16 v) {
#if defined(__AVX512F__)
  __m512i i;
  std::memcpy(&i, &v, sizeof(i));
  const __m512 f = _mm512_cvtepi32_ps(i);
  f32x16 out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
#else
  return __builtin_convertvector(v, f32x16);
#endif
}

// table[idx & 15] per lane.
inline f32x16 lookup16(f32x16 table, i32x16 idx) {
#if defined(__AVX512F__)
  __m512 t;
  __m512i i;
  std::memcpy(&t, &table, sizeof(t));
  std::memcpy(&i, &idx, sizeof(i));
  const __m512 f = _mm512_permutexvar_ps(i, t);
  f32x16 out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
#else
  return __builtin_shuffle(table, idx & 15);
#endif
}

// (lo ++ hi)[idx & 31] per lane.
inline f32x16 lookup32(f32x16 lo, f32x16 hi, i32x16 idx) {
#if defined(__AVX512F__)
  __m512 a, b;
  __m512i i;
  std::memcpy(&a, &lo, sizeof(a));
  std::memcpy(&b, &hi, sizeof(b));
  std::memcpy(&i, &idx, sizeof(i));
  const __m512 f = _mm512_permutex2var_ps(a, i, b);
  f32x16 out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
#else
  return __builtin_shuffle(lo, hi, idx & 31);
#endif
}

inline f32x16 iota16() { return f32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
inline i32x16 lane_index() { return i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// The values a code takes in one sub-block: (first + i) * scale + offset for lanes i in [0, 16). The product is
// exact in every format (a code of at most 5 bits times a scale of at most 17 significant bits), so the one
// rounding is the addition's, as in the reference, whether or not the compiler fuses the two into one FMA.
inline f32x16 table16(float scale, float offset, float first) {
  const f32x16 n = iota16() + first;
  return n * scale + offset;
}

// Bit b of a little-endian 32-bit word per lane i, for bits start + i, moved to bit 4 (the 5th code bit).
inline i32x16 high_bits(uint32_t word, int start) {
  const i32x16 w = i32x16{} + int32_t(word >> start);
  return ((w >> lane_index()) & 1) << 4;
}

// ------------------------------------------------------------------------------------------------ the formats
// Each format: kValues per block and kBytes per block; Scales, decoded once per block and row; Sub, what one
// 32-value sub-block j needs (its value table, or its scales), made from Scales; half(b, sub, j, h): the 16
// float32 weights h (0: values 0-15, 1: values 16-31) of sub-block j.

struct Q4_0 {
  static constexpr int kValues = 32, kBytes = 18;
  struct Scales { float d; };
  struct Sub { f32x16 t; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); }
  static void sub(const Scales& s, int, Sub& u) { u.t = table16(s.d, 0.0f, -8.0f); }
  static f32x16 half(const uint8_t* b, const Sub& u, int, int h) { return lookup16(u.t, bytes_u(b + 2) >> (4 * h)); }
};

struct Q4_1 {
  static constexpr int kValues = 32, kBytes = 20;
  struct Scales { float d, m; };
  struct Sub { f32x16 t; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); s.m = half_to_float(b + 2); }
  static void sub(const Scales& s, int, Sub& u) { u.t = table16(s.d, s.m, 0.0f); }
  static f32x16 half(const uint8_t* b, const Sub& u, int, int h) { return lookup16(u.t, bytes_u(b + 4) >> (4 * h)); }
};

struct Q5_0 {
  static constexpr int kValues = 32, kBytes = 22;
  struct Scales { float d; uint32_t qh; };
  struct Sub { f32x16 lo, hi; uint32_t qh; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); std::memcpy(&s.qh, b + 2, 4); }
  static void sub(const Scales& s, int, Sub& u) {
    u.lo = table16(s.d, 0.0f, -16.0f);
    u.hi = table16(s.d, 0.0f, 0.0f);
    u.qh = s.qh;
  }
  static f32x16 half(const uint8_t* b, const Sub& u, int, int h) {
    return lookup32(u.lo, u.hi, ((bytes_u(b + 6) >> (4 * h)) & 15) | high_bits(u.qh, 16 * h));
  }
};

struct Q5_1 {
  static constexpr int kValues = 32, kBytes = 24;
  struct Scales { float d, m; uint32_t qh; };
  struct Sub { f32x16 lo, hi; uint32_t qh; };
  static void scales(const uint8_t* b, Scales& s) {
    s.d = half_to_float(b);
    s.m = half_to_float(b + 2);
    std::memcpy(&s.qh, b + 4, 4);
  }
  static void sub(const Scales& s, int, Sub& u) {
    u.lo = table16(s.d, s.m, 0.0f);
    u.hi = table16(s.d, s.m, 16.0f);
    u.qh = s.qh;
  }
  static f32x16 half(const uint8_t* b, const Sub& u, int, int h) {
    return lookup32(u.lo, u.hi, ((bytes_u(b + 8) >> (4 * h)) & 15) | high_bits(u.qh, 16 * h));
  }
};

struct Q8_0 {
  static constexpr int kValues = 32, kBytes = 34;
  struct Scales { float d; };
  struct Sub { float d; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); }
  static void sub(const Scales& s, int, Sub& u) { u.d = s.d; }
  static f32x16 half(const uint8_t* b, const Sub& u, int, int h) { return to_f32(bytes_s(b + 2 + 16 * h)) * u.d; }
};

struct Q4_K {
  static constexpr int kValues = 256, kBytes = 144;
  struct Scales { float scale[8], offset[8]; };
  struct Sub { f32x16 t; };
  static void scales(const uint8_t* b, Scales& s) { k_scales(b, s.scale, s.offset); }
  static void sub(const Scales& s, int j, Sub& u) { u.t = table16(s.scale[j], s.offset[j], 0.0f); }
  static f32x16 half(const uint8_t* b, const Sub& u, int j, int h) {
    return lookup16(u.t, bytes_u(b + 16 + 32 * (j / 2) + 16 * h) >> (4 * (j & 1)));
  }
};

struct Q5_K {
  static constexpr int kValues = 256, kBytes = 176;
  struct Scales { float scale[8], offset[8]; };
  struct Sub { f32x16 lo, hi; };
  static void scales(const uint8_t* b, Scales& s) { k_scales(b, s.scale, s.offset); }
  static void sub(const Scales& s, int j, Sub& u) {
    u.lo = table16(s.scale[j], s.offset[j], 0.0f);
    u.hi = table16(s.scale[j], s.offset[j], 16.0f);
  }
  static f32x16 half(const uint8_t* b, const Sub& u, int j, int h) {
    const i32x16 low = (bytes_u(b + 48 + 32 * (j / 2) + 16 * h) >> (4 * (j & 1))) & 15;
    const i32x16 high = ((bytes_u(b + 16 + 16 * h) >> j) & 1) << 4;
    return lookup32(u.lo, u.hi, low | high);
  }
};

struct Q6_K {
  static constexpr int kValues = 256, kBytes = 210;
  // d times the int8 scale of each 16 values: exact (11 x 8 significant bits); times a 6-bit code it rounds
  // once, as the reference's (d * scale) * code does.
  struct Scales { float s[16]; };
  struct Sub { float s[2]; };
  static void scales(const uint8_t* b, Scales& s) {
    const f32x16 f = to_f32(bytes_s(b + 192)) * half_to_float(b + 208);
    std::memcpy(s.s, &f, sizeof(f));
  }
  static void sub(const Scales& s, int j, Sub& u) {
    u.s[0] = s.s[2 * j];
    u.s[1] = s.s[2 * j + 1];
  }
  static f32x16 half(const uint8_t* b, const Sub& u, int j, int h) {
    const int part = j / 4, jj = j % 4;
    const i32x16 low = (bytes_u(b + 64 * part + 32 * (jj & 1) + 16 * h) >> (4 * (jj >> 1))) & 15;
    const i32x16 high = ((bytes_u(b + 128 + 32 * part + 16 * h) >> (2 * jj)) & 3) << 4;
    return to_f32((low | high) - 32) * u.s[h];
  }
};

// R weight rows x TC token rows of float32 accumulators. Per block, each row's scales are decoded once; per
// 32-value sub-block, the 16 low values of every row are decoded and multiplied into all TC tokens, then the 16
// high ones: each accumulator lane sees k in increasing order, as the float32 kernel's does.
template <typename F>
struct BlockWeights {
  template <int R, int TC>
  static void tile(const float* __restrict x, const uint8_t* __restrict w, float* __restrict y, int64_t K,
                   int64_t N, int64_t o) {
    const int64_t blocks = K / F::kValues, row_bytes = blocks * F::kBytes;
    f32x16 acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) acc[r][t] = f32x16{};
    for (int64_t g = 0; g < blocks; ++g) {
      typename F::Scales s[R];
      const uint8_t* b[R];
      for (int r = 0; r < R; ++r) {
        b[r] = w + (o + r) * row_bytes + g * F::kBytes;
        for (int off = 0; off < F::kBytes; off += 64) __builtin_prefetch(b[r] + R * row_bytes + off, 0, 2);
        F::scales(b[r], s[r]);
      }
      for (int j = 0; j < F::kValues / 32; ++j) {
        const int64_t k = g * F::kValues + 32 * j;
        typename F::Sub u[R];
        for (int r = 0; r < R; ++r) F::sub(s[r], j, u[r]);
        for (int h = 0; h < 2; ++h) {
          f32x16 wv[R];
          for (int r = 0; r < R; ++r) wv[r] = F::half(b[r], u[r], j, h);
          for (int t = 0; t < TC; ++t) {
            const f32x16 xv = load_f32(x + t * K + k + 16 * h);
            for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) y[t * N + o + r] = hsum(acc[r][t]);
  }
};

template <typename F>
void run(ffi::ThreadPool& pool, const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  parallel_items(pool, chunks, true, [=](int64_t c) {
    const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
    row_range<BlockWeights<F>>(x, w, y, M, K, N, lo, hi);
  });
}

// ggml type ids (ggml.h's enum ggml_type).
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

bool layout(int64_t type, int64_t& values, int64_t& bytes) {
  switch (type) {
    case kQ4_0: values = Q4_0::kValues; bytes = Q4_0::kBytes; return true;
    case kQ4_1: values = Q4_1::kValues; bytes = Q4_1::kBytes; return true;
    case kQ5_0: values = Q5_0::kValues; bytes = Q5_0::kBytes; return true;
    case kQ5_1: values = Q5_1::kValues; bytes = Q5_1::kBytes; return true;
    case kQ8_0: values = Q8_0::kValues; bytes = Q8_0::kBytes; return true;
    case kQ4_K: values = Q4_K::kValues; bytes = Q4_K::kBytes; return true;
    case kQ5_K: values = Q5_K::kValues; bytes = Q5_K::kBytes; return true;
    case kQ6_K: values = Q6_K::kValues; bytes = Q6_K::kBytes; return true;
    default: return false;
  }
}

ffi::Error GgufMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks,
                          ffi::ResultBuffer<ffi::F32> y, int64_t type) {
  const auto xd = x.dimensions();
  const auto bd = blocks.dimensions();
  if (xd.size() != 2 || bd.size() != 2) return ffi::Error::InvalidArgument("gguf_matmul: x and blocks must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = bd[0];
  int64_t values = 0, bytes = 0;
  if (!layout(type, values, bytes)) return ffi::Error::InvalidArgument("gguf_matmul: unsupported ggml type");
  if (K % values) return ffi::Error::InvalidArgument("gguf_matmul: K is not a whole number of blocks");
  if (bd[1] != (K / values) * bytes) return ffi::Error::InvalidArgument("gguf_matmul: row bytes disagree with K");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const uint8_t* wp = blocks.typed_data();
  float* yp = y->typed_data();
  switch (type) {
    case kQ4_0: run<Q4_0>(pool, xp, wp, yp, M, K, N); break;
    case kQ4_1: run<Q4_1>(pool, xp, wp, yp, M, K, N); break;
    case kQ5_0: run<Q5_0>(pool, xp, wp, yp, M, K, N); break;
    case kQ5_1: run<Q5_1>(pool, xp, wp, yp, M, K, N); break;
    case kQ8_0: run<Q8_0>(pool, xp, wp, yp, M, K, N); break;
    case kQ4_K: run<Q4_K>(pool, xp, wp, yp, M, K, N); break;
    case kQ5_K: run<Q5_K>(pool, xp, wp, yp, M, K, N); break;
    case kQ6_K: run<Q6_K>(pool, xp, wp, yp, M, K, N); break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type"));
