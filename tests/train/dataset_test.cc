// Classification datasets, the deterministic Batcher, the prefetching loader thread, and
// Fashion-MNIST from Debian's dataset-fashion-mnist package.
#include "train/data/dataset.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "train/data/fashion_mnist.h"
#include "train/data/idx.h"
#include "train/data/loader.h"
#include "test_util.h"
#include "train/temp_dir.h"

namespace kiln::train {
namespace {

using kiln::testing::error_of;
using kiln::testing::TempDir;

// 10 samples, sample i = [i, 100 + i] (f32), label i % 3: every value names its sample.
ClassificationDataset ten_samples() {
  Tensor features(TensorType{DType::kF32, {10, 2}});
  Tensor labels(TensorType{DType::kI64, {10}});
  for (int i = 0; i < 10; ++i) {
    features.set(2 * i, i);
    features.set(2 * i + 1, 100 + i);
    labels.set(i, i % 3);
  }
  return ClassificationDataset(features, labels, 3);
}

// The sample ids of a batch of ten_samples(), read back from its first feature column, after
// checking that every row and label belong together.
std::vector<int64_t> sample_ids(const Batch& batch) {
  std::vector<int64_t> ids;
  for (int64_t r = 0; r < batch.inputs.shape()[0]; ++r) {
    int64_t id = static_cast<int64_t>(batch.inputs.get(2 * r));
    EXPECT_EQ(batch.inputs.get(2 * r + 1), 100 + id);
    EXPECT_EQ(batch.targets.get(r), id % 3);
    ids.push_back(id);
  }
  return ids;
}


TEST(TrainDataset, GatherSliceAndSampleShape) {
  ClassificationDataset data = ten_samples();
  EXPECT_EQ(data.size(), 10);
  EXPECT_EQ(data.sample_shape(), Shape{2});
  std::vector<int64_t> indices = {3, 0, 7};
  Batch b = data.gather(indices);
  EXPECT_EQ(b.inputs.shape(), (Shape{3, 2}));
  EXPECT_EQ(b.inputs.to_f64(), (std::vector<double>{3, 103, 0, 100, 7, 107}));
  EXPECT_EQ(b.targets.dtype(), DType::kI64);
  EXPECT_EQ(b.targets.to_f64(), (std::vector<double>{0, 0, 1}));

  ClassificationDataset part = data.slice(2, 5);
  EXPECT_EQ(part.size(), 3);
  EXPECT_EQ(part.features().to_f64(), (std::vector<double>{2, 102, 3, 103, 4, 104}));
  EXPECT_EQ(part.labels().to_f64(), (std::vector<double>{2, 0, 1}));

  ClassificationDataset viewed = data.with_sample_shape({1, 2, 1});
  EXPECT_EQ(viewed.features().shape(), (Shape{10, 1, 2, 1}));
  EXPECT_EQ(viewed.gather(indices).inputs.shape(), (Shape{3, 1, 2, 1}));
  std::string message = error_of([&] { data.with_sample_shape({3}); });
  EXPECT_NE(message.find("samples of shape (2,) as (3,)"), std::string::npos) << message;
}

TEST(TrainDataset, ConstructorRejectsBadInput) {
  Tensor features(TensorType{DType::kF32, {3, 2}});
  Tensor labels(TensorType{DType::kI64, {3}});
  labels.set(2, 5);
  std::string message = error_of([&] { ClassificationDataset(features, labels, 3); });
  EXPECT_NE(message.find("label 5 of sample 2"), std::string::npos) << message;
  message = error_of([&] {
    ClassificationDataset(features, Tensor(TensorType{DType::kI64, {4}}), 3);
  });
  EXPECT_NE(message.find("3 feature rows but 4 labels"), std::string::npos) << message;
  message = error_of([&] {
    ClassificationDataset(features, Tensor(TensorType{DType::kI32, {3}}), 3);
  });
  EXPECT_NE(message.find("i64"), std::string::npos) << message;
  message = error_of([&] { ten_samples().gather(std::vector<int64_t>{10}); });
  EXPECT_NE(message.find("sample index 10"), std::string::npos) << message;
}

TEST(TrainDataset, ShuffledOrderIsADeterministicPermutation) {
  std::vector<int64_t> a = shuffled_order(100, 42, 0);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_EQ(a, shuffled_order(100, 42, 0));  // same seed and epoch: same order
  EXPECT_NE(a, shuffled_order(100, 42, 1));  // another epoch
  EXPECT_NE(a, shuffled_order(100, 43, 0));  // another seed
  std::vector<int64_t> identity(100);
  for (int64_t i = 0; i < 100; ++i) identity[i] = i;
  EXPECT_NE(a, identity);
  EXPECT_TRUE(shuffled_order(0, 1, 0).empty());
  EXPECT_EQ(shuffled_order(1, 1, 0), std::vector<int64_t>{0});
}

TEST(TrainDataset, ShuffledOrderIsUniform) {
  // Over 8000 epochs, each of 4 samples should come first about 2000 times. The standard
  // deviation of a count is sqrt(8000 * 1/4 * 3/4) ~ 39, so +-200 is > 5 sigma.
  std::vector<int> first(4, 0);
  for (int epoch = 0; epoch < 8000; ++epoch) ++first[shuffled_order(4, 7, epoch)[0]];
  for (int count : first) EXPECT_NEAR(count, 2000, 200);
}

TEST(TrainDataset, UniformBelowStaysInRange) {
  std::mt19937_64 rng(5);
  std::set<uint64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    uint64_t v = uniform_below(rng, 7);
    ASSERT_LT(v, 7u);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(uniform_below(rng, 1), 0u);
  EXPECT_LT(uniform_below(rng, (uint64_t(1) << 63) + 1), (uint64_t(1) << 63) + 1);
}

TEST(TrainBatcher, TrainingDropsThePartialBatchAndShufflesPerEpoch) {
  Batcher batcher = Batcher::training(ten_samples(), 3, /*seed=*/11);
  ASSERT_EQ(batcher.batches_per_epoch(), 3);  // 10 / 3, the last sample dropped
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> order = batcher.epoch_order(epoch);
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < 3; ++i) {
      Batch b = batcher.batch(epoch, i);
      EXPECT_EQ(b.inputs.shape(), (Shape{3, 2}));
      std::vector<int64_t> ids = sample_ids(b);
      // Batch i takes positions [3i, 3i + 3) of the epoch's order.
      EXPECT_EQ(ids, std::vector<int64_t>(order.begin() + 3 * i, order.begin() + 3 * i + 3));
      seen.insert(seen.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 9u);  // no repeats
  }
  EXPECT_NE(batcher.epoch_order(0), batcher.epoch_order(1));
  // A second Batcher with the same seed makes the same batches (resuming a run).
  Batcher again = Batcher::training(ten_samples(), 3, 11);
  EXPECT_EQ(sample_ids(again.batch(2, 1)), sample_ids(batcher.batch(2, 1)));
  // Step 4 is epoch 1 (3 batches per epoch), batch 1.
  EXPECT_EQ(sample_ids(batcher.batch_at_step(4)), sample_ids(batcher.batch(1, 1)));
}

TEST(TrainBatcher, EvaluationCoversEverySampleInOrder) {
  Batcher batcher = Batcher::evaluation(ten_samples(), 4);
  ASSERT_EQ(batcher.batches_per_epoch(), 3);  // 4 + 4 + 2
  EXPECT_EQ(sample_ids(batcher.batch(0, 0)), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(sample_ids(batcher.batch(5, 1)), (std::vector<int64_t>{4, 5, 6, 7}));
  Batch last = batcher.batch(0, 2);
  EXPECT_EQ(last.inputs.shape(), (Shape{2, 2}));
  EXPECT_EQ(last.inputs.to_f64(), (std::vector<double>{8, 108, 9, 109}));
  EXPECT_EQ(last.targets.to_f64(), (std::vector<double>{2, 0}));
}

TEST(TrainBatcher, RejectsBadOptions) {
  EXPECT_NE(error_of([] { Batcher::training(ten_samples(), 0, 1); }).find("batch_size"),
            std::string::npos);
  std::string message = error_of([] { Batcher::training(ten_samples(), 11, 1); });
  EXPECT_NE(message.find("10 samples"), std::string::npos) << message;
  message = error_of([] { Batcher::training(ten_samples(), 3, 1).batch(0, 3); });
  EXPECT_NE(message.find("batch 3"), std::string::npos) << message;
}

// A produce function whose batch i is a (1,) i64 tensor holding i.
Batch numbered(int64_t i) {
  Batch b{Tensor(TensorType{DType::kI64, {1}}), Tensor(TensorType{DType::kI64, {1}})};
  b.inputs.set(0, static_cast<double>(i));
  return b;
}

TEST(TrainPrefetcher, YieldsEveryBatchInOrderThenEnds) {
  BatchPrefetcher loader(numbered, 5);
  for (int64_t i = 0; i < 5; ++i) {
    std::optional<Batch> b = loader.next();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->inputs.get(0), i);
  }
  EXPECT_FALSE(loader.next().has_value());
  EXPECT_FALSE(loader.next().has_value());
}

TEST(TrainPrefetcher, WorksAheadButNoMoreThanTheQueueDepth) {
  std::atomic<int64_t> produced{0};
  BatchPrefetcher loader(
      [&](int64_t i) {
        ++produced;
        return numbered(i);
      },
      -1, /*depth=*/2);
  for (int64_t consumed = 1; consumed <= 20; ++consumed) {
    ASSERT_EQ(loader.next()->inputs.get(0), consumed - 1);
    // While the consumer "computes", the thread fills the queue: 2 batches beyond those
    // taken. Poll (up to 5 s) rather than sleep a fixed time, so a slow machine still passes.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (produced.load() < consumed + 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(produced.load(), consumed + 2);
  }
  // Destroying the loader while its thread waits for room must return promptly.
}

TEST(TrainPrefetcher, RethrowsTheThreadsExceptionAfterEarlierBatches) {
  BatchPrefetcher loader(
      [](int64_t i) {
        if (i == 3) fail("batch {} is broken", i);
        return numbered(i);
      },
      10);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(loader.next()->inputs.get(0), i);
  try {
    loader.next();
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "batch 3 is broken");
  }
  EXPECT_THROW(loader.next(), Error);  // still failed
}

