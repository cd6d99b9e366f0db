// libFuzzer target: safetensors files. Each input is tried twice:
//   1. as a whole file (8-byte header length, JSON header, data section) through parse_safetensors;
//   2. as the JSON header alone, framed with its true length and followed by a 4 KiB data section, so that
//      mutations of the header are not all stopped by a wrong length field.
// Every tensor a successful parse returns is read at its first and last byte: ASan reports a view that
// points outside the input.
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_util.h"
#include "io/safetensors.h"
#include "util/error.h"

namespace {

volatile uint8_t sink;

void parse_and_touch(std::span<const std::byte> file) {
  try {
    const mtpx::SafetensorsTable table = mtpx::parse_safetensors(file, "fuzz.safetensors");
    for (const auto& [name, view] : table.tensors) {
      if (view.nbytes == 0) continue;
      sink = static_cast<uint8_t>(view.data[0]) ^ static_cast<uint8_t>(view.data[view.nbytes - 1]);
    }
  } catch (const mtpx::Error&) {
    // Rejected with a message: what a malformed file must do.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  parse_and_touch({reinterpret_cast<const std::byte*>(data), size});

  constexpr size_t kDataSection = 4096;
  std::vector<std::byte> framed(8 + size + kDataSection, std::byte{0x5a});
  for (int i = 0; i < 8; ++i)
    framed[static_cast<size_t>(i)] = static_cast<std::byte>(uint64_t{size} >> (8 * i));
  if (size > 0) std::memcpy(framed.data() + 8, data, size);
  parse_and_touch(framed);
  return 0;
}
