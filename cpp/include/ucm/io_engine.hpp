// Positional file I/O on a pool of native threads, many requests in flight.
//
// Lock order: IoEngine::mu_ only; a Batch's own mutex is taken after it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ucm {

enum class IoOp { kRead, kWrite };

struct IoRequest {
  void* buf;
  std::size_t len;
  std::int64_t offset;
};

class IoEngine {
 public:
  explicit IoEngine(int threads);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Runs every request of the batch on `fd`, all of them in flight at once
  // (up to the thread count), and blocks until all are done. Result per
  // request: bytes transferred (== len on success), or -errno. Short
  // transfers are retried; end of file gives a short count.
  std::vector<std::int64_t> read_batch(int fd, const std::vector<IoRequest>& reqs);
  std::vector<std::int64_t> write_batch(int fd, const std::vector<IoRequest>& reqs);

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  struct Batch;
  struct Task {
    std::shared_ptr<Batch> batch;
    std::size_t index;
  };
  std::vector<std::int64_t> run(int fd, IoOp op, const std::vector<IoRequest>& reqs);
  void worker();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace ucm
