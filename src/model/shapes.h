// The published Qwen3.5 shapes (spec §9), for synthetic models at real scale.
#pragma once

#include <string>
#include <vector>

#include "io/model_config.h"

namespace mtpx {

// "0.8B", "2B", "4B", "9B", "27B", the mixture-of-experts "35B-A3B", "122B-A10B", "397B-A17B", or the
// smoke-test shapes "tiny" and "tiny-moe". layers > 0: only the first `layers` layers (a reduced-depth
// model that fits a smaller machine). Throws kInvalidInput otherwise.
ModelConfig shape_config(const std::string& shape, int64_t layers = 0);
std::vector<std::string> shape_names();

}  // namespace mtpx
