// Generated ids -> the text a client may see, piece by piece: whole UTF-8 characters only, stop ids never
// shown, and the text cut before the first stop string (which is never sent). A tail that could still
// grow into a stop string is held back until the next tokens decide it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace mtpx::server {

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
             std::vector<int32_t> stop_ids);

  // The text that is now safe to send (possibly empty). Nothing once a stop string has matched.
  std::string push(int32_t id);
  // At the end of generation: whatever was held back (a partial character becomes U+FFFD).
  std::string finish();
  // True once a stop string matched: generation should end, nothing more will be sent.
  bool stopped() const { return stopped_; }

 private:
  // Moves the sendable part of held_ to the result, cutting at a stop string.
  std::string release(bool final);

  StreamDecoder decoder_;
  std::vector<std::string> stop_strings_;
  std::vector<int32_t> stop_ids_;
  std::string held_;  // decoded text not sent yet: a possible beginning of a stop string
  bool stopped_ = false;
};

// The length of the longest suffix of `text` that is a proper prefix of one of `stop_strings`.
size_t partial_stop_suffix(const std::string& text, const std::vector<std::string>& stop_strings);

}  // namespace mtpx::server
