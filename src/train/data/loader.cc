// BatchPrefetcher's producer thread and its bounded queue (see loader.h).
#include "train/data/loader.h"

namespace kiln::train {

BatchPrefetcher::BatchPrefetcher(std::function<Batch(int64_t)> produce, int64_t count, int depth)
    : produce_(std::move(produce)), count_(count), depth_(static_cast<size_t>(depth)) {
  KILN_CHECK(depth >= 1, "prefetcher: queue depth must be at least 1, got {}", depth);
  KILN_CHECK(produce_ != nullptr, "prefetcher: no produce function given");
  thread_ = std::thread([this] { run(); });
}

std::unique_ptr<BatchPrefetcher> BatchPrefetcher::for_epoch(const Batcher& batcher, int64_t epoch,
                                                            int depth) {
  return std::make_unique<BatchPrefetcher>(
      [batcher, epoch](int64_t i) { return batcher.batch(epoch, i); }, batcher.batches_per_epoch(),
      depth);
}

std::unique_ptr<BatchPrefetcher> BatchPrefetcher::for_steps(const Batcher& batcher,
                                                            int64_t first_step, int depth) {
  return std::make_unique<BatchPrefetcher>(
      [batcher, first_step](int64_t i) { return batcher.batch_at_step(first_step + i); }, -1,
      depth);
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  // A produce() call in progress runs to its end (it cannot be interrupted); then the thread
  // sees stop_ and returns.
  if (thread_.joinable()) thread_.join();
}

void BatchPrefetcher::run() {
  for (int64_t i = 0; count_ < 0 || i < count_; ++i) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
      if (stop_) return;
    }
    try {
      Batch batch = produce_(i);
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(batch));
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

std::optional<Batch> BatchPrefetcher::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !queue_.empty() || finished_; });
  if (!queue_.empty()) {
    Batch batch = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    changed_.notify_all();  // room for the thread to make the next one
    return batch;
  }
  if (error_) std::rethrow_exception(error_);
  return std::nullopt;
}

}  // namespace kiln::train
