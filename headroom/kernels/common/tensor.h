// What the kernels use of ATen. torch/extension.h would bring torch's whole C++ frontend
// and pybind11 into every file (most of a file's compile time); only bindings.cpp, which
// makes the Python module, includes pybind11 (through torch/python.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

// The names torch/types.h gives the dtypes the kernels use.
namespace torch {
using at::empty;
using at::empty_like;
using at::Tensor;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kHalf = at::kHalf;
constexpr auto kBFloat16 = at::kBFloat16;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch
