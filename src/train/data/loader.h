// BatchPrefetcher: a loader thread that makes the next batches while the current training step
// runs, so data preparation (gathering, shuffling, tokenizing) overlaps compute. It keeps a
// bounded queue (depth 2 by default: one batch being consumed, one ready, no more, which bounds
// memory), shuts down cleanly in its destructor, and hands an exception thrown on the thread
// to the consumer, in order, after the batches made before it.
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

#include "train/data/dataset.h"

namespace kiln::train {

class BatchPrefetcher {
 public:
  // Makes batch i by produce(i) for i = 0, 1, ..., count - 1 on its own thread (count < 0:
  // without end). At most `depth` batches wait in the queue; the thread makes a batch only
  // when there is room for it.
  BatchPrefetcher(std::function<Batch(int64_t)> produce, int64_t count, int depth = 2);
  // Batches of one epoch of `batcher` (which is copied; copies are cheap).
  static std::unique_ptr<BatchPrefetcher> for_epoch(const Batcher& batcher, int64_t epoch,
                                                    int depth = 2);
  // Training steps first_step, first_step + 1, ... of `batcher` across epochs, without end.
  static std::unique_ptr<BatchPrefetcher> for_steps(const Batcher& batcher, int64_t first_step,
                                                    int depth = 2);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // The next batch, waiting for the thread if none is ready; std::nullopt after the last one.
  // Rethrows (every time it is called) an exception that produce() threw, once the batches made
  // before it have been taken.
  std::optional<Batch> next();

 private:
  void run();

  std::function<Batch(int64_t)> produce_;
  int64_t count_;
  size_t depth_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Batch> queue_;
  std::exception_ptr error_;
  bool finished_ = false;  // the thread made its last batch or failed
  bool stop_ = false;      // the destructor asks the thread to end
  std::thread thread_;     // last: starts after the members it uses exist
};

}  // namespace kiln::train
