// specjax CPU kernel: y[M, N] = x[M, K] . dequantize(w)[N, K]^T for weight-only quantized projections.
//
// Why it exists: XLA:CPU runs a product with an int8 or 4-bit weight by converting the whole weight to float32
// first (measured on SmolLM2's 30 layers of projections, one token: 157 ms against 17 ms for float32 weights), so
// quantized weights would be ten times slower instead of reading a quarter or an eighth of the bytes. This kernel
// widens the codes in registers, block by block, and multiplies the dequantized float32 values with the same
// register tiles, k order and horizontal sums as the float32 kernel (small_matmul.cc). So:
//   - a product reads the codes and scales only;
//   - the result for one (token, weight row) does not depend on how many tokens the call has, so plain decode
//     steps and verify blocks compute the same function (exact greedy speculation);
//   - it equals the float32 kernel run on the dequantized weight, up to how the compiler contracts the
//     dequantization itself (q4_1's code * scale + min).
//
// Formats (the `bits`, `group` and `has_min` attributes; codes [N, K] int8 for 8 bits, [N, K / 2] uint8 for 4 bits;
// scale and minimum [N, K / group], float32 or float16):
//   8 bits:               w[k] = code[k] * scale[k / group]                           (specjax int8, GGUF Q8_0)
//   4 bits, no minimum:   w[k] = (nibble[k] - 8) * scale[k / group]                   (GGUF Q4_0)
//   4 bits, minimum:      w[k] = nibble[k] * scale[k / group] + minimum[k / group]    (specjax int4, GGUF Q4_1)
// 4-bit codes follow GGUF's order inside every 32 values: byte j of a 32-block holds value j in its low nibble and
// value j + 16 in its high nibble. group is a multiple of 32 that divides K.
//
// Threads: as small_matmul.cc, chunks of 64 weight rows claimed from one atomic counter (tiles.h, parallel_items).
#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "tiles.h"

namespace {

using namespace specjax_cpu;

constexpr int64_t kChunk = 64;
constexpr int64_t kBlock = 32;

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// 16 codes widened to float32. With AVX-512 through the widening intrinsics; otherwise through int32 vectors (GCC 12
// compiles a direct char -> float __builtin_convertvector to 16 scalar conversions, and scalarizes the signed
// widening of a loaded byte vector too, hence the xor / subtract sign extension).
#if defined(__AVX512F__)
inline f32x16 int32_to_f32x16(__m512i v) {
  const __m512 f = _mm512_cvtepi32_ps(v);
  f32x16 out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
}
#endif

inline f32x16 widen_unsigned(const uint8_t* p, int shift, int mask) {
#if defined(__AVX512F__)
  return int32_to_f32x16(_mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), shift), _mm512_set1_epi32(mask)));
#else
  u8x16 c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector((__builtin_convertvector(c, i32x16) >> shift) & mask, f32x16);
#endif
}

