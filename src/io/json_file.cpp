#include "io/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

#include "util/error.h"

namespace mtpx {
namespace {

using nlohmann::json;

// A first, DOM-less pass over the text (nlohmann's SAX interface) that finds what json::parse accepts
// but mtpx refuses. nlohmann's own callback parser could do this while building the DOM, but it rescans
// the parent object after every nested one: quadratic, minutes for a header of 50,000 tensors.
class StructureCheck : public nlohmann::json_sax<json> {
 public:
  std::string problem;  // set when the text is refused

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    objects_.emplace_back();
    return enter();
  }
  bool key(string_t& key) override {
    if (objects_.back().insert(key).second) return true;
    problem = fmt::format("duplicate key '{}' in the JSON", printable(key));
    return false;
  }
  bool end_object() override {
    objects_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    problem = fmt::format("not valid JSON ({})", printable(e.what()));
    return false;
  }

 private:
  bool enter() {
    if (++depth_ <= kMaxJsonDepth) return true;
    problem = fmt::format("JSON nested deeper than {} levels", kMaxJsonDepth);
    return false;
  }

  int depth_ = 0;
  std::vector<std::unordered_set<std::string>> objects_;  // keys seen in each open object, innermost last
};

}  // namespace

std::string printable(std::string_view text) {
  constexpr size_t kMaxBytes = 512;
  std::string out;
  const bool cut = text.size() > kMaxBytes;
  if (cut) text = text.substr(0, kMaxBytes);
  out.reserve(text.size() + 3);
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  if (cut) out += "...";
  return out;
}

std::string read_small_file(const std::filesystem::path& path, size_t max_bytes) {
  const std::string name = printable(path.native());
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    fail(err == ENOENT ? ErrorKind::kNotFound : ErrorKind::kInvalidInput, "cannot open '{}': {}", name,
         std::strerror(err));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) invalid_input("cannot stat '{}': {}", name, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) invalid_input("cannot read '{}': not a regular file", name);
  if (static_cast<uint64_t>(st.st_size) > max_bytes)
    invalid_input("'{}' is {} bytes, larger than the {} bytes a file of this kind may have", name, st.st_size,
                  max_bytes);
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) invalid_input("cannot read '{}': {}", name, std::strerror(errno));
    if (n == 0) break;  // shrank while reading: parse what is there
    done += static_cast<size_t>(n);
  }
  text.resize(done);
  return text;
}

json parse_json_strict(std::string_view text, const std::string& describe) {
  StructureCheck check;
  if (!json::sax_parse(text.begin(), text.end(), &check)) invalid_input("{}: {}", describe, check.problem);
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {  // not expected: the check parsed the same text
    invalid_input("{}: not valid JSON ({})", describe, printable(e.what()));
  }
}

json parse_json_text(std::string_view text, const std::string& source) {
  return parse_json_strict(text, fmt::format("'{}'", printable(source)));
}

json read_json_file(const std::filesystem::path& path) {
  return parse_json_text(read_small_file(path, kMaxConfigFileBytes), path.native());
}

}  // namespace mtpx
