// Linear layers over float16 / bfloat16 weights as a GGUF file stores them: [N, K] rows, read in place.
//
// Why: widened to float32, an F16 or BF16 file's projections held twice the file (a 7-8B BF16 file, ~16 GB,
// could not load on a 24 GB machine) and a decode step streamed twice the bytes. Here the rows stay as the file
// has them (memory-mapped; only the q/k rows llama.cpp permuted are copied, in Hugging Face's order) and each
// weight is widened in a register. That is exact: every fp16 and bf16 value is a float32 value.
//
// Arithmetic, the same in every loop and for every batch (so answers are batch-invariant), activations kept in
// float32: y[m, n] = s + bias[n], where lane j (0..15) sums x[m, k] * w[n, k] over k = j, j + 16, j + 32, ... in
// order, each step one fused multiply-add, and s adds the 16 lanes in a fixed tree (reduce_lanes).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tile_walk.h"

namespace {

constexpr int64_t kLanes = 16;  // k steps of 16: one 512-bit register of float32, two 256-bit ones

// The tree that adds a row's 16 lane sums, written out for the portable loop; the vector loops do the same adds.
inline float reduce_lanes(const float l[kLanes]) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

#if defined(CHATAPP_HAVE_AVX2)
// lanes 0-7 + lanes 8-15 (t8) given as two registers, then reduce_lanes' last steps.
inline float reduce_halves(__m256 lo, __m256 hi) {
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));  // t4[0] + t4[2], t4[1] + t4[3]
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// 8 weights at p widened to float32.
template <bool kBf16>
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}
#endif

#if defined(CHATAPP_HAVE_VNNI)
// 16 weights at p widened to float32.
template <bool kBf16>
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

