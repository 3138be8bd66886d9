// activation_pool.h says why.
#include "activation_pool.h"

#include <c10/util/accumulate.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

constexpr size_t kPooledBytes = size_t{1} << 20;  // smaller blocks: glibc's heap keeps and reuses them itself
constexpr size_t kIdleBytes = size_t{256} << 20;  // what may wait in the pool between steps

class Pool {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = idle_.find(bytes);
      if (it != idle_.end()) {
        void* block = it->second;
        idle_.erase(it);
        idle_bytes_ -= bytes;
        return block;
      }
    }
    void* block = nullptr;
    if (posix_memalign(&block, 64, bytes) != 0) throw std::bad_alloc();
    return block;
  }

  // Every idle block, out of the pool (the caller frees them outside the lock); the bytes they held.
  size_t drain(std::vector<void*>& blocks) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [bytes, block] : idle_) blocks.push_back(block);
    idle_.clear();
    return std::exchange(idle_bytes_, 0);
  }

  // A tensor's block comes back (its deleter, on whichever thread freed the tensor).
  void give(void* block, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (idle_bytes_ + bytes <= kIdleBytes) {
        idle_.emplace(bytes, block);
        idle_bytes_ += bytes;
        return;
      }
    }
    std::free(block);
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, void*> idle_;  // by size in bytes
  size_t idle_bytes_ = 0;
};

// Never destroyed: a tensor may be freed after static destructors ran.
Pool& pool() {
  static Pool* const instance = new Pool;
  return *instance;
}

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kPooledBytes || options.device().type() != at::kCPU) return at::empty(sizes, options);
  void* block = pool().take(bytes);
  return at::from_blob(block, sizes, [bytes](void* p) { pool().give(p, bytes); }, options);
}

int64_t release_idle_activations() {
  std::vector<void*> blocks;
  const size_t bytes = pool().drain(blocks);
  for (void* block : blocks) std::free(block);
#if defined(__GLIBC__)
  if (bytes > 0) malloc_trim(0);  // blocks under glibc's mmap threshold went to its heap: return what is free
#endif
  return static_cast<int64_t>(bytes);
}
