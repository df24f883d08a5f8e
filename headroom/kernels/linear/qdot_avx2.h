// The AVX2 form of qdot_linear (qdot_avx2.cpp), which qdot_linear.cpp calls on a CPU without
// AVX-512 VNNI.
#pragma once
#include <cstdint>

namespace headroom {
// y (M, N) = x (M, K) @ W^T; W as qdot_linear takes it: (N, K * bits / 8) bytes, scales and
// minima (N, K / 32). K a multiple of 64.
void qdot_avx2(const float* x, const uint8_t* w, const float* scales, const float* mins, float* y, int64_t M,
               int64_t K, int64_t N, int64_t bits);
}  // namespace headroom
