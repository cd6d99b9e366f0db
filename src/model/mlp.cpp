#include "model/mlp.h"

#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/input_statistics.h"

namespace mtpx {

void mlp_forward(const MlpWeights& w, const float* h, int64_t T, float* out, InputStatistics* stats) {
  const int64_t I = w.gate_proj.rows;
  std::vector<float> gate(static_cast<size_t>(T * I)), up(static_cast<size_t>(T * I));  // [T, I]
  const cpu::MatmulTarget gate_up[] = {{&w.gate_proj, gate.data()}, {&w.up_proj, up.data()}};
  cpu::matmul_shared_input(gate_up, h, T);
  cpu::swiglu(gate.data(), up.data(), T * I, gate.data());
  cpu::matmul(w.down_proj, gate.data(), T, out);
  if (stats != nullptr) {
    stats->add(w.gate_proj, h, T);
    stats->add(w.up_proj, h, T);
    stats->add(w.down_proj, gate.data(), T);
  }
}

}  // namespace mtpx
