// End-to-end tests of the `mtpx` program: real runs on the fixture and shipped models, and every kind
// of bad input giving a one-line `error: ...` and exit code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_util.h"
#include "io/safetensors.h"
#include "test_paths.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace mtpx {
namespace {

using testing_util::CommandResult;
using testing_util::expect_usage_error;
using testing_util::run;
using testing_util::TempDir;

using test_paths::kFixtures;
using test_paths::kSource;

// A copy of the single-file fixture whose tensors pass through `edit` (name -> keep?, may change
// dtype/shape).
fs::path edited_model(const TempDir& dir, const std::function<bool(TensorToWrite&)>& edit,
                      const fs::path& src = kFixtures / "causal_untied_single_bf16") {
  fs::copy_file(src / "config.json", dir.path() / "config.json");
  SafetensorsFile file(src / "model.safetensors");
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, t] : file.tensors()) {
    TensorToWrite w{name, t.dtype, t.shape, {t.data, t.nbytes}};
    if (edit(w)) tensors.push_back(w);
  }
  write_safetensors(dir.path() / "model.safetensors", tensors);
  return dir.path();
}

std::string ids_of(const TensorView& t) {
  std::string s;
  for (size_t i = 0; i < t.nbytes / 4; ++i) {
    int32_t v;
    std::memcpy(&v, t.data + i * 4, 4);
    if (i) s += ',';
    s += std::to_string(v);
  }
  return s;
}

