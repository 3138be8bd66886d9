// GGUF tensor rows -> our packed tile layouts, every weight kept exactly (no rounding anywhere).
//
// Why here and not in numpy: a 4-8 GB file is repacked at every start, and a plain C++ pass over the
// bytes (in parallel over tiles) takes a fraction of a second per GB where numpy's many whole-array
// passes would take many seconds and memory for temporaries.
//
// Each GGUF block is first decoded to its integer codes and scales as the file defines them (ggml's
// block layouts), then written into the layout of block_quant.cpp (block-of-32 kinds) or kquant.cpp
// (K kinds). Which kind holds which type, exactly:
//   Q4_0 -> kind 5 (codes offset by 8)         Q4_1 -> kind 4   Q8_0 -> kind 8
//   Q5_0 -> kind 6 (codes offset by 16)        Q5_1 -> kind 7
//   Q4_K -> 104   Q5_K -> 105   Q6_K -> 106
// Q3_K has no loop of its own and is held exactly by Q6_K's kind, at more bytes a weight (1.9x the file's) but
// with the file's very factors, in the file's order:
//   Q3_K -> 106: d x a 6-bit scale (-32..31) x a code (-4..3) per 16 weights is Q6_K's d x int8 scale x
//                code (-32..31), the code stored + 32 as Q6_K stores it
// The two types that index IQ4_NL's 16 values with 4 bits have kinds of their own (the kernels look the values
// up), their indices and factors as the file has them:
//   IQ4_NL -> kind 9 (Q4_0's layout, 1.0x)   IQ4_XS -> 108 (kquant.cpp's IQ4X; its 6-bit scales as int8, 1.015x)
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "block_quant.h"
#include "iq4_values.h"
#include "six_bit_scales.h"
#include "worker_pool.h"

namespace {

#if defined(__linux__)
#if defined(MADV_POPULATE_WRITE)
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // Linux 5.14's value, for older headers
#endif
#endif

// ggml type ids (ggml.h) and block bytes.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
                  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23;

int64_t gguf_block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kIQ4_NL: return 18;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_XS: return 136;
    default: return 0;
  }
}

int64_t kind_for(int64_t type) {
  switch (type) {
    case kQ4_0: return kKindQ4S;
    case kQ4_1: return kKindQ4;
    case kQ5_0: return kKindQ5S;
    case kQ5_1: return kKindQ5M;
    case kQ8_0: return kKindQ8;
    case kIQ4_NL: return kKindIQ4NL;
    case kQ3_K:
    case kQ6_K: return kKindQ6K;
    case kQ4_K: return kKindQ4K;
    case kQ5_K: return kKindQ5K;
    case kIQ4_XS: return kKindIQ4X;
    default: return 0;
  }
}

uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One block of 32 decoded: codes as the packed kind stores them, fp16 scale and minimum bits.
struct Block32 {
  uint8_t code[32];
  uint16_t d, m;
};

Block32 decode_block32(int64_t type, const uint8_t* p) {
  Block32 b{};
  b.d = u16(p);
  switch (type) {
    case kQ4_0:  // kind 5 keeps the codes with their offset of 8, and no minimum
      for (int i = 0; i < 32; ++i) b.code[i] = i < 16 ? p[2 + i] & 0x0F : p[2 + i - 16] >> 4;
      break;
    case kQ4_1:
      b.m = u16(p + 2);
      for (int i = 0; i < 32; ++i) b.code[i] = i < 16 ? p[4 + i] & 0x0F : p[4 + i - 16] >> 4;
      break;
    case kQ5_0: {
      const uint32_t qh = u32(p + 2);
      for (int i = 0; i < 32; ++i) {
        const int low = i < 16 ? p[6 + i] & 0x0F : p[6 + i - 16] >> 4;
        b.code[i] = static_cast<uint8_t>(low | ((qh >> i) & 1) << 4);  // kind 6 keeps the offset of 16
      }
      break;
    }
    case kQ5_1: {
      b.m = u16(p + 2);
      const uint32_t qh = u32(p + 4);
      for (int i = 0; i < 32; ++i) {
        const int low = i < 16 ? p[8 + i] & 0x0F : p[8 + i - 16] >> 4;
        b.code[i] = static_cast<uint8_t>(low | ((qh >> i) & 1) << 4);
      }
      break;
    }
    default:  // Q8_0
      for (int i = 0; i < 32; ++i) b.code[i] = static_cast<uint8_t>(static_cast<int8_t>(p[2 + i]) + 128);
  }
  return b;
}

