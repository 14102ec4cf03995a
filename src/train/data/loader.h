// Prefetcher: a loader thread that makes the next batches while the current training step
// runs, so data preparation (gathering, shuffling, tokenizing) overlaps compute. It keeps a
// bounded queue (depth 2 by default: one batch being consumed, one ready, no more, which bounds
// memory), shuts down cleanly in its destructor, and hands an exception thrown on the thread
// to the consumer, in order, after the batches made before it. Its items are a dataset's
// Batch (BatchPrefetcher) or a step's data inputs in order (the training job's: an imported
// model's inputs are bound by shape, train/tasks.cc).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "support/error.h"
#include "train/data/dataset.h"

namespace kiln::train {

template <class Item>
class Prefetcher {
 public:
  // Makes item i by produce(i) for i = 0, 1, ..., count - 1 on its own thread (count < 0:
  // without end). At most `depth` items wait in the queue; the thread makes an item only
  // when there is room for it.
  Prefetcher(std::function<Item(int64_t)> produce, int64_t count, int depth = 2)
      : produce_(std::move(produce)), count_(count), depth_(static_cast<size_t>(depth)) {
    KILN_CHECK(depth >= 1, "prefetcher: queue depth must be at least 1, got {}", depth);
    KILN_CHECK(produce_ != nullptr, "prefetcher: no produce function given");
    thread_ = std::thread([this] { run(); });
  }
  // Batches of one epoch of `batcher` (which is copied; copies are cheap). Item = Batch.
  static std::unique_ptr<Prefetcher> for_epoch(const Batcher& batcher, int64_t epoch, int depth = 2) {
    return std::make_unique<Prefetcher>([batcher, epoch](int64_t i) { return batcher.batch(epoch, i); },
                                        batcher.batches_per_epoch(), depth);
  }
  // Training steps first_step, first_step + 1, ... of `batcher` across epochs, without end.
  static std::unique_ptr<Prefetcher> for_steps(const Batcher& batcher, int64_t first_step, int depth = 2) {
    return std::make_unique<Prefetcher>(
        [batcher, first_step](int64_t i) { return batcher.batch_at_step(first_step + i); }, -1, depth);
  }

  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    // A produce() call in progress runs to its end (it cannot be interrupted); then the thread
    // sees stop_ and returns.
    if (thread_.joinable()) thread_.join();
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next item, waiting for the thread if none is ready; std::nullopt after the last one.
  // Rethrows (every time it is called) an exception that produce() threw, once the items made
  // before it have been taken.
  std::optional<Item> next() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !queue_.empty() || finished_; });
    if (!queue_.empty()) {
      Item item = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      changed_.notify_all();  // room for the thread to make the next one
      return item;
    }
    if (error_) std::rethrow_exception(error_);
    return std::nullopt;
  }

 private:
  void run() {
    for (int64_t i = 0; count_ < 0 || i < count_; ++i) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
        if (stop_) return;
      }
      try {
        Item item = produce_(i);
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(item));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        finished_ = true;
        changed_.notify_all();
        return;
      }
      changed_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    finished_ = true;
    changed_.notify_all();
  }

  std::function<Item(int64_t)> produce_;
  int64_t count_;
  size_t depth_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Item> queue_;
  std::exception_ptr error_;
  bool finished_ = false;  // the thread made its last item or failed
  bool stop_ = false;      // the destructor asks the thread to end
  std::thread thread_;     // last: starts after the members it uses exist
};

using BatchPrefetcher = Prefetcher<Batch>;

}  // namespace kiln::train
