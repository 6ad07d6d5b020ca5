#include "daemon/teardown_queue.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "base/log.h"

namespace offload {

struct TeardownQueue::Batch {
  std::atomic<size_t> left{0};
  std::vector<std::string> lines;
};

TeardownQueue::TeardownQueue(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Work(); });
}

TeardownQueue::~TeardownQueue() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();  // (what is queued runs first)
}

void TeardownQueue::Add(SessionManager::Teardowns work, std::vector<std::string> lines) {
  std::vector<std::function<void()>> each = work.Take();
  auto batch = std::make_shared<Batch>();
  batch->lines = std::move(lines);
  if (each.empty()) {
    for (const std::string& line : batch->lines) LogInfo("%s", line);
    return;
  }
  batch->left.store(each.size());
  absl::MutexLock lock(&mu_);
  for (std::function<void()>& f : each) tasks_.push_back(Task{std::move(f), batch});
}

void TeardownQueue::Work() {
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TeardownQueue* q)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(q->mu_) { return q->stopping_ || !q->tasks_.empty(); },
          this));
      if (tasks_.empty()) return;  // stopping, nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task.run();
    if (task.batch->left.fetch_sub(1) == 1) {
      for (const std::string& line : task.batch->lines) LogInfo("%s", line);
    }
  }
}

}  // namespace offload
