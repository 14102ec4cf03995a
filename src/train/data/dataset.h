// In-memory classification datasets and the Batcher that cuts them into batches.
// A dataset is two tensors, features (N, ...) and labels (N,) i64, so any loader (IDX, a
// synthetic generator, a test) can build one. The Batcher is deterministic: the sample order of
// an epoch depends only on (seed, epoch), so a resumed run sees the same batches as an
// uninterrupted one, and any batch can be made out of order (what the prefetch thread does).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::train {

// One step's data. Classification: inputs (B, ...sample shape), targets (B,) i64.
// Language modelling: inputs (B, T) i64, targets (B, T) i64.
struct Batch {
  Tensor inputs;
  Tensor targets;
};

class ClassificationDataset {
 public:
  ClassificationDataset() = default;
  // features: (N, ...) of any dtype; labels: (N,) i64 in [0, num_classes). Throws kiln::Error
  // when the counts differ or a label is out of range.
  ClassificationDataset(Tensor features, Tensor labels, int64_t num_classes,
                        std::vector<std::string> class_names = {});

  int64_t size() const { return labels_.defined() ? labels_.numel() : 0; }
  int64_t num_classes() const { return num_classes_; }
  const std::vector<std::string>& class_names() const { return class_names_; }
  const Tensor& features() const { return features_; }  // (N, ...)
  const Tensor& labels() const { return labels_; }      // (N,) i64
  // The shape of one sample: features' shape without its leading N.
  Shape sample_shape() const;

  // The same samples viewed with another per-sample shape of equal size, e.g. Fashion-MNIST's
  // (784,) as (1, 28, 28) for a convolutional model. Shares storage.
  ClassificationDataset with_sample_shape(Shape sample_shape) const;
  // Samples [begin, end) as a new dataset (copies), e.g. to hold out a validation split.
  ClassificationDataset slice(int64_t begin, int64_t end) const;
  // Gathers the samples at `indices` into a batch: inputs (B, ...), targets (B,).
  Batch gather(std::span<const int64_t> indices) const;

 private:
  Tensor features_;
  Tensor labels_;
  int64_t num_classes_ = 0;
  std::vector<std::string> class_names_;
};

// The sample order of one epoch: a permutation of [0, n) made by Fisher-Yates with
// std::mt19937_64 seeded from (seed, epoch). Written by hand (not std::shuffle, whose algorithm
// the standard leaves to the library) so the order is the same with every compiler.
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch);

// A uniform draw in [0, n) from `rng`, unbiased (rejection of the incomplete last block) and,
// unlike std::uniform_int_distribution, the same with every standard library.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t n);

struct BatcherOptions {
  int64_t batch_size = 32;
  bool shuffle = true;    // reorder each epoch by shuffled_order(seed, epoch)
  bool drop_last = true;  // drop the final partial batch (training wants a fixed B)
  uint64_t seed = 0;
};

class Batcher {
 public:
  Batcher(ClassificationDataset dataset, BatcherOptions options);
  // Training: shuffled each epoch, every batch exactly batch_size (the partial tail dropped).
  static Batcher training(ClassificationDataset dataset, int64_t batch_size, uint64_t seed);
  // Evaluation: dataset order, every sample once, the last batch possibly smaller.
  static Batcher evaluation(ClassificationDataset dataset, int64_t batch_size);

  const ClassificationDataset& dataset() const { return dataset_; }
  const BatcherOptions& options() const { return options_; }
  int64_t batches_per_epoch() const;
  // Sample indices of the given epoch, in the order batches take them.
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  // Batch `index` (0 <= index < batches_per_epoch()) of `epoch`.
  Batch batch(int64_t epoch, int64_t index) const;
  // The batch of a global training step: epoch = step / batches_per_epoch(), so a trainer can
  // count steps and never think about epoch boundaries.
  Batch batch_at_step(int64_t step) const;

 private:
  // The last epoch's order, kept so that making each batch does not redo the O(N) shuffle.
  // Shared by copies (same options, so the same orders) and locked for the prefetch thread.
  struct OrderCache {
    std::mutex mutex;
    int64_t epoch = -1;
    std::shared_ptr<const std::vector<int64_t>> order;
  };
  std::shared_ptr<const std::vector<int64_t>> cached_order(int64_t epoch) const;

  ClassificationDataset dataset_;
  BatcherOptions options_;
  std::shared_ptr<OrderCache> cache_ = std::make_shared<OrderCache>();
};

}  // namespace kiln::train
