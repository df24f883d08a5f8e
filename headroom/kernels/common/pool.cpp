// The kernels' thread pool (see pool.h): one job at a time, handed out in chunks through
// an atomic counter; workers spin on the job generation for a while, then sleep on a
// condition variable.
#include "pool.h"

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HEADROOM_PAUSE() _mm_pause()
#else
#define HEADROOM_PAUSE() std::this_thread::yield()
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace headroom {
namespace {

constexpr int kSpins = 1 << 11;  // ~40 us of pause instructions before a worker sleeps

class Pool {
 public:
  explicit Pool(int workers) {
    // Workers start from generation 0, whenever they first run: a job posted before a
    // worker is scheduled is still its to take.
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
  }

  int size() const { return static_cast<int>(threads_.size()) + 1; }

  bool try_run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    if (busy_.exchange(true)) return false;
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_.store(0);
    error_ = nullptr;
    pending_.store(static_cast<int>(threads_.size()));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    take_chunks();
    while (pending_.load() != 0) HEADROOM_PAUSE();
    std::exception_ptr error = error_;
    busy_.store(false);
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  void take_chunks() {
    for (;;) {
      const int64_t begin = next_.fetch_add(chunk_);
      if (begin >= n_) return;
      try {
        (*fn_)(begin, std::min(n_, begin + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      int spins = 0;
      while (generation_.load() == seen && spins++ < kSpins) HEADROOM_PAUSE();
      if (generation_.load() == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load();
      take_chunks();
      pending_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> busy_{false};
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::exception_ptr error_;
};

Pool& pool() {
  // As many threads as PyTorch's intra-op setting, counting the caller. Never destroyed:
  // its workers sleep until the process ends, rather than be joined during interpreter exit.
  static Pool* instance = new Pool(std::max(0, at::get_num_threads() - 1));
  return *instance;
}

}  // namespace

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  Pool& p = pool();
  // The engine may run its steps at fewer threads than the pool has (runtime/threads.py):
  // at one, its regions run here alone.
  if (n > grain && p.size() > 1 && at::get_num_threads() > 1) {
    // A few chunks per thread, so a descheduled thread delays the job by one chunk only.
    const int64_t chunk = std::max(grain, (n + 4 * p.size() - 1) / (4 * p.size()));
    if (p.try_run(n, chunk, fn)) return;
  }
  fn(0, n);
}

std::vector<std::vector<int64_t>> deal(const std::vector<int64_t>& work, int64_t threads, int64_t per) {
  threads = std::max<int64_t>(1, threads);
  const int64_t bins = per * threads;
  std::vector<int64_t> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  std::vector<std::vector<int64_t>> dealt(bins);
  std::vector<int64_t> load(bins, 0);
  for (const int64_t item : order) {
    int64_t best = 0;
    for (int64_t i = 1; i < bins; ++i) {  // bins in the order thread 0's first, thread 1's first, ...
      const int64_t bin = (i % threads) * per + i / threads;
      if (load[bin] < load[best]) best = bin;
    }
    dealt[best].push_back(item);
    load[best] += work[item];
  }
  return dealt;
}

void parallel_rows(int64_t rows, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (rows <= kPoolRows) {
    parallel_for(n, grain, fn);
  } else {
    at::parallel_for(0, n, grain, fn);
  }
}

}  // namespace headroom
