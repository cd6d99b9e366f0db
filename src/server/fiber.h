// A stackful coroutine on the calling thread. The server runs each request's generate() call inside one,
// so that one scheduler thread can run the requests' decode steps in turn (see scheduler.h for why).
#pragma once

#include <ucontext.h>

#include <cstddef>
#include <exception>
#include <functional>

namespace mtpx::server {

class Fiber {
 public:
  // Reserves the stack once (mapped lazily, with a guard page below it); a fiber is reused for many bodies.
  explicit Fiber(size_t stack_bytes = size_t{8} << 20);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Sets the function the next resume() starts. Only when no body is running.
  void start(std::function<void()> body);
  // Runs the body until it calls yield() or returns; true while the body has not returned. Rethrows an
  // exception that escaped the body.
  bool resume();
  // From inside the body: back to the caller of resume(); the next resume() continues from here.
  void yield();
  bool running() const { return running_; }

 private:
  static void entry(unsigned int low, unsigned int high);

  void* stack_ = nullptr;  // [guard page | stack]
  size_t mapped_bytes_ = 0;
  size_t stack_bytes_ = 0;
  ucontext_t caller_{};
  ucontext_t body_context_{};
  std::function<void()> body_;
  bool running_ = false;
  std::exception_ptr escaped_;
};

}  // namespace mtpx::server
