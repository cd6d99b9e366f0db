// Generation cancellation (GenerateOptions::cancelled) and the server's scheduler on the shipped model:
// interleaved slots give exactly the tokens of generate() alone, cancelled and stopped jobs free their
// slot, a full queue refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include "decode/generate.h"
#include "decode/sampler.h"
#include "io/model_config.h"
#include "model/qwen35.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "test_paths.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace mtpx::server {
namespace {

using test_paths::kDefaultModel;

struct Shipped {
  std::unique_ptr<Model> model = Model::load(kDefaultModel);
  Tokenizer tokenizer = Tokenizer::from_file(kDefaultModel / "tokenizer.json");
};

Shipped& shipped() {
  static Shipped s;
  return s;
}

// The shipped model's generation_config.json stops at <|im_end|> and <|endoftext|>.
std::vector<int32_t> shipped_stop_ids() {
  return {*shipped().tokenizer.token_to_id("<|endoftext|>"), *shipped().tokenizer.token_to_id("<|im_end|>")};
}

GenerateOptions greedy(int64_t max_tokens, int64_t draft) {
  GenerateOptions o;
  o.max_tokens = max_tokens;
  o.sampler.temperature = 0.0;
  o.draft = draft;
  o.stop_ids = shipped_stop_ids();
  o.vocab_limit = shipped().tokenizer.vocab_size();
  return o;
}

TEST(GenerateCancellation, StopsBetweenStepsAndKeepsTheOutputPrefix) {
  const std::vector<int32_t> prompt = shipped().tokenizer.encode("def quicksort(xs):");
  for (int64_t draft : {0, 1, 3}) {
    SCOPED_TRACE(draft);
    GenerateOptions o = greedy(64, draft);
    const GenerateResult full = generate(*shipped().model, prompt, o);
    int asked = 0;
    o.cancelled = [&] { return ++asked > 5; };
    const GenerateResult cut = generate(*shipped().model, prompt, o);
    EXPECT_EQ(cut.finish_reason, "cancelled");
    ASSERT_LT(cut.tokens.size(), full.tokens.size());
    ASSERT_FALSE(cut.tokens.empty());
    EXPECT_TRUE(std::equal(cut.tokens.begin(), cut.tokens.end(), full.tokens.begin()));
    o.cancelled = [] { return false; };  // asked, never cancelling: output unchanged
    EXPECT_EQ(generate(*shipped().model, prompt, o).tokens, full.tokens);
  }
}

GenerationOutcome wait(GenerationJob& job, std::string* text = nullptr) {
  while (true) {
    auto update = job.wait_for_update(std::chrono::milliseconds(50));
    if (text) *text += update.text;
    if (update.finished) return job.outcome();
  }
}

TEST(Scheduler, InterleavedSlotsGiveTheTokensOfGenerateAlone) {
  Metrics metrics;
  Scheduler scheduler(*shipped().model, shipped().tokenizer, metrics, 2, 8);
  const std::vector<std::string> prompts = {"def fibonacci(n):", "import os\n\n", "class Stack:\n    def",
                                            "for i in range(10):"};
  std::vector<std::shared_ptr<GenerationJob>> jobs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.prompt = shipped().tokenizer.encode(prompts[i]);
    r.options = greedy(40, static_cast<int64_t>(i % 3));  // AR and MTP K=1, 2 side by side
    jobs.push_back(std::make_shared<GenerationJob>(r));
    ASSERT_TRUE(scheduler.submit(jobs.back()));
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    SCOPED_TRACE(prompts[i]);
    std::string text;
    const GenerationOutcome outcome = wait(*jobs[i], &text);
    ASSERT_FALSE(outcome.error) << outcome.error->what();
    const GenerateResult alone =
        generate(*shipped().model, jobs[i]->request().prompt, jobs[i]->request().options);
    EXPECT_EQ(outcome.tokens, alone.tokens);
    std::vector<int32_t> shown = alone.tokens;
    const auto stops = shipped_stop_ids();
    if (!shown.empty() && std::count(stops.begin(), stops.end(), shown.back()) > 0) shown.pop_back();
    EXPECT_EQ(text, shipped().tokenizer.decode(shown));
    EXPECT_EQ(outcome.stats.generated_tokens, static_cast<int64_t>(alone.tokens.size()));
    EXPECT_GT(outcome.time_to_first_token_seconds, 0.0);
  }
  const std::string exposition = metrics.render(0, 0, 2);
  EXPECT_NE(exposition.find("mtpx_generations_total"), std::string::npos);
  // The two slots' passes ran together: more passes than engine steps (not twice as many: the jobs end at
  // different steps, and the last one runs alone).
  auto counter = [&](const std::string& name) {
    const size_t at = exposition.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(exposition.substr(at + name.size() + 2));
  };
  const double steps = counter("mtpx_engine_steps_total");
  const double passes = counter("mtpx_engine_step_sequences_total");
  EXPECT_GT(steps, 0.0);
  EXPECT_GT(passes, 1.2 * steps) << passes << " passes in " << steps << " steps";
}

