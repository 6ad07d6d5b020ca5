// TeardownQueue: where the arena channel's thread hands the sessions it
// closed (SessionManager::Teardowns: their memory, ring threads, files and,
// for a session kept for a resume, its final checkpoint), so that tearing
// them down delays no attach, and so that the sessions of a job whose ranks
// all went away at once are torn down side by side, not one after another:
// each session's teardown is a task of its own, run by one of `threads`
// threads in the order handed in. A batch's log lines are logged once all
// of its tasks are done.
//
// Thread-safety: Add may be called from any thread. The destructor runs
// what is queued, then joins the threads.
#ifndef OFFLOADD_DAEMON_TEARDOWN_QUEUE_H_
#define OFFLOADD_DAEMON_TEARDOWN_QUEUE_H_

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "engine/session_manager.h"

namespace offload {

class TeardownQueue {
 public:
  static constexpr int kDefaultThreads = 4;

  explicit TeardownQueue(int threads = kDefaultThreads);
  ~TeardownQueue();
  TeardownQueue(const TeardownQueue&) = delete;
  TeardownQueue& operator=(const TeardownQueue&) = delete;

  // Runs each of `work`'s teardowns on the queue's threads; `lines` are
  // logged (info) once every one of them is done.
  void Add(SessionManager::Teardowns work, std::vector<std::string> lines) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Batch;
  struct Task {
    std::function<void()> run;
    std::shared_ptr<Batch> batch;
  };
  void Work() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace offload

#endif  // OFFLOADD_DAEMON_TEARDOWN_QUEUE_H_
