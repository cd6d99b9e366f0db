// mtpx serve: the flags of the OpenAI-compatible server, and its life cycle (bind, serve, stop on
// SIGINT/SIGTERM).
#include <fmt/core.h>
#include <pthread.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <thread>

#include "cli/common.h"
#include "decode/generate.h"
#include "server/http_server.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct ServeFlags {
  std::string model;
  server::ServerOptions options;
  bool quiet = false;
};

int run_serve(ServeFlags& f) {
  f.options.model_dir = resolve_model_dir(f.model);
  f.options.log_requests = !f.quiet;
  // Signals go to one watcher thread (sigwait) instead of interrupting whichever thread they hit; the
  // mask is set before any thread starts, so every thread inherits it.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that hangs up is a failed write, not the end of the server
  // One descriptor per connection: the usual soft limit (1024) is below the HTTP threads' maximum.
  if (rlimit files{}; getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const rlim_t wanted = std::min<rlim_t>(files.rlim_max, 65536);
    if (files.rlim_cur < wanted) {
      files.rlim_cur = wanted;
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }

  server::Server server(f.options);
  const int port = server.bind();
  std::fprintf(stderr, "mtpx serve: listening on http://%s:%d | %s\n", f.options.host.c_str(), port,
               server.describe().c_str());
  std::fflush(stderr);

  std::thread watcher([&] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    server.stop();
  });
  server.serve();
  server.stop();
  pthread_kill(watcher.native_handle(), SIGTERM);  // wakes the watcher if no signal came
  watcher.join();
  return 0;
}

}  // namespace

std::function<int()> add_serve_command(CLI::App& app) {
  auto f = std::make_shared<ServeFlags>();
  server::ServerOptions& o = f->options;
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--host", o.host, "address to listen on (127.0.0.1: this machine only)")
      ->capture_default_str();
  app.add_option("--port", o.port, "TCP port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' on /v1/* and /metrics");
  app.add_option("--parallel", o.parallel, "requests generating at once (slots)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--queue", o.max_queue, "requests waiting for a slot before 503")
      ->check(CLI::Range(0, 100000))
      ->capture_default_str();
  app.add_option("--threads", o.threads, "worker threads of the forward passes (default: all cores)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--device", o.device, "where the forward passes run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--draft", o.draft,
                 fmt::format("MTP draft depth K (default: the tuned profile's, else {})", kDefaultDraft))
      ->check(CLI::Range(int64_t{1}, int64_t{8}));
  app.add_option("--draft-vocab", o.draft_vocab,
                 "MTP drafts only from the first N token ids (the head's lm_head pass reads N rows; exact at "
                 "any N)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_flag_callback(
      "--mtp", [f] { f->options.mtp = true; },
      "MTP speculative decoding for requests that do not say (the default)");
  app.add_flag_callback(
      "--no-mtp", [f] { f->options.mtp = false; },
      "plain decoding for requests that do not say (they may ask for MTP)");
  app.add_option("--ctx-size", o.context,
                 "most tokens per request, prompt + completion (default: min(model, 8192))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--max-tokens-default", o.max_tokens_default,
                 "tokens a chat request without max_tokens may generate before it stops with finish_reason "
                 "\"length\" (/v1/completions keeps OpenAI's 16)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--max-body", o.max_body_bytes, "largest request body in bytes (default 8 MiB; larger: 413)")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 30));
  app.add_option("--request-timeout", o.request_timeout,
                 "seconds a client has to send a whole request, headers and body (then 408)")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  app.add_flag("--quiet", f->quiet, "no request log on stderr");
  return [f] { return run_serve(*f); };
}

}  // namespace mtpx::cli
