// The server's text handling without a model: streamed text at UTF-8 boundaries with stop strings held
// back, Qwen tool calls -> OpenAI tool_calls (whole and streamed), request validation, error objects,
// metrics exposition, and the fiber the scheduler runs generations in.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/fiber.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace fs = std::filesystem;

namespace mtpx::server {
namespace {

using test_paths::kDefaultModel;

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
  return t;
}

bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    i += n;
  }
  return true;
}

// The id of the byte-level token standing for exactly this one byte.
int32_t byte_token(unsigned char byte) {
  for (int32_t id = 0; id < tokenizer().vocab_size(); ++id)
    if (tokenizer().token_bytes(id) == std::string(1, static_cast<char>(byte))) return id;
  ADD_FAILURE() << "no token for byte " << int(byte);
  return 0;
}

TEST(TextStream, EmitsWholeCharactersOnly) {
  // 世 = E4 B8 96, fed one byte token at a time: nothing until the character is complete.
  TextStream stream(tokenizer(), {}, {});
  EXPECT_EQ(stream.push(byte_token(0xe4)), "");
  EXPECT_EQ(stream.push(byte_token(0xb8)), "");
  EXPECT_EQ(stream.push(byte_token(0x96)), "世");
  const std::string text = "héllo 世界 👋 done";
  TextStream whole(tokenizer(), {}, {});
  std::string out;
  for (int32_t id : tokenizer().encode(text)) {
    const std::string piece = whole.push(id);
    EXPECT_TRUE(valid_utf8(piece)) << piece;
    out += piece;
  }
  out += whole.finish();
  EXPECT_EQ(out, text);
}

TEST(TextStream, StopStringAcrossTokensIsCutAndNeverSent) {
  const std::string text = "def f(x):\n    return x  # END here and more";
  const std::vector<int32_t> ids = tokenizer().encode(text);
  for (const std::string stop : {"END", "# END", "x):\n", "here and more", "e"}) {
    SCOPED_TRACE(stop);
    TextStream stream(tokenizer(), {stop, "NEVER"}, {});
    std::string out;
    for (int32_t id : ids) {
      out += stream.push(id);
      EXPECT_EQ(out.find(stop), std::string::npos);
      if (stream.stopped()) break;
    }
    out += stream.finish();
    EXPECT_TRUE(stream.stopped());
    EXPECT_EQ(out, text.substr(0, text.find(stop)));
  }
}

TEST(TextStream, HeldBackPrefixIsReleasedWhenItDoesNotMatch) {
  TextStream stream(tokenizer(), {"STOP"}, {});
  std::string out;
  for (int32_t id : tokenizer().encode("a ST")) out += stream.push(id);
  EXPECT_EQ(out, "a ");  // "ST" could still become "STOP"
  for (int32_t id : tokenizer().encode("X done")) out += stream.push(id);
  out += stream.finish();
  EXPECT_EQ(out, "a STX done");
  EXPECT_FALSE(stream.stopped());
}

TEST(TextStream, StopIdsAreNotShown) {
  const int32_t im_end = *tokenizer().token_to_id("<|im_end|>");
  TextStream stream(tokenizer(), {}, {im_end});
  std::string out;
  for (int32_t id : tokenizer().encode("hi")) out += stream.push(id);
  out += stream.push(im_end);
  EXPECT_EQ(out + stream.finish(), "hi");
}

TEST(TextStream, PartialStopSuffix) {
  EXPECT_EQ(partial_stop_suffix("abc <tool", {"<tool_call>"}), 5u);
  EXPECT_EQ(partial_stop_suffix("abc", {"<tool_call>"}), 0u);
  EXPECT_EQ(partial_stop_suffix("xx<", {"<a>", "x<a"}), 2u);
  EXPECT_EQ(partial_stop_suffix("", {"ab"}), 0u);
}

