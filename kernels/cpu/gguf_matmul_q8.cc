// specjax CPU kernel: y[M, N] = q8(x)[M, K] . dequantize(w)[N, K]^T for GGUF weights kept as stored (Q4_K, Q6_K,
// Q5_0, Q8_0), with each token's activations rounded to int8 (one scale per 32 values, per 256 for the
// K-quants), as llama.cpp's CPU backend does:
// the products of codes and activations then run as integer dot products (AVX-512 VNNI: 4 products a lane and
// instruction), several times fewer instructions than decoding every weight to float32 (gguf_matmul.cc).
//
// It changes the model's numbers (activations are rounded, as in llama.cpp), so it is a separate implementation
// in the kernel table. Greedy speculation stays exact because nothing depends on the other rows of a call:
//   - a token's int8 activations, scales and sums are a function of that token's row only;
//   - integer dot products are exact; each 32-value sub-block's integer sum is converted and multiplied into a
//     float32 accumulator in a fixed order per (token, weight row), the same whatever the number of tokens;
// so a plain decode step, a verify block and a draft step give each token the same bits.
//
// Per sub-block j of 32 values and token t (dx: the activation scale, xq: the int8 activations):
//   codes c in [0, 2^b) as unsigned bytes, the format's value is s * (c - o) (- m for Q4_K), so
//   sum_i w_i x_i = s dx_t (sum_i c_i xq_i - o sum_i xq_i) - m dx_t sum_i xq_i.
// The offset o (32 for Q6_K, 16 for Q5_0, 128 for Q8_0 whose signed codes are shifted to unsigned) enters as the
// dot product's initial value -o * (sum of each lane's 4 activations), so it costs no instruction of its own.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "tiles.h"

namespace {

using namespace specjax_cpu;

constexpr int64_t kChunk = 64;

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t s8x32 __attribute__((vector_size(32)));

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define SPECJAX_Q8_VNNI 1
#endif

// acc + per lane i: sum over k < 4 of c[4i + k] (unsigned) * x[4i + k] (signed): exact in int32.
inline i32x8 dot4(i32x8 acc, u8x32 c, s8x32 x) {
#if defined(SPECJAX_Q8_VNNI)
  __m256i a, cc, xx;
  std::memcpy(&a, &acc, 32);
  std::memcpy(&cc, &c, 32);
  std::memcpy(&xx, &x, 32);
  const __m256i r = _mm256_dpbusd_epi32(a, cc, xx);
  i32x8 out;
  std::memcpy(&out, &r, 32);
  return out;
#else
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 4; ++k) acc[i] += int32_t(c[4 * i + k]) * int32_t(x[4 * i + k]);
  return acc;
#endif
}

inline f32x8 to_f32x8(i32x8 v) { return __builtin_convertvector(v, f32x8); }

inline float hsum8(f32x8 v) {
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

inline u8x32 load32(const uint8_t* p) {
  u8x32 v;
  std::memcpy(&v, p, 32);
  return v;
}

// --------------------------------------------------------------------------------------- the activations
// One token row of K values, rounded per 32 values: dx = max|x| / 127, xq = round-to-nearest-even(x / dx).
struct Q8Row {
  const int8_t* xq;     // [K]
  const float* dx;      // [K / Q]: one scale per Q = 32 values (Q5_0, Q8_0) or 256 (the K-quants)
  const int16_t* sum32; // [K / 32]: the sum of each 32 xq (Q4_K's minimums)
  const int32_t* neg4;  // [K / 4]: -(sum of each 4 consecutive xq), the offset's initial value
};

// One token row of K values, rounded per `block` values (32, or 256 for the K-quants, whose sub-block scales
// then multiply integer sums: llama.cpp's Q8_K): dx = max|x| / 127, xq = round-to-nearest-even(x * (1 / dx)).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t block, int8_t* xq, float* dx, int16_t* sum32,
                   int32_t* neg4) {
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* v = x + t * K + block * b;
      float amax = 0.0f;
      for (int64_t i = 0; i < block; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = xq + t * K + block * b;
      for (int64_t i = 0; i < block; ++i) {
        float r = std::nearbyint(v[i] * id);
        r = std::fmin(127.0f, std::fmax(-127.0f, r));
        q[i] = int8_t(r);
      }
      dx[t * (K / block) + b] = d;
    }
    const int8_t* q = xq + t * K;
    for (int64_t l = 0; l < K / 4; ++l) neg4[t * (K / 4) + l] = -(q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    for (int64_t b = 0; b < K / 32; ++b) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[32 * b + i];
      sum32[t * (K / 32) + b] = int16_t(sum);
    }
  }
}