TEST(Scheduler, SeededSampledJobsUnderLoadGiveTheTokensOfGenerateAlone) {
  // The model's own sampler with a seed, plain and MTP, six requests on three slots: each output is what
  // generate gives alone (sampling reads every logit, so a row changed by its neighbours in the batched
  // step would show here).
  Metrics metrics;
  Scheduler scheduler(*shipped().model, shipped().tokenizer, metrics, 3, 8);
  const SamplerParams sampler =
      sampler_defaults(load_generation_config(kDefaultModel / "generation_config.json"));
  std::vector<std::shared_ptr<GenerationJob>> jobs;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    r.prompt = shipped().tokenizer.encode(i % 2 ? "import numpy as np\n" : "def parse(text):");
    r.options = greedy(48, i % 3);
    r.options.sampler = sampler;
    r.options.seed = static_cast<uint64_t>(100 + i);
    jobs.push_back(std::make_shared<GenerationJob>(r));
    ASSERT_TRUE(scheduler.submit(jobs.back()));
  }
  for (const auto& job : jobs) {
    const GenerationOutcome outcome = wait(*job);
    ASSERT_FALSE(outcome.error) << outcome.error->what();
    EXPECT_EQ(outcome.tokens,
              generate(*shipped().model, job->request().prompt, job->request().options).tokens)
        << "seed " << job->request().options.seed << ", draft " << job->request().options.draft;
  }
}

TEST(Scheduler, CancelledAndStoppedJobsFreeTheirSlot) {
  Metrics metrics;
  Scheduler scheduler(*shipped().model, shipped().tokenizer, metrics, 1, 0);
  GenerationRequest long_request;
  long_request.prompt = shipped().tokenizer.encode("def main():\n");
  long_request.options = greedy(3000, 1);
  auto running = std::make_shared<GenerationJob>(long_request);
  ASSERT_TRUE(scheduler.submit(running));
  EXPECT_FALSE(scheduler.submit(std::make_shared<GenerationJob>(long_request)));  // 1 slot, no queue
  while (running->wait_for_update(std::chrono::milliseconds(50)).text.empty()) {
  }
  running->cancel();
  const auto t0 = std::chrono::steady_clock::now();
  const GenerationOutcome cancelled = wait(*running);
  EXPECT_EQ(cancelled.finish_reason, "cancelled");
  EXPECT_LT(cancelled.stats.generated_tokens, 3000);
  // Cancellation is seen between steps: well under the time the remaining tokens would take (a loose
  // bound, so a loaded CI machine does not fail it).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));

  // A stop string ends generation, is not shown, and the slot takes the next job.
  GenerationRequest probe;
  probe.prompt = shipped().tokenizer.encode("def fibonacci(n):");
  probe.options = greedy(30, 2);
  std::string full_text;
  auto first = std::make_shared<GenerationJob>(probe);
  while (!scheduler.submit(first)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  wait(*first, &full_text);
  ASSERT_GT(full_text.size(), 12u);
  probe.stop_strings = {full_text.substr(8, 4)};
  std::string stopped_text;
  auto stopped = std::make_shared<GenerationJob>(probe);
  while (!scheduler.submit(stopped)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const GenerationOutcome outcome = wait(*stopped, &stopped_text);
  EXPECT_EQ(outcome.finish_reason, "stop");
  EXPECT_EQ(stopped_text, full_text.substr(0, full_text.find(probe.stop_strings[0])));
}

TEST(Scheduler, ShutdownEndsRunningAndQueuedJobs) {
  Metrics metrics;
  auto scheduler = std::make_unique<Scheduler>(*shipped().model, shipped().tokenizer, metrics, 1, 4);
  GenerationRequest r;
  r.prompt = shipped().tokenizer.encode("x = ");
  r.options = greedy(5000, 0);
  auto running = std::make_shared<GenerationJob>(r), queued = std::make_shared<GenerationJob>(r);
  ASSERT_TRUE(scheduler->submit(running));
  ASSERT_TRUE(scheduler->submit(queued));
  scheduler.reset();
  EXPECT_EQ(wait(*running).finish_reason, "cancelled");
  EXPECT_TRUE(wait(*queued).error.has_value());
}

}  // namespace
}  // namespace mtpx::server
