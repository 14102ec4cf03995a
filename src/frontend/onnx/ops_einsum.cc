// ONNX's Einsum as kiln ops: diagonals (a label repeated in one operand) as gathers, labels only
// one operand has and the output lacks summed first, then the operands contracted left to right,
// each pair as one matmul (batch labels kept as matmul's batch dims, the other labels' groups
// reshaped to M, K and N) so that the products stay GEMMs for the kernels, fusion and autodiff;
// a pair with nothing to contract (an outer product, `i,j->ij`) or of integers is a broadcast
// multiply and a sum instead. The output's transpose comes last.
//
// Labels are numpy's: letters (case matters), and `...` for the broadcast dims, aligned from the
// right across operands; size-1 dims broadcast against their label's size. Without `->` the
// output is the broadcast dims then the letters used once, in ASCII order.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;
using Labels = std::vector<int>;  // one label per axis: 0-51 letters, 52 + k the k-th broadcast dim

constexpr int kFirstBroadcastLabel = 52;

int letter_label(char ch) { return ch >= 'a' ? ch - 'a' + 26 : ch - 'A'; }  // 'A' < 'Z' < 'a' (ASCII)

// One term of the equation: its letters' labels, and where `...` stands (-1: nowhere).
struct Term {
  Labels letters;
  int ellipsis = -1;  // index into letters before which the broadcast dims go
};

Term parse_term(NodeContext& c, const std::string& text) {
  Term t;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '.') {
      if (text.compare(i, 3, "...") != 0 || t.ellipsis >= 0)
        c.fail("equation term '{}': '.' only as one '...'", text);
      t.ellipsis = static_cast<int>(t.letters.size());
      i += 2;
    } else if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z')) {
      t.letters.push_back(letter_label(ch));
    } else {
      c.fail("equation term '{}': '{}' is not a letter or '...'", text, ch);
    }
  }
  return t;
}

// The term's label per axis, with `broadcast` dims at its ellipsis: the last ones of the
// equation's `all_broadcast` (numpy aligns broadcast dims from the right).
Labels expand(const Term& t, int broadcast, int all_broadcast) {
  if (t.ellipsis < 0) return t.letters;
  Labels out(t.letters.begin(), t.letters.begin() + t.ellipsis);
  for (int k = all_broadcast - broadcast; k < all_broadcast; ++k) out.push_back(kFirstBroadcastLabel + k);
  out.insert(out.end(), t.letters.begin() + t.ellipsis, t.letters.end());
  return out;
}

std::string label_name(int label) {
  if (label >= kFirstBroadcastLabel) return fmt::format("...[{}]", label - kFirstBroadcastLabel);
  return std::string(1, static_cast<char>(label < 26 ? 'A' + label : 'a' + label - 26));
}

// An operand on its way through: its value and the label of each axis.
struct Operand {
  Expr x;
  Labels labels;
};

bool contains(const Labels& labels, int label) { return std::find(labels.begin(), labels.end(), label) != labels.end(); }

int position(const Labels& labels, int label) {
  return static_cast<int>(std::find(labels.begin(), labels.end(), label) - labels.begin());
}

// The operand's axes in the order of `order` (every label of the operand, each once).
Operand permuted(const Operand& a, const Labels& order) {
  Ints perm;
  for (int label : order) perm.push_back(position(a.labels, label));
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int64_t>(i);
  return {identity ? a.x : transpose(a.x, perm), order};
}

// The operand with the axes of `labels_to_sum` summed away.
Operand summed(const Operand& a, const Labels& labels_to_sum) {
  if (labels_to_sum.empty()) return a;
  Ints axes;
  Labels kept;
  for (size_t d = 0; d < a.labels.size(); ++d) {
    if (contains(labels_to_sum, a.labels[d])) axes.push_back(static_cast<int64_t>(d));
    else kept.push_back(a.labels[d]);
  }
  if (axes.empty()) return a;
  return {sum(a.x, axes, false), kept};
}

// A label repeated in one operand takes the diagonal: the two axes moved last and flattened,
// positions i * (d + 1) gathered.
Operand diagonals(NodeContext& c, Operand a) {
  for (size_t p = 0; p < a.labels.size(); ++p) {
    for (size_t q = p + 1; q < a.labels.size(); ++q) {
      if (a.labels[p] != a.labels[q]) continue;
      const int64_t d = a.x.dim(static_cast<int>(p));
      if (a.x.dim(static_cast<int>(q)) != d)
        c.fail("label {} repeats in one operand over dims {} and {}: a diagonal needs them equal",
               label_name(a.labels[p]), d, a.x.dim(static_cast<int>(q)));
      Labels order;
      for (size_t k = 0; k < a.labels.size(); ++k)
        if (k != p && k != q) order.push_back(a.labels[k]);
      Ints perm;
      for (size_t k = 0; k < a.labels.size(); ++k)
        if (k != p && k != q) perm.push_back(static_cast<int64_t>(k));
      perm.push_back(static_cast<int64_t>(p));
      perm.push_back(static_cast<int64_t>(q));
      Shape flat;
      for (int64_t k : perm) flat.push_back(a.x.dim(static_cast<int>(k)));
      flat.pop_back();
      flat.back() = d * d;
      Tensor index(TensorType{DType::kI64, {d}});
      for (int64_t i = 0; i < d; ++i) index.data<int64_t>()[i] = i * (d + 1);
      Expr x = reshape(transpose(a.x, perm), flat);
      order.push_back(a.labels[p]);
      return diagonals(c, {gather(x, constant_of(c.b(), index), static_cast<int64_t>(flat.size()) - 1), order});
    }
  }
  return a;
}

