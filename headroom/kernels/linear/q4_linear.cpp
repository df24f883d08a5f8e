// y = x @ W^T for W stored as 4-bit groups of 32 along K (llama.cpp's Q4_1 block:
// w = scale * q + min, q in 0..15), with x and y in float32. Each group's 32 weights
// are unpacked to floats once and used for every row of x, so one sequence reads an
// eighth of the fp32 bytes and a batch shares the unpacking. AVX2 + FMA where the
// compiler targets them, plain C++ elsewhere; threads over output rows on the kernels' pool.
#include "tensor.h"

#include "pool.h"
#include <cstdint>
#include <vector>
#include "simd.h"

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 64;  // rows of x handled per pass over a group

// Packed layout per output row: K/32 groups of 16 bytes; byte j of a group holds
// element j in its low nibble and element j + 16 in its high nibble (as Q4_1 does).
inline void unpack_group(const uint8_t* q, float scale, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = scale * static_cast<float>(q[j] & 0x0F);
    w[j + 16] = scale * static_cast<float>(q[j] >> 4);
  }
}

#ifdef HEADROOM_AVX2
inline void unpack_group_avx2(const uint8_t* q, float scale, __m256* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m256 s = _mm256_set1_ps(scale);
  w[0] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  w[1] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  w[2] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  w[3] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
}
#endif

}  // namespace

// x: (M, K) float32; qweight: (N, K/2) uint8; scales, mins: (N, K/32) float32 -> (M, N)
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kFloat32 &&
                  mins.scalar_type() == torch::kFloat32, "qweight must be uint8, scales and mins float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) == K / 2 && scales.size(0) == N && scales.size(1) == G &&
                  mins.size(0) == N && mins.size(1) == G, "shapes do not match a 4-bit group-32 weight");
  auto y = torch::empty({M, N}, x.options());
  // Per-group sums of x, for the min term: sum_j (s q_j + m) x_j = s (q . x) + m sum(x).
  auto xsum = x.view({M, G, kGroup}).sum(-1).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  headroom::parallel_rows(M, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(kRowTile);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qp + n * (K / 2);
      const float* srow = sp + n * G;
      const float* mrow = mp + n * G;
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int64_t rows = std::min(kRowTile, M - m0);
#ifdef HEADROOM_AVX2
        __m256 sums[kRowTile];
        for (int64_t r = 0; r < rows; ++r) sums[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          __m256 w[4];
          unpack_group_avx2(qrow + g * 16, srow[g], w);
          for (int64_t r = 0; r < rows; ++r) {
            const float* xg = xp + (m0 + r) * K + g * kGroup;
            __m256 s = sums[r];
            s = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), s);
            s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), s);
            s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), s);
            s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), s);
            sums[r] = s;
          }
        }
        for (int64_t r = 0; r < rows; ++r) acc[r] = headroom::hsum(sums[r]);
#else
        float w[kGroup];
        for (int64_t r = 0; r < rows; ++r) acc[r] = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          unpack_group(qrow + g * 16, srow[g], w);
          for (int64_t r = 0; r < rows; ++r) {
            const float* xg = xp + (m0 + r) * K + g * kGroup;
            float s = 0.f;
            for (int j = 0; j < kGroup; ++j) s += w[j] * xg[j];
            acc[r] += s;
          }
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          const float* xsr = xs + (m0 + r) * G;
          float minterm = 0.f;
          for (int64_t g = 0; g < G; ++g) minterm += mrow[g] * xsr[g];
          yp[(m0 + r) * N + n] = acc[r] + minterm;
        }
      }
    }
  });
  return y;
}
