// End-to-end tests of the model tools (synth, inspect, bench, tune, quantize, graft) on the shipped model
// and on synthetic checkpoints, through the `mtpx` program.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "backend/cpu/matmul.h"
#include "backend/cpu/quant_matmul.h"
#include "cli_util.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/qwen35.h"
#include "tools/bench.h"
#include "tools/checkpoint.h"
#include "tools/graft.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace mtpx {
namespace {

using testing_util::expect_usage_error;
using testing_util::run;
using testing_util::TempDir;

const fs::path kShipped = fs::path(MTPX_SOURCE_DIR) / "models" / "default";

json run_json(const std::string& args) {
  const auto r = run(args);
  EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
  return r.code == 0 ? json::parse(r.out) : json();
}

// A copy of the shipped model whose tensors pass through `keep` (hard links would share the inode, and
// tests write profiles into the copy, so the small files are copied).
fs::path copy_of_shipped(const fs::path& dir, const std::function<bool(const std::string&)>& keep = {}) {
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(kShipped)) {
    const std::string name = e.path().filename().string();
    if (name == "model.safetensors" || name.rfind("mtpx_runtime", 0) == 0) continue;
    fs::copy_file(e.path(), dir / name);
  }
  SafetensorsFile file(kShipped / "model.safetensors");
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, t] : file.tensors())
    if (!keep || keep(name)) tensors.push_back({name, t.dtype, t.shape, {t.data, t.nbytes}});
  write_safetensors(dir / "model.safetensors", tensors);
  return dir;
}

