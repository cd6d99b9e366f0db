// mtpx quantize and mtpx graft: thin front ends over tools/quantize.h and tools/graft.h.
#include <fmt/core.h>

#include "cli/commands.h"
#include "cli/common.h"
#include "tools/graft.h"
#include "tools/progress.h"
#include "tools/quantize.h"

namespace mtpx::cli {
namespace {

struct QuantizeFlags {
  std::string model, out;
  int bits = 4;
  int64_t group_size = 64;
  int mtp_fc_bits = 16;
  int embed_bits = 0;
  std::string method = "least-squares";
  std::string calibration = "builtin";
  bool force = false, json = false;
  int threads = 0;
};

int run_quantize(const QuantizeFlags& f) {
  set_threads(f.threads);
  tools::ProgressBar bar(fmt::format("quantize {}-bit", f.bits));
  tools::QuantizeOptions o;
  o.quant = {.bits = f.bits,
             .group_size = f.group_size,
             .method = f.method == "mlx" ? tools::QuantMethod::kMlx : tools::QuantMethod::kLeastSquares,
             .mtp_fc_bits = f.mtp_fc_bits,
             .embed_bits = f.embed_bits};
  o.calibration = f.calibration;
  o.force = f.force;
  o.progress = [&](double x) { bar.update(x); };
  const nlohmann::json report = tools::quantize_model(resolve_model_dir(f.model), f.out, o);
  bar.finish();
  if (f.json)
    fmt::print("{}\n", report.dump(2));
  else
    fmt::print("wrote {}: {}-bit affine ({}), group {}, mtp.fc {}, {:.1f} MiB{}\n", f.out, f.bits, f.method,
               f.group_size, f.mtp_fc_bits == 16 ? std::string("bf16") : fmt::format("{}-bit", f.mtp_fc_bits),
               report["bytes"].get<double>() / (1 << 20),
               report["mtp_head"].get<bool>() ? ", MTP head kept" : ", no MTP head");
  return 0;
}

struct GraftFlags {
  std::string trunk, donor, out;
  double min_acceptance = 0.30;
  bool force = false, json = false;
  int threads = 0;
};

int run_graft(const GraftFlags& f) {
  set_threads(f.threads);
  const nlohmann::json report =
      tools::graft_mtp_head(f.trunk, f.donor, f.out, {.min_acceptance = f.min_acceptance, .force = f.force});
  if (f.json)
    fmt::print("{}\n", report.dump(2));
  else
    fmt::print("wrote {}: {} head tensors from {}; teacher-forced acceptance {:.1f}% on {} tokens{}\n", f.out,
               report["head_tensors"].get<int64_t>(), f.donor,
               100 * report["teacher_forced_acceptance"].get<double>(),
               report["sample_tokens"].get<int64_t>(),
               report["accepted"].get<bool>() ? "" : " (below threshold, kept by --force)");
  return 0;
}

}  // namespace

std::function<int()> add_quantize_command(CLI::App& app) {
  auto f = std::make_shared<QuantizeFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--out", f->out, "output model directory (must not exist)")->required();
  app.add_option("--bits", f->bits, "bits per weight: 4, 6 or 8")
      ->check(CLI::IsMember({4, 6, 8}))
      ->capture_default_str();
  app.add_option("--group-size", f->group_size, "weights per scale/bias group")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  app.add_option("--mtp-fc-bits", f->mtp_fc_bits, "mtp.fc: 16 (bf16, default), 8 or 4")
      ->check(CLI::IsMember({16, 8, 4}));
  app.add_option("--embed-bits", f->embed_bits,
                 "embedding / lm_head: 16, 8, 6 or 4 (default: as --bits, like MLX)")
      ->check(CLI::IsMember({16, 8, 6, 4}));
  app.add_option("--method", f->method,
                 "scales and biases: least-squares (default: each group's smallest squared error found by a "
                 "short search) or mlx (MLX's min/max rule, bit for bit what mlx_lm.convert -q writes)")
      ->check(CLI::IsMember({"least-squares", "mlx"}))
      ->capture_default_str();
  app.add_option(
      "--calibration", f->calibration,
      "least-squares: weigh each input column's error by its mean square over a text run through "
      "the model: builtin (default, a short code sample), none, or a text FILE (its first 2048 tokens)");
  app.add_flag("--force", f->force, "replace --out if it exists");
  app.add_flag("--json", f->json, "print the report as JSON");
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  return [f] { return run_quantize(*f); };
}

std::function<int()> add_graft_command(CLI::App& app) {
  auto f = std::make_shared<GraftFlags>();
  app.add_option("--trunk", f->trunk, "model directory without an MTP head")->required();
  app.add_option("--donor", f->donor, "another build of the same base model, with its MTP head")->required();
  app.add_option("--out", f->out, "output model directory (must not exist)")->required();
  app.add_option("--min-acceptance", f->min_acceptance, "refuse heads below this teacher-forced acceptance")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_flag("--force", f->force, "keep a head below the threshold; replace --out");
  app.add_flag("--json", f->json, "print the report as JSON");
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  return [f] { return run_graft(*f); };
}

}  // namespace mtpx::cli
