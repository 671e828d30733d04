// specjax CPU kernels: decoding shared by the GGUF block products (gguf_matmul.cc, gguf_matmul_q8.cc) and the
// float16 scales of quant_matmul.cc.
#ifndef SPECJAX_KERNELS_CPU_GGUF_BLOCKS_H_
#define SPECJAX_KERNELS_CPU_GGUF_BLOCKS_H_

#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace specjax_cpu {

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16v __attribute__((vector_size(64)));

// IEEE half to float, exact for every value (normals, subnormals, zeros, infinities, NaNs).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400u));
    bits = sign | (uint32_t(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// The same from two little-endian bytes (a GGUF block's scale, at any alignment).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// The 6-bit scales and minimums of Q4_K and Q5_K, 8 pairs packed in 12 bytes, as (d * scale, -(dmin * min)):
// both products are exact in float32 (11 x 6 significant bits). Decoded in one vector (lanes 0-7 the scales,
// 8-15 the minimums): for j < 4 the low 6 bits of byte j (scale) or j + 4 (min); for j >= 4 a nibble of byte
// j + 4 with the top 2 bits of byte j - 4 (scale) or j (min) above it.
inline void k_scales(const uint8_t* b, float* scale, float* offset) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
#if defined(__AVX512F__)
  // 12 scale bytes, then 4 bytes of codes that no lane uses.
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i a = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i t = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7));
  const __m512i a32 = _mm512_cvtepu8_epi32(a), t32 = _mm512_cvtepu8_epi32(t);
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i mask = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i top = _mm512_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1);
  const __m512i v = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(a32, shift), mask),
                                    _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(t32, 6), 4), top));
  const __m512 mul = _mm512_setr_ps(d, d, d, d, d, d, d, d, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin, -dmin);
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), mul);
  _mm256_storeu_ps(scale, _mm512_castps512_ps256(f));
  _mm256_storeu_ps(offset, _mm512_extractf32x8_ps(f, 1));
#else
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    if (j < 4) {
      sc = q[j] & 63;
      m = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    scale[j] = d * float(sc);
    offset[j] = -(dmin * float(m));
  }
#endif
}

// The same 6-bit scales and minimums as integers: scale[0..7] (scale has room for 16: the upper 8 are
// written with the minimums, which callers ignore) and minimum[0..7].
inline void k_scales_int(const uint8_t* b, int16_t* scale, int16_t* minimum) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i a = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i t = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7));
  const __m256i a16 = _mm256_cvtepu8_epi16(a), t16 = _mm256_cvtepu8_epi16(t);
  const __m256i shift = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m256i mask = _mm256_setr_epi16(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m256i top = _mm256_setr_epi16(0, 0, 0, 0, -1, -1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1);
  const __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi16(a16, shift), mask),
                                    _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(t16, 6), 4), top));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale), v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(minimum), _mm256_extracti128_si256(v, 1));
#else
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scale[j] = q[j] & 63;
      minimum[j] = q[j + 4] & 63;
    } else {
      scale[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      minimum[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
#endif
}

}  // namespace specjax_cpu

#endif  // SPECJAX_KERNELS_CPU_GGUF_BLOCKS_H_
