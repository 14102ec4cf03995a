"""Integers stay exact through the ONNX front end, and a slice never empties silently.

PyTorch exports x[:, k:] as a Slice whose end is INT64_MAX; read through a double that end
overflowed and the slice imported as empty, so h[:, 2:].square().sum() trained with loss 0.
Here: ONNX models whose slices use INT64_MAX and INT64_MIN bounds, negative and huge steps and
bounds out of range, against numpy's slicing on random inputs (the oracle; ONNX's reference is
numpy slicing); int64 values above 2^53 through constants, folded shape arithmetic and int64
kernels against numpy's int64; torch modules that slice against torch's own training; and an
empty slice feeding a sum or a product is one error naming the nodes."""
import numpy as np
import pytest

import kiln

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
SHAPE = (4, 6, 5)


def build(tmp_path, nodes, outputs, initializers=(), inputs=(), name="m"):
    """kiln.compile of an ONNX model with data input x (SHAPE) and the extra `inputs`, whose first
    output is loss = sum(x * w) (w a trained param: a step needs a loss) and then `outputs`."""
    w = numpy_helper.from_array(np.full(SHAPE, 0.5, np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("ReduceSum", ["xw"], ["loss"], keepdims=0)] + list(nodes)
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)] + list(inputs),
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])] + list(outputs),
        [w] + list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = str(tmp_path / f"{name}.onnx")
    onnx.save(model, path)
    return path


