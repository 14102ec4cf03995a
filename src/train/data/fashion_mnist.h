// Fashion-MNIST (Zalando's 28x28 grey images of clothes in 10 classes: 60,000 train, 10,000
// test), loaded from the IDX files that Debian's dataset-fashion-mnist package installs, so
// the examples and tests train on real data without fetching anything at run time.
#pragma once

#include <string>

#include "train/data/dataset.h"

namespace kiln::train {

// Where dataset-fashion-mnist installs train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
// t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist/";
inline constexpr int64_t kFashionMnistClasses = 10;
inline constexpr int64_t kFashionMnistPixels = 28 * 28;
// The per-sample shape for convolutional models: (1, 28, 28), one channel.
inline const Shape kFashionMnistImageShape = {1, 28, 28};

struct FashionMnist {
  ClassificationDataset train;  // features (60000, 784) f32 in [0, 1], labels (60000,) i64
  ClassificationDataset test;   // features (10000, 784) f32 in [0, 1], labels (10000,) i64
};

// Loads both splits from `dir` (files gzip-compressed as the package installs them, or
// uncompressed with the same names less ".gz"). Images become f32 (N, 784) pixels / 255; call
// dataset.with_sample_shape(kFashionMnistImageShape) for (N, 1, 28, 28). A missing directory
// or file throws kiln::Error that says to install dataset-fashion-mnist.
FashionMnist load_fashion_mnist(const std::string& dir = kFashionMnistDir);
// One split: "train" or "t10k" (the files' prefix).
ClassificationDataset load_fashion_mnist_split(const std::string& dir, const std::string& split);

// The 10 class names, in label order ("T-shirt/top", "Trouser", ...).
const std::vector<std::string>& fashion_mnist_class_names();

}  // namespace kiln::train
