#include "server/openai_api.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <random>

#include "util/error.h"

namespace mtpx::server {
namespace {

const char* json_type_name(const OrderedJson& v) {
  switch (v.type()) {
    case OrderedJson::value_t::null:
      return "null";
    case OrderedJson::value_t::boolean:
      return "a boolean";
    case OrderedJson::value_t::number_integer:
    case OrderedJson::value_t::number_unsigned:
      return "an integer";
    case OrderedJson::value_t::number_float:
      return "a number";
    case OrderedJson::value_t::string:
      return "a string";
    case OrderedJson::value_t::array:
      return "an array";
    case OrderedJson::value_t::object:
      return "an object";
    default:
      return "a value";
  }
}

// The field, or nullptr when it is absent or null (OpenAI clients send null for "not set").
const OrderedJson* field(const OrderedJson& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// Whether an object's "type" is the string `expected` (`when_absent` when it has none). A "type" of another
// JSON type is simply not `expected`: nlohmann's value("type", "") throws type_error for it, which escaped
// as a crash (fuzz/corpus/fuzz_openai_request/finding-type-object).
bool type_is(const OrderedJson& obj, const char* expected, bool when_absent) {
  if (!obj.is_object()) return false;
  const OrderedJson* type = field(obj, "type");
  if (type == nullptr) return when_absent;
  return type->is_string() && type->get<std::string>() == expected;
}

std::optional<double> number_field(const OrderedJson& body, const char* name, double lo, double hi) {
  const OrderedJson* v = field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) invalid_input("'{}' must be a number, got {}", name, json_type_name(*v));
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) invalid_input("'{}' must be in [{}, {}], got {}", name, lo, hi, x);
  return x;
}

std::optional<int64_t> integer_field(const OrderedJson& body, const char* name, int64_t lo, int64_t hi) {
  const OrderedJson* v = field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number_integer()) invalid_input("'{}' must be an integer, got {}", name, json_type_name(*v));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) invalid_input("'{}' must be in [{}, {}], got {}", name, lo, hi, x);
  return x;
}

std::optional<bool> bool_field(const OrderedJson& body, const char* name) {
  const OrderedJson* v = field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) invalid_input("'{}' must be a boolean, got {}", name, json_type_name(*v));
  return v->get<bool>();
}

void check_model(const OrderedJson& body, const ServingDefaults& defaults) {
  const OrderedJson* model = field(body, "model");
  if (model == nullptr) return;  // mtpx serves one model: a missing name means it
  if (!model->is_string()) invalid_input("'model' must be a string, got {}", json_type_name(*model));
  if (model->get<std::string>() != defaults.model_id)
    fail(ErrorKind::kNotFound, "The model '{}' does not exist; this server serves '{}'",
         model->get<std::string>(), defaults.model_id);
}

// OpenAI features that change what is computed and that mtpx does not implement: refuse rather than
// silently ignore them.
void reject_unsupported(const OrderedJson& body) {
  if (auto n = integer_field(body, "n", 1, 128); n && *n != 1)
    fail(ErrorKind::kUnsupported, "'n' must be 1: mtpx generates one choice per request (got {})", *n);
  if (auto best_of = integer_field(body, "best_of", 1, 128); best_of && *best_of != 1)
    fail(ErrorKind::kUnsupported, "'best_of' must be 1 (got {})", *best_of);
  for (const char* penalty : {"presence_penalty", "frequency_penalty"})
    if (auto p = number_field(body, penalty, -2.0, 2.0); p && *p != 0.0)
      fail(ErrorKind::kUnsupported, "'{}' is not supported (only 0)", penalty);
  if (const OrderedJson* logprobs = field(body, "logprobs");
      logprobs != nullptr && !(logprobs->is_boolean() && !logprobs->get<bool>()))
    fail(ErrorKind::kUnsupported, "'logprobs' is not supported");
  if (const OrderedJson* bias = field(body, "logit_bias"); bias != nullptr && !bias->empty())
    fail(ErrorKind::kUnsupported, "'logit_bias' is not supported");
  if (const OrderedJson* format = field(body, "response_format"); format != nullptr) {
    if (!type_is(*format, "text", /*when_absent=*/false))
      fail(ErrorKind::kUnsupported, "'response_format' other than {{\"type\": \"text\"}} is not supported");
  }
}

