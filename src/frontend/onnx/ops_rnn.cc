// ONNX's recurrent layers RNN, GRU and LSTM, unrolled over their time steps (kiln's shapes are
// static, so the sequence length is known): the input projection of every step is one matmul
// (T, B, I) x (I, G * H) ahead of the loop, each step one matmul of the hidden state by R and the
// gates' elementwise math, so autodiff gives backpropagation through time. Directions forward,
// reverse and bidirectional, both layouts, the initial states, peepholes, clip, GRU's
// linear_before_reset, LSTM's input_forget, the activation functions the spec lists, and
// sequence_lens (positions at or past a batch entry's length hold its state and output 0; the
// reverse direction reads each sequence from its own last element).
#include <algorithm>
#include <cctype>

#include "frontend/onnx/converter.h"

namespace kiln::onnx {
namespace {

using Ints = std::vector<int64_t>;
using Activation = std::function<Expr(Expr)>;

enum class Cell { kRnn, kGru, kLstm };

int gate_count(Cell cell) { return cell == Cell::kRnn ? 1 : cell == Cell::kGru ? 3 : 4; }

// The activations of the node, one list per direction, with their alpha and beta consumed in
// order by the functions that take them (the defaults where the lists run out).
std::vector<std::vector<Activation>> activations(NodeContext& c, Cell cell, int directions) {
  const std::vector<std::string> defaults =
      cell == Cell::kRnn ? std::vector<std::string>{"Tanh"}
      : cell == Cell::kGru ? std::vector<std::string>{"Sigmoid", "Tanh"}
                           : std::vector<std::string>{"Sigmoid", "Tanh", "Tanh"};
  std::vector<std::string> names;
  if (c.has_attr("activations")) {
    const auto* node_attr = &c.node();
    for (const auto& a : node_attr->attribute())
      if (a.name() == "activations")
        for (const auto& s : a.strings()) names.push_back(s);
    c.ignore_attr("activations");
  } else {
    for (int d = 0; d < directions; ++d) names.insert(names.end(), defaults.begin(), defaults.end());
  }
  if (names.size() != defaults.size() * static_cast<size_t>(directions))
    c.fail("{} activations for {} direction(s) of {} functions each", names.size(), directions, defaults.size());
  const std::vector<double> alphas = c.attr_floats("activation_alpha"), betas = c.attr_floats("activation_beta");
  size_t next_alpha = 0, next_beta = 0;
  auto alpha = [&](double fallback) { return next_alpha < alphas.size() ? alphas[next_alpha++] : fallback; };
  auto beta = [&](double fallback) { return next_beta < betas.size() ? betas[next_beta++] : fallback; };
  std::vector<std::vector<Activation>> out(directions);
  for (size_t i = 0; i < names.size(); ++i) {
    std::string name = names[i];
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::tolower(ch); });
    Activation f;
    if (name == "sigmoid") f = [](Expr x) { return sigmoid(x); };
    else if (name == "tanh") f = [](Expr x) { return tanh(x); };
    else if (name == "relu") f = [](Expr x) { return relu(x); };
    else if (name == "softsign") f = [](Expr x) { return x / (abs(x) + 1.0); };
    else if (name == "softplus") f = [](Expr x) { return log(exp(x) + 1.0); };
    else if (name == "affine") {
      const double a = alpha(1.0), b = beta(0.0);
      f = [a, b](Expr x) { return x * a + b; };
    } else if (name == "leakyrelu") {
      const double a = alpha(0.01);
      f = [a](Expr x) { return where(lt(x, scalar_like(x, 0.0)), x * a, x); };
    } else if (name == "thresholdedrelu") {
      const double a = alpha(1.0);
      f = [a](Expr x) { return where(gt(x, scalar_like(x, a)), x, scalar_like(x, 0.0)); };
    } else if (name == "scaledtanh") {
      const double a = alpha(1.0), b = beta(1.0);
      f = [a, b](Expr x) { return tanh(x * b) * a; };
    } else if (name == "hardsigmoid") {
      const double a = alpha(0.2), b = beta(0.5);
      f = [a, b](Expr x) { return minimum(maximum(x * a + b, scalar_like(x, 0.0)), scalar_like(x, 1.0)); };
    } else if (name == "elu") {
      const double a = alpha(1.0);
      f = [a](Expr x) { return where(lt(x, scalar_like(x, 0.0)), (exp(x) - 1.0) * a, x); };
    } else {
      c.unsupported("activation '{}'", names[i]);
    }
    out[i / defaults.size()].push_back(f);
  }
  return out;
}

