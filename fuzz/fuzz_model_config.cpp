// libFuzzer target: config.json and generation_config.json. The same text goes through both parsers,
// from text as the loaders read it (parse_json_text, then parse_model_config / parse_generation_config).
// An accepted config must have the invariants the model code relies on (layer types for every layer,
// head counts that divide, an even rotary dimension within the head).
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "io/model_config.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json root;
  try {
    root = mtpx::parse_json_text(mtpx::fuzz::as_text(data, size), "config.json");
  } catch (const mtpx::Error&) {
    return 0;
  }
  try {
    const mtpx::ModelConfig c = mtpx::parse_model_config(root, "config.json");
    if (static_cast<int64_t>(c.layer_types.size()) != c.num_layers) std::abort();
    if (c.num_kv_heads <= 0 || c.num_attention_heads % c.num_kv_heads != 0) std::abort();
    if (c.linear_num_key_heads <= 0 || c.linear_num_value_heads % c.linear_num_key_heads != 0) std::abort();
    if (c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim || c.rotary_dim < 0) std::abort();
    (void)c.conv_dim();
    (void)c.num_linear_attention_layers();
  } catch (const mtpx::Error&) {
  }
  try {
    const mtpx::GenerationConfig g = mtpx::parse_generation_config(root, "generation_config.json");
    if (!(g.temperature >= 0.0) || !(g.top_p >= 0.0 && g.top_p <= 1.0) || g.top_k < 0) std::abort();
  } catch (const mtpx::Error&) {
  }
  return 0;
}
