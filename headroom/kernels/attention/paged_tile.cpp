// Attention of a tile of query rows (up to 8 tokens, 64 on AVX-512, times the query heads
// of one kv head) over a paged context, read in place. The context is walked 16 keys at a
// time (64 on AVX-512):
// each key and value row is widened to float32 once per tile (not once per query row,
// and never into a copy of the whole context), scored against every row of the tile,
// and folded in with an online softmax, so a chunk deep in a long context costs its
// tokens' arithmetic and one pass over the cache. Rows are causal: token j of the tile
// sees keys [0, first_pos + j]. AVX-512 builds run the tile with 512-bit vectors and the
// keys transposed (attend16); the decode spans keep 256-bit vectors on every build (on a
// Zen 5 they read the cache faster than a 512-bit kernel per kv head did, bench/RESULTS.md).
#include "paged_tile.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace headroom {

#if defined(HEADROOM_AVX2) && defined(__F16C__)

namespace {

using bf16 = c10::BFloat16;
using f16 = c10::Half;
constexpr int64_t kKeys = 16;  // keys per pass

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // a bf16 is a float32's top half
}
// Dims [i, i + 8) of the cache row at `row`, widened: an int8 row's values times its scale.
template <typename T>
inline __m256 load8(const T* row, int64_t i) { return load8(row + i); }
inline __m256 load8(const int8_t* row, int64_t i) {
  const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(scale_of(row)));
}
// The decode spans take an int8 row's scale out of the loads: the key's once into its
// score and the value's into its weight, one multiply a row rather than one a dim.
template <typename T>
inline __m256 load8_unscaled(const T* row, int64_t i) { return load8(row + i); }
inline __m256 load8_unscaled(const int8_t* row, int64_t i) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i))));
}
// Where a row's bytes begin: an int8 row's scale before its values.
template <typename T>
inline const char* row_start(const T* row) {
  return reinterpret_cast<const char*>(row) - (std::is_same_v<T, int8_t> ? kScaleBytes : 0);
}
template <typename T>
inline int64_t row_bytes_of(int64_t d) {
  return d * static_cast<int64_t>(sizeof(T)) + (std::is_same_v<T, int8_t> ? kScaleBytes : 0);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// q . key[j] for the 8 keys, one lane each: eight accumulators, then a transposing sum.
inline __m256 dots8(const float* q, const float* const* key, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[3] + i), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[4] + i), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[5] + i), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[6] + i), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[7] + i), a7);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Lanes at or past `valid` (0..8) hold -inf.
inline __m256 mask_from(__m256 x, int64_t valid) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane));
  return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), x, keep);
}

// The running state of one query row: max score, softmax denominator, unnormalised output.
struct Row {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
};

// Folds keys [c0, c0 + valid) into one row: o <- o * e^(m - m') + sum_t e^(s_t - m') v_t.
inline void fold(Row& row, float* o, const float* q, const float* const* key, const float* const* value,
                 int64_t valid, int64_t d, float scale) {
  alignas(32) float p[kKeys];
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 s0 = mask_from(_mm256_mul_ps(dots8(q, key, d), sv), valid);
  __m256 s1 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  if (valid > 8) s1 = mask_from(_mm256_mul_ps(dots8(q, key + 8, d), sv), valid - 8);
  const float top = std::max(row.m, hmax(_mm256_max_ps(s0, s1)));
  const float carry = std::exp(row.m - top);  // 0 for the first keys (m = -inf)
  const __m256 tv = _mm256_set1_ps(top);
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, tv)), _mm256_cmp_ps(s0, none, _CMP_NEQ_OQ));
  const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, tv)), _mm256_cmp_ps(s1, none, _CMP_NEQ_OQ));
  _mm256_store_ps(p, p0);
  _mm256_store_ps(p + 8, p1);
  row.l = row.l * carry + hsum(_mm256_add_ps(p0, p1));
  row.m = top;
  const __m256 cv = _mm256_set1_ps(carry);
  for (int64_t i = 0; i < d; i += 64) {  // 64 output dims in eight registers at a time
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_mul_ps(_mm256_loadu_ps(o + i + 8 * k), cv);
    for (int64_t t = 0; t < valid; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* v = value[t] + i;
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * k), acc[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(o + i + 8 * k, acc[k]);
  }
}

// Where keys [c0, c0 + n) of the kv head start in the cache, in elements: one division a
// pass, then block by block (a division per key cost more than the key's arithmetic).
inline void offsets_of(const TileArgs& a, int64_t c0, int64_t n, int64_t* at) {
  int64_t block = c0 / a.block_size, in_block = c0 % a.block_size;
  for (int64_t t = 0; t < n; ++t) {
    at[t] = a.table[block] * a.cache_block_stride + in_block * a.cache_token_stride + a.kv_head * a.cache_head_stride;
    if (++in_block == a.block_size) {
      in_block = 0;
      ++block;
    }
  }
}

// Points rows[0..n) at those cache rows, widened into `buffer` unless the cache is float32
// already; rows past n point at `zero`.
template <typename T>
inline void rows_at(const T* cache, const int64_t* at, int64_t n, int64_t d, float* buffer, const float* zero,
                    const float** rows) {
  for (int64_t t = 0; t < kKeys; ++t) {
    if (t >= n) {
      rows[t] = zero;
    } else if constexpr (std::is_same_v<T, float>) {
      rows[t] = cache + at[t];
    } else {
      float* dst = buffer + t * d;
      for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8(cache + at[t], i));
      rows[t] = dst;
    }
  }
}

