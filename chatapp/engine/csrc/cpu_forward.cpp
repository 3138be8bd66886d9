// The decoder layers of our Llama-family and Gemma models in one C++ call per step (CPU, float32 activations).
//
// Why: at batch 1 a step is ~120 small matmuls around ~1,600 small ops, and in
// Python the interpreter, module calls and per-op dispatch cost more than the
// arithmetic (8 of 18 ms per token on SmolLM2). Here each layer is ~19 calls:
// the GEMMs (fbgemm int8 or float), our paged attention, and fused row loops for
// RMSNorm (+ residual), RoPE, the KV store, SiLU*up and the int8 pro/epilogue.
// It follows chatapp/engine/models/llama.py, gemma.py and quantization.py step for step;
// every row is computed by the same code whatever shares the batch, so greedy
// answers stay independent of load (tests hold both paths to the same tokens).
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "activation_pool.h"
#include "block_quant.h"
#include "op_profile.h"
#include "worker_pool.h"
#include "paged_attention_cpu.h"
#include "vec16.h"

namespace py = pybind11;

namespace {

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, as Hugging Face orders it.
void rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const v16 vinv = splat(inv);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(x + i) * vinv * load(w + i));
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// x += y (the residual), then out = rms_norm(x); y may be undefined (no residual to add).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = pooled_empty(x.sizes(), x.options());
  float* xp = x.data_ptr<float>();
  const float* yp = y.defined() ? y.data_ptr<float>() : nullptr;
  const int64_t y_stride = y.defined() ? y.stride(0) : 0;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  chatapp::parallel_for(0, rows, chatapp::row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      if (yp) {
        const float* yr = yp + r * y_stride;
        int64_t i = 0;
        for (; i + kLanes <= n; i += kLanes) store(xr + i, load(xr + i) + load(yr + i));
        for (; i < n; ++i) xr[i] += yr[i];
      }
      rms_norm_row(xr, wp, op + r * n, n, eps);
    }
  });
  return out;
}

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm), on heads [first, first + count) of each row.
void rms_norm_heads(at::Tensor& qkv, int64_t first, int64_t count, int64_t d, const at::Tensor& w, float eps) {
  const int64_t rows = qkv.size(0), stride = qkv.stride(0);
  float* base = qkv.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  std::vector<float> tmp(d);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = first; h < first + count; ++h) {
      float* x = base + r * stride + h * d;
      std::copy(x, x + d, tmp.data());
      rms_norm_row(tmp.data(), wp, x, d, eps);
    }
}

// Rotate heads [0, heads) of each row in place: x * cos + roll(x, r/2) * signed_sin over the first r
// dimensions, r the tables' width (rope.py; Phi-4-mini rotates 3/4 of each head), the rest untouched. The
// rolled halves are read from a copy of the head; each value is the scalar loop's two products and sum.
void rope(at::Tensor& qkv, int64_t heads, int64_t d, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = qkv.size(0), stride = qkv.stride(0), r = cos.size(-1), half = r / 2;
  TORCH_CHECK(r <= d && r % 2 == 0 && cos.is_contiguous() && sin.is_contiguous(), "rope tables must be [T, <= D]");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  chatapp::parallel_for(0, rows, chatapp::row_grain(heads * d), [&](int64_t begin, int64_t end) {
    std::vector<float> head(r);
    for (int64_t row = begin; row < end; ++row) {
      const float* c = cp + row * r;
      const float* s = sp + row * r;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = base + row * stride + h * d;
        std::copy(x, x + r, head.data());
        const float* lo = head.data();
        const float* hi = head.data() + half;
        int64_t i = 0;  // x[i] for i < half pairs with x[i + half], and x[half + i] with x[i]
        for (; i + kLanes <= half; i += kLanes) {
          store(x + i, load(lo + i) * load(c + i) + load(hi + i) * load(s + i));
          store(x + half + i, load(hi + i) * load(c + half + i) + load(lo + i) * load(s + half + i));
        }
        for (; i < half; ++i) {
          x[i] = lo[i] * c[i] + hi[i] * s[i];
          x[half + i] = hi[i] * c[half + i] + lo[i] * s[half + i];
        }
      }
    }
  });
}

