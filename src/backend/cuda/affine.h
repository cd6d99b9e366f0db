// Kernels for affine-quantized matrices (Matrix::type == Dtype::kAffine), used by matmul.cu's row products,
// matmul_group, matmul_swiglu and embed_rows. Internal to backend/cuda.
#pragma once

#include <cstdint>

#include "backend/cuda/kernels.h"

namespace mtpx::cuda::affine {

// The row kernels for m < kGemmMinRows (batch-invariant as the float ones, see kernels.h): `epilogue` is a
// RowEpilogue (device_math.cuh). kStore/kAccumulate: ys[i] (+)= x ws[i]^T for i < count (same cols, bits,
// group size and scale type). kSwiglu: ys[0] = silu(x ws[0]^T) * (x ws[1]^T).
void rows(int epilogue, const Matrix* ws, int count, const float* x, int64_t m, float* const* ys,
          void* stream);

// out [rows, cols] bf16 = rows row0 .. row0 + rows - 1 of w, dequantized (fma(scale, code, bias), rounded).
void dequantize_bf16(const Matrix& w, int64_t row0, int64_t rows, void* out, void* stream);

// out[t, :] = row tokens[t] of w in float32, fma(scale, code, bias) exactly as the CPU's weight_row_to_f32.
void embed(const Matrix& w, const int32_t* tokens, int64_t t_count, float* out, void* stream);

}  // namespace mtpx::cuda::affine