// Asks for the next pass's rows ahead of use: a context's blocks lie anywhere in the pool,
// so the hardware prefetcher cannot guess the next one, and past the last-level cache each
// pass would otherwise start with a wait on memory.
template <typename T>
inline void prefetch(const T* cache, const int64_t* at, int64_t n, int64_t d) {
  const int64_t bytes = row_bytes_of<T>(d);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(row_start(cache + at[t]) + line, _MM_HINT_T0);
}

template <typename T>
void attend(const TileArgs& a, const T* kc, const T* vc) {
  const int64_t d = a.head_dim, rows = a.tokens * a.group, keys = a.first_pos + a.tokens;
  thread_local std::vector<float> scratch;
  scratch.assign(2 * kKeys * d + d + rows * d, 0.f);
  float *kbuf = scratch.data(), *vbuf = kbuf + kKeys * d, *zero = vbuf + kKeys * d, *o = zero + d;
  std::vector<Row> state(rows);
  const float* key[kKeys];
  const float* value[kKeys];
  int64_t here[kKeys], ahead[kKeys];
  offsets_of(a, 0, std::min(kKeys, keys), ahead);
  for (int64_t c0 = 0; c0 < keys; c0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - c0);
    const int64_t next = std::min(kKeys, keys - c0 - n);
    std::copy(ahead, ahead + n, here);
    if (next > 0) {
      offsets_of(a, c0 + n, next, ahead);
      prefetch(kc, ahead, next, d);
      prefetch(vc, ahead, next, d);
    }
    rows_at(kc, here, n, d, kbuf, zero, key);
    rows_at(vc, here, n, d, vbuf, zero, value);
    for (int64_t j = 0; j < a.tokens; ++j) {
      const int64_t valid = std::min(n, a.first_pos + j + 1 - c0);  // causal: this token's keys in the pass
      if (valid <= 0) continue;
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t r = j * a.group + g;
        fold(state[r], o + r * d, a.q + j * a.token_stride + g * d, key, value, valid, d, a.scale);
      }
    }
  }
  for (int64_t j = 0; j < a.tokens; ++j)
    for (int64_t g = 0; g < a.group; ++g) {
      const int64_t r = j * a.group + g;
      const __m256 inv = _mm256_set1_ps(1.f / state[r].l);
      float* dst = a.out + j * a.token_stride + g * d;
      for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(o + r * d + i), inv));
    }
}


#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <typename T>
inline __m512 load16(const T* row, int64_t i) { return load16(row + i); }
inline __m512 load16(const int8_t* row, int64_t i) {
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale_of(row)));
}

// Lane u of block[j] becomes lane j of block[u]: a 16 x 16 block of floats transposed in
// registers (pairs of floats, then pairs of pairs, then 128-bit lanes twice), where a
// scalar copy per float took as many stores as the block has floats.
inline void transpose16(__m512* block) {
  __m512 pair[16], quad[16];
  for (int i = 0; i < 16; i += 2) {
    pair[i] = _mm512_unpacklo_ps(block[i], block[i + 1]);
    pair[i + 1] = _mm512_unpackhi_ps(block[i], block[i + 1]);
  }
  // quad[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3.
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(pair[i]), b = _mm512_castps_pd(pair[i + 1]);
    const __m512d c = _mm512_castps_pd(pair[i + 2]), e = _mm512_castps_pd(pair[i + 3]);
    quad[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    quad[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    quad[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    quad[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 low = _mm512_shuffle_f32x4(quad[c], quad[4 + c], 0x44);
    const __m512 high = _mm512_shuffle_f32x4(quad[c], quad[4 + c], 0xEE);
    const __m512 low2 = _mm512_shuffle_f32x4(quad[8 + c], quad[12 + c], 0x44);
    const __m512 high2 = _mm512_shuffle_f32x4(quad[8 + c], quad[12 + c], 0xEE);
    block[c] = _mm512_shuffle_f32x4(low, low2, 0x88);
    block[4 + c] = _mm512_shuffle_f32x4(low, low2, 0xDD);
    block[8 + c] = _mm512_shuffle_f32x4(high, high2, 0x88);
    block[12 + c] = _mm512_shuffle_f32x4(high, high2, 0xDD);
  }
}

constexpr int64_t kPass = 64;  // keys a pass of the 512-bit tiles

// Each row's unnormalised output over its softmax denominator, into the tile's out.
inline void normalise(const TileArgs& a, int64_t rows, const float* o, const float* l) {
  const int64_t d = a.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    float* dst = a.out + (r / a.group) * a.token_stride + (r % a.group) * d;
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + i), inv));
  }
}

// Row r's running max m, denominator l and the pass's weights p (kPass floats, 0 past
// `valid` keys) from its kPass scores, as attend16's online softmax; returns the factor
// its running output is rescaled by (e^(m - m')). The bfloat16 pairs' tile takes it (4 rows
// at a time); attend16 keeps its own copy in registers, the float32 reference's exact ops.
inline float softmax_pass(const float* scores, int64_t valid, float& m, float& l, float* p) {
  constexpr int S = kPass / 16;
  if (valid == 0) {  // no key of this pass is visible to the row: it stays as it was
    std::fill(p, p + kPass, 0.f);
    return 1.f;
  }
  __m512 s[S];
  __mmask16 keep[S];
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < S; ++v) {
    const int64_t lanes = std::clamp<int64_t>(valid - 16 * v, 0, 16);
    keep[v] = static_cast<__mmask16>((1u << lanes) - 1);
    s[v] = _mm512_loadu_ps(scores + 16 * v);
    top = _mm512_mask_max_ps(top, keep[v], top, s[v]);
  }
  const float most = std::max(m, _mm512_reduce_max_ps(top));
  const float carry = std::exp(m - most);  // 0 for the first keys (m = -inf)
  const __m512 mv = _mm512_set1_ps(most);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < S; ++v) {
    const __m512 e = _mm512_maskz_mov_ps(keep[v], exp512(_mm512_sub_ps(s[v], mv)));
    _mm512_storeu_ps(p + 16 * v, e);
    sum = _mm512_add_ps(sum, e);
  }
  l = l * carry + _mm512_reduce_add_ps(sum);
  m = most;
  return carry;
}

