// Running the `mtpx` program from tests: capture stdout/stderr/exit code, check one-line usage errors,
// and temporary directories.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace mtpx::testing_util {

namespace fs = std::filesystem;

struct CommandResult {
  int code = -1;
  std::string out;
  std::string err;
};

// Runs mtpx with `args` (shell-quoted by the caller), capturing stdout and stderr.
inline CommandResult run(const std::string& args) {
  static int counter = 0;
  const fs::path err_file = fs::temp_directory_path() /
                            ("mtpx_cli_err_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
  const std::string cmd = std::string(MTPX_BINARY) + " " + args + " 2>" + err_file.string();
  CommandResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) r.out.append(buffer.data(), n);
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  fs::remove(err_file);
  return r;
}

// A bad-input run: exit 2, nothing on stdout, exactly one stderr line "error: ..." containing `needle`.
inline void expect_usage_error(const std::string& args, const std::string& needle) {
  SCOPED_TRACE(args);
  CommandResult r = run(args);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
}

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("mtpx_cli_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace mtpx::testing_util
