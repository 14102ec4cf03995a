// ClassificationDataset, the hand-written shuffle and the Batcher (see dataset.h).
#include "train/data/dataset.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>

namespace kiln::train {

ClassificationDataset::ClassificationDataset(Tensor features, Tensor labels, int64_t num_classes,
                                             std::vector<std::string> class_names)
    : features_(std::move(features)),
      labels_(std::move(labels)),
      num_classes_(num_classes),
      class_names_(std::move(class_names)) {
  KILN_CHECK(features_.defined() && features_.rank() >= 1,
             "dataset: features must be a tensor of rank >= 1 with samples on axis 0, got {}",
             features_.defined() ? to_string(features_.type()) : std::string("an empty tensor"));
  KILN_CHECK(labels_.defined() && labels_.dtype() == DType::kI64 && labels_.rank() == 1,
             "dataset: labels must be i64 of shape (N,), got {}",
             labels_.defined() ? to_string(labels_.type()) : std::string("an empty tensor"));
  KILN_CHECK(features_.shape()[0] == labels_.shape()[0], "dataset: {} feature rows but {} labels",
             features_.shape()[0], labels_.shape()[0]);
  KILN_CHECK(num_classes_ > 0, "dataset: num_classes must be positive, got {}", num_classes_);
  KILN_CHECK(class_names_.empty() || static_cast<int64_t>(class_names_.size()) == num_classes_,
             "dataset: {} class names for {} classes", class_names_.size(), num_classes_);
  const int64_t* l = labels_.data<int64_t>();
  for (int64_t i = 0; i < labels_.numel(); ++i)
    KILN_CHECK(l[i] >= 0 && l[i] < num_classes_,
               "dataset: label {} of sample {} is outside [0, {})", l[i], i, num_classes_);
}

Shape ClassificationDataset::sample_shape() const {
  if (!features_.defined()) return {};
  return Shape(features_.shape().begin() + 1, features_.shape().end());
}

ClassificationDataset ClassificationDataset::with_sample_shape(Shape sample_shape) const {
  KILN_CHECK(kiln::numel(sample_shape) == kiln::numel(this->sample_shape()),
             "dataset: cannot view samples of shape {} as {}", to_string(this->sample_shape()),
             to_string(sample_shape));
  Shape full = {size()};
  full.insert(full.end(), sample_shape.begin(), sample_shape.end());
  ClassificationDataset out = *this;
  out.features_ = features_.reshaped(std::move(full));
  return out;
}

ClassificationDataset ClassificationDataset::slice(int64_t begin, int64_t end) const {
  KILN_CHECK(0 <= begin && begin <= end && end <= size(),
             "dataset: slice [{}, {}) is outside the {} samples", begin, end, size());
  std::vector<int64_t> indices(static_cast<size_t>(end - begin));
  for (int64_t i = begin; i < end; ++i) indices[i - begin] = i;
  Batch b = gather(indices);
  return ClassificationDataset(std::move(b.inputs), std::move(b.targets), num_classes_,
                               class_names_);
}

Batch ClassificationDataset::gather(std::span<const int64_t> indices) const {
  int64_t b = static_cast<int64_t>(indices.size());
  Shape shape = features_.shape();
  shape[0] = b;
  Batch out{Tensor(TensorType{features_.dtype(), shape}), Tensor(TensorType{DType::kI64, {b}})};
  size_t row_bytes =
      static_cast<size_t>(kiln::numel(sample_shape())) * dtype_size(features_.dtype());
  const int64_t* labels = labels_.data<int64_t>();
  int64_t* targets = out.targets.data<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    int64_t s = indices[i];
    KILN_CHECK(s >= 0 && s < size(), "dataset: sample index {} is outside [0, {})", s, size());
    std::memcpy(out.inputs.raw() + i * row_bytes, features_.raw() + s * row_bytes, row_bytes);
    targets[i] = labels[s];
  }
  return out;
}

uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  KILN_CHECK(n > 0, "uniform_below: the range is empty");
  // Values at or past the last whole multiple of n are redrawn, so every residue is equally
  // likely.
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  uint64_t limit = kMax - (kMax % n + 1) % n;  // largest multiple of n, minus 1, as inclusive
  uint64_t r;
  do r = rng();
  while (r > limit);
  return r % n;
}

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  // seed_seq spreads (seed, epoch) over the whole generator state, so neighbouring epochs give
  // unrelated orders.
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(uint64_t(epoch)),
                    uint32_t(uint64_t(epoch) >> 32)};
  std::mt19937_64 rng(seq);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[i], order[uniform_below(rng, uint64_t(i) + 1)]);
  }
  return order;
}

Batcher::Batcher(ClassificationDataset dataset, BatcherOptions options)
    : dataset_(std::move(dataset)), options_(options) {
  KILN_CHECK(options_.batch_size > 0, "batcher: batch_size must be positive, got {}",
             options_.batch_size);
  KILN_CHECK(!options_.drop_last || dataset_.size() >= options_.batch_size,
             "batcher: the dataset has {} samples, fewer than one batch of {} (with drop_last "
             "there would be no batch at all)",
             dataset_.size(), options_.batch_size);
}

Batcher Batcher::training(ClassificationDataset dataset, int64_t batch_size, uint64_t seed) {
  return Batcher(std::move(dataset), {batch_size, /*shuffle=*/true, /*drop_last=*/true, seed});
}

Batcher Batcher::evaluation(ClassificationDataset dataset, int64_t batch_size) {
  return Batcher(std::move(dataset), {batch_size, /*shuffle=*/false, /*drop_last=*/false, 0});
}

int64_t Batcher::batches_per_epoch() const {
  int64_t n = dataset_.size(), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

std::vector<int64_t> Batcher::epoch_order(int64_t epoch) const {
  if (options_.shuffle) return shuffled_order(dataset_.size(), options_.seed, epoch);
  std::vector<int64_t> order(static_cast<size_t>(dataset_.size()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  return order;
}

std::shared_ptr<const std::vector<int64_t>> Batcher::cached_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->epoch != epoch || !cache_->order) {
    cache_->order = std::make_shared<const std::vector<int64_t>>(epoch_order(epoch));
    cache_->epoch = epoch;
  }
  return cache_->order;
}

Batch Batcher::batch(int64_t epoch, int64_t index) const {
  KILN_CHECK(index >= 0 && index < batches_per_epoch(),
             "batcher: batch {} is outside the {} batches of an epoch", index, batches_per_epoch());
  int64_t begin = index * options_.batch_size;
  int64_t end = std::min<int64_t>(begin + options_.batch_size, dataset_.size());
  std::shared_ptr<const std::vector<int64_t>> order = cached_order(epoch);
  return dataset_.gather(std::span<const int64_t>(*order).subspan(begin, end - begin));
}

Batch Batcher::batch_at_step(int64_t step) const {
  KILN_CHECK(step >= 0, "batcher: step must be non-negative, got {}", step);
  int64_t per_epoch = batches_per_epoch();
  KILN_CHECK(per_epoch > 0, "batcher: the dataset is empty, there is no batch for step {}", step);
  return batch(step / per_epoch, step % per_epoch);
}

}  // namespace kiln::train