SamplingFields parse_sampling(const OrderedJson& body, const ServingDefaults& defaults) {
  SamplingFields s;
  s.max_tokens = integer_field(body, "max_completion_tokens", 0, int64_t{1} << 30);
  if (!s.max_tokens) s.max_tokens = integer_field(body, "max_tokens", 0, int64_t{1} << 30);
  s.temperature = number_field(body, "temperature", 0.0, 100.0);
  s.top_p = number_field(body, "top_p", 0.0, 1.0);
  if (s.top_p && *s.top_p == 0.0) invalid_input("'top_p' must be greater than 0");
  s.min_p = number_field(body, "min_p", 0.0, 1.0);
  s.top_k = integer_field(body, "top_k", -1, int64_t{1} << 30);
  if (s.top_k && *s.top_k < 0) s.top_k = 0;  // -1 means off (vLLM's spelling)
  if (auto seed = integer_field(body, "seed", INT64_MIN, INT64_MAX)) s.seed = static_cast<uint64_t>(*seed);
  if (const OrderedJson* stop = field(body, "stop")) {
    if (stop->is_string()) {
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& item : *stop) {
        if (!item.is_string()) invalid_input("'stop' must be a string or an array of strings");
        s.stop.push_back(item.get<std::string>());
      }
      if (s.stop.size() > 16) invalid_input("'stop' may hold at most 16 strings, got {}", s.stop.size());
    } else {
      invalid_input("'stop' must be a string or an array of strings, got {}", json_type_name(*stop));
    }
    std::erase(s.stop, std::string());
  }
  s.stream = bool_field(body, "stream").value_or(false);
  if (const OrderedJson* options = field(body, "stream_options"); options != nullptr && !options->is_object())
    invalid_input("'stream_options' must be an object, got {}", json_type_name(*options));
  s.mtp = bool_field(body, "mtp");
  s.draft = integer_field(body, "draft", 1, kMaxDraft);
  if (s.mtp.value_or(false) && !defaults.mtp_available)
    invalid_input("'mtp': this model has no usable MTP head");
  reject_unsupported(body);
  return s;
}

// OpenAI message content (a string, null, or an array of parts) -> the string chat templates expect.
OrderedJson content_text(const OrderedJson& content, size_t index) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array())
    invalid_input("'messages[{}].content' must be a string, an array of parts or null, got {}", index,
                  json_type_name(content));
  std::string text;
  for (const auto& part : content) {
    if (!type_is(part, "text", /*when_absent=*/false) || !part.contains("text") || !part["text"].is_string())
      fail(ErrorKind::kUnsupported,
           "'messages[{}].content': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
           index);
    text += part["text"].get<std::string>();
  }
  return text;
}

OrderedJson normalize_messages(const OrderedJson& body) {
  const OrderedJson* messages = field(body, "messages");
  if (messages == nullptr) invalid_input("'messages' is required");
  if (!messages->is_array()) invalid_input("'messages' must be an array, got {}", json_type_name(*messages));
  if (messages->empty()) invalid_input("'messages' must not be empty");
  OrderedJson out = OrderedJson::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const OrderedJson& m = (*messages)[i];
    if (!m.is_object()) invalid_input("'messages[{}]' must be an object, got {}", i, json_type_name(m));
    OrderedJson message = m;
    const OrderedJson* role = field(m, "role");
    if (role == nullptr || !role->is_string()) invalid_input("'messages[{}].role' must be a string", i);
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool")
      invalid_input("'messages[{}].role' must be system, developer, user, assistant or tool, got '{}'", i, r);
    message["content"] = content_text(m.contains("content") ? m["content"] : OrderedJson(), i);
    if (message["content"].is_null() && r != "assistant")
      invalid_input("'messages[{}].content' is required for the {} role", i, r);
    if (const OrderedJson* calls = field(m, "tool_calls")) {
      if (!calls->is_array()) invalid_input("'messages[{}].tool_calls' must be an array", i);
      for (auto& call : message["tool_calls"]) {
        if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
            !call["function"].contains("name") || !call["function"]["name"].is_string())
          invalid_input("'messages[{}].tool_calls' entries need function.name", i);
        // OpenAI sends arguments as JSON text; templates (and the model) expect the object.
        auto& arguments = call["function"]["arguments"];
        if (arguments.is_string()) {
          auto parsed = OrderedJson::parse(arguments.get<std::string>(), nullptr, false);
          if (parsed.is_object()) arguments = parsed;
        }
      }
    }
    out.push_back(std::move(message));
  }
  return out;
}

