#include "server/http_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "decode/generate.h"
#include "io/model_config.h"
#include "model/qwen35.h"
#include "server/bounded_server.h"
#include "server/chat_page.h"
#include "server/chat_template.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/scheduler.h"
#include "server/thread_pool.h"
#include "server/tool_calls.h"
#include "tokenizer/tokenizer.h"
#include "tools/runtime_profile.h"
#include "util/error.h"

namespace mtpx::server {
namespace {

// How often a response waiting for tokens checks that its client is still there.
constexpr auto kPollInterval = std::chrono::milliseconds(100);
// At most one write per interval and stream: tokens that come faster are sent together. Waking an HTTP
// thread for every token would preempt the OpenMP team of the forward passes (2 cores, spinning threads).
constexpr auto kMinWriteInterval = std::chrono::milliseconds(10);
constexpr int kListenBacklog = 512;
constexpr size_t kSpareHttpThreads = 1024;
constexpr size_t kKeepAliveMaxRequests = 1000;
constexpr int64_t kDefaultContextCap = 8192;
constexpr int64_t kCompletionsDefaultMaxTokens = 16;  // OpenAI's default for /v1/completions

std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& res, int status, const std::string& message) {
  send_json(res, status, error_json(status, message));
}

// Constant time in the key's length, so the comparison does not leak how much of a guess was right.
bool same_secret(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

// Relays a job's text to `on_text` as it comes, while checking that the client is still connected.
// False when the client went away or a write failed (the job is then cancelled).
template <typename OnText>
bool relay(GenerationJob& job, httplib::DataSink& sink, OnText on_text) {
  while (true) {
    if (!sink.is_writable()) {
      job.cancel();
      return false;
    }
    GenerationJob::Update update = job.wait_for_update(kPollInterval);
    if (!update.text.empty() && !on_text(update.text)) {
      job.cancel();
      return false;
    }
    if (update.finished) return true;
    if (!update.text.empty()) std::this_thread::sleep_for(kMinWriteInterval);
  }
}

bool write_event(httplib::DataSink& sink, const nlohmann::json& event) {
  const std::string line = "data: " + dump(event) + "\n\n";
  return sink.write(line.data(), line.size());
}

bool write_done(httplib::DataSink& sink) {
  static const std::string kDone = "data: [DONE]\n\n";
  return sink.write(kDone.data(), kDone.size());
}

}  // namespace

struct Server::State {
  ServerOptions options;
  std::unique_ptr<Model> model;
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;
  std::string chat_template_problem;  // why there is none (no template, or one this interpreter cannot parse)
  ServingDefaults defaults;
  Metrics metrics;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<BoundedServer> http;  // created once the options are known
  int port = 0;
  int listen_socket = -1;    // the bound socket, to raise its listen backlog (see bind())
  std::string draft_source;  // where the default K came from (--draft, the tuned profile, the default)
  int64_t created = 0;

  bool authorized(const httplib::Request& req) const {
    if (options.api_key.empty()) return true;
    return same_secret(req.get_header_value("Authorization"), "Bearer " + options.api_key);
  }