// One super-block of 256 decoded: codes 0..15/31/63, integer sub-block scales (and minimums).
struct Block256 {
  uint8_t code[256];
  int8_t sc[16];  // Q6_K: 16 signed scales of 16 inputs; Q4_K/Q5_K: 8 of 32 (6-bit, unsigned)
  uint8_t m[8];
  uint16_t d, dmin;
};

void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Straight loops over ggml's byte order (no per-weight index arithmetic): this runs over every weight
// of the file at each start.
Block256 decode_block256(int64_t type, const uint8_t* p) {
  Block256 b{};
  if (type == kQ3_K) {  // hmask[32], qs[64], scales[12], d: decoded as the Q6_K super-block of its weights
    const uint8_t *hmask = p, *qs = p + 32, *sc = p + 96;
    for (int s = 0; s < 16; ++s) {  // scale s: low 4 bits in byte s % 8 (nibble s / 8), top 2 in byte 8 + s % 4
      const int low = (sc[s % 8] >> (4 * (s / 8))) & 0x0F, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 0x03;
      b.sc[s] = static_cast<int8_t>((low | high << 4) - 32);
    }
    b.d = u16(p + 108);
    for (int h = 0; h < 2; ++h)  // weight 128h + 32s + l: bits 2s..2s+1 of qs[32h + l], and 4 taken off
      for (int s = 0; s < 4; ++s)  // unless bit (4h + s) of hmask[l] is set; stored + 32, as Q6_K's codes
        for (int l = 0; l < 32; ++l) {
          const int low = (qs[32 * h + l] >> (2 * s)) & 0x03, bit = (hmask[l] >> (4 * h + s)) & 1;
          b.code[128 * h + 32 * s + l] = static_cast<uint8_t>(low - (bit ? 0 : 4) + 32);
        }
    return b;
  }
  if (type == kQ6_K) {
    const uint8_t *ql = p, *qh = p + 128;
    for (int s = 0; s < 16; ++s) b.sc[s] = static_cast<int8_t>(p[192 + s]);
    b.d = u16(p + 208);
    for (int h = 0; h < 2; ++h) {  // two halves of 128: low nibbles of 64 bytes, then their high nibbles
      for (int l = 0; l < 64; ++l) {
        b.code[128 * h + l] = ql[64 * h + l] & 0x0F;
        b.code[128 * h + 64 + l] = ql[64 * h + l] >> 4;
      }
      for (int s = 0; s < 4; ++s)  // bits 4-5 of weight 32s + l: bits 2s..2s+1 of qh[l]
        for (int l = 0; l < 32; ++l) b.code[128 * h + 32 * s + l] |= ((qh[32 * h + l] >> (2 * s)) & 3) << 4;
    }
    return b;
  }
  b.d = u16(p);
  b.dmin = u16(p + 2);
  const uint8_t* scales = p + 4;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(scales, j, sc, m);
    b.sc[j] = static_cast<int8_t>(sc);
    b.m[j] = m;
  }
  const uint8_t* qh = type == kQ5_K ? p + 16 : nullptr;
  const uint8_t* qs = type == kQ5_K ? p + 48 : p + 16;
  for (int c = 0; c < 4; ++c)  // chunks of 64: low nibbles of 32 bytes, then their high nibbles
    for (int l = 0; l < 32; ++l) {
      b.code[64 * c + l] = qs[32 * c + l] & 0x0F;
      b.code[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  if (qh)
    for (int g = 0; g < 8; ++g)  // the fifth bit of weight 32g + l: bit g of qh[l]
      for (int l = 0; l < 32; ++l) b.code[32 * g + l] |= ((qh[l] >> g) & 1) << 4;
  return b;
}

// Channel c's 32 codes of one block in the Q4 nibble layout (chunk j, byte 4c + i: inputs 4j+i | 16+4j+i).
void put_nibbles(uint8_t* dst, int64_t c, const uint8_t* code) {
  for (int in = 0; in < 16; ++in)
    dst[64 * (in / 4) + 4 * c + in % 4] = static_cast<uint8_t>((code[in] & 0x0F) | ((code[in + 16] & 0x0F) << 4));
}

void write_block32(uint8_t* blk, int64_t kind, int64_t c, const Block32& b) {
  if (kind == kKindQ4 || kind == kKindQ4S) {
    put_nibbles(blk, c, b.code);
    std::memcpy(blk + 256 + 2 * c, &b.d, 2);
    if (kind == kKindQ4) std::memcpy(blk + 288 + 2 * c, &b.m, 2);
    return;
  }
  if (kind == kKindQ5S || kind == kKindQ5M) {
    put_nibbles(blk, c, b.code);
    for (int in = 0; in < 32; ++in)  // input 16 half + 4j + i: register j + 4 half, lane 4c + i, its bit
      blk[256 + 4 * c + in % 4] |= static_cast<uint8_t>((b.code[in] >> 4) << ((in % 16) / 4 + 4 * (in / 16)));
    std::memcpy(blk + 320 + 2 * c, &b.d, 2);
    if (kind == kKindQ5M) std::memcpy(blk + 352 + 2 * c, &b.m, 2);
    return;
  }
  for (int in = 0; in < 32; ++in) blk[64 * (in / 4) + 4 * c + in % 4] = b.code[in];
  std::memcpy(blk + 512 + 2 * c, &b.d, 2);
}

void write_block256(uint8_t* blk, int64_t kind, int64_t c, const Block256& b) {
  for (int g = 0; g < 8; ++g) put_nibbles(blk + 256 * g, c, b.code + 32 * g);
  if (kind != kKindQ4K)
    for (int g = 0; g < 8; ++g)
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {  // input 16 half + 4j + i sits in register j + 4 half, lane 4c + i
            const int reg = j + 4 * half, lane = static_cast<int>(4 * c + i);
            const int high = b.code[32 * g + 16 * half + 4 * j + i] >> 4;
            if (kind == kKindQ5K) blk[2048 + 64 * g + lane] |= static_cast<uint8_t>(high << reg);
            else blk[2048 + 128 * g + 64 * half + lane] |= static_cast<uint8_t>(high << (2 * j));
          }
  if (kind == kKindQ6K) {
    std::memcpy(blk + 3072 + 2 * c, &b.d, 2);
    for (int s = 0; s < 16; ++s) blk[3104 + 16 * s + c] = static_cast<uint8_t>(b.sc[s]);
    return;
  }
  const int64_t base = kind == kKindQ4K ? 2048 : 2560;
  std::memcpy(blk + base + 2 * c, &b.d, 2);
  std::memcpy(blk + base + 32 + 2 * c, &b.dmin, 2);
  for (int g = 0; g < 8; ++g) {
    chatapp::put_six_bit(blk + base + 64, g, c, static_cast<uint8_t>(b.sc[g]));
    chatapp::put_six_bit(blk + base + 64 + chatapp::kSixBitPlanesBytes, g, c, b.m[g]);
  }
}

// Direct writers for the types people pull most (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), and IQ4_NL and IQ4_XS (which have
// only these): each goes from the file's bytes to the tile's in words, without decoding to one byte per weight
// first. They write exactly what decode_block* + write_block* write (tests/test_gguf.py holds every type to
// gguf's weights), about 4x faster: a 1B Q4_K_M file's repack is most of its start.

void put_word(uint8_t* dst, uint32_t w) { std::memcpy(dst, &w, 4); }

uint64_t u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// 16 nibble bytes of one 32-weight group (code[in] | code[in + 16] << 4) from 32 bytes of 4-bit codes held
// as ggml does (low nibbles of a[0..32) or their high nibbles), to chunk j's word of channel c.
void put_nibble_group(uint8_t* dst, int64_t c, const uint8_t* a, bool high) {
  constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0FULL;
  for (int half = 0; half < 2; ++half) {  // inputs 8 half .. 8 half + 7: chunks 2 half and 2 half + 1
    const uint64_t x = u64(a + 8 * half), y = u64(a + 16 + 8 * half);
    const uint64_t bytes = high ? ((x >> 4) & kLow) | (y & ~kLow) : (x & kLow) | ((y & kLow) << 4);
    put_word(dst + 64 * (2 * half) + 4 * c, static_cast<uint32_t>(bytes));
    put_word(dst + 64 * (2 * half + 1) + 4 * c, static_cast<uint32_t>(bytes >> 32));
  }
}

// Channel c's Q4_K factors from its block p: d, dmin, and each group's 6-bit scale and minimum.
void put_q4k_factors(uint8_t* blk, int64_t c, const uint8_t* p) {
  std::memcpy(blk + 2048 + 2 * c, p, 2);
  std::memcpy(blk + 2080 + 2 * c, p + 2, 2);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(p + 4, j, sc, m);
    chatapp::put_six_bit(blk + 2112, j, c, sc);
    chatapp::put_six_bit(blk + 2112 + chatapp::kSixBitPlanesBytes, j, c, m);
  }
}

