// Decode attention on the CPU that reads K and V in place from the paged cache (no
// gather into a padded copy, no mask): one query token per sequence, float32 queries and
// arithmetic over a float32, float16, bfloat16 or int8 cache (16 bits halve the bytes a
// step reads, int8 rows with a scale nearly halve them again; they are widened to float32
// as they are loaded), any GQA ratio. The query heads
// that share a kv head are scored together so each cached key and value is read once per
// step. Given this step's keys and values with their slots, it writes them into the cache
// first. With AVX2 (AVX-512 builds included: the spans read the cache faster there than a
// kernel per (sequence, kv head) with 512-bit vectors did, bench/RESULTS.md), each
// sequence's context is read in spans by the tile kernel (see decode_spans).
#include "tensor.h"

#include "decode_spans.h"
#include "paged_tile.h"
#include "pool.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;

// Widening to float32 is exact for both 16-bit types (a bf16 is the top half of a float32).
inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }
inline float widen(f16 x) { return static_cast<float>(x); }
// Rounded to nearest even, as torch's .to(torch.bfloat16) and .to(torch.float16) round.
template <typename T>
inline void store_row(const float* src, T* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i]);
}
// An int8 row (paged_tile.h: its scale before its values): max |x| / 127 and each value
// x / scale rounded to nearest even, the same float32 operations as the torch write
// (executor/attention/kv_rows.py), so rows written by either are the same bytes.
inline void store_row(const float* src, int8_t* dst, int64_t d) {
  float top = 0.f;
  for (int64_t i = 0; i < d; ++i) top = std::max(top, std::fabs(src[i]));
  float scale = top / 127.f;
  if (!(scale > 0.f) || !std::isfinite(scale)) scale = 1.f;  // a zero row, or one past float's range
  std::memcpy(dst - headroom::kScaleBytes, &scale, sizeof scale);
  for (int64_t i = 0; i < d; ++i)
    dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(src[i] / scale), -127.f, 127.f));
}

// Elements between two kv heads' rows of a cache of T.
template <typename T>
constexpr int64_t cache_row(int64_t d) {
  return std::is_same_v<T, int8_t> ? d + headroom::kScaleBytes : d;
}

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

// The AVX2 path: the step's rows cut into spans of their keys (decode_spans.h), dealt to
// the threads by their keys (headroom::deal), then the cut rows merged.
template <typename T>
void decode_spans(const float* qp, T* kc, T* vc, const int32_t* tp, const int32_t* lp, float* op, int64_t B,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t W, int64_t block_size, float s, const float* knp,
                  const float* vnp, int64_t kn_row, int64_t vn_row, const int64_t* sp) {
  const int64_t group = Hq / Hkv, R = cache_row<T>(D);
  const int64_t token_stride = Hkv * R, block_stride = block_size * token_stride;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && (lp[b] + block_size - 1) / block_size <= W, "seq_len does not fit the block table");
    if (sp != nullptr)  // this step's keys and values first, before any span reads them
      for (int64_t h = 0; h < Hkv; ++h) {
        store_row(knp + b * kn_row + h * D, kc + sp[b] * token_stride + h * R, D);
        store_row(vnp + b * vn_row + h * D, vc + sp[b] * token_stride + h * R, D);
      }
  }
  const int64_t threads = at::get_num_threads();
  headroom::Spans spans;
  for (int64_t b = 0; b < B; ++b) headroom::cut_row(spans, b, b, lp[b], headroom::span_keys(lp[b]), Hkv);
  headroom::split_heads(spans, threads);
  std::vector<int64_t> work;
  for (const auto& span : spans.items) work.push_back((span.last - span.first) * span.heads);
  const auto bins = headroom::deal(work, threads);
  std::vector<float> partial(spans.slots * headroom::slot_floats(Hq, D));
  headroom::parallel_rows(B, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> own(headroom::slot_floats(Hq, D));
    for (int64_t bin = begin; bin < end; ++bin)
      for (const int64_t i : bins[bin]) {
        const headroom::Span& span = spans.items[i];
        const int64_t b = span.seq;
        const headroom::TileArgs a{qp + b * Hq * D, op + b * Hq * D, Hq * D, 1, lp[b] - 1, group, D, tp + b * W,
                                   block_size, token_stride, block_stride, R, 0, s};
        headroom::attend_span(span, a, Hkv, kc, vc, partial.data(), own.data());
      }
  });
  headroom::merge_spans(spans, partial.data(), Hq, D, op);
}