// Copy each token's key and value heads into its cache slot; keys go transposed within their block
// ([block][kv_head][dim][slot], see paged_attention_cpu.cpp), values as they are.
template <typename T>
void store_kv_typed(const at::Tensor& qkv, int64_t k_offset, at::Tensor& k_cache_t, at::Tensor& v_cache,
                    const at::Tensor& slots) {
  const int64_t rows = qkv.size(0), stride = qkv.stride(0);
  const int64_t hkv = k_cache_t.size(1), d = k_cache_t.size(2), bs = k_cache_t.size(3), kv_size = hkv * d;
  const float* base = qkv.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* kc = k_cache_t.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    if (sp[r] < 0) continue;
    const float* src = base + r * stride + k_offset;
    T* key_block = kc + (sp[r] / bs) * kv_size * bs + sp[r] % bs;
    for (int64_t i = 0; i < kv_size; ++i) narrow_to(src[i], key_block + i * bs);  // i = head * d + dim
    T* value = vc + sp[r] * kv_size;
    for (int64_t i = 0; i < kv_size; ++i) narrow_to(src[kv_size + i], value + i);
  }
}

// The step's new keys and values into their cache slots (float32 or float16 cache).
void store_kv(const at::Tensor& qkv, int64_t k_offset, at::Tensor& k_cache_t, at::Tensor& v_cache,
              const at::Tensor& slots) {
  if (k_cache_t.scalar_type() == at::kHalf)
    store_kv_typed<c10::Half>(qkv, k_offset, k_cache_t, v_cache, slots);
  else
    store_kv_typed<float>(qkv, k_offset, k_cache_t, v_cache, slots);
}

// silu(gate) * up for gate_up = [gate | up] per row; silu(x) = x / (1 + exp(-x)).
// gelu_tanh(gate) * up (Gemma's GeGLU) with torch's own ops, so it has the Python model's bits.
at::Tensor gelu_and_mul(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  return at::gelu(gate_up.narrow(1, 0, inter), "tanh").mul_(gate_up.narrow(1, inter, inter));
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = pooled_empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  chatapp::parallel_for(0, rows, chatapp::row_grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * stride, gp + r * stride + inter, op + r * inter, inter);
  });
  return out;
}

// A [1 + rows, K] scratch whose row 0 is the anchor [1, -1, 0, ...] (quantization.py: it pins
// fbgemm's dynamic activation range to [-1, 1] so rows quantize alike whatever shares the batch).
struct AnchorBuffer {
  at::Tensor data;
  explicit AnchorBuffer(int64_t k) : data(at::zeros({65, k})) { set_anchor(); }
  void set_anchor() {
    data[0][0] = 1.0;
    data[0][1] = -1.0;
  }
  at::Tensor rows(int64_t n) {
    if (data.size(0) < n + 1) {
      data = at::zeros({std::max<int64_t>(n + 1, 2 * data.size(0)), data.size(1)});
      set_anchor();
    }
    return data.narrow(0, 0, n + 1);
  }
};

struct Linear {
  c10::intrusive_ptr<LinearPackedParamsBase> packed;  // int8 (fbgemm) when set
  std::vector<at::Tensor> parts;                       // block-quantized weights (block_quant.h) when set:
  std::vector<int64_t> part_kinds, part_outs;          // one per kind, their outputs side by side
  at::Tensor weight;                                   // float32 [N, K] otherwise
  at::Tensor bias;                                     // optional
  std::vector<int64_t> outliers;                       // input channels kept in float (int8 only)
  std::vector<at::Tensor> outlier_rows;                // their weight columns, [N] each
  std::shared_ptr<AnchorBuffer> buffer;