TEST(TrainPrefetcher, DestructorStopsAnEndlessLoader) {
  for (int repeat = 0; repeat < 20; ++repeat) {
    BatchPrefetcher loader(numbered, -1);
    if (repeat % 2) loader.next();
  }  // each destructor must join; a hang fails the test by timeout
}

TEST(TrainPrefetcher, EpochAndStepLoadersMatchTheBatcher) {
  Batcher batcher = Batcher::training(ten_samples(), 3, 5);
  auto epoch = BatchPrefetcher::for_epoch(batcher, 2);
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_EQ(sample_ids(*epoch->next()), sample_ids(batcher.batch(2, i)));
  EXPECT_FALSE(epoch->next().has_value());
  auto steps = BatchPrefetcher::for_steps(batcher, 2);  // steps 2, 3, 4 = (0,2) (1,0) (1,1)
  EXPECT_EQ(sample_ids(*steps->next()), sample_ids(batcher.batch(0, 2)));
  EXPECT_EQ(sample_ids(*steps->next()), sample_ids(batcher.batch(1, 0)));
  EXPECT_EQ(sample_ids(*steps->next()), sample_ids(batcher.batch(1, 1)));
}

// ---- Fashion-MNIST ----------------------------------------------------------------------------

TEST(TrainFashionMnist, MissingDirectorySaysWhatToInstall) {
  std::string message = error_of([] { load_fashion_mnist("/nonexistent/fashion-mnist"); });
  EXPECT_NE(message.find("/nonexistent/fashion-mnist"), std::string::npos) << message;
  EXPECT_NE(message.find("dataset-fashion-mnist"), std::string::npos) << message;
  TempDir empty;
  message = error_of([&] { load_fashion_mnist(empty.path().string()); });
  EXPECT_NE(message.find("train-images-idx3-ubyte"), std::string::npos) << message;
  EXPECT_NE(message.find("dataset-fashion-mnist"), std::string::npos) << message;
}