// ------------------------------------------------------------------------------------------- the formats
// Each: kValues / kBytes per block; Scales per block and row; sub(b, s, j, out): sub-block j's 32 codes as
// unsigned bytes and its lane scales (8 floats: lanes 4i..4i+3 of the dot product hold values 4i..4i+3), and
// kShift: the code offset o = 2^kShift (0: none); kMin: whether the format subtracts a minimum (Q4_K).

#if defined(SPECJAX_Q8_VNNI)
inline u8x32 from_m256(__m256i v) {
  u8x32 out;
  std::memcpy(&out, &v, 32);
  return out;
}
inline __m256i to_m256(u8x32 v) {
  __m256i out;
  std::memcpy(&out, &v, 32);
  return out;
}
// Bytes shifted right by n within 16-bit lanes, then masked: x86 has no byte shift.
inline u8x32 shr_mask(u8x32 v, int n, int mask) {
  return from_m256(_mm256_and_si256(_mm256_srli_epi16(to_m256(v), n), _mm256_set1_epi8(char(mask))));
}
inline u8x32 shl_mask(u8x32 v, int n, int mask) {
  return from_m256(_mm256_and_si256(_mm256_slli_epi16(to_m256(v), n), _mm256_set1_epi8(char(mask))));
}
#else
inline u8x32 shr_mask(u8x32 v, int n, int mask) { return (v >> n) & (u8x32{} + uint8_t(mask)); }
inline u8x32 shl_mask(u8x32 v, int n, int mask) { return (v << n) & (u8x32{} + uint8_t(mask)); }
#endif
inline u8x32 nibbles_lo(u8x32 v) { return v & 15; }
inline u8x32 nibbles_hi(u8x32 v) { return shr_mask(v, 4, 15); }

// The K-quants: activations share one scale per 256 values, so a superblock's 8 sub-blocks sum in integers.
// Two sub-blocks' dot products (each lane below 2^15 in magnitude) are packed to 16 bits and multiplied by their
// integer sub-block scales in one multiply-add (llama.cpp's maddubs / madd idea, with VNNI's dot products), and
// each superblock's integer sum is converted and scaled once per (row, token).
typedef int16_t i16x16 __attribute__((vector_size(32)));

inline i32x8 pack_madd(i32x8 pa, i32x8 pb, i16x16 scale) {
#if defined(SPECJAX_Q8_VNNI)
  __m256i a, b, sc;
  std::memcpy(&a, &pa, 32);
  std::memcpy(&b, &pb, 32);
  std::memcpy(&sc, &scale, 32);
  const __m256i r = _mm256_madd_epi16(_mm256_packs_epi32(a, b), sc);
  i32x8 out;
  std::memcpy(&out, &r, 32);
  return out;
#else
  // The same integers: packs_epi32 interleaves 4-lane halves ([a0-3, b0-3, a4-7, b4-7]); no value saturates.
  const int32_t packed[16] = {pa[0], pa[1], pa[2], pa[3], pb[0], pb[1], pb[2], pb[3],
                              pa[4], pa[5], pa[6], pa[7], pb[4], pb[5], pb[6], pb[7]};
  i32x8 out;
  for (int k = 0; k < 8; ++k) out[k] = packed[2 * k] * scale[2 * k] + packed[2 * k + 1] * scale[2 * k + 1];
  return out;
#endif
}

