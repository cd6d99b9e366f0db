// The published Qwen3.5 shapes (spec §9), for synthetic models at real scale.
#pragma once

#include <string>
#include <vector>

#include "io/model_config.h"

namespace mtpx {

// "0.8B", "2B", "4B", "9B", "27B", or "tiny" (a smoke-test shape). Throws kInvalidInput otherwise.
ModelConfig shape_config(const std::string& shape);
std::vector<std::string> shape_names();

}  // namespace mtpx