// Channel c's Q6_K factors from its block p: d and the 16 sub-blocks' int8 scales.
void put_q6k_factors(uint8_t* blk, int64_t c, const uint8_t* p) {
  std::memcpy(blk + 3072 + 2 * c, p + 208, 2);
  for (int sb = 0; sb < 16; ++sb) blk[3104 + 16 * sb + c] = p[192 + sb];
}

// Channel c of one block written straight from the file's block p; false for the types left to the
// decoding path.
bool write_direct(int64_t type, uint8_t* blk, int64_t c, const uint8_t* p) {
  switch (type) {
    case kQ4_0:  // kind 5's nibble byte for input i is the file's byte i (i < 16 low, i + 16 high)
    case kIQ4_NL:  // and kind 9's (IQ4_NL's indices sit as Q4_0's codes)
    case kQ4_1: {
      const uint8_t* qs = p + (type == kQ4_1 ? 4 : 2);
      for (int j = 0; j < 4; ++j) std::memcpy(blk + 64 * j + 4 * c, qs + 4 * j, 4);
      std::memcpy(blk + 256 + 2 * c, p, 2);
      if (type == kQ4_1) std::memcpy(blk + 288 + 2 * c, p + 2, 2);
      return true;
    }
    case kQ8_0:  // codes offset by 128: the sign bit flipped
      for (int j = 0; j < 8; ++j) put_word(blk + 64 * j + 4 * c, u32(p + 2 + 4 * j) ^ 0x80808080u);
      std::memcpy(blk + 512 + 2 * c, p, 2);
      return true;
    case kQ4_K: {
      const uint8_t* qs = p + 16;
      for (int g = 0; g < 8; ++g) put_nibble_group(blk + 256 * g, c, qs + 32 * (g / 2), g % 2 == 1);
      put_q4k_factors(blk, c, p);
      return true;
    }
    case kIQ4_XS: {  // d, scales_h (2 bits a scale), scales_l[4] (4 bits a scale), qs[128]: to kind IQ4X
      const uint16_t high = u16(p + 2);
      const uint8_t *low = p + 4, *qs = p + 8;
      for (int g = 0; g < 8; ++g) {  // a group's 16 index bytes hold inputs i (low nibble) and 16 + i, as Q4_0's
        for (int j = 0; j < 4; ++j) std::memcpy(blk + 256 * g + 64 * j + 4 * c, qs + 16 * g + 4 * j, 4);
        const int ls = ((low[g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 0x03) << 4);
        blk[2080 + 16 * g + c] = static_cast<uint8_t>(ls - 32);
      }
      std::memcpy(blk + 2048 + 2 * c, p, 2);
      return true;
    }
    case kQ6_K: {
      const uint8_t *ql = p, *qh = p + 128;
      for (int g = 0; g < 8; ++g) {
        const int h = g / 4, s = g % 4;  // weights 128 h + 32 s + l
        put_nibble_group(blk + 256 * g, c, ql + 64 * h + 32 * (s % 2), s >= 2);
        for (int half = 0; half < 2; ++half) {  // lane 4c + i: the high bits of inputs 16 half + 4j + i at 2j
          const uint8_t* q = qh + 32 * h + 16 * half;
          uint32_t word = 0;
          for (int j = 0; j < 4; ++j) word |= ((u32(q + 4 * j) >> (2 * s)) & 0x03030303u) << (2 * j);
          put_word(blk + 2048 + 128 * g + 64 * half + 4 * c, word);
        }
      }
      put_q6k_factors(blk, c, p);
      return true;
    }
    default:
      return false;
  }
}

// A whole tile (16 channels) of the types people pull most, block by block: what write_direct writes for each
// channel, 16 channels at once where AVX-512 is there (else channel by channel, through write_direct).
// Why: channel by channel, these small copies were most of the repack's CPU (a 1B Q8_0 file: 0.28 of its
// ~0.5 CPU-seconds), and a first start on 2 cores waits for every CPU-second of the start.
bool tile_direct(int64_t type) {
  return type == kQ4_0 || type == kIQ4_NL || type == kQ4_1 || type == kQ8_0 || type == kQ4_K || type == kQ6_K;
}

#if defined(__AVX512F__)
// 4 registers of the 16 bytes at rows[c] + off of each channel: lane L of register i holds channel i + 4L's.
inline void load_lanes(const uint8_t* const rows[kQuantTile], int64_t off, __m512i a[4]) {
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 4] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 8] + off)), 2);
    a[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i + 12] + off)), 3);
  }
}

