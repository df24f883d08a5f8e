// y = x @ W^T for W stored as int8 groups of 32 along K with one float scale per group
// (llama.cpp's Q8_0 block: w = scale * q), x and y float32. Same shape of loop as
// q4_linear.cpp: each group is widened to floats once and used for every row of x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include "simd.h"

namespace {
constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 32;
}  // namespace

// x: (M, K) float32; qweight: (N, K) int8; scales: (N, K/32) float32 -> (M, N)
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && scales.scalar_type() == torch::kFloat32,
              "qweight must be int8 and scales float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) == K && scales.size(0) == N && scales.size(1) == G,
              "shapes do not match an int8 group-32 weight");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // Two output rows per pass, so each load of x feeds two FMAs.
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t n = 2 * pair;
      const bool two = n + 1 < N;
      const int8_t* qa = qp + n * K;
      const int8_t* qb = two ? qa + K : qa;
      const float* sa = sp + n * G;
      const float* sb = two ? sa + G : sa;
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, M - m0);
#ifdef HEADROOM_AVX2
        __m256 suma[kRowTile], sumb[kRowTile];
        for (int64_t r = 0; r < rows; ++r) suma[r] = sumb[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          __m256 wa[4], wb[4];
          const __m256 fa = _mm256_set1_ps(sa[g]), fb = _mm256_set1_ps(sb[g]);
          for (int i = 0; i < 4; ++i) {
            const int64_t at = g * kGroup + 8 * i;
            wa[i] = _mm256_mul_ps(fa, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qa + at)))));
            wb[i] = _mm256_mul_ps(fb, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + at)))));
          }
          for (int64_t r = 0; r < rows; ++r) {
            const float* xg = xp + (m0 + r) * K + g * kGroup;
            __m256 a = suma[r], b = sumb[r];
            for (int i = 0; i < 4; ++i) {
              const __m256 xv = _mm256_loadu_ps(xg + 8 * i);
              a = _mm256_fmadd_ps(wa[i], xv, a);
              b = _mm256_fmadd_ps(wb[i], xv, b);
            }
            suma[r] = a;
            sumb[r] = b;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          yp[(m0 + r) * N + n] = headroom::hsum(suma[r]);
          if (two) yp[(m0 + r) * N + n + 1] = headroom::hsum(sumb[r]);
        }
#else
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = xp + (m0 + r) * K;
          for (int64_t which = 0; which < (two ? 2 : 1); ++which) {
            const int8_t* qrow = which ? qb : qa;
            const float* srow = which ? sb : sa;
            float acc = 0.f;
            for (int64_t g = 0; g < G; ++g) {
              float s = 0.f;
              for (int j = 0; j < kGroup; ++j) s += static_cast<float>(qrow[g * kGroup + j]) * xr[g * kGroup + j];
              acc += srow[g] * s;
            }
            yp[(m0 + r) * N + n + which] = acc;
          }
        }
#endif
      }
    }
  });
  return y;
}
