// The HTTP layer in process, with httplib's client: routes, OpenAI error objects (400/401/404/413),
// SSE framing, the greedy output of /v1/completions, and the LIFO worker pool. (The end-to-end tests with
// the OpenAI SDK, curl and a browser are in tests/server/.)
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "decode/generate.h"
#include "model/qwen35.h"
#include "server/http_server.h"
#include "server/thread_pool.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace fs = std::filesystem;

namespace mtpx::server {
namespace {

using test_paths::kDefaultModel;

class RunningServer {
 public:
  explicit RunningServer(ServerOptions options, int port = 0) {
    options.model_dir = kDefaultModel;
    options.port = port;
    options.log_requests = false;
    if (options.draft == 0) options.draft = 1;  // MTP on with K=1, whatever a `mtpx tune` profile says
    server_ = std::make_unique<Server>(options);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->serve(); });
  }
  ~RunningServer() {
    server_->stop();
    thread_.join();
  }
  int port() const { return port_; }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60);
    return c;
  }

 private:
  std::unique_ptr<Server> server_;
  int port_ = 0;
  std::thread thread_;
};

RunningServer& shared_server() {
  static RunningServer server{ServerOptions{}};
  return server;
}

nlohmann::json error_of(const httplib::Result& r, int status) {
  EXPECT_TRUE(r);
  EXPECT_EQ(r->status, status) << r->body;
  auto j = nlohmann::json::parse(r->body);
  EXPECT_EQ(j["error"].size(), 4u) << r->body;  // message, type, param, code
  return j["error"];
}

TEST(HttpServer, HealthModelsAndPage) {
  auto c = shared_server().client();
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(nlohmann::json::parse(health->body)["status"], "ok");
  auto models = nlohmann::json::parse(c.Get("/v1/models")->body);
  EXPECT_EQ(models["data"][0]["id"], "default");
  EXPECT_TRUE(models["data"][0]["mtp"]["enabled"].get<bool>());
  // The defaults a request without sampler fields gets: the shipped model's generation_config.json
  // (T 0.7, top-p 0.95, top-k 20) and the chat max_tokens default.
  const auto& d = models["data"][0]["defaults"];
  EXPECT_DOUBLE_EQ(d["temperature"].get<double>(), 0.7);
  EXPECT_DOUBLE_EQ(d["top_p"].get<double>(), 0.95);
  EXPECT_EQ(d["top_k"], 20);
  EXPECT_EQ(d["max_tokens"], 2048);
  for (const char* icon : {"/favicon.ico", "/favicon.svg"}) {
    auto r = c.Get(icon);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << icon;
    EXPECT_EQ(r->get_header_value("Content-Type"), "image/svg+xml");
    EXPECT_EQ(r->body.rfind("<svg", 0), 0u);
  }
  auto page = c.Get("/");
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page->body.find("/v1/chat/completions"), std::string::npos);
  EXPECT_NE(c.Get("/metrics")->body.find("# TYPE mtpx_requests_total counter"), std::string::npos);
}

TEST(HttpServer, GreedyCompletionEqualsGenerate) {
  auto model = Model::load(kDefaultModel);
  auto tokenizer = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
  GenerateOptions o;
  o.max_tokens = 24;
  o.sampler.temperature = 0.0;
  o.stop_ids = {*tokenizer.token_to_id("<|im_end|>"), *tokenizer.token_to_id("<|endoftext|>")};
  o.vocab_limit = tokenizer.vocab_size();
  auto want = generate(*model, tokenizer.encode("def add(a, b):"), o);
  auto r = shared_server().client().Post(
      "/v1/completions", R"({"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0})",
      "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = nlohmann::json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["text"], tokenizer.decode(want.tokens));
  EXPECT_EQ(j["usage"]["completion_tokens"], 24);
  EXPECT_EQ(j["usage"]["mtp"]["draft"], 1);
}

TEST(HttpServer, StreamIsSseEndingWithUsageAndDone) {
  auto r = shared_server().client().Post(
      "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true, "mtp": false})",
      "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  std::vector<std::string> frames;
  for (size_t pos = 0; pos < r->body.size();) {
    const size_t end = r->body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << r->body;
    frames.push_back(r->body.substr(pos, end - pos));
    pos = end + 2;
  }
  ASSERT_GE(frames.size(), 4u);
  EXPECT_EQ(frames.back(), "data: [DONE]");
  auto usage = nlohmann::json::parse(frames[frames.size() - 2].substr(6));
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_FALSE(usage["usage"].contains("mtp"));  // "mtp": false
  EXPECT_EQ(nlohmann::json::parse(frames[0].substr(6))["choices"][0]["delta"]["role"], "assistant");
}

TEST(HttpServer, ErrorsHaveTheOpenAiShape) {
  auto c = shared_server().client();
  EXPECT_EQ(error_of(c.Post("/v1/chat/completions", "{not json", "application/json"), 400)["type"],
            "invalid_request_error");
  EXPECT_EQ(error_of(c.Post("/v1/completions", R"({"prompt": "x", "model": "other"})", "application/json"),
                     404)["code"],
            "model_not_found");
  EXPECT_EQ(error_of(c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 99999})", "application/json"),
                     400)["code"],
            "context_length_exceeded");
  EXPECT_EQ(
      error_of(c.Post("/v1/completions", R"({"prompt": "x", "n": 3})", "application/json"), 400)["param"],
      "n");
  error_of(c.Get("/v1/nowhere"), 404);
}