// The tile with 512-bit vectors: each pass's kPass keys are widened once and laid out
// transposed (head_dim x kPass), so that a row's scores are four vectors built by head_dim
// FMAs each with no horizontal sums, four rows share every key and value load, and the
// online softmax's reductions and rescaling are paid once per 64 keys. (The AVX2 tile's
// fold spent as many loads as FMAs and shuffles on every key's sum; with passes of 16
// keys the softmax's fixed work outweighed the FMAs.)

template <typename T>
void attend16(const TileArgs& a, const T* kc, const T* vc) {
  constexpr int S = kPass / 16;  // score vectors a row
  const int64_t d = a.head_dim, rows = a.tokens * a.group, keys = a.first_pos + a.tokens;
  thread_local std::vector<float> scratch;
  scratch.assign(2 * kPass * d + rows * d + 2 * rows, 0.f);
  float *kt = scratch.data(), *vbuf = kt + kPass * d, *o = vbuf + kPass * d, *m = o + rows * d, *l = m + rows;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  alignas(64) float p[4][kPass];
  int64_t here[kPass];
  for (int64_t c0 = 0; c0 < keys; c0 += kPass) {
    const int64_t n = std::min(kPass, keys - c0);
    offsets_of(a, c0, n, here);
    if (n < kPass) std::fill(kt, kt + kPass * d, 0.f);  // keys past n score 0, then are masked
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(vbuf + t * d + i, load16(vc + here[t], i));
    for (int64_t t0 = 0; t0 < n; t0 += 16)  // keys transposed 16 x 16 in registers
      for (int64_t i = 0; i < d; i += 16) {
        __m512 block[16];
        for (int j = 0; j < 16; ++j) block[j] = t0 + j < n ? load16(kc + here[t0 + j], i) : _mm512_setzero_ps();
        transpose16(block);
        for (int u = 0; u < 16; ++u) _mm512_storeu_ps(kt + (i + u) * kPass + t0, block[u]);
      }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t count = std::min<int64_t>(4, rows - r0);
      const float* q[4];
      int64_t valid[4], most = 0;
      __m512 s[4][S];
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t r = r0 + std::min(k, count - 1), j = r / a.group;
        q[k] = a.q + j * a.token_stride + (r % a.group) * d;
        valid[k] = std::clamp<int64_t>(a.first_pos + j + 1 - c0, 0, n);  // causal: this token's keys in the pass
        most = std::max(most, valid[k]);
      }
      if (most == 0) continue;  // no row of the block sees a key of this pass
      // Each score summed in four runs of 16 dims added at the end, not one run of head_dim:
      // as the AVX2 tile's partial sums, so a long dot product rounds no worse than there.
      for (int64_t i0 = 0; i0 < d; i0 += 16) {
        __m512 run[4][S];
        for (int k = 0; k < 4; ++k)
          for (int v = 0; v < S; ++v) run[k][v] = _mm512_setzero_ps();
        for (int64_t i = i0; i < i0 + 16; ++i) {
          __m512 x[S];
          for (int v = 0; v < S; ++v) x[v] = _mm512_loadu_ps(kt + i * kPass + 16 * v);  // scratch: not 64-byte aligned
          for (int k = 0; k < 4; ++k) {
            const __m512 b = _mm512_set1_ps(q[k][i]);
            for (int v = 0; v < S; ++v) run[k][v] = _mm512_fmadd_ps(b, x[v], run[k][v]);
          }
        }
        for (int k = 0; k < 4; ++k)
          for (int v = 0; v < S; ++v) s[k][v] = i0 == 0 ? run[k][v] : _mm512_add_ps(s[k][v], run[k][v]);
      }
      __m512 carry[4];
      for (int64_t k = 0; k < count; ++k) {
        const int64_t r = r0 + k;
        __mmask16 keep[S];
        __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int v = 0; v < S; ++v) {
          const int64_t lanes = std::clamp<int64_t>(valid[k] - 16 * v, 0, 16);
          keep[v] = static_cast<__mmask16>((1u << lanes) - 1);
          s[k][v] = _mm512_mul_ps(s[k][v], _mm512_set1_ps(a.scale));
          top = _mm512_mask_max_ps(top, keep[v], top, s[k][v]);
        }
        if (valid[k] == 0) {  // no key of this pass is visible to the row: it stays as it was
          carry[k] = _mm512_set1_ps(1.f);
          std::fill(p[k], p[k] + kPass, 0.f);
          continue;
        }
        const float most_s = std::max(m[r], _mm512_reduce_max_ps(top));
        const float c = std::exp(m[r] - most_s);  // 0 for the first keys (m = -inf)
        const __m512 mv = _mm512_set1_ps(most_s);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < S; ++v) {
          const __m512 e = _mm512_maskz_mov_ps(keep[v], exp512(_mm512_sub_ps(s[k][v], mv)));
          _mm512_store_ps(p[k] + 16 * v, e);
          sum = _mm512_add_ps(sum, e);
        }
        l[r] = l[r] * c + _mm512_reduce_add_ps(sum);
        m[r] = most_s;
        carry[k] = _mm512_set1_ps(c);
      }
      for (int64_t k = count; k < 4; ++k) std::fill(p[k], p[k] + kPass, 0.f);
      for (int64_t i = 0; i < d; i += 64) {  // 64 output dims of four rows in sixteen registers
        // All four rows' sums are formed even in a block of fewer (those past count weigh
        // every key 0 and are never stored): with a bound known at compile time the
        // accumulators stay in registers; with `count` the compiler stored them every key.
        __m512 acc[4][4];
        for (int64_t k = 0; k < 4; ++k)
          for (int u = 0; u < 4; ++u)
            acc[k][u] = k < count ? _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + k) * d + i + 16 * u), carry[k])
                                  : _mm512_setzero_ps();
        // Up to the block's most visible key: a row that sees fewer weighs the rest 0.
        for (int64_t t = 0; t < most; ++t) {
          __m512 v[4];
          for (int u = 0; u < 4; ++u) v[u] = _mm512_loadu_ps(vbuf + t * d + i + 16 * u);
          for (int k = 0; k < 4; ++k) {
            const __m512 w = _mm512_set1_ps(p[k][t]);
            for (int u = 0; u < 4; ++u) acc[k][u] = _mm512_fmadd_ps(w, v[u], acc[k][u]);
          }
        }
        for (int64_t k = 0; k < count; ++k)
          for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + (r0 + k) * d + i + 16 * u, acc[k][u]);
      }
    }
  }
  normalise(a, rows, o, l);
}
#ifdef __AVX512BF16__
// The tile with bfloat16 dot products (vdpbf16ps: a pair of products a lane, summed into
// float32): on AMD as fast an instruction as a float32 FMA, so twice its work; on Intel a
// fraction of its rate (there AMX, below). The server times it against attend16 at start.
// Queries, keys, probabilities and values are each rounded to bfloat16 once; every sum
// stays float32. The keys of a pass are laid out as attend16's, one 32-bit word (a pair of
// dims) in place of a float; the values as pairs of keys, so that the weighted sum runs
// two keys an instruction.
inline __m512i bf16x32(const __m512 low, const __m512 high) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));  // low's 16 first
}
template <typename T>
inline __m512i bf16x32(const T* row, int64_t i) { return bf16x32(load16(row, i), load16(row, i + 16)); }
inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Rows of queries times the softmax scale, as bfloat16 pairs: row r's word w holds its dims
// 2w and 2w + 1 (scaled before rounding, so the scores need no multiply; exact where the
// scale is a power of two, as head_dim 64's 1/8).
inline void queries_as_pairs(const TileArgs& a, int64_t rows, uint32_t* qb) {
  const int64_t d = a.head_dim;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* q = a.q + (r / a.group) * a.token_stride + (r % a.group) * d;
    for (int64_t i = 0; i < d; i += 32)
      _mm512_storeu_si512(qb + r * (d / 2) + i / 2,
                          bf16x32(_mm512_mul_ps(load16(q + i), scale), _mm512_mul_ps(load16(q + i + 16), scale)));
  }
}