  // this(silu_and_mul(gate_up)), the two fused for a kind of blocks of 32 (block_linear_swiglu says why).
  at::Tensor after_swiglu(const at::Tensor& gate_up) const {
    if (parts.size() == 1 && is_block_kind(part_kinds[0]))
      return block_linear_swiglu(gate_up, parts[0], part_kinds[0], part_outs[0], bias);
    return (*this)(silu_and_mul(gate_up));
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (parts.size() == 1) return block_linear(x, parts[0], part_kinds[0], part_outs[0], bias);
    if (!parts.empty()) return block_linear_parts(x, parts, part_kinds, part_outs, bias);  // e.g. Q4_K_M's qkv
    if (!packed) return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
    const int64_t rows = x.size(0), k = x.size(1), x_stride = x.stride(0);
    const int64_t n_out = static_cast<int64_t>(outliers.size());
    at::Tensor buf = buffer->rows(rows);
    std::vector<float> row_max(rows), kept(rows * n_out);
    const float* xp = x.data_ptr<float>();
    float* bp = buf.data_ptr<float>() + k;  // row 1 on
    // Prologue: each row's absmax (outlier channels excluded), the row scaled to [-1, 1].
    chatapp::parallel_for(0, rows, chatapp::row_grain(k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* xr = xp + r * x_stride;
        float* br = bp + r * k;
        std::copy(xr, xr + k, br);
        for (int64_t j = 0; j < n_out; ++j) {
          kept[r * n_out + j] = br[outliers[j]];
          br[outliers[j]] = 0.f;
        }
        float m = 0.f;
        for (int64_t i = 0; i < k; ++i) m = std::max(m, std::fabs(br[i]));
        m = std::max(m, 1e-6f);
        row_max[r] = m;
        for (int64_t i = 0; i < k; ++i) br[i] = br[i] / m;
      }
    });
    // reduce_range=false: with VNNI the u8 x s8 products accumulate in int32 without saturating.
    at::Tensor y = packed->apply_dynamic(buf, false);
    const int64_t n = y.size(1);
    float* yp = y.data_ptr<float>() + n;  // row 1 on
    const float* biasp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    // Epilogue: undo the row scale, add the float outlier channels (in order) and the bias.
    chatapp::parallel_for(0, rows, chatapp::row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* yr = yp + r * n;
        const float m = row_max[r];
        for (int64_t i = 0; i < n; ++i) yr[i] = yr[i] * m;
        for (int64_t j = 0; j < n_out; ++j) {
          const float kv = kept[r * n_out + j];
          const float* w = outlier_rows[j].data_ptr<float>();
          for (int64_t i = 0; i < n; ++i) yr[i] = yr[i] + kv * w[i];
        }
        if (biasp)
          for (int64_t i = 0; i < n; ++i) yr[i] = yr[i] + biasp[i];
      }
    });
    return y.narrow(0, 1, rows);
  }
};

struct Layer {
  at::Tensor input_norm, mlp_in_norm, q_norm, k_norm;  // q/k norms only for Qwen3 and Gemma 3
  Linear qkv, o, gate_up, down;
  at::Tensor attn_out_norm, mlp_out_norm;  // Gemma: each block's output is normed before the residual
  bool local = false;                       // Gemma: a sliding-window layer with its own RoPE tables
  bool use_rope = true;                     // SmolLM3: every 4th layer has no position rotation
};

c10::intrusive_ptr<LinearPackedParamsBase> to_packed(const py::object& obj) {
  auto type = c10::getCustomClassType<c10::intrusive_ptr<LinearPackedParamsBase>>();
  return torch::jit::toIValue(obj, type).toCustomClass<LinearPackedParamsBase>();
}

// numpy arrays in and out, for the engine's torch-free CPU path (chatapp/engine/array_runner.py): this
// library links against libtorch, but its caller need not import torch's Python module (~1.1 s at start).
at::ScalarType scalar_type_of(const py::array& a) {
  const char kind = a.dtype().kind();
  const auto size = a.itemsize();
  if (kind == 'f' && size == 4) return at::kFloat;
  if (kind == 'f' && size == 2) return at::kHalf;
  if (kind == 'u' && size == 1) return at::kByte;
  if (kind == 'i' && size == 4) return at::kInt;
  if (kind == 'i' && size == 8) return at::kLong;
  throw py::type_error("unsupported array dtype " + std::string(py::str(a.dtype())));
}

