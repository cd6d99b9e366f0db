// Helpers shared by the benchmark programs of bench/ (each is one .cpp file).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>

#include "backend/cpu/matmul.h"
#include "model/weights.h"

namespace mtpx::bench {

// Parses the command line as mtpx's own commands do (src/cli/main.cpp): a bad flag is one line on stderr and
// exit code 2 (CLI11_PARSE would exit 105-111). Returns the code to exit with, or -1 to go on.
inline int parse_arguments(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}

// Matmul FLOPs of one token through the trunk (excluding lm_head) plus lm_head rows.
inline double matmul_flops(const ModelWeights& w, int64_t tokens, int64_t logit_rows) {
  double per_token = 0;
  auto add = [&](const cpu::WeightMatrix& m) { per_token += 2.0 * static_cast<double>(m.rows * m.cols); };
  for (const auto& l : w.layers) {
    if (l.attention)
      add(l.attention->q_proj), add(l.attention->k_proj), add(l.attention->v_proj), add(l.attention->o_proj);
    if (l.delta_net)
      add(l.delta_net->in_proj_qkv), add(l.delta_net->in_proj_z), add(l.delta_net->in_proj_a),
          add(l.delta_net->in_proj_b), add(l.delta_net->out_proj);
    add(l.mlp.gate_proj), add(l.mlp.up_proj), add(l.mlp.down_proj);
  }
  return per_token * static_cast<double>(tokens) +
         2.0 * static_cast<double>(w.lm_head.rows * w.lm_head.cols * logit_rows);
}

}  // namespace mtpx::bench