TEST(Tools, InspectCountsEveryParameterAndReportsTheHead) {
  const json r = run_json("inspect " + kShipped.string() + " --json");
  ASSERT_TRUE(r.is_object());
  EXPECT_TRUE(r["can_run"].get<bool>()) << r.dump();
  EXPECT_EQ(r["mtp"]["status"], "present");
  EXPECT_EQ(r["layout"], "huggingface");
  EXPECT_TRUE(r["tied_embeddings"].get<bool>());
  // Parameters and bytes per component add up to what the file holds (counted here from the header).
  SafetensorsFile file(kShipped / "model.safetensors");
  int64_t params = 0, head = 0, bytes = 0;
  for (const auto& [name, t] : file.tensors()) {
    params += t.numel();
    bytes += static_cast<int64_t>(t.nbytes);
    if (name.rfind("mtp.", 0) == 0) head += t.numel();
  }
  int64_t got_params = 0, got_bytes = 0;
  for (const auto& [name, c] : r["components"].items()) {
    got_params += c["parameters"].get<int64_t>();
    got_bytes += c["bytes"].get<int64_t>();
  }
  EXPECT_EQ(got_params, params);
  EXPECT_EQ(got_bytes, bytes);
  EXPECT_EQ(r["components"]["mtp_head"]["parameters"].get<int64_t>(), head);
  EXPECT_EQ(r["tokenizer"]["vocab_size"], 8192);
  EXPECT_TRUE(r["tokenizer"]["chat_template"].get<bool>());
  // Memory grows with the context by the KV of 2 trunk + 1 head attention layers (2 kv heads x 64, fp32).
  const json small = run_json("inspect " + kShipped.string() + " --json --context 1000");
  const json large = run_json("inspect " + kShipped.string() + " --json --context 2000");
  EXPECT_EQ(large["memory"]["state_bytes"].get<int64_t>() - small["memory"]["state_bytes"].get<int64_t>(),
            3 * 2 * 1000 * 2 * 64 * 4);
  // The text form says the same.
  const auto text = run("inspect " + kShipped.string());
  EXPECT_EQ(text.code, 0);
  EXPECT_NE(text.out.find("mtp head   present"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("can run    yes"), std::string::npos) << text.out;
}

TEST(Tools, InspectNamesMissingAndMisfitHeadTensors) {
  TempDir dir;
  copy_of_shipped(dir.path() / "absent", [](const std::string& n) { return n.rfind("mtp.", 0) != 0; });
  EXPECT_EQ(run_json("inspect " + (dir.path() / "absent").string() + " --json")["mtp"]["status"], "absent");
  copy_of_shipped(dir.path() / "incomplete",
                  [](const std::string& n) { return n != "mtp.layers.0.mlp.up_proj.weight"; });
  const json inc = run_json("inspect " + (dir.path() / "incomplete").string() + " --json");
  EXPECT_EQ(inc["mtp"]["status"], "incomplete");
  EXPECT_NE(inc["mtp"]["detail"].get<std::string>().find("mtp.layers.0.mlp.up_proj.weight"),
            std::string::npos);
  EXPECT_TRUE(inc["can_run"].get<bool>());  // the trunk still runs, without MTP
  const auto missing_trunk = run("inspect " + (dir.path() / "nothing").string());
  EXPECT_EQ(missing_trunk.code, 2);
}

TEST(Tools, SynthWritesALoadableOfficialLayoutCheckpoint) {
  TempDir dir;
  const fs::path out = dir.path() / "tiny";
  const auto w = run("synth --shape tiny --out " + out.string() + " --mtp --seed 3");
  ASSERT_EQ(w.code, 0) << w.err;
  const json config = read_json_file(out / "config.json");
  EXPECT_EQ(config["architectures"][0], "Qwen3_5ForConditionalGeneration");
  EXPECT_EQ(config["text_config"]["mtp_num_hidden_layers"], 1);
  SafetensorsFile file(out / "model.safetensors");
  EXPECT_NE(file.find("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"), nullptr);
  EXPECT_NE(file.find("mtp.fc.weight"), nullptr);
  EXPECT_EQ(file.find("model.language_model.layers.0.linear_attn.conv1d.weight")->shape,
            (std::vector<int64_t>{512, 1, 4}));
  const json r = run_json("inspect " + out.string() + " --json");
  EXPECT_EQ(r["mtp"]["status"], "present");
  EXPECT_TRUE(r["can_run"].get<bool>());
  // Greedy MTP on it is lossless like on any model.
  const std::string gen = "generate --model " + out.string() + " --prompt-ids 5,6,7,8 --max-tokens 12 --json";
  EXPECT_EQ(run_json(gen)["tokens"], run_json(gen + " --mtp --draft 3")["tokens"]);
  // Same seed, same bytes; the target must not exist.
  expect_usage_error("synth --shape tiny --out " + out.string(), "already exists");
  expect_usage_error("synth --shape 3B --out " + (dir.path() / "x").string(), "unknown shape");
  expect_usage_error("synth --shape tiny --bits 5 --out " + (dir.path() / "y").string(), "--bits");
  EXPECT_FALSE(fs::exists(dir.path() / "x"));
}

TEST(Tools, SynthCopiesTheShapeOfAConfigOrModelDirectory) {
  TempDir dir;
  // From the shipped model's directory: every tensor with the same name, shape and dtype, other values.
  const fs::path like = dir.path() / "like";
  const auto w = run("synth --shape " + kShipped.string() + " --mtp --out " + like.string());
  ASSERT_EQ(w.code, 0) << w.err;
  SafetensorsFile shipped(kShipped / "model.safetensors"), synth(like / "model.safetensors");
  size_t compared = 0;
  for (const auto& [name, info] : shipped.tensors()) {
    if (name.starts_with("model.visual.")) continue;  // the text engine's checkpoints have no vision tower
    const auto* t = synth.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->shape, info.shape) << name;
    EXPECT_EQ(t->dtype, info.dtype) << name;
    ++compared;
  }
  EXPECT_EQ(synth.tensors().size(), compared);
  // From a config.json whose shape is edited: 12 layers, the attention every 4th.
  json config = read_json_file(kShipped / "config.json");
  config["text_config"]["num_hidden_layers"] = 12;
  json types = json::array();
  for (int i = 0; i < 12; ++i) types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  config["text_config"]["layer_types"] = types;
  const fs::path edited = dir.path() / "edited.json";
  tools::write_json_file(edited, config);
  const fs::path deeper = dir.path() / "deeper";
  ASSERT_EQ(run("synth --shape " + edited.string() + " --out " + deeper.string()).code, 0);
  const json r = run_json("inspect " + deeper.string() + " --json");
  EXPECT_EQ(r["shape"]["layers"], 12);
  EXPECT_EQ(r["mtp"]["status"], "absent");
  EXPECT_NE(SafetensorsFile(deeper / "model.safetensors")
                .find("model.language_model.layers.11.self_attn.q_proj.weight"),
            nullptr);
  // A config that is not one names the file.
  std::ofstream(dir.path() / "bad.json") << "{\"text_config\": 3}";
  expect_usage_error(
      "synth --shape " + (dir.path() / "bad.json").string() + " --out " + (dir.path() / "z").string(),
      "bad.json");
  EXPECT_FALSE(fs::exists(dir.path() / "z"));
}