// A tensor over the array's memory (no copy); the array must outlive it (the caller keeps it).
at::Tensor array_view(const py::array& a) {
  std::vector<int64_t> sizes(a.ndim()), strides(a.ndim());
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    sizes[i] = a.shape(i);
    strides[i] = a.strides(i) / a.itemsize();
  }
  return at::from_blob(const_cast<void*>(a.data()), sizes, strides, at::TensorOptions().dtype(scalar_type_of(a)));
}

// A tensor argument given as a numpy array (kept alive in `keep`) or as a torch tensor (the torch path).
at::Tensor tensor_arg(const py::handle& h, std::vector<py::object>& keep) {
  if (py::isinstance<py::array>(h)) {
    keep.push_back(py::reinterpret_borrow<py::object>(h));
    return array_view(py::reinterpret_borrow<py::array>(h));
  }
  return h.cast<at::Tensor>();
}

// A float32 tensor as a numpy array sharing its memory (the array holds the tensor).
py::array float_array(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "expected a float32 result");
  const at::Tensor c = t.contiguous();
  auto* held = new at::Tensor(c);
  py::capsule owner(held, [](void* p) { delete static_cast<at::Tensor*>(p); });
  std::vector<py::ssize_t> shape(c.sizes().begin(), c.sizes().end());
  return py::array_t<float>(shape, c.data_ptr<float>(), owner);
}

}  // namespace