// 16 lanes of scale, lanes 4i..4i+3 all = s[idx[i]] (i < 4; s holds 16 values): the layout pack_madd multiplies by.
inline i16x16 spread4(const int16_t* s, int a, int b, int c, int d) {
#if defined(SPECJAX_Q8_VNNI)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i idx = _mm256_setr_epi16(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d);
  const __m256i r = _mm256_permutexvar_epi16(idx, v);
  i16x16 out;
  std::memcpy(&out, &r, 32);
  return out;
#else
  return i16x16{s[a], s[a], s[a], s[a], s[b], s[b], s[b], s[b], s[c], s[c], s[c], s[c], s[d], s[d], s[d], s[d]};
#endif
}

struct Q4_K8 {
  static constexpr int kValues = 256, kBytes = 144, kShift = 0;
  static constexpr bool kMin = true;
  struct Scales { i16x16 pair[4]; int16_t m[8]; float d, dmin; };
  static void scales(const uint8_t* b, Scales& s) {
    int16_t sc[16];
    k_scales_int(b, sc, s.m);
    // pair p = sub-blocks (2p, 2p + 1); a sub-block's lanes 0-3 and 4-7 pack to positions 0-3 / 8-11 (first)
    // and 4-7 / 12-15 (second).
    for (int p = 0; p < 4; ++p) s.pair[p] = spread4(sc, 2 * p, 2 * p + 1, 2 * p, 2 * p + 1);
    s.d = half_to_float(b);
    s.dmin = half_to_float(b + 2);
  }
  static u8x32 codes(const uint8_t* b, int j) {
    const u8x32 v = load32(b + 16 + 32 * (j / 2));
    return (j & 1) ? nibbles_hi(v) : nibbles_lo(v);
  }
};

struct Q6_K8 {
  static constexpr int kValues = 256, kBytes = 210, kShift = 5;
  static constexpr bool kMin = false;
  struct Scales { i16x16 pair[4]; int16_t m[8]; float d, dmin; };
  static void scales(const uint8_t* b, Scales& s) {
    int16_t sc[16];
#if defined(SPECJAX_Q8_VNNI)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
#else
    for (int i = 0; i < 16; ++i) sc[i] = int8_t(b[192 + i]);
#endif
    // group g = 16 values; sub-block j holds groups 2j (its lanes 0-3) and 2j + 1 (lanes 4-7).
    for (int p = 0; p < 4; ++p) s.pair[p] = spread4(sc, 4 * p, 4 * p + 2, 4 * p + 1, 4 * p + 3);
    s.d = half_to_float(b + 208);
    s.dmin = 0.0f;
  }
  static u8x32 codes(const uint8_t* b, int j) {
    const int part = j / 4, jj = j % 4;
    const u8x32 ql = load32(b + 64 * part + 32 * (jj & 1));
    const u8x32 qh = load32(b + 128 + 32 * part);
    const u8x32 low = (jj >> 1) ? nibbles_hi(ql) : nibbles_lo(ql);
    // bits 2jj, 2jj + 1 of qh moved to bits 4, 5
    const u8x32 high = 2 * jj <= 4 ? shl_mask(qh, 4 - 2 * jj, 0x30) : shr_mask(qh, 2 * jj - 4, 0x30);
    return low | high;
  }
};

