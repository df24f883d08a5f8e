// The LoRA deltas of one projection for every adapter of a step in one call (Punica's SGMV
// shape): the rows of each group run under one slot's A and B, out[row] += x[row] @ A @ B.
// In PyTorch this is a gather, two batched matmuls over slots padded to the fullest one,
// and a scatter: four dispatches and three copies a projection, on matrices too small for
// a BLAS to be efficient. Here both products are written as row updates (t += x[c] * A[c],
// y += t[r] * B[r]) whose sums stay in registers along a contiguous row of the weights, so
// a group reads its slot's A and B once for all its rows and nothing is padded.
// A fused projection's B is block-placed (q's rank rows feed q's columns only, and so on)
// and a slot is as wide as the widest adapter placed: spans[slot][r] gives the columns
// where B's row r may be non-zero, and the products skip the rest (most of B, and every
// rank row past the slot's own adapter's).
#include "tensor.h"

#include "pool.h"
#include <algorithm>
#include <cstdint>
#include <vector>
#include "simd.h"

namespace {
// Output columns per task of the expand: a slot's B for one task (R x kColumns floats)
// stays in L1/L2 while every row of the group uses it.
constexpr int64_t kColumns = 256;
// 8-float registers per row in the inner loops: 2 rows x 4 sums, 4 loads, and a broadcast
// per row fit AVX2's 16 registers.
constexpr int kVectors = 4;
constexpr int64_t kTaskRows = 8;

// t[n] = x[rows[n]] @ A for NR rows (A: (I, R)), R columns at a time in registers: each
// row of A is loaded once for the NR rows.
#ifdef HEADROOM_AVX2
template <int NR, int NV>
void shrink_block(const float* const* xr, const float* A, int64_t I, int64_t R, int64_t r0, float* t) {
  __m256 acc[NR][NV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < NV; ++v) acc[n][v] = _mm256_setzero_ps();
  for (int64_t c = 0; c < I; ++c) {
    const float* a = A + c * R + r0;
    for (int n = 0; n < NR; ++n) {
      const __m256 xv = _mm256_broadcast_ss(xr[n] + c);
      for (int v = 0; v < NV; ++v) acc[n][v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a + 8 * v), acc[n][v]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(t + n * R + r0 + 8 * v, acc[n][v]);
}

template <int NR, int NV>
void expand_block(const float* t, int64_t R, const float* B, const int64_t* span, int64_t O, int64_t j,
                  float* const* yr) {
  __m256 acc[NR][NV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < NV; ++v) acc[n][v] = _mm256_loadu_ps(yr[n] + j + 8 * v);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lo = span[2 * r], hi = span[2 * r + 1];
    if (hi <= lo || hi <= j || lo >= j + 8 * NV) continue;  // B's row r is zero here (or everywhere)
    const float* b = B + r * O + j;
    for (int n = 0; n < NR; ++n) {
      const __m256 tv = _mm256_broadcast_ss(t + n * R + r);
      for (int v = 0; v < NV; ++v) acc[n][v] = _mm256_fmadd_ps(tv, _mm256_loadu_ps(b + 8 * v), acc[n][v]);
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(yr[n] + j + 8 * v, acc[n][v]);
}
#endif

// The first `used` of the R columns of t (A's row stride stays R).
template <int NR>
void shrink(const float* x, int64_t xs, const int64_t* rows, const float* A, int64_t I, int64_t R, int64_t used,
            float* t) {
  const float* xr[NR];
  for (int n = 0; n < NR; ++n) xr[n] = x + rows[n] * xs;
  int64_t r0 = 0;
#ifdef HEADROOM_AVX2
  for (; r0 + 8 * kVectors <= used; r0 += 8 * kVectors) shrink_block<NR, kVectors>(xr, A, I, R, r0, t);
  for (; r0 + 8 <= used; r0 += 8) shrink_block<NR, 1>(xr, A, I, R, r0, t);
#endif
  for (; r0 < used; ++r0) {  // columns past the last full register block
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t c = 0; c < I; ++c) s += xr[n][c] * A[c * R + r0];
      t[n * R + r0] = s;
    }
  }
}

// y[rows[n], j0:j1] += t[n] @ B[:, j0:j1] for NR rows (B: (R, O)), the sums of a block of
// columns kept in registers across R.
template <int NR>
void expand(const float* t, int64_t R, const float* B, const int64_t* span, int64_t O, int64_t j0, int64_t j1,
            float* y, int64_t ys, const int64_t* rows) {
  float* yr[NR];
  for (int n = 0; n < NR; ++n) yr[n] = y + rows[n] * ys;
  int64_t j = j0;
#ifdef HEADROOM_AVX2
  for (; j + 8 * kVectors <= j1; j += 8 * kVectors) expand_block<NR, kVectors>(t, R, B, span, O, j, yr);
  for (; j + 8 <= j1; j += 8) expand_block<NR, 1>(t, R, B, span, O, j, yr);
#endif
  for (; j < j1; ++j) {  // columns past the last full register block
    for (int n = 0; n < NR; ++n) {
      float s = yr[n][j];
      for (int64_t r = 0; r < R; ++r)
        if (span[2 * r] <= j && j < span[2 * r + 1]) s += t[n * R + r] * B[r * O + j];
      yr[n][j] = s;
    }
  }
}

void check_float(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == torch::kFloat32 && t.stride(dim - 1) == 1, name,
              " must be a float32 tensor of ", dim, " dimensions with contiguous rows");
}
}  // namespace

