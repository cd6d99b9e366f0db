#include "server/text_stream.h"

#include <algorithm>

namespace mtpx::server {

size_t partial_stop_suffix(const std::string& text, const std::vector<std::string>& stop_strings) {
  size_t longest = 0;
  for (const std::string& stop : stop_strings) {
    for (size_t n = std::min(stop.size() - 1, text.size()); n > longest; --n) {
      if (text.compare(text.size() - n, n, stop, 0, n) == 0) {
        longest = n;
        break;
      }
    }
  }
  return longest;
}

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                       std::vector<int32_t> stop_ids)
    : decoder_(tokenizer), stop_ids_(std::move(stop_ids)) {
  for (std::string& s : stop_strings)
    if (!s.empty()) stop_strings_.push_back(std::move(s));
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return {};
  if (std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end()) return {};
  held_ += decoder_.push(id);
  return release(/*final=*/false);
}

std::string TextStream::finish() {
  if (stopped_) return {};
  held_ += decoder_.flush();
  return release(/*final=*/true);
}

std::string TextStream::release(bool final) {
  // The earliest stop string wins; held_ never contained one before, so only new text can start one.
  size_t cut = std::string::npos;
  for (const std::string& stop : stop_strings_) cut = std::min(cut, held_.find(stop));
  std::string out;
  if (cut != std::string::npos) {
    out = held_.substr(0, cut);
    held_.clear();
    stopped_ = true;
    return out;
  }
  // Stop strings and held_ are whole UTF-8 characters, so a matching suffix starts on a character boundary.
  const size_t keep = final ? 0 : partial_stop_suffix(held_, stop_strings_);
  out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

}  // namespace mtpx::server
