// The OpenAI wire format: request bodies -> validated requests, results -> response and chunk objects,
// errors -> {"error": {"message", "type", "param", "code"}}. No HTTP and no model here: the HTTP layer
// (http_server.cpp) calls these, the scheduler runs what they describe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/model_config.h"
#include "server/scheduler.h"
#include "server/tool_calls.h"

namespace mtpx::server {

using OrderedJson = nlohmann::ordered_json;  // request JSON keeps its key order (tool schemas render as sent)

// What a request falls back on, from the model and the command line.
struct ServingDefaults {
  std::string model_id;
  GenerationConfig generation;  // sampler defaults (generation_config.json)
  bool mtp_available = false;   // the model has a usable MTP head
  bool mtp = false;             // MTP on unless the request says otherwise
  int64_t draft = 1;            // K unless the request says otherwise
  int64_t draft_vocab = 0;      // GenerateOptions::draft_vocab (serve --draft-vocab)
  int64_t context = 0;          // most positions per request: prompt + completion
  std::vector<int32_t> stop_ids;
  int64_t vocab_limit = 0;
};

// Sampling and decoding fields shared by both endpoints (absent fields stay unset).
struct SamplingFields {
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::optional<bool> mtp;
  std::optional<int64_t> draft;
  bool stream = false;
};

struct ChatRequest {
  SamplingFields sampling;
  OrderedJson messages;         // normalized: content is a string (or null), tool call arguments objects
  OrderedJson tools;            // null when none (or tool_choice "none")
  OrderedJson template_kwargs;  // chat_template_kwargs, an object
};

struct CompletionRequest {
  SamplingFields sampling;
  std::optional<std::string> prompt_text;  // or
  std::vector<int32_t> prompt_ids;
};

// The body of a POST as JSON; throws mtpx::Error (kInvalidInput) when it is not valid JSON or nests
// objects and arrays deeper than kMaxBodyNesting.
inline constexpr int kMaxBodyNesting = 64;
OrderedJson parse_request_body(std::string_view body);

// Validate a body; throw mtpx::Error: kInvalidInput (400) naming the field, kNotFound (404) for another
// model, kUnsupported (400) for valid OpenAI features mtpx does not do (n > 1, logprobs, ...).
ChatRequest parse_chat_request(const OrderedJson& body, const ServingDefaults& defaults);
CompletionRequest parse_completion_request(const OrderedJson& body, const ServingDefaults& defaults);

// The engine's work for a tokenized prompt; checks prompt + max_tokens against the context.
// `default_max_tokens`: when the request has none (0: the rest of the context).
GenerationRequest make_generation_request(std::vector<int32_t> prompt, const SamplingFields& sampling,
                                          const ServingDefaults& defaults, int64_t default_max_tokens);

// ---- responses ----

// usage: prompt/completion/total tokens, and mtp (draft, steps, drafted, accepted, acceptance,
// acceptance_by_position, mean_accepted_per_step) when the request used MTP.
nlohmann::json usage_json(const GenerationOutcome& outcome);
// Speeds of the request, for the chat page and clients that want them (not an OpenAI field).
nlohmann::json timings_json(const GenerationOutcome& outcome);
// OpenAI's finish_reason for an outcome: "stop", "length" or "tool_calls".
std::string finish_reason(const GenerationOutcome& outcome, bool made_tool_calls);

nlohmann::json tool_call_json(const ToolCall& call);
nlohmann::json tool_call_delta_json(const ToolCall& call, int index);

// The fields every object of one response shares.
struct ResponseHeader {
  std::string id;  // chatcmpl-... / cmpl-...
  int64_t created = 0;
  std::string model;
};
ResponseHeader new_response_header(const std::string& prefix, const std::string& model);

nlohmann::json chat_completion_json(const ResponseHeader& header, const std::string& text,
                                    bool parse_tool_calls, const GenerationOutcome& outcome);
nlohmann::json chat_chunk_json(const ResponseHeader& header, nlohmann::json delta,
                               const std::optional<std::string>& finish_reason);
nlohmann::json text_completion_json(const ResponseHeader& header, const std::string& text,
                                    const GenerationOutcome& outcome);
nlohmann::json text_chunk_json(const ResponseHeader& header, const std::string& text,
                               const std::optional<std::string>& finish_reason);
// The last chunk of a stream: no choices, the usage (and timings).
nlohmann::json usage_chunk_json(const ResponseHeader& header, const std::string& object,
                                const GenerationOutcome& outcome);

// {"error": {"message", "type", "param", "code"}} for an HTTP status. `param` is the request field a
// validation message starts with ('temperature' must be ...), when it does.
nlohmann::json error_json(int status, const std::string& message);

}  // namespace mtpx::server
