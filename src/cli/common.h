// Helpers shared by the command-line front ends: model-directory resolution, id-list parsing, RSS.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "model/qwen35.h"
#include "tokenizer/tokenizer.h"

namespace mtpx::cli {

// --model if given; else $MTPX_MODEL; else the shipped model (models/default next to the binary's
// source tree, or beside the installed binary).
std::filesystem::path resolve_model_dir(const std::string& flag_value);

// "1, 2,3" -> {1,2,3}; errors name `flag`.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& flag);

// The tokenizer of a model directory, if it has one (errors if tokenizer.json exists but is bad).
std::optional<Tokenizer> load_tokenizer_if_present(const std::filesystem::path& model_dir);

// The prompt of a command: exactly one of --prompt (text, needs the tokenizer) and --prompt-ids; every
// id must be inside the model's vocabulary. Errors name the flag.
std::vector<int32_t> resolve_prompt(const std::string& prompt_text, const std::string& prompt_ids,
                                    const std::optional<Tokenizer>& tokenizer,
                                    const std::filesystem::path& model_dir, int64_t vocab_size);

// Loads a model directory and moves its forward passes to `device` ("cpu" or "cuda").
std::unique_ptr<Model> load_model_on(const std::filesystem::path& dir, const std::string& device);

// When a model on the CPU is larger than the memory available: a note saying how it runs anyway (from the
// mapped files: a mixture-of-experts model reads each token's routed experts from disk the first time they
// are used; a dense one reads all of its weights every token). "" when the weights fit (or on a GPU).
std::string paging_note(const Model& model);

// Peak resident set size of this process in bytes.
int64_t peak_rss_bytes();

// A model on a GPU: the device memory its weights take and the most seen in use (DeviceExecutor), as JSON
// fields ({} on the CPU) and as a summary fragment (" | GPU: weights 17 MiB, peak in use 612 MiB"; "" on
// the CPU).
nlohmann::json device_memory_json(const Model& model);
std::string device_memory_text(const Model& model);

// Sets the number of worker threads (0: leave the default).
void set_threads(int threads);

}  // namespace mtpx::cli