TEST(TrainFashionMnist, LoadsSmallUncompressedFiles) {
  // Two 28x28 images: image 0 all 51 (0.2 after / 255), image 1 all 255; labels 7, 2.
  TempDir dir;
  Tensor images(TensorType{DType::kU8, {2, 28, 28}});
  for (int i = 0; i < 784; ++i) images.set(i, 51), images.set(784 + i, 255);
  Tensor labels(TensorType{DType::kU8, {2}});
  labels.set(0, 7);
  labels.set(1, 2);
  for (const char* split : {"train", "t10k"}) {
    write_idx(dir.file(std::string(split) + "-images-idx3-ubyte"), images, false);
    write_idx(dir.file(std::string(split) + "-labels-idx1-ubyte"), labels, false);
  }
  FashionMnist data = load_fashion_mnist(dir.path().string());
  EXPECT_EQ(data.train.features().shape(), (Shape{2, 784}));
  EXPECT_EQ(data.train.features().dtype(), DType::kF32);
  EXPECT_FLOAT_EQ(data.train.features().get(5), 0.2f);
  EXPECT_FLOAT_EQ(data.train.features().get(784 + 5), 1.0f);
  EXPECT_EQ(data.test.labels().to_f64(), (std::vector<double>{7, 2}));
  EXPECT_EQ(data.train.class_names()[7], "Sneaker");

  // A labels file with 3 labels for 2 images.
  Tensor three(TensorType{DType::kU8, {3}});
  write_idx(dir.file("train-labels-idx1-ubyte"), three, false);
  std::string message = error_of([&] { load_fashion_mnist_split(dir.path().string(), "train"); });
  EXPECT_NE(message.find("2 images"), std::string::npos) << message;
  EXPECT_NE(message.find("3 labels"), std::string::npos) << message;
}