std::string random_hex(size_t n) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}() ^ counter++);
  std::string s;
  while (s.size() < n) s += fmt::format("{:016x}", rng());
  return s.substr(0, n);
}

}  // namespace

OrderedJson parse_request_body(std::string_view body) {
  // Copying, comparing and printing JSON recurse once per level, and a body of 8 MiB can nest millions
  // deep: deeper than any real request (tool schemas take a handful of levels) is refused while parsing.
  const OrderedJson::parser_callback_t limit_nesting = [](int depth, OrderedJson::parse_event_t event,
                                                          OrderedJson&) {
    if ((event == OrderedJson::parse_event_t::object_start ||
         event == OrderedJson::parse_event_t::array_start) &&
        depth >= kMaxBodyNesting)
      invalid_input("the request body nests deeper than {} levels", kMaxBodyNesting);
    return true;
  };
  try {
    return OrderedJson::parse(body, limit_nesting);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number such as 1e400
    invalid_input("the request body is not valid JSON: {}", e.what());
  }
}

ChatRequest parse_chat_request(const OrderedJson& body, const ServingDefaults& defaults) {
  if (!body.is_object()) invalid_input("the request body must be a JSON object");
  check_model(body, defaults);
  ChatRequest r;
  r.sampling = parse_sampling(body, defaults);
  r.messages = normalize_messages(body);
  r.tools = nullptr;
  if (const OrderedJson* tools = field(body, "tools")) {
    if (!tools->is_array()) invalid_input("'tools' must be an array, got {}", json_type_name(*tools));
    for (size_t i = 0; i < tools->size(); ++i) {
      const OrderedJson& t = (*tools)[i];
      if (!type_is(t, "function", /*when_absent=*/true) || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string())
        invalid_input("'tools[{}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., ...}}}}",
                      i);
    }
    if (!tools->empty()) r.tools = *tools;
  }
  if (const OrderedJson* choice = field(body, "tool_choice")) {
    const std::string c = choice->is_string() ? choice->get<std::string>() : "";
    if (c == "none") {
      r.tools = nullptr;
    } else if (c != "auto") {
      fail(ErrorKind::kUnsupported,
           "'tool_choice' must be \"auto\" or \"none\" (forced tool calls are not supported)");
    }
  }
  r.template_kwargs = OrderedJson::object();
  if (const OrderedJson* kwargs = field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object())
      invalid_input("'chat_template_kwargs' must be an object, got {}", json_type_name(*kwargs));
    for (const auto& [key, value] : kwargs->items()) {
      if (key == "messages" || key == "tools" || key == "add_generation_prompt" || key == "documents")
        invalid_input("'chat_template_kwargs' may not set '{}'", key);
      r.template_kwargs[key] = value;
    }
  }
  return r;
}

CompletionRequest parse_completion_request(const OrderedJson& body, const ServingDefaults& defaults) {
  if (!body.is_object()) invalid_input("the request body must be a JSON object");
  check_model(body, defaults);
  CompletionRequest r;
  r.sampling = parse_sampling(body, defaults);
  for (const char* unsupported : {"echo", "suffix"})
    if (const OrderedJson* v = field(body, unsupported); v != nullptr &&
                                                         !(v->is_boolean() && !v->get<bool>()) &&
                                                         !(v->is_string() && v->get<std::string>().empty()))
      fail(ErrorKind::kUnsupported, "'{}' is not supported", unsupported);
  const OrderedJson* prompt = field(body, "prompt");
  if (prompt == nullptr) invalid_input("'prompt' is required");
  OrderedJson p = *prompt;
  // A batch of one prompt is the prompt; larger batches are n > 1 in disguise.
  if (p.is_array() && p.size() == 1 && (p[0].is_string() || p[0].is_array())) p = OrderedJson(p[0]);
  if (p.is_string()) {
    r.prompt_text = p.get<std::string>();
    if (r.prompt_text->empty()) invalid_input("'prompt' must not be empty");
  } else if (p.is_array() && !p.empty() &&
             std::all_of(p.begin(), p.end(), [](const auto& x) { return x.is_number_integer(); })) {
    for (const auto& id : p) {
      const int64_t v = id.get<int64_t>();
      if (v < 0 || v >= defaults.vocab_limit)
        invalid_input("'prompt': token id {} is outside the vocabulary [0, {})", v, defaults.vocab_limit);
      r.prompt_ids.push_back(static_cast<int32_t>(v));
    }
  } else if (p.is_array() && !p.empty()) {
    fail(ErrorKind::kUnsupported, "'prompt': one prompt per request (a string or an array of token ids)");
  } else {
    invalid_input("'prompt' must be a non-empty string or array of token ids, got {}", json_type_name(p));
  }
  return r;
}

