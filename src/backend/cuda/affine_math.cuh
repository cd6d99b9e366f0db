// Device helpers for MLX affine-quantized rows (kernels.h, Dtype::kAffine), shared by affine.cu and moe.cu
// (included by .cu files only). A row's codes are a little-endian bit stream; a chunk is 8 consecutive
// codes (8 * B bits, B bytes), and weight = scale * code + bias per group of group_size codes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mtpx::cuda::affine {

// The 8 codes of chunk `chunk` of a row as a 64-bit little-endian value.
template <int B>
__device__ __forceinline__ uint64_t load_chunk(const uint32_t* row, int chunk) {
  if constexpr (B == 4) return __ldg(row + chunk);
  if constexpr (B == 8) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(row) + chunk);
    return u.x | static_cast<uint64_t>(u.y) << 32;
  }
  if constexpr (B == 6) {  // 6 bytes at byte 6 * chunk, 2-byte aligned
    const auto* h = reinterpret_cast<const unsigned short*>(row) + 3 * chunk;
    return __ldg(h) | static_cast<uint64_t>(__ldg(h + 1)) << 16 | static_cast<uint64_t>(__ldg(h + 2)) << 32;
  }
  // 2, 3 and 5 bits: B bytes at byte B * chunk.
  const auto* b = reinterpret_cast<const unsigned char*>(row) + B * chunk;
  uint64_t v = 0;
#pragma unroll
  for (int i = 0; i < B; ++i) v |= static_cast<uint64_t>(__ldg(b + i)) << (8 * i);
  return v;
}

// The float 1 + c / 2^B for code c (compile-time index after unrolling) of the chunk: c's B bits moved to
// the top of the mantissa, under the exponent of 1.0.
template <int B>
__device__ __forceinline__ float code_plus_one(uint64_t chunk, int c) {
  const int bit = c * B;
  const uint32_t word = bit >= 32 ? static_cast<uint32_t>(chunk >> 32) : static_cast<uint32_t>(chunk);
  const int shift = bit % 32;
  const uint32_t bits = shift + B > 32 ? static_cast<uint32_t>(chunk >> bit) : word >> shift;
  return __uint_as_float(0x3F800000u | ((bits << (23 - B)) & (((1u << B) - 1u) << (23 - B))));
}

// Scale or bias i of a matrix whose scales are float32 (f32) or bf16.
__device__ __forceinline__ float scale_at(const void* p, size_t i, bool f32) {
  return f32 ? __ldg(static_cast<const float*>(p) + i)
             : __uint_as_float(static_cast<uint32_t>(__ldg(static_cast<const unsigned short*>(p) + i)) << 16);
}

}  // namespace mtpx::cuda::affine