// load_lanes' registers to dword j of every channel's 16 bytes, channel c at dword c of o[j]: a 4 x 4 dword
// transpose within each 128-bit lane (lane L, dword i of o[j] is register i's lane L, dword j: channel 4L + i).
inline void to_chunks(const __m512i a[4], __m512i o[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  o[0] = _mm512_unpacklo_epi64(t0, t2);
  o[1] = _mm512_unpackhi_epi64(t0, t2);
  o[2] = _mm512_unpacklo_epi64(t1, t3);
  o[3] = _mm512_unpackhi_epi64(t1, t3);
}

inline void store_chunks(const __m512i a[4], uint8_t* dst) {
  __m512i o[4];
  to_chunks(a, o);
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(dst + 64 * j, o[j]);
}

// Chunks 0..3 of the 16 code bytes at rows[c] + off (block-of-32 kinds), each byte xor flip.
inline void put_tile_codes(const uint8_t* const rows[kQuantTile], int64_t off, uint8_t* dst, uint8_t flip) {
  __m512i a[4];
  load_lanes(rows, off, a);
  const __m512i x = _mm512_set1_epi8(static_cast<char>(flip));
  for (int i = 0; i < 4; ++i) a[i] = _mm512_xor_si512(a[i], x);
  store_chunks(a, dst);
}

// The two 32-weight groups whose 4-bit codes share the 32 bytes at rows[c] + off (ggml: the low nibbles are
// one group's, the high nibbles the next's), as put_nibble_group writes them: the low group to dst_low, the
// high group to dst_high.
inline void put_tile_nibble_pair(const uint8_t* const rows[kQuantTile], int64_t off, uint8_t* dst_low,
                                 uint8_t* dst_high) {
  __m512i x[4], y[4], low[4], high[4];
  load_lanes(rows, off, x);
  load_lanes(rows, off + 16, y);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i y_low = _mm512_slli_epi16(_mm512_and_si512(y[i], low4), 4);
    low[i] = _mm512_or_si512(_mm512_and_si512(x[i], low4), y_low);
    const __m512i x_high = _mm512_and_si512(_mm512_srli_epi16(x[i], 4), low4);
    high[i] = _mm512_or_si512(x_high, _mm512_andnot_si512(low4, y[i]));
  }
  store_chunks(low, dst_low);
  store_chunks(high, dst_high);
}

