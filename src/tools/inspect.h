// `mtpx inspect`: what a model directory holds and whether this machine can run it, from the headers
// alone (no weight is read unless check_values is set): architecture and shape, parameters and bytes per
// component, storage (dtype or quantization) per component, tokenizer and generation defaults, the runtime
// profile, the memory needed for a context, and the MTP head's status.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace mtpx::tools {

struct InspectOptions {
  int64_t context = 4096;     // tokens of context the memory estimate is for
  int64_t draft = 4;          // MTP draft depth the estimate allows for
  bool check_values = false;  // read every weight and report the tensors holding NaN or Inf
};

// The report as JSON (the --json output; the text output is rendered from it). A directory that is not
// a readable model (config.json, safetensors headers or the index malformed, a trunk tensor missing or
// misshapen) throws mtpx::Error, as loading it would. What a well-formed model lacks (an MTP head, a
// tokenizer, enough memory here, finite weights) is reported, with can_run and its reason.
nlohmann::json inspect_model(const std::filesystem::path& dir, const InspectOptions& options);

// The human-readable rendering of inspect_model's report.
std::string render_inspect_report(const nlohmann::json& report);

// Memory available to a new process on this machine (MemAvailable), bytes; 0 if unknown.
int64_t available_memory_bytes();

}  // namespace mtpx::tools
