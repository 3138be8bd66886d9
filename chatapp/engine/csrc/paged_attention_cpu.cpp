// Causal attention straight from the paged KV cache, for the CPU: decodes and
// prefill chunks alike.
//
// Why not gather + SDPA: gathering every request's blocks into a contiguous
// tensor in every layer of every step cost more than the attention itself at
// 16 concurrent decodes. This kernel reads keys and values in place.
//
// Why one kernel for every query length: a token's result must not depend on
// how its prompt was chunked or what shared the batch, or greedy answers change
// with load. Each query row's arithmetic here is the same whatever tile it is
// computed in: every score is a dot product with one fixed reduction tree, the
// softmax runs over exactly the row's own keys (exp vectorised elementwise, the
// sum taken in position order), and values accumulate in position order.
// Built with -ffp-contract=off so vector and scalar code round alike.
#include "paged_attention_cpu.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Task {
  int64_t request, kv_head, first_vector, num_vectors;
};

// Scores of up to 16 query rows against one key. For head sizes of C * 16 floats the key stays in
// registers across the rows; the arithmetic is dot()'s, term for term (see vec16.h).
template <int C>
inline void score_rows(const float* key, const float* const* qrow, const int64_t* last, int64_t nv, int64_t pos,
                       float fscale, float* scores, int64_t stride, int64_t D) {
  if constexpr (C == 0) {
    for (int64_t l = 0; l < nv; ++l)
      if (pos <= last[l]) scores[l * stride + pos] = dot(qrow[l], key, D) * fscale;
  } else {
    v16 k[C];
    for (int c = 0; c < C; ++c) k[c] = load(key + c * kLanes);
    for (int64_t l = 0; l < nv; ++l) {
      if (pos > last[l]) continue;
      v16 acc = splat(0.f);
      for (int c = 0; c < C; ++c) acc = acc + load(qrow[l] + c * kLanes) * k[c];
      scores[l * stride + pos] = hsum(acc) * fscale;
    }
  }
}

// For rows rows[0..nr): out_r = sum over p <= last_r, in position order, of w_r[p] * v_p, where w_r = the
// row's normalised weights. Several rows share each read of v_p (R rows x C vectors of accumulators stay
// in registers); each row's arithmetic is the single-row one, term for term.
template <int C, int R, typename SlotFn>
inline void weighted_values(float* const* w, const int64_t* last, int nr, int64_t num_keys, const float* vp,
                            SlotFn slot, int64_t offset, float* const* out, int64_t D) {
  if constexpr (C == 0) {
    for (int r = 0; r < nr; ++r) {
      std::fill(out[r], out[r] + D, 0.f);
      for (int64_t p = 0; p <= last[r]; ++p) {
        const float* value = vp + slot(p) + offset;
        for (int64_t d = 0; d < D; ++d) out[r][d] += w[r][p] * value[d];
      }
    }
  } else {
    v16 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = splat(0.f);
    int64_t end = 0;
    for (int r = 0; r < nr; ++r) end = std::max(end, last[r] + 1);
    end = std::min(end, num_keys);
    for (int64_t p = 0; p < end; ++p) {
      const float* value = vp + slot(p) + offset;
      v16 v[C];
      for (int c = 0; c < C; ++c) v[c] = load(value + c * kLanes);
      for (int r = 0; r < nr; ++r) {
        if (p > last[r]) continue;
        const v16 wr = splat(w[r][p]);
        for (int c = 0; c < C; ++c) acc[r][c] = acc[r][c] + wr * v[c];
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < C; ++c) store(out[r] + c * kLanes, acc[r][c]);
  }
}

}  // namespace

