#include "cli/common.h"

#include <fmt/core.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>

#include "model/device.h"
#include "tools/inspect.h"
#include "util/error.h"

namespace mtpx::cli {

std::filesystem::path resolve_model_dir(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  if (const char* env = std::getenv("MTPX_MODEL"); env != nullptr && *env != '\0') return env;
  // Beside the installed binary (<prefix>/bin/mtpx -> <prefix>/share/mtpx/models/default), then the
  // source tree this binary was built from.
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    auto installed = exe.parent_path().parent_path() / "share" / "mtpx" / "models" / "default";
    if (std::filesystem::is_directory(installed)) return installed;
  }
  return MTPX_DEFAULT_MODEL_DIR;
}

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i <= text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string item = text.substr(i, j - i);
    auto b = item.find_first_not_of(" \t");
    auto e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    if (item.empty()) invalid_input("{}: empty entry in id list '{}'", flag, text);
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || v < 0 || v > INT32_MAX)
      invalid_input("{}: '{}' is not a token id (a non-negative integer)", flag, item);
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  return ids;
}

std::optional<Tokenizer> load_tokenizer_if_present(const std::filesystem::path& model_dir) {
  auto path = model_dir / "tokenizer.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  return Tokenizer::from_file(path);
}

std::vector<int32_t> resolve_prompt(const std::string& prompt_text, const std::string& prompt_ids,
                                    const std::optional<Tokenizer>& tokenizer,
                                    const std::filesystem::path& model_dir, int64_t vocab_size) {
  if (prompt_text.empty() == prompt_ids.empty())
    invalid_input("give exactly one of --prompt and --prompt-ids");
  std::vector<int32_t> prompt;
  if (!prompt_ids.empty()) {
    prompt = parse_id_list(prompt_ids, "--prompt-ids");
  } else {
    if (!tokenizer)
      invalid_input("--prompt needs a tokenizer, but '{}' has no tokenizer.json (use --prompt-ids)",
                    model_dir.string());
    prompt = tokenizer->encode(prompt_text);
    if (prompt.empty()) invalid_input("--prompt encodes to no tokens");
  }
  for (int32_t id : prompt)
    if (id >= vocab_size)
      invalid_input("--prompt-ids: token id {} is outside the model's vocabulary [0, {})", id, vocab_size);
  return prompt;
}

int64_t peak_rss_bytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

std::unique_ptr<Model> load_model_on(const std::filesystem::path& dir, const std::string& device) {
  auto model = Model::load(dir);
  model->use_device(device);
  return model;
}

std::string paging_note(const Model& model) {
  const int64_t available = tools::available_memory_bytes();
  const int64_t bytes = model.mapped_bytes();
  if (model.executor() != nullptr || available <= 0 || bytes <= available) return "";
  const double gib = 1 << 30;
  if (model.config().is_moe())
    return fmt::format(
        "the weights ({:.1f} GiB) exceed the available memory ({:.1f} GiB): running from the mapped files, "
        "routed experts read from disk the first time tokens route to them",
        static_cast<double>(bytes) / gib, static_cast<double>(available) / gib);
  return fmt::format(
      "the weights ({:.1f} GiB) exceed the available memory ({:.1f} GiB): every token reads them from disk",
      static_cast<double>(bytes) / gib, static_cast<double>(available) / gib);
}

void set_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

nlohmann::json device_memory_json(const Model& model) {
  const DeviceExecutor* e = model.executor();
  if (e == nullptr) return nlohmann::json::object();
  return {{"gpu_weight_bytes", e->weight_bytes()}, {"gpu_peak_bytes", e->peak_device_bytes()}};
}

std::string device_memory_text(const Model& model) {
  const DeviceExecutor* e = model.executor();
  if (e == nullptr) return "";
  return fmt::format(" | GPU: weights {:.0f} MiB, peak in use {:.0f} MiB",
                     static_cast<double>(e->weight_bytes()) / (1 << 20),
                     static_cast<double>(e->peak_device_bytes()) / (1 << 20));
}

}  // namespace mtpx::cli
