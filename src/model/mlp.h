// SwiGLU MLP (spec §5): down(silu(gate(h)) * up(h)).
#pragma once

#include <cstdint>

#include "model/weights.h"

namespace mtpx {

class InputStatistics;

// h: [T, H] -> out: [T, H]
void mlp_forward(const MlpWeights& w, const float* h, int64_t t_count, float* out,
                 InputStatistics* stats = nullptr);  // stats: see input_statistics.h

}  // namespace mtpx
