// Matrix products of float32 activations with weights in their stored dtype (f32, f16, bf16).
//
// Batch invariance (the property that makes greedy MTP lossless): y[m, o] is computed by the same
// sequence of floating-point operations whatever M is and whichever rows share a tile: the reduction over
// k runs in fixed lane-blocked order with one accumulator per (m, o), followed by a fixed horizontal sum.
// Threads split the output features, never the reduction.
#pragma once

#include <cstdint>

namespace mtpx::cpu {

enum class WeightType { kF32, kF16, kBF16 };

// A row-major [rows, cols] weight matrix (PyTorch nn.Linear layout: rows = out_features).
struct WeightMatrix {
  WeightType type = WeightType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;  // out features
  int64_t cols = 0;  // in features
};

// y[m, o] = sum_k x[m, k] * W[o, k]   for m < M, o < W.rows.
// x: [M, W.cols] float32 row-major; y: [M, W.rows] float32 row-major (must not alias x).
void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y);

// The same product computed in the plainest way (double accumulation): the oracle for tests.
void matmul_reference(const WeightMatrix& w, const float* x, int64_t m, float* y);

// Row `row` of the matrix widened to float32 (embedding lookup).
void weight_row_to_f32(const WeightMatrix& w, int64_t row, float* out);

// Which SIMD path the kernels picked on this CPU ("avx512", "avx2", "scalar").
const char* simd_path();

}  // namespace mtpx::cpu
