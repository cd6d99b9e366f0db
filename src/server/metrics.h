// Server counters and latency histograms, rendered in the Prometheus text exposition format (GET /metrics).
// Thread-safe: the HTTP threads count requests, the scheduler thread counts tokens and latencies.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "decode/generate.h"

namespace mtpx::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // `name`_bucket{le=...}, `name`_sum, `name`_count lines.
  std::string render(const std::string& name) const;

 private:
  std::vector<double> upper_bounds_;
  std::vector<int64_t> counts_;  // [bounds + 1]: the last is +Inf
  double sum_ = 0.0;
  int64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  void count_request(const std::string& endpoint, int status);
  void count_finished(int64_t prompt_tokens, int64_t completion_tokens, const std::string& finish_reason,
                      const MtpStats& mtp);
  void observe_time_to_first_token(double seconds);
  void observe_inter_token_latency(double seconds);
  // One engine step: the passes of `sequences` requests run together (Model::forward_batch for trunk
  // passes, mtp_forward_batch for head passes).
  void count_engine_step(int64_t sequences);

  // The whole exposition; `busy_slots` and `queued` are gauges read at scrape time.
  std::string render(int64_t busy_slots, int64_t queued, int64_t slots) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;  // (endpoint, status) -> count
  std::map<int, int64_t> errors_;                            // status >= 400 -> count
  std::map<std::string, int64_t> finished_;                  // finish_reason -> generations
  int64_t prompt_tokens_ = 0;
  int64_t completion_tokens_ = 0;
  std::vector<int64_t> drafted_by_position_;   // [max K seen]
  std::vector<int64_t> accepted_by_position_;  // [max K seen]
  int64_t mtp_steps_ = 0;
  int64_t engine_steps_ = 0;
  int64_t engine_step_sequences_ = 0;
  Histogram time_to_first_token_;
  Histogram inter_token_latency_;
};

}  // namespace mtpx::server
