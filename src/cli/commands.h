// The subcommands of the `mtpx` program. Each adds its flags to a CLI11 subcommand and runs after a
// successful parse; errors propagate as mtpx::Error to main(), which maps them to exit codes.
#pragma once

#include <CLI/CLI.hpp>

namespace mtpx::cli {

// Each returns the function that runs the command once the flags are parsed.
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_tokenize_command(CLI::App& app);
std::function<int()> add_logits_command(CLI::App& app);
std::function<int()> add_synth_command(CLI::App& app);
std::function<int()> add_inspect_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);
std::function<int()> add_tune_command(CLI::App& app);
std::function<int()> add_quantize_command(CLI::App& app);
std::function<int()> add_graft_command(CLI::App& app);
std::function<int()> add_serve_command(CLI::App& app);

}  // namespace mtpx::cli