GenerationRequest make_generation_request(std::vector<int32_t> prompt, const SamplingFields& s,
                                          const ServingDefaults& defaults, int64_t default_max_tokens) {
  if (prompt.empty()) invalid_input("the prompt is empty");
  const auto prompt_tokens = static_cast<int64_t>(prompt.size());
  const int64_t room = defaults.context - prompt_tokens;
  const int64_t max_tokens = s.max_tokens             ? *s.max_tokens
                             : default_max_tokens > 0 ? std::min(default_max_tokens, room)
                                                      : room;
  if (room <= 0 || prompt_tokens + max_tokens > defaults.context)
    invalid_input(
        "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the "
        "prompt, {} "
        "in the completion). Please reduce the prompt or the completion length.",
        defaults.context, prompt_tokens + std::max<int64_t>(max_tokens, 0), prompt_tokens,
        std::max<int64_t>(max_tokens, 0));

  GenerationRequest r;
  r.prompt = std::move(prompt);
  GenerateOptions& o = r.options;
  o.max_tokens = max_tokens;
  const SamplerParams d = sampler_defaults(defaults.generation);
  o.sampler.temperature = s.temperature.value_or(d.temperature);
  o.sampler.top_k = s.top_k.value_or(d.top_k);
  o.sampler.top_p = s.top_p.value_or(d.top_p);
  o.sampler.min_p = s.min_p.value_or(d.min_p);
  validate(o.sampler);
  // No seed: a fresh one, so unseeded requests differ as OpenAI's do.
  o.seed = s.seed ? *s.seed : std::random_device{}() * uint64_t{0x9e3779b97f4a7c15} + std::random_device{}();
  o.stop_ids = defaults.stop_ids;
  o.vocab_limit = defaults.vocab_limit;
  o.draft = s.mtp.value_or(defaults.mtp) ? s.draft.value_or(defaults.draft) : 0;
  o.draft_vocab = defaults.draft_vocab;
  r.stop_strings = s.stop;
  return r;
}

nlohmann::json usage_json(const GenerationOutcome& outcome) {
  const GenerateStats& st = outcome.stats;
  nlohmann::json usage = {{"prompt_tokens", st.prompt_tokens},
                          {"completion_tokens", st.generated_tokens},
                          {"total_tokens", st.prompt_tokens + st.generated_tokens}};
  const MtpStats& m = st.mtp;
  if (m.draft > 0) {
    usage["mtp"] = {{"draft", m.draft},
                    {"steps", m.steps},
                    {"drafted", m.drafted},
                    {"accepted", m.accepted},
                    {"acceptance", m.acceptance()},
                    {"acceptance_by_position", m.acceptance_by_position()},
                    {"mean_accepted_per_step", m.mean_accepted_per_step()}};
  }
  return usage;
}

nlohmann::json timings_json(const GenerationOutcome& outcome) {
  const GenerateStats& st = outcome.stats;
  return {{"time_to_first_token_ms", 1000.0 * outcome.time_to_first_token_seconds},
          {"prefill_tok_s", st.prefill_tok_s()},
          {"decode_tok_s", st.decode_tok_s()},
          {"decode_steps", st.decode_steps},
          {"tokens_per_step", st.decode_steps > 0 ? static_cast<double>(st.generated_tokens - 1) /
                                                        static_cast<double>(st.decode_steps)
                                                  : 0.0}};
}

std::string finish_reason(const GenerationOutcome& outcome, bool made_tool_calls) {
  if (made_tool_calls) return "tool_calls";
  return outcome.finish_reason == "length" ? "length" : "stop";
}

