// y = x @ W^T by integer dot products (AVX-512 VNNI), for CPUs that have them; on AVX2
// alone, the same arithmetic through qdot_avx2.cpp (small batches: the tiles are VNNI's).
// W: unsigned groups of 32 along K with a scale and a minimum each (w = scale * q + min),
// either 8-bit (q in 0..255, one byte each) or 4-bit (q in 0..15, packed per 64 weights:
// byte i of a chunk holds weight i in its low nibble and weight 32 + i in its high one, so
// one chunk unpacks to two whole groups in order). x is quantised per row and group of 32
// to int8 with one scale (quantise.cpp: llama.cpp's Q8_1 activations), so a group's dot
// product is one vpdpbusd per 64 weights, scaled once; the minimum adds min * sum(x) over
// the group. That sum is the quantised x's, as in Q8_1: then the error is sum(w * e) over
// the weights as they are, not over scale * q, which is far from zero mean. No weight is
// widened to float.
#include "tensor.h"

#include "pool.h"
#include "qdot_avx2.h"
#include "quantise.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>
#include "simd.h"

namespace {
constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 64;  // two groups: one 512-bit register of 8-bit weights

#ifdef HEADROOM_VNNI
using headroom::QuantisedX;

// 64 weights (two groups) as unsigned bytes, in order.
template <int Bits>
inline __m512i load_chunk(const uint8_t* w) {
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(w);
  } else {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Lanes 0-7 hold a, lanes 8-15 hold b: the scales of the chunk's two groups.
inline __m512 pair(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

// NB weight rows against RT activation rows: NB * RT accumulators in registers, so one
// weight load feeds RT rows and NB independent chains hide the multiply-add latency (one
// row at a time was latency-bound: ~80 cycles an output, 2x the memory time at batch 1).
template <int Bits, int NB, int RT>
inline void dot_tile(const QuantisedX& x, const float* sums, const __m512* xscale, int64_t r0,
                     const uint8_t* w, const float* s, const float* mins, float* y, int64_t n, int64_t K,
                     int64_t N) {
  const int64_t G = K / kGroup, C = K / kChunk, row_bytes = K * Bits / 8;
  __m512 acc[RT][NB];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i wv[NB];
    __m512 ws[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = load_chunk<Bits>(w + j * row_bytes + c * kChunk * Bits / 8);
      ws[j] = pair(s[j * G + 2 * c], s[j * G + 2 * c + 1]);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.q.data() + (r0 + r) * K + c * kChunk);
      const __m512 xs = xscale[(r0 + r) * C + c];
      for (int j = 0; j < NB; ++j) {
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(ws[j], xs), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    // The minima's share: sum over groups of min * sum(x), 16 groups at a time.
    const float* xsum = sums + (r0 + r) * G;
    __m512 offset[NB];
    for (int j = 0; j < NB; ++j) offset[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 live = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512 xg = _mm512_maskz_loadu_ps(live, xsum + g);
      for (int j = 0; j < NB; ++j)
        offset[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, mins + j * G + g), xg, offset[j]);
    }
    for (int j = 0; j < NB; ++j) y[(r0 + r) * N + n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][j], offset[j]));
  }
}

template <int Bits, int NB>
inline void dot_rows(const QuantisedX& x, const float* sums, const __m512* xscale, int64_t M,
                     const uint8_t* w, const float* s, const float* mins, float* y, int64_t n, int64_t K,
                     int64_t N) {
  int64_t r0 = 0;
  for (; r0 + 4 <= M; r0 += 4) dot_tile<Bits, NB, 4>(x, sums, xscale, r0, w, s, mins, y, n, K, N);
  switch (M - r0) {
    case 3: dot_tile<Bits, NB, 3>(x, sums, xscale, r0, w, s, mins, y, n, K, N); break;
    case 2: dot_tile<Bits, NB, 2>(x, sums, xscale, r0, w, s, mins, y, n, K, N); break;
    case 1: dot_tile<Bits, NB, 1>(x, sums, xscale, r0, w, s, mins, y, n, K, N); break;
    default: break;
  }
}

template <int Bits>
void qdot_rows(const QuantisedX& x, const uint8_t* wp, const float* sp, const float* mp, float* yp,
               int64_t M, int64_t K, int64_t N) {
  constexpr int64_t NB = 4;
  const int64_t G = K / kGroup, C = K / kChunk, row_bytes = K * Bits / 8;
  const float* sums = x.sum.data();
  // The activations' scales as chunk vectors, once per call rather than once per weight row.
  std::vector<__m512> xscale(M * C);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < C; ++c) xscale[r * C + c] = pair(x.d[r * G + 2 * c], x.d[r * G + 2 * c + 1]);
  const int64_t blocks = (N + NB - 1) / NB;
  headroom::parallel_rows(M, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NB;
      if (n + NB <= N) {
        dot_rows<Bits, NB>(x, sums, xscale.data(), M, wp + n * row_bytes, sp + n * G, mp + n * G, yp, n, K, N);
      } else {
        for (int64_t m = n; m < N; ++m)
          dot_rows<Bits, 1>(x, sums, xscale.data(), M, wp + m * row_bytes, sp + m * G, mp + m * G, yp, m, K, N);
      }
    }
  });
}

