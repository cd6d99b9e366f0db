// libFuzzer target: encoding and decoding arbitrary bytes with the shipped model's tokenizer
// (models/default/tokenizer.json: NFC, a Split regex, byte-level BPE, special tokens).
//   - as text: valid UTF-8 must encode, and decode back to its NFC form; anything else must be refused
//     with mtpx::Error;
//   - as token ids (little-endian int32): decode, and stream-decode id by id; ids outside the vocabulary
//     must be refused with mtpx::Error.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace {

const mtpx::Tokenizer& tokenizer() {
  static const mtpx::Tokenizer t = mtpx::Tokenizer::from_json(
      mtpx::fuzz::read_source_file("models/default/tokenizer.json"), "models/default/tokenizer.json");
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const mtpx::Tokenizer& t = tokenizer();
  const std::string_view text = mtpx::fuzz::as_text(data, size);

  const bool valid = mtpx::tokenizer_internal::find_invalid_utf8(text) == text.size();
  try {
    const std::vector<int32_t> ids = t.encode(text);
    if (!valid) std::abort();  // ill-formed UTF-8 must be refused
    if (t.decode(ids) != mtpx::tokenizer_internal::nfc(text)) std::abort();
  } catch (const mtpx::Error&) {
    if (valid) std::abort();  // well-formed text must encode
  }

  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  try {
    (void)t.decode(ids);
  } catch (const mtpx::Error&) {
  }
  mtpx::StreamDecoder stream(t);
  try {
    for (int32_t id : ids) (void)stream.push(id);
  } catch (const mtpx::Error&) {
  }
  (void)stream.flush();
  return 0;
}