// A pass's n keys (at `here`) as bfloat16 pairs: kt (head_dim / 2 x kPass words), word
// (w, t) key t's dims 2w and 2w + 1, keys past n 0; vp (kPass / 2 x head_dim words), word
// (u, i) dim i of keys 2u and 2u + 1 (low half first), a key past n 0.
template <typename T>
inline void pass_as_pairs(const TileArgs& a, const T* kc, const T* vc, const int64_t* here, int64_t n, uint32_t* kt,
                          uint32_t* vp) {
  const int64_t d = a.head_dim;
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  if (n < kPass) std::fill(kt, kt + d / 2 * kPass, 0u);
  for (int64_t t0 = 0; t0 < n; t0 += 16)  // keys' dim pairs transposed 16 x 16 in registers
    for (int64_t i = 0; i < d; i += 32) {
      __m512 block[16];
      for (int j = 0; j < 16; ++j)
        block[j] = t0 + j < n ? _mm512_castsi512_ps(bf16x32(kc + here[t0 + j], i)) : _mm512_setzero_ps();
      transpose16(block);
      for (int u = 0; u < 16; ++u) _mm512_storeu_ps(reinterpret_cast<float*>(kt + (i / 2 + u) * kPass + t0), block[u]);
    }
  for (int64_t t = 0; t < n; t += 2)
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 second = t + 1 < n ? load16(vc + here[t + 1], i) : _mm512_setzero_ps();
      const __m512i both = bf16x32(load16(vc + here[t], i), second);  // key t's 16 dims, then key t + 1's
      _mm512_storeu_si512(vp + (t / 2) * d + i, _mm512_permutexvar_epi16(pairs, both));
    }
}

