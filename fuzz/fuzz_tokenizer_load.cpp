// libFuzzer target: tokenizer.json text through Tokenizer::from_json. A tokenizer that loads then encodes
// a fixed sentence and the input itself (when it is valid UTF-8), and decodes what it encoded: loading
// must reject, with mtpx::Error, anything that would make encoding or decoding fail otherwise.
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = mtpx::fuzz::as_text(data, size);
  try {
    const mtpx::Tokenizer tokenizer = mtpx::Tokenizer::from_json(text, "tokenizer.json");
    for (std::string_view sample :
         {std::string_view("Hello, world! def f(x):\n  return x  # ünïcødé 你好"), text.substr(0, 512)}) {
      if (mtpx::tokenizer_internal::find_invalid_utf8(sample) != sample.size()) continue;
      const std::vector<int32_t> ids = tokenizer.encode(sample);
      (void)tokenizer.decode(ids);
      for (int32_t id : ids) (void)tokenizer.token_piece(id);
    }
    (void)tokenizer.vocab_size();
  } catch (const mtpx::Error&) {
  }
  return 0;
}
