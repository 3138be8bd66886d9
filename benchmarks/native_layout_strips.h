// What the design study's in-place kernels share (native_layout_kquant.cpp, native_layout_blocks32.cpp): not engine
// code. A strip is 16 of a GGUF tensor's rows, read as the file stores them; the transposes turn 16 rows' words into
// registers that hold one row a lane, as our packed tiles do.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace native_layout {

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 rows x `width` int32 (row-major) -> `width` registers, register s holding column s of the 16 rows; by
// permutes (a gather per register was ~20% slower overall).
template <int width>
struct Transpose {
  static_assert(width == 4 || width == 8);
  __m512i index[3][2];
  Transpose() {
    alignas(64) int32_t t[16];
    // Level 1: two registers of 16 / width rows each -> width / 2 columns... for width 8: 4 rows, 4 columns.
    constexpr int rows1 = 16 / width * 2, cols1 = 16 / rows1;
    for (int h = 0; h < 2; ++h) {
      for (int c = 0; c < cols1; ++c)
        for (int r = 0; r < rows1; ++r) t[c * rows1 + r] = (r < rows1 / 2 ? 0 : 16) + (r % (rows1 / 2)) * width + h * cols1 + c;
      index[0][h] = _mm512_load_si512(t);
    }
    if constexpr (width == 8) {  // level 2: 8 rows, 2 columns
      for (int q = 0; q < 2; ++q) {
        for (int c = 0; c < 2; ++c)
          for (int r = 0; r < 8; ++r) t[c * 8 + r] = (r < 4 ? 0 : 16) + (2 * q + c) * 4 + r % 4;
        index[1][q] = _mm512_load_si512(t);
      }
    }
    for (int c = 0; c < 2; ++c) {  // last level: 16 rows, 1 column
      for (int r = 0; r < 16; ++r) t[r] = (r < 8 ? 0 : 16) + c * 8 + r % 8;
      index[2][c] = _mm512_load_si512(t);
    }
  }

  void run(const int32_t* rows, __m512i out[width]) const {
    __m512i z[width];
    for (int i = 0; i < width; ++i) z[i] = _mm512_loadu_si512(rows + 16 * i);
    run(z, out);
  }

  // z[i]: rows 16 / width * i onwards, `width` int32 each
  void run(const __m512i z[width], __m512i out[width]) const {
    if constexpr (width == 8) {
      __m512i a[4][2], b[2][2][2];
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) a[i][h] = _mm512_permutex2var_epi32(z[2 * i], index[0][h], z[2 * i + 1]);
      for (int j = 0; j < 2; ++j)
        for (int h = 0; h < 2; ++h)
          for (int q = 0; q < 2; ++q) b[j][h][q] = _mm512_permutex2var_epi32(a[2 * j][h], index[1][q], a[2 * j + 1][h]);
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 2; ++q)
          for (int c = 0; c < 2; ++c) out[h * 4 + 2 * q + c] = _mm512_permutex2var_epi32(b[0][h][q], index[2][c], b[1][h][q]);
    } else {
      __m512i a[2][2];
      for (int j = 0; j < 2; ++j)
        for (int h = 0; h < 2; ++h) a[j][h] = _mm512_permutex2var_epi32(z[2 * j], index[0][h], z[2 * j + 1]);
      for (int c = 0; c < 4; ++c) out[c] = _mm512_permutex2var_epi32(a[0][c / 2], index[2][c % 2], a[1][c / 2]);
    }
  }
};

inline const Transpose<8> kDotsTranspose;
inline const Transpose<4> kHeaderTranspose;

// A strip of 16 rows for the lanes way: where each row starts, and the next strip, which it prefetches in file
// order, a block's share of its lines as each block is computed (into L2 instead, or two strips ahead: 0.74-0.81x
// of the tiles' GB/s against 0.90-0.95x; by column, as the blocks are read: 0.77x).
struct Strip {
  const uint8_t* row[16];
  const uint8_t* next;
  int64_t bytes, per_block;

  Strip(const uint8_t* base, int64_t row_bytes, int64_t blocks, int64_t nrows)
      : next(base + 16 * row_bytes), bytes(16 * row_bytes), per_block((16 * row_bytes + blocks - 1) / blocks) {
    for (int r = 0; r < 16; ++r) row[r] = base + std::min<int64_t>(r, nrows - 1) * row_bytes;
  }
  void prefetch_next(int64_t b) const {
    for (int64_t o = b * per_block; o < std::min(bytes, (b + 1) * per_block); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
  }
  // The 16 rows' 16 bytes at `at`, 4 rows a register (for Transpose<4>).
  void quads(int64_t at, __m512i z[4]) const {
    auto field = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + at)); };
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_castsi128_si512(field(4 * i));
      v = _mm512_inserti32x4(v, field(4 * i + 1), 1);
      v = _mm512_inserti32x4(v, field(4 * i + 2), 2);
      z[i] = _mm512_inserti32x4(v, field(4 * i + 3), 3);
    }
  }
  // The 16 rows' 32 bytes at `at`, 2 rows a register (for Transpose<8>).
  void pairs(int64_t at, __m512i z[8]) const {
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[2 * i] + at))),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[2 * i + 1] + at)), 1);
  }
};

// Runs `reps` times over n rows, on `threads` threads: reference(r) for each row, or strip(t, rows) for each strip t of
// 16 (its last one `rows` long); returns the fastest run's seconds.
template <class Reference, class Strip16>
double fastest_run(int64_t n, int threads, int reps, bool reference, Reference&& one_row, Strip16&& strip) {
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const double start = omp_get_wtime();
    if (reference) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t r = 0; r < n; ++r) one_row(r);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t t = 0; t < (n + 15) / 16; ++t) strip(t, std::min<int64_t>(16, n - t * 16));
    }
    best = std::min(best, omp_get_wtime() - start);
  }
  return best;
}

}  // namespace native_layout