template <typename T>
void attend16_bf16(const TileArgs& a, const T* kc, const T* vc) {
  constexpr int S = kPass / 16;
  const int64_t d = a.head_dim, half = d / 2, rows = a.tokens * a.group, keys = a.first_pos + a.tokens;
  thread_local std::vector<uint32_t> words;  // bfloat16 pairs: keys, values, queries
  words.assign(2 * kPass * half + rows * half, 0u);
  uint32_t *kt = words.data(), *vp = kt + half * kPass, *qb = vp + half * kPass;
  thread_local std::vector<float> scratch;
  scratch.assign(rows * d + 2 * rows, 0.f);
  float *o = scratch.data(), *m = o + rows * d, *l = m + rows;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  queries_as_pairs(a, rows, qb);
  alignas(64) float p[4][kPass];
  alignas(64) uint32_t pw[4][kPass / 2];
  int64_t here[kPass];
  for (int64_t c0 = 0; c0 < keys; c0 += kPass) {
    const int64_t n = std::min(kPass, keys - c0);
    offsets_of(a, c0, n, here);
    pass_as_pairs(a, kc, vc, here, n, kt, vp);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t count = std::min<int64_t>(4, rows - r0);
      const uint32_t* q[4];
      int64_t valid[4], most = 0;
      __m512 s[4][S];
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t r = r0 + std::min(k, count - 1), j = r / a.group;
        q[k] = qb + r * half;
        valid[k] = std::clamp<int64_t>(a.first_pos + j + 1 - c0, 0, n);
        most = std::max(most, valid[k]);
      }
      if (most == 0) continue;
      for (int k = 0; k < 4; ++k)
        for (int v = 0; v < S; ++v) s[k][v] = _mm512_setzero_ps();
      for (int64_t w = 0; w < half; ++w) {
        __m512i x[S];
        for (int v = 0; v < S; ++v) x[v] = _mm512_loadu_si512(kt + w * kPass + 16 * v);
        for (int k = 0; k < 4; ++k) {
          const __m512i b = _mm512_set1_epi32(static_cast<int>(q[k][w]));
          for (int v = 0; v < S; ++v) s[k][v] = dot2(s[k][v], b, x[v]);
        }
      }
      __m512 carry[4];
      for (int64_t k = 0; k < count; ++k) {
        alignas(64) float scores[kPass];
        for (int v = 0; v < S; ++v) _mm512_store_ps(scores + 16 * v, s[k][v]);
        carry[k] = _mm512_set1_ps(softmax_pass(scores, valid[k], m[r0 + k], l[r0 + k], p[k]));
      }
      for (int64_t k = count; k < 4; ++k) std::fill(p[k], p[k] + kPass, 0.f);
      for (int k = 0; k < 4; ++k)  // each row's weights as pairs of keys
        for (int v = 0; v < S; v += 2)
          _mm512_store_si512(pw[k] + 8 * v, bf16x32(_mm512_load_ps(p[k] + 16 * v), _mm512_load_ps(p[k] + 16 + 16 * v)));
      const int64_t most_pairs = (most + 1) / 2;  // a row's weights past its keys are 0
      for (int64_t i = 0; i < d; i += 64) {
        __m512 acc[4][4];
        for (int64_t k = 0; k < 4; ++k)
          for (int u = 0; u < 4; ++u)
            acc[k][u] = k < count ? _mm512_mul_ps(_mm512_loadu_ps(o + (r0 + k) * d + i + 16 * u), carry[k])
                                  : _mm512_setzero_ps();
        for (int64_t t = 0; t < most_pairs; ++t) {
          __m512i v[4];
          for (int u = 0; u < 4; ++u) v[u] = _mm512_loadu_si512(vp + t * d + i + 16 * u);
          for (int k = 0; k < 4; ++k) {
            const __m512i w = _mm512_set1_epi32(static_cast<int>(pw[k][t]));
            for (int u = 0; u < 4; ++u) acc[k][u] = dot2(acc[k][u], w, v[u]);
          }
        }
        for (int64_t k = 0; k < count; ++k)
          for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o + (r0 + k) * d + i + 16 * u, acc[k][u]);
      }
    }
  }
  normalise(a, rows, o, l);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The tile on AMX: tdpbf16ps multiplies a 16 x 32 block of bfloat16 by a 32 x 16 one into
// 16 x 16 float32 sums, sixteen times the float32 FMA's work an instruction. The
// operands are the pairs path's (queries, keys and values rounded to bfloat16 once; every
// sum float32): a pass's scores of 16 rows are four such blocks (16 keys each) summed over
// the head's dims 32 at a time, its values' weighted sum four blocks (16 dims each) summed
// over its keys 32 at a time. The online softmax runs on the scores in float32 as elsewhere.

// Linux lends a thread AMX's tile state only once the process has asked for it.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The online softmax of a block of 16 rows' scores (sc: 16 x kPass), as softmax_pass's
// per row, with every row's rescale factor e^(m - m') taken in one vector: a libm call
// per row, between rows' work, spilled the vector registers and cost most of the tile.
// Writes the rows' weights as bfloat16 pairs (pw: 16 x kPass / 2 words) and updates m, l.
inline void softmax_rows16(const float* sc, const int64_t* valid, float* m, float* l, float* carry, uint32_t* pw) {
  constexpr int S = kPass / 16;
  alignas(64) float top[16], sum[16];
  __mmask16 seen = 0;  // rows that see a key of this pass
  for (int k = 0; k < 16; ++k) {
    __m512 t = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int v = 0; v < S; ++v) {
      const auto keep = static_cast<__mmask16>((1u << std::clamp<int64_t>(valid[k] - 16 * v, 0, 16)) - 1);
      t = _mm512_mask_max_ps(t, keep, t, _mm512_loadu_ps(sc + k * kPass + 16 * v));
    }
    top[k] = _mm512_reduce_max_ps(t);
    if (valid[k] > 0) seen |= static_cast<__mmask16>(1u << k);
  }
  const __m512 old = _mm512_loadu_ps(m), most = _mm512_max_ps(old, _mm512_load_ps(top));
  // Rows that see no key keep their state (factor 1; their max may still be -inf, and
  // -inf - -inf is NaN); a row's first keys give e^-inf, which exp512 takes as ~1e-38 of
  // an output and denominator that are still 0.
  _mm512_store_ps(carry, _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), exp512(_mm512_sub_ps(old, most))));
  _mm512_storeu_ps(m, _mm512_mask_mov_ps(old, seen, most));
  for (int k = 0; k < 16; ++k) {
    if (valid[k] == 0) {
      std::fill(pw + k * kPass / 2, pw + (k + 1) * kPass / 2, 0u);
      sum[k] = 0.f;
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m[k]);
    __m512 e[S], total = _mm512_setzero_ps();
    for (int v = 0; v < S; ++v) {
      const auto keep = static_cast<__mmask16>((1u << std::clamp<int64_t>(valid[k] - 16 * v, 0, 16)) - 1);
      e[v] = _mm512_maskz_mov_ps(keep, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + k * kPass + 16 * v), mv)));
      total = _mm512_add_ps(total, e[v]);
    }
    sum[k] = _mm512_reduce_add_ps(total);
    for (int v = 0; v < S; v += 2) _mm512_storeu_si512(pw + k * kPass / 2 + 8 * v, bf16x32(e[v], e[v + 1]));
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_load_ps(carry), _mm512_load_ps(sum)));
}