// q [T, H, D] (flattened batch); k_cache, v_cache [num_blocks, block_size, Hkv, D];
// query_start_loc [B + 1], seq_lens [B] (context after this step), block_tables [B, max_blocks]: int32.
// The i-th query of request b sits at position seq_lens[b] - q_len[b] + i. Returns [T, H, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt, "int32 metadata");
  q = q.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_lens = seq_lens.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t H = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head shapes disagree");
  const int64_t G = H / Hkv, B = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && lens[b] <= max_blocks * bs, "inconsistent metadata");
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t v = 0; v < q_len * G; v += kLanes)
        tasks.push_back({b, kvh, v, std::min<int64_t>(kLanes, q_len * G - v)});
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive token slots

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t b = task.request, q_len = qsl[b + 1] - qsl[b], start = lens[b] - q_len;
      const int64_t nv = task.num_vectors;
      int64_t last[kLanes], token[kLanes], head[kLanes];
      const float* qrow[kLanes];
      int64_t num_keys = 0;
      for (int64_t l = 0; l < nv; ++l) {
        const int64_t vec = task.first_vector + l, i = vec / G;
        token[l] = qsl[b] + i;
        head[l] = task.kv_head * G + vec % G;
        last[l] = start + i;  // this row attends keys 0..last
        qrow[l] = qp + (token[l] * H + head[l]) * D;
        num_keys = std::max(num_keys, last[l] + 1);
      }
      const int32_t* table = tables + b * max_blocks;
      auto slot = [&](int64_t pos) { return (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row; };

      // Scores, row by row in a [lanes][keys] buffer: each key is read once for the whole tile.
      const int64_t stride = (num_keys + kLanes - 1) / kLanes * kLanes;
      scores.assign(nv * stride, 0.f);
      for (int64_t pos = 0; pos < num_keys; ++pos) {
        const float* key = kp + slot(pos) + task.kv_head * D;
        if (D == 64)
          score_rows<4>(key, qrow, last, nv, pos, fscale, scores.data(), stride, D);
        else if (D == 128)
          score_rows<8>(key, qrow, last, nv, pos, fscale, scores.data(), stride, D);
        else
          score_rows<0>(key, qrow, last, nv, pos, fscale, scores.data(), stride, D);
      }
      // Softmax per row over its own keys; the normalised weights replace the scores.
      for (int64_t l = 0; l < nv; ++l) {
        float* s = scores.data() + l * stride;
        const int64_t n = last[l] + 1;
        const float m = *std::max_element(s, s + n);
        int64_t pos = 0;
        for (; pos + kLanes <= n; pos += kLanes) store(s + pos, vexp(load(s + pos) - splat(m)));
        if (pos < n) {  // the tail through the same vector code
          float tail[kLanes] = {0.f};
          std::copy(s + pos, s + n, tail);
          const v16 e = vexp(load(tail) - splat(m));
          for (int64_t j = 0; pos + j < n; ++j) s[pos + j] = e[j];
        }
        float sum = 0.f;
        for (int64_t p = 0; p < n; ++p) sum += s[p];  // in position order
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < n; ++p) s[p] = s[p] * inv;
      }
      // Weighted values, a few rows per pass over the values.
      const int64_t offset = task.kv_head * D;
      constexpr int kGroup = 4;
      for (int64_t g0 = 0; g0 < nv; g0 += kGroup) {
        const int nr = static_cast<int>(std::min<int64_t>(kGroup, nv - g0));
        float* w[kGroup];
        float* dst[kGroup];
        for (int r = 0; r < nr; ++r) {
          w[r] = scores.data() + (g0 + r) * stride;
          dst[r] = op + (token[g0 + r] * H + head[g0 + r]) * D;
        }
        if (D == 64) {
          weighted_values<4, kGroup>(w, last + g0, nr, num_keys, vp, slot, offset, dst, D);
        } else if (D == 128) {
          for (int r = 0; r < nr; r += 2)
            weighted_values<8, 2>(w + r, last + g0 + r, std::min(2, nr - r), num_keys, vp, slot, offset, dst + r, D);
        } else {
          weighted_values<0, 1>(w, last + g0, nr, num_keys, vp, slot, offset, dst, D);
        }
      }
    }
  });
  return out;
}
