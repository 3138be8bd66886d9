#pragma once
// 256-bit helpers for the AVX2 kernels (block_quant.cpp, kquant.cpp): the CPUs most laptops have,
// where AVX-512 VNNI is missing (AMD before Zen 4, Intel's client chips since Alder Lake).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CHATAPP_HAVE_AVX2 1

// acc + in each 32-bit lane, the sum of its 4 products of unsigned 8-bit w by signed 8-bit x: VNNI's
// dot on 8 lanes. Without AVX-VNNI it is maddubs (pairs summed in int16, saturating) then madd: exact
// while a pair of products fits int16, so callers keep w <= 128 and |x| <= 127. Our activation codes
// are within +-127 (scaled to the block's absolute maximum) and every packed kind's codes are at most
// 63 (K kinds), 31 (Q5_0, Q5_1), 15 (Q4_0, Q4_1) or taken as absolute values of signed bytes (Q8_0).
inline __m256i dot4x8(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// The 4 int8 activations at p in every lane.
inline __m256i broadcast4x8(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 fp16 values at p as floats.
inline __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 signed bytes at p widened to 8 int32 lanes.
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
#endif