template <typename T>
void attend_amx(const TileArgs& a, const T* kc, const T* vc) {
  static_assert(kPass == 64, "a pass is four blocks of 16 keys");
  const int64_t d = a.head_dim, half = d / 2, rows = a.tokens * a.group, keys = a.first_pos + a.tokens;
  const int64_t padded = (rows + 15) / 16 * 16;  // whole blocks of 16 rows; the rest's queries 0
  thread_local std::vector<uint32_t> words;
  words.assign(2 * kPass * half + padded * half + 16 * kPass / 2, 0u);
  uint32_t *kt = words.data(), *vp = kt + half * kPass, *qb = vp + half * kPass, *pw = qb + padded * half;
  thread_local std::vector<float> scratch;
  scratch.assign(padded * d + 2 * padded + 2 * 16 * kPass, 0.f);
  float *o = scratch.data(), *m = o + padded * d, *l = m + padded, *sc = l + padded, *sum = sc + 16 * kPass;
  std::fill(m, m + padded, -std::numeric_limits<float>::infinity());
  queries_as_pairs(a, rows, qb);
  TileConfig config;
  for (int t = 0; t < 8; ++t) {  // every operand and sum a block of 16 rows x 64 bytes
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) float carry[16];
  int64_t here[kPass];
  const int64_t key_row = kPass * 4, pw_row = kPass / 2 * 4, vp_row = d * 4, q_row = half * 4;
  for (int64_t c0 = 0; c0 < keys; c0 += kPass) {
    const int64_t n = std::min(kPass, keys - c0);
    offsets_of(a, c0, n, here);
    pass_as_pairs(a, kc, vc, here, n, kt, vp);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      int64_t valid[16], most = 0;
      for (int k = 0; k < 16; ++k) {
        valid[k] = r0 + k < rows ? std::clamp<int64_t>(a.first_pos + (r0 + k) / a.group + 1 - c0, 0, n) : 0;
        most = std::max(most, valid[k]);
      }
      if (most == 0) continue;  // no row of the block sees a key of this pass
      // Scores: tiles 0-3 the four blocks of 16 keys, 4 the rows' dims, 6 and 7 the keys'.
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t w = 0; w < half; w += 16) {
        _tile_loadd(4, qb + r0 * half + w, q_row);
        _tile_loadd(6, kt + w * kPass, key_row);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, kt + w * kPass + 16, key_row);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, kt + w * kPass + 32, key_row);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, kt + w * kPass + 48, key_row);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, sc, key_row);
      _tile_stored(1, sc + 16, key_row);
      _tile_stored(2, sc + 32, key_row);
      _tile_stored(3, sc + 48, key_row);
      softmax_rows16(sc, valid, m + r0, l + r0, carry, pw);
      // Values: tiles 0-3 the sums of four blocks of 16 dims, 4 the weights of 32 keys, 6
      // and 7 those keys' values; then each row's output rescaled and the pass's sum added.
      for (int64_t i = 0; i < d; i += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t u = 0; u < (most + 1) / 2; u += 16) {  // weights past a row's keys are 0
          _tile_loadd(4, pw + u, pw_row);
          _tile_loadd(6, vp + u * d + i, vp_row);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, vp + u * d + i + 16, vp_row);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(6, vp + u * d + i + 32, vp_row);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, vp + u * d + i + 48, vp_row);
          _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, sum, 256);
        _tile_stored(1, sum + 16, 256);
        _tile_stored(2, sum + 32, 256);
        _tile_stored(3, sum + 48, 256);
        for (int64_t k = 0; k < std::min<int64_t>(16, rows - r0); ++k) {
          float* out = o + (r0 + k) * d + i;
          const __m512 cv = _mm512_set1_ps(carry[k]);
          for (int u = 0; u < 4; ++u)
            _mm512_storeu_ps(out + 16 * u, _mm512_fmadd_ps(_mm512_loadu_ps(out + 16 * u), cv,
                                                           _mm512_loadu_ps(sum + k * 64 + 16 * u)));
        }
      }
    }
  }
  _tile_release();
  normalise(a, rows, o, l);
}
#endif
#endif
#endif