// R weight rows x TC tokens of a K-quant. Per superblock and (row, token): an int32 accumulator over the 4
// sub-block pairs, then one conversion times d * dx into the float32 accumulator (and Q4_K's minimum term,
// dmin * dx * sum_j m_j * sum32_j, into a scalar one), in the same order whatever the number of tokens.
template <typename F>
struct Q8KWeights {
  template <int R, int TC>
  static void tile(const Q8Row* __restrict xr, const uint8_t* __restrict w, float* __restrict y, int64_t K,
                   int64_t N, int64_t o) {
    const int64_t blocks = K / F::kValues, row_bytes = blocks * F::kBytes;
    f32x8 acc[R][TC];
    float macc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) {
        acc[r][t] = f32x8{};
        macc[r][t] = 0.0f;
      }
    for (int64_t g = 0; g < blocks; ++g) {
      typename F::Scales s[R];
      const uint8_t* b[R];
      for (int r = 0; r < R; ++r) {
        b[r] = w + (o + r) * row_bytes + g * F::kBytes;
        for (int off = 0; off < F::kBytes; off += 64) __builtin_prefetch(b[r] + R * row_bytes + off, 0, 2);
        F::scales(b[r], s[r]);
      }
      i32x8 isum[R][TC];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < TC; ++t) isum[r][t] = i32x8{};
      for (int p = 0; p < 4; ++p) {
        const int64_t ka = g * F::kValues + 64 * p, kb = ka + 32;
        u8x32 ca[R], cb[R];
        for (int r = 0; r < R; ++r) {
          ca[r] = F::codes(b[r], 2 * p);
          cb[r] = F::codes(b[r], 2 * p + 1);
        }
        for (int t = 0; t < TC; ++t) {
          s8x32 xa, xb;
          std::memcpy(&xa, xr[t].xq + ka, 32);
          std::memcpy(&xb, xr[t].xq + kb, 32);
          i32x8 ia = i32x8{}, ib = i32x8{};
          if constexpr (F::kShift > 0) {
            std::memcpy(&ia, xr[t].neg4 + ka / 4, 32);
            std::memcpy(&ib, xr[t].neg4 + kb / 4, 32);
            ia = ia << F::kShift;
            ib = ib << F::kShift;
          }
          for (int r = 0; r < R; ++r)
            isum[r][t] += pack_madd(dot4(ia, ca[r], xa), dot4(ib, cb[r], xb), s[r].pair[p]);
        }
      }
      for (int t = 0; t < TC; ++t) {
        const float dx = xr[t].dx[g];
        const int16_t* s32 = xr[t].sum32 + g * (F::kValues / 32);
        for (int r = 0; r < R; ++r) {
          acc[r][t] += to_f32x8(isum[r][t]) * (s[r].d * dx);
          if constexpr (F::kMin) {
            int32_t ms = 0;
            for (int j = 0; j < 8; ++j) ms += int32_t(s[r].m[j]) * int32_t(s32[j]);
            macc[r][t] += float(ms) * (s[r].dmin * dx);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) y[t * N + o + r] = hsum8(acc[r][t]) - macc[r][t];
  }
};

struct Q5_08 {
  static constexpr int kValues = 32, kBytes = 22, kShift = 4;
  struct Scales { float d; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); }
  static u8x32 codes(const uint8_t* b, int) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
#if defined(SPECJAX_Q8_VNNI)
    // values 0-15: low nibbles, 16-31: high nibbles; bit i of qh is the 5th bit of value i.
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(qs), _mm_srli_epi16(qs, 4), 1);
    const __m256i low = _mm256_and_si256(both, _mm256_set1_epi8(15));
    return from_m256(_mm256_or_si256(low, _mm256_maskz_mov_epi8(__mmask32(qh), _mm256_set1_epi8(16))));
