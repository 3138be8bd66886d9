#pragma once
// The 6-bit sub-block scales and minimums of Q4_K and Q5_K tiles, packed as tightly as the file packs them.
//
// Why: a decode step streams every byte of a tile. Kept a byte each, a (tile, super-block)'s 8 scales and 8
// minimums of 16 channels took 256 bytes where the file's 16 blocks hold them in 192: a Q4_K tile read 2.8% more
// than the file (148 bytes a row per 256 weights against 144), Q5_K 2.3%. Packed in two planes, a group's 16
// values come back with a load, a shift and a mask from each, once per group for every row the loop runs.
//
// Planes of one kind of value (scales, or minimums) for 16 channels and 8 groups, 96 bytes:
//   bytes [0, 64):  nibble plane, byte 16 j + c (j = 0..3): group j's low 4 bits, group j + 4's in the high nibble;
//   bytes [64, 96): two-bit plane, byte 16 q + c (q = 0..1): bits 2i..2i+1 hold group 4q + i's top two bits.
#include <immintrin.h>

#include <cstdint>

namespace chatapp {

constexpr int64_t kSixBitPlanesBytes = 96;

// Group g's value of channel c.
inline int32_t six_bit_at(const uint8_t* planes, int64_t g, int64_t c) {
  const int32_t low = (planes[16 * (g & 3) + c] >> (4 * (g >> 2))) & 15;
  const int32_t top = (planes[64 + 16 * (g >> 2) + c] >> (2 * (g & 3))) & 3;
  return low | top << 4;
}

// Sets group g's value of channel c (0..63), leaving the other values' bits as they are.
inline void put_six_bit(uint8_t* planes, int64_t g, int64_t c, uint8_t value) {
  uint8_t& low = planes[16 * (g & 3) + c];
  const int low_shift = static_cast<int>(4 * (g >> 2));
  low = static_cast<uint8_t>((low & ~(15 << low_shift)) | ((value & 15) << low_shift));
  uint8_t& top = planes[64 + 16 * (g >> 2) + c];
  const int top_shift = static_cast<int>(2 * (g & 3));
  top = static_cast<uint8_t>((top & ~(3 << top_shift)) | (((value >> 4) & 3) << top_shift));
}

// Group g's 16 values (one a channel) as bytes.
inline __m128i six_bit_row(const uint8_t* planes, int64_t g) {
  const __m128i low4 = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(0x03);
  const __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * (g & 3)));
  const __m128i low = _mm_and_si128(_mm_srli_epi16(nibbles, static_cast<int>(4 * (g >> 2))), low4);
  const __m128i tops = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 64 + 16 * (g >> 2)));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(tops, static_cast<int>(2 * (g & 3))), two);
  return _mm_or_si128(low, _mm_slli_epi16(top, 4));
}

// The planes of 8 groups' rows of 16 values (each 0..63).
inline void put_six_bit_rows(const __m128i rows[8], uint8_t* planes) {
  const __m128i low4 = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(0x03);
  for (int j = 0; j < 4; ++j) {
    const __m128i high = _mm_slli_epi16(_mm_and_si128(rows[j + 4], low4), 4);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes + 16 * j), _mm_or_si128(_mm_and_si128(rows[j], low4), high));
  }
  for (int q = 0; q < 2; ++q) {
    __m128i tops = _mm_setzero_si128();
    for (int i = 0; i < 4; ++i) {
      const __m128i top = _mm_and_si128(_mm_srli_epi16(rows[4 * q + i], 4), two);
      tops = _mm_or_si128(tops, _mm_slli_epi16(top, 2 * i));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes + 64 + 16 * q), tops);
  }
}

}  // namespace chatapp
