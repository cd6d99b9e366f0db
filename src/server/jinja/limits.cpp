#include "server/jinja/limits.h"

#include "util/error.h"

namespace mtpx::jinja {
namespace {

// Per thread, because a render runs start to end on the thread that called it (builtins have no other
// way to reach the budget of the render that calls them).
thread_local RenderBudget* current_budget = nullptr;

}  // namespace

RenderBudget::RenderBudget() : previous_(current_budget) { current_budget = this; }
RenderBudget::~RenderBudget() { current_budget = previous_; }

void charge_work(size_t units) {
  RenderBudget* budget = current_budget;
  if (budget == nullptr) return;
  if (units > kMaxWork - budget->work_)
    invalid_input("the template did more than {} steps of work (an endless or runaway loop?)", kMaxWork);
  budget->work_ += units;
}

void charge_bytes(size_t bytes) {
  RenderBudget* budget = current_budget;
  if (budget == nullptr) return;
  if (bytes > kMaxBytes - budget->bytes_)
    invalid_input("the template built more than {} MiB of text and lists", kMaxBytes >> 20);
  budget->bytes_ += bytes;
}

}  // namespace mtpx::jinja
