// Fashion-MNIST from the IDX files of Debian's dataset-fashion-mnist (see fashion_mnist.h).
#include "train/data/fashion_mnist.h"

#include <filesystem>

#include "train/data/idx.h"

namespace kiln::train {
namespace {

// The file `name` in `dir`, compressed or not; throws with the install hint when neither exists.
std::string find_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail(
        "fashion-mnist: directory '{}' not found: install the Debian package "
        "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass the directory "
        "holding the IDX files",
        dir);
  for (const std::string& candidate : {name + ".gz", name}) {
    fs::path path = fs::path(dir) / candidate;
    if (fs::exists(path, ec)) return path.string();
  }
  fail(
      "fashion-mnist: neither '{0}.gz' nor '{0}' is in '{1}': install the Debian package "
      "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)",
      name, dir);
}

}  // namespace

const std::vector<std::string>& fashion_mnist_class_names() {
  static const std::vector<std::string> kNames = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                                  "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                                  "Bag",         "Ankle boot"};
  return kNames;
}

ClassificationDataset load_fashion_mnist_split(const std::string& dir, const std::string& split) {
  KILN_CHECK(split == "train" || split == "t10k",
             "fashion-mnist: split must be \"train\" or \"t10k\", got \"{}\"", split);
  std::string images_path = find_file(dir, split + "-images-idx3-ubyte");
  std::string labels_path = find_file(dir, split + "-labels-idx1-ubyte");
  Tensor images = read_idx(images_path);
  Tensor labels = read_idx(labels_path);
  KILN_CHECK(images.dtype() == DType::kU8 && images.rank() == 3 && images.shape()[1] == 28 &&
                 images.shape()[2] == 28,
             "fashion-mnist: '{}' holds {}, expected u8 images of shape (N, 28, 28)", images_path,
             to_string(images.type()));
  KILN_CHECK(labels.dtype() == DType::kU8 && labels.rank() == 1,
             "fashion-mnist: '{}' holds {}, expected u8 labels of shape (N,)", labels_path,
             to_string(labels.type()));
  int64_t n = images.shape()[0];
  KILN_CHECK(labels.shape()[0] == n, "fashion-mnist: '{}' has {} images but '{}' has {} labels",
             images_path, n, labels_path, labels.shape()[0]);

  Tensor features(TensorType{DType::kF32, {n, kFashionMnistPixels}});
  const uint8_t* pixels = images.data<uint8_t>();
  float* out = features.data<float>();
  for (int64_t i = 0; i < n * kFashionMnistPixels; ++i) out[i] = pixels[i] / 255.0f;
  Tensor targets(TensorType{DType::kI64, {n}});
  const uint8_t* l = labels.data<uint8_t>();
  int64_t* t = targets.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) t[i] = l[i];
  return ClassificationDataset(std::move(features), std::move(targets), kFashionMnistClasses,
                               fashion_mnist_class_names());
}

FashionMnist load_fashion_mnist(const std::string& dir) {
  return {load_fashion_mnist_split(dir, "train"), load_fashion_mnist_split(dir, "t10k")};
}

}  // namespace kiln::train
