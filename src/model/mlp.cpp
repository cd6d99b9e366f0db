#include "model/mlp.h"

#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"

namespace mtpx {

void mlp_forward(const MlpWeights& w, const float* h, int64_t T, float* out) {
  const int64_t I = w.gate_proj.rows;
  std::vector<float> gate(static_cast<size_t>(T * I)), up(static_cast<size_t>(T * I));  // [T, I]
  cpu::matmul(w.gate_proj, h, T, gate.data());
  cpu::matmul(w.up_proj, h, T, up.data());
  cpu::swiglu(gate.data(), up.data(), T * I, gate.data());
  cpu::matmul(w.down_proj, gate.data(), T, out);
}

}  // namespace mtpx
