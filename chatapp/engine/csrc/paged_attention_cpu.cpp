// Decode attention straight from the paged KV cache, for the CPU.
//
// The torch backend gathers every request's blocks into a contiguous tensor in
// every layer of every step before calling SDPA; at 16 concurrent decodes that
// copy (twice per layer) cost more than the attention itself. This kernel reads
// each key and value once, in place, one (request, KV head) pair per task, and
// serves all query heads of that KV head's group from the same reads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Sixteen independent partial sums: a shape GCC turns into one vector FMA per
// step (a plain float reduction stays scalar without -ffast-math).
constexpr int kLanes = 16;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
// seq_lens [B] int32 (keys 0..seq_len-1 are attended). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head shapes disagree");
  const int64_t G = H / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive token slots

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && len <= max_blocks * bs, "sequence length outside its block table");
      scores.assign(G * len, 0.f);
      const float* qb = qp + (b * H + kvh * G) * D;
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = static_cast<int64_t>(tp[b * max_blocks + pos / bs]) * bs + pos % bs;
        const float* key = kp + slot * row + kvh * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + pos] = dot(qb + g * D, key, D) * fscale;
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax per query head
        float* s = scores.data() + g * len;
        const float m = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) sum += (s[pos] = std::exp(s[pos] - m));
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < len; ++pos) s[pos] *= inv;
      }
      float* ob = op + (b * H + kvh * G) * D;
      for (int64_t pos = 0; pos < len; ++pos) {
        const int64_t slot = static_cast<int64_t>(tp[b * max_blocks + pos / bs]) * bs + pos % bs;
        const float* value = vp + slot * row + kvh * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * len + pos], value, ob + g * D, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