TEST(ToolCalls, JsonAndXmlCallsBecomeOpenAiCalls) {
  const auto split = extract_tool_calls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
      "\"days\": 2}}\n"
      "</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\nbest llamas\n</parameter>\n"
      "<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>");
  EXPECT_EQ(split.content, "Let me check.");
  ASSERT_EQ(split.tool_calls.size(), 2u);
  EXPECT_EQ(split.tool_calls[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(split.tool_calls[0].arguments),
            nlohmann::json({{"city", "Paris"}, {"days", 2}}));
  EXPECT_EQ(split.tool_calls[1].name, "search");
  EXPECT_EQ(nlohmann::json::parse(split.tool_calls[1].arguments),
            nlohmann::json({{"query", "best llamas"}, {"limit", 3}}));
  EXPECT_NE(split.tool_calls[0].id, split.tool_calls[1].id);
  EXPECT_EQ(split.tool_calls[0].id.rfind("call_", 0), 0u);
}

TEST(ToolCalls, MalformedOrUnclosedBlocksStayText) {
  auto bad = extract_tool_calls("a <tool_call>not json</tool_call> b");
  EXPECT_TRUE(bad.tool_calls.empty());
  EXPECT_EQ(bad.content, "a <tool_call>not json</tool_call> b");
  auto unclosed = extract_tool_calls("x <tool_call>{\"name\": \"f\"");
  EXPECT_TRUE(unclosed.tool_calls.empty());
  EXPECT_EQ(unclosed.content, "x <tool_call>{\"name\": \"f\"");
  EXPECT_EQ(extract_tool_calls("no calls <tool").content, "no calls <tool");
}

TEST(ToolCalls, StreamingGivesTheSameSplitAtAnyChunking) {
  const std::string text =
      "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"<tool_call>\"}}\n</tool_call>\n"
      "<tool_call>{\"name\": \"g\", \"arguments\": \"{}\"}</tool_call> tail <tool";
  const auto whole = extract_tool_calls(text);
  ASSERT_EQ(whole.tool_calls.size(), 2u);
  for (size_t chunk = 1; chunk <= 7; ++chunk) {
    SCOPED_TRACE(chunk);
    ToolCallStream stream;
    std::string content;
    std::vector<std::string> names;
    auto take = [&](const std::vector<ToolCallStream::Piece>& pieces) {
      for (const auto& p : pieces) {
        if (p.call) {
          names.push_back(p.call->name);
        } else {
          EXPECT_EQ(p.content.find("<tool_call>"), std::string::npos);
          content += p.content;
        }
      }
    };
    for (size_t i = 0; i < text.size(); i += chunk) take(stream.push(text.substr(i, chunk)));
    take(stream.finish());
    EXPECT_EQ(names, (std::vector<std::string>{"f", "g"}));
    EXPECT_EQ(content, "Sure. tail <tool");
    EXPECT_TRUE(stream.saw_tool_call());
  }
}

ServingDefaults defaults() {
  ServingDefaults d;
  d.model_id = "default";
  d.generation.do_sample = true;
  d.generation.temperature = 0.7;
  d.generation.top_k = 20;
  d.generation.top_p = 0.95;
  d.mtp_available = true;
  d.mtp = true;
  d.draft = 2;
  d.context = 100;
  d.stop_ids = {7};
  d.vocab_limit = 8192;
  return d;
}