  // Wraps a handler: authentication, errors -> OpenAI error objects, the request counter.
  template <typename Handler>
  httplib::Server::Handler route(const char* endpoint, bool needs_key, Handler handler) {
    return [this, endpoint, needs_key, handler](const httplib::Request& req, httplib::Response& res) {
      try {
        if (needs_key && !authorized(req)) {
          send_error(res, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'");
        } else {
          handler(req, res);
        }
      } catch (const Error& e) {
        send_error(res, http_status_for(e.kind()), e.what());
      } catch (const std::bad_alloc&) {
        send_error(res, 500, "out of memory");
      } catch (const std::exception& e) {
        send_error(res, 500, fmt::format("internal error: {}", e.what()));
      }
      metrics.count_request(endpoint, res.status);
    };
  }

  std::shared_ptr<GenerationJob> submit(GenerationRequest request, httplib::Response& res) {
    auto job = std::make_shared<GenerationJob>(std::move(request));
    if (!scheduler->submit(job)) {
      res.set_header("Retry-After", "1");
      send_error(res, 503,
                 fmt::format("The server is busy ({} slots and a queue of {} are full); retry later",
                             scheduler->slots(), options.max_queue));
      return nullptr;
    }
    return job;
  }

  void handle_chat(const httplib::Request& req, httplib::Response& res) {
    ChatRequest chat = parse_chat_request(parse_request_body(req.body), defaults);
    if (!chat_template)
      fail(ErrorKind::kUnsupported, "the model '{}' has no usable chat template ({}): use /v1/completions",
           defaults.model_id, chat_template_problem);
    const std::string prompt = chat_template->apply(chat.messages, chat.tools, chat.template_kwargs, true);
    auto job = submit(make_generation_request(tokenizer->encode(prompt), chat.sampling, defaults,
                                              options.max_tokens_default),
                      res);
    if (!job) return;
    const ResponseHeader header = new_response_header("chatcmpl-", defaults.model_id);
    const bool parse_tool_calls = !chat.tools.is_null();
    if (chat.sampling.stream) {
      stream_chat(res, job, header, parse_tool_calls);
    } else {
      respond_when_done(res, job,
                        [header, parse_tool_calls](const std::string& text, const GenerationOutcome& o) {
                          return chat_completion_json(header, text, parse_tool_calls, o);
                        });
    }
  }

  void handle_completion(const httplib::Request& req, httplib::Response& res) {
    CompletionRequest completion = parse_completion_request(parse_request_body(req.body), defaults);
    std::vector<int32_t> prompt =
        completion.prompt_text ? tokenizer->encode(*completion.prompt_text) : completion.prompt_ids;
    auto job = submit(make_generation_request(std::move(prompt), completion.sampling, defaults,
                                              kCompletionsDefaultMaxTokens),
                      res);
    if (!job) return;
    const ResponseHeader header = new_response_header("cmpl-", defaults.model_id);
    if (completion.sampling.stream) {
      stream_completion(res, job, header);
    } else {
      respond_when_done(res, job, [header](const std::string& text, const GenerationOutcome& o) {
        return text_completion_json(header, text, o);
      });
    }
  }

  // Non-streaming: the body is written when the job ends. It still goes out through a content provider,
  // because that is where httplib lets the server notice a client that hung up (and cancel its job).
  template <typename MakeBody>
  void respond_when_done(httplib::Response& res, const std::shared_ptr<GenerationJob>& job,
                         MakeBody make_body) {
    res.status = 200;
    res.set_chunked_content_provider(
        "application/json",
        [job, make_body](size_t, httplib::DataSink& sink) {
          std::string text;
          if (!relay(*job, sink, [&](const std::string& piece) {
                text += piece;
                return true;
              }))
            return false;
          const GenerationOutcome& outcome = job->outcome();
          // Headers are out already: a generation that failed reports its error in the body.
          const std::string body =
              dump(outcome.error ? error_json(http_status_for(outcome.error->kind()), outcome.error->what())
                                 : make_body(text, outcome));
          sink.write(body.data(), body.size());
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel();
        });
  }

  void stream_chat(httplib::Response& res, const std::shared_ptr<GenerationJob>& job,
                   const ResponseHeader& header, bool parse_tool_calls) {
    res.status = 200;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, header, parse_tool_calls](size_t, httplib::DataSink& sink) {
          ToolCallStream tool_calls;
          int calls_sent = 0;
          // Content and tool calls go out as separate chunks, in the order the model wrote them.
          auto send_pieces = [&](const std::vector<ToolCallStream::Piece>& pieces) {
            for (const auto& piece : pieces) {
              nlohmann::json delta =
                  piece.call
                      ? nlohmann::json{{"tool_calls", {tool_call_delta_json(*piece.call, calls_sent++)}}}
                      : nlohmann::json{{"content", piece.content}};
              if (!write_event(sink, chat_chunk_json(header, std::move(delta), std::nullopt))) return false;
            }
            return true;
          };
          if (!write_event(sink,
                           chat_chunk_json(header, {{"role", "assistant"}, {"content", ""}}, std::nullopt)))
            return false;
          const bool finished = relay(*job, sink, [&](const std::string& text) {
            if (parse_tool_calls) return send_pieces(tool_calls.push(text));
            return write_event(sink, chat_chunk_json(header, {{"content", text}}, std::nullopt));
          });
          if (!finished) return false;
          const GenerationOutcome& outcome = job->outcome();
          if (outcome.error) {
            write_event(sink, error_json(http_status_for(outcome.error->kind()), outcome.error->what()));
          } else {
            if (parse_tool_calls && !send_pieces(tool_calls.finish())) return false;
            write_event(sink, chat_chunk_json(header, nlohmann::json::object(),
                                              finish_reason(outcome, calls_sent > 0)));
            write_event(sink, usage_chunk_json(header, "chat.completion.chunk", outcome));
          }
          write_done(sink);
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel();
        });
  }