// The sum of each of four vectors' lanes: [sum a0, sum a1, sum a2, sum a3].
inline __m128 sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// One pass of up to kKeys keys (rows at `here`, n of them) for G query heads (G <= 3) of
// one decode token that share a kv head, each key and value read straight from the cache
// into registers: no float32 copy of the rows. Folds the pass into the heads' running max
// m, softmax denominator l and unnormalised output o (G x d), and asks for its `count`
// of the next pass's cache lines a quarter at a time along the way.
template <int G, typename T>
inline void pass_heads(const float* q, const T* kc, const T* vc, const int64_t* here, int64_t n, int64_t d,
                       float scale, float* m, float* l, float* o, const char* const* lines, int64_t count) {
  alignas(32) float p[G][kKeys];
  // Scores, four keys at a time: G x 4 accumulators and one row's vector live, 16 registers.
  for (int64_t t0 = 0; t0 < kKeys; t0 += 4) {
    if (t0 >= n) {
      for (int g = 0; g < G; ++g) _mm_store_ps(&p[g][t0], _mm_set1_ps(-std::numeric_limits<float>::infinity()));
      continue;
    }
    for (int64_t i = count * t0 / kKeys; i < count * (t0 + 4) / kKeys; ++i) _mm_prefetch(lines[i], _MM_HINT_T0);
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      for (int j = 0; j < 4; ++j) {
        const __m256 x = load8_unscaled(kc + here[t0 + j], i);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), x, acc[g][j]);
      }
    }
    __m128 keys_scale = _mm_set1_ps(1.f);
    if constexpr (std::is_same_v<T, int8_t>)
      keys_scale = _mm_set_ps(scale_of(kc + here[t0 + 3]), scale_of(kc + here[t0 + 2]), scale_of(kc + here[t0 + 1]),
                              scale_of(kc + here[t0]));
    for (int g = 0; g < G; ++g)
      _mm_store_ps(&p[g][t0], _mm_mul_ps(sums4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), keys_scale));
  }
  // Online softmax per head: p <- e^(s - m'), the running output rescaled by e^(m - m').
  const __m256 sv = _mm256_set1_ps(scale);
  const __m256 none = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  float carry[G];
  for (int g = 0; g < G; ++g) {
    const __m256 s0 = mask_from(_mm256_mul_ps(_mm256_load_ps(p[g]), sv), n);
    const __m256 s1 = mask_from(_mm256_mul_ps(_mm256_load_ps(p[g] + 8), sv), n - 8);
    const float top = std::max(m[g], hmax(_mm256_max_ps(s0, s1)));
    carry[g] = std::exp(m[g] - top);  // 0 for the first keys (m = -inf)
    const __m256 tv = _mm256_set1_ps(top);
    const __m256 e0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, tv)), _mm256_cmp_ps(s0, none, _CMP_NEQ_OQ));
    const __m256 e1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, tv)), _mm256_cmp_ps(s1, none, _CMP_NEQ_OQ));
    _mm256_store_ps(p[g], e0);
    _mm256_store_ps(p[g] + 8, e1);
    l[g] = l[g] * carry[g] + hsum(_mm256_add_ps(e0, e1));
    m[g] = top;
  }
  // Values, 32 output dims at a time: G x 4 accumulators, G weights and one row's vector.
  for (int64_t i = 0; i < d; i += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g) {
      const __m256 cv = _mm256_set1_ps(carry[g]);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_mul_ps(_mm256_loadu_ps(o + g * d + i + 8 * j), cv);
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* v = vc + here[t];
      __m256 pt[G];
      if constexpr (std::is_same_v<T, int8_t>) {
        const float value_scale = scale_of(v);
        for (int g = 0; g < G; ++g) pt[g] = _mm256_set1_ps(p[g][t] * value_scale);
      } else {
        for (int g = 0; g < G; ++g) pt[g] = _mm256_broadcast_ss(&p[g][t]);
      }
      for (int j = 0; j < 4; ++j) {
        const __m256 x = load8_unscaled(v, i + 8 * j);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(pt[g], x, acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + g * d + i + 8 * j, acc[g][j]);
  }
}

// Keys [begin, end) for the query heads of kv heads [a.kv_head, a.kv_head + kv_heads):
// pass by pass, each pass every kv head in turn over its 16 keys, so that a pass reads
// the cache's token rows whole (a block is one run of memory). The next pass's lines
// are prefetched spread across this pass's work: asked for in one burst at its start (as
// the AVX2 prefill tile does), the prefetches outnumber the core's outstanding misses and
// hold up the arithmetic they were meant to overlap, so memory and arithmetic took turns.
template <typename T>
void decode(const TileArgs& a, int64_t kv_heads, const T* kc, const T* vc, int64_t begin, int64_t end, float* m,
            float* l, float* o) {
  const int64_t d = a.head_dim;
  TileArgs rows = a;
  rows.kv_head = 0;  // offsets of whole token rows; each head adds its own
  const int64_t row_bytes = kv_heads * row_bytes_of<T>(d), calls = kv_heads * ((a.group + 2) / 3);
  thread_local std::vector<const char*> lines;
  lines.resize(2 * kKeys * ((row_bytes + 63) / 64 + 1));  // + 1: an int8 cache's rows start anywhere in a line
  int64_t here[kKeys], ahead[kKeys];
  offsets_of(rows, begin, std::min(kKeys, end - begin), ahead);
  for (int64_t c0 = begin; c0 < end; c0 += kKeys) {
    const int64_t n = std::min(kKeys, end - c0);
    const int64_t next = std::min(kKeys, end - c0 - n);
    std::copy(ahead, ahead + n, here);
    for (int64_t t = n; t < kKeys; ++t) here[t] = here[0];  // scored, then masked
    int64_t count = 0;  // the next pass's cache lines, asked for a slice at a time as this pass runs
    if (next > 0) {
      offsets_of(rows, c0 + n, next, ahead);
      for (int64_t t = 0; t < next; ++t) {
        const char* k_row = row_start(kc + a.kv_head * a.cache_head_stride + ahead[t]);
        const char* v_row = row_start(vc + a.kv_head * a.cache_head_stride + ahead[t]);
        // From the line each row starts in, so that a row not aligned to lines is asked for whole.
        const int64_t lead = reinterpret_cast<uintptr_t>(k_row) % 64;
        for (int64_t line = -lead; line < row_bytes; line += 64) {
          lines[count++] = k_row + line;
          lines[count++] = v_row + line;
        }
      }
    }
    int64_t call = 0;
    for (int64_t h = a.kv_head; h < a.kv_head + kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < a.group; g0 += 3, ++call) {  // three heads at a time fill the registers
        const char* const* slice = lines.data() + count * call / calls;
        const int64_t share = count * (call + 1) / calls - count * call / calls;
        const int64_t r = (h - a.kv_head) * a.group + g0;
        const float* q = a.q + r * d;
        const T *k = kc + h * a.cache_head_stride, *v = vc + h * a.cache_head_stride;
        switch (std::min<int64_t>(3, a.group - g0)) {
          case 1: pass_heads<1>(q, k, v, here, n, d, a.scale, m + r, l + r, o + r * d, slice, share); break;
          case 2: pass_heads<2>(q, k, v, here, n, d, a.scale, m + r, l + r, o + r * d, slice, share); break;
          default: pass_heads<3>(q, k, v, here, n, d, a.scale, m + r, l + r, o + r * d, slice, share); break;
        }
      }
    }
  }
}

}  // namespace

