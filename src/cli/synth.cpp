// mtpx synth: a randomly initialized checkpoint with a real Qwen3.5 shape (spec §9) in the official
// layout (bf16), or in the MLX quantized layout (--bits 8|6|4), for benchmarks at real scale without a
// download. There is no tokenizer: drive it with --prompt-ids. --shape also takes a config.json (or a model
// directory holding one): the checkpoint then has that model's shape, e.g. to measure a recipe before
// training it.
#include <fmt/core.h>

#include <filesystem>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/model_config.h"
#include "model/shapes.h"
#include "tools/checkpoint.h"
#include "tools/progress.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct SynthFlags {
  std::string shape;
  std::string out;
  int bits = 16;
  int64_t group_size = 64;
  bool mtp = false;
  bool force = false;
  uint64_t seed = 1;
  int threads = 0;
  int64_t layers = 0;
};

// A named shape (spec §9), or the shape of a config.json / a model directory's config.json.
// layers > 0: only the first `layers` layers (a reduced-depth model).
ModelConfig synth_shape(const std::string& shape, int64_t layers) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(shape, ec) && !fs::is_regular_file(shape, ec)) return shape_config(shape, layers);
  ModelConfig c =
      load_model_config(fs::is_directory(shape, ec) ? fs::path(shape) / "config.json" : fs::path(shape));
  if (layers > c.num_layers) invalid_input("--layers {}: '{}' has {} layers", layers, shape, c.num_layers);
  if (layers > 0) {
    c.num_layers = layers;
    c.layer_types.resize(static_cast<size_t>(layers));
  }
  return c;
}

int run_synth(const SynthFlags& f) {
  set_threads(f.threads);
  ModelConfig config = synth_shape(f.shape, f.layers);
  config.mtp_num_hidden_layers = f.mtp ? 1 : 0;
  config.max_position_embeddings = 262144;
  tools::WriteOptions options;
  options.layout = f.bits < 16 ? tools::Layout::kMlx : tools::Layout::kHuggingFace;
  options.quant.bits = f.bits;
  options.quant.group_size = f.group_size;
  options.quant.mtp_fc_bits = 16;
  options.seed = f.seed;
  tools::ProgressBar bar("synth " + f.shape);
  options.progress = [&](double x) { bar.update(x); };

  tools::AtomicDirectory out(f.out, f.force);
  const auto tensors = tools::checkpoint_manifest(config, f.mtp, options.layout);
  const int64_t bytes = tools::write_checkpoint_tensors(out.path(), tensors, options);
  tools::write_json_file(out.path() / "config.json", tools::config_json(config, options));
  // Greedy by default: random weights make sampling defaults meaningless.
  tools::write_json_file(out.path() / "generation_config.json", {{"do_sample", false}});
  out.commit();
  bar.finish();
  fmt::print("wrote {} ({} shape{}, {}, {:.2f} GB{})\n", f.out, f.shape,
             f.layers > 0 ? fmt::format(", first {} layers", f.layers) : std::string(),
             f.bits < 16 ? fmt::format("{}-bit affine, group {}", f.bits, f.group_size) : std::string("bf16"),
             static_cast<double>(bytes) / 1e9, f.mtp ? ", with MTP head" : "");
  return 0;
}

}  // namespace

std::function<int()> add_synth_command(CLI::App& app) {
  auto f = std::make_shared<SynthFlags>();
  app.add_option("--shape", f->shape,
                 "0.8B, 2B, 4B, 9B, 27B, 35B-A3B, 122B-A10B, 397B-A17B, tiny, tiny-moe, or a config.json (or "
                 "model directory) to copy the shape of")
      ->required();
  app.add_option(
         "--layers", f->layers,
         "only the first N layers of the shape (a reduced-depth model, e.g. a MoE shape that fits this "
         "machine's memory)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--out", f->out, "output model directory (must not exist)")->required();
  app.add_option("--bits", f->bits, "16 (bf16), or 8, 6, 4 (MLX affine quantization)")
      ->check(CLI::IsMember({16, 8, 6, 4}))
      ->capture_default_str();
  app.add_option("--group-size", f->group_size, "quantization group size")
      ->check(CLI::IsMember({32, 64, 128}))
      ->capture_default_str();
  app.add_flag("--mtp", f->mtp, "include a (random) MTP head");
  app.add_flag("--force", f->force, "replace --out if it exists");
  app.add_option("--seed", f->seed, "random seed")->capture_default_str();
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  return [f] { return run_synth(*f); };
}

}  // namespace mtpx::cli
