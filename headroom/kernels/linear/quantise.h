// The integer-dot kernels' activations (qdot_linear.cpp on VNNI, qdot_avx2.cpp on AVX2, the
// tiled qgemm_linear): x rounded to int8 per row and group of 32 with one scale each, as
// llama.cpp's Q8_1 rounds them, so both CPUs multiply the same integers.
#pragma once
#include <cstdint>
#include <vector>

namespace headroom {
struct QuantisedX {
  std::vector<int8_t> q;   // (M, K)
  std::vector<float> d;    // (M, K / 32): each group's scale, max|x| / 127
  std::vector<float> sum;  // (M, K / 32): d * the sum of the group's q, for the minima's share
};

// x: (M, K) float32, K a multiple of 32; rounds half to even (vcvtps2dq). Needs AVX2.
QuantisedX quantise_x(const float* x, int64_t M, int64_t K);
}  // namespace headroom