// out: (N, O) float32, updated in place; x: (N, I); a: (S, I, R) and b: (S, R, O), each
// slot's A and B (contiguous); spans: (S, R, 2) int64, the columns [lo, hi) where each row
// of each slot's B may be non-zero (lo = hi: a zero row, whose rank column is never
// computed past the slot's last non-zero row); rows: (K,) int64, the batch rows grouped by adapter;
// starts: (G + 1,) int64, where each group begins in rows; slots: (G,) int64, each
// group's slot. A row is in at most one group (checked).
void lora_add_(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor spans,
               torch::Tensor rows, torch::Tensor starts, torch::Tensor slots) {
  check_float(out, 2, "out");
  check_float(x, 2, "x");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() &&
                  a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32,
              "a and b must be contiguous float32 (S, I, R) and (S, R, O)");
  const int64_t N = x.size(0), I = x.size(1), S = a.size(0), R = a.size(2), O = b.size(2);
  TORCH_CHECK(out.size(0) == N && out.size(1) == O && a.size(1) == I && b.size(0) == S && b.size(1) == R,
              "shapes do not agree: out ", out.sizes(), ", x ", x.sizes(), ", a ", a.sizes(), ", b ", b.sizes());
  for (const auto* t : {&rows, &starts, &slots})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == torch::kInt64 && t->is_contiguous(),
                "rows, starts and slots must be contiguous int64 vectors");
  TORCH_CHECK(spans.dim() == 3 && spans.size(0) == S && spans.size(1) == R && spans.size(2) == 2 &&
                  spans.scalar_type() == torch::kInt64 && spans.is_contiguous(),
              "spans must be a contiguous int64 (S, R, 2) tensor, one column range per row of B");
  const int64_t G = slots.numel(), K = rows.numel();
  TORCH_CHECK(starts.numel() == G + 1, "starts must hold one more entry than slots");
  const int64_t *rp = rows.data_ptr<int64_t>(), *sp = starts.data_ptr<int64_t>(), *gp = slots.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[G] == K, "starts must run from 0 to the number of rows");
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(sp[g] <= sp[g + 1] && gp[g] >= 0 && gp[g] < S, "group ", g, ": bad start or slot");
  // Tasks of different groups write their rows at once: a row in two groups would race.
  std::vector<uint8_t> taken(N, 0);
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "row ", rp[i], " is outside the batch");
    TORCH_CHECK(!taken[rp[i]], "row ", rp[i], " is in more than one group");
    taken[rp[i]] = 1;
  }
  if (K == 0 || R == 0) return;

  const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const int64_t* spp = spans.data_ptr<int64_t>();
  // Each group's rank: the rows of its slot up to the last one with columns (the rank
  // columns past it are never computed, nor read: their spans are empty).
  std::vector<int64_t> rank(G, 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = R; r > 0; --r)
      if (spp[(gp[g] * R + r - 1) * 2 + 1] > spp[(gp[g] * R + r - 1) * 2]) {
        rank[g] = r;
        break;
      }
  float* yp = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = out.stride(0);
  auto shrunk = torch::empty({K, R}, x.options());
  float* tp = shrunk.data_ptr<float>();

  // Tasks of at most kTaskRows rows of one group, so that a prefill chunk's large group is
  // shared between threads as a step's many small ones are.
  std::vector<int64_t> task_group, task_start;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = sp[g]; i < sp[g + 1]; i += kTaskRows) {
      task_group.push_back(g);
      task_start.push_back(i);
    }
  const int64_t T = static_cast<int64_t>(task_group.size());
  auto rows_of = [&](int64_t task, auto&& each) {  // each(first row, rows: 2 or 1)
    const int64_t g = task_group[task], end = std::min(sp[g + 1], task_start[task] + kTaskRows);
    int64_t i = task_start[task];
    for (; i + 2 <= end; i += 2) each(i, 2);
    if (i < end) each(i, 1);
  };

  // t = x @ A: each row of the slot's A meets a column of two rows at once.
  headroom::parallel_rows(K, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task_group[task];
      const float* A = ap + gp[g] * I * R;
      rows_of(task, [&](int64_t i, int n) {
        if (n == 2) shrink<2>(xp, xs, rp + i, A, I, R, rank[g], tp + i * R);
        else shrink<1>(xp, xs, rp + i, A, I, R, rank[g], tp + i * R);
      });
    }
  });

  // out += t @ B, a task's rows and a run of columns at a time.
  const int64_t chunks = (O + kColumns - 1) / kColumns;
  headroom::parallel_rows(K, T * chunks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t task = w / chunks, j0 = (w % chunks) * kColumns, j1 = std::min(O, j0 + kColumns);
      const int64_t slot = gp[task_group[task]];
      const float* B = bp + slot * R * O;
      const int64_t* span = spp + slot * R * 2;
      rows_of(task, [&](int64_t i, int n) {
        if (n == 2) expand<2>(tp + i * R, R, B, span, O, j0, j1, yp, ys, rp + i);
        else expand<1>(tp + i * R, R, B, span, O, j0, j1, yp, ys, rp + i);
      });
    }
  });
}