// Q6_K's bits 4-5 of group g (weights 128h + 32s + l), both halves: lane 4c + i of half p holds, at bits 2j,
// the bits of inputs 16p + 4j + i (the file's qh bytes at 32h + 16p + 4j + i, bits 2s..2s+1).
inline void put_tile_q6_high(const uint8_t* const rows[kQuantTile], int64_t qh_off, int s, uint8_t* dst) {
  const __m512i two = _mm512_set1_epi8(0x03);
  for (int p = 0; p < 2; ++p) {
    __m512i a[4], o[4];
    load_lanes(rows, qh_off + 16 * p, a);
    to_chunks(a, o);
    __m512i word = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i bits = _mm512_and_si512(_mm512_srli_epi32(o[j], static_cast<unsigned>(2 * s)), two);
      word = _mm512_or_si512(word, _mm512_slli_epi32(bits, static_cast<unsigned>(2 * j)));
    }
    _mm512_storeu_si512(dst + 64 * p, word);
  }
}

// Byte i of each channel's dword (the channel's byte 4j + i of to_chunks' o[j]) as one row of 16 bytes.
inline __m128i byte_row(__m512i dwords, int i) {
  return _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(dwords, static_cast<unsigned>(8 * i)),
                                               _mm512_set1_epi32(0xFF)));
}

