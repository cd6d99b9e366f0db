#include "server/thread_pool.h"

namespace mtpx::server {

LifoThreadPool::LifoThreadPool(size_t max_threads) : max_threads_(max_threads) {}

LifoThreadPool::~LifoThreadPool() { shutdown(); }

void LifoThreadPool::enqueue(std::function<void()> job) {
  std::lock_guard lock(mutex_);
  if (idle_.empty() && workers_.size() < max_threads_ && !shutting_down_) {
    workers_.push_back(std::make_unique<Worker>());
    Worker* w = workers_.back().get();
    w->job = std::move(job);
    w->thread = std::thread([this, w] { work(*w); });
    return;
  }
  if (idle_.empty()) {
    backlog_.push_back(std::move(job));
    return;
  }
  Worker* w = idle_.back();
  idle_.pop_back();
  w->job = std::move(job);
  w->wake.notify_one();
}

void LifoThreadPool::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (shutting_down_) return;
    shutting_down_ = true;
    for (auto& w : workers_) w->wake.notify_one();
  }
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

void LifoThreadPool::work(Worker& worker) {
  std::unique_lock lock(mutex_);
  while (true) {
    std::function<void()> job;
    if (worker.job) {
      job = std::move(worker.job);
      worker.job = nullptr;
    } else if (!backlog_.empty()) {
      job = std::move(backlog_.front());
      backlog_.pop_front();
    } else if (shutting_down_) {
      return;
    } else {
      idle_.push_back(&worker);
      worker.wake.wait(lock, [&] { return worker.job || shutting_down_; });
      if (!worker.job) return;  // shutting down while idle (nothing is queued: idle threads see no backlog)
      continue;
    }
    lock.unlock();
    job();
    lock.lock();
  }
}

}  // namespace mtpx::server
