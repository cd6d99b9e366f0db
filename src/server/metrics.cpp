#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace mtpx::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket =
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

std::string Histogram::render(const std::string& name) const {
  std::string out;
  int64_t cumulative = 0;
  for (size_t i = 0; i < upper_bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, upper_bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n", name, count_);
  out += fmt::format("{}_sum {}\n{}_count {}\n", name, sum_, name, count_);
  return out;
}

Metrics::Metrics()
    : time_to_first_token_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}),
      inter_token_latency_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}) {}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lock(mutex_);
  ++requests_[{endpoint, status}];
  if (status >= 400) ++errors_[status];
}

void Metrics::count_finished(int64_t prompt_tokens, int64_t completion_tokens,
                             const std::string& finish_reason, const MtpStats& mtp) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += prompt_tokens;
  completion_tokens_ += completion_tokens;
  ++finished_[finish_reason];
  const size_t k = mtp.drafted_by_position.size();
  if (drafted_by_position_.size() < k) {
    drafted_by_position_.resize(k, 0);
    accepted_by_position_.resize(k, 0);
  }
  for (size_t i = 0; i < k; ++i) {
    drafted_by_position_[i] += mtp.drafted_by_position[i];
    accepted_by_position_[i] += mtp.accepted_by_position[i];
  }
  mtp_steps_ += mtp.steps;
}

void Metrics::observe_time_to_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  time_to_first_token_.observe(seconds);
}

void Metrics::observe_inter_token_latency(double seconds) {
  std::lock_guard lock(mutex_);
  inter_token_latency_.observe(seconds);
}

void Metrics::count_engine_step(int64_t sequences) {
  std::lock_guard lock(mutex_);
  ++engine_steps_;
  engine_step_sequences_ += sequences;
}

std::string Metrics::render(int64_t busy_slots, int64_t queued, int64_t slots) const {
  std::lock_guard lock(mutex_);
  std::string out;
  auto header = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  header("mtpx_requests_total", "counter", "HTTP requests answered, by endpoint and status.");
  for (const auto& [key, n] : requests_)
    out += fmt::format("mtpx_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
  header("mtpx_request_errors_total", "counter", "HTTP requests answered with an error status.");
  for (const auto& [status, n] : errors_)
    out += fmt::format("mtpx_request_errors_total{{status=\"{}\"}} {}\n", status, n);
  header("mtpx_generations_total", "counter", "Finished generations, by finish reason.");
  for (const auto& [reason, n] : finished_)
    out += fmt::format("mtpx_generations_total{{finish_reason=\"{}\"}} {}\n", reason, n);
  header("mtpx_prompt_tokens_total", "counter", "Prompt tokens processed.");
  out += fmt::format("mtpx_prompt_tokens_total {}\n", prompt_tokens_);
  header("mtpx_completion_tokens_total", "counter", "Tokens generated.");
  out += fmt::format("mtpx_completion_tokens_total {}\n", completion_tokens_);
  header("mtpx_mtp_steps_total", "counter", "MTP verify passes.");
  out += fmt::format("mtpx_mtp_steps_total {}\n", mtp_steps_);
  header("mtpx_engine_steps_total", "counter",
         "Engine steps: one batched pass of the active requests' trunk passes, one of their head passes.");
  out += fmt::format("mtpx_engine_steps_total {}\n", engine_steps_);
  header("mtpx_engine_step_sequences_total", "counter",
         "Requests' passes (trunk or MTP head) run in engine steps (divided by the steps: the mean batch).");
  out += fmt::format("mtpx_engine_step_sequences_total {}\n", engine_step_sequences_);
  header("mtpx_mtp_drafted_tokens_total", "counter",
         "MTP draft tokens proposed, by draft position (1-based).");
  for (size_t i = 0; i < drafted_by_position_.size(); ++i)
    out +=
        fmt::format("mtpx_mtp_drafted_tokens_total{{position=\"{}\"}} {}\n", i + 1, drafted_by_position_[i]);
  header("mtpx_mtp_accepted_tokens_total", "counter",
         "MTP draft tokens accepted, by draft position (1-based).");
  for (size_t i = 0; i < accepted_by_position_.size(); ++i)
    out += fmt::format("mtpx_mtp_accepted_tokens_total{{position=\"{}\"}} {}\n", i + 1,
                       accepted_by_position_[i]);
  header("mtpx_time_to_first_token_seconds", "histogram",
         "From request arrival to its first generated token.");
  out += time_to_first_token_.render("mtpx_time_to_first_token_seconds");
  header("mtpx_inter_token_latency_seconds", "histogram", "Time between consecutive generated tokens.");
  out += inter_token_latency_.render("mtpx_inter_token_latency_seconds");
  header("mtpx_slots", "gauge", "Generation slots (--parallel).");
  out += fmt::format("mtpx_slots {}\n", slots);
  header("mtpx_slots_busy", "gauge", "Slots generating now.");
  out += fmt::format("mtpx_slots_busy {}\n", busy_slots);
  header("mtpx_queue_length", "gauge", "Requests waiting for a slot.");
  out += fmt::format("mtpx_queue_length {}\n", queued);
  return out;
}

}  // namespace mtpx::server
