// `mtpx quantize` and `mtpx graft` killed (SIGKILL) in the middle of writing their output: the inputs
// must be untouched, no output directory may appear (or, when replacing one, the old one must stay whole),
// and a rerun must succeed and clean up what the killed run left (tools::AtomicDirectory).
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.h"
#include "model/shapes.h"
#include "tools/checkpoint.h"

extern char** environ;

namespace fs = std::filesystem;

namespace mtpx {
namespace {

using testing_util::run;
using testing_util::TempDir;

// A checkpoint big enough that quantizing it takes a while (~40 M parameters, ~80 MB in bf16), with
// random weights; tied embeddings, no tokenizer.
void write_model(const fs::path& dir, bool with_mtp) {
  ModelConfig c = shape_config("tiny");
  c.vocab_size = 32768;
  c.hidden_size = 512;
  c.intermediate_size = 1536;
  c.num_layers = 8;
  c.layer_types.clear();
  for (int64_t i = 0; i < c.num_layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention);
  c.mtp_num_hidden_layers = with_mtp ? 1 : 0;
  c.max_position_embeddings = 4096;
  tools::WriteOptions options;
  options.seed = 11;
  tools::AtomicDirectory out(dir, false);
  tools::write_checkpoint_tensors(out.path(), tools::checkpoint_manifest(c, with_mtp), options);
  tools::write_json_file(out.path() / "config.json", tools::config_json(c, options));
  out.commit();
}

// FNV-1a over every file of a directory (names, then bytes, in name order).
uint64_t hash_directory(const fs::path& dir) {
  std::map<std::string, fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files[e.path().filename().string()] = e.path();
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const char* data, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ull;
  };
  std::vector<char> buffer(1 << 20);
  for (const auto& [name, path] : files) {
    mix(name.data(), name.size());
    std::ifstream in(path, std::ios::binary);
    while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0)
      mix(buffer.data(), static_cast<size_t>(in.gcount()));
  }
  return h;
}

// Entries of `parent` whose name starts with `prefix`.
std::vector<std::string> entries_starting_with(const fs::path& parent, const std::string& prefix) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(parent))
    if (e.path().filename().string().rfind(prefix, 0) == 0) found.push_back(e.path().filename().string());
  return found;
}

// Starts `mtpx args...` (output discarded), waits until its staging directory for `out` holds an entry
// for which `started_writing` is true, kills it with SIGKILL and reaps it. Returns the staging directory
// it left. Fails the test when the run ends before that (the model is too small to catch it writing).
fs::path kill_while_writing(const std::vector<std::string>& args, const fs::path& out,
                            const std::function<bool(const std::string&)>& started_writing) {
  std::vector<std::string> argv_storage = {MTPX_BINARY};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, MTPX_BINARY, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(spawned, 0);
  const fs::path staging = out.parent_path() / fmt::format(".{}.tmp-{}", out.filename().string(), pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool caught = false;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(staging, ec))
      if (started_writing(e.path().filename().string())) caught = true;
    if (caught || waitpid(pid, &status, WNOHANG) == pid) break;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  if (caught) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  EXPECT_TRUE(caught) << "the run ended (status " << status << ") before it could be killed while writing";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  return staging;
}

// A model directory that loads and generates.
void expect_loads(const fs::path& dir) {
  const auto r = run("generate --model " + dir.string() + " --prompt-ids 1,2,3 --max-tokens 2 --json");
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST(InterruptedWrites, QuantizeKilledMidWriteLeavesNoOutputAndARerunSucceeds) {
  TempDir dir;
  const fs::path input = dir.path() / "input", out = dir.path() / "q4";
  write_model(input, true);
  const uint64_t input_hash = hash_directory(input);
  const std::vector<std::string> quantize = {"quantize", "--model", input.string(), "--out", out.string(),
                                             "--bits",   "4"};

  // Killed once a tensor file is being written into the staging directory.
  const fs::path staging = kill_while_writing(
      quantize, out, [](const std::string& name) { return name.find("safetensors") != std::string::npos; });
  EXPECT_EQ(hash_directory(input), input_hash);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(fs::exists(staging)) << "the killed run left no staging directory: it was not writing";
  EXPECT_EQ(run("generate --model " + out.string() + " --prompt-ids 1 --max-tokens 1").code, 2);

  // A rerun writes the output and removes what the killed run left.
  const auto rerun = run("quantize --model " + input.string() + " --out " + out.string() + " --bits 4");
  ASSERT_EQ(rerun.code, 0) << rerun.err;
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_TRUE(entries_starting_with(dir.path(), ".q4.tmp-").empty());
  EXPECT_EQ(hash_directory(input), input_hash);
  expect_loads(out);

  // Replacing an existing output (--force) and killed: the old output stays whole.
  const uint64_t out_hash = hash_directory(out);
  std::vector<std::string> replace = quantize;
  replace.push_back("--force");
  kill_while_writing(replace, out,
                     [](const std::string& name) { return name.find("safetensors") != std::string::npos; });
  EXPECT_EQ(hash_directory(out), out_hash);
  EXPECT_EQ(hash_directory(input), input_hash);
  expect_loads(out);

  // Killed between the two renames of a replacing commit (made by hand: that window is too short to hit):
  // the old output was moved aside, the new one not yet moved in. The next run puts the old one back.
  fs::rename(out, dir.path() / ".q4.tmp-999999999.old");
  const auto after = run("quantize --model " + input.string() + " --out " + out.string() + " --bits 4");
  EXPECT_EQ(after.code, 2);  // restored, so the target exists again: --force is needed to replace it
  EXPECT_NE(after.err.find("restored"), std::string::npos) << after.err;
  EXPECT_NE(after.err.find("already exists"), std::string::npos) << after.err;
  EXPECT_EQ(hash_directory(out), out_hash);
  EXPECT_TRUE(entries_starting_with(dir.path(), ".q4.tmp-").empty());
}

TEST(InterruptedWrites, GraftKilledMidWriteLeavesNoOutputAndARerunSucceeds) {
  TempDir dir;
  const fs::path trunk = dir.path() / "trunk", donor = dir.path() / "donor", out = dir.path() / "grafted";
  write_model(trunk, false);
  write_model(donor, true);
  const uint64_t trunk_hash = hash_directory(trunk), donor_hash = hash_directory(donor);
  // Random weights: the head's acceptance is ~0, so --force keeps it (the point here is the writing).
  const std::vector<std::string> graft = {"graft",        "--trunk", trunk.string(), "--donor",
                                          donor.string(), "--out",   out.string(),   "--force"};

  // Killed once the head's sidecar is being written (the trunk's files are already linked in).
  const fs::path staging = kill_while_writing(
      graft, out, [](const std::string& name) { return name.rfind("mtp.safetensors", 0) == 0; });
  EXPECT_EQ(hash_directory(trunk), trunk_hash);
  EXPECT_EQ(hash_directory(donor), donor_hash);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(fs::exists(staging));
  EXPECT_EQ(run("generate --model " + out.string() + " --prompt-ids 1 --max-tokens 1").code, 2);

  std::string command;
  for (const std::string& a : graft) command += a + " ";
  const auto rerun = run(command);
  ASSERT_EQ(rerun.code, 0) << rerun.err;
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_TRUE(entries_starting_with(dir.path(), ".grafted.tmp-").empty());
  EXPECT_EQ(hash_directory(trunk), trunk_hash);  // the output hard-links the trunk's files: still the same
  EXPECT_EQ(hash_directory(donor), donor_hash);
  expect_loads(out);
}

}  // namespace
}  // namespace mtpx
