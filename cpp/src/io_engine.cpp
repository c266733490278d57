#include "ucm/io_engine.hpp"

#include <unistd.h>

#include <cerrno>

namespace ucm {

struct IoEngine::Batch {
  int fd;
  IoOp op;
  const std::vector<IoRequest>* reqs;
  std::vector<std::int64_t> results;
  std::size_t remaining;
  std::mutex mu;
  std::condition_variable done;
};

IoEngine::IoEngine(int threads) {
  const int n = threads < 1 ? 1 : threads;
  workers_.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) workers_.emplace_back([this] { worker(); });
}

IoEngine::~IoEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::vector<std::int64_t> IoEngine::read_batch(int fd, const std::vector<IoRequest>& reqs) {
  return run(fd, IoOp::kRead, reqs);
}

std::vector<std::int64_t> IoEngine::write_batch(int fd, const std::vector<IoRequest>& reqs) {
  return run(fd, IoOp::kWrite, reqs);
}

std::vector<std::int64_t> IoEngine::run(int fd, IoOp op, const std::vector<IoRequest>& reqs) {
  if (reqs.empty()) return {};
  auto batch = std::make_shared<Batch>();
  batch->fd = fd;
  batch->op = op;
  batch->reqs = &reqs;
  batch->results.assign(reqs.size(), 0);
  batch->remaining = reqs.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0; i < reqs.size(); ++i) queue_.push_back(Task{batch, i});
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->done.wait(lock, [&] { return batch->remaining == 0; });
  return batch->results;
}

namespace {

std::int64_t transfer(int fd, IoOp op, const IoRequest& r) {
  std::size_t done = 0;
  char* buf = static_cast<char*>(r.buf);
  while (done < r.len) {
    const off_t off = static_cast<off_t>(r.offset) + static_cast<off_t>(done);
    const ssize_t n = op == IoOp::kRead ? ::pread(fd, buf + done, r.len - done, off)
                                        : ::pwrite(fd, buf + done, r.len - done, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -static_cast<std::int64_t>(errno);
    }
    if (n == 0) break;  // end of file on read; a zero-byte write does not progress either
    done += static_cast<std::size_t>(n);
  }
  return static_cast<std::int64_t>(done);
}

}  // namespace

void IoEngine::worker() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    Batch& b = *task.batch;
    const std::int64_t res = transfer(b.fd, b.op, (*b.reqs)[task.index]);
    std::lock_guard<std::mutex> lock(b.mu);
    b.results[task.index] = res;
    if (--b.remaining == 0) b.done.notify_all();
  }
}

}  // namespace ucm
