// `mtpx serve`: an OpenAI-compatible HTTP server over one model (cpp-httplib). This file holds the HTTP
// layer only: routes, authentication, body limits, Server-Sent Events, client disconnects. Requests
// become GenerationJobs for the Scheduler (scheduler.h); the wire format lives in openai_api.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

namespace mtpx::server {

struct ServerOptions {
  std::filesystem::path model_dir;
  std::string host = "127.0.0.1";
  int port = 8080;             // 0: any free port (see Server::port())
  std::string api_key;         // non-empty: /v1/* and /metrics need "Authorization: Bearer <key>"
  int parallel = 4;            // generation slots
  int max_queue = 64;          // requests waiting for a slot before 503
  int threads = 0;             // worker threads of the forward passes (0: all cores)
  std::string device = "cpu";  // where the forward passes run: cpu or cuda
  int64_t draft = 0;           // MTP draft depth K; 0: the tuned profile's, else kDefaultDraft
  int64_t draft_vocab = 0;     // GenerateOptions::draft_vocab for every MTP request (0: whole vocabulary)
  bool mtp = true;             // MTP on by default (when the model has a head)
  int64_t context = 0;         // positions per request; 0: min(model's maximum, 8192)
  // Tokens a chat request without max_tokens / max_completion_tokens may generate before it stops with
  // finish_reason "length" (when no stop token came first); never more than the context leaves.
  // /v1/completions keeps OpenAI's default of 16.
  int64_t max_tokens_default = 2048;
  size_t max_body_bytes = size_t{8} << 20;
  int request_timeout = 20;  // seconds for a request's line, headers and body to arrive (then 408)
  bool log_requests = true;  // one line per request on stderr
};

class Server {
 public:
  // Loads the model, tokenizer, chat template and generation defaults; throws mtpx::Error naming the
  // problem (missing tokenizer, bad flag values, ...).
  explicit Server(ServerOptions options);
  ~Server();

  // Binds host:port; throws mtpx::Error (kInvalidInput) when it cannot. Returns the port bound.
  int bind();
  // Serves until stop() (from another thread or a signal watcher).
  void serve();
  void stop();

  // One line describing what is served (model, MTP, slots), for the startup message.
  std::string describe() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace mtpx::server