// put_q4k_factors for the 16 channels: the 12 scale bytes at rows[c] + at + 4 unpacked as scale_min_k4 does.
inline void put_tile_q4k_factors(const uint8_t* const rows[kQuantTile], int64_t at, uint8_t* blk) {
  for (int64_t c = 0; c < kQuantTile; ++c) {
    std::memcpy(blk + 2048 + 2 * c, rows[c] + at, 2);
    std::memcpy(blk + 2080 + 2 * c, rows[c] + at + 2, 2);
  }
  __m512i a[4], s[4];
  load_lanes(rows, at + 4, a);  // bytes 12-15 are the codes' first: read, not used
  to_chunks(a, s);              // s[k], channel c's dword: its scale bytes 4k..4k+3
  const __m128i six = _mm_set1_epi8(63), low4 = _mm_set1_epi8(0x0F);
  __m128i sc[8], m[8];  // each group's row of 16 channels' values
  for (int j = 0; j < 4; ++j) {
    sc[j] = _mm_and_si128(byte_row(s[0], j), six);
    m[j] = _mm_and_si128(byte_row(s[1], j), six);
    // j + 4: sc = (s[j + 8] & 15) | (s[j] >> 6) << 4, m = s[j + 8] >> 4 | (s[j + 4] >> 6) << 4
    const __m128i hi = byte_row(s[2], j);
    const __m128i top_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte_row(s[0], j), 6), _mm_set1_epi8(3)), 4);
    const __m128i top_m = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(byte_row(s[1], j), 6), _mm_set1_epi8(3)), 4);
    sc[j + 4] = _mm_or_si128(_mm_and_si128(hi, low4), top_sc);
    m[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(hi, 4), low4), top_m);
  }
  chatapp::put_six_bit_rows(sc, blk + 2112);
  chatapp::put_six_bit_rows(m, blk + 2112 + chatapp::kSixBitPlanesBytes);
}

// put_q6k_factors for the 16 channels: the 16 int8 scales at rows[c] + at + 192 transposed to [sub-block][c].
inline void put_tile_q6k_factors(const uint8_t* const rows[kQuantTile], int64_t at, uint8_t* blk) {
  for (int64_t c = 0; c < kQuantTile; ++c) std::memcpy(blk + 3072 + 2 * c, rows[c] + at + 208, 2);
  __m512i a[4], s[4];
  load_lanes(rows, at + 192, a);
  to_chunks(a, s);
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 4; ++i)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(blk + 3104 + 16 * (4 * k + i)), byte_row(s[k], i));
}

// Block b of a whole tile (rows: its 16 channels' rows, at: the block's offset in each) of a tile_direct type.
void write_tile_direct(int64_t type, uint8_t* blk, const uint8_t* const rows[kQuantTile], int64_t at) {
  switch (type) {
    case kQ8_0:  // codes offset by 128: the sign bit flipped
      put_tile_codes(rows, at + 2, blk, 0x80);
      put_tile_codes(rows, at + 18, blk + 256, 0x80);
      for (int64_t c = 0; c < kQuantTile; ++c) std::memcpy(blk + 512 + 2 * c, rows[c] + at, 2);
      return;
    case kQ4_1:
      put_tile_codes(rows, at + 4, blk, 0);
      for (int64_t c = 0; c < kQuantTile; ++c) {
        std::memcpy(blk + 256 + 2 * c, rows[c] + at, 2);
        std::memcpy(blk + 288 + 2 * c, rows[c] + at + 2, 2);
      }
      return;
    case kQ4_K:
      for (int pair = 0; pair < 4; ++pair)
        put_tile_nibble_pair(rows, at + 16 + 32 * pair, blk + 512 * pair, blk + 512 * pair + 256);
      put_tile_q4k_factors(rows, at, blk);
      return;
    case kQ6_K:
      // Groups g = 4h + s: s = 0, 1 take the low nibbles of ql[64h + 32s ...], s = 2, 3 the high ones.
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half)
          put_tile_nibble_pair(rows, at + 64 * h + 32 * half, blk + 256 * (4 * h + half),
                               blk + 256 * (4 * h + half + 2));
      for (int g = 0; g < 8; ++g) put_tile_q6_high(rows, at + 128 + 32 * (g / 4), g % 4, blk + 2048 + 128 * g);
      put_tile_q6k_factors(rows, at, blk);
      return;
    default:  // Q4_0, IQ4_NL
      put_tile_codes(rows, at + 2, blk, 0);
      for (int64_t c = 0; c < kQuantTile; ++c) std::memcpy(blk + 256 + 2 * c, rows[c] + at, 2);
  }
}
#else
void write_tile_direct(int64_t type, uint8_t* blk, const uint8_t* const rows[kQuantTile], int64_t at) {
  for (int64_t c = 0; c < kQuantTile; ++c) write_direct(type, blk, c, rows[c] + at);
}
#endif