void expect_error(const OrderedJson& body, ErrorKind kind, const std::string& needle, bool chat = true) {
  SCOPED_TRACE(body.dump());
  try {
    if (chat) {
      parse_chat_request(body, defaults());
    } else {
      parse_completion_request(body, defaults());
    }
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(OpenAiApi, ChatRequestValidation) {
  const OrderedJson hi = OrderedJson::array({{{"role", "user"}, {"content", "hi"}}});
  expect_error({{"model", "default"}}, ErrorKind::kInvalidInput, "'messages' is required");
  expect_error({{"messages", "hi"}}, ErrorKind::kInvalidInput, "'messages' must be an array");
  expect_error({{"messages", OrderedJson::array()}}, ErrorKind::kInvalidInput, "must not be empty");
  expect_error({{"messages", {{{"role", "robot"}, {"content", "x"}}}}}, ErrorKind::kInvalidInput, "role");
  expect_error({{"messages", {{{"role", "user"}}}}}, ErrorKind::kInvalidInput, "content' is required");
  expect_error({{"messages", hi}, {"model", "gpt-4"}}, ErrorKind::kNotFound, "gpt-4");
  expect_error({{"messages", hi}, {"temperature", "hot"}}, ErrorKind::kInvalidInput,
               "'temperature' must be a number");
  expect_error({{"messages", hi}, {"top_p", 1.5}}, ErrorKind::kInvalidInput, "'top_p'");
  expect_error({{"messages", hi}, {"max_tokens", -1}}, ErrorKind::kInvalidInput, "'max_tokens'");
  expect_error({{"messages", hi}, {"max_tokens", 2.5}}, ErrorKind::kInvalidInput, "must be an integer");
  expect_error({{"messages", hi}, {"stop", 3}}, ErrorKind::kInvalidInput, "'stop'");
  expect_error({{"messages", hi}, {"n", 2}}, ErrorKind::kUnsupported, "'n' must be 1");
  expect_error({{"messages", hi}, {"logprobs", true}}, ErrorKind::kUnsupported, "logprobs");
  expect_error({{"messages", hi}, {"stream", "yes"}}, ErrorKind::kInvalidInput, "'stream' must be a boolean");
  expect_error({{"messages", hi}, {"draft", 9}}, ErrorKind::kInvalidInput, "'draft'");
  expect_error({{"messages", hi}, {"tool_choice", "required"}}, ErrorKind::kUnsupported, "tool_choice");
  expect_error({{"messages", hi}, {"chat_template_kwargs", {{"messages", 1}}}}, ErrorKind::kInvalidInput,
               "may not set");
  expect_error({{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
               ErrorKind::kUnsupported, "text parts");
  expect_error({{"prompt", OrderedJson::array({"a", "b"})}}, ErrorKind::kUnsupported, "one prompt", false);
  expect_error({{"prompt", OrderedJson::array({1, 99999})}}, ErrorKind::kInvalidInput, "vocabulary", false);
  expect_error({{"prompt", 5}}, ErrorKind::kInvalidInput, "'prompt'", false);
}

TEST(OpenAiApi, ChatRequestNormalization) {
  const OrderedJson body = OrderedJson::parse(R"({
    "model": "default", "stop": "###", "seed": 5, "top_k": -1, "mtp": false,
    "messages": [
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null,
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": 2}"}}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "chat_template_kwargs": {"enable_thinking": false}})");
  ChatRequest r = parse_chat_request(body, defaults());
  EXPECT_EQ(r.messages[0]["content"], "ab");
  EXPECT_TRUE(r.messages[1]["content"].is_null());
  EXPECT_EQ(r.messages[1]["tool_calls"][0]["function"]["arguments"].dump(),
            R"({"z":1,"a":2})");  // order kept
  EXPECT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.template_kwargs["enable_thinking"], false);
  EXPECT_EQ(r.sampling.stop, std::vector<std::string>{"###"});
  EXPECT_EQ(*r.sampling.top_k, 0);
  GenerationRequest g = make_generation_request({1, 2, 3}, r.sampling, defaults(), 0);
  EXPECT_EQ(g.options.draft, 0);        // "mtp": false
  EXPECT_EQ(g.options.max_tokens, 97);  // the rest of the context
  EXPECT_EQ(g.options.seed, 5u);
  EXPECT_DOUBLE_EQ(g.options.sampler.temperature, 0.7);  // generation_config.json
  EXPECT_EQ(g.options.stop_ids, std::vector<int32_t>{7});
  OrderedJson tool_none = body;
  tool_none["tool_choice"] = "none";
  EXPECT_TRUE(parse_chat_request(tool_none, defaults()).tools.is_null());
}

TEST(OpenAiApi, ContextLimitAndMtpDefaults) {
  SamplingFields s;
  s.max_tokens = 90;
  try {
    make_generation_request(std::vector<int32_t>(20, 1), s, defaults(), 0);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("maximum context length is 100 tokens"), std::string::npos)
        << e.what();
    EXPECT_EQ(error_json(400, e.what())["error"]["code"], "context_length_exceeded");
  }
  s.max_tokens = std::nullopt;
  GenerationRequest g = make_generation_request({1, 2}, s, defaults(), 16);
  EXPECT_EQ(g.options.max_tokens, 16);
  EXPECT_EQ(g.options.draft, 2);  // the server's default K, MTP on
  s.draft = 3;
  s.temperature = 0.0;
  g = make_generation_request({1, 2}, s, defaults(), 16);
  EXPECT_EQ(g.options.draft, 3);
  EXPECT_TRUE(g.options.sampler.greedy());
}

