#include "ir/shape.h"

#include "support/error.h"

namespace kiln {

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorType::numel() const { return kiln::numel(shape); }

std::string to_string(const Shape& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

std::string to_string(const TensorType& type) {
  return fmt::format("{}[{}]", dtype_name(type.dtype), fmt::join(type.shape, ","));
}

std::vector<int64_t> strides_of(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      fail("shapes {} and {} do not broadcast (dimension {} is {} vs {})", to_string(a),
           to_string(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int normalize_axis(int64_t axis, int rank) {
  if (axis < -rank || axis >= rank || (rank == 0 && axis != 0 && axis != -1))
    fail("axis {} is out of range for rank {} (expected {}..{})", axis, rank, -rank,
         rank == 0 ? 0 : rank - 1);
  return static_cast<int>(axis < 0 ? axis + rank : axis);
}

std::vector<int64_t> broadcast_strides(const Shape& from, const Shape& to) {
  std::vector<int64_t> own = strides_of(from);
  std::vector<int64_t> out(to.size(), 0);
  size_t offset = to.size() - from.size();
  for (size_t i = 0; i < from.size(); ++i) out[offset + i] = from[i] == 1 ? 0 : own[i];
  return out;
}

}  // namespace kiln
