// The one error type of mtpx. Library code throws it; front ends (CLI, server)
// catch it at the edge and map its kind to an exit code or an HTTP status in
// one place (cli/main.cpp, server/).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mtpx {

enum class ErrorKind {
  kInvalidInput,  // bad file, flag, id or request body: the user's to fix (exit 2, HTTP 400)
  kNotFound,      // a named file/model/tensor does not exist (exit 2, HTTP 404)
  kUnsupported,   // valid input that mtpx does not handle (exit 2, HTTP 400)
  kInternal,      // a bug or an environment failure (exit 1, HTTP 500)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// Exit code of the command-line program for an error kind.
inline int exit_code_for(ErrorKind kind) { return kind == ErrorKind::kInternal ? 1 : 2; }

// HTTP status for an error kind.
inline int http_status_for(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidInput:
    case ErrorKind::kUnsupported:
      return 400;
    case ErrorKind::kNotFound:
      return 404;
    case ErrorKind::kInternal:
      return 500;
  }
  return 500;
}

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(kind, fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void invalid_input(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(ErrorKind::kInvalidInput, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace mtpx