inline f32x16 widen_signed(const uint8_t* p) {
#if defined(__AVX512F__)
  return int32_to_f32x16(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  u8x16 c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector((__builtin_convertvector(c, i32x16) ^ 0x80) - 0x80, f32x16);
#endif
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return half_to_float(v); }

// The weight operand of one product; S is float (specjax's own scales) or uint16_t (GGUF's float16 scales).
template <typename S>
struct QuantArgs {
  const uint8_t* codes;
  const S* scale;
  const S* minimum;
  int64_t group;
};

// One Kind per code width and scale type; HasMin only for 4 bits. tile<R, TC> mirrors F32Weights::tile (tiles.h):
// the weights of each 32-wide block are dequantized into registers (two 16-lane vectors per row), then multiplied
// into the R x TC accumulators in k order, 16 lanes at a time, as the float32 kernel does. Groups are the outer
// loop, so each row's scale is read once per group.
template <int Bits, bool HasMin, typename S>
struct QuantWeights {
  template <int R, int TC>
  static void tile(const float* __restrict x, const QuantArgs<S>* a, float* __restrict y, int64_t K, int64_t N,
                   int64_t o) {
    const int64_t row_bytes = Bits == 8 ? K : K / 2;
    const int64_t G = a->group, groups = K / G;
    f32x16 acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) acc[r][t] = f32x16{};
    for (int64_t g = 0; g < groups; ++g) {
      float s[R], m[R];
      for (int r = 0; r < R; ++r) {
        s[r] = to_float(a->scale[(o + r) * groups + g]);
        if constexpr (HasMin) m[r] = to_float(a->minimum[(o + r) * groups + g]);
      }
      for (int64_t k = g * G; k < (g + 1) * G; k += kBlock) {
        f32x16 lo[R], hi[R];
        prefetch_next_tile<R>(a->codes, row_bytes, o, Bits == 8 ? k : k / 2);
        for (int r = 0; r < R; ++r) {
          if constexpr (Bits == 8) {
            lo[r] = widen_signed(a->codes + (o + r) * row_bytes + k) * s[r];
            hi[r] = widen_signed(a->codes + (o + r) * row_bytes + k + 16) * s[r];
          } else {
            const uint8_t* c = a->codes + (o + r) * row_bytes + k / 2;
            const f32x16 l = widen_unsigned(c, 0, 15), h = widen_unsigned(c, 4, 15);
            if constexpr (HasMin) {
              lo[r] = l * s[r] + m[r];
              hi[r] = h * s[r] + m[r];
            } else {
              lo[r] = (l - 8.0f) * s[r];
              hi[r] = (h - 8.0f) * s[r];
            }
          }
        }
        for (int t = 0; t < TC; ++t) {
          const f32x16 xv = load_f32(x + t * K + k);
          for (int r = 0; r < R; ++r) acc[r][t] += lo[r] * xv;
        }
        for (int t = 0; t < TC; ++t) {
          const f32x16 xv = load_f32(x + t * K + k + 16);
          for (int r = 0; r < R; ++r) acc[r][t] += hi[r] * xv;
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TC; ++t) y[t * N + o + r] = hsum(acc[r][t]);
  }
};

template <typename Kind, typename S>
void run(ffi::ThreadPool& pool, const float* x, const QuantArgs<S>* a, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  parallel_items(pool, chunks, true, [=](int64_t c) {
    const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
    row_range<Kind>(x, a, y, M, K, N, lo, hi);
  });
}

template <typename S>
void dispatch(ffi::ThreadPool& pool, const float* x, const QuantArgs<S>& a, float* y, int64_t M, int64_t K,
              int64_t N, int64_t bits, bool has_min) {
  if (bits == 8) {
    run<QuantWeights<8, false, S>>(pool, x, &a, y, M, K, N);
  } else if (has_min) {
    run<QuantWeights<4, true, S>>(pool, x, &a, y, M, K, N);
  } else {
    run<QuantWeights<4, false, S>>(pool, x, &a, y, M, K, N);
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                           ffi::AnyBuffer scale, ffi::AnyBuffer minimum, ffi::ResultBuffer<ffi::F32> y,
                           int64_t bits, int64_t group, bool has_min) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul: x, codes and scale must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = cd[0];
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("quant_matmul: bits must be 8 or 4");
  if (has_min && bits != 4) return ffi::Error::InvalidArgument("quant_matmul: a minimum needs 4-bit codes");
  if (group <= 0 || group % kBlock || K % group)
    return ffi::Error::InvalidArgument("quant_matmul: group must be a multiple of 32 that divides K");
  if (cd[1] != (bits == 8 ? K : K / 2)) return ffi::Error::InvalidArgument("quant_matmul: codes disagree with K");
  if (sd[0] != N || sd[1] != K / group) return ffi::Error::InvalidArgument("quant_matmul: scale must be [N, K/group]");
  const bool half = scale.element_type() == ffi::F16;
  if (!half && scale.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("quant_matmul: scale must be float32 or float16");
  if (has_min && (minimum.element_type() != scale.element_type() || minimum.element_count() != N * (K / group)))
    return ffi::Error::InvalidArgument("quant_matmul: minimum must match scale");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const auto* codes_p = static_cast<const uint8_t*>(codes.untyped_data());
  if (half) {
    const QuantArgs<uint16_t> a{codes_p, static_cast<const uint16_t*>(scale.untyped_data()),
                                static_cast<const uint16_t*>(minimum.untyped_data()), group};
    dispatch(pool, x.typed_data(), a, y->typed_data(), M, K, N, bits, has_min);
  } else {
    const QuantArgs<float> a{codes_p, static_cast<const float*>(scale.untyped_data()),
                             static_cast<const float*>(minimum.untyped_data()), group};
    dispatch(pool, x.typed_data(), a, y->typed_data(), M, K, N, bits, has_min);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("has_min"));
