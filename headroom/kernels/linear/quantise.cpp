// x rounded to int8 per group of 32 (quantise.h says for whom and why).
#include "quantise.h"

#include "pool.h"
#include "simd.h"

#ifdef HEADROOM_AVX2
namespace headroom {
QuantisedX quantise_x(const float* x, int64_t M, int64_t K) {
  constexpr int64_t kGroup = 32;
  const int64_t G = K / kGroup;
  QuantisedX out{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  parallel_rows(M, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* xg = x + i * kGroup;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(xg + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.f;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * kGroup), bytes);
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      out.d[i] = d;
      out.sum[i] = d * static_cast<float>(_mm_cvtsi128_si32(s));
    }
  });
  return out;
}
}  // namespace headroom
#endif
