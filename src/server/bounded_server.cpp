#include "server/bounded_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <string_view>

namespace mtpx::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How often a connection waiting for its next keep-alive request checks that the server still runs.
constexpr milliseconds kStopPollInterval{100};

// poll() one socket for `events` up to `timeout`; > 0 when ready, 0 on timeout, < 0 on error.
int poll_socket(int sock, short events, milliseconds timeout) {
  pollfd p{sock, events, 0};
  const int ms = static_cast<int>(std::max<milliseconds::rep>(0, timeout.count()));
  while (true) {
    const int n = ::poll(&p, 1, ms);
    if (n < 0 && errno == EINTR) continue;
    return n;
  }
}

milliseconds to_ms(time_t sec, time_t usec) { return milliseconds(sec * 1000 + usec / 1000); }

// The socket stream of one connection, as httplib's own (buffered reads, a timeout on every read and
// write), plus the bounds of the request being read: once it is too slow or too large, reads fail, and
// writes too, so that httplib's answer to the half-read request (a 400) does not go out; the caller
// sends a 408 or 413 instead (send_all).
class BoundedStream : public httplib::Stream {
 public:
  BoundedStream(int sock, milliseconds read_timeout, milliseconds write_timeout)
      : sock_(sock), read_timeout_(read_timeout), write_timeout_(write_timeout) {}

  // A new request starts: it must be read by `deadline`, in at most `max_bytes`.
  void start_request(Clock::time_point deadline, size_t max_bytes) {
    deadline_ = deadline;
    max_bytes_ = max_bytes;
    read_ = written_ = 0;
    refusal_ = 0;
  }
  // 408 or 413 when the request broke a bound, else 0.
  int refusal() const { return refusal_; }
  size_t written() const { return written_; }
  bool has_buffered_input() const { return begin_ < end_; }

  bool is_readable() const override { return has_buffered_input() || wait_for_input() > 0; }

  bool is_writable() const override {
    return poll_socket(sock_, POLLOUT, write_timeout_) > 0 && peer_still_there();
  }

  ssize_t read(char* ptr, size_t size) override {
    if (refusal_ != 0) return -1;
    if (!has_buffered_input()) {
      if (wait_for_input() <= 0) return -1;
      ssize_t n;
      do {
        n = ::recv(sock_, buffer_.data(), buffer_.size(), 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - begin_);
    if (read_ + n > max_bytes_) {
      refusal_ = 413;
      return -1;
    }
    std::memcpy(ptr, buffer_.data() + begin_, n);
    begin_ += n;
    read_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (refusal_ != 0) return -1;
    return send_some(ptr, size);
  }

  void send_all(std::string_view text) {
    for (size_t done = 0; done < text.size();) {
      const ssize_t n = send_some(text.data() + done, text.size() - done);
      if (n < 0) return;
      done += static_cast<size_t>(n);
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) describe(addr, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) describe(addr, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // Waits for input up to the read timeout, cut short by the request deadline (408 once it passed).
  int wait_for_input() const {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
    if (left <= milliseconds(0)) {
      refusal_ = 408;
      return 0;
    }
    const int n = poll_socket(sock_, POLLIN, std::min(read_timeout_, left + milliseconds(1)));
    if (n == 0 && Clock::now() >= deadline_) refusal_ = 408;
    return n;
  }

  // Sends what fits now. MSG_DONTWAIT: a partial write returns at once (httplib calls again), and a client
  // that stopped reading fails the next is_writable() after the write timeout instead of blocking here.
  ssize_t send_some(const char* ptr, size_t size) {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(sock_, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n > 0) written_ += static_cast<size_t>(n);
    return n;
  }

  // A peer that closed its side reads as end of file; one that is still there has nothing to say (or
  // has pipelined its next request).
  bool peer_still_there() const {
    char byte;
    const ssize_t n = ::recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }

  static void describe(const sockaddr_storage& addr, std::string& ip, int& port) {
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
      ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
      port = ntohs(a.sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
      ::inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof(text));
      port = ntohs(a.sin6_port);
    }
    ip = text;
  }

  const int sock_;
  const milliseconds read_timeout_;
  const milliseconds write_timeout_;
  Clock::time_point deadline_ = Clock::time_point::max();
  size_t max_bytes_ = 0;
  size_t read_ = 0;          // bytes of the current request handed to httplib
  size_t written_ = 0;       // bytes of the current request's response sent
  mutable int refusal_ = 0;  // 408 / 413 once a bound is broken
  std::array<char, 4096> buffer_{};
  size_t begin_ = 0, end_ = 0;  // unread input in buffer_
};

}  // namespace

bool BoundedServer::process_and_close_socket(socket_t sock) {
  BoundedStream stream(sock, to_ms(read_timeout_sec_, read_timeout_usec_),
                       to_ms(write_timeout_sec_, write_timeout_usec_));
  const milliseconds keep_alive = to_ms(keep_alive_timeout_sec_, 0);
  bool ok = false;
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    // Between requests: wait for the next one's first byte up to the keep-alive timeout, in short
    // slices so that stop() does not wait for idle connections.
    bool arrived = stream.has_buffered_input();
    for (auto waited = milliseconds(0); !arrived && waited < keep_alive && svr_sock_ != INVALID_SOCKET;
         waited += kStopPollInterval) {
      const int n = poll_socket(sock, POLLIN, std::min(kStopPollInterval, keep_alive - waited));
      if (n < 0) break;
      arrived = n > 0;
    }
    if (!arrived) break;
    stream.start_request(Clock::now() + bounds_.request_timeout, bounds_.max_request_bytes);
    bool connection_closed = false;
    ok = process_request(stream, /*close_connection=*/left == 1, connection_closed, nullptr);
    if (const int status = stream.refusal(); status != 0) {
      // Too slow or too large: say so (unless the response had started), then hang up.
      if (stream.written() == 0) {
        const std::string body = bounds_.error_body ? bounds_.error_body(status) : std::string();
        stream.send_all(
            fmt::format("HTTP/1.1 {}\r\nConnection: close\r\nContent-Type: application/json\r\n"
                        "Content-Length: {}\r\n\r\n{}",
                        status == 408 ? "408 Request Timeout" : "413 Payload Too Large", body.size(), body));
      }
      if (bounds_.on_refused) bounds_.on_refused(status);
      ok = false;
      break;
    }
    if (!ok || connection_closed) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace mtpx::server
