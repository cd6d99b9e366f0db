// httplib::Server with every request bounded in time and size while it is read. httplib (0.11) bounds
// each single read (5 s) but not a request as a whole, so a client that sends one byte of its headers
// every few seconds (slowloris) holds an HTTP thread forever, and enough of them take every thread. It
// checks Content-Length against the payload limit, but reads a chunked body (and any number of header
// lines) to the end into memory. Here the request line, headers and body must arrive within
// `request_timeout` of the request's first byte (else 408) and take at most `max_request_bytes` on the wire
// (else 413); either way the connection is then closed. Writing the response (a long SSE stream) is not
// bounded by these: it only waits for the client to read (httplib's write timeout).
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace mtpx::server {

struct RequestBounds {
  std::chrono::milliseconds request_timeout{20000};
  size_t max_request_bytes = size_t{9} << 20;  // request line + headers + body, as sent
  // The body of the 408 / 413 answer (called with the status), and a hook run for each refusal; both on
  // the connection's thread.
  std::function<std::string(int status)> error_body;
  std::function<void(int status)> on_refused;
};

class BoundedServer : public httplib::Server {
 public:
  explicit BoundedServer(RequestBounds bounds) : bounds_(std::move(bounds)) {}

 private:
  // httplib calls this (virtual) for every accepted connection, on a thread of its task queue: the
  // keep-alive loop of httplib's own version, over a stream that enforces the bounds.
  bool process_and_close_socket(socket_t sock) override;

  const RequestBounds bounds_;
};

}  // namespace mtpx::server
