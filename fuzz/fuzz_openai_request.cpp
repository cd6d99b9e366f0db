// libFuzzer target: the server's request bodies, from the bytes of a POST to the engine's work, as
// http_server.cpp runs them: parse_request_body, then
//   - /v1/chat/completions: parse_chat_request, the chat template (tests/fixtures/chat_template/
//     qwen35_style.jinja: tools, tool calls, thinking), the tokenizer, make_generation_request;
//   - /v1/completions: parse_completion_request, the tokenizer, make_generation_request.
// Anything a client can send must end in a request or an mtpx::Error (an HTTP 4xx); other exceptions
// would be HTTP 500s, crashes take the server down.
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "io/model_config.h"
#include "server/chat_template.h"
#include "server/openai_api.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace {

using namespace mtpx;
using namespace mtpx::server;

struct Fixture {
  Tokenizer tokenizer;
  ChatTemplate chat_template;
  ServingDefaults defaults;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Tokenizer tokenizer = Tokenizer::from_json(fuzz::read_source_file("models/default/tokenizer.json"),
                                               "models/default/tokenizer.json");
    ChatTemplate chat_template(
        fuzz::read_source_file("tests/fixtures/chat_template/qwen35_style.jinja"),
        nlohmann::ordered_json{{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}});
    ServingDefaults d;
    d.model_id = "default";
    d.generation = parse_generation_config(
        parse_json_text(fuzz::read_source_file("models/default/generation_config.json"),
                        "generation_config.json"),
        "generation_config.json");
    d.mtp_available = true;
    d.mtp = true;
    d.draft = 2;
    d.context = 8192;
    d.stop_ids = d.generation.eos_token_ids;
    d.vocab_limit = tokenizer.vocab_size();
    return Fixture{std::move(tokenizer), std::move(chat_template), d};
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& f = fixture();
  OrderedJson body;
  try {
    body = parse_request_body(fuzz::as_text(data, size));
  } catch (const Error&) {
    return 0;
  }
  try {
    const ChatRequest chat = parse_chat_request(body, f.defaults);
    const std::string prompt = f.chat_template.apply(chat.messages, chat.tools, chat.template_kwargs, true);
    (void)make_generation_request(f.tokenizer.encode(prompt), chat.sampling, f.defaults, 0);
  } catch (const Error&) {
  }
  try {
    const CompletionRequest completion = parse_completion_request(body, f.defaults);
    std::vector<int32_t> prompt =
        completion.prompt_text ? f.tokenizer.encode(*completion.prompt_text) : completion.prompt_ids;
    (void)make_generation_request(std::move(prompt), completion.sampling, f.defaults, 16);
  } catch (const Error&) {
  }
  return 0;
}
