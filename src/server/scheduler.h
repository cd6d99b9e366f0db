// Generation scheduling for the server: a fixed number of slots (--parallel), a bounded queue behind them,
// and one scheduler thread that runs every model step.
//
// Why one thread: every forward pass already spreads over all cores with OpenMP. Two requests decoding on
// two threads would start two OpenMP teams on the same cores, and teams that spin-wait for each other slow
// everything down by 10-100x (see scripts/test.sh). So each request's generate() call runs inside a Fiber
// on the scheduler thread. Its trunk passes go through GenerateOptions::run_forward, which posts the pass
// and yields; once every busy slot has posted its pass (or ended), the scheduler runs all of them in one
// Model::forward_batch: one engine step for all active requests, each weight read once per step, and each
// request's result bit-identical to its own forward()'s, so its output does not depend on its neighbours.
// The MTP head's passes (run_head_forward) are gathered the same way, into one mtp_forward_batch. A prompt
// prefill runs whole in its step: a long prompt delays the other slots by its prefill time.
//
// This file owns all the locking between the HTTP threads and the scheduler thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "decode/generate.h"
#include "model/qwen35.h"
#include "server/fiber.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace mtpx::server {

using Clock = std::chrono::steady_clock;

// One request's work, validated and tokenized by the HTTP layer.
struct GenerationRequest {
  std::vector<int32_t> prompt;
  GenerateOptions options;  // `cancelled` is the scheduler's to set
  std::vector<std::string> stop_strings;
};

// How a generation ended.
struct GenerationOutcome {
  std::string finish_reason;  // "stop" (stop id or stop string), "length" or "cancelled"
  std::vector<int32_t> tokens;
  GenerateStats stats;
  double time_to_first_token_seconds = 0.0;  // from submission (queue time included)
  std::optional<Error> error;                // set when the generation failed
};

// A request in flight, shared by the HTTP thread that answers it and the scheduler.
class GenerationJob {
 public:
  explicit GenerationJob(GenerationRequest request);
  const GenerationRequest& request() const { return request_; }

  // The client's side. Waits up to `timeout` for new text or the end, and takes the new text.
  struct Update {
    std::string text;
    bool finished = false;
  };
  Update wait_for_update(std::chrono::milliseconds timeout);
  // The client went away: the generation stops at its next step (or never starts).
  void cancel() { cancelled_ = true; }
  // Valid once an update said finished.
  const GenerationOutcome& outcome() const { return outcome_; }

  // The scheduler's side.
  bool cancelled() const { return cancelled_; }
  void append_text(std::string_view text);
  void finish(GenerationOutcome outcome);
  Clock::time_point submitted_at() const { return submitted_at_; }

 private:
  const GenerationRequest request_;
  const Clock::time_point submitted_at_;
  std::atomic<bool> cancelled_{false};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::string unread_text_;  // appended by the scheduler, taken by the client
  bool finished_ = false;
  GenerationOutcome outcome_;  // written once, before finished_ is set
};

class Scheduler {
 public:
  // `model` and `tokenizer` must outlive the scheduler; they are shared by every slot (read only).
  // `threads`: OpenMP threads of the forward passes (0: all cores).
  Scheduler(const Model& model, const Tokenizer& tokenizer, Metrics& metrics, int slots, int max_queue,
            int threads = 0);
  ~Scheduler();  // shutdown()
  // Cancels what is running, fails what is queued, refuses new jobs and joins the scheduler thread.
  void shutdown();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a job; false when every slot is busy and the queue is full (the caller answers 503).
  bool submit(const std::shared_ptr<GenerationJob>& job);

  int slots() const { return static_cast<int>(slots_.size()); }
  int64_t busy_slots() const { return busy_slots_; }
  int64_t queued() const;

 private:
  struct Slot {
    Fiber fiber;
    std::shared_ptr<GenerationJob> job;
    // Posted by the fiber (one of the two), run by the scheduler.
    std::optional<SequenceForward> pass;
    std::optional<MtpSequenceForward> head_pass;
    std::exception_ptr pass_error;  // why its pass failed, rethrown in the fiber
  };
  // One forward_batch of the slots' posted trunk passes and one mtp_forward_batch of their head passes.
  void run_posted_passes();

  void run();                         // the scheduler thread
  void generate_in_slot(Slot& slot);  // a slot's fiber body: one whole generation
  bool wait_for_work();               // false when stopping
  void admit_queued_jobs();

  const Model& model_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  const int max_queue_;
  const int threads_;
  std::vector<std::unique_ptr<Slot>> slots_;  // touched by the scheduler thread only
  std::atomic<int64_t> busy_slots_{0};

  mutable std::mutex mutex_;
  std::condition_variable work_arrived_;
  std::deque<std::shared_ptr<GenerationJob>> queue_;  // submitted, waiting for a slot
  int64_t jobs_in_system_ = 0;                        // queued + in slots
  bool stopping_ = false;

  std::thread thread_;  // last: starts after everything above is ready
};

}  // namespace mtpx::server
