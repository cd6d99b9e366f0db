#include "server/scheduler.h"

#include <omp.h>

#include <utility>

#include "server/text_stream.h"

namespace mtpx::server {

GenerationJob::GenerationJob(GenerationRequest request)
    : request_(std::move(request)), submitted_at_(Clock::now()) {}

GenerationJob::Update GenerationJob::wait_for_update(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return finished_ || !unread_text_.empty(); });
  Update update;
  update.text = std::move(unread_text_);
  unread_text_.clear();
  update.finished = finished_;
  return update;
}

void GenerationJob::append_text(std::string_view text) {
  if (text.empty()) return;
  {
    std::lock_guard lock(mutex_);
    unread_text_ += text;
  }
  changed_.notify_all();
}

void GenerationJob::finish(GenerationOutcome outcome) {
  {
    std::lock_guard lock(mutex_);
    outcome_ = std::move(outcome);
    finished_ = true;
  }
  changed_.notify_all();
}

Scheduler::Scheduler(const Model& model, const Tokenizer& tokenizer, Metrics& metrics, int slots,
                     int max_queue, int threads)
    : model_(model), tokenizer_(tokenizer), metrics_(metrics), max_queue_(max_queue), threads_(threads) {
  if (slots < 1) invalid_input("--parallel must be at least 1, got {}", slots);
  for (int i = 0; i < slots; ++i) slots_.push_back(std::make_unique<Slot>());
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { shutdown(); }

void Scheduler::shutdown() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_arrived_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Scheduler::submit(const std::shared_ptr<GenerationJob>& job) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || jobs_in_system_ >= static_cast<int64_t>(slots_.size()) + max_queue_) return false;
    ++jobs_in_system_;
    queue_.push_back(job);
  }
  work_arrived_.notify_one();
  return true;
}

int64_t Scheduler::queued() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(queue_.size());
}

bool Scheduler::wait_for_work() {
  std::unique_lock lock(mutex_);
  work_arrived_.wait(lock, [&] { return stopping_ || !queue_.empty() || busy_slots_ > 0; });
  return !stopping_;
}

void Scheduler::admit_queued_jobs() {
  std::lock_guard lock(mutex_);
  for (auto& slot : slots_) {
    if (slot->job || queue_.empty()) continue;
    slot->job = std::move(queue_.front());
    queue_.pop_front();
    ++busy_slots_;
    Slot* s = slot.get();
    slot->fiber.start([this, s] { generate_in_slot(*s); });
  }
}

void Scheduler::run() {
  // The OpenMP thread count is per thread: set it on the thread that runs the forward passes.
  if (threads_ > 0) omp_set_num_threads(threads_);
  while (true) {
    const bool stopping = !wait_for_work();
    if (!stopping) admit_queued_jobs();
    // Every busy slot runs up to its next pass (trunk or head) or its end; then their passes run together.
    // When stopping, the jobs are cancelled and run to their end.
    for (auto& slot : slots_) {
      if (!slot->job) continue;
      if (stopping) slot->job->cancel();
      if (slot->fiber.resume()) continue;
      slot->job.reset();
      --busy_slots_;
      std::lock_guard lock(mutex_);
      --jobs_in_system_;
    }
    run_posted_passes();
    if (stopping && busy_slots_ == 0) break;
  }
  // Jobs still queued never started: tell their clients.
  std::lock_guard lock(mutex_);
  for (auto& job : queue_) {
    GenerationOutcome outcome;
    outcome.finish_reason = "cancelled";
    outcome.error = Error(ErrorKind::kInternal, "the server is shutting down");
    job->finish(std::move(outcome));
  }
  queue_.clear();
}

void Scheduler::run_posted_passes() {
  // Each slot posted at most one pass; an invalid one fails its own request only (checked before any runs).
  std::vector<SequenceForward> passes;
  std::vector<MtpSequenceForward> head_passes;
  std::vector<Slot*> posted;
  for (auto& slot : slots_) {
    try {
      if (slot->pass) {
        model_.check_forward(*slot->pass);
        passes.push_back(*slot->pass);
        posted.push_back(slot.get());
      } else if (slot->head_pass) {
        check_mtp_forward(model_, *slot->head_pass);
        head_passes.push_back(*slot->head_pass);
        posted.push_back(slot.get());
      }
    } catch (...) {
      slot->pass_error = std::current_exception();
    }
    slot->pass.reset();
    slot->head_pass.reset();
  }
  if (posted.empty()) return;
  metrics_.count_engine_step(static_cast<int64_t>(posted.size()));
  try {
    if (!passes.empty()) model_.forward_batch(passes);
    if (!head_passes.empty()) mtp_forward_batch(model_, head_passes);
  } catch (...) {  // the computation failed (NaN or Inf logits): every request of the step ends with it
    for (Slot* slot : posted) slot->pass_error = std::current_exception();
  }
}

void Scheduler::generate_in_slot(Slot& slot) {
  GenerationJob& job = *slot.job;
  const GenerationRequest& request = job.request();
  GenerationOutcome outcome;
  if (job.cancelled()) {  // the client left while the job was queued
    outcome.finish_reason = "cancelled";
    metrics_.count_finished(0, 0, outcome.finish_reason, {});
    job.finish(std::move(outcome));
    return;
  }
  TextStream text(tokenizer_, request.stop_strings, request.options.stop_ids);
  GenerateOptions options = request.options;
  options.cancelled = [&] { return job.cancelled() || text.stopped(); };
  options.run_forward = [&](const SequenceForward& pass) {
    slot.pass = pass;
    slot.fiber.yield();  // the scheduler runs the passes of all slots together
    if (slot.pass_error) std::rethrow_exception(std::exchange(slot.pass_error, nullptr));
  };
  options.run_head_forward = [&](const MtpSequenceForward& pass) {
    slot.head_pass = pass;
    slot.fiber.yield();
    if (slot.pass_error) std::rethrow_exception(std::exchange(slot.pass_error, nullptr));
  };
  Clock::time_point last_token_at;
  bool first = true;
  auto on_token = [&](int32_t id) {
    const Clock::time_point now = Clock::now();
    if (first) {
      outcome.time_to_first_token_seconds = std::chrono::duration<double>(now - job.submitted_at()).count();
      metrics_.observe_time_to_first_token(outcome.time_to_first_token_seconds);
      first = false;
    } else {
      metrics_.observe_inter_token_latency(std::chrono::duration<double>(now - last_token_at).count());
    }
    last_token_at = now;
    job.append_text(text.push(id));
  };
  try {
    GenerateResult result = generate(model_, request.prompt, options, on_token);
    job.append_text(text.finish());
    outcome.finish_reason = text.stopped() ? "stop" : result.finish_reason;
    outcome.tokens = std::move(result.tokens);
    outcome.stats = result.stats;
  } catch (const Error& e) {
    outcome.error = e;
  } catch (const std::exception& e) {
    outcome.error = Error(ErrorKind::kInternal, e.what());
  }
  if (outcome.error) outcome.finish_reason = "error";
  metrics_.count_finished(outcome.stats.prompt_tokens, outcome.stats.generated_tokens, outcome.finish_reason,
                          outcome.stats.mtp);
  job.finish(std::move(outcome));
}

}  // namespace mtpx::server
