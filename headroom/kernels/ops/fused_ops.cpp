// The small float32 ops of a decoder layer, one call each instead of several PyTorch ops
// (which cost more in dispatch than in arithmetic at decode sizes): RMSNorm, the residual
// add fused into the next RMSNorm, SiLU(gate) * up, and rotate-half RoPE in place.
#include "tensor.h"

#include "pool.h"
#include <cmath>
#include <cstdint>
#include "simd.h"

namespace {

// Rows per task: small batches run on one thread, where a parallel region costs more than it saves.
constexpr int64_t kRowGrain = 16;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous 2-D float32 tensor");
}

inline void norm_row(const float* x, const float* w, float* y, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * inv * w[i];
}

}  // namespace

// x: (M, D), weight: (D,) -> x / rms(x) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "weight must be float32 of the row's size");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  headroom::parallel_rows(M, M, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  });
  return y;
}

// x += delta in place, then -> rms_norm(x): the residual add and the next layer's norm.
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must be shaped like x");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(),
              "weight must be float32 of the row's size");
  auto y = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  headroom::parallel_rows(M, M, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = xp + r * D;
      for (int64_t i = 0; i < D; ++i) row[i] += dp[r * D + i];
      norm_row(row, wp, yp + r * D, D, static_cast<float>(eps));
    }
  });
  return y;
}

// gate_up: (M, 2I), gate first -> (M, I): silu(gate) * up
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto y = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  headroom::parallel_rows(M, M, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = gp + r * 2 * I, *u = g + I;
      float* out = yp + r * I;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= I; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = headroom::exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

namespace {
void rope_heads(torch::Tensor& x, const float* cp, const float* sp, int64_t half) {
  const int64_t N = x.size(0), H = x.size(1), row = x.stride(0), head = x.stride(1);
  float* xp = x.data_ptr<float>();
  headroom::parallel_rows(N, N, kRowGrain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float *c = cp + n * half, *s = sp + n * half;
      for (int64_t h = 0; h < H; ++h) {
        float* a = xp + n * row + h * head;
        float* b = a + half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}
}  // namespace

// q: (N, Hq, D), k: (N, Hk, D), views whose heads are contiguous (e.g. slices of one qkv
// row); cos, sin: (N, D/2) contiguous. Rotates both in place (rotate-half pairing).
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (const auto* t : {&q, &k})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == torch::kFloat32 && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2), "q and k must be float32 (N, H, D) with contiguous heads");
  const int64_t N = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(k.size(0) == N && k.size(2) == q.size(2) && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == N * half && sin.numel() == N * half && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32, "cos and sin must be contiguous float32 (N, D/2)");
  rope_heads(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rope_heads(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
}