inline float reduce_lanes(__m512 v) {
  return reduce_halves(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// One weight widened to float32, exactly.
template <bool kBf16>
inline float widen1(const uint16_t* p) {
  if constexpr (kBf16) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return half_at(reinterpret_cast<const uint8_t*>(p));
  }
}

// What every loop is handed: x [rows, k] (row stride xs floats), the weights' rows w [n, k], y [rows, n].
struct Problem {
  const float* x;
  int64_t xs, rows, k, n;
  const uint16_t* w;
  const float* bias;
  float* y;
  float out(int64_t c, float s) const { return s + (bias ? bias[c] : 0.f); }
};

// The rows of the block after ours (they follow ours in memory), fetched into L2 a cache line each per 32 inputs
// as ours are read. Why: a row of 2048 weights is one 4 KB page, and the hardware prefetchers stop at a page's
// end, so each new row began cold (one row streamed at 25.8 GB/s without this, 28.6 with it; 512 MB of rows).
struct NextRows {
  const uint16_t* rows;
  int64_t count, k;
  NextRows(const Problem& p, int64_t c0, int64_t block)
      : rows(p.w + (c0 + block) * p.k), count(std::clamp<int64_t>(p.n - c0 - block, 0, block)), k(p.k) {}
  void fetch(int64_t k0) const {
    if (k0 % 32 == 0)
      for (int64_t c = 0; c < count; ++c) _mm_prefetch(reinterpret_cast<const char*>(rows + c * k + k0), _MM_HINT_T1);
  }
};

#if defined(CHATAPP_HAVE_VNNI)
// kR rows x kC channels from (m0, c0): kR * kC registers of lane sums, one fused multiply-add each per 16 inputs.
template <bool kBf16, int kR, int kC>
inline void block512(const Problem& p, int64_t m0, int64_t c0) {
  __m512 acc[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_setzero_ps();
  const NextRows next(p, c0, kC);
  for (int64_t k0 = 0; k0 < p.k; k0 += kLanes) {
    next.fetch(k0);
    __m512 w[kC];
    for (int c = 0; c < kC; ++c) w[c] = widen16<kBf16>(p.w + (c0 + c) * p.k + k0);
    for (int r = 0; r < kR; ++r) {
      const __m512 xv = _mm512_loadu_ps(p.x + (m0 + r) * p.xs + k0);
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) p.y[(m0 + r) * p.n + c0 + c] = p.out(c0 + c, reduce_lanes(acc[r][c]));
}
#endif

#if defined(CHATAPP_HAVE_AVX2)
// block512 on 256-bit registers: each lane sum's inputs j and j + 8 in two registers (lanes 0-7, 8-15).
template <bool kBf16, int kR, int kC>
inline void block256(const Problem& p, int64_t m0, int64_t c0) {
  __m256 lo[kR][kC], hi[kR][kC];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  const NextRows next(p, c0, kC);
  for (int64_t k0 = 0; k0 < p.k; k0 += kLanes) {
    next.fetch(k0);
    __m256 w[kC];
    for (int c = 0; c < kC; ++c) w[c] = widen8<kBf16>(p.w + (c0 + c) * p.k + k0);
    for (int r = 0; r < kR; ++r) {
      const __m256 xv = _mm256_loadu_ps(p.x + (m0 + r) * p.xs + k0);
      for (int c = 0; c < kC; ++c) lo[r][c] = _mm256_fmadd_ps(xv, w[c], lo[r][c]);
    }
    for (int c = 0; c < kC; ++c) w[c] = widen8<kBf16>(p.w + (c0 + c) * p.k + k0 + 8);
    for (int r = 0; r < kR; ++r) {
      const __m256 xv = _mm256_loadu_ps(p.x + (m0 + r) * p.xs + k0 + 8);
      for (int c = 0; c < kC; ++c) hi[r][c] = _mm256_fmadd_ps(xv, w[c], hi[r][c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) p.y[(m0 + r) * p.n + c0 + c] = p.out(c0 + c, reduce_halves(lo[r][c], hi[r][c]));
}
#endif

// The same arithmetic one value at a time (std::fma rounds once, as the vector loops' instructions do).
template <bool kBf16>
void one_output(const Problem& p, int64_t m, int64_t c) {
  float lanes[kLanes] = {};
  const float* xr = p.x + m * p.xs;
  const uint16_t* wr = p.w + c * p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::fma(xr[k0 + j], widen1<kBf16>(wr + k0 + j), lanes[j]);
  p.y[m * p.n + c] = p.out(c, reduce_lanes(lanes));
}

// Channels [c0, c1) for kR rows from m: kC channels at a time, then the last ones one at a time. The rows'
// activations stay in L1 while the channels' weights stream past.
template <class Loop, bool kBf16, int kR, int kC>
void sweep(const Problem& p, int64_t m, int64_t c0, int64_t c1) {
  int64_t c = c0;
#if defined(CHATAPP_HAVE_VNNI)
  if constexpr (std::is_same_v<Loop, VnniLoop>) {
    for (; c + kC <= c1; c += kC) block512<kBf16, kR, kC>(p, m, c);
    for (; c < c1; ++c) block512<kBf16, kR, 1>(p, m, c);
  }
#endif
#if defined(CHATAPP_HAVE_AVX2)
  if constexpr (std::is_same_v<Loop, Avx2Loop>) {
    for (; c + kC <= c1; c += kC) block256<kBf16, kR, kC>(p, m, c);
    for (; c < c1; ++c) block256<kBf16, kR, 1>(p, m, c);
  }
#endif
}

// Channels [c0, c1) for every row. Batches go 8 rows x 3 channels at a time (24 sums in registers; a widened
// weight register serves 8 rows, so widening takes few of the ports the multiply-adds need: at 512 rows
// 216-224 GFLOP/s on 2 cores where 4 x 4 gave 200-205, and 8 rows 207-216 against 145-185), a last row
// (decode's only one) 1 x 8: 8 chains of fused multiply-adds side by side. 256-bit registers hold half as
// many: 3 x 2 (12 registers of sums; 114 GFLOP/s here at 512 rows, where 2 x 2 gave 103), then 1 x 4.
template <bool kBf16>
void compute_channels(const Problem& p, int64_t c0, int64_t c1, KernelPath path) {
  on_path(path, [&](auto loop) {
    using Loop = decltype(loop);
    if constexpr (std::is_same_v<Loop, PortableLoop>) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t m = 0; m < p.rows; ++m) one_output<kBf16>(p, m, c);
    } else {
      int64_t m = 0;
      if constexpr (std::is_same_v<Loop, VnniLoop>) {
        for (; m + 8 <= p.rows; m += 8) sweep<Loop, kBf16, 8, 3>(p, m, c0, c1);
        if (p.rows - m >= 4) sweep<Loop, kBf16, 4, 4>(p, m, c0, c1), m += 4;
        if (p.rows - m >= 2) sweep<Loop, kBf16, 2, 4>(p, m, c0, c1), m += 2;
        if (m < p.rows) sweep<Loop, kBf16, 1, 8>(p, m, c0, c1);
      } else {
        for (; m + 3 <= p.rows; m += 3) sweep<Loop, kBf16, 3, 2>(p, m, c0, c1);
        if (p.rows - m >= 2) sweep<Loop, kBf16, 2, 2>(p, m, c0, c1), m += 2;
        if (m < p.rows) sweep<Loop, kBf16, 1, 4>(p, m, c0, c1);
      }
    }
  });
}

}  // namespace

bool is_float_rows_kind(int64_t kind) { return kind == kKindF16Rows || kind == kKindBF16Rows; }

at::Tensor float_rows_linear(const at::Tensor& x, const at::Tensor& rows, int64_t kind, int64_t out_features,
                             const std::optional<at::Tensor>& bias, KernelPath path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be [M, K] float32 rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kLanes == 0, "in_features ", k, " is not a multiple of ", kLanes);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous(),
              "weights must be contiguous uint8 [N, 2 K] rows");
  TORCH_CHECK(rows.size(1) == 2 * k, "weight rows hold ", rows.size(1) / 2, " inputs, x has ", k);
  TORCH_CHECK(rows.size(0) == out_features, "weights have ", rows.size(0), " rows for ", out_features, " outputs");
  at::Tensor bias_c = bias && bias->defined() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, out_features}, x.options());
  if (m == 0 || out_features == 0) return y;
  const Problem p{x.data_ptr<float>(),
                  x.stride(0),
                  m,
                  k,
                  out_features,
                  reinterpret_cast<const uint16_t*>(rows.data_ptr<uint8_t>()),
                  bias_c.defined() ? bias_c.data_ptr<float>() : nullptr,
                  y.data_ptr<float>()};
  const int64_t tiles = (out_features + kQuantTile - 1) / kQuantTile;
  for_tiles_balanced(tiles, [&](int64_t t0, int64_t t1) {
    const int64_t c0 = t0 * kQuantTile, c1 = std::min(t1 * kQuantTile, out_features);
    if (kind == kKindBF16Rows) compute_channels<true>(p, c0, c1, path);
    else compute_channels<false>(p, c0, c1, path);
  });
  return y;
}