// Maps in the pages of [p, p + n) that lie wholly inside it, ready to be written, in one call.
//
// Why: the packed weights go to fresh anonymous memory (gguf_weights.py says why), and each first write to a
// page there traps into the kernel: ~175,000 traps for a 1B model's 700 MB, a fifth of a start's CPU on this VM.
// MADV_POPULATE_WRITE (Linux 5.14) maps a range's pages in one call at about two thirds of that cost (700 MB:
// 0.22-0.29 s of CPU against 0.33-0.36 s for the traps, with the writes). Each repack thread maps its own
// tiles, so the work stays split. Memory that is already there (at::zeros), or a kernel without the call,
// makes it a no-op: the writes then fault the pages in as before.
void populate_for_writing(uint8_t* p, int64_t n) {
#if defined(__linux__)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, kPopulateWrite);
#else
  (void)p, (void)n;
#endif
}

float half_bits_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// One GGUF block's weights as floats, in the `gguf` package's own order of float operations (quants.py), so each
// value has its bits: Q4_0 d * (q - 8), Q4_1 d * q + m, Q5_0 d * (q - 16), Q5_1 d * q + m, Q8_0 q * d,
// Q4_K/Q5_K (d * sc) * q - dmin * m, Q6_K (d * sc) * (q - 32). Built with -ffp-contract=off: nothing is fused.
void dequantize_block(int64_t type, const uint8_t* p, float* out) {
  if (type == kQ4_K || type == kQ5_K || type == kQ6_K) {
    const Block256 b = decode_block256(type, p);
    const float d = half_bits_to_float(b.d);
    if (type == kQ6_K) {
      for (int i = 0; i < 256; ++i)
        out[i] = (d * static_cast<float>(b.sc[i / 16])) * static_cast<float>(static_cast<int>(b.code[i]) - 32);
      return;
    }
    const float dmin = half_bits_to_float(b.dmin);
    for (int g = 0; g < 8; ++g) {
      const float scale = d * static_cast<float>(static_cast<uint8_t>(b.sc[g])), min = dmin * static_cast<float>(b.m[g]);
      for (int i = 32 * g; i < 32 * g + 32; ++i) out[i] = scale * static_cast<float>(b.code[i]) - min;
    }
    return;
  }
  const Block32 b = decode_block32(type, p);
  const float d = half_bits_to_float(b.d), m = half_bits_to_float(b.m);
  for (int i = 0; i < 32; ++i) {
    const int code = b.code[i];
    switch (type) {
      case kQ4_0: out[i] = d * static_cast<float>(code - 8); break;
      case kQ5_0: out[i] = d * static_cast<float>(code - 16); break;
      case kQ8_0: out[i] = static_cast<float>(code - 128) * d; break;
      default: out[i] = d * static_cast<float>(code) + m;  // Q4_1, Q5_1
    }
  }
}

}  // namespace

