// mtpx: command-line front end. The one place where errors become exit codes:
// 0 success, 2 bad input (flags, files, ids), 1 internal failure.
#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "util/error.h"

namespace {

// Levenshtein distance (insertions, deletions, substitutions of one character each).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The command's long flag nearest to `typed` ("--promt" -> "--prompt"), or "" when none is within a
// third of its length.
std::string closest_flag(std::string typed, const CLI::App& command) {
  if (const size_t eq = typed.find('='); eq != std::string::npos) typed.resize(eq);
  if (typed.rfind("--", 0) != 0) return "";
  std::string best;
  size_t best_distance = std::max<size_t>(2, typed.size() / 3) + 1;
  for (const CLI::Option* option : command.get_options()) {
    for (const std::string& name : option->get_lnames()) {
      const size_t d = edit_distance(typed, "--" + name);
      if (d < best_distance) {
        best_distance = d;
        best = "--" + name;
      }
    }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mtpx: Qwen3.5/Qwen3.6 inference with native multi-token-prediction speculative decoding"};
  app.set_version_flag("--version", std::string("mtpx ") + MTPX_VERSION);
  app.require_subcommand(1);
  std::map<CLI::App*, std::function<int()>> runners;
  auto add = [&](const char* name, const char* description, auto adder) {
    CLI::App* sub = app.add_subcommand(name, description);
    runners[sub] = adder(*sub);
  };
  add("generate", "generate text from a prompt", mtpx::cli::add_generate_command);
  add("tokenize", "print the token ids of a text", mtpx::cli::add_tokenize_command);
  add("logits", "write the logits and final hidden states of a prompt to a safetensors file",
      mtpx::cli::add_logits_command);
  add("synth", "write a randomly initialized checkpoint with a real Qwen3.5 shape",
      mtpx::cli::add_synth_command);
  add("inspect", "describe a model directory without loading it: shapes, sizes, MTP status, memory",
      mtpx::cli::add_inspect_command);
  add("bench", "measure decoding speed, plain vs MTP, with a fixed protocol", mtpx::cli::add_bench_command);
  add("tune", "find the fastest MTP draft depth on this machine and save it as the model's profile",
      mtpx::cli::add_tune_command);
  add("quantize", "quantize a model (MLX affine layout), keeping its MTP head",
      mtpx::cli::add_quantize_command);
  add("graft", "give a head-less model the MTP head of another build, verified by measured acceptance",
      mtpx::cli::add_graft_command);
  add("serve", "OpenAI-compatible HTTP server (chat, completions, SSE) with MTP on",
      mtpx::cli::add_serve_command);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-') {
      std::fprintf(stderr, "error: unknown command '%s' (see mtpx --help for the commands)\n", argv[1]);
      return 2;
    }
    std::string message = e.what();
    // A mistyped flag: name the closest one the command has.
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      CLI::App* command = app.get_subcommands().empty() ? &app : app.get_subcommands().front();
      for (const std::string& extra : command->remaining()) {
        if (const std::string close = closest_flag(extra, *command); !close.empty()) {
          message += fmt::format(" (did you mean {} instead of {}?)", close, extra);
          break;
        }
      }
    }
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return 2;
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
    return 2;
  } catch (const mtpx::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return mtpx::exit_code_for(e.kind());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: internal: %s\n", e.what());
    return 1;
  }
}
