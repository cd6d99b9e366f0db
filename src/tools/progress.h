// A one-line progress bar on stderr, drawn only when stderr is a terminal (logs and pipes stay clean).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace mtpx::tools {

class ProgressBar {
 public:
  explicit ProgressBar(std::string label)
      : label_(std::move(label)), enabled_(::isatty(STDERR_FILENO) == 1) {}
  ~ProgressBar() { finish(); }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // fraction in [0, 1]; redraws at most 10 times a second.
  void update(double fraction) {
    if (!enabled_ || finished_) return;
    const auto now = std::chrono::steady_clock::now();
    if (drawn_ && now - last_ < std::chrono::milliseconds(100) && fraction < 1.0) return;
    last_ = now;
    drawn_ = true;
    const int width = 30;
    const int filled = static_cast<int>(fraction * width + 0.5);
    std::fprintf(stderr, "\r%s [%s%s] %3d%%", label_.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(),
                 static_cast<int>(fraction * 100 + 0.5));
    std::fflush(stderr);
  }

  void finish() {
    if (enabled_ && drawn_ && !finished_) std::fputc('\n', stderr);
    finished_ = true;
  }

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  bool finished_ = false;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace mtpx::tools
