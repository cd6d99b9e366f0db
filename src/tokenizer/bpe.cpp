#include "tokenizer/bpe.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "tokenizer/utf8.h"
#include "util/error.h"

namespace mtpx::tokenizer_internal {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::string byte_level_string(std::string_view bytes) {
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += alphabet.byte_to_utf8[static_cast<uint8_t>(c)];
  return out;
}

}  // namespace

BpeModel::BpeModel(std::unordered_map<std::string, int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, Options options)
    : vocab_(std::move(vocab)), options_(options) {
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& left = merges[rank].first;  // not a structured binding: clang 14 cannot capture one
    const std::string& right = merges[rank].second;
    const auto find = [&](const std::string& piece) {
      auto it = vocab_.find(piece);
      if (it == vocab_.end()) {
        throw std::invalid_argument(fmt::format(
            "merge {} (\"{}\", \"{}\") uses \"{}\", which is not in model.vocab", rank, left, right, piece));
      }
      return it->second;
    };
    const int32_t left_id = find(left);
    const int32_t right_id = find(right);
    const int32_t new_id = find(left + right);
    // Like the reference implementation (a HashMap collected in order), a repeated pair takes the rank
    // of its last occurrence.
    merges_[pair_key(left_id, right_id)] = MergeValue{static_cast<uint32_t>(rank), new_id};
  }
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(alphabet.byte_to_utf8[b]);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    auto it = vocab_.find(byte_level_string(word));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() == 1 && byte_ids_[static_cast<uint8_t>(word[0])] >= 0) {
    out.push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) {
      cache_.emplace(std::string(word),
                     std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(first), out.end()));
    }
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool removed;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&](int32_t id) {
    const auto index = static_cast<int32_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = index;
    symbols.push_back(Symbol{id, index - 1, -1, false});
  };

  // Initial symbols: one per byte (one per character of the byte-level string), unknown bytes become the
  // unk token (consecutive ones fused into one if fuse_unk).
  bool pending_unk = false;
  for (char c : word) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id >= 0) {
      if (pending_unk) add(*options_.unk_id);
      pending_unk = false;
      add(id);
      continue;
    }
    if (!options_.unk_id) {
      invalid_input(
          "the text contains byte 0x{:02X}, which has no token in the vocabulary (and there is no unk token)",
          static_cast<uint8_t>(c));
    }
    if (pending_unk && !options_.fuse_unk) add(*options_.unk_id);
    pending_unk = true;
  }
  if (pending_unk) add(*options_.unk_id);

  // Merges in order of rank, then position (a min-heap of candidate pairs; stale entries are skipped).
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::vector<Candidate> heap;
  heap.reserve(symbols.size());
  const auto push = [&](int32_t pos, int32_t left, int32_t right) {
    auto it = merges_.find(pair_key(left, right));
    if (it == merges_.end()) return;
    heap.push_back(Candidate{it->second.rank, pos, it->second.new_id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    push(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);
  }
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& current = symbols[static_cast<size_t>(top.pos)];
    if (current.removed || current.next < 0) continue;
    const int32_t next_pos = current.next;
    const Symbol right = symbols[static_cast<size_t>(next_pos)];
    auto it = merges_.find(pair_key(current.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale entry

    current.id = top.new_id;
    current.next = right.next;
    symbols[static_cast<size_t>(next_pos)].removed = true;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (current.prev >= 0) push(current.prev, symbols[static_cast<size_t>(current.prev)].id, current.id);
    if (current.next >= 0) push(top.pos, current.id, symbols[static_cast<size_t>(current.next)].id);
  }
  for (const Symbol& s : symbols) {
    if (!s.removed) out.push_back(s.id);
  }
}

}  // namespace mtpx::tokenizer_internal
