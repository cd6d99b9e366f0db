#include "io/model_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace mtpx {
namespace {

using nlohmann::json;

json text_config() {
  return {{"model_type", "qwen3_5_text"},
          {"vocab_size", 512},
          {"hidden_size", 64},
          {"intermediate_size", 128},
          {"num_hidden_layers", 8},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 32},
          {"linear_num_key_heads", 2},
          {"linear_num_value_heads", 4},
          {"linear_key_head_dim", 16},
          {"linear_value_head_dim", 16},
          {"linear_conv_kernel_dim", 4},
          {"rms_norm_eps", 1e-6},
          {"eos_token_id", 511}};
}

TEST(ModelConfig, WrapperLayoutWithNestedRopeAndInterval) {
  json t = text_config();
  t["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", 1e7},
                          {"partial_rotary_factor", 0.25},
                          {"mrope_interleaved", true}};
  json root = {{"architectures", {"Qwen3_5ForConditionalGeneration"}},
               {"model_type", "qwen3_5"},
               {"text_config", t},
               {"tie_word_embeddings", true},
               {"vision_config", {{"depth", 2}}}};
  ModelConfig c = parse_model_config(root, "config.json");
  EXPECT_EQ(c.tensor_prefix, "model.language_model.");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rotary_dim, 8);
  EXPECT_EQ(c.rope_theta, 1e7);
  ASSERT_EQ(c.layer_types.size(), 8u);
  // Default interval 4: layers 3 and 7 are full attention.
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(c.layer_types[i], (i == 3 || i == 7) ? LayerType::kFullAttention : LayerType::kLinearAttention)
        << i;
  EXPECT_EQ(c.conv_dim(), 2 * 2 * 16 + 4 * 16);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{511}));
}

TEST(ModelConfig, TextOnlyLayoutWithFlatRopeAndExplicitLayerTypes) {
  json root = text_config();
  root["architectures"] = {"Qwen3_5ForCausalLM"};
  root["num_hidden_layers"] = 3;
  root["layer_types"] = {"full_attention", "linear_attention", "full_attention"};
  root["rope_theta"] = 10000.0;
  root["partial_rotary_factor"] = 0.5;
  ModelConfig c = parse_model_config(root, "config.json");
  EXPECT_EQ(c.tensor_prefix, "model.");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rotary_dim, 16);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kFullAttention, LayerType::kLinearAttention,
                                                   LayerType::kFullAttention}));
}

TEST(ModelConfig, OldRopeScalingSpellingWithType) {
  json root = text_config();
  root["full_attention_interval"] = 2;
  root["rope_scaling"] = {{"type", "default"}, {"rope_theta", 5e5}, {"partial_rotary_factor", 0.5}};
  ModelConfig c = parse_model_config(root, "config.json");
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(c.rotary_dim, 16);
  EXPECT_EQ(c.layer_types[1], LayerType::kFullAttention);
  EXPECT_EQ(c.layer_types[2], LayerType::kLinearAttention);
}

void expect_error(const json& root, const std::string& needle) {
  try {
    parse_model_config(root, "cfg.json");
    ADD_FAILURE() << "no error for " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
  }
}

TEST(ModelConfig, RejectsBadConfigsWithOneLineErrors) {
  json c = text_config();
  expect_error(json::array(), "JSON object");
  json a = c;
  a["architectures"] = {"LlamaForCausalLM"};
  expect_error(a, "unknown architecture");
  json other_moe = c;  // Qwen3's MoE, not Qwen3.5's (whose configs are tested in moe_test.cpp)
  other_moe["architectures"] = {"Qwen3MoeForCausalLM"};
  expect_error(other_moe, "unknown architecture");
  json missing = c;
  missing.erase("hidden_size");
  expect_error(missing, "hidden_size");
  json negative = c;
  negative["num_attention_heads"] = -4;
  expect_error(negative, "num_attention_heads");
  json huge = c;
  huge["num_hidden_layers"] = int64_t{1} << 40;
  expect_error(huge, "num_hidden_layers");
  json wrong_type = c;
  wrong_type["vocab_size"] = "many";
  expect_error(wrong_type, "vocab_size");
  json gqa = c;
  gqa["num_key_value_heads"] = 3;
  expect_error(gqa, "multiple");
  json types = c;
  types["layer_types"] = {"full_attention"};
  expect_error(types, "layer_types");
  json bad_type = c;
  bad_type["num_hidden_layers"] = 1;
  bad_type["layer_types"] = {"sliding_attention"};
  expect_error(bad_type, "sliding_attention");
  json rope = c;
  rope["rope_parameters"] = {{"rope_type", "yarn"}};
  expect_error(rope, "yarn");
}

TEST(GenerationConfig, ReadsSamplerDefaults) {
  json g = {{"do_sample", true},
            {"temperature", 0.6},
            {"top_k", 20},
            {"top_p", 0.95},
            {"eos_token_id", {248046, 248044}}};
  GenerationConfig c = parse_generation_config(g, "generation_config.json");
  EXPECT_TRUE(c.do_sample);
  EXPECT_DOUBLE_EQ(c.temperature, 0.6);
  EXPECT_EQ(c.top_k, 20);
  EXPECT_DOUBLE_EQ(c.top_p, 0.95);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{248046, 248044}));
  EXPECT_THROW(parse_generation_config({{"top_p", 3.0}}, "g.json"), Error);
  GenerationConfig defaults = parse_generation_config(json::object(), "g.json");
  EXPECT_FALSE(defaults.do_sample);
}

}  // namespace
}  // namespace mtpx
