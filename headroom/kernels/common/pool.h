// A small persistent thread pool for headroom's kernels, instead of OpenMP.
//
// Why: at decode sizes a step runs ~120 kernel calls of 20-80 us each, while the server's
// event-loop thread wakes for every token. libgomp's workers spin without yielding and
// then sleep on a futex, so a region that meets the event loop on a 2-core machine waits
// for a descheduled worker: measured in the server, a batch-1 decode step took 18-20 ms
// with every kernel on OpenMP against 12-13 ms on this pool, whose workers yield while
// they spin (~40 us) and then sleep, so an idle server costs nothing. (Offline, from one
// thread, the two are within 10%.) Regions started from a thread other than the one that
// first used OpenMP cost ~50 us more again; see Engine.started.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace headroom {

// Calls fn(begin, end) over disjoint chunks covering [0, n), on the pool's workers and
// the calling thread; returns when all are done, rethrowing the first exception. Ranges
// of at most `grain` items, and calls made while the pool is busy (nested, or from a
// second thread), run on the calling thread alone.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// For a kernel over a batch of `rows`: batches of a few rows (decode at low concurrency,
// where headroom's kernels run back to back) on the pool above; larger ones on PyTorch's
// OpenMP threads, which the float matmuls between them use too, so that two pools never
// alternate (and spin against each other) within one step.
constexpr int64_t kPoolRows = 4;
void parallel_rows(int64_t rows, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Items of the given work dealt into `per` bins a thread, of about equal work: heaviest
// first, each to the bin with the least so far, ties to the first in the order thread 0's
// first bin, thread 1's first, ..., so that equal items alternate between threads. A loop
// over the bins that hands each thread a contiguous run of them (at::parallel_for) then
// gives the threads about equal work, where by position alone one thread could take all
// the heavy items (a step's long rows, a causal chunk's later tiles). Returns the items'
// indices, a list per bin.
std::vector<std::vector<int64_t>> deal(const std::vector<int64_t>& work, int64_t threads, int64_t per = 4);

}  // namespace headroom
