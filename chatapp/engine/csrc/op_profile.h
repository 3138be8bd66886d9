#pragma once
// Where a forward's time goes inside the layer loop, op by op, when asked (benchmarks/step_breakdown.py).
//
// Why: outside the loop a step can only be split into the loop, the LM head and the engine; the loop's ~20 ops a
// layer (projections, attention, norms, RoPE, KV writes) run in one C++ call. Timing each op there showed what
// no outside split could: attention took ~14% of an 8-way decode step of a 1B Q4_0 model, and 4% of a one-row
// step, where the projections alone leave nothing to win. Off by default: each op then costs one
// predictable branch; on, two clock reads (~50 ns) per op, ~20 us a step of a 22-layer model.
#include <array>
#include <chrono>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace chatapp {

class OpProfile {
 public:
  enum Op : int {
    kInputNorm,
    kQkv,
    kQkNorms,
    kRope,
    kKvStore,
    kAttention,
    kOutProjection,
    kMlpNorm,
    kGateUp,
    kDown,
    kBlockOutNorms,
    kFinalNorm,
    kOpCount
  };

  void enable(bool on) { on_ = on; }

  // f(), its time added to op's when profiling is on.
  template <class F>
  auto time(Op op, F&& f) -> decltype(f()) {
    if (!on_) return f();
    const auto start = std::chrono::steady_clock::now();
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      add(op, start);
    } else {
      auto result = f();
      add(op, start);
      return result;
    }
  }

  // (name, seconds, calls) of every op that ran since the last take, in layer order; the sums restart.
  std::vector<std::tuple<std::string, double, int64_t>> take() {
    static constexpr std::array<const char*, kOpCount> kNames = {
        "input norm", "qkv", "q/k norms", "rope", "kv store", "attention", "o", "mlp norm", "gate_up", "down",
        "block out norms", "final norm"};
    std::vector<std::tuple<std::string, double, int64_t>> out;
    for (int op = 0; op < kOpCount; ++op)
      if (calls_[op] > 0) out.emplace_back(kNames[op], seconds_[op], calls_[op]);
    seconds_.fill(0.0);
    calls_.fill(0);
    return out;
  }

 private:
  void add(Op op, std::chrono::steady_clock::time_point start) {
    seconds_[op] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++calls_[op];
  }

  bool on_ = false;
  std::array<double, kOpCount> seconds_{};
  std::array<int64_t, kOpCount> calls_{};
};

}  // namespace chatapp