TEST(OpenAiApi, ErrorObjects) {
  const auto e = error_json(400, "'temperature' must be a number, got a string");
  EXPECT_EQ(e["error"]["message"], "'temperature' must be a number, got a string");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "temperature");
  EXPECT_TRUE(e["error"]["code"].is_null());
  EXPECT_EQ(error_json(401, "no key")["error"]["type"], "authentication_error");
  EXPECT_EQ(error_json(404, "The model 'x' does not exist")["error"]["code"], "model_not_found");
  EXPECT_EQ(error_json(503, "busy")["error"]["type"], "server_error");
  EXPECT_TRUE(error_json(500, "boom")["error"]["param"].is_null());
}

TEST(OpenAiApi, UsageCarriesMtpStats) {
  GenerationOutcome o;
  o.finish_reason = "length";
  o.stats.prompt_tokens = 5;
  o.stats.generated_tokens = 9;
  o.stats.mtp.draft = 2;
  o.stats.mtp.steps = 4;
  o.stats.mtp.drafted = 8;
  o.stats.mtp.accepted = 4;
  o.stats.mtp.drafted_by_position = {4, 4};
  o.stats.mtp.accepted_by_position = {3, 1};
  const auto usage = usage_json(o);
  EXPECT_EQ(usage["total_tokens"], 14);
  EXPECT_EQ(usage["mtp"]["acceptance_by_position"], nlohmann::json({0.75, 0.25}));
  EXPECT_DOUBLE_EQ(usage["mtp"]["mean_accepted_per_step"].get<double>(), 1.0);
  EXPECT_EQ(finish_reason(o, false), "length");
  EXPECT_EQ(finish_reason(o, true), "tool_calls");
  o.stats.mtp = MtpStats{};
  EXPECT_FALSE(usage_json(o).contains("mtp"));
}

TEST(Metrics, PrometheusExposition) {
  Metrics m;
  m.count_request("/v1/chat/completions", 200);
  m.count_request("/v1/chat/completions", 400);
  MtpStats mtp;
  mtp.drafted_by_position = {10, 8};
  mtp.accepted_by_position = {9, 5};
  mtp.steps = 10;
  m.count_finished(12, 30, "stop", mtp);
  m.observe_time_to_first_token(0.02);
  m.observe_inter_token_latency(0.003);
  m.observe_inter_token_latency(0.5);
  const std::string text = m.render(1, 2, 4);
  for (const char* line :
       {"mtpx_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "mtpx_request_errors_total{status=\"400\"} 1", "mtpx_completion_tokens_total 30",
        "mtpx_mtp_accepted_tokens_total{position=\"2\"} 5",
        "mtpx_time_to_first_token_seconds_bucket{le=\"0.025\"} 1",
        "mtpx_inter_token_latency_seconds_bucket{le=\"+Inf\"} 2", "mtpx_inter_token_latency_seconds_count 2",
        "# TYPE mtpx_time_to_first_token_seconds histogram", "mtpx_slots_busy 1", "mtpx_queue_length 2",
        "mtpx_generations_total{finish_reason=\"stop\"} 1"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
}

TEST(Fiber, YieldsResumesAndPassesExceptionsOn) {
  Fiber fiber(64 * 1024);
  std::vector<int> trace;
  fiber.start([&] {
    for (int i = 0; i < 3; ++i) {
      trace.push_back(i);
      fiber.yield();
    }
  });
  int resumes = 0;
  while (fiber.resume()) {
    ++resumes;
    trace.push_back(100);
  }
  EXPECT_EQ(resumes, 3);
  EXPECT_EQ(trace, (std::vector<int>{0, 100, 1, 100, 2, 100}));
  fiber.start([] { throw Error(ErrorKind::kInvalidInput, "inside"); });  // reused for a second body
  EXPECT_THROW(fiber.resume(), Error);
  EXPECT_FALSE(fiber.running());
}

}  // namespace
}  // namespace mtpx::server