// The same arithmetic for batches of many rows, laid out the other way round: each
// register holds 16 outputs (16 weight rows) of one step of 4 inputs, so one vpdpbusd is
// 64 multiply-adds into 16 separate outputs and nothing is summed across lanes. A group
// of 32 inputs takes 8 of them; its int32 sums are scaled once (cvt, one multiply-add)
// and the minimum's share is one more. Per 512 multiply-adds that is 11 instructions,
// where a bfloat16 GEMM takes 16 vdpbf16ps; on a 2-core EPYC (Zen, AVX-512 VNNI and BF16)
// a projection of SmolLM2's took 1.45-1.6x less time than oneDNN's bfloat16 at 32-512
// rows. Weights: (N/16, G, 8, 16, 4) bytes, or (N/16, G, 4, 16, 4) with 4-bit weights two
// a byte (tile_gemm); their scales and minima: (N/16, G, 16).
constexpr int64_t kTile = 16;    // outputs per register
constexpr int64_t kRowTile = 6;  // activation rows per register tile
constexpr int64_t kTilePair = 2; // 16-output tiles per register tile: 6 x 2 accumulators of each kind

// 64-byte loads a group of one tile, and a tile's bytes for K inputs.
template <int Bits>
constexpr int kLoads = Bits == 8 ? kGroup / 4 : kGroup / 8;
constexpr int64_t tile_size(int64_t K, int bits) { return K * kTile * bits / 8; }

// A tile's 16 scales or minima of one group, stored as float32 or as float16 (int4's, as
// Q4_1 stores them).
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Bits 8: a weight a byte, 8 registers a group. Bits 4: a register's steps s and s + 4 of
// a group share one 64-byte load (step s in the low nibbles), half the bytes a decode step
// reads, at two instructions a register to unpack.
template <int Bits, int RT, int NB, typename S>
inline void tile_gemm(const int8_t* xq, const float* xd, const float* xsum, const uint8_t* w, const S* ws,
                      const S* wm, float* y, int64_t K, int64_t N) {
  const int64_t G = K / kGroup, tile_bytes = tile_size(K, Bits);
  __m512 acc[RT][NB];
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dots[RT][NB];
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < NB; ++j) dots[r][j] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * kGroup;
#pragma GCC unroll 8
    for (int s = 0; s < kLoads<Bits>; ++s) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * tile_bytes + (g * kLoads<Bits> + s) * 64);
      if constexpr (Bits == 8) {
        for (int r = 0; r < RT; ++r) {
          const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * K + s * 4));
          for (int j = 0; j < NB; ++j) dots[r][j] = _mm512_dpbusd_epi32(dots[r][j], wv[j], xv);
        }
      } else {
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        __m512i high[NB];
        for (int j = 0; j < NB; ++j) {
          high[j] = _mm512_and_si512(_mm512_srli_epi16(wv[j], 4), nibble);
          wv[j] = _mm512_and_si512(wv[j], nibble);
        }
        for (int r = 0; r < RT; ++r) {
          const __m512i lo = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * K + s * 4));
          const __m512i hi = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xg + r * K + (s + 4) * 4));
          for (int j = 0; j < NB; ++j) {
            dots[r][j] = _mm512_dpbusd_epi32(dots[r][j], wv[j], lo);
            dots[r][j] = _mm512_dpbusd_epi32(dots[r][j], high[j], hi);
          }
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 scale = load_scales(ws + j * G * kTile + g * kTile);
      const __m512 low = load_scales(wm + j * G * kTile + g * kTile);
      for (int r = 0; r < RT; ++r) {
        const __m512 both = _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * G + g]));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][j]), both, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[r * G + g]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(y + r * N + j * kTile, acc[r][j]);
}

template <int Bits, int NB, typename S>
inline void gemm_rows(const QuantisedX& x, const float* sums, int64_t m0, int64_t m1, const uint8_t* w,
                      const S* ws, const S* wm, float* y, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  int64_t m = m0;
  for (; m + kRowTile <= m1; m += kRowTile)
    tile_gemm<Bits, kRowTile, NB>(x.q.data() + m * K, x.d.data() + m * G, sums + m * G, w, ws, wm, y + m * N, K,
                                  N);
  const int8_t* xq = x.q.data() + m * K;
  const float *xd = x.d.data() + m * G, *xs = sums + m * G;
  switch (m1 - m) {
    case 5: tile_gemm<Bits, 5, NB>(xq, xd, xs, w, ws, wm, y + m * N, K, N); break;
    case 4: tile_gemm<Bits, 4, NB>(xq, xd, xs, w, ws, wm, y + m * N, K, N); break;
    case 3: tile_gemm<Bits, 3, NB>(xq, xd, xs, w, ws, wm, y + m * N, K, N); break;
    case 2: tile_gemm<Bits, 2, NB>(xq, xd, xs, w, ws, wm, y + m * N, K, N); break;
    case 1: tile_gemm<Bits, 1, NB>(xq, xd, xs, w, ws, wm, y + m * N, K, N); break;
    default: break;
  }
}