nlohmann::json tool_call_json(const ToolCall& call) {
  return {{"id", call.id},
          {"type", "function"},
          {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

nlohmann::json tool_call_delta_json(const ToolCall& call, int index) {
  nlohmann::json j = tool_call_json(call);
  j["index"] = index;
  return j;
}

ResponseHeader new_response_header(const std::string& prefix, const std::string& model) {
  ResponseHeader h;
  h.id = prefix + random_hex(24);
  h.created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  h.model = model;
  return h;
}

namespace {

// The fields every response object and chunk of the OpenAI API starts with.
nlohmann::json response_json(const ResponseHeader& header, const std::string& object,
                             nlohmann::json choices) {
  return {{"id", header.id},
          {"object", object},
          {"created", header.created},
          {"model", header.model},
          {"choices", std::move(choices)}};
}

// The one choice this server returns: `field` ("message", "delta" or "text") holds the content.
nlohmann::json single_choice(const char* field, nlohmann::json content, nlohmann::json finish_reason) {
  return nlohmann::json::array({{{"index", 0},
                                 {field, std::move(content)},
                                 {"logprobs", nullptr},
                                 {"finish_reason", std::move(finish_reason)}}});
}

nlohmann::json reason_or_null(const std::optional<std::string>& reason) {
  return reason ? nlohmann::json(*reason) : nlohmann::json();
}

nlohmann::json with_usage(nlohmann::json response, const GenerationOutcome& outcome) {
  response["usage"] = usage_json(outcome);
  response["timings"] = timings_json(outcome);
  return response;
}

}  // namespace

nlohmann::json chat_completion_json(const ResponseHeader& header, const std::string& text,
                                    bool parse_tool_calls, const GenerationOutcome& outcome) {
  nlohmann::json message = {{"role", "assistant"}, {"content", text}};
  bool made_tool_calls = false;
  if (parse_tool_calls) {
    ContentAndToolCalls split = extract_tool_calls(text);
    if (!split.tool_calls.empty()) {
      made_tool_calls = true;
      message["content"] = split.content.empty() ? nlohmann::json() : nlohmann::json(split.content);
      message["tool_calls"] = nlohmann::json::array();
      for (const ToolCall& call : split.tool_calls) message["tool_calls"].push_back(tool_call_json(call));
    }
  }
  return with_usage(
      response_json(header, "chat.completion",
                    single_choice("message", std::move(message), finish_reason(outcome, made_tool_calls))),
      outcome);
}

nlohmann::json chat_chunk_json(const ResponseHeader& header, nlohmann::json delta,
                               const std::optional<std::string>& reason) {
  return response_json(header, "chat.completion.chunk",
                       single_choice("delta", std::move(delta), reason_or_null(reason)));
}

nlohmann::json text_completion_json(const ResponseHeader& header, const std::string& text,
                                    const GenerationOutcome& outcome) {
  return with_usage(
      response_json(header, "text_completion", single_choice("text", text, finish_reason(outcome, false))),
      outcome);
}

nlohmann::json text_chunk_json(const ResponseHeader& header, const std::string& text,
                               const std::optional<std::string>& reason) {
  return response_json(header, "text_completion", single_choice("text", text, reason_or_null(reason)));
}

nlohmann::json usage_chunk_json(const ResponseHeader& header, const std::string& object,
                                const GenerationOutcome& outcome) {
  return with_usage(response_json(header, object, nlohmann::json::array()), outcome);
}

nlohmann::json error_json(int status, const std::string& message) {
  std::string type = "invalid_request_error";
  nlohmann::json code = nullptr;
  switch (status) {
    case 401:
      type = "authentication_error";
      code = "invalid_api_key";
      break;
    case 404:
      code = message.rfind("The model", 0) == 0 ? "model_not_found" : "not_found";
      break;
    case 408:
      code = "request_timeout";
      break;
    case 413:
      code = "request_too_large";
      break;
    case 503:
      type = "server_error";
      code = "server_overloaded";
      break;
    default:
      if (status >= 500) type = "server_error";
  }
  if (message.find("maximum context length") != std::string::npos) code = "context_length_exceeded";
  nlohmann::json param = nullptr;
  if (message.size() > 2 && message[0] == '\'') {
    const size_t end = message.find('\'', 1);
    if (end != std::string::npos) param = message.substr(1, end - 1);
  }
  return {{"error", {{"message", message}, {"type", type}, {"param", param}, {"code", code}}}};
}

}  // namespace mtpx::server