TEST(Tools, BenchPairsPlainAndMtpAndSyntheticAcceptanceIsHonoured) {
  const json r = run_json("bench --max-tokens 24 --runs 1 --draft 2 --json");
  ASSERT_TRUE(r.contains("results"));
  std::set<std::string> seen;
  for (const auto& row : r["results"]) {
    seen.insert(row["sampler"].get<std::string>() + "/" + std::to_string(row["draft"].get<int64_t>()));
    EXPECT_GT(row["tok_s_median"].get<double>(), 0);
  }
  EXPECT_EQ(seen, (std::set<std::string>{"greedy/0", "greedy/2", "default/0", "default/2"}));
  const json all = run_json("bench --max-tokens 24 --runs 1 --draft 3 --synthetic-acceptance 1 --json");
  const json none = run_json("bench --max-tokens 24 --runs 1 --draft 3 --synthetic-acceptance 0 --json");
  for (const auto& row : all["results"]) {
    if (row["draft"] == 3) {
      EXPECT_DOUBLE_EQ(row["acceptance"].get<double>(), 1.0);
    }
  }
  for (const auto& row : none["results"]) {
    if (row["draft"] == 3) {
      EXPECT_DOUBLE_EQ(row["acceptance"].get<double>(), 0.0);
    }
  }
  expect_usage_error("bench --runs 0", "--runs");
}

TEST(Tools, BenchRunsUntilItsMediansSettle) {
  // --runs N: exactly N runs.
  const json exact = run_json("bench --max-tokens 8 --runs 2 --draft 1 --json");
  EXPECT_EQ(exact["protocol"]["runs"], 2);
  EXPECT_EQ(exact["protocol"]["stopped_by"], "runs");
  for (const auto& row : exact["results"]) EXPECT_EQ(row["tok_s_runs"].size(), 2u);
  // By default at least 7 runs, then on until every median moved under 1% with each of the last two runs,
  // at most 25; each row reports its spread.
  const json r = run_json("bench --max-tokens 8 --draft 1 --json");
  const int64_t runs = r["protocol"]["runs"];
  EXPECT_GE(runs, 7);
  EXPECT_LE(runs, 25);
  const std::string stop = r["protocol"]["stopped_by"];
  EXPECT_TRUE(stop == "settled" || (stop == "max_runs" && runs == 25)) << stop << " after " << runs;
  for (const auto& row : r["results"]) {
    std::vector<double> t = row["tok_s_runs"];
    ASSERT_EQ(static_cast<int64_t>(t.size()), runs);
    const auto [lo, hi] = std::minmax_element(t.begin(), t.end());
    EXPECT_NEAR(row["spread"].get<double>(), (*hi - *lo) / row["tok_s_median"].get<double>(), 1e-9);
    if (stop == "settled") {
      // The check that stopped it: adding each of the last two runs moved the median by at most 1%.
      const double now = tools::median_of(t);
      t.pop_back();
      const double before = tools::median_of(t);
      t.pop_back();
      EXPECT_LE(std::abs(now - before), 0.01 * now);
      EXPECT_LE(std::abs(before - tools::median_of(t)), 0.01 * now);
    }
  }
  expect_usage_error("bench --runs 5 --max-runs 3", "--max-runs");
}

// Points $XDG_CACHE_HOME (where tune saves profiles) at `dir` for the test's lifetime.
class CacheHome {
 public:
  explicit CacheHome(const fs::path& dir) {
    if (const char* v = std::getenv("XDG_CACHE_HOME")) old_ = v;
    ::setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  }
  ~CacheHome() {
    if (old_)
      ::setenv("XDG_CACHE_HOME", old_->c_str(), 1);
    else
      ::unsetenv("XDG_CACHE_HOME");
  }

 private:
  std::optional<std::string> old_;
};