template <int Bits, typename S>
void qgemm_rows(const QuantisedX& x, const uint8_t* wp, const S* sp, const S* mp, float* yp, int64_t M,
                int64_t K, int64_t N) {
  // Threads split the weight tiles; each passes all rows over its tiles. (Splitting rows
  // too, in chunks, left the threads unequal work at 512 rows and gained nothing at 4096.)
  const int64_t G = K / kGroup, tiles = N / kTile, pairs = (tiles + kTilePair - 1) / kTilePair;
  const int64_t tile_bytes = tile_size(K, Bits);
  const float* sums = x.sum.data();
  headroom::parallel_rows(M, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = p * kTilePair;
      const uint8_t* w = wp + t * tile_bytes;
      const S *s = sp + t * G * kTile, *mn = mp + t * G * kTile;
      if (t + kTilePair <= tiles) {
        gemm_rows<Bits, kTilePair>(x, sums, 0, M, w, s, mn, yp + t * kTile, K, N);
      } else {
        gemm_rows<Bits, 1>(x, sums, 0, M, w, s, mn, yp + t * kTile, K, N);
      }
    }
  });
}
#endif
}  // namespace

bool qdot_available() {
#if defined(HEADROOM_VNNI) || defined(HEADROOM_AVX2)
  return true;
#else
  return false;
#endif
}

bool qgemm_available() {
#ifdef HEADROOM_VNNI
  return true;
#else
  return false;
#endif
}

// x: (M, K) float32; qweight: (N, K) uint8 for bits=8 or (N, K/2) for bits=4; scales, mins:
// (N, K/32) float32 -> (M, N) float32. K must be a multiple of 64.
torch::Tensor qdot_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                          int64_t bits) {
  TORCH_CHECK(qdot_available(), "qdot_linear needs AVX2 or AVX-512 VNNI, which this build lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kFloat32 &&
                  mins.scalar_type() == torch::kFloat32 && qweight.is_contiguous() && scales.is_contiguous() &&
                  mins.is_contiguous(), "qweight must be contiguous uint8, scales and mins contiguous float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kChunk == 0 && qweight.size(1) == K * bits / 8 && scales.size(0) == N &&
                  scales.size(1) == K / kGroup && mins.sizes() == scales.sizes(),
              "shapes do not match a group-32 weight with K a multiple of 64");
  auto y = torch::empty({M, N}, x.options());
#ifdef HEADROOM_VNNI
  const QuantisedX xq = headroom::quantise_x(x.data_ptr<float>(), M, K);
  if (bits == 8) {
    qdot_rows<8>(xq, qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                 y.data_ptr<float>(), M, K, N);
  } else {
    qdot_rows<4>(xq, qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                 y.data_ptr<float>(), M, K, N);
  }
#elif defined(HEADROOM_AVX2)
  headroom::qdot_avx2(x.data_ptr<float>(), qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                      mins.data_ptr<float>(), y.data_ptr<float>(), M, K, N, bits);
#endif
  return y;
}

// x: (M, K) float32; tiles: (N/16, K/32, 8, 16, 4) uint8, unsigned 8-bit weights (4-bit
// ones as they are, 0..15), or (N/16, K/32, 4, 16, 4) for 4-bit ones packed, step s + 4's
// in the high nibbles of step s's; scales, mins: (N/16, K/32, 16), both float32 or both
// float16 -> (M, N) float32.
torch::Tensor qgemm_linear(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(qgemm_available(), "qgemm_linear needs AVX-512 VNNI, which this build lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.scalar_type() == mins.scalar_type() &&
                  (scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kHalf),
              "tiles must be contiguous uint8, scales and mins contiguous and both float32 or both float16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(tiles.dim() == 5 && tiles.size(1) == K / kGroup && K % kGroup == 0 &&
                  (tiles.size(2) == 8 || tiles.size(2) == 4) && tiles.size(3) == 16 && tiles.size(4) == 4 &&
                  scales.dim() == 3 && scales.size(0) == tiles.size(0) && scales.size(1) == K / kGroup &&
                  scales.size(2) == 16 && mins.sizes() == scales.sizes(),
              "shapes do not match (N/16, K/32, 8 or 4, 16, 4) tiles of a group-32 weight");
  const int64_t N = tiles.size(0) * 16;
  auto y = torch::empty({M, N}, x.options());
#ifdef HEADROOM_VNNI
  const QuantisedX xq = headroom::quantise_x(x.data_ptr<float>(), M, K);
  auto run = [&](const auto* sp, const auto* mp) {
    if (tiles.size(2) == 8)
      qgemm_rows<8>(xq, tiles.data_ptr<uint8_t>(), sp, mp, y.data_ptr<float>(), M, K, N);
    else
      qgemm_rows<4>(xq, tiles.data_ptr<uint8_t>(), sp, mp, y.data_ptr<float>(), M, K, N);
  };
  if (scales.scalar_type() == torch::kHalf)
    run(scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>());
  else
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
#endif
  return y;
}
