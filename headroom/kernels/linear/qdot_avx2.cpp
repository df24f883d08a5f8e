// qdot_linear's arithmetic for CPUs with AVX2 and no AVX-512 VNNI: the same weights (layout
// as qdot_linear.cpp states it), the same int8 x (quantise.cpp), and
// the same integer dot products, exactly, so the two kernels differ only in float rounding.
// AVX2 multiplies unsigned by signed bytes into saturating int16 pairs (vpmaddubsw), which a
// 4-bit weight (0..15) times an int8 x (-127..127) never saturates. An 8-bit weight (0..255)
// could, so it goes in less 128: its magnitude (at most 128, unsigned) against x given its
// sign (vpsignb; |x| <= 127), the same products, no pair past 32,512; the 128 comes back
// through the minimum (min + 128 * scale). Per group of 32 weights and row that is 2
// integer instructions for 4-bit weights (5 for 8-bit), where the float kernels widen each
// weight to float (for 4-bit, 12 instructions to unpack before 4 multiply-adds).
#include "qdot_avx2.h"

#include "pool.h"
#include "quantise.h"
#include "simd.h"

#ifdef HEADROOM_AVX2
#include <cstdint>

namespace {
using headroom::QuantisedX;

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 64;  // two groups: 32 bytes of 4-bit weights
constexpr int kWeightRows = 4;  // weight rows per tile: one x load feeds four chains
constexpr int kXRows = 2;       // rows of x per tile (8 accumulators of 16 registers)

// One group's 32 weight bytes against 32 bytes of x, as 8 int32 sums of 4 products each.
template <int Bits>
inline __m256i group_dot(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  } else {
    const __m256i centred = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred)), ones);
  }
}

// Group g (of chunk c) of a weight row: 4-bit, the chunk's low nibbles for its first group
// and high ones for its second; 8-bit, the group's own 32 bytes.
template <int Bits>
inline __m256i load_group(const uint8_t* row, int64_t g) {
  if constexpr (Bits == 4) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g / 2) * (kChunk / 2)));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    return g % 2 ? _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble) : _mm256_and_si256(packed, nibble);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup));
  }
}

// NB weight rows (from n) against RT rows of x (from r0): NB * RT float accumulators.
template <int Bits, int NB, int RT>
inline void dot_tile(const QuantisedX& x, int64_t r0, const uint8_t* w, const float* s, const float* mins, float* y,
                     int64_t n, int64_t K, int64_t N) {
  const int64_t G = K / kGroup, row_bytes = K * Bits / 8;
  __m256 acc[RT][NB];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_group<Bits>(w + j * row_bytes, g);
    for (int r = 0; r < RT; ++r) {
      const int64_t row = r0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row * K + g * kGroup));
      const float xd = x.d[row * G + g];
      for (int j = 0; j < NB; ++j) {
        const __m256 both = _mm256_set1_ps(s[j * G + g] * xd);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_dot<Bits>(wv[j], xv)), both, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    const float* xsum = x.sum.data() + (r0 + r) * G;
    for (int j = 0; j < NB; ++j) {
      // The minima's share: sum over groups of min * d * sum(q_x), 8-bit weights' centre added.
      const float *mn = mins + j * G, *sc = s + j * G;
      constexpr float centre = Bits == 8 ? 128.f : 0.f;
      const __m256 centres = _mm256_set1_ps(centre);
      __m256 offset = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= G; g += 8) {
        const __m256 low = _mm256_fmadd_ps(_mm256_loadu_ps(sc + g), centres, _mm256_loadu_ps(mn + g));
        offset = _mm256_fmadd_ps(low, _mm256_loadu_ps(xsum + g), offset);
      }
      float tail = 0.f;
      for (; g < G; ++g) tail += (mn[g] + centre * sc[g]) * xsum[g];
      y[(r0 + r) * N + n + j] = headroom::hsum(_mm256_add_ps(acc[r][j], offset)) + tail;
    }
  }
}

template <int Bits, int NB>
inline void dot_rows(const QuantisedX& x, int64_t M, const uint8_t* w, const float* s, const float* mins, float* y,
                     int64_t n, int64_t K, int64_t N) {
  int64_t r0 = 0;
  for (; r0 + kXRows <= M; r0 += kXRows) dot_tile<Bits, NB, kXRows>(x, r0, w, s, mins, y, n, K, N);
  if (r0 < M) dot_tile<Bits, NB, 1>(x, r0, w, s, mins, y, n, K, N);
}

template <int Bits>
void qdot_rows(const QuantisedX& x, const uint8_t* wp, const float* sp, const float* mp, float* yp, int64_t M, int64_t K,
          int64_t N) {
  const int64_t G = K / kGroup, row_bytes = K * Bits / 8, blocks = (N + kWeightRows - 1) / kWeightRows;
  headroom::parallel_rows(M, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kWeightRows;
      if (n + kWeightRows <= N) {
        dot_rows<Bits, kWeightRows>(x, M, wp + n * row_bytes, sp + n * G, mp + n * G, yp, n, K, N);
      } else {
        for (int64_t m = n; m < N; ++m) dot_rows<Bits, 1>(x, M, wp + m * row_bytes, sp + m * G, mp + m * G, yp, m, K, N);
      }
    }
  });
}
}  // namespace

namespace headroom {
void qdot_avx2(const float* x, const uint8_t* w, const float* scales, const float* mins, float* y, int64_t M,
               int64_t K, int64_t N, int64_t bits) {
  const QuantisedX xq = quantise_x(x, M, K);
  if (bits == 8)
    qdot_rows<8>(xq, w, scales, mins, y, M, K, N);
  else
    qdot_rows<4>(xq, w, scales, mins, y, M, K, N);
}
}  // namespace headroom
#endif