int64_t product(const Operand& a, const Labels& labels) {
  int64_t n = 1;
  for (int label : labels) n *= a.x.dim(position(a.labels, label));
  return n;
}

// a and b contracted over the labels both have that `keep` lacks; labels only one of them has
// are all in `keep` (summed before). The result's labels: batch (both, kept), a's own, b's own.
Operand contract(const Operand& a_in, const Operand& b_in, const std::set<int>& keep) {
  Operand a = a_in, b = b_in;
  Labels batch, contracted, only_a, only_b;
  for (int label : a.labels) {
    if (!contains(b.labels, label)) only_a.push_back(label);
    else if (keep.count(label)) batch.push_back(label);
    else contracted.push_back(label);
  }
  for (int label : b.labels)
    if (!contains(a.labels, label)) only_b.push_back(label);
  // A contracted label of size 1 on one side broadcasts: the other side's sum over it is the
  // same contraction (sum_j a * b_j = a * sum_j b_j), and leaves both sides size 1.
  Labels a_sums, b_sums;
  for (int label : contracted) {
    const int64_t da = a.x.dim(position(a.labels, label)), db = b.x.dim(position(b.labels, label));
    if (da == 1 && db != 1) b_sums.push_back(label);
    if (db == 1 && da != 1) a_sums.push_back(label);
  }
  auto keep_dims_sum = [](Operand o, const Labels& labels) {
    if (labels.empty()) return o;
    Ints axes;
    for (int label : labels) axes.push_back(position(o.labels, label));
    return Operand{sum(o.x, axes, true), o.labels};
  };
  a = keep_dims_sum(a, a_sums);
  b = keep_dims_sum(b, b_sums);

  Labels result = batch;
  result.insert(result.end(), only_a.begin(), only_a.end());
  result.insert(result.end(), only_b.begin(), only_b.end());

  if (contracted.empty() || !is_float(a.x.dtype())) {
    // Broadcast multiply over (batch, only_a, only_b, contracted), then the sum.
    Labels all = result;
    all.insert(all.end(), contracted.begin(), contracted.end());
    auto aligned = [&](const Operand& o) {
      Labels own;
      for (int label : all)
        if (contains(o.labels, label)) own.push_back(label);
      Operand p = permuted(o, own);
      Shape s;
      for (int label : all) s.push_back(contains(o.labels, label) ? p.x.dim(position(p.labels, label)) : 1);
      return s == p.x.shape() ? p.x : reshape(p.x, s);
    };
    Expr y = aligned(a) * aligned(b);
    return summed({y, all}, contracted);
  }

  // One matmul: a as (batch..., M, K), or (batch..., K, M) read transposed where a is stored so;
  // b as (batch..., K, N) or (batch..., N, K).
  auto layout = [&](const Operand& o, const Labels& first, const Labels& second, bool& transposed) {
    Labels plain = batch, swapped = batch;
    plain.insert(plain.end(), first.begin(), first.end());
    plain.insert(plain.end(), second.begin(), second.end());
    swapped.insert(swapped.end(), second.begin(), second.end());
    swapped.insert(swapped.end(), first.begin(), first.end());
    transposed = o.labels == swapped && o.labels != plain;
    Operand p = permuted(o, transposed ? swapped : plain);
    Shape s;
    for (int label : batch) s.push_back(p.x.dim(position(p.labels, label)));
    const int64_t n_first = product(p, first), n_second = product(p, second);
    if (transposed) s.insert(s.end(), {n_second, n_first});
    else s.insert(s.end(), {n_first, n_second});
    return s == p.x.shape() ? p.x : reshape(p.x, s);
  };
  bool ta = false, tb = false;
  Expr xa = layout(a, only_a, contracted, ta);
  Expr xb = layout(b, contracted, only_b, tb);
  Expr y = matmul(xa, xb, ta, tb);
  // (batch..., M, N) back to one axis per label; a batch dim of size 1 on one side broadcast.
  const Shape product_shape = y.shape();  // by value: two calls' begin() and end() would not pair
  Shape s(product_shape.begin(), product_shape.end() - 2);
  for (int label : only_a) s.push_back(a.x.dim(position(a.labels, label)));
  for (int label : only_b) s.push_back(b.x.dim(position(b.labels, label)));
  return {s == y.shape() ? y : reshape(y, s), result};
}