std::set<std::string> file_names(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

TEST(Tools, TuneSavesAProfileThatGenerateUsesAndStaleProfilesAreNotUsed) {
  TempDir dir;
  const CacheHome cache(dir.path() / "cache");
  const fs::path model = copy_of_shipped(dir.path() / "m");
  const std::set<std::string> model_files = file_names(model);
  const auto t =
      run("tune --model " + model.string() + " --max-draft 2 --max-tokens 16 --runs 1 --margin 0 --json");
  ASSERT_EQ(t.code, 0) << t.err;
  const json profile = json::parse(t.out);
  // The profile and its chart go to the cache, keyed by the model; the model directory is left as it was,
  // and tune says where it wrote.
  EXPECT_EQ(file_names(model), model_files);
  const fs::path profile_path = run_json("inspect " + model.string() + " --json")["runtime_profile"]["path"];
  EXPECT_EQ(profile_path.string().rfind((dir.path() / "cache" / "mtpx" / "profiles").string(), 0), 0u)
      << profile_path;
  EXPECT_NE(profile_path.parent_path().filename().string().find("m-"), std::string::npos) << profile_path;
  ASSERT_TRUE(fs::exists(profile_path));
  ASSERT_TRUE(fs::exists(fs::path(profile_path).replace_extension(".svg")));
  EXPECT_NE(t.err.find(profile_path.string()), std::string::npos) << t.err;
  // Plain decoding, then K = 1 and 2 each with the whole vocabulary and with the default candidate for an
  // 8192-id vocabulary, half of it.
  ASSERT_EQ(profile["evidence"].size(), 5u);
  EXPECT_EQ(profile["draft_vocab_candidates"], json::array({4096}));
  const int64_t k = profile["draft"].get<int64_t>();
  const json on_disk = read_json_file(profile_path);
  EXPECT_EQ(on_disk["draft"], k);
  EXPECT_TRUE(on_disk.contains("hardware"));
  EXPECT_EQ(run_json("inspect " + model.string() + " --json")["runtime_profile"]["status"], "valid");
  // generate --mtp without --draft takes the tuned K (kDefaultDraft when the profile recommends plain
  // decoding).
  const json g =
      run_json("generate --model " + model.string() + " --prompt-ids 1,2,3 --max-tokens 8 --mtp --json");
  EXPECT_EQ(g["stats"]["mtp"]["draft"], k > 0 ? k : kDefaultDraft);
  // The draft vocabulary: tune tries the candidates asked for at every K, and generate takes the
  // profile's choice unless --draft-vocab says otherwise.
  {
    const auto t2 = run("tune --model " + model.string() +
                        " --max-draft 1 --max-tokens 16 --runs 1 --draft-vocab 1000,3000 --json");
    ASSERT_EQ(t2.code, 0) << t2.err;
    const json p2 = json::parse(t2.out);
    ASSERT_EQ(p2["evidence"].size(), 4u);
    EXPECT_EQ(p2["evidence"][1]["draft_vocab"], 0);
    EXPECT_EQ(p2["evidence"][2]["draft_vocab"], 1000);
    EXPECT_EQ(p2["evidence"][3]["draft_vocab"], 3000);
    EXPECT_EQ(p2["draft_vocab_candidates"], json::array({1000, 3000}));
    json chosen = read_json_file(profile_path);
    chosen["draft"] = 2;
    chosen["draft_vocab"] = 4096;
    tools::write_json_file(profile_path, chosen);
    const std::string gen =
        "generate --model " + model.string() + " --prompt-ids 1,2,3 --max-tokens 8 --mtp --json";
    const json tuned = run_json(gen)["stats"]["mtp"];
    EXPECT_EQ(tuned["draft"], 2);
    EXPECT_EQ(tuned["draft_vocab"], 4096);
    EXPECT_EQ(run_json(gen + " --draft-vocab 100")["stats"]["mtp"]["draft_vocab"], 100);
    chosen["draft_vocab"] = -1;
    tools::write_json_file(profile_path, chosen);
    EXPECT_EQ(run_json("inspect " + model.string() + " --json")["runtime_profile"]["status"], "invalid");
    EXPECT_EQ(run_json(gen)["stats"]["mtp"]["draft_vocab"], 0);
    tools::write_json_file(profile_path, on_disk);
  }
  // A profile from another version is stale: reported, not used.
  json stale = on_disk;
  stale["mtpx_version"] = "0.0.0-other";
  stale["draft"] = 2;
  tools::write_json_file(profile_path, stale);
  const json s = run_json("inspect " + model.string() + " --json")["runtime_profile"];
  EXPECT_EQ(s["status"], "stale");
  const json g2 =
      run_json("generate --model " + model.string() + " --prompt-ids 1,2,3 --max-tokens 8 --mtp --json");
  EXPECT_EQ(g2["stats"]["mtp"]["draft"], kDefaultDraft);
}

TEST(Tools, GraftRestoresAStrippedHeadExactlyAndRefusesAForeignOne) {
  TempDir dir;
  const fs::path stripped =
      copy_of_shipped(dir.path() / "stripped", [](const std::string& n) { return n.rfind("mtp.", 0) != 0; });
  const fs::path out = dir.path() / "grafted";
  const auto g = run("graft --trunk " + stripped.string() + " --donor " + kShipped.string() + " --out " +
                     out.string() + " --json");
  ASSERT_EQ(g.code, 0) << g.err;
  const json report = json::parse(g.out);
  ASSERT_TRUE(fs::exists(out / "mtp.safetensors"));
  // The grafted head is the shipped one: the same measured acceptance, bit for bit.
  const auto shipped = Model::load(kShipped);
  const double expected = tools::teacher_forced_acceptance(*shipped, tools::graft_sample_ids(kShipped, 8192));
  EXPECT_EQ(report["teacher_forced_acceptance"].get<double>(), expected);
  EXPECT_GT(expected, 0.5);
  EXPECT_EQ(run_json("inspect " + out.string() + " --json")["mtp"]["status"], "present");
  const std::string gen = " --prompt-ids 1,2,3,4 --max-tokens 16 --mtp --draft 2 --json";
  EXPECT_EQ(run_json("generate --model " + out.string() + gen)["tokens"],
            run_json("generate --model " + kShipped.string() + gen)["tokens"]);
  // Inputs untouched.
  EXPECT_FALSE(fs::exists(stripped / "mtp.safetensors"));

  // A head from a differently initialized model of the same shape does not fit: refused, no output.
  const fs::path foreign = dir.path() / "foreign";
  {
    ModelConfig config = load_model_config(kShipped / "config.json");
    tools::AtomicDirectory staging(foreign, false);
    tools::WriteOptions o;
    o.seed = 99;
    tools::write_checkpoint_tensors(staging.path(), tools::checkpoint_manifest(config, true), o);
    tools::write_json_file(staging.path() / "config.json", tools::config_json(config, o));
    staging.commit();
  }
  expect_usage_error("graft --trunk " + stripped.string() + " --donor " + foreign.string() + " --out " +
                         (dir.path() / "bad").string(),
                     "acceptance");
  EXPECT_FALSE(fs::exists(dir.path() / "bad"));
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  // Mismatched shapes are refused before anything is measured.
  expect_usage_error("graft --trunk " + stripped.string() + " --donor " +
                         (fs::path(MTPX_SOURCE_DIR) / "tests/fixtures/causal_mtp_untied_f32").string() +
                         " --out " + (dir.path() / "bad2").string(),
                     "differs");
  // A trunk with a head is refused without --force.
  expect_usage_error("graft --trunk " + kShipped.string() + " --donor " + kShipped.string() + " --out " +
                         (dir.path() / "bad3").string(),
                     "already has an MTP head");
}

// Top-1 agreement of two models' logits over held-out text.
double top1_agreement(const Model& a, const Model& b, const std::vector<int32_t>& ids) {
  auto argmaxes = [&](const Model& m) {
    InferenceState state = m.new_state(static_cast<int64_t>(ids.size()));
    ForwardResult r;
    m.forward(state, ids, LogitRows::kAll, r);
    const int64_t V = m.config().vocab_size;
    std::vector<int64_t> out;
    for (size_t t = 0; t < ids.size(); ++t)
      out.push_back(std::max_element(&r.logits[t * V], &r.logits[(t + 1) * V]) - &r.logits[t * V]);
    return out;
  };
  const auto x = argmaxes(a), y = argmaxes(b);
  int64_t same = 0;
  for (size_t i = 0; i < x.size(); ++i) same += x[i] == y[i];
  return static_cast<double>(same) / static_cast<double>(x.size());
}

// MTPX_AFFINE_ACTIVATIONS (quant_matmul.h): f32 keeps float activations in the 4-bit row kernels, int8 (the
// default) quantizes them where the CPU has AVX-512 VNNI, anything else is a usage error.
TEST(Tools, AffineActivationsEnvironmentChoosesTheRowKernels) {
  TempDir dir;
  const fs::path q4 = dir.path() / "q4";
  ASSERT_EQ(run("quantize --out " + q4.string() + " --bits 4").code, 0);
  auto logits_with = [&](const char* value) {
    if (value != nullptr) setenv("MTPX_AFFINE_ACTIVATIONS", value, 1);
    const fs::path out = dir.path() / (std::string("logits_") + (value ? value : "default") + ".safetensors");
    const auto r =
        run("logits --model " + q4.string() + " --prompt-ids 11,200,31,400,5 --out " + out.string());
    unsetenv("MTPX_AFFINE_ACTIVATIONS");
    EXPECT_EQ(r.code, 0) << r.err;
    SafetensorsFile file(out);
    const TensorView& t = *file.find("logits");
    return std::vector<std::byte>(t.data, t.data + t.nbytes);
  };
  const auto by_default = logits_with(nullptr), int8 = logits_with("int8"), f32 = logits_with("f32");
  EXPECT_EQ(by_default, int8);
  // This process and the mtpx it runs pick the same family (the same CPU, the variable unset here).
  const cpu::AffineKernel family = cpu::affine_default_kernel();
  if (family == cpu::AffineKernel::kAvx512Vnni || family == cpu::AffineKernel::kAvx2Int8) {
    EXPECT_NE(int8, f32);  // 5 rows: the row kernels, not the prompt path
  } else {
    EXPECT_EQ(int8, f32);
  }
  setenv("MTPX_AFFINE_ACTIVATIONS", "fp32", 1);
  expect_usage_error("generate --model " + q4.string() + " --prompt-ids 1,2 --max-tokens 2",
                     "MTPX_AFFINE_ACTIVATIONS");
  unsetenv("MTPX_AFFINE_ACTIVATIONS");
}

TEST(Tools, QuantizeKeepsTheHeadAndGreedyMtpStaysLossless) {
  TempDir dir;
  const json samples =
      read_json_file(fs::path(MTPX_SOURCE_DIR) / "tests/fixtures/trained_default/heldout_samples.json");
  std::vector<int32_t> text;
  for (int i = 0; i < 4; ++i) {
    for (int32_t id : samples["samples"][i]["prompt_ids"]) text.push_back(id);
    for (int32_t id : samples["samples"][i]["next_ids"]) text.push_back(id);
  }
  const auto bf16 = Model::load(kShipped);
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    const fs::path out = dir.path() / ("q" + std::to_string(bits));
    const auto q = run("quantize --out " + out.string() + " --bits " + std::to_string(bits) + " --json");
    ASSERT_EQ(q.code, 0) << q.err;
    EXPECT_EQ(json::parse(q.out)["method"], "least-squares");
    EXPECT_EQ(json::parse(q.out)["calibration"], "builtin");
    EXPECT_GT(json::parse(q.out)["calibration_tokens"].get<int64_t>(), 50);
    const json config = read_json_file(out / "config.json");
    EXPECT_EQ(config["quantization"]["bits"], bits);
    EXPECT_EQ(config["quantization"]["group_size"], 64);
    SafetensorsFile file(out / "model.safetensors");
    EXPECT_EQ(file.find("language_model.model.layers.0.mlp.up_proj.weight")->dtype, DType::kU32);
    EXPECT_EQ(file.find("mtp.layers.0.mlp.up_proj.weight")->dtype, DType::kU32);  // the head is quantized too
    EXPECT_EQ(file.find("mtp.fc.weight")->dtype, DType::kBF16);                   // ... except mtp.fc
    EXPECT_EQ(file.find("language_model.model.norm.weight")->dtype, DType::kBF16);
    const auto model = Model::load(out);
    ASSERT_NE(model->mtp(), nullptr) << model->mtp_status().detail;
    EXPECT_GE(top1_agreement(*bf16, *model, text), bits == 8 ? 0.97 : 0.85);
    EXPECT_GT(tools::teacher_forced_acceptance(*model, text), 0.6);
    const std::string gen = "generate --model " + out.string() +
                            " --prompt \"def main():\" --max-tokens 40 --temperature 0 --json";
    const json plain = run_json(gen);
    for (int k : {1, 3})
      EXPECT_EQ(run_json(gen + " --mtp --draft " + std::to_string(k))["tokens"], plain["tokens"]) << k;
  }
  expect_usage_error("quantize --out " + (dir.path() / "x").string() + " --bits 5", "--bits");
  expect_usage_error("quantize --out " + (dir.path() / "x").string() + " --method minmax", "--method");
  expect_usage_error("quantize --out " + (dir.path() / "x").string() + " --calibration /no/such/file.txt",
                     "--calibration");
  expect_usage_error("quantize --out " + (dir.path() / "x").string() + " --method mlx --calibration " +
                         (fs::path(MTPX_SOURCE_DIR) / "README.md").string(),
                     "--calibration");
  expect_usage_error("quantize --out " + (dir.path() / "q4").string() + " --bits 4", "already exists");
  expect_usage_error("quantize --out " + (dir.path() / "no/such/parent").string() + " --bits 4",
                     "parent directory");
  // A synthetic checkpoint can be written quantized directly.
  const fs::path synth = dir.path() / "synth4";
  ASSERT_EQ(run("synth --shape tiny --bits 4 --mtp --out " + synth.string()).code, 0);
  const json r = run_json("inspect " + synth.string() + " --json");
  EXPECT_EQ(r["layout"], "mlx");
  EXPECT_TRUE(r["components"]["trunk"]["storage"].contains("affine 4-bit g64")) << r["components"].dump();
  const std::string gen = "generate --model " + synth.string() + " --prompt-ids 3,4,5 --max-tokens 10 --json";
  EXPECT_EQ(run_json(gen)["tokens"], run_json(gen + " --mtp --draft 2")["tokens"]);
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

// A mixture-of-experts shape through every tool: synth writes the official layout (fused experts) or MLX's
// (stacked switch_mlp, quantized, router and shared-expert gate bf16), quantize writes MLX's from a
// Hugging Face checkpoint with its experts quantized one expert at a time, inspect reports the experts and
// what a token reads, bench and tune report the distinct experts a pass reads, and greedy MTP stays
// lossless on every form.
TEST(Tools, MixtureOfExpertsCheckpointsThroughEveryTool) {
  TempDir dir;
  const fs::path hf = dir.path() / "moe", mlx = dir.path() / "moe4", quantized = dir.path() / "moe_q4";
  ASSERT_EQ(run("synth --shape tiny-moe --mtp --out " + hf.string()).code, 0);
  const json config = read_json_file(hf / "config.json");
  EXPECT_EQ(config["architectures"][0], "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(config["text_config"]["num_experts"], 16);
  EXPECT_FALSE(config["text_config"].contains("intermediate_size"));
  {
    SafetensorsFile file(hf / "model.safetensors");
    const TensorView* fused = file.find("model.language_model.layers.0.mlp.experts.gate_up_proj");
    ASSERT_NE(fused, nullptr);
    EXPECT_EQ(fused->shape, (std::vector<int64_t>{16, 256, 256}));
    EXPECT_EQ(file.find("mtp.layers.0.mlp.experts.down_proj")->shape, (std::vector<int64_t>{16, 256, 128}));
  }
  ASSERT_EQ(run("synth --shape tiny-moe --bits 4 --mtp --out " + mlx.string()).code, 0);
  ASSERT_EQ(run("quantize --model " + hf.string() + " --out " + quantized.string() + " --bits 4").code, 0);
  for (const fs::path& q : {mlx, quantized}) {
    SafetensorsFile file(q / "model.safetensors");
    const TensorView* gate = file.find("language_model.model.layers.1.mlp.switch_mlp.gate_proj.weight");
    ASSERT_NE(gate, nullptr) << q;
    EXPECT_EQ(gate->dtype, DType::kU32);
    EXPECT_EQ(gate->shape, (std::vector<int64_t>{16, 128, 256 * 4 / 32}));
    EXPECT_EQ(file.find("language_model.model.layers.1.mlp.switch_mlp.gate_proj.scales")->shape,
              (std::vector<int64_t>{16, 128, 4}));
    EXPECT_EQ(file.find("language_model.model.layers.1.mlp.gate.weight")->dtype, DType::kBF16);
    EXPECT_EQ(file.find("language_model.model.layers.1.mlp.shared_expert_gate.weight")->dtype, DType::kBF16);
    EXPECT_EQ(file.find("mtp.layers.0.mlp.switch_mlp.up_proj.weight")->dtype, DType::kU32);
  }
  for (const fs::path& m : {hf, mlx, quantized}) {
    const json r = run_json("inspect " + m.string() + " --json");
    EXPECT_EQ(r["shape"]["experts"]["routed"], 16) << m;
    EXPECT_EQ(r["shape"]["experts"]["per_token"], 4) << m;
    EXPECT_EQ(r["mtp"]["status"], "present") << m;
    ASSERT_TRUE(r["components"].contains("routed experts")) << r["components"].dump();
    // A token reads a quarter of the routed experts: fewer parameters than the matrices hold.
    const int64_t routed = r["components"]["routed experts"]["parameters"].get<int64_t>();
    EXPECT_EQ(routed, 4 * 16 * 3 * 128 * 256) << m;  // 4 layers, 16 experts of 3 [128, 256] matrices
    EXPECT_EQ(r["per_token"]["routed_expert_parameters"].get<int64_t>(), routed / 4) << m;
    const std::string gen = "generate --model " + m.string() + " --prompt-ids 3,4,5,6 --max-tokens 12 --json";
    const json plain = run_json(gen);
    EXPECT_EQ(plain["stats"]["experts"]["per_layer_decode_pass"].get<double>(), 4.0);
    for (const char* k : {"1", "3"}) {
      const json spec = run_json(gen + " --mtp --draft " + k);
      EXPECT_EQ(plain["tokens"], spec["tokens"]) << m << " K=" << k;
      EXPECT_GE(spec["stats"]["experts"]["per_layer_decode_pass"].get<double>(), 4.0);
    }
  }
  // bench reports the experts a verify pass reads: more than a decode row's 4 when the window's rows route
  // apart (random weights route nearly uniformly).
  const json b =
      run_json("bench --model " + hf.string() +
               " --prompt-ids 1,2,3 --max-tokens 16 --runs 1 --draft 3 --synthetic-acceptance 1 --json");
  ASSERT_EQ(b["results"].size(), 2u);
  EXPECT_DOUBLE_EQ(b["results"][0]["experts_per_layer_pass"].get<double>(), 4.0);
  EXPECT_GT(b["results"][1]["experts_per_layer_pass"].get<double>(), 4.0);
  EXPECT_LE(b["results"][1]["experts_per_layer_pass"].get<double>(), 16.0);
  const json t =
      run_json("tune --model " + hf.string() + " --max-draft 1 --max-tokens 8 --runs 1 --margin 0 --json");
  ASSERT_FALSE(t["evidence"].empty());
  EXPECT_TRUE(t["evidence"][0].contains("experts_per_layer_pass")) << t.dump();
}

// --layers: a reduced-depth model of a shape (the MoE shapes do not fit smaller machines whole).
TEST(Tools, SynthWritesAReducedDepthShape) {
  TempDir dir;
  const fs::path out = dir.path() / "shallow";
  ASSERT_EQ(run("synth --shape tiny-moe --layers 2 --out " + out.string()).code, 0);
  const json config = read_json_file(out / "config.json");
  EXPECT_EQ(config["text_config"]["num_hidden_layers"], 2);
  EXPECT_EQ(config["text_config"]["layer_types"].size(), 2u);
  EXPECT_EQ(run_json("inspect " + out.string() + " --json")["shape"]["layers"], 2);
  expect_usage_error("synth --shape tiny-moe --layers 5 --out " + (dir.path() / "deep").string(), "--layers");
  expect_usage_error("synth --shape 35B-A3B --layers 0 --out " + (dir.path() / "none").string(), "--layers");
  EXPECT_FALSE(fs::exists(dir.path() / "deep"));
}

}  // namespace
}  // namespace mtpx
