// mtpx logits: the float32 logits [n, V] and post-final-norm hidden states [n, H] of every prompt
// position, written to a safetensors file (for comparison with reference implementations).
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstring>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/safetensors.h"
#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct LogitsFlags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  std::string out;
  int threads = 0;
  std::string device = "cpu";
  bool mtp = false;
};

std::span<const std::byte> bytes_of(const std::vector<float>& v) {
  return {reinterpret_cast<const std::byte*>(v.data()), v.size() * sizeof(float)};
}

int run_logits(const LogitsFlags& f) {
  set_threads(f.threads);
  if (f.out.empty()) invalid_input("--out is required");
  const auto dir = resolve_model_dir(f.model);
  auto model = load_model_on(dir, f.device);
  const std::vector<int32_t> prompt =
      resolve_prompt(f.prompt, f.prompt_ids, load_tokenizer_if_present(dir), dir, model->config().vocab_size);
  InferenceState state = model->new_state(static_cast<int64_t>(prompt.size()));
  ForwardResult r;
  model->forward(state, prompt, LogitRows::kAll, r);
  const int64_t n = static_cast<int64_t>(prompt.size());
  const int64_t V = model->config().vocab_size, H = model->config().hidden_size;
  std::vector<int32_t> ids(prompt);
  std::vector<TensorToWrite> tensors = {
      {"logits", DType::kF32, {n, V}, bytes_of(r.logits)},
      {"hidden", DType::kF32, {n, H}, bytes_of(r.hidden)},
      {"prompt", DType::kI32, {n}, {reinterpret_cast<const std::byte*>(ids.data()), ids.size() * 4}},
  };
  // Teacher-forced MTP (spec §6.3): row t is the head's prediction of token t+2 from the trunk hidden at t
  // and the prompt token at t+1, at position t.
  MtpResult head;
  if (f.mtp) {
    if (model->mtp() == nullptr)
      invalid_input("--mtp: '{}' has no usable MTP head: {}", dir.string(), model->mtp_status().detail);
    if (n > 1) {
      MtpState head_state = new_mtp_state(*model, n);
      mtp_forward(
          *model, head_state, std::span<const float>(r.hidden.data(), static_cast<size_t>((n - 1) * H)),
          std::span<const int32_t>(prompt.data() + 1, static_cast<size_t>(n - 1)), 0, LogitRows::kAll, head);
    }
    tensors.push_back({"mtp_logits", DType::kF32, {n - 1, V}, bytes_of(head.logits)});
  }
  write_safetensors(f.out, tensors);
  std::string contents;
  for (const auto& t : tensors)
    contents += fmt::format("{}{} [{}]", contents.empty() ? "" : ", ", t.name, fmt::join(t.shape, ", "));
  fmt::print("wrote {}: {}\n", f.out, contents);
  return 0;
}

}  // namespace

std::function<int()> add_logits_command(CLI::App& app) {
  auto f = std::make_shared<LogitsFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--prompt", f->prompt, "prompt text");
  app.add_option("--prompt-ids", f->prompt_ids, "prompt as comma-separated token ids");
  app.add_option("--out", f->out, "output .safetensors file");
  app.add_flag("--mtp", f->mtp, "also write mtp_logits [n-1, V]: the MTP head's teacher-forced predictions");
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--device", f->device, "where the forward passes run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return [f] { return run_logits(*f); };
}

}  // namespace mtpx::cli