  void stream_completion(httplib::Response& res, const std::shared_ptr<GenerationJob>& job,
                         const ResponseHeader& header) {
    res.status = 200;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [job, header](size_t, httplib::DataSink& sink) {
          const bool finished = relay(*job, sink, [&](const std::string& text) {
            return write_event(sink, text_chunk_json(header, text, std::nullopt));
          });
          if (!finished) return false;
          const GenerationOutcome& outcome = job->outcome();
          if (outcome.error) {
            write_event(sink, error_json(http_status_for(outcome.error->kind()), outcome.error->what()));
          } else {
            write_event(sink, text_chunk_json(header, "", finish_reason(outcome, false)));
            write_event(sink, usage_chunk_json(header, "text_completion", outcome));
          }
          write_done(sink);
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel();
        });
  }

  nlohmann::json models_json() const {
    const SamplerParams sampler = sampler_defaults(defaults.generation);
    return {
        {"object", "list"},
        {"data",
         {{{"id", defaults.model_id},
           {"object", "model"},
           {"created", created},
           {"owned_by", "mtpx"},
           {"context_length", defaults.context},
           {"mtp",
            {{"available", defaults.mtp_available}, {"enabled", defaults.mtp}, {"draft", defaults.draft}}},
           // What a request that leaves these out gets (the chat page shows them as placeholders).
           {"defaults",
            {{"temperature", sampler.temperature},
             {"top_p", sampler.top_p},
             {"top_k", sampler.top_k},
             {"min_p", sampler.min_p},
             {"max_tokens", std::min(options.max_tokens_default, defaults.context)}}},
           {"chat_template", chat_template.has_value()}}}}};
  }

  void install_routes() {
    http->Get("/", route("/", false, [](const httplib::Request&, httplib::Response& res) {
                res.set_content(std::string(chat_page_html()), "text/html; charset=utf-8");
              }));
    // The page's icon (also where browsers look without a <link rel="icon">): no 404 in their consoles.
    for (const char* path : {"/favicon.ico", "/favicon.svg"}) {
      http->Get(path, route(path, false, [](const httplib::Request&, httplib::Response& res) {
                  res.set_header("Cache-Control", "max-age=86400");
                  res.set_content(std::string(chat_page_icon_svg()), "image/svg+xml");
                }));
    }
    http->Get("/health", route("/health", false, [this](const httplib::Request&, httplib::Response& res) {
                send_json(res, 200,
                          {{"status", "ok"},
                           {"model", defaults.model_id},
                           {"slots", scheduler->slots()},
                           {"slots_busy", scheduler->busy_slots()},
                           {"queued", scheduler->queued()}});
              }));
    http->Get("/v1/models",
              route("/v1/models", true, [this](const httplib::Request&, httplib::Response& res) {
                send_json(res, 200, models_json());
              }));
    http->Get("/metrics", route("/metrics", true, [this](const httplib::Request&, httplib::Response& res) {
                res.set_content(
                    metrics.render(scheduler->busy_slots(), scheduler->queued(), scheduler->slots()),
                    "text/plain; version=0.0.4");
              }));
    http->Post("/v1/chat/completions",
               route("/v1/chat/completions", true,
                     [this](const httplib::Request& req, httplib::Response& res) { handle_chat(req, res); }));
    http->Post("/v1/completions",
               route("/v1/completions", true, [this](const httplib::Request& req, httplib::Response& res) {
                 handle_completion(req, res);
               }));
    // Errors httplib produces itself (404 for unknown paths, 413 for oversized bodies, 400 for bad
    // requests) get the OpenAI error shape too; the handlers' own errors already have a body.
    http->set_error_handler(
        httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
          std::string message = res.status == 404 ? fmt::format("No route {} {}", req.method, req.path)
                                : res.status == 413
                                    ? fmt::format("The request body is larger than the limit of {} bytes",
                                                  options.max_body_bytes)
                                    : fmt::format("HTTP {}", res.status);
          res.set_content(dump(error_json(res.status, message)), "application/json");
          metrics.count_request("other", res.status);  // never reached a route
          return httplib::Server::HandlerResponse::Handled;
        }));
    if (options.log_requests)
      http->set_logger([](const httplib::Request& req, const httplib::Response& res) {
        std::fprintf(stderr, "[serve] %s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
      });
  }
};