// The cache's element type T is float, f16, bf16 or int8 (rows of a scale and D values);
// q, k_new, v_new and the output are float32.
template <typename T>
void decode(const float* qp, T* kc, T* vc, const int32_t* tp, const int32_t* lp, float* op, int64_t B, int64_t Hq,
            int64_t Hkv, int64_t D, int64_t W, int64_t block_size, float s, const float* knp, const float* vnp,
            int64_t kn_row, int64_t vn_row, const int64_t* sp) {
  const int64_t group = Hq / Hkv, R = cache_row<T>(D);
  const int64_t token_stride = Hkv * R, block_stride = block_size * token_stride;
  if (headroom::tile_available(D)) {
    decode_spans(qp, kc, vc, tp, lp, op, B, Hq, Hkv, D, W, block_size, s, knp, vnp, kn_row, vn_row, sp);
    return;
  }
  // This step's keys and values first, before any row reads them: rows of one sequence
  // (a decode row and the rows after its guesses) read each other's.
  if (sp != nullptr)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hkv; ++h) {
        store_row(knp + b * kn_row + h * D, kc + sp[b] * token_stride + h * R, D);
        store_row(vnp + b * vn_row + h * D, vc + sp[b] * token_stride + h * R, D);
      }
  headroom::parallel_rows(B, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= W, "seq_len does not fit the block table");
      const float* qh = qp + (b * Hq + h * group) * D;
      const int32_t* table = tp + b * W;
      scores.assign(group * len, 0.f);
      // Portable: each cached row widened to float32 first, then AVX2 where the build has it.
      auto cached = [&](const T* cache, int64_t t) -> const float* {
        const T* at = cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * R;
        if constexpr (std::is_same_v<T, float>) {
          return at;
        } else if constexpr (std::is_same_v<T, int8_t>) {
          const float scale = headroom::scale_of(at);
          for (int64_t i = 0; i < D; ++i) row[i] = static_cast<float>(at[i]) * scale;
          return row.data();
        } else {
          for (int64_t i = 0; i < D; ++i) row[i] = widen(at[i]);
          return row.data();
        }
      };
      for (int64_t t = 0; t < len; ++t) {
        const float* key = cached(kc, t);
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = s * dot(qh + g * D, key, D);
      }
      std::vector<float> total(group);
      for (int64_t g = 0; g < group; ++g) {
        float* srow = scores.data() + g * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) top = std::max(top, srow[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          srow[t] = std::exp(srow[t] - top);
          sum += srow[t];
        }
        total[g] = sum;
        float* o = op + (b * Hq + h * group + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
      }
      for (int64_t t = 0; t < len; ++t) {
        const float* value = cached(vc, t);
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
}

}  // namespace

// q: (B, Hq, D) float32; caches: (num_blocks, block_size, Hkv, D), both float32, float16 or
// bfloat16, or (num_blocks, block_size, Hkv, kScaleBytes + D) int8 rows (paged_tile.h); block_tables: (B, W) int32; seq_lens: (B,) int32 (context length including this
// token) -> (B, Hq, D) float32. With k_new and v_new (B, Hkv, D) float32 and slots (B,)
// int64, those are first written to the cache at the slots (rounded to the cache's dtype).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     std::optional<torch::Tensor> k_new, std::optional<torch::Tensor> v_new,
                                     std::optional<torch::Tensor> slots) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode_attention takes float32 queries");
  TORCH_CHECK((kv == torch::kFloat32 || kv == torch::kBFloat16 || kv == torch::kHalf || kv == torch::kInt8) &&
                  v_cache.scalar_type() == kv,
              "the caches must be both float32, both float16, both bfloat16 or both int8");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const int64_t row = kv == torch::kInt8 ? D + headroom::kScaleBytes : D;  // an int8 row: its scale, then D values
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == row && v_cache.sizes() == k_cache.sizes(),
              "head counts or head_dim do not match");
  auto out = torch::empty_like(q);
  const bool write = k_new.has_value();
  TORCH_CHECK(write == v_new.has_value() && write == slots.has_value(), "give k_new, v_new and slots together");
  const float *knp = nullptr, *vnp = nullptr;
  const int64_t* sp = nullptr;
  int64_t kn_row = 0, vn_row = 0;
  if (write) {
    for (const auto* t : {&*k_new, &*v_new})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->dim() == 3 && t->size(0) == B && t->size(1) == Hkv &&
                      t->size(2) == D && t->stride(2) == 1 && t->stride(1) == D,
                  "k_new and v_new must be float32 (B, Hkv, D) with contiguous heads");
    TORCH_CHECK(slots->scalar_type() == torch::kInt64 && slots->numel() == B && slots->is_contiguous(),
                "slots must be int64 (B,)");
    knp = k_new->data_ptr<float>();
    vnp = v_new->data_ptr<float>();
    kn_row = k_new->stride(0);
    vn_row = v_new->stride(0);
    sp = slots->data_ptr<int64_t>();
  }
  const float s = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  if (kv == torch::kFloat32)
    decode(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, lp, op, B, Hq, Hkv, D, W, block_size, s,
           knp, vnp, kn_row, vn_row, sp);
  else if (kv == torch::kHalf)
    decode(qp, reinterpret_cast<f16*>(k_cache.data_ptr<at::Half>()), reinterpret_cast<f16*>(v_cache.data_ptr<at::Half>()),
           tp, lp, op, B, Hq, Hkv, D, W, block_size, s, knp, vnp, kn_row, vn_row, sp);
  else if (kv == torch::kInt8)  // at the first row's values, past its scale
    decode(qp, k_cache.data_ptr<int8_t>() + headroom::kScaleBytes, v_cache.data_ptr<int8_t>() + headroom::kScaleBytes,
           tp, lp, op, B, Hq, Hkv, D, W, block_size, s, knp, vnp, kn_row, vn_row, sp);
  else
    decode(qp, k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), tp, lp, op, B, Hq, Hkv, D, W, block_size, s,
           knp, vnp, kn_row, vn_row, sp);
  return out;
}