std::vector<Expr> einsum(NodeContext& c) {
  if (!c.has_attr("equation")) c.fail("needs an equation");
  std::string equation;
  for (char ch : c.attr_string("equation", ""))
    if (ch != ' ') equation += ch;
  const size_t arrow = equation.find("->");
  const std::string lhs = equation.substr(0, arrow);
  std::vector<Term> terms;
  for (size_t start = 0;;) {
    const size_t comma = lhs.find(',', start);
    terms.push_back(parse_term(c, lhs.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (static_cast<int>(terms.size()) != c.num_inputs())
    c.fail("equation '{}' has {} operand terms for {} inputs", equation, terms.size(), c.num_inputs());

  // Broadcast dims of each operand, and of the equation (the most any operand has).
  std::vector<Operand> operands;
  std::vector<int> broadcast(terms.size());
  int all_broadcast = 0;
  for (size_t i = 0; i < terms.size(); ++i) {
    Expr x = c.in(static_cast<int>(i));
    const int letters = static_cast<int>(terms[i].letters.size());
    broadcast[i] = terms[i].ellipsis >= 0 ? x.rank() - letters : 0;
    if (broadcast[i] < 0 || (terms[i].ellipsis < 0 && x.rank() != letters))
      c.fail("equation term {} has {} letters{} for input {} of {}", i, letters,
             terms[i].ellipsis >= 0 ? " and '...'" : "", i, to_string(x.type()));
    all_broadcast = std::max(all_broadcast, broadcast[i]);
    operands.push_back({x, {}});
  }
  for (size_t i = 0; i < terms.size(); ++i) operands[i].labels = expand(terms[i], broadcast[i], all_broadcast);
  const DType dtype = operands.at(0).x.dtype();
  for (const Operand& o : operands)
    if (o.x.dtype() != dtype) c.fail("inputs differ in dtype: {} and {}", dtype_name(dtype), dtype_name(o.x.dtype()));

  // Each label's size: equal across operands, or 1 (broadcast).
  std::map<int, int64_t> size;
  std::map<int, int> uses;
  for (const Operand& o : operands) {
    std::set<int> seen;
    for (size_t d = 0; d < o.labels.size(); ++d) {
      const int label = o.labels[d];
      const int64_t n = o.x.dim(static_cast<int>(d));
      auto [it, fresh] = size.insert({label, n});
      if (!fresh && it->second != n && n != 1 && it->second != 1)
        c.fail("label {} has sizes {} and {}", label_name(label), it->second, n);
      if (!fresh && it->second == 1) it->second = n;
      if (label < kFirstBroadcastLabel) uses[label] += 1;
    }
  }

  Labels output;
  if (arrow == std::string::npos) {
    for (int k = 0; k < all_broadcast; ++k) output.push_back(kFirstBroadcastLabel + k);
    for (const auto& [label, count] : uses)
      if (count == 1) output.push_back(label);
  } else {
    const Term out = parse_term(c, equation.substr(arrow + 2));
    if (out.ellipsis < 0 && all_broadcast > 0)
      c.fail("equation '{}': the inputs' '...' dims need a '...' in the output", equation);
    output = expand(out, out.ellipsis >= 0 ? all_broadcast : 0, all_broadcast);
    for (size_t i = 0; i < output.size(); ++i) {
      if (!size.count(output[i])) c.fail("output label {} is in no input", label_name(output[i]));
      if (std::count(output.begin(), output.end(), output[i]) > 1)
        c.fail("output label {} repeats", label_name(output[i]));
    }
  }

  for (Operand& o : operands) o = diagonals(c, o);
  // Labels needed after operand i: the output's and those of the operands after it.
  auto needed_after = [&](size_t i) {
    std::set<int> keep(output.begin(), output.end());
    for (size_t j = i + 1; j < operands.size(); ++j) keep.insert(operands[j].labels.begin(), operands[j].labels.end());
    return keep;
  };
  // Labels no later step needs are summed as early as possible (fewer elements to multiply).
  auto sum_unneeded = [&](const Operand& o, const std::set<int>& keep, const Labels& also) {
    Labels drop;
    for (int label : o.labels)
      if (!keep.count(label) && !contains(also, label)) drop.push_back(label);
    return summed(o, drop);
  };
  Operand acc = sum_unneeded(operands[0], needed_after(0), {});
  for (size_t i = 1; i < operands.size(); ++i) {
    const std::set<int> keep = needed_after(i);
    Operand next = sum_unneeded(operands[i], keep, acc.labels);
    acc = contract(acc, next, keep);
  }
  acc = sum_unneeded(acc, std::set<int>(output.begin(), output.end()), {});
  Operand y = permuted(acc, output);
  // A label of size 1 in every operand that has it, broadcast to its size elsewhere (an output
  // label some operand holds at 1 and no contraction met).
  Shape want;
  for (int label : output) want.push_back(size.at(label));
  return {y.x.shape() == want ? y.x : broadcast_to(y.x, want)};
}

}  // namespace

void add_einsum_rules(RuleTable& r) { r["Einsum"] = einsum; }

}  // namespace kiln::onnx
