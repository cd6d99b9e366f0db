// The built-in prompt suite of `mtpx bench` and `mtpx tune`: short code and prose openings (the
// shipped model is a code model; real models handle both). Models without a tokenizer get fixed id
// sequences instead.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace mtpx::tools {

inline const std::vector<std::string>& builtin_prompts() {
  static const std::vector<std::string> prompts = {
      "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
      "import os\nimport sys\n\n\ndef main(argv):\n",
      "class Stack:\n    def __init__(self):\n",
      "def parse_args():\n    parser = argparse.ArgumentParser(description=",
  };
  return prompts;
}

// The suite as token ids: encoded with `tokenizer`, or (no tokenizer) deterministic id sequences of
// 16-24 ids below `vocab_size`.
inline std::vector<std::vector<int32_t>> builtin_prompt_ids(const std::optional<Tokenizer>& tokenizer,
                                                            int64_t vocab_size, size_t count) {
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < count; ++i) {
    if (tokenizer) {
      out.push_back(tokenizer->encode(builtin_prompts()[i % builtin_prompts().size()]));
    } else {
      std::vector<int32_t> ids;
      for (size_t t = 0; t < 16 + 2 * i; ++t)
        ids.push_back(
            static_cast<int32_t>((1000 + 7919 * (i + 1) * (t + 3)) % static_cast<size_t>(vocab_size)));
      out.push_back(ids);
    }
  }
  return out;
}

}  // namespace mtpx::tools
