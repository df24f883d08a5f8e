// Decode attention on the CPU that reads K and V in place from the paged cache (no
// gather into a padded copy, no mask): one query token per sequence, float32, any GQA
// ratio. Threads over (sequence, kv head); the query heads that share a kv head are
// scored together so each cached key and value is read once per step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "simd.h"

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef HEADROOM_AVX2
  if (d % 8 == 0) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    return headroom::hsum(s);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t d) {
#ifdef HEADROOM_AVX2
  if (d % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) y[i] += p * x[i];
}

}  // namespace

// q: (B, Hq, D); caches: (num_blocks, block_size, Hkv, D); block_tables: (B, W) int32;
// seq_lens: (B,) int32 (context length including this token) -> (B, Hq, D)
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention is float32 only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "head counts or head_dim do not match");
  const int64_t group = Hq / Hkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = Hkv * D, block_stride = block_size * Hkv * D;
  const float s = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= W, "seq_len does not fit the block table");
      scores.assign(group * len, 0.f);
      const float* qh = qp + (b * Hq + h * group) * D;
      for (int64_t t = 0; t < len; ++t) {
        const float* key = kp + tp[b * W + t / block_size] * block_stride + (t % block_size) * token_stride + h * D;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = s * dot(qh + g * D, key, D);
      }
      std::vector<float> total(group);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) top = std::max(top, row[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - top);
          sum += row[t];
        }
        total[g] = sum;
        float* o = op + (b * Hq + h * group + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
      }
      for (int64_t t = 0; t < len; ++t) {
        const float* value = vp + tp[b * W + t / block_size] * block_stride + (t % block_size) * token_stride + h * D;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + t], value, op + (b * Hq + h * group + g) * D, D);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + (b * Hq + h * group + g) * D;
        const float inv = 1.f / total[g];
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
    }
  });
  return out;
}