TEST(Cli, GenerateJsonMatchesTheReferenceGreedyContinuation) {
  const fs::path model = kFixtures / "wrapper_sharded_tied_bf16";
  SafetensorsFile ref(model / "reference.safetensors");
  CommandResult r = run("generate --model " + model.string() + " --prompt-ids " +
                        ids_of(*ref.find("prompt_1")) + " --max-tokens 12 --temperature 0 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  const TensorView& greedy = *ref.find("greedy_1");
  std::vector<int32_t> want(greedy.nbytes / 4);
  std::memcpy(want.data(), greedy.data, greedy.nbytes);
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(j["stats"]["prompt_tokens"], 11);
  EXPECT_EQ(j["stats"]["generated_tokens"], 12);
  for (const char* key : {"prefill_tok_s", "decode_tok_s", "peak_rss_bytes"})
    EXPECT_GT(j["stats"][key].get<double>(), 0) << key;
  EXPECT_TRUE(j["text"].is_string());
}

TEST(Cli, SeededSamplingRepeatsAndSamplesDiffer) {
  const std::string base = "generate --model " + (kFixtures / "causal_f16_interval2").string() +
                           " --prompt-ids 5,6,7 --max-tokens 8 --temperature 1.5 --json";
  CommandResult a = run(base + " --seed 11"), b = run(base + " --seed 11");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(nlohmann::json::parse(a.out)["tokens"], nlohmann::json::parse(b.out)["tokens"]);
  CommandResult many = run(base + " --seed 11 --samples 6");
  ASSERT_EQ(many.code, 0) << many.err;
  auto list = nlohmann::json::parse(many.out);
  ASSERT_TRUE(list.is_array());
  ASSERT_EQ(list.size(), 6u);
  EXPECT_EQ(list[0]["tokens"], nlohmann::json::parse(a.out)["tokens"]);  // sample i uses seed + i
  std::set<std::string> distinct;
  for (const auto& s : list) distinct.insert(s["tokens"].dump());
  EXPECT_GE(distinct.size(), 3u);
}

TEST(Cli, LogitsCommandWritesReferenceLogits) {
  const fs::path model = kFixtures / "causal_untied_single_bf16";
  SafetensorsFile ref(model / "reference.safetensors");
  TempDir dir;
  const fs::path out = dir.path() / "out.safetensors";
  CommandResult r = run("logits --model " + model.string() + " --prompt-ids " +
                        ids_of(*ref.find("prompt_1")) + " --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  // It says what it wrote: the file and each tensor's shape.
  const int64_t n = ref.find("prompt_1")->numel();
  EXPECT_EQ(r.out, "wrote " + out.string() + ": logits [" + std::to_string(n) + ", " +
                       std::to_string(ref.find("logits_1")->shape[1]) + "], hidden [" + std::to_string(n) +
                       ", " + std::to_string(ref.find("hidden_1")->shape[1]) + "], prompt [" +
                       std::to_string(n) + "]\n");
  SafetensorsFile got(out);
  const TensorView& logits = *got.find("logits");
  const TensorView& want = *ref.find("logits_1");
  ASSERT_EQ(logits.shape, want.shape);
  EXPECT_EQ(got.find("hidden")->shape, ref.find("hidden_1")->shape);
  const auto* a = reinterpret_cast<const float*>(logits.data);
  const auto* b = reinterpret_cast<const float*>(want.data);
  EXPECT_LT(testing_util::relative_error(a, b, logits.numel()), 1e-3);
}

TEST(Cli, LogitsMtpWritesTeacherForcedHeadLogits) {
  const fs::path model = kFixtures / "wrapper_sharded_tied_bf16";
  SafetensorsFile ref(model / "reference.safetensors");
  TempDir dir;
  const fs::path out = dir.path() / "out.safetensors";
  CommandResult r = run("logits --mtp --model " + model.string() + " --prompt-ids " +
                        ids_of(*ref.find("prompt_1")) + " --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  SafetensorsFile got(out);
  const TensorView& logits = *got.find("mtp_logits");
  const TensorView& want = *ref.find("mtp_logits_1");
  ASSERT_EQ(logits.shape, want.shape);
  const auto* a = reinterpret_cast<const float*>(logits.data);
  const auto* b = reinterpret_cast<const float*>(want.data);
  EXPECT_LT(testing_util::relative_error(a, b, logits.numel()), 1e-3);
}

TEST(Cli, MtpGenerateReportsStatsAndMatchesPlainGreedy) {
  const std::string base = "generate --model " + (kFixtures / "wrapper_sharded_tied_bf16").string() +
                           " --prompt-ids 5,6,7,8 --max-tokens 20 --temperature 0 --json";
  CommandResult plain = run(base), mtp = run(base + " --mtp --draft 3");
  ASSERT_EQ(mtp.code, 0) << mtp.err;
  auto a = nlohmann::json::parse(plain.out), b = nlohmann::json::parse(mtp.out);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_FALSE(a["stats"].contains("mtp"));
  const auto& m = b["stats"]["mtp"];
  EXPECT_EQ(m["draft"], 3);
  EXPECT_EQ(m["acceptance_by_position"].size(), 3u);
  for (const char* key : {"steps", "drafted", "accepted", "acceptance", "mean_accepted_per_step"})
    EXPECT_TRUE(m.contains(key)) << key;
  EXPECT_GT(m["steps"].get<int>(), 0);
  CommandResult console = run("generate --model " + (kFixtures / "wrapper_sharded_tied_bf16").string() +
                              " --prompt-ids 5,6 --max-tokens 8 --mtp");
  ASSERT_EQ(console.code, 0) << console.err;
  EXPECT_NE(console.err.find("acceptance"), std::string::npos) << console.err;  // the one-line summary
}

TEST(Cli, ShippedModelStreamsTextAndTokenizes) {
  CommandResult r = run("generate --prompt 'def fibonacci(n):' --max-tokens 16 --seed 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  EXPECT_NE(r.err.find("decode"), std::string::npos) << r.err;  // the speed summary
  // Regression: text cut inside a UTF-8 character must not break --json (U+FFFD instead).
  for (int max_tokens = 1; max_tokens <= 40; max_tokens += 13) {
    CommandResult j =
        run("generate --prompt-ids 1,2,3 --temperature 0 --json --max-tokens " + std::to_string(max_tokens));
    ASSERT_EQ(j.code, 0) << j.err;
    EXPECT_TRUE(nlohmann::json::parse(j.out)["text"].is_string());
  }
  CommandResult t = run("tokenize --text 'hello world' --json");
  ASSERT_EQ(t.code, 0) << t.err;
  auto j = nlohmann::json::parse(t.out);
  EXPECT_FALSE(j["ids"].empty());
  EXPECT_EQ(j["ids"].size(), j["pieces"].size());
}

TEST(Cli, BadFlagsAreOneLineErrors) {
  const std::string m = " --model " + (kFixtures / "causal_untied_single_bf16").string();
  expect_usage_error("generate" + m + " --prompt-ids 1 --max-tokens -5", "--max-tokens");
  expect_usage_error("generate" + m + " --prompt-ids 1 --temperature abc", "--temperature");
  expect_usage_error("generate" + m + " --prompt-ids 1 --top-p 2", "--top-p");
  expect_usage_error("generate" + m + " --prompt-ids 1 --bogus", "bogus");
  expect_usage_error("generate" + m + " --prompt-ids 1,x,3", "--prompt-ids");
  expect_usage_error("generate" + m + " --prompt-ids 1,999999", "999999");
  expect_usage_error("generate" + m + " --prompt-ids 1 --prompt hi", "exactly one");
  expect_usage_error("generate" + m + " --prompt hi", "tokenizer");
  expect_usage_error("frobnicate", "frobnicate");
  expect_usage_error("logits" + m + " --prompt-ids 1", "--out");
  expect_usage_error("generate" + m + " --prompt-ids 1 --mtp", "no usable MTP head");
  expect_usage_error("logits" + m + " --prompt-ids 1,2 --mtp --out /tmp/x.safetensors", "no usable MTP head");
  const std::string h = " --model " + (kFixtures / "wrapper_sharded_tied_bf16").string();
  expect_usage_error("generate" + h + " --prompt-ids 1 --mtp --draft 0", "--draft");
  expect_usage_error("generate" + h + " --prompt-ids 1 --mtp --draft 9", "--draft");
  expect_usage_error("generate" + h + " --prompt-ids 1 --mtp --draft-vocab 0", "--draft-vocab");
  expect_usage_error("bench" + h + " --draft-vocab -5", "--draft-vocab");
}

TEST(Cli, BadModelDirectoriesAreOneLineErrors) {
  expect_usage_error("generate --model /nonexistent/model --prompt-ids 1", "/nonexistent/model");
  {
    TempDir d;
    expect_usage_error("generate --model " + d.path().string() + " --prompt-ids 1", "config.json");
  }
  {
    TempDir d;
    std::ofstream(d.path() / "config.json") << "{ not json";
    expect_usage_error("generate --model " + d.path().string() + " --prompt-ids 1", "not valid JSON");
  }
  {
    TempDir d;
    std::ofstream(d.path() / "config.json")
        << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})";
    expect_usage_error("generate --model " + d.path().string() + " --prompt-ids 1", "unknown architecture");
  }
  {
    TempDir d;
    auto dir = edited_model(d, [](TensorToWrite& t) { return t.name != "model.layers.1.linear_attn.A_log"; });
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1",
                       "model.layers.1.linear_attn.A_log");
  }
  {
    TempDir d;
    std::vector<std::byte> zeros(64 * 16 * 2);
    auto dir = edited_model(d, [&](TensorToWrite& t) {
      if (t.name == "model.norm.weight") t.shape = {32}, t.bytes = {zeros.data(), 32 * 2};
      return true;
    });
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1", "wrong shape");
  }
  {
    TempDir d;
    auto dir = edited_model(d, [](TensorToWrite& t) {
      if (t.name == "model.layers.0.mlp.up_proj.weight") t.dtype = DType::kI16;  // same bytes, integer dtype
      return true;
    });
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1", "dtype");
  }
  {
    TempDir d;
    auto dir = edited_model(d, [](TensorToWrite&) { return true; });
    // Truncate the file: the header now promises data past the end.
    fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 100);
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1", "model.safetensors");
  }
  {
    TempDir d;
    auto dir = edited_model(d, [](TensorToWrite&) { return true; });
    std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "Unigram"}})";
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1", "tokenizer.json");
  }
}

