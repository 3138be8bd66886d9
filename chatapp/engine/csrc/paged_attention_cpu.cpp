// Causal attention straight from the paged KV cache, for the CPU: decodes and
// prefill chunks alike.
//
// Why not gather + SDPA: gathering every request's blocks into a contiguous
// tensor in every layer of every step cost more than the attention itself at
// 16 concurrent decodes. This kernel reads keys and values in place.
//
// Why one arithmetic for every query length: a token's result must not depend
// on how its prompt was chunked or what shared the batch, or greedy answers
// change with load. Every score is the same chain of fused multiply-adds over
// the head dimension (d = 0, 1, ...), 16 keys at a time in the vector lanes (which
// is why keys are stored transposed within a block: [block][kv_head][dim][slot]);
// every softmax runs over exactly its row's keys with an order that depends on its
// length alone; every output is a chain of fused multiply-adds over positions in
// order. How rows are grouped into tiles changes which rows share a load, never a
// row's arithmetic. Built with -ffp-contract=off, so the compiler fuses nothing.
//
// The cache holds float32 or float16 (the CPU default: half the memory and half the bytes read per
// decode). Half values are widened exactly on load, so the arithmetic above is the same either way;
// only what was stored was rounded once.
#include "paged_attention_cpu.h"
#include "activation_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec16.h"
#include "worker_pool.h"

#define CHATAPP_ALWAYS_INLINE __attribute__((always_inline))

namespace {

constexpr int64_t kPrefetchBlocks = 2;  // how far ahead the cache blocks are fetched
// Query rows sharing each load of 16 keys, their accumulators in registers: 8 with AVX-512's 32 vector
// registers, 4 with AVX2's 16 (each 16-float vector takes two). Grouping never changes a row's arithmetic.
#if !defined(CHATAPP_VEC_AVX2)
constexpr int kRowGroup = 8;
#else
constexpr int kRowGroup = 4;
#endif

struct Task {
  int64_t request, kv_head, first_vector, num_vectors;
};

// Ask for `count` runs of `n` elements, `stride` elements apart, one cache line at a time.
template <typename T>
inline void prefetch_lines(const T* p, int64_t n, int64_t count, int64_t stride = 0) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t f = 0; f < n; f += kLine) __builtin_prefetch(p + i * stride + f);
}

struct Geometry {
  int64_t H, D, bs, Hkv, G, max_blocks;
};

