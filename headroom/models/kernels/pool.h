// A small persistent thread pool for headroom's kernels, instead of OpenMP.
//
// Why: at decode sizes, the engine calls the kernels from its own thread, not the process's initial one,
// and libgomp starts each parallel region from such a thread ~45 us slower (measured on a
// 2-core EPYC: a batch-1 linear took 111 us from a second thread against 65 us from the
// main one). A decode step runs ~120 of them. These workers spin briefly between regions
// (a step's kernels follow each other within microseconds) and then sleep, so an idle
// server costs nothing.
#pragma once
#include <cstdint>
#include <functional>

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

}  // namespace headroom