class CpuModel {
 public:
  // scale: attention's (head_dim^-0.5, or Gemma's query_pre_attn_scalar^-0.5); window: the local layers'
  // sliding window (0: none); softcap: Gemma 2's attention score cap (0: none); gelu: GeGLU, not SwiGLU.
  // Tensor arguments (here and in add_layer) are torch tensors or numpy arrays alike.
  CpuModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, const py::object& final_norm,
           double scale, int64_t window, double softcap, bool gelu)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
        scale_(scale), window_(window), softcap_(softcap), gelu_(gelu), final_norm_(tensor_arg(final_norm, keep_)) {}

  // spec: {"weight", "bias"} for a float layer, {"packed", "in_features", "outliers", "outlier_rows", "bias"} for
  // int8, {"parts": [(packed, kind, out_features), ...], "bias"} for block-quantized weights.
  Linear make_linear(const py::dict& spec) {
    Linear lin;
    if (spec.contains("bias") && !spec["bias"].is_none()) lin.bias = tensor_arg(spec["bias"], keep_).contiguous();
    if (spec.contains("parts")) {
      for (const auto& part : spec["parts"]) {
        const auto fields = py::reinterpret_borrow<py::tuple>(part);
        lin.parts.push_back(tensor_arg(fields[0], keep_));
        lin.part_kinds.push_back(fields[1].cast<int64_t>());
        lin.part_outs.push_back(fields[2].cast<int64_t>());
      }
      return lin;
    }
    if (!spec.contains("packed")) {
      lin.weight = tensor_arg(spec["weight"], keep_);
      return lin;
    }
    lin.packed = to_packed(spec["packed"]);
    const int64_t k = spec["in_features"].cast<int64_t>();
    auto& buf = buffers_[k];
    if (!buf) buf = std::make_shared<AnchorBuffer>(k);
    lin.buffer = buf;
    if (!spec["outliers"].is_none()) {
      at::Tensor ids = spec["outliers"].cast<at::Tensor>().to(at::kLong).contiguous();
      lin.outliers.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
      for (const auto& row : spec["outlier_rows"].cast<std::vector<at::Tensor>>())
        lin.outlier_rows.push_back(row.contiguous());
    }
    return lin;
  }

  void add_layer(const py::object& input_norm, const py::object& mlp_in_norm, const py::object& q_norm,
                 const py::object& k_norm, const py::dict& qkv, const py::dict& o, const py::dict& gate_up,
                 const py::dict& down, const py::object& attn_out_norm, const py::object& mlp_out_norm, bool local,
                 bool use_rope) {
    auto opt = [this](const py::object& t) { return t.is_none() ? at::Tensor() : tensor_arg(t, keep_).contiguous(); };
    layers_.push_back(Layer{opt(input_norm), opt(mlp_in_norm), opt(q_norm), opt(k_norm), make_linear(qkv),
                            make_linear(o), make_linear(gate_up), make_linear(down), opt(attn_out_norm),
                            opt(mlp_out_norm), local, use_rope});
  }

  // The LM head, for callers without torch (forward_arrays' caller); spec as make_linear's.
  void set_head(const py::dict& spec) { head_ = make_linear(spec); }

  // forward() with numpy arrays: x float32 [T, hidden] (updated in place), the int index arrays as
  // forward's tensors. Returns the final-normed hidden states.
  py::array forward_arrays(const py::array& x, const py::array& cos, const py::array& sin, const py::array& local_cos,
                           const py::array& local_sin, const py::list& k_caches, const py::list& v_caches,
                           const py::array& slot_mapping, const py::array& query_start_loc, const py::array& seq_lens,
                           const py::array& block_tables) {
    std::vector<at::Tensor> ks, vs;
    ks.reserve(k_caches.size());
    vs.reserve(v_caches.size());
    for (const auto& k : k_caches) ks.push_back(array_view(py::reinterpret_borrow<py::array>(k)));
    for (const auto& v : v_caches) vs.push_back(array_view(py::reinterpret_borrow<py::array>(v)));
    return float_array(forward(array_view(x), array_view(cos), array_view(sin), array_view(local_cos),
                               array_view(local_sin), std::move(ks), std::move(vs), array_view(slot_mapping),
                               array_view(query_start_loc), array_view(seq_lens), array_view(block_tables)));
  }

  // Logits [rows, vocab] of final-normed hidden states through the head set by set_head.
  py::array head_arrays(const py::array& hidden) {
    TORCH_CHECK(!head_.parts.empty() || head_.weight.defined(), "set_head() comes first");
    return float_array(head_(array_view(hidden).contiguous()));
  }

  // x [T, hidden] (embedded, owned: updated in place); cos/sin [T, 1, R] for the step's positions (the local
  // layers' own tables in local_cos/local_sin); k_caches [num_blocks, Hkv, D, block_size] (transposed keys),
  // v_caches [num_blocks, block_size, Hkv, D]. Returns the final-normed hidden states.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& local_cos,
                     const at::Tensor& local_sin, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables) {
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32");
    const int64_t t = x.size(0), h = num_heads_, hkv = num_kv_heads_, d = head_dim_;
    const int64_t q_size = h * d;
    const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slots = slot_mapping.contiguous();
    const at::Tensor lc = local_cos.contiguous(), ls = local_sin.contiguous();
    at::Tensor pending;  // the last block's output, added into the residual by the next norm
    using Op = chatapp::OpProfile;
    auto timed = [this](Op::Op op, auto&& f) { return profile_.time(op, f); };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const at::Tensor normed = timed(Op::kInputNorm, [&] { return add_rms_norm(x, pending, L.input_norm, eps_); });
      at::Tensor qkv = timed(Op::kQkv, [&] { return L.qkv(normed); });
      if (L.q_norm.defined())
        timed(Op::kQkNorms, [&] {
          rms_norm_heads(qkv, 0, h, d, L.q_norm, eps_);
          rms_norm_heads(qkv, h, hkv, d, L.k_norm, eps_);
        });
      if (L.use_rope) timed(Op::kRope, [&] { rope(qkv, h + hkv, d, L.local ? lc : c, L.local ? ls : s); });
      timed(Op::kKvStore, [&] { store_kv(qkv, q_size, k_caches[i], v_caches[i], slots); });
      const at::Tensor attn = timed(Op::kAttention, [&] {
        return paged_attention(qkv.narrow(1, 0, q_size).view({t, h, d}), k_caches[i], v_caches[i], query_start_loc,
                               seq_lens, block_tables, scale_, L.local ? window_ : 0, softcap_);
      });
      at::Tensor o = timed(Op::kOutProjection, [&] { return L.o(attn.view({t, q_size})); });
      if (L.attn_out_norm.defined())
        o = timed(Op::kBlockOutNorms, [&] { return add_rms_norm(o, at::Tensor(), L.attn_out_norm, eps_); });
      const at::Tensor mlp_in = timed(Op::kMlpNorm, [&] { return add_rms_norm(x, o, L.mlp_in_norm, eps_); });
      const at::Tensor gate_up = timed(Op::kGateUp, [&] { return L.gate_up(mlp_in); });
      pending = timed(Op::kDown, [&] { return gelu_ ? L.down(gelu_and_mul(gate_up)) : L.down.after_swiglu(gate_up); });
      if (L.mlp_out_norm.defined())
        pending = timed(Op::kBlockOutNorms, [&] { return add_rms_norm(pending, at::Tensor(), L.mlp_out_norm, eps_); });
    }
    return timed(Op::kFinalNorm, [&] { return add_rms_norm(x, pending, final_norm_, eps_); });
  }

  // Time each op of the layer loop from now on (or stop): what take_profile() reports (op_profile.h says why).
  void set_profiling(bool on) { profile_.enable(on); }

  // [(op, seconds, calls)] summed over the forwards since the last call, for the ops that ran; the sums restart.
  std::vector<std::tuple<std::string, double, int64_t>> take_profile() { return profile_.take(); }

 private:
  std::vector<py::object> keep_;  // the numpy arrays our tensors view (first: the initializers below fill it)
  int64_t num_heads_, num_kv_heads_, head_dim_;
  float eps_;
  double scale_;
  int64_t window_;
  double softcap_;
  bool gelu_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  Linear head_;
  chatapp::OpProfile profile_;
  std::map<int64_t, std::shared_ptr<AnchorBuffer>> buffers_;
};