// Scores of NV rows against the 16 keys of one block starting at `base` (transposed cache). qt: the rows'
// queries transposed, row l's element d at qt[d * kLanes + l] (one pointer for all rows: with a pointer per
// row, GCC ran out of general registers and kept them in vector ones, moved back for every multiply).
template <int NV, typename T>
inline void keys_chunk(const T* base, const Geometry& g, const float* qt, const int64_t* last,
                       int64_t start, float scale, float* scores, int64_t stride) {
#if !defined(CHATAPP_VEC_AVX2)
  v16 s[NV];
  for (int l = 0; l < NV; ++l) s[l] = splat(0.f);
  for (int64_t d = 0; d < g.D; ++d) {
    const v16 k = load_wide(base + d * g.bs);  // one read of 16 keys serves every row
    for (int l = 0; l < NV; ++l) s[l] = fmadd(splat(qt[d * kLanes + l]), k, s[l]);
  }
  for (int l = 0; l < NV; ++l)
    if (start <= last[l]) store(scores + l * stride + start, s[l] * splat(scale));
#else
  // AVX2: the same fused multiply-adds on two 8-float halves (GCC's 16-float vectors spill here).
  __m256 lo[NV], hi[NV];
  for (int l = 0; l < NV; ++l) lo[l] = hi[l] = _mm256_setzero_ps();
  for (int64_t d = 0; d < g.D; ++d) {
    __m256 klo, khi;
    load_wide8x2(base + d * g.bs, klo, khi);
    for (int l = 0; l < NV; ++l) {
      const __m256 qd = _mm256_set1_ps(qt[d * kLanes + l]);
      lo[l] = _mm256_fmadd_ps(qd, klo, lo[l]);
      hi[l] = _mm256_fmadd_ps(qd, khi, hi[l]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int l = 0; l < NV; ++l)
    if (start <= last[l]) {
      _mm256_storeu_ps(scores + l * stride + start, _mm256_mul_ps(lo[l], sc));
      _mm256_storeu_ps(scores + l * stride + start + 8, _mm256_mul_ps(hi[l], sc));
    }
#endif
}

// Scores of a tile's query rows, 16 keys per vector: keys of one block sit side by side in the
// transposed cache. scores[l * stride + pos] for pos <= last[l] (later entries are scratch).
template <typename T>
void scores_keys_in_lanes(const T* kt, const int32_t* table, int64_t kv_head, const Geometry& g,
                          const float* qt, const int64_t* last, int64_t nv, float scale, float* scores,
                          int64_t stride, int64_t from) {
  int64_t num_keys = 0;
  for (int64_t l = 0; l < nv; ++l) num_keys = std::max(num_keys, last[l] + 1);
  const bool full = g.bs % kLanes == 0;  // 16 keys of one block per vector
  for (int64_t start = from; start < num_keys; start += kLanes) {
    if (full) {
      const int64_t block = table[start / g.bs], offset = start % g.bs;
      const T* base = kt + ((block * g.Hkv + kv_head) * g.D) * g.bs + offset;
      for (int64_t ahead = start == from ? 1 : kPrefetchBlocks; offset == 0 && ahead <= kPrefetchBlocks; ++ahead)
        if (start + ahead * g.bs < num_keys)  // blocks sit anywhere: fetch the coming ones' keys early
          prefetch_lines(kt + ((static_cast<int64_t>(table[start / g.bs + ahead]) * g.Hkv + kv_head) * g.D) * g.bs,
                         g.D * g.bs, 1);
      for (int64_t r = 0, step; r < nv; r += step) {  // a fixed row count keeps accumulators in registers
        const float* q = qt + r;
        const int64_t* lr = last + r;
        float* sr = scores + r * stride;
#if !defined(CHATAPP_VEC_AVX2)
        if (nv - r >= 16) {  // a whole task of 16 rows: each load of 16 keys serves all of them
          keys_chunk<16>(base, g, q, lr, start, scale, sr, stride);
          step = 16;
          continue;
        }
#endif
        step = std::min<int64_t>(kRowGroup, nv - r);
        switch (step) {
          case 1: keys_chunk<1>(base, g, q, lr, start, scale, sr, stride); break;
          case 2: keys_chunk<2>(base, g, q, lr, start, scale, sr, stride); break;
          case 3: keys_chunk<3>(base, g, q, lr, start, scale, sr, stride); break;
          case 4: keys_chunk<4>(base, g, q, lr, start, scale, sr, stride); break;
          case 5: keys_chunk<5>(base, g, q, lr, start, scale, sr, stride); break;
          case 6: keys_chunk<6>(base, g, q, lr, start, scale, sr, stride); break;
          case 7: keys_chunk<7>(base, g, q, lr, start, scale, sr, stride); break;
          default: keys_chunk<8>(base, g, q, lr, start, scale, sr, stride); break;
        }
      }
      continue;
    }
    for (int64_t l = 0; l < nv; ++l) {  // small blocks: the same chain, one key at a time
      for (int64_t pos = start; pos < std::min(start + kLanes, last[l] + 1); ++pos) {
        const T* k = kt + ((static_cast<int64_t>(table[pos / g.bs]) * g.Hkv + kv_head) * g.D) * g.bs +
                     pos % g.bs;
        float s = 0.f;
        for (int64_t d = 0; d < g.D; ++d) s = fmadd(qt[d * kLanes + l], widen(k[d * g.bs]), s);
        scores[l * stride + pos] = s * scale;
      }
    }
  }
}

// In place: scores of the row -> softmax weights over its n keys. Vectorised throughout; the sum is
// 16 position-strided partial sums and a fixed tree, an order that depends on n alone.
void softmax_row(float* s, int64_t n) {
  const int64_t n_vec = n - n % kLanes;
  v16 vm = splat(-INFINITY);
  for (int64_t p = 0; p < n_vec; p += kLanes) {
    const v16 x = load(s + p);
    vm = x > vm ? x : vm;
  }
  float m = -INFINITY;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, vm[l]);
  for (int64_t p = n_vec; p < n; ++p) m = std::max(m, s[p]);
  v16 vsum = splat(0.f);
  int64_t p = 0;
  for (; p + 4 * kLanes <= n_vec; p += 4 * kLanes) {  // four vectors' exps in lockstep (vexp_n says why)
    v16 e[4];
    for (int i = 0; i < 4; ++i) e[i] = load(s + p + i * kLanes) - splat(m);
    vexp_n<4>(e);
    for (int i = 0; i < 4; ++i) {
      store(s + p + i * kLanes, e[i]);
      vsum = vsum + e[i];  // in position order, as one at a time
    }
  }
  for (; p < n_vec; p += kLanes) {
    const v16 e = vexp(load(s + p) - splat(m));
    store(s + p, e);
    vsum = vsum + e;
  }
  if (n_vec < n) {  // the tail through the same vector code, zero-padded
    float tail[kLanes] = {0.f};
    std::copy(s + n_vec, s + n, tail);
    v16 e = vexp(load(tail) - splat(m));
    for (int64_t j = n - n_vec; j < kLanes; ++j) e[j] = 0.f;
    for (int64_t j = 0; n_vec + j < n; ++j) s[n_vec + j] = e[j];
    vsum = vsum + e;
  }
  // Weights that would normalise to below 2^-64 become exactly 0, before any multiply. Why: a subnormal float
  // costs a microcode assist in every multiply-add that reads or makes one (~100x slower), and a peaky row of
  // scores makes thousands: as weights and as their products with small values (a random 1B Q4_K_M model
  // spent 22% of a 512-token prefill in the values loop; 208 -> 266 tok/s without them). At most a row's
  // length x 2^-64 of its largest value is dropped, far below float32's own rounding.
  const float total = hsum(vsum);
  const v16 inv = splat(1.f / total), least = splat(0x1p-64f * total);
  for (p = 0; p < n_vec; p += kLanes) {
    const v16 e = load(s + p);
    store(s + p, (e < least ? splat(0.f) : e) * inv);
  }
  for (; p < n; ++p) s[p] = s[p] < least[0] ? 0.f : s[p] * inv[0];
}

// Head dimensions one pass of weighted_values covers for two rows. Each output element keeps its one
// chain over positions, so every slice width gives the same bits. AVX-512's 32 registers hold two rows
// by 128 (16 accumulators, 8 value registers); AVX2's 16 hold two rows by 32.
#if !defined(CHATAPP_VEC_AVX2)
constexpr int64_t kValueSlice = 128;
#else
constexpr int64_t kValueSlice = 32;
#endif

#if !defined(CHATAPP_VEC_AVX2)
// weighted_values' vector loop for exactly NR rows: with the count a constant the NR x C accumulators stay in
// registers (with a runtime count GCC kept them on the stack, a load and a store per multiply-add). Positions
// every row attends take no per-row test. Each output element keeps its one chain over positions in order.
template <int C, int NR, typename T>
void values_rows(float* const* w, const int64_t* first_key, const int64_t* last, const T* vp, const int32_t* table,
                 int64_t kv_head, const Geometry& g, float* const* out) {
  const int64_t row = g.Hkv * g.D;
  v16 acc[NR][C];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat(0.f);
  int64_t end = 0, begin = last[0], all_from = 0, all_to = last[0];  // all rows attend all_from..all_to
  for (int r = 0; r < NR; ++r) {
    end = std::max(end, last[r] + 1), begin = std::min(begin, first_key[r]);
    all_from = std::max(all_from, first_key[r]), all_to = std::min(all_to, last[r]);
  }
  for (int64_t first = begin / g.bs * g.bs; first < end; first += g.bs) {  // block by block: no division per position
    const T* slot0 = vp + static_cast<int64_t>(table[first / g.bs]) * g.bs * row + kv_head * g.D;
    const int64_t n = std::min(g.bs, end - first);
    for (int64_t ahead = first == begin / g.bs * g.bs ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks; ++ahead)
      if (first + ahead * g.bs < end)  // the coming blocks' values of this head, fetched early
        prefetch_lines(vp + static_cast<int64_t>(table[first / g.bs + ahead]) * g.bs * row + kv_head * g.D,
                       C * kLanes, g.bs, row);
    auto add = [&](int64_t j, bool every_row) CHATAPP_ALWAYS_INLINE {
      const int64_t p = first + j;
      const T* value = slot0 + j * row;
      v16 v[C];
      for (int c = 0; c < C; ++c) v[c] = load_wide(value + c * kLanes);
      for (int r = 0; r < NR; ++r) {
        if (!every_row && (p > last[r] || p < first_key[r])) continue;
        const v16 wr = splat(w[r][p]);
        for (int c = 0; c < C; ++c) acc[r][c] = fmadd(wr, v[c], acc[r][c]);
      }
    };
    // Slots [j0, j1) of this block are attended by every row; the ones either side are tested row by row.
    const int64_t j0 = std::clamp<int64_t>(all_from - first, 0, n), j1 = std::clamp<int64_t>(all_to + 1 - first, j0, n);
    for (int64_t j = 0; j < j0; ++j) add(j, false);
    for (int64_t j = j0; j < j1; ++j) add(j, true);
    for (int64_t j = j1; j < n; ++j) add(j, false);
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) store(out[r] + c * kLanes, acc[r][c]);
}
#endif

// out_r = sum over p <= last_r, in position order, of w_r[p] * v_p, for a few rows sharing each read
// of v_p (R rows x C vectors of accumulators in registers). Each row's chain is the single-row one.
template <int C, int R, typename T>
void weighted_values(float* const* w, const int64_t* first_key, const int64_t* last, int nr, const T* vp,
                     const int32_t* table, int64_t kv_head, const Geometry& g, float* const* out) {
  const int64_t row = g.Hkv * g.D;
  auto value_at = [&](int64_t p) {
    return vp + (static_cast<int64_t>(table[p / g.bs]) * g.bs + p % g.bs) * row + kv_head * g.D;
  };
  if constexpr (C == 0) {
    for (int r = 0; r < nr; ++r) {
      std::fill(out[r], out[r] + g.D, 0.f);
      for (int64_t p = first_key[r]; p <= last[r]; ++p) {
        const T* value = value_at(p);
        for (int64_t d = 0; d < g.D; ++d) out[r][d] = fmadd(w[r][p], widen(value[d]), out[r][d]);
      }
    }
  } else {
#if defined(CHATAPP_VEC_AVX2)
    // AVX2: the same chains on 8-float halves, so the accumulators stay in the 16 registers.
    __m256 acc[R][2 * C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm256_setzero_ps();
    int64_t end = 0, begin = last[0];
    for (int r = 0; r < nr; ++r) end = std::max(end, last[r] + 1), begin = std::min(begin, first_key[r]);
    for (int64_t first = begin / g.bs * g.bs; first < end; first += g.bs) {
      const T* slot0 = vp + static_cast<int64_t>(table[first / g.bs]) * g.bs * row + kv_head * g.D;
      const int64_t n = std::min(g.bs, end - first);
      for (int64_t ahead = first == begin / g.bs * g.bs ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks; ++ahead)
        if (first + ahead * g.bs < end)
          prefetch_lines(vp + static_cast<int64_t>(table[first / g.bs + ahead]) * g.bs * row + kv_head * g.D,
                         C * kLanes, g.bs, row);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = first + j;
        const T* value = slot0 + j * row;
        __m256 v[2 * C];
        for (int c = 0; c < C; ++c) load_wide8x2(value + c * kLanes, v[2 * c], v[2 * c + 1]);
        for (int r = 0; r < nr; ++r) {
          if (p > last[r] || p < first_key[r]) continue;
          const __m256 wr = _mm256_set1_ps(w[r][p]);
          for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm256_fmadd_ps(wr, v[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < 2 * C; ++c) _mm256_storeu_ps(out[r] + 8 * c, acc[r][c]);
#else
    switch (nr) {  // the row count as a constant: see values_rows
      case 1: return values_rows<C, 1>(w, first_key, last, vp, table, kv_head, g, out);
      case 2: return values_rows<C, std::min(2, R)>(w, first_key, last, vp, table, kv_head, g, out);
      case 3: return values_rows<C, std::min(3, R)>(w, first_key, last, vp, table, kv_head, g, out);
      default: return values_rows<C, std::min(4, R)>(w, first_key, last, vp, table, kv_head, g, out);
    }
#endif
  }
}


template <typename T>
torch::Tensor attend(torch::Tensor q, torch::Tensor k_cache_t, torch::Tensor v_cache, torch::Tensor query_start_loc,
                     torch::Tensor seq_lens, torch::Tensor block_tables, double scale, int64_t window,
                     double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache_t.dim() == 4 && v_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && (k_cache_t.scalar_type() == at::kFloat ||
                                                 k_cache_t.scalar_type() == at::kHalf),
              "float32 queries; a float32 or float16 cache");
  TORCH_CHECK(k_cache_t.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt, "int32 metadata");
  q = q.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  block_tables = block_tables.contiguous();
  Geometry g{q.size(1), q.size(2), v_cache.size(1), v_cache.size(2), 0, block_tables.size(1)};
  TORCH_CHECK(k_cache_t.size(0) == v_cache.size(0) && k_cache_t.size(1) == g.Hkv && k_cache_t.size(2) == g.D &&
                  k_cache_t.size(3) == g.bs && v_cache.size(3) == g.D, "cache shapes disagree");
  TORCH_CHECK(g.H % g.Hkv == 0, "query heads must be a multiple of KV heads");
  g.G = g.H / g.Hkv;
  const int64_t B = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && lens[b] <= g.max_blocks * g.bs, "inconsistent metadata");
    for (int64_t kvh = 0; kvh < g.Hkv; ++kvh)
      for (int64_t v = 0; v < q_len * g.G; v += kLanes)
        tasks.push_back({b, kvh, v, std::min<int64_t>(kLanes, q_len * g.G - v)});
  }
  at::Tensor out = pooled_empty(q.sizes(), q.options());
  const float* qp = q.data_ptr<float>();
  const T* ktp = k_cache_t.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Tasks are claimed a few at a time from a shared counter (see worker_pool.h), each computed whole, the last
  // first: in a prompt a task's rows attend more keys the later they sit, so the walk ends on the lightest tasks
  // and the threads finish together. A claim is 1/32 of a thread's share: claims of a quarter, taken in order,
  // had left one thread on the heaviest eighth of a 512-token prompt's attention while the other waited.
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::reverse(tasks.begin(), tasks.end());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  const int64_t per_claim = std::max<int64_t>(1, num_tasks / std::max<int64_t>(1, 32 * threads));
  std::atomic<int64_t> next_task{0};
  chatapp::parallel_parts(threads, [&](int64_t) {
    std::vector<float> scores, qt(g.D * kLanes);
    for (int64_t t = 0, claimed_end = 0;; ++t) {
      if (t == claimed_end) {  // claim the next few tasks
        t = next_task.fetch_add(per_claim, std::memory_order_relaxed);
        if (t >= num_tasks) break;
        claimed_end = std::min(t + per_claim, num_tasks);
      }
      const Task& task = tasks[t];
      const int64_t b = task.request, q_len = qsl[b + 1] - qsl[b], start = lens[b] - q_len;
      const int64_t nv = task.num_vectors;
      int64_t last[kLanes], first_key[kLanes], token[kLanes], head[kLanes];
      const float* qrow[kLanes];
      int64_t num_keys = 0, from = std::numeric_limits<int64_t>::max();
      for (int64_t l = 0; l < nv; ++l) {
        const int64_t vec = task.first_vector + l, i = vec / g.G;
        token[l] = qsl[b] + i;
        head[l] = task.kv_head * g.G + vec % g.G;
        last[l] = start + i;  // this row attends keys first_key..last: all before it, or its window
        first_key[l] = window > 0 ? std::max<int64_t>(0, last[l] - window + 1) : 0;
        qrow[l] = qp + (token[l] * g.H + head[l]) * g.D;
        num_keys = std::max(num_keys, last[l] + 1);
        from = std::min(from, first_key[l] / kLanes * kLanes);
      }
      for (int64_t d = 0; d < g.D; ++d)
        for (int64_t l = 0; l < nv; ++l) qt[d * kLanes + l] = qrow[l][d];
      const int32_t* table = tables + b * g.max_blocks;
      const int64_t stride = (num_keys + kLanes - 1) / kLanes * kLanes;
      scores.assign(nv * stride, 0.f);
      scores_keys_in_lanes(ktp, table, task.kv_head, g, qt.data(), last, nv, fscale, scores.data(), stride, from);
      for (int64_t l = 0; l < nv; ++l) {
        float* row = scores.data() + l * stride;
        if (softcap > 0)  // Gemma 2: cap * tanh(score / cap), before the softmax
          for (int64_t p = first_key[l]; p <= last[l]; ++p)
            row[p] = std::tanh(row[p] / static_cast<float>(softcap)) * static_cast<float>(softcap);
        softmax_row(row + first_key[l], last[l] - first_key[l] + 1);
      }
      constexpr int kGroup = 4;
      for (int64_t g0 = 0; g0 < nv; g0 += kGroup) {
        const int nr = static_cast<int>(std::min<int64_t>(kGroup, nv - g0));
        float* w[kGroup];
        float* dst[kGroup];
        for (int r = 0; r < nr; ++r) {
          w[r] = scores.data() + (g0 + r) * stride;
          dst[r] = op + (token[g0 + r] * g.H + head[g0 + r]) * g.D;
        }
#if !defined(CHATAPP_VEC_AVX2)
        if (g.D == 64) {  // the whole head in registers, for the group's rows at once
          weighted_values<4, kGroup>(w, first_key + g0, last + g0, nr, vp, table, task.kv_head, g, dst);
          continue;
        }
#endif
        if (g.D % kValueSlice == 0) {  // two rows at a time, the head in slices (Gemma's 256: two of 128)
          for (int r = 0; r < nr; r += 2)
            for (int64_t d0 = 0; d0 < g.D; d0 += kValueSlice) {
              float* slice[2] = {dst[r] + d0, r + 1 < nr ? dst[r + 1] + d0 : nullptr};
              weighted_values<kValueSlice / kLanes, 2>(w + r, first_key + g0 + r, last + g0 + r, std::min(2, nr - r),
                                                       vp + d0, table, task.kv_head, g, slice);
            }
        } else {
          weighted_values<0, 1>(w, first_key + g0, last + g0, nr, vp, table, task.kv_head, g, dst);
        }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache_t, torch::Tensor v_cache,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale, int64_t window, double softcap) {
  TORCH_CHECK(k_cache_t.scalar_type() == v_cache.scalar_type(), "keys and values must share a type");
  if (k_cache_t.scalar_type() == at::kHalf)
    return attend<c10::Half>(q, k_cache_t, v_cache, query_start_loc, seq_lens, block_tables, scale, window, softcap);
  return attend<float>(q, k_cache_t, v_cache, query_start_loc, seq_lens, block_tables, scale, window, softcap);
}
