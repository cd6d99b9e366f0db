#include "server/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <utility>

#include "util/error.h"

namespace mtpx::server {

Fiber::Fiber(size_t stack_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes_ = (stack_bytes + page - 1) / page * page;
  mapped_bytes_ = stack_bytes_ + page;
  stack_ = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1, 0);
  if (stack_ == MAP_FAILED) fail(ErrorKind::kInternal, "cannot map a {} byte fiber stack", mapped_bytes_);
  // The stack grows down: an overflow hits this page and faults instead of corrupting memory.
  mprotect(stack_, page, PROT_NONE);
}

Fiber::~Fiber() { munmap(stack_, mapped_bytes_); }

void Fiber::start(std::function<void()> body) {
  if (running_) fail(ErrorKind::kInternal, "Fiber::start while a body is running");
  body_ = std::move(body);
  escaped_ = nullptr;
  getcontext(&body_context_);
  body_context_.uc_stack.ss_sp = static_cast<char*>(stack_) + (mapped_bytes_ - stack_bytes_);
  body_context_.uc_stack.ss_size = stack_bytes_;
  body_context_.uc_link = &caller_;  // where the context goes when entry() returns
  // makecontext passes only int arguments: the pointer travels as two halves.
  const auto self = reinterpret_cast<uintptr_t>(this);
  makecontext(&body_context_, reinterpret_cast<void (*)()>(&Fiber::entry), 2,
              static_cast<unsigned int>(self & 0xffffffffu), static_cast<unsigned int>(self >> 32));
  running_ = true;
}

void Fiber::entry(unsigned int low, unsigned int high) {
  auto* fiber = reinterpret_cast<Fiber*>((static_cast<uintptr_t>(high) << 32) | low);
  try {
    fiber->body_();
  } catch (...) {
    fiber->escaped_ = std::current_exception();  // cannot unwind past this frame: hand it to resume()
  }
  fiber->body_ = nullptr;
  fiber->running_ = false;
}

bool Fiber::resume() {
  if (!running_) return false;
  swapcontext(&caller_, &body_context_);
  if (escaped_) std::rethrow_exception(std::exchange(escaped_, nullptr));
  return running_;
}

void Fiber::yield() { swapcontext(&body_context_, &caller_); }

}  // namespace mtpx::server