bool tile_available(int64_t head_dim) { return head_dim > 0 && head_dim % 64 == 0; }
#ifdef __AVX512BF16__
int bf16_dots_available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_permitted()) return kAmxTiles;
#endif
  return kBf16Pairs;
}
template <typename T>
void attend_either(const TileArgs& a, const T* k, const T* v) {
  switch (a.dots) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    case kAmxTiles: attend_amx(a, k, v); break;
#endif
    case kBf16Pairs: attend16_bf16(a, k, v); break;
    default: attend16(a, k, v);
  }
}
void attend_tile(const TileArgs& a, const float* k, const float* v) { attend_either(a, k, v); }
void attend_tile(const TileArgs& a, const c10::Half* k, const c10::Half* v) { attend_either(a, k, v); }
void attend_tile(const TileArgs& a, const c10::BFloat16* k, const c10::BFloat16* v) { attend_either(a, k, v); }
void attend_tile(const TileArgs& a, const int8_t* k, const int8_t* v) { attend_either(a, k, v); }
#elif defined(__AVX512F__)
int bf16_dots_available() { return kFloat32Dots; }
void attend_tile(const TileArgs& a, const float* k, const float* v) { attend16(a, k, v); }
void attend_tile(const TileArgs& a, const c10::Half* k, const c10::Half* v) { attend16(a, k, v); }
void attend_tile(const TileArgs& a, const c10::BFloat16* k, const c10::BFloat16* v) { attend16(a, k, v); }
void attend_tile(const TileArgs& a, const int8_t* k, const int8_t* v) { attend16(a, k, v); }
#else
int bf16_dots_available() { return kFloat32Dots; }
void attend_tile(const TileArgs& a, const float* k, const float* v) { attend(a, k, v); }
void attend_tile(const TileArgs& a, const c10::Half* k, const c10::Half* v) { attend(a, k, v); }
void attend_tile(const TileArgs& a, const c10::BFloat16* k, const c10::BFloat16* v) { attend(a, k, v); }
void attend_tile(const TileArgs& a, const int8_t* k, const int8_t* v) { attend(a, k, v); }
#endif
void decode_span(const TileArgs& a, int64_t kv_heads, const float* k, const float* v, int64_t begin,
                 int64_t end, float* m, float* l, float* o) {
  decode(a, kv_heads, k, v, begin, end, m, l, o);
}
void decode_span(const TileArgs& a, int64_t kv_heads, const c10::Half* k, const c10::Half* v, int64_t begin,
                 int64_t end, float* m, float* l, float* o) {
  decode(a, kv_heads, k, v, begin, end, m, l, o);
}
void decode_span(const TileArgs& a, int64_t kv_heads, const c10::BFloat16* k, const c10::BFloat16* v, int64_t begin,
                 int64_t end, float* m, float* l, float* o) {
  decode(a, kv_heads, k, v, begin, end, m, l, o);
}
void decode_span(const TileArgs& a, int64_t kv_heads, const int8_t* k, const int8_t* v, int64_t begin, int64_t end,
                 float* m, float* l, float* o) {
  decode(a, kv_heads, k, v, begin, end, m, l, o);
}

#else  // no AVX2+FMA+F16C: callers keep their portable paths

bool tile_available(int64_t) { return false; }
int bf16_dots_available() { return kFloat32Dots; }
void attend_tile(const TileArgs&, const float*, const float*) { TORCH_CHECK(false, "no tiled attention in this build"); }
void attend_tile(const TileArgs&, const c10::Half*, const c10::Half*) { TORCH_CHECK(false, "no tiled attention in this build"); }
void attend_tile(const TileArgs&, const c10::BFloat16*, const c10::BFloat16*) {
  TORCH_CHECK(false, "no tiled attention in this build");
}
void attend_tile(const TileArgs&, const int8_t*, const int8_t*) { TORCH_CHECK(false, "no tiled attention in this build"); }
void decode_span(const TileArgs&, int64_t, const float*, const float*, int64_t, int64_t, float*, float*, float*) {
  TORCH_CHECK(false, "no tiled attention in this build");
}
void decode_span(const TileArgs&, int64_t, const c10::Half*, const c10::Half*, int64_t, int64_t, float*, float*, float*) {
  TORCH_CHECK(false, "no tiled attention in this build");
}
void decode_span(const TileArgs&, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, float*, float*,
                 float*) {
  TORCH_CHECK(false, "no tiled attention in this build");
}
void decode_span(const TileArgs&, int64_t, const int8_t*, const int8_t*, int64_t, int64_t, float*, float*, float*) {
  TORCH_CHECK(false, "no tiled attention in this build");
}

#endif

}  // namespace headroom