def i64(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def slice_case(tmp_path, index, starts, ends, axes, steps):
    """(output name, its nodes and initializers) of Slice(x, starts, ends, axes, steps)."""
    p = f"s{index}_"
    inits = [i64(p + "starts", starts), i64(p + "ends", ends), i64(p + "axes", axes), i64(p + "steps", steps)]
    node = helper.make_node("Slice", ["x", p + "starts", p + "ends", p + "axes", p + "steps"], [p + "out"],
                            name=f"Slice_{index}")
    return p + "out", node, inits


def numpy_slice(x, starts, ends, axes, steps):
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[a] = slice(s, e, st)
    return x[tuple(index)]


FIXED = [  # (starts, ends, axes, steps): PyTorch's x[:, k:] and friends, numpy's edge cases
    ([2], [INT64_MAX], [1], [1]),                       # x[:, 2:] as torch exports it
    ([INT64_MIN], [3], [1], [1]),                       # x[:, :3] from the other end
    ([INT64_MAX], [INT64_MIN], [1], [-1]),              # x[:, ::-1]
    ([-1], [INT64_MIN], [2], [-2]),                     # x[..., ::-2]
    ([-100], [100], [0], [1]),                          # bounds past both ends
    ([5], [1], [0], [-2]),                              # a negative step from past the end
    ([1], [INT64_MAX], [1], [INT64_MAX]),               # a step of INT64_MAX: one element
    ([INT64_MAX], [INT64_MIN], [0], [INT64_MIN]),       # a step of INT64_MIN: one element
    ([1, INT64_MIN, -2], [INT64_MAX, -1, INT64_MIN], [0, -1, 1], [2, 1, -3]),
    ([10], [INT64_MAX], [1], [1]),                      # empty, as a graph output (allowed)
    ([-100], [-100], [2], [-1]),                        # empty with a negative step
]


def random_cases(count, seed):
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        axes = rng.permutation(3)[: rng.integers(1, 4)].tolist()
        starts, ends, steps = [], [], []
        for a in axes:
            d = SHAPE[a]
            low = [INT64_MIN, -100, -d - 1, -d, -d + 1, 0, 1, 2]  # before or at the front
            high = [-2, -1, d - 1, d, d + 3, INT64_MAX]           # at or past the back
            step = int(rng.choice([1, 1, 2, 3, -1, -1, -2, INT64_MAX, INT64_MIN]))
            if rng.random() < 0.8:  # mostly bounds in the step's direction, so most cases hold elements
                first, last = (low, high) if step > 0 else (high, low)
            else:
                first = last = low + high
            starts.append(int(rng.choice(first)))
            ends.append(int(rng.choice(last)))
            steps.append(step)
        cases.append((starts, ends, [int(a) - 3 if rng.integers(2) else int(a) for a in axes], steps))
    return cases


@pytest.mark.parametrize("group", ["fixed", "random"])
def test_slices_match_numpy(tmp_path, group):
    cases = FIXED if group == "fixed" else random_cases(40, 1)
    nodes, inits, outs = [], [], []
    for i, case in enumerate(cases):
        out, node, case_inits = slice_case(tmp_path, i, *case)
        nodes.append(node)
        inits += case_inits
        outs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    step = kiln.compile(build(tmp_path, nodes, outs, inits, name=group), (np.zeros(SHAPE, np.float32),))
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
        got = step.evaluate(x)[1:]
        for case, value in zip(cases, got):
            want = numpy_slice(x, *case)
            assert value.shape == want.shape, f"Slice {case}: shape {value.shape}, numpy {want.shape}"
            np.testing.assert_array_equal(value, want, err_msg=f"Slice {case}")


def test_zero_step_is_an_error(tmp_path):
    out, node, inits = slice_case(tmp_path, 0, [0], [3], [1], [0])
    path = build(tmp_path, [node], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    with pytest.raises(kiln.Error, match=r"Slice_0.*step 0"):
        kiln.compile(path, (np.zeros(SHAPE, np.float32),))


def test_int64_above_two_to_the_53_stays_exact(tmp_path):
    big, k = 2**62 + 1, 2**61 + 3
    nodes = [
        # Folded at import: a constant above 2^53 plus a shape computation.
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["dim"], axis=0),
        helper.make_node("Mul", ["dim", "dim"], ["dim2"]),
        helper.make_node("Add", ["big", "dim2"], ["folded"]),
        # On the data input n: int64 kernels at run time.
        helper.make_node("Mul", ["n", "k"], ["nk"]),
        helper.make_node("Add", ["nk", "k"], ["y"]),
        helper.make_node("Div", ["y", "minus7"], ["q"]),
        helper.make_node("Neg", ["y"], ["neg"]),
        helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0),
        helper.make_node("ReduceMax", ["y"], ["largest"], keepdims=0),
        helper.make_node("ArgMax", ["y"], ["where_largest"], keepdims=0),
        helper.make_node("Add", ["y", "one_i64"], ["y_plus_1"]),
        helper.make_node("Equal", ["y", "y_plus_1"], ["same"]),
        helper.make_node("Greater", ["n", "zero"], ["positive"]),
        helper.make_node("Where", ["positive", "y", "q"], ["chosen"]),
        helper.make_node("Concat", ["y", "folded"], ["joined"], axis=0),
    ]
    inits = [i64("one", 1), i64("big", [big]), i64("k", [k]), i64("minus7", [-7]), i64("one_i64", [1]),
             i64("zero", [0])]
    names = ["folded", "y", "q", "neg", "total", "largest", "where_largest", "same", "chosen", "joined"]
    outs = [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in names]
    n_info = helper.make_tensor_value_info("n", TensorProto.INT64, [8])
    path = build(tmp_path, nodes, outs, inits, inputs=[n_info])
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    n = np.random.default_rng(1).integers(-2, 3, size=8).astype(np.int64)
    step = kiln.compile(path, (x, n))
    got = dict(zip(names, step.evaluate(x, n)[1:]))

    y = n * np.int64(k) + np.int64(k)  # numpy's int64: exact, wrapping
    q = np.array([abs(int(v)) // 7 * (-1 if v > 0 else 1) for v in y], dtype=np.int64)  # toward zero
    want = {"folded": np.array([big + 36], np.int64), "y": y, "q": q, "neg": -y, "total": y.sum(),
            "largest": y.max(), "where_largest": np.argmax(y), "same": y == y + 1,
            "chosen": np.where(n > 0, y, q), "joined": np.concatenate([y, [big + 36]])}
    assert got["folded"].tolist() == [2**62 + 37], "2^62 + 1 + 6 * 6, folded at import"
    for name in names:
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), f"{name}: {got[name]} != {want[name]}"


def test_empty_slice_into_a_sum_names_both_nodes(tmp_path):
    out, node, inits = slice_case(tmp_path, 12, [5], [INT64_MAX], [0], [1])  # dim 0 is 4: empty
    nodes = [node, helper.make_node("ReduceSum", [out], ["summed"], keepdims=0, name="ReduceSum_13")]
    path = build(tmp_path, nodes, [helper.make_tensor_value_info("summed", TensorProto.FLOAT, [])], inits)
    with pytest.raises(kiln.Error) as error:
        kiln.compile(path, (np.zeros(SHAPE, np.float32),))
    message = str(error.value)
    for fragment in ("node 'ReduceSum_13' (ReduceSum)", "empty f32[0,6,5]", "node 'Slice_12' (Slice)",
                     "f32[4,6,5]", "= [5]", "= [9223372036854775807]"):
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert message.count("\n") == 0, "one line"


def test_empty_slice_into_a_matmul_is_an_error(tmp_path):
    out, node, inits = slice_case(tmp_path, 3, [7], [9], [2], [1])  # dim 2 is 5: (4, 6, 0)
    v = numpy_helper.from_array(np.ones((0, 3), np.float32), "v")
    nodes = [node, helper.make_node("MatMul", [out, "v"], ["product"], name="MatMul_4")]
    path = build(tmp_path, nodes, [helper.make_tensor_value_info("product", TensorProto.FLOAT, None)], inits + [v])
    with pytest.raises(kiln.Error, match=r"node 'MatMul_4' \(MatMul\).*node 'Slice_3' \(Slice\)"):
        kiln.compile(path, (np.zeros(SHAPE, np.float32),))


def test_concat_keeps_empty_pieces_only_of_the_same_shape(tmp_path):
    a, node_a, inits_a = slice_case(tmp_path, 0, [9], [INT64_MAX], [1], [1])  # (4, 0, 5): may join
    b, node_b, inits_b = slice_case(tmp_path, 1, [9], [INT64_MAX], [0], [1])  # (0, 6, 5): may not
    good = build(tmp_path, [node_a, helper.make_node("Concat", ["x", a], ["joined"], axis=1)],
                 [helper.make_tensor_value_info("joined", TensorProto.FLOAT, None)], inits_a, name="good")
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    assert np.array_equal(kiln.compile(good, (x,)).evaluate(x)[1], x)
    bad = build(tmp_path, [node_b, helper.make_node("Concat", ["x", b], ["joined"], axis=1, name="Concat_2")],
                [helper.make_tensor_value_info("joined", TensorProto.FLOAT, None)], inits_b, name="bad")
    with pytest.raises(kiln.Error, match=r"Concat_2.*f32\[0,6,5\].*every axis but 1"):
        kiln.compile(bad, (x,))


# ---- the user's view: torch modules that slice, against torch's own training ----------------------

torch = pytest.importorskip("torch")


class SliceSquare(torch.nn.Module):
    """h[:, 2:].square().sum(): the slice ends at INT64_MAX in the export."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        return h[:, 2:].square().sum()


class SliceCat(torch.nn.Module):
    """cat([h[:, :2], h[:, 2:]]): the second half is no longer dropped."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        return (torch.cat([h[:, :2], 3 * h[:, 2:]], 1) - 1).square().mean()


class RotateHalf(torch.nn.Module):
    """LLaMA's rotate_half: x[..., h:] with h from the shape."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 8)

    def forward(self, x):
        h = self.fc(x)
        half = h.shape[-1] // 2
        rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
        return (h + 2 * rotated).square().mean()


@pytest.mark.parametrize("cls", [SliceSquare, SliceCat, RotateHalf])
def test_torch_slices_train_like_torch(cls):
    torch.manual_seed(0)
    model = cls()
    reference = cls()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(3, 6, generator=g) for _ in range(4)]
    step = kiln.compile(model, (data[0],), optimizer=kiln.SGD(lr=0.05))
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for x in data:
        opt.zero_grad()
        want = reference(x)
        want.backward()
        opt.step()
        got = float(step(x))
        assert got == pytest.approx(float(want), rel=1e-5, abs=1e-6)
        assert abs(float(want)) > 1e-3  # a real loss, not the empty slice's 0


def test_torch_empty_slice_into_a_loss_is_an_error():
    class EmptySum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 5)

        def forward(self, x):
            return self.fc(x)[:, 7:].square().sum()  # torch: 0, and no gradient

    # Through ONNX the empty value is an error naming the Slice; torch.export's capture (PyTorch
    # >= 2.5) sees torch's own program, whose loss of an empty slice is torch's 0.
    with pytest.raises(kiln.Error, match=r"empty f32\[3,0\].*\(Slice\)"):
        kiln.compile(EmptySum(), (torch.randn(3, 6),), capture="onnx")