Server::Server(ServerOptions options) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.options = std::move(options);
  const ServerOptions& o = s.options;
  if (o.port < 0 || o.port > 65535) invalid_input("--port must be in [0, 65535], got {}", o.port);
  if (o.parallel < 1 || o.parallel > 256) invalid_input("--parallel must be in [1, 256], got {}", o.parallel);
  if (o.max_queue < 0) invalid_input("--queue must be >= 0, got {}", o.max_queue);
  if (o.request_timeout < 1) invalid_input("--request-timeout must be >= 1, got {}", o.request_timeout);

  s.model = Model::load(o.model_dir);
  s.model->use_device(o.device);
  if (!std::filesystem::exists(o.model_dir / "tokenizer.json"))
    invalid_input("'{}' has no tokenizer.json: the server needs one", o.model_dir.string());
  s.tokenizer = Tokenizer::from_file(o.model_dir / "tokenizer.json");
  // A template this interpreter cannot parse disables chat, not the server: completions still work.
  try {
    s.chat_template = ChatTemplate::from_model_dir(o.model_dir);
    if (!s.chat_template) s.chat_template_problem = "tokenizer_config.json has none";
  } catch (const Error& e) {
    s.chat_template_problem = e.what();
    std::fprintf(stderr, "mtpx serve: warning: chat disabled: %s\n", e.what());
  }

  ServingDefaults& d = s.defaults;
  d.model_id = std::filesystem::weakly_canonical(o.model_dir).filename().string();
  d.generation = load_generation_config(o.model_dir / "generation_config.json");
  d.stop_ids = d.generation.eos_token_ids;
  for (int32_t id : s.model->config().eos_token_ids) d.stop_ids.push_back(id);
  d.vocab_limit = std::min<int64_t>(s.tokenizer->vocab_size(), s.model->config().vocab_size);
  const int64_t model_max = s.model->config().max_position_embeddings;
  d.context = o.context > 0 ? o.context
                            : std::min(model_max > 0 ? model_max : kDefaultContextCap, kDefaultContextCap);
  if (model_max > 0 && d.context > model_max)
    invalid_input("--ctx-size {} is beyond the model's {} positions", d.context, model_max);
  d.mtp_available = s.model->mtp() != nullptr;
  d.draft = o.draft;
  d.draft_vocab = o.draft_vocab;
  bool mtp = o.mtp;
  s.draft_source = "--draft";
  // K and the draft vocabulary from `mtpx tune`'s runtime profile when there is a valid one and the flags
  // leave them open (K = 0 there: plain decoding was faster on this machine, so MTP starts off); else
  // generate's defaults.
  std::optional<tools::TunedDecoding> tuned;
  if (d.draft == 0 || d.draft_vocab == 0) {
    try {
      tuned = tools::tuned_decoding(o.model_dir, tools::profile_device(*s.model));
    } catch (const std::exception&) {
    }
  }
  const tools::TunedDecoding chosen = tools::decoding_or_default(tuned);
  if (d.draft_vocab == 0) d.draft_vocab = chosen.draft_vocab;
  if (d.draft == 0) {
    d.draft = chosen.draft;
    if (tuned && tuned->draft == 0) mtp = false;
    s.draft_source = !tuned             ? "default"
                     : tuned->draft > 0 ? "tuned profile"
                                        : "tuned profile: plain decoding is faster";
  }
  if (d.draft < 1 || d.draft > kMaxDraft)
    invalid_input("--draft must be in [1, {}], got {}", kMaxDraft, d.draft);
  d.mtp = mtp && d.mtp_available;

  // Headers (httplib allows 8 KiB per line) and chunked framing get 1 MiB on top of the body limit.
  s.http = std::make_unique<BoundedServer>(RequestBounds{
      .request_timeout = std::chrono::seconds(o.request_timeout),
      .max_request_bytes = o.max_body_bytes + (size_t{1} << 20),
      .error_body =
          [&s](int status) {
            const std::string message =
                status == 408
                    ? fmt::format("The request was not received within {} s", s.options.request_timeout)
                    : fmt::format("The request body is larger than the limit of {} bytes",
                                  s.options.max_body_bytes);
            return dump(error_json(status, message));
          },
      .on_refused = [&s](int status) { s.metrics.count_request("other", status); }});
  s.created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  s.scheduler =
      std::make_unique<Scheduler>(*s.model, *s.tokenizer, s.metrics, o.parallel, o.max_queue, o.threads);

  // Each open connection holds one HTTP thread (httplib is thread-per-connection): one for every slot and
  // queue place, plus room for /health, /metrics, quick refusals and clients that connect and are slow to
  // ask (each held at most --request-timeout). Threads start only when needed.
  const size_t http_threads = static_cast<size_t>(o.parallel + o.max_queue) + kSpareHttpThreads;
  s.http->new_task_queue = [http_threads] { return new LifoThreadPool(http_threads); };
  s.http->set_payload_max_length(o.max_body_bytes);
  // httplib closes a keep-alive connection after 5 requests by default; reconnecting clients then arrive
  // in bursts. An API client reuses its connection for many requests.
  s.http->set_keep_alive_max_count(kKeepAliveMaxRequests);
  // Not httplib's default_socket_options: it sets SO_REUSEPORT too, and then a second server on the same
  // port also "listens" and the kernel splits connections between the two (any local process could take
  // over a running server's port). SO_REUSEADDR alone lets a restarted server rebind at once while the old
  // connections sit in TIME_WAIT, and a port held by a listening socket still refuses the bind.
  // TCP_NODELAY: httplib writes a response as headers then body; with Nagle's algorithm on, the body waits
  // for the client's delayed ACK of the headers (~40 ms) on every request of a kept-alive connection after
  // the first (measured: 2.3 ms fresh, 43.6 ms reused). Accepted sockets inherit it from the listening one.
  s.http->set_socket_options([&s](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    s.listen_socket = sock;
  });
  s.install_routes();
}

