// Scalar conversions between float32 and the 16-bit float formats stored in checkpoints.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace mtpx {

// bf16 is the upper half of an IEEE float32: widening is exact.
inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element i of an array of 16-bit or 32-bit values at any address: checkpoint tensors need not be aligned
// (MLX's safetensors writer does not pad the header, so a file's tensors can all start at odd addresses).
// memcpy compiles to one load.
inline uint16_t load_u16(const void* base, int64_t i) {
  uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + i * 2, sizeof v);
  return v;
}
inline float load_f32(const void* base, int64_t i) {
  float v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + i * 4, sizeof v);
  return v;
}

inline float f16_to_f32(uint16_t bits) { return static_cast<float>(std::bit_cast<_Float16>(bits)); }
inline uint16_t f32_to_f16(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }

}  // namespace mtpx