// x (T, B, ...) with each batch entry's first lengths[b] steps reversed (ReverseSequence).
Expr reversed_within(Builder& b, const Expr& x, const Expr& lengths) {
  const int64_t steps = x.dim(0), batch = x.dim(1);
  Shape flat = x.shape();
  flat.erase(flat.begin());
  flat[0] = steps * batch;
  Expr len = reshape(lengths, {1, batch});
  Expr t = b.iota({steps, batch}, 0, DType::kI64);
  Expr source = where(lt(t, len), len - b.scalar(1, DType::kI64) - t, t);
  Expr index = source * b.scalar(static_cast<double>(batch), DType::kI64) + b.iota({steps, batch}, 1, DType::kI64);
  return gather(reshape(x, flat), index, 0);
}

Rule recurrent(Cell cell) {
  return [cell](NodeContext& c) {
    Builder& b = c.b();
    Expr x = c.in(0), w = c.in(1), r = c.in(2);
    if (!is_float(x.dtype())) c.unsupported("needs float inputs, got {}", dtype_name(x.dtype()));
    const int64_t layout = c.opset() >= 14 ? c.attr_int("layout", 0) : 0;
    if (layout != 0 && layout != 1) c.fail("layout {} (expected 0 or 1)", layout);
    const std::string direction = c.attr_string("direction", "forward");
    if (direction != "forward" && direction != "reverse" && direction != "bidirectional")
      c.fail("direction '{}' (expected forward, reverse or bidirectional)", direction);
    const int directions = direction == "bidirectional" ? 2 : 1;
    if (x.rank() != 3) c.fail("X must be 3-D, got {}", to_string(x.type()));
    if (layout == 1) x = transpose(x, {1, 0, 2});  // (T, B, I) from here on
    const int64_t steps = x.dim(0), batch = x.dim(1), width = x.dim(2);
    const int gates = gate_count(cell);
    const int64_t hidden = c.attr_int("hidden_size", r.rank() == 3 ? r.dim(2) : 0);
    if (w.shape() != Shape{directions, gates * hidden, width} || r.shape() != Shape{directions, gates * hidden, hidden})
      c.fail("W {} and R {} do not fit {} direction(s), {} gates of hidden size {} over inputs of {}",
             to_string(w.type()), to_string(r.type()), directions, gates, hidden, width);
    const double clip = c.attr_float("clip", 0.0);
    const bool clipped = c.has_attr("clip");
    if (clipped && !(clip > 0)) c.fail("clip {} (expected > 0)", clip);
    const bool linear_before_reset = cell == Cell::kGru && c.attr_int("linear_before_reset", 0) != 0;
    const bool input_forget = cell == Cell::kLstm && c.attr_int("input_forget", 0) != 0;
    const std::vector<std::vector<Activation>> fs = activations(c, cell, directions);

    // Optional inputs: B (D, 2 G H), sequence_lens (B,), initial_h / initial_c (D, B, H) or
    // (B, D, H) in layout 1, P (D, 3 H).
    auto state_input = [&](int i, const std::string& what) -> std::optional<Expr> {
      if (!c.has_input(i)) return std::nullopt;
      Expr s = c.in(i);
      if (layout == 1) s = transpose(s, {1, 0, 2});
      if (s.shape() != Shape{directions, batch, hidden})
        c.fail("{} is {}, expected ({}, {}, {}) in layout {}", what, to_string(c.in(i).type()), layout == 0 ? directions : batch,
               layout == 0 ? batch : directions, hidden, layout);
      return s;
    };
    std::optional<Expr> bias;
    if (c.has_input(3)) {
      bias = c.in(3);
      if (bias->shape() != Shape{directions, 2 * gates * hidden}) c.fail("B is {}, expected ({}, {})", to_string(bias->type()), directions, 2 * gates * hidden);
    }
    std::optional<Expr> lengths;
    if (c.has_input(4)) {
      Expr l = cast_to(c.in(4), DType::kI64);
      if (l.shape() != Shape{batch}) c.fail("sequence_lens is {}, expected ({},)", to_string(c.in(4).type()), batch);
      bool full = false;
      if (std::optional<Tensor> known = c.known(4)) {  // every sequence whole: nothing to mask
        full = true;
        for (int64_t i = 0; i < known->numel(); ++i) full = full && static_cast<int64_t>(known->get(i)) == steps;
      }
      if (!full) lengths = minimum(l, b.scalar(static_cast<double>(steps), DType::kI64));
    }
    const std::optional<Expr> initial_h = state_input(5, "initial_h");
    const std::optional<Expr> initial_c = cell == Cell::kLstm ? state_input(6, "initial_c") : std::nullopt;
    std::optional<Expr> peepholes;
    if (cell == Cell::kLstm && c.has_input(7)) {
      peepholes = c.in(7);
      if (peepholes->shape() != Shape{directions, 3 * hidden}) c.fail("P is {}, expected ({}, {})", to_string(peepholes->type()), directions, 3 * hidden);
    }

    auto clamp = [&](Expr v) {
      return clipped ? minimum(maximum(v, scalar_like(v, -clip)), scalar_like(v, clip)) : v;
    };
    auto row = [&](const Expr& v, int64_t d) {  // (D, N) -> (N,) of direction d
      return reshape(slice_axis(v, 0, d, d + 1), {v.dim(1)});
    };
    auto part = [&](const Expr& v, int64_t k, int64_t n = 1) { return slice_axis(v, -1, k * hidden, (k + n) * hidden); };

    std::vector<Expr> ys, last_h, last_c;
    for (int64_t d = 0; d < directions; ++d) {
      const bool backwards = direction == "reverse" || d == 1;
      const std::vector<Activation>& f = fs[d];
      Expr wd = reshape(slice_axis(w, 0, d, d + 1), {gates * hidden, width});
      Expr rd = reshape(slice_axis(r, 0, d, d + 1), {gates * hidden, hidden});
      Expr xd = backwards && lengths ? reversed_within(b, x, *lengths) : x;
      // Every step's input projection at once, with the biases that do not depend on r.
      Expr projected = matmul(xd, wd, false, true);  // (T, B, G H)
      Expr recurrent_bias;
      if (bias) {
        Expr bd = row(*bias, d);
        Expr wb = slice_axis(bd, 0, 0, gates * hidden), rb = slice_axis(bd, 0, gates * hidden, 2 * gates * hidden);
        if (cell == Cell::kGru) {
          // z and r take both biases here; h takes Rb_h inside the reset (after R h) or here.
          Expr outside = concat({slice_axis(rb, 0, 0, 2 * hidden),
                                 linear_before_reset ? b.full({hidden}, 0.0, x.dtype()) : slice_axis(rb, 0, 2 * hidden, 3 * hidden)}, 0);
          projected = projected + (wb + outside);
          recurrent_bias = slice_axis(rb, 0, 2 * hidden, 3 * hidden);
        } else {
          projected = projected + (wb + rb);
        }
      }
      const std::vector<Expr> inputs = split(projected, Ints(steps, 1), 0);
      Expr h = initial_h ? reshape(slice_axis(*initial_h, 0, d, d + 1), {batch, hidden}) : b.full({batch, hidden}, 0.0, x.dtype());
      Expr cs = initial_c ? reshape(slice_axis(*initial_c, 0, d, d + 1), {batch, hidden}) : b.full({batch, hidden}, 0.0, x.dtype());
      Expr pi, po, pf;
      if (peepholes) {
        Expr pd = row(*peepholes, d);
        pi = part(pd, 0), po = part(pd, 1), pf = part(pd, 2);
      }
      std::vector<Expr> outputs(steps);
      for (int64_t k = 0; k < steps; ++k) {
        const int64_t t = backwards && !lengths ? steps - 1 - k : k;
        Expr xt = reshape(inputs[t], {batch, gates * hidden});
        Expr h_new, c_new;
        if (cell == Cell::kRnn) {
          h_new = f[0](clamp(xt + matmul(h, rd, false, true)));
        } else if (cell == Cell::kGru) {
          Expr zr = clamp(part(xt, 0, 2) + matmul(h, slice_axis(rd, 0, 0, 2 * hidden), false, true));
          Expr z = f[0](part(zr, 0)), reset = f[0](part(zr, 1));
          Expr rh = slice_axis(rd, 0, 2 * hidden, 3 * hidden);
          Expr candidate;
          if (linear_before_reset) {
            Expr hr = matmul(h, rh, false, true);
            if (recurrent_bias.id() >= 0) hr = hr + recurrent_bias;
            candidate = part(xt, 2) + reset * hr;
          } else {
            candidate = part(xt, 2) + matmul(reset * h, rh, false, true);
          }
          Expr hc = f[1](clamp(candidate));
          h_new = (1.0 - z) * hc + z * h;
        } else {  // LSTM, gates i o f c
          Expr g = xt + matmul(h, rd, false, true);
          Expr gi = part(g, 0), go = part(g, 1), gf = part(g, 2), gc = part(g, 3);
          if (peepholes) {
            gi = gi + pi * cs;
            gf = gf + pf * cs;
          }
          Expr i = f[0](clamp(gi));
          Expr fg = input_forget ? 1.0 - i : f[0](clamp(gf));
          c_new = fg * cs + i * f[1](clamp(gc));
          if (peepholes) go = go + po * c_new;
          h_new = f[0](clamp(go)) * f[2](c_new);
        }
        if (lengths) {  // past its length an entry keeps its state and outputs 0
          Expr live = cast(gt(reshape(*lengths, {batch, 1}), b.scalar(static_cast<double>(k), DType::kI64)), x.dtype());
          outputs[t] = h_new * live;
          h = outputs[t] + h * (1.0 - live);
          if (cell == Cell::kLstm) cs = c_new * live + cs * (1.0 - live);
        } else {
          outputs[t] = h = h_new;
          if (cell == Cell::kLstm) cs = c_new;
        }
      }
      std::vector<Expr> rows;
      for (const Expr& o : outputs) rows.push_back(reshape(o, {1, 1, batch, hidden}));
      Expr y = steps == 1 ? rows[0] : concat(rows, 0);  // (T, 1, B, H)
      if (backwards && lengths) y = reshape(reversed_within(b, reshape(y, {steps, batch, hidden}), *lengths), y.shape());
      ys.push_back(y);
      last_h.push_back(reshape(h, {1, batch, hidden}));
      last_c.push_back(reshape(cs, {1, batch, hidden}));
    }
    Expr y = directions == 1 ? ys[0] : concat(ys, 1);                  // (T, D, B, H)
    Expr yh = directions == 1 ? last_h[0] : concat(last_h, 0);        // (D, B, H)
    Expr yc = directions == 1 ? last_c[0] : concat(last_c, 0);
    if (layout == 1) {
      y = transpose(y, {2, 0, 1, 3});  // (B, T, D, H)
      yh = transpose(yh, {1, 0, 2});   // (B, D, H)
      yc = transpose(yc, {1, 0, 2});
    }
    std::vector<Expr> out{y, yh};
    if (cell == Cell::kLstm) out.push_back(yc);
    return out;
  };
}

}  // namespace

void add_rnn_rules(RuleTable& r) {
  r["RNN"] = recurrent(Cell::kRnn);
  r["GRU"] = recurrent(Cell::kGru);
  r["LSTM"] = recurrent(Cell::kLstm);
}

}  // namespace kiln::onnx
