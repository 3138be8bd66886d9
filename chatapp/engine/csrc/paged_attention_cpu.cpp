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
// computed in: scores accumulate over the head dimension in a fixed order (query
// rows sit in vector lanes, so there is no horizontal reduction), the softmax
// runs over exactly the row's own keys, and values accumulate in position order.
// Built with -ffp-contract=off so vector and scalar code round alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;  // query vectors (token, head) per tile

struct Task {
  int64_t request, kv_head, first_vector, num_vectors;
};

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
    std::vector<float> qt(D * kLanes), scores, acc(kLanes * D);
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t b = task.request, q_len = qsl[b + 1] - qsl[b], start = lens[b] - q_len;
      int64_t last[kLanes], token[kLanes], head[kLanes];
      int64_t num_keys = 0;
      std::fill(qt.begin(), qt.end(), 0.f);
      for (int64_t l = 0; l < task.num_vectors; ++l) {
        const int64_t vec = task.first_vector + l, i = vec / G;
        token[l] = qsl[b] + i;
        head[l] = task.kv_head * G + vec % G;
        last[l] = start + i;  // this row attends keys 0..last
        num_keys = std::max(num_keys, last[l] + 1);
        const float* src = qp + (token[l] * H + head[l]) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * kLanes + l] = src[d];
      }
      const int32_t* table = tables + b * max_blocks;
      auto slot = [&](int64_t pos) { return (static_cast<int64_t>(table[pos / bs]) * bs + pos % bs) * row; };

      scores.resize(kLanes * num_keys);
      for (int64_t pos = 0; pos < num_keys; ++pos) {  // scores[lane][pos] = q_lane . k_pos * scale
        const float* key = kp + slot(pos) + task.kv_head * D;
        float s[kLanes] = {0.f};
        for (int64_t d = 0; d < D; ++d) {
          const float kd = key[d];
          const float* qd = qt.data() + d * kLanes;
          for (int l = 0; l < kLanes; ++l) s[l] += qd[l] * kd;
        }
        for (int l = 0; l < kLanes; ++l) scores[l * num_keys + pos] = s[l] * fscale;
      }
      for (int64_t l = 0; l < task.num_vectors; ++l) {  // softmax over the row's own keys
        float* s = scores.data() + l * num_keys;
        const int64_t n = last[l] + 1;
        const float m = *std::max_element(s, s + n);
        float sum = 0.f;
        for (int64_t pos = 0; pos < n; ++pos) sum += (s[pos] = std::exp(s[pos] - m));
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < n; ++pos) s[pos] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < num_keys; ++pos) {  // out_lane = sum over pos of w * v_pos, in order
        const float* value = vp + slot(pos) + task.kv_head * D;
        for (int64_t l = 0; l < task.num_vectors; ++l) {
          if (pos > last[l]) continue;
          const float w = scores[l * num_keys + pos];
          float* a = acc.data() + l * D;
          for (int64_t d = 0; d < D; ++d) a[d] += w * value[d];
        }
      }
      for (int64_t l = 0; l < task.num_vectors; ++l)
        std::copy(acc.data() + l * D, acc.data() + (l + 1) * D, op + (token[l] * H + head[l]) * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache (CPU, float32)");
}
