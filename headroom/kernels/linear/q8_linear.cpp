// y = x @ W^T for W stored as 8-bit groups of 32 along K, x and y float32. Two forms:
// symmetric, int8 q with one scale per group (llama.cpp's Q8_0 block: w = scale * q), and
// with a minimum, uint8 q with a scale and a minimum per group (w = scale * q + min), which
// holds any Q4_1 group exactly (q = 17 * its 4-bit value). Same shape of loop as
// q4_linear.cpp: each group is widened to floats once and used for every row of x.
#include "tensor.h"

#include "pool.h"
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace {
constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 32;
}  // namespace

#ifdef HEADROOM_AVX2
// Eight weights of a group as floats: scale * q.
template <typename Q>
inline __m256 widen(const Q* q, __m256 scale) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  const __m256i wide = std::is_same_v<Q, uint8_t> ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
  return _mm256_mul_ps(scale, _mm256_cvtepi32_ps(wide));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#ifdef HEADROOM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = headroom::hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Q: int8_t (symmetric, mp null) or uint8_t (with a minimum per group in mp). The minimum
// adds min * sum(x over the group) to a dot product; those sums are taken once per row of
// x here, not once per weight row.
template <typename Q>
void q8_rows(const float* xp, const Q* qp, const float* sp, const float* mp, float* yp,
             int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  std::vector<float> xsum(mp ? M * G : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    float s = 0.f;
    for (int j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
    xsum[i] = s;
  }
  // sum over groups of min * (sum of x over the group), for weight row `mins`, x row r
  auto offset = [&](const float* mins, int64_t r) { return mins ? dot(mins, xsum.data() + r * G, G) : 0.f; };

  // Two output rows per pass, so each load of x feeds two FMAs.
  headroom::parallel_rows(M, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t n = 2 * pair;
      const bool two = n + 1 < N;
      const Q* qa = qp + n * K;
      const Q* qb = two ? qa + K : qa;
      const float* sa = sp + n * G;
      const float* sb = two ? sa + G : sa;
      const float* ma = mp ? mp + n * G : nullptr;
      const float* mb = mp ? (two ? ma + G : ma) : nullptr;
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
            wa[i] = widen(qa + at, fa);
            wb[i] = widen(qb + at, fb);
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
          yp[(m0 + r) * N + n] = headroom::hsum(suma[r]) + offset(ma, m0 + r);
          if (two) yp[(m0 + r) * N + n + 1] = headroom::hsum(sumb[r]) + offset(mb, m0 + r);
        }
#else
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = xp + (m0 + r) * K;
          for (int64_t which = 0; which < (two ? 2 : 1); ++which) {
            const Q* qrow = which ? qb : qa;
            const float* srow = which ? sb : sa;
            const float* mrow = which ? mb : ma;
            float acc = offset(mrow, m0 + r);
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
}

// x: (M, K) float32; qweight: (N, K) int8, or uint8 with mins; scales (and mins): (N, K/32)
// float32 -> (M, N)
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        std::optional<torch::Tensor> mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  const bool with_min = mins.has_value();
  TORCH_CHECK(qweight.scalar_type() == (with_min ? torch::kUInt8 : torch::kInt8) &&
              scales.scalar_type() == torch::kFloat32,
              "qweight must be int8 (uint8 with mins) and scales float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) == K && scales.size(0) == N && scales.size(1) == G,
              "shapes do not match an 8-bit group-32 weight");
  TORCH_CHECK(!with_min || (mins->scalar_type() == torch::kFloat32 && mins->sizes() == scales.sizes()),
              "mins must be float32 and shaped like scales");
  auto y = torch::empty({M, N}, x.options());
  if (with_min) {
    q8_rows(x.data_ptr<float>(), qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
            mins->data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  } else {
    q8_rows(x.data_ptr<float>(), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), nullptr,
            y.data_ptr<float>(), M, K, N);
  }
  return y;
}
