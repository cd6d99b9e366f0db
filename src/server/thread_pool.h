// The HTTP server's worker threads: httplib's task queue interface, but the most recently idle thread
// takes the next connection. httplib's own pool wakes threads in turn, so over time every thread of a
// large pool touches its stack and malloc arena; here only as many threads as were ever busy at once
// are warm, and the server's memory follows its peak concurrency instead of its thread count. Threads
// start when first needed, so a large maximum (room for clients that hold a connection without asking
// anything: slow or idle ones) costs nothing until it is used.
#pragma once

#include <httplib.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mtpx::server {

class LifoThreadPool : public httplib::TaskQueue {
 public:
  explicit LifoThreadPool(size_t max_threads);
  ~LifoThreadPool() override;

  void enqueue(std::function<void()> job) override;
  // Runs what is queued, then joins the threads (httplib calls it when the server stops).
  void shutdown() override;

 private:
  struct Worker {
    std::thread thread;
    std::condition_variable wake;
    std::function<void()> job;  // handed over by enqueue()
  };
  void work(Worker& worker);

  const size_t max_threads_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<Worker*> idle_;                  // a stack: back() went idle last
  std::deque<std::function<void()>> backlog_;  // jobs that found no idle thread
  bool shutting_down_ = false;
};

}  // namespace mtpx::server