#else
    uint8_t qs[16];
    std::memcpy(qs, b + 6, 16);
    u8x32 c;
    for (int i = 0; i < 16; ++i) {
      c[i] = uint8_t((qs[i] & 15) | (((qh >> i) & 1) << 4));
      c[i + 16] = uint8_t((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
    return c;
#endif
  }
  static f32x8 lane_scale(const Scales& s, int) { return f32x8{} + s.d; }
};

struct Q8_08 {
  static constexpr int kValues = 32, kBytes = 34, kShift = 7;
  struct Scales { float d; };
  static void scales(const uint8_t* b, Scales& s) { s.d = half_to_float(b); }
  static u8x32 codes(const uint8_t* b, int) { return load32(b + 2) ^ 0x80; }  // int8 code + 128
  static f32x8 lane_scale(const Scales& s, int) { return f32x8{} + s.d; }
};

// R weight rows x TC tokens. Per sub-block: each row's codes once, then for every token one integer dot product
// (started from the offset's correction), converted and multiplied by the lane scales times the token's dx into
// that (row, token)'s accumulator; Q4_K's minimum term goes to a scalar accumulator in the same order.
template <typename F>
struct Q8Weights {
  template <int R, int TC>
  static void tile(const Q8Row* __restrict xr, const uint8_t* __restrict w, float* __restrict y, int64_t K,
                   int64_t N, int64_t o) {
    const int64_t blocks = K / F::kValues, row_bytes = blocks * F::kBytes;
    f32x8 acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) acc[r][t] = f32x8{};
    for (int64_t g = 0; g < blocks; ++g) {
      typename F::Scales s[R];
      const uint8_t* b[R];
      for (int r = 0; r < R; ++r) {
        b[r] = w + (o + r) * row_bytes + g * F::kBytes;
        for (int off = 0; off < F::kBytes; off += 64) __builtin_prefetch(b[r] + R * row_bytes + off, 0, 2);
        F::scales(b[r], s[r]);
      }
      for (int j = 0; j < F::kValues / 32; ++j) {
        const int64_t k = g * F::kValues + 32 * j, blk = k / 32;
        u8x32 c[R];
        f32x8 ls[R];
        for (int r = 0; r < R; ++r) {
          c[r] = F::codes(b[r], j);
          ls[r] = F::lane_scale(s[r], j);
        }
        for (int t = 0; t < TC; ++t) {
          s8x32 xv;
          std::memcpy(&xv, xr[t].xq + k, 32);
          i32x8 init = i32x8{};
          if constexpr (F::kShift > 0) {
            std::memcpy(&init, xr[t].neg4 + k / 4, 32);
            init = init << F::kShift;
          }
          const float dx = xr[t].dx[blk];
          for (int r = 0; r < R; ++r) {
            const i32x8 p = dot4(init, c[r], xv);
            acc[r][t] += to_f32x8(p) * (ls[r] * dx);

          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) y[t * N + o + r] = hsum8(acc[r][t]);
  }
};

template <typename W>
void run(ffi::ThreadPool& pool, const Q8Row* xr, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  parallel_items(pool, chunks, true, [=](int64_t c) {
    const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
    row_range<W>(xr, w, y, M, K, N, lo, hi, 1);  // one row descriptor per token
  });
}

enum : int64_t { kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

ffi::Error GgufMatmulQ8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks,
                            ffi::ResultBuffer<ffi::F32> y, int64_t type) {
  const auto xd = x.dimensions();
  const auto bd = blocks.dimensions();
  if (xd.size() != 2 || bd.size() != 2)
    return ffi::Error::InvalidArgument("gguf_matmul_q8: x and blocks must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = bd[0];
  int64_t values, bytes;
  switch (type) {
    case kQ5_0: values = 32; bytes = 22; break;
    case kQ8_0: values = 32; bytes = 34; break;
    case kQ4_K: values = 256; bytes = 144; break;
    case kQ6_K: values = 256; bytes = 210; break;
    default: return ffi::Error::InvalidArgument("gguf_matmul_q8: type must be Q5_0, Q8_0, Q4_K or Q6_K");
  }
  if (K % values) return ffi::Error::InvalidArgument("gguf_matmul_q8: K is not a whole number of blocks");
  if (bd[1] != (K / values) * bytes) return ffi::Error::InvalidArgument("gguf_matmul_q8: row bytes disagree with K");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t block = values == 256 ? 256 : 32;  // the activation scale's span
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / block));
  std::vector<int16_t> sum32(M * (K / 32));
  std::vector<int32_t> neg4(M * (K / 4));
  quantize_rows(x.typed_data(), M, K, block, xq.data(), dx.data(), sum32.data(), neg4.data());
  std::vector<Q8Row> rows(M);
  for (int64_t t = 0; t < M; ++t)
    rows[t] = Q8Row{xq.data() + t * K, dx.data() + t * (K / block), sum32.data() + t * (K / 32),
                    neg4.data() + t * (K / 4)};
  const uint8_t* wp = blocks.typed_data();
  float* yp = y->typed_data();
  switch (type) {
    case kQ5_0: run<Q8Weights<Q5_08>>(pool, rows.data(), wp, yp, M, K, N); break;
    case kQ8_0: run<Q8Weights<Q8_08>>(pool, rows.data(), wp, yp, M, K, N); break;
    case kQ4_K: run<Q8KWeights<Q4_K8>>(pool, rows.data(), wp, yp, M, K, N); break;
    case kQ6_K: run<Q8KWeights<Q6_K8>>(pool, rows.data(), wp, yp, M, K, N); break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxGgufMatmulQ8, GgufMatmulQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("type"));