TEST(Cli, BrokenMtpHeadsAreNamed) {
  const fs::path with_head = kFixtures / "causal_mtp_untied_f32";
  {
    TempDir d;
    auto dir = edited_model(
        d, [](TensorToWrite& t) { return t.name != "mtp.fc.weight" && t.name != "mtp.norm.weight"; },
        with_head);
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1 --mtp",
                       "mtp.fc.weight, mtp.norm.weight");
    // Plain decoding still works: the head is only needed for --mtp.
    EXPECT_EQ(run("generate --model " + dir.string() + " --prompt-ids 1 --max-tokens 2").code, 0);
  }
  {
    TempDir d;
    std::vector<float> zeros(32 * 32);
    auto dir = edited_model(
        d,
        [&](TensorToWrite& t) {
          if (t.name == "mtp.fc.weight")
            t.shape = {32, 32},
            t.bytes = {reinterpret_cast<const std::byte*>(zeros.data()), zeros.size() * 4};
          return true;
        },
        with_head);
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1 --mtp", "mtp.fc.weight");
  }
  {
    TempDir d;
    auto dir = edited_model(
        d, [](TensorToWrite& t) { return t.name.rfind("mtp.", 0) != 0; }, with_head);
    expect_usage_error("generate --model " + dir.string() + " --prompt-ids 1 --mtp", "mtp_num_hidden_layers");
  }
}

}  // namespace
}  // namespace mtpx
