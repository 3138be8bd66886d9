#pragma once
// 16-float GCC vector helpers shared by our CPU kernels. Built with -ffp-contract=off,
// so every lane rounds exactly like scalar code would: results never depend on
// which lane or which tile a value was computed in.
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
typedef int32_t i16v __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// x in every lane. (Not v16{} + x: that is an addition GCC must keep, 0 + -0 being +0, and it cost an add
// and a broadcast per use where a broadcast load folds into the instruction using it.)
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// a * b + c rounded once where the CPU has FMA, in every lane and in scalar code alike (std::fma is
// the same correctly rounded operation), so a value never depends on which path computed it.
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  __m256 lo, hi, alo, ahi, blo, bhi, clo, chi;
  __builtin_memcpy(&alo, &a, 32); __builtin_memcpy(&ahi, reinterpret_cast<char*>(&a) + 32, 32);
  __builtin_memcpy(&blo, &b, 32); __builtin_memcpy(&bhi, reinterpret_cast<char*>(&b) + 32, 32);
  __builtin_memcpy(&clo, &c, 32); __builtin_memcpy(&chi, reinterpret_cast<char*>(&c) + 32, 32);
  lo = _mm256_fmadd_ps(alo, blo, clo);
  hi = _mm256_fmadd_ps(ahi, bhi, chi);
  v16 out;
  __builtin_memcpy(&out, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  return a * b + c;
#endif
}

inline float fmadd(float a, float b, float c) {
#if defined(__AVX512F__) || defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

// exp on 16 lanes of each of kN vectors: Cody-Waite range reduction and a degree-6 polynomial (relative error
// ~1e-7); inputs at or below -87 give ~0 (callers force masked entries to exactly 0). The kN vectors go through
// each step in turn. Why: one vector's exp is a chain of ~30 dependent steps, and the out-of-order window held too
// few of them to fill the pipes (a pass of exps over 512 floats on Zen 5: 5.8 ns per vector alone, 4.0 ns four in
// lockstep). Every lane takes the same operations whatever kN: same bits.
template <int kN>
inline void vexp_n(v16* x) {
  v16 n[kN], r[kN], p[kN];
  for (int i = 0; i < kN; ++i) {
    x[i] = x[i] < splat(-87.0f) ? splat(-87.0f) : x[i];
    x[i] = x[i] > splat(88.0f) ? splat(88.0f) : x[i];
  }
  for (int i = 0; i < kN; ++i) n[i] = x[i] * splat(1.44269504088896341f);
  for (int i = 0; i < kN; ++i)
    n[i] = __builtin_convertvector(__builtin_convertvector(n[i] + (n[i] < 0 ? splat(-0.5f) : splat(0.5f)), i16v), v16);
  for (int i = 0; i < kN; ++i) r[i] = x[i] - n[i] * splat(0.693359375f);
  for (int i = 0; i < kN; ++i) r[i] = r[i] - n[i] * splat(-2.12194440e-4f);
  for (int i = 0; i < kN; ++i) p[i] = splat(1.9875691500e-4f) * r[i] + splat(1.3981999507e-3f);
  for (int i = 0; i < kN; ++i) p[i] = p[i] * r[i] + splat(8.3334519073e-3f);
  for (int i = 0; i < kN; ++i) p[i] = p[i] * r[i] + splat(4.1665795894e-2f);
  for (int i = 0; i < kN; ++i) p[i] = p[i] * r[i] + splat(1.6666665459e-1f);
  for (int i = 0; i < kN; ++i) p[i] = p[i] * r[i] + splat(5.0000001201e-1f);
  for (int i = 0; i < kN; ++i) p[i] = p[i] * r[i] * r[i] + r[i] + splat(1.0f);
  for (int i = 0; i < kN; ++i) {
    const i16v bits = (__builtin_convertvector(n[i], i16v) + 127) << 23;
    v16 scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    x[i] = p[i] * scale;
  }
}

inline v16 vexp(v16 x) {
  vexp_n<1>(&x);
  return x;
}

// o[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i] for i < n: SwiGLU's product, one row. Every element takes
// the same operations wherever it sits (the tail's exps through the vector code, zero-padded), so a row has
// the same bits whichever caller computes it (cpu_forward.cpp's silu_and_mul, or block_quant.cpp's fused down
// projection).
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {  // four vectors' exps in lockstep (vexp_n says why)
    v16 e[4];
    for (int j = 0; j < 4; ++j) e[j] = -load(g + i + j * kLanes);
    vexp_n<4>(e);
    for (int j = 0; j < 4; ++j) {
      const v16 gv = load(g + i + j * kLanes);
      store(o + i + j * kLanes, gv / (splat(1.f) + e[j]) * load(u + i + j * kLanes));
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const v16 gv = load(g + i);
    store(o + i, gv / (splat(1.f) + vexp(-gv)) * load(u + i));
  }
  for (; i < n; ++i) {
    float tail[kLanes] = {0.f};
    tail[0] = -g[i];
    o[i] = g[i] / (1.f + vexp(load(tail))[0]) * u[i];
  }
}

// Horizontal sum with one fixed tree.
inline float hsum(v16 acc) {
  v16 h = acc + __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  h = h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
  h = h + __builtin_shufflevector(h, h, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return h[0] + h[1];
}

// a . b over n floats with one fixed order: 16-wide partial sums chunk by chunk, then the tree.
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = splat(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = acc + load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Cache values, float32 or float16, as float32: exact either way (every half is a float).
inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline v16 load_wide(const float* p) { return load(p); }
inline v16 load_wide(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v16 out;
  __builtin_memcpy(&out, &x, sizeof(out));
  return out;
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16 out;
  __builtin_memcpy(&out, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
  return out;
#else
  v16 out;
  for (int i = 0; i < kLanes; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

// float32 -> cache type, rounded to nearest even for halves (the one rounding a half cache adds).
inline void narrow_to(float x, float* dst) { *dst = x; }
inline void narrow_to(float x, c10::Half* dst) { *dst = c10::Half(x); }

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Where the widest registers are AVX2's 16 of 256 bits: GCC's 16-float vectors spill there in loops
// that keep many of them live, so those loops (paged attention) take 8-float halves instead.
#define CHATAPP_VEC_AVX2 1

// 16 cache values as two 8-float halves (the AVX2 loops keep their accumulators in 256-bit registers).
inline void load_wide8x2(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load_wide8x2(const c10::Half* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
#endif
