// Limits of one template render. A chat template is code that comes with the model, and the messages it
// renders come from clients: whatever either holds, a render must end in mtpx::Error (kInvalidInput) rather
// than exhaust the server's stack, memory or time. The limits are far above what real chat templates need
// (tests/fixtures/chat_template renders a conversation in well under 1% of each).
#pragma once

#include <cstddef>

namespace mtpx::jinja {

// Expressions and statement blocks nest at most this deep (the parser refuses deeper ones): the parser and
// the interpreter recurse once per level.
inline constexpr int kMaxNesting = 64;
// Lists and dicts nest at most this deep: printing, comparing and tojson recurse once per level.
inline constexpr int kMaxValueDepth = 128;
// Work per render, in units of about a microsecond (more under sanitizers): one per statement and call, per
// container element made or visited and per 32 bytes of text scanned; kLoopIterationWork per loop
// iteration (each makes a scope and a `loop` object).
inline constexpr size_t kMaxWork = 2'000'000;
inline constexpr size_t kLoopIterationWork = 25;
// Text and list data built per render: the output, concatenation, repetition, join, replace, tojson, ...
inline constexpr size_t kMaxBytes = size_t{256} << 20;

// Charge the render running on this thread (no-ops outside a render). Throw mtpx::Error past a limit.
void charge_work(size_t units);
void charge_bytes(size_t bytes);

// The budget of one render: Template::render holds one for its duration.
class RenderBudget {
 public:
  RenderBudget();   // becomes this thread's budget
  ~RenderBudget();  // restores the previous one
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;

 private:
  friend void charge_work(size_t units);
  friend void charge_bytes(size_t bytes);
  size_t work_ = 0;
  size_t bytes_ = 0;
  RenderBudget* previous_;
};

}  // namespace mtpx::jinja