namespace {

// repack_gguf with numpy arrays: fills `out` (zeroed uint8 [tiles, blocks, tile bytes]); returns the kind. The GIL
// is let go while the blocks are packed: a model's weights are packed on a thread of its own while the engine's
// loop answers clients (weight_packer.py). The caller's arrays outlive the call, and with them the views.
int64_t repack_gguf_array(const py::array& raw, int64_t ggml_type, int64_t k, const py::object& row_order,
                          const py::array& out) {
  std::optional<at::Tensor> order;
  if (!row_order.is_none()) order = array_view(py::reinterpret_borrow<py::array>(row_order));
  const at::Tensor raw_view = array_view(raw), out_view = array_view(out);
  py::gil_scoped_release released;
  return std::get<1>(repack_gguf(raw_view, ggml_type, k, order, out_view));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache (CPU; float32 or float16 cache)",
        py::arg("q"), py::arg("k_cache_t"), py::arg("v_cache"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("block_tables"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("block_linear", &block_linear, "x @ W^T with W in a packed block-quantized kind (CPU, float32)",
        py::arg("x"), py::arg("packed"), py::arg("kind"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("path") = "best");
  m.def("block_linear_parts", &block_linear_parts,
        "block_linear of several packed parts, each of its own kind, their outputs side by side (one parallel call)",
        py::arg("x"), py::arg("packed"), py::arg("kinds"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("path") = "best");
  m.def("block_linear_swiglu", &block_linear_swiglu,
        "block_linear of silu(gate) * up for gate_up = [gate | up], a kind of blocks of 32 (the same bits, fused)",
        py::arg("gate_up"), py::arg("packed"), py::arg("kind"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("path") = "best");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up] (float32 rows)", py::arg("gate_up"));
  m.def("repack_gguf", &repack_gguf, "GGUF tensor rows -> (packed, kind), every weight exact", py::arg("raw"),
        py::arg("ggml_type"), py::arg("k"), py::arg("row_order") = py::none(), py::arg("out") = py::none());
  m.def("block_quant_fast", &block_quant_fast, "whether a vector block kernel (AVX-512 VNNI or AVX2) was compiled in");
  m.def("block_quant_paths", &block_quant_paths, "the block kernels' loops compiled in, fastest first");
  m.def("set_decode_batch_loop", &set_decode_batch_loop,
        "the VNNI loop decode batches of 2-8 rows run: auto (by CPU), rows or pairs (the same bits)", py::arg("name"));
  m.def("decode_batch_loop", &decode_batch_loop, "the VNNI loop decode batches of 2-8 rows run now: rows or pairs");
  m.def("set_decode_prefetch", &set_decode_prefetch,
        "how the VNNI one-row loops fetch weights ahead: auto (by CPU), t1 or nta (the same bits)",
        py::arg("name"));
  m.def("decode_prefetch", &decode_prefetch, "how the VNNI one-row loops fetch weights ahead now: t1 or nta");
  m.def("set_prompt_tile_loop", &set_prompt_tile_loop,
        "the VNNI loop a prompt's rows (more than 8) run: auto (by CPU and kind), single or pairs (the same bits)",
        py::arg("name"));
  m.def("prompt_tile_loop", &prompt_tile_loop,
        "the VNNI loop a prompt's rows run now for a packed kind: single or pairs", py::arg("kind"));
  m.def("dequantizes_gguf_rows", &dequantizes_gguf_rows, "whether dequantize_gguf_rows takes a GGUF type",
        py::arg("ggml_type"));
  m.def(
      "dequantize_gguf_rows",
      [](const py::array& raw, int64_t ggml_type, int64_t k, const py::array& out) {
        at::Tensor out_view = array_view(out);
        dequantize_gguf_rows(array_view(raw), ggml_type, k, out_view);
      },
      "GGUF rows (uint8 [N, row bytes]) into out (float32 [N, k]) with the gguf package's bits", py::arg("raw"),
      py::arg("ggml_type"), py::arg("k"), py::arg("out"));
  m.def("repack_gguf_array", &repack_gguf_array, "repack_gguf into a numpy array (no torch needed)", py::arg("raw"),
        py::arg("ggml_type"), py::arg("k"), py::arg("row_order"), py::arg("out"));
  m.def(
      "cos_sin", [](const py::array& angles) {
        const at::Tensor a = array_view(angles).contiguous();
        return py::make_tuple(float_array(a.cos()), float_array(a.sin()));
      },
      "cos and sin of float32 angles with torch's own kernels (RoPE tables with the torch path's bits)");
  m.def("release_idle_activations", &release_idle_activations,
        "free the activation pool's idle blocks (the engine, once idle); the bytes they held");
  m.def("set_num_threads", [](int64_t n) { at::set_num_threads(static_cast<int>(n)); },
        "the threads our kernels (and libtorch's) use, for callers without torch");
  m.def("get_num_threads", []() { return static_cast<int64_t>(at::get_num_threads()); });
  py::class_<CpuModel>(m, "CpuModel", py::module_local())  // local: two builds (tests) can be loaded at once
      .def(py::init<int64_t, int64_t, int64_t, double, const py::object&, double, int64_t, double, bool>())
      .def("add_layer", &CpuModel::add_layer)
      .def("forward", &CpuModel::forward)
      .def("set_head", &CpuModel::set_head)
      .def("forward_arrays", &CpuModel::forward_arrays)
      .def("head_arrays", &CpuModel::head_arrays)
      .def("set_profiling", &CpuModel::set_profiling, "time each op of the layer loop (or stop)", py::arg("on"))
      .def("take_profile", &CpuModel::take_profile,
           "[(op, seconds, calls)] of the layer loop's ops since the last take (with set_profiling on)");
}
