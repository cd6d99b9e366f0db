// mtpx inspect DIR: what a model directory holds and whether this machine can run it (tools/inspect.h).
#include "tools/inspect.h"

#include <fmt/core.h>

#include "cli/commands.h"
#include "cli/common.h"

namespace mtpx::cli {
namespace {

struct InspectFlags {
  std::string model;
  bool json = false;
  int64_t context = 4096;
  bool check_values = false;
};

int run_inspect(const InspectFlags& f) {
  const auto dir = resolve_model_dir(f.model);
  const nlohmann::json report =
      tools::inspect_model(dir, {.context = f.context, .check_values = f.check_values});
  // Names from a hostile file need not be UTF-8: replaced, not an exception.
  if (f.json)
    fmt::print("{}\n", report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  else
    fmt::print("{}", tools::render_inspect_report(report));
  return 0;
}

}  // namespace

std::function<int()> add_inspect_command(CLI::App& app) {
  auto f = std::make_shared<InspectFlags>();
  app.add_option("model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_flag("--json", f->json, "print the report as JSON");
  app.add_option("--context", f->context, "context length for the memory estimate")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  app.add_flag("--check-values", f->check_values,
               "read every weight and report tensors holding NaN or Inf (reads the whole checkpoint)");
  return [f] { return run_inspect(*f); };
}

}  // namespace mtpx::cli
