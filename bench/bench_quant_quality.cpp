// Quantization quality on the shipped model (issue targets: 8-bit top-1 agreement with bf16 >= 99%,
// 4-bit >= 90% with MTP acceptance within 3 points of bf16, 6-bit in between). For each bit width the
// model is quantized with `mtpx quantize`'s code into a temporary directory, then on the held-out samples
// (tests/fixtures/trained_default/heldout_samples.json: prompt + the true continuation):
//   top-1 agreement: argmax of the quantized trunk's logits == argmax of bf16's, over every position
//   head acceptance: teacher-forced greedy acceptance of the MTP head's first draft (tools/graft.h)
//   MTP acceptance:  measured by greedy generation with K = 1 (64 tokens per prompt)
//
//   bench_quant_quality [--model DIR] [--samples FILE] [--prompts 20]
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "decode/generate.h"
#include "model/qwen35.h"
#include "tools/graft.h"
#include "tools/quantize.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::string model_dir = std::string(MTPX_SOURCE_DIR) + "/models/default";
  std::string samples_file =
      std::string(MTPX_SOURCE_DIR) + "/tests/fixtures/trained_default/heldout_samples.json";
  size_t prompts = 20;
  CLI::App app{"mtpx quantization quality"};
  app.add_option("--model", model_dir);
  app.add_option("--samples", samples_file);
  app.add_option("--prompts", prompts)->check(CLI::PositiveNumber);
  // A calibration text apart from the held-out samples the figures are measured on.
  std::string calibration_file = std::string(MTPX_SOURCE_DIR) + "/scripts/train_small_model.py";
  app.add_option("--calibration", calibration_file, "text file for the calibrated least-squares rows");
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;

  std::ifstream in(samples_file);
  const auto samples = nlohmann::json::parse(in)["samples"];
  std::vector<std::vector<int32_t>> texts, heads;
  for (const auto& s : samples) {
    if (texts.size() >= prompts) break;
    auto ids = s["prompt_ids"].get<std::vector<int32_t>>();
    heads.push_back(ids);
    for (int32_t id : s["next_ids"].get<std::vector<int32_t>>()) ids.push_back(id);
    texts.push_back(ids);
  }
  const auto reference = mtpx::Model::load(model_dir);
  auto argmaxes = [](const mtpx::Model& m, const std::vector<int32_t>& ids) {
    mtpx::InferenceState state = m.new_state(static_cast<int64_t>(ids.size()));
    mtpx::ForwardResult r;
    m.forward(state, ids, mtpx::LogitRows::kAll, r);
    const int64_t V = m.config().vocab_size;
    std::vector<int64_t> out;
    for (size_t t = 0; t < ids.size(); ++t)
      out.push_back(std::max_element(&r.logits[t * V], &r.logits[(t + 1) * V]) - &r.logits[t * V]);
    return out;
  };
  // The same argmaxes, one token per forward pass: the decode path, whose row kernels (the int8-activation
  // tiles where the CPU has VNNI) differ from the prompt path's dequantize + sgemm.
  auto decode_argmaxes = [](const mtpx::Model& m, const std::vector<int32_t>& ids) {
    mtpx::InferenceState state = m.new_state(static_cast<int64_t>(ids.size()));
    mtpx::ForwardResult r;
    std::vector<int64_t> out;
    for (int32_t id : ids) {
      m.forward(state, std::vector<int32_t>{id}, mtpx::LogitRows::kLast, r);
      out.push_back(std::max_element(r.logits.begin(), r.logits.end()) - r.logits.begin());
    }
    return out;
  };
  auto measure = [&](const mtpx::Model& m) {
    double head = 0, drafted = 0, accepted = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      head += mtpx::tools::teacher_forced_acceptance(m, texts[i]) / static_cast<double>(texts.size());
      mtpx::GenerateOptions o;
      o.max_tokens = 64;
      o.draft = 1;
      o.sampler.temperature = 0.0;
      const auto g = mtpx::generate(m, heads[i], o);
      drafted += static_cast<double>(g.stats.mtp.drafted);
      accepted += static_cast<double>(g.stats.mtp.accepted);
    }
    return std::pair{head, accepted / drafted};
  };
  const auto [ref_head, ref_mtp] = measure(*reference);
  std::vector<std::vector<int64_t>> ref_top1, ref_decode_top1;
  for (const auto& t : texts) ref_top1.push_back(argmaxes(*reference, t));
  for (const auto& t : texts) ref_decode_top1.push_back(decode_argmaxes(*reference, t));

  fmt::print("model {} | {} held-out texts ({} positions)\n", model_dir, texts.size(),
             texts.size() * texts[0].size());
  fmt::print(
      "| weights | size | top-1 agreement with bf16 (prompt pass) | top-1 agreement (decode passes) | head "
      "acceptance (teacher-forced) | MTP acceptance (K=1, greedy) |\n");
  fmt::print("|---|---|---|---|---|---|\n");
  fmt::print("| bf16 | {:.1f} MiB | 100% | 100% | {:.1f}% | {:.1f}% |\n",
             static_cast<double>(fs::file_size(fs::path(model_dir) / "model.safetensors")) / (1 << 20),
             100 * ref_head, 100 * ref_mtp);
  const fs::path tmp = fs::temp_directory_path() / fmt::format("mtpx_quant_quality_{}", ::getpid());
  fs::create_directories(tmp);
  using mtpx::tools::QuantMethod;
  // MLX's rule; least squares unweighted, calibrated on the built-in sample, calibrated on a file.
  const std::vector<std::pair<QuantMethod, std::string>> methods = {
      {QuantMethod::kMlx, "none"},
      {QuantMethod::kLeastSquares, "none"},
      {QuantMethod::kLeastSquares, "builtin"},
      {QuantMethod::kLeastSquares, calibration_file}};
  for (auto [bits, embed_bits] : std::vector<std::pair<int, int>>{{8, 0}, {6, 0}, {4, 0}, {4, 6}, {4, 8}})
    for (size_t mi = 0; mi < methods.size(); ++mi) {
      const auto& [method, calibration] = methods[mi];
      const fs::path out = tmp / fmt::format("q{}_{}_{}", bits, embed_bits, mi);
      mtpx::tools::QuantizeOptions o;
      o.quant.bits = bits;
      o.quant.embed_bits = embed_bits;
      o.quant.method = method;
      o.calibration = calibration;
      const auto report = mtpx::tools::quantize_model(model_dir, out, o);
      const auto q = mtpx::Model::load(out);
      int64_t agree = 0, decode_agree = 0, total = 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        const auto got = argmaxes(*q, texts[i]);
        const auto got_decode = decode_argmaxes(*q, texts[i]);
        for (size_t t = 0; t < got.size(); ++t)
          agree += got[t] == ref_top1[i][t], decode_agree += got_decode[t] == ref_decode_top1[i][t], ++total;
      }
      const auto [head, mtp] = measure(*q);
      fmt::print(
          "| {}-bit g64{}, {} | {:.1f} MiB | {:.2f}% | {:.2f}% | {:.1f}% | {:.1f}% |\n", bits,
          embed_bits ? fmt::format(", embeddings {}-bit", embed_bits) : std::string(),
          method == QuantMethod::kMlx ? std::string("MLX's rule")
          : calibration == "none"
              ? std::string("least squares")
              : fmt::format("least squares, calibration {}", fs::path(calibration).filename().string()),
          report["bytes"].get<double>() / (1 << 20),
          100.0 * static_cast<double>(agree) / static_cast<double>(total),
          100.0 * static_cast<double>(decode_agree) / static_cast<double>(total), 100 * head, 100 * mtp);
    }
  fs::remove_all(tmp);
  return 0;
}