Server::~Server() { stop(); }

int Server::bind() {
  State& s = *state_;
  if (s.options.port == 0) {
    s.port = s.http->bind_to_any_port(s.options.host);
    if (s.port < 0) invalid_input("cannot bind to {} (any port)", s.options.host);
  } else {
    if (!s.http->bind_to_port(s.options.host, s.options.port))
      invalid_input("cannot bind to {}:{} (in use, or not an address of this machine)", s.options.host,
                    s.options.port);
    s.port = s.options.port;
  }
  // Debian's httplib listens with a backlog of 5: a burst of connections (32 clients reconnecting at
  // once) overflows it, the kernel drops SYNs and clients wait for retransmits (1 s, 3 s, 7 s, ... up to
  // minutes). Listening again on the bound socket raises the backlog.
  if (s.listen_socket >= 0) ::listen(s.listen_socket, kListenBacklog);
  return s.port;
}

void Server::serve() { state_->http->listen_after_bind(); }

void Server::stop() {
  // Finish the jobs first: httplib joins its threads on stop, and those threads wait for their jobs.
  state_->scheduler->shutdown();
  state_->http->stop();
}

std::string Server::describe() const {
  const State& s = *state_;
  const ServingDefaults& d = s.defaults;
  const std::string vocab = d.draft_vocab > 0 ? fmt::format(", draft vocabulary {}", d.draft_vocab) : "";
  const std::string mtp = d.mtp ? fmt::format("on (K={}{}, {})", d.draft, vocab, s.draft_source)
                          : !d.mtp_available
                              ? std::string("unavailable (no MTP head)")
                              : fmt::format("off ({})", s.options.mtp ? s.draft_source : "--no-mtp");
  return fmt::format(
      "model '{}' ({}), MTP {}, {} slots, queue {}, context {}, chat max_tokens default {}, chat template: "
      "{}",
      d.model_id, s.options.model_dir.string(), mtp, s.scheduler->slots(), s.options.max_queue, d.context,
      s.options.max_tokens_default, s.chat_template ? "yes" : "none");
}

}  // namespace mtpx::server