TEST(HttpServer, ApiKeyAndBodyLimit) {
  ServerOptions options;
  options.api_key = "k3y";
  options.max_body_bytes = 2048;
  options.parallel = 1;
  RunningServer server(options);
  auto c = server.client();
  EXPECT_EQ(error_of(c.Get("/v1/models"), 401)["type"], "authentication_error");
  httplib::Headers wrong = {{"Authorization", "Bearer nope"}}, right = {{"Authorization", "Bearer k3y"}};
  error_of(c.Get("/v1/models", wrong), 401);
  EXPECT_EQ(c.Get("/v1/models", right)->status, 200);
  EXPECT_EQ(c.Get("/health")->status, 200);  // open without the key
  const std::string big = R"({"prompt": ")" + std::string(4000, 'x') + R"("})";
  error_of(c.Post("/v1/completions", right, big, "application/json"), 413);
}

TEST(HttpServer, ChatWithoutMaxTokensStopsAtTheDefault) {
  ServerOptions options;
  options.max_tokens_default = 6;
  options.parallel = 1;
  RunningServer server(options);
  auto r = server.client().Post(
      "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "def fib(n):"}], "temperature": 0, "mtp": false})",
      "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = nlohmann::json::parse(r->body);
  const int64_t tokens = j["usage"]["completion_tokens"];
  EXPECT_GE(tokens, 1);
  EXPECT_LE(tokens, 6);  // not the rest of the 8192-token context
  if (j["choices"][0]["finish_reason"] == "length") {
    EXPECT_EQ(tokens, 6);
  }
  // An explicit max_tokens still wins over the default.
  r = server.client().Post("/v1/chat/completions",
                           R"({"messages": [{"role": "user", "content": "def fib(n):"}], "temperature": 0, )"
                           R"("max_tokens": 9, "mtp": false})",
                           "application/json");
  ASSERT_TRUE(r);
  j = nlohmann::json::parse(r->body);
  if (j["choices"][0]["finish_reason"] == "length") {
    EXPECT_EQ(j["usage"]["completion_tokens"], 9);
  }
  EXPECT_LE(j["usage"]["completion_tokens"].get<int64_t>(), 9);
}

TEST(HttpServer, AUsedPortIsRefusedAndAFreedOneRebindsAtOnce) {
  int port = 0;
  {
    RunningServer first{ServerOptions{}};
    port = first.port();
    // A second server on the same port must fail to bind (no SO_REUSEPORT sharing of the port).
    ServerOptions second;
    second.model_dir = kDefaultModel;
    second.port = port;
    second.log_requests = false;
    Server intruder(second);
    try {
      intruder.bind();
      ADD_FAILURE() << "a second server bound port " << port;
    } catch (const mtpx::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
    }
    // The first still answers every request (none went to the intruder).
    for (int i = 0; i < 4; ++i) EXPECT_EQ(first.client().Get("/health")->status, 200);
  }
  // The connections above left TIME_WAIT entries on the port: SO_REUSEADDR lets a restart bind it at once.
  RunningServer restarted(ServerOptions{}, port);
  EXPECT_EQ(restarted.port(), port);
  EXPECT_EQ(restarted.client().Get("/health")->status, 200);
}

TEST(HttpServer, AKeptAliveConnectionIsNoSlowerThanAFreshOne) {
  // Without TCP_NODELAY every request after the first on a kept-alive connection waited for the client's
  // delayed ACK (~40 ms on Linux: 2.3 ms fresh, 43.6 ms reused, measured with curl). OpenAI clients keep
  // their connections alive, so every call paid it. Medians of 7 one-token requests each way; the margin
  // (20 ms) is half the stall, far above the noise of a request this small.
  const std::string body = R"({"prompt": "def f(x):", "max_tokens": 1, "temperature": 0})";
  auto ms_since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> fresh, reused;
  // The client sets TCP_NODELAY itself, as curl and the OpenAI SDKs' HTTP stacks do (httplib's client does
  // not by default, and would then stall on its own side): what is measured is the server.
  httplib::Client kept = shared_server().client();
  kept.set_keep_alive(true);
  kept.set_tcp_nodelay(true);
  ASSERT_EQ(kept.Post("/v1/completions", body, "application/json")->status, 200);  // opens the connection
  for (int i = 0; i < 7; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    httplib::Client once = shared_server().client();
    once.set_tcp_nodelay(true);
    ASSERT_EQ(once.Post("/v1/completions", body, "application/json")->status, 200);
    fresh.push_back(ms_since(t0));
    t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(kept.Post("/v1/completions", body, "application/json")->status, 200);
    reused.push_back(ms_since(t0));
  }
  std::sort(fresh.begin(), fresh.end());
  std::sort(reused.begin(), reused.end());
  EXPECT_LT(reused[3], fresh[3] + 20.0) << "median ms: kept-alive " << reused[3] << ", fresh " << fresh[3];
}

TEST(LifoThreadPool, ReusesTheMostRecentlyIdleThreadAndDrainsOnShutdown) {
  std::set<std::thread::id> used;
  std::mutex mutex;
  std::atomic<int> done{0};
  {
    LifoThreadPool pool(8);
    for (int i = 0; i < 20; ++i) {
      pool.enqueue([&] {
        std::lock_guard lock(mutex);
        used.insert(std::this_thread::get_id());
        ++done;
      });
      while (done <= i) std::this_thread::yield();                 // one job at a time
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // its thread is idle again
    }
    EXPECT_LE(used.size(),
              2u);  // sequential jobs stay on the warm thread (a FIFO pool rotates through all 8)
    for (int i = 0; i < 50; ++i)
      pool.enqueue([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++done;
      });
    pool.shutdown();  // runs what is queued first
  }
  EXPECT_EQ(done, 70);
}

}  // namespace
}  // namespace mtpx::server