bool dequantizes_gguf_rows(int64_t ggml_type) {
  switch (ggml_type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

void dequantize_gguf_rows(const at::Tensor& raw, int64_t ggml_type, int64_t k, at::Tensor& out) {
  TORCH_CHECK(dequantizes_gguf_rows(ggml_type), "GGUF type ", ggml_type, " is not de-quantised here");
  const int64_t block = ggml_type >= kQ4_K ? kSuperBlock : kQuantBlock, block_bytes = gguf_block_bytes(ggml_type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1, "raw must be uint8 [N, row bytes]");
  TORCH_CHECK(k % block == 0 && raw.size(1) == k / block * block_bytes, "row bytes ", raw.size(1), " do not match ",
              k, " weights of this type");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == raw.size(0) &&
                  out.size(1) == k, "out must be a contiguous float32 [N, ", k, "]");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < raw.size(0); ++r)
    for (int64_t b = 0; b < k / block; ++b)
      dequantize_block(ggml_type, rp + r * raw.stride(0) + b * block_bytes, op + r * k + b * block);
}

std::tuple<at::Tensor, int64_t> repack_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t k,
                                            const std::optional<at::Tensor>& row_order,
                                            const std::optional<at::Tensor>& out) {
  const int64_t kind = kind_for(ggml_type), block_bytes = gguf_block_bytes(ggml_type);
  TORCH_CHECK(kind != 0, "GGUF type ", ggml_type, " has no packed kind");
  const int64_t block = kind_block_inputs(kind), tile_bytes = kind_tile_bytes(kind);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1, "raw must be uint8 [N, row bytes]");
  TORCH_CHECK(k % block == 0, "row length ", k, " is not a whole number of ", block, "-weight blocks");
  const int64_t n = raw.size(0), blocks = k / block, row_stride = raw.stride(0);
  TORCH_CHECK(raw.size(1) == blocks * block_bytes, "row bytes ", raw.size(1), " do not match ", k, " weights of this type");
  const int64_t tiles = (n + kQuantTile - 1) / kQuantTile;
  at::Tensor packed;
  if (out && out->defined()) {
    packed = *out;
    TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                    packed.size(0) == tiles && packed.size(1) == blocks && packed.size(2) == tile_bytes,
                "out must be a contiguous uint8 [", tiles, ", ", blocks, ", ", tile_bytes, "]");
  } else {
    packed = at::zeros({tiles, blocks, tile_bytes}, at::kByte);
  }
  at::Tensor order;
  if (row_order && row_order->defined()) {
    order = row_order->to(at::kLong).contiguous();
    TORCH_CHECK(order.numel() == n, "row_order must name every row once");
    const int64_t* o = order.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(o[i] >= 0 && o[i] < n, "row_order out of range");
  }
  const int64_t* op = order.defined() ? order.data_ptr<int64_t>() : nullptr;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  chatapp::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    // Mapped in ~256 KB at a time, just before they are written: the kernel's zeroed lines are then still
    // in L2 when the repack overwrites them (a thread's whole share at once had them evicted first, and
    // each line came back from memory): a 1B Q4_0 file's load 0.27-0.29 -> 0.26-0.27 s.
    const int64_t tiles_per_map = std::max<int64_t>(1, (256 << 10) / (blocks * tile_bytes));
    for (int64_t t = t0; t < t1; ++t) {
      if ((t - t0) % tiles_per_map == 0)
        populate_for_writing(dst + t * blocks * tile_bytes, std::min(tiles_per_map, t1 - t) * blocks * tile_bytes);
      if (tile_direct(ggml_type) && (t + 1) * kQuantTile <= n) {
        const uint8_t* rows[kQuantTile];
        for (int64_t c = 0; c < kQuantTile; ++c) {
          const int64_t r = t * kQuantTile + c;
          rows[c] = src + (op ? op[r] : r) * row_stride;
        }
        for (int64_t b = 0; b < blocks; ++b)
          write_tile_direct(ggml_type, dst + (t * blocks + b) * tile_bytes, rows, b * block_bytes);
        continue;
      }
      for (int64_t c = 0; c < kQuantTile && t * kQuantTile + c < n; ++c) {
        const int64_t r = t * kQuantTile + c;
        const uint8_t* row = src + (op ? op[r] : r) * row_stride;
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* blk = dst + (t * blocks + b) * tile_bytes;
          if (write_direct(ggml_type, blk, c, row + b * block_bytes)) continue;
          if (block == kQuantBlock) write_block32(blk, kind, c, decode_block32(ggml_type, row + b * block_bytes));
          else write_block256(blk, kind, c, decode_block256(ggml_type, row + b * block_bytes));
        }
      }
    }
  });
  return {packed, kind};
}
