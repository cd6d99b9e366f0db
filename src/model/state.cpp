#include "model/state.h"

#include <algorithm>
#include <utility>

#include "util/error.h"

namespace mtpx {

InferenceState::InferenceState(const ModelConfig& c, int64_t capacity) : capacity_(capacity) {
  if (capacity <= 0) invalid_input("context capacity must be positive, got {}", capacity);
  kv_.resize(static_cast<size_t>(c.num_layers));
  delta_.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    // Attention caches start empty and grow as positions are used (gated_attention_forward).
    if (c.layer_types[static_cast<size_t>(i)] == LayerType::kLinearAttention) {
      DeltaNetState& d = delta_[static_cast<size_t>(i)];
      d.conv.assign(static_cast<size_t>((c.linear_conv_kernel_dim - 1) * c.conv_dim()), 0.0f);
      d.ssm.assign(
          static_cast<size_t>(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim),
          0.0f);
    }
  }
}

InferenceState::InferenceState(int64_t capacity, std::unique_ptr<DeviceSequence> device)
    : capacity_(capacity), device_(std::move(device)) {
  if (capacity <= 0) invalid_input("context capacity must be positive, got {}", capacity);
}

}  // namespace mtpx
