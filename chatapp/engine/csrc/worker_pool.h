#pragma once
// The threads our C++ code splits its work over (a linear layer's tiles, attention's tasks, row loops, the GGUF
// repack), in place of an OpenMP parallel region per call.
//
// Why: a decode step makes ~5 parallel calls per layer, microseconds apart. OpenMP waits passively after a
// short spin (chatapp/__init__.py sets it so: threads that spin for long collapse when another process wants
// the core), so its worker slept between calls and every call began with a futex wake; and an OpenMP region
// ends only when every thread of its team has arrived, so a worker the OS had not yet scheduled held the
// caller up. Here:
// - a call never waits for a worker that has not joined it: the parts are claimed one by one from a shared
//   counter, by the caller too, so a caller whose workers are busy elsewhere (or descheduled) does them all;
//   it waits only for the parts already begun;
// - between calls a worker spins (pausing) for a while and then sleeps; past the first microseconds it yields
//   the core at every check, so a process wanting that core gets it.
// Which thread computes a part never changes its arithmetic: answers stay the same bits.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>

namespace chatapp {

class WorkerPool {
 public:
  // Runs body(part) for every part in [0, parts) on the calling thread and up to threads - 1 workers, and
  // returns when all are done (rethrowing the first exception a part threw). A call made while the pool is
  // busy (another thread's call, or a call from inside a part) runs its parts on the calling thread.
  template <class Body>
  void run(int64_t parts, int64_t threads, Body&& body) {
    std::unique_lock<std::mutex> turn(run_mutex_, std::try_to_lock);
    if (parts <= 1 || threads <= 1 || !turn.owns_lock()) {
      for (int64_t p = 0; p < parts; ++p) body(p);
      return;
    }
    grow(threads - 1);
    using Fn = std::remove_reference_t<Body>;
    Job job{[](const void* body, int64_t p) { (*static_cast<const Fn*>(body))(p); }, &body, parts};
    job_.store(&job, std::memory_order_seq_cst);
    open_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(job);
    open_.store(false, std::memory_order_seq_cst);  // from here no worker joins: it checks open_ after counting itself
    wait_for([&] { return active_.load(std::memory_order_seq_cst) == 0; });
    if (job.error) std::rethrow_exception(job.error);
  }

  // The process's pool. A child made by fork() gets a new one (its parent's workers do not exist there, and a
  // lock one of them held would stay locked); a pool is never destroyed: its detached workers outlive static
  // destructors.
  static WorkerPool& instance() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { current() = new WorkerPool(); }); });
    return *current();
  }

 private:
  static WorkerPool*& current() {
    static WorkerPool* pool = new WorkerPool();
    return pool;
  }

  struct Job {
    void (*call)(const void*, int64_t);  // runs part p of the caller's body
    const void* body;
    int64_t parts;
    std::atomic<int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
  };

  static constexpr auto kSpinOnly = std::chrono::microseconds(50);  // then every check also yields the core
  static constexpr auto kSleepAfter = std::chrono::milliseconds(2);  // idle this long, a worker sleeps

  // Spin (pausing) until done(); past kSpinOnly yield at every check; with may_give_up, false past kSleepAfter.
  template <class Done>
  static bool wait_for(Done&& done, bool may_give_up = false) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (done()) return true;
        _mm_pause();
      }
      const auto waited = std::chrono::steady_clock::now() - start;
      if (may_give_up && waited > kSleepAfter) return false;
      if (waited > kSpinOnly) sched_yield();
    }
  }

  static void work(Job& job) {
    for (;;) {
      const int64_t p = job.next.fetch_add(1, std::memory_order_relaxed);
      if (p >= job.parts) return;
      try {
        job.call(job.body, p);
      } catch (...) {
        std::lock_guard<std::mutex> lock(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
      }
    }
  }

  void grow(int64_t workers) {
    while (started_ < workers) {
      std::thread(&WorkerPool::worker_loop, this).detach();
      ++started_;
    }
  }

  void worker_loop() {
    uint64_t seen = generation_.load(std::memory_order_seq_cst);
    auto posted = [&] { return generation_.load(std::memory_order_seq_cst) != seen; };
    for (;;) {
      if (!wait_for(posted, true)) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, posted);  // the caller notifies under sleep_mutex_ after bumping generation_
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = generation_.load(std::memory_order_seq_cst);
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst)) work(*job_.load(std::memory_order_seq_cst));
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex run_mutex_;  // one call at a time; held by the caller for its call
  std::atomic<Job*> job_{nullptr};
  std::atomic<bool> open_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> active_{0};  // workers inside the current call
  std::atomic<int64_t> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  int64_t started_ = 0;  // guarded by run_mutex_
};

// body(part) for part in [0, parts), split over at::get_num_threads() threads (see WorkerPool).
template <class Body>
inline void parallel_parts(int64_t parts, Body&& body) {
  WorkerPool::instance().run(parts, std::min<int64_t>(at::get_num_threads(), parts), body);
}

// Rows per part for a pass over rows of `width` values: about kPartValues each. A decode batch of a few rows is
// then split across the threads (a part outweighs handing it to a spinning worker, ~1 us), where a grain of 64
// rows left those passes to one thread while the other waited (quantizing, norms, RoPE, SiLU: ~8% of an 8-way
// step on one thread); one short row still runs inline.
constexpr int64_t kPartValues = 8192;
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kPartValues / std::max<int64_t>(width, 1)); }

// f(b, e) over [begin, end) in one contiguous chunk per thread, each at least `grain` long, as at::parallel_for
// splits a range, but on the pool: with a second set of threads (OpenMP's) beside ours, each spun while the other
// needed the core. A range of at most `grain` runs here, inline.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (parts <= 1) return f(begin, end);
  const int64_t chunk = (n + parts - 1) / parts;
  parallel_parts(parts, [&](int64_t p) {
    const int64_t first = begin + p * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  });
}

}  // namespace chatapp