class TrainFashionMnistPackage : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::filesystem::is_directory(kFashionMnistDir))
      data_ = new FashionMnist(load_fashion_mnist());
  }
  static void TearDownTestSuite() {
    delete data_;
    data_ = nullptr;
  }
  void SetUp() override {
    if (!data_)
      GTEST_SKIP() << kFashionMnistDir << " not found: apt-get install dataset-fashion-mnist";
  }
  static FashionMnist* data_;
};
FashionMnist* TrainFashionMnistPackage::data_ = nullptr;

TEST_F(TrainFashionMnistPackage, ShapesAndRanges) {
  EXPECT_EQ(data_->train.features().shape(), (Shape{60000, 784}));
  EXPECT_EQ(data_->test.features().shape(), (Shape{10000, 784}));
  EXPECT_EQ(data_->train.labels().shape(), Shape{60000});
  EXPECT_EQ(data_->train.labels().dtype(), DType::kI64);
  const float* pixels = data_->train.features().data<float>();
  auto [lo, hi] = std::minmax_element(pixels, pixels + 60000 * 784);
  EXPECT_EQ(*lo, 0.0f);
  EXPECT_EQ(*hi, 1.0f);
  ClassificationDataset images = data_->train.with_sample_shape(kFashionMnistImageShape);
  EXPECT_EQ(images.features().shape(), (Shape{60000, 1, 28, 28}));
}

TEST_F(TrainFashionMnistPackage, KnownValues) {
  // Read independently from the package's files with zcat and od:
  //   zcat train-labels-idx1-ubyte.gz | od -An -tu1 -j8 -N10  ->  9 0 0 3 0 2 7 2 5 5
  //   zcat t10k-labels-idx1-ubyte.gz  | od -An -tu1 -j8 -N10  ->  9 2 1 1 6 1 4 6 5 7
  //   first train image: pixel sum 76247, pixel 300 = 210; first test image: sum 33456.
  std::vector<double> train_labels = data_->train.labels().to_f64();
  std::vector<double> test_labels = data_->test.labels().to_f64();
  EXPECT_EQ(std::vector<double>(train_labels.begin(), train_labels.begin() + 10),
            (std::vector<double>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
  EXPECT_EQ(std::vector<double>(test_labels.begin(), test_labels.begin() + 10),
            (std::vector<double>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7}));
  double sum = 0, test_sum = 0;
  for (int i = 0; i < 784; ++i) {
    sum += data_->train.features().get(i);
    test_sum += data_->test.features().get(i);
  }
  EXPECT_NEAR(sum, 76247.0 / 255.0, 1e-3);
  EXPECT_NEAR(test_sum, 33456.0 / 255.0, 1e-3);
  EXPECT_FLOAT_EQ(data_->train.features().get(300), 210.0f / 255.0f);
  // Fashion-MNIST is balanced: 6000 train and 1000 test images per class.
  std::vector<int> train_counts(10), test_counts(10);
  for (double l : train_labels) ++train_counts[static_cast<int>(l)];
  for (double l : test_labels) ++test_counts[static_cast<int>(l)];
  EXPECT_EQ(train_counts, std::vector<int>(10, 6000));
  EXPECT_EQ(test_counts, std::vector<int>(10, 1000));
}

}  // namespace
}  // namespace kiln::train
