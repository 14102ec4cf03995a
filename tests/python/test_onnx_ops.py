"""ONNX ops the importer decomposes into kiln ops (src/frontend/onnx/ops_einsum.cc,
ops_resize.cc), forward and gradients against independent oracles on random inputs:

- Einsum: torch modules calling torch.einsum (exported to ONNX's Einsum), their output against
  numpy.einsum in float64 and their parameters' gradients against torch's autograd; hand-built
  ONNX models for what torch's export does not write (size-1 broadcasting, integers).
- Resize: torch modules calling F.interpolate (nearest, bilinear and bicubic with align_corners
  False and True, 1-D linear, trilinear; scale_factor and size), output and gradients against
  torch; hand-built opset 18 models with antialias against torch's antialiased interpolate; opset
  10 Resize, Upsample and opset 13 modes against the ONNX reference (onnx's interpolate_nd).

Gradients are read from one SGD step with lr = 1: param_before - param_after."""
import copy
import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
import kiln  # noqa: E402

if not kiln._kiln.onnx_available():
    pytest.skip("kiln is built without the ONNX front end", allow_module_level=True)

from onnx import TensorProto, helper, mapping, numpy_helper  # noqa: E402

F = torch.nn.functional


def kiln_forward_and_grads(model, inputs):
    """(kiln's outputs after the loss, kiln's gradients by parameter name) of a module whose
    forward returns (loss, output). Through ONNX (capture="onnx"): these tests are of the ONNX
    import rules (Einsum, Resize, GridSample, the RNNs)."""
    step = kiln.compile(model, inputs, optimizer=kiln.SGD(lr=1.0), capture="onnx")
    outputs = step.evaluate(*inputs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step(*inputs)
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return outputs[1:], grads


def torch_grads(model, inputs):
    reference = copy.deepcopy(model)
    loss, *_ = reference(*inputs)
    loss.backward()
    return {n: p.grad for n, p in reference.named_parameters()}


def assert_close(got, want, what, rtol=1e-4):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max())
    assert err <= rtol * scale + 1e-6, f"{what}: max difference {err:.3g} at scale {scale:.3g}"


# ---- Einsum ------------------------------------------------------------------------------------

class Einsum(torch.nn.Module):
    def __init__(self, equation, shapes):
        super().__init__()
        self.equation = equation
        self.operands = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in shapes])

    def forward(self, weights):
        y = torch.einsum(self.equation, *self.operands)
        return (y * weights).sum(), y


EQUATIONS = [
    ("i,j->ij", [(5,), (4,)]),                                  # rotary tables' outer product
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),         # attention scores
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),         # attention output
    ("bij,bjk->bik", [(3, 2, 4), (3, 4, 5)]),
    ("bij,bkj->bik", [(3, 2, 4), (3, 5, 4)]),
    ("abc,cd->abd", [(2, 3, 4), (4, 5)]),                      # a linear layer
    ("bqhd,bkhd->bhqk", [(2, 4, 3, 5), (2, 6, 3, 5)]),         # heads in the middle
    ("bn,anm,bm->ba", [(3, 4), (2, 4, 5), (3, 5)]),            # bilinear, three operands
    ("ij->ji", [(3, 4)]),
    ("ij->i", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),                                           # trace
    ("i,i", [(5,), (5,)]),                                      # implicit output: a scalar
    ("ij,jk", [(3, 4), (4, 2)]),                                # implicit output: ik
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,ij->", [(3, 4), (3, 4)]),
    ("Bi,bi->Bb", [(2, 3), (4, 3)]),                            # case matters
    ("bijk->bkji", [(2, 3, 4, 5)]),
    ("...ij,...jk->...ik", [(3, 2, 4, 5), (2, 5, 3)]),         # broadcast dims of two ranks
    ("...ii->...i", [(3, 5, 5)]),
    ("b...d,bd->b...", [(2, 3, 4, 5), (2, 5)]),
    ("ijk,jil->kl", [(3, 4, 5), (4, 3, 2)]),                    # two contracted labels, transposed
]


@pytest.mark.parametrize("equation,shapes", EQUATIONS, ids=[e for e, _ in EQUATIONS])
def test_einsum_against_numpy_and_autograd(equation, shapes):
    torch.manual_seed(0)
    model = Einsum(equation, shapes)
    operands = [p.detach().numpy().astype(np.float64) for p in model.operands]
    want = np.einsum(equation, *operands)
    weights = torch.randn(*want.shape) if want.ndim else torch.randn(())
    want_grads = torch_grads(model, (weights,))
    (y,), grads = kiln_forward_and_grads(model, (weights,))
    assert_close(y, want, f"{equation} forward")
    for name, g in want_grads.items():
        assert_close(grads[name], g, f"{equation} gradient of {name}", rtol=1e-3)


def run_onnx(nodes, inputs, initializers, output, opset, tmp_path, name="model"):
    """Evaluates a hand-built ONNX graph in kiln: its first output is a loss made here (the sum
    of `output` plus a scalar parameter, so that the step has one), the second `output`; returns
    kiln's value of `output`."""
    loss_nodes = []
    if output.type.tensor_type.elem_type != TensorProto.FLOAT:
        loss_nodes.append(helper.make_node("Cast", [output.name], ["as_float"], to=TensorProto.FLOAT))
        loss_nodes.append(helper.make_node("ReduceSum", ["as_float"], ["sum"], keepdims=0))
    else:
        loss_nodes.append(helper.make_node("ReduceSum", [output.name], ["sum"], keepdims=0))
    loss_nodes.append(helper.make_node("Add", ["sum", "offset"], ["loss"]))
    initializers = initializers + [("offset", np.array(0.5, dtype=np.float32))]
    graph = helper.make_graph(
        nodes + loss_nodes, name,
        [helper.make_tensor_value_info(n, mapping.NP_TYPE_TO_TENSOR_TYPE[a.dtype], a.shape) for n, a in inputs],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), output],
        [numpy_helper.from_array(a, n) for n, a in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="test")
    path = os.path.join(tmp_path, name + ".onnx")
    onnx.save(model, path)
    step = kiln.compile(path, tuple(a for _, a in inputs), optimizer=kiln.SGD(lr=1e-3))  # only evaluated
    return np.asarray(step.evaluate(*(a for _, a in inputs))[1])


ONNX_EINSUMS = [
    ("ij,jk->ik", [(2, 1), (3, 4)], np.float32),    # j of size 1 broadcasts: b is summed over it
    ("ij,jk->ik", [(3, 4), (4, 2)], np.int64),      # integers: a multiply and a sum, no matmul
    ("bi,i->bi", [(1, 3), (3,)], np.float32),
    ("...i,...i->...", [(2, 1, 3), (4, 3)], np.float64),
]


@pytest.mark.parametrize("equation,shapes,dtype", ONNX_EINSUMS, ids=[f"{e}-{d.__name__}" for e, _, d in ONNX_EINSUMS])
def test_einsum_models_torch_does_not_write(equation, shapes, dtype, tmp_path):
    rng = np.random.default_rng(1)
    arrays = [(rng.integers(-5, 5, s) if dtype == np.int64 else rng.standard_normal(s)).astype(dtype) for s in shapes]
    want = np.einsum(equation, *[a.astype(np.float64) for a in arrays])
    names = [f"x{i}" for i in range(len(arrays))]
    out = helper.make_tensor_value_info("y", mapping.NP_TYPE_TO_TENSOR_TYPE[np.dtype(dtype)], want.shape)
    got = run_onnx([helper.make_node("Einsum", names, ["y"], equation=equation)], list(zip(names, arrays)), [],
                   out, 12, str(tmp_path))
    assert got.dtype == dtype
    assert_close(got, want, equation, rtol=1e-5)


# ---- Resize through F.interpolate ----------------------------------------------------------------

class Interpolate(torch.nn.Module):
    def __init__(self, shape, **options):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(*shape))
        self.options = options

    def forward(self, x, weights):
        y = F.interpolate(self.p * x, **self.options)
        return (y * weights).sum(), y


INTERPOLATIONS = [
    ((2, 3, 4, 5), dict(scale_factor=2, mode="nearest")),
    ((2, 3, 4, 5), dict(size=(7, 11), mode="nearest")),
    ((2, 3, 8, 9), dict(size=(3, 4), mode="nearest")),
    ((2, 3, 4, 6), dict(scale_factor=(1.5, 2.5), mode="nearest")),
    ((2, 3, 4, 5), dict(scale_factor=2, mode="bilinear", align_corners=False)),
    ((2, 3, 4, 5), dict(size=(7, 11), mode="bilinear", align_corners=False)),
    ((2, 3, 8, 9), dict(size=(3, 4), mode="bilinear", align_corners=False)),
    ((2, 3, 4, 5), dict(scale_factor=2, mode="bilinear", align_corners=True)),
    ((2, 3, 4, 5), dict(size=(7, 11), mode="bilinear", align_corners=True)),
    ((2, 3, 8, 9), dict(size=(3, 4), mode="bilinear", align_corners=True)),
    ((2, 3, 4, 5), dict(scale_factor=2, mode="bicubic", align_corners=False)),
    ((2, 3, 5, 6), dict(size=(8, 3), mode="bicubic", align_corners=True)),
    ((2, 3, 7), dict(scale_factor=2, mode="linear", align_corners=False)),
    ((2, 3, 7), dict(size=4, mode="nearest")),
    ((1, 2, 3, 4, 5), dict(size=(5, 6, 4), mode="trilinear", align_corners=False)),
]


@pytest.mark.parametrize("shape,options", INTERPOLATIONS, ids=[f"{o['mode']}-{i}" for i, (_, o) in enumerate(INTERPOLATIONS)])
def test_interpolate_against_torch(shape, options):
    torch.manual_seed(0)
    model = Interpolate(shape, **options)
    x = torch.randn(*shape)
    with torch.no_grad():
        _, want = model(x, 1.0)
    weights = torch.randn(*want.shape)
    want_grads = torch_grads(model, (x, weights))
    (y,), grads = kiln_forward_and_grads(model, (x, weights))
    assert_close(y, want, "forward")
    for name, g in want_grads.items():
        assert_close(grads[name], g, f"gradient of {name}", rtol=1e-3)


def resize_node(inputs, **attributes):
    return helper.make_node("Resize", inputs, ["y"], **attributes)


@pytest.mark.parametrize("mode,size", [("linear", (3, 5)), ("linear", (2, 9)), ("cubic", (4, 3)), ("cubic", (3, 6))])
def test_antialiased_resize_against_torch(mode, size, tmp_path):
    # torch's antialiased interpolate leaves out the taps past the edges and renormalizes (ONNX's
    # exclude_outside) and uses A = -0.5 for bicubic.
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 12)).astype(np.float32)
    want = F.interpolate(torch.from_numpy(x), size=size, mode="bilinear" if mode == "linear" else "bicubic",
                         align_corners=False, antialias=True).numpy()
    sizes = np.array([2, 3, *size], dtype=np.int64)
    node = resize_node(["x", "", "", "sizes"], mode=mode, antialias=1, exclude_outside=1, cubic_coeff_a=-0.5)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, want.shape)
    got = run_onnx([node], [("x", x)], [("sizes", sizes)], out, 18, str(tmp_path))
    assert_close(got, want, f"antialiased {mode} to {size}", rtol=1e-4)


def onnx_reference():
    from onnx.backend.test.case.node import resize
    return resize


REFERENCE_CASES = [
    # (opset, attributes, scales or None, sizes or None, roi or None)
    (13, dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1), [1, 1, 0.6, 1.7], None, None),
    (13, dict(mode="cubic", coordinate_transformation_mode="asymmetric"), None, [1, 2, 9, 4], None),
    (13, dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.5),
     None, [1, 2, 4, 7], [0, 0, 0.2, -0.3, 1, 1, 0.9, 1.2]),
    (13, dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
     [1, 1, 1.7, 0.6], None, None),
    (13, dict(mode="nearest", coordinate_transformation_mode="align_corners", nearest_mode="ceil"), None, [1, 2, 7, 3], None),
    (13, dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"), None, [1, 2, 1, 7], None),
    (13, dict(mode="linear", coordinate_transformation_mode="align_corners"), [1, 1, 0.6, 2.3], None, None),
]


@pytest.mark.parametrize("opset,attributes,scales,sizes,roi", REFERENCE_CASES, ids=[str(i) for i in range(len(REFERENCE_CASES))])
def test_resize_against_onnx_reference(opset, attributes, scales, sizes, roi, tmp_path):
    resize = onnx_reference()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    mode = attributes["mode"]
    coordinates = attributes.get("coordinate_transformation_mode", "half_pixel")
    if mode == "nearest":
        coefficients = lambda r: resize.nearest_coeffs(r, mode=attributes.get("nearest_mode", "round_prefer_floor"))  # noqa: E731
    elif mode == "linear":
        coefficients = resize.linear_coeffs
    else:
        coefficients = lambda r: resize.cubic_coeffs(r, A=attributes.get("cubic_coeff_a", -0.75))  # noqa: E731
    want = resize.interpolate_nd(
        x, coefficients, output_size=None if sizes is None else np.array(sizes),
        scale_factors=None if scales is None else np.array(scales, dtype=np.float32),
        roi=None if roi is None else np.array(roi, dtype=np.float32), coordinate_transformation_mode=coordinates,
        exclude_outside=bool(attributes.get("exclude_outside", 0)),
        extrapolation_value=attributes.get("extrapolation_value", 0.0)).astype(np.float32)
    initializers = []
    names = ["x", "roi" if roi is not None else "", "scales" if scales is not None else "", "sizes" if sizes is not None else ""]
    if roi is not None:
        initializers.append(("roi", np.array(roi, dtype=np.float32)))
    if scales is not None:
        initializers.append(("scales", np.array(scales, dtype=np.float32)))
    if sizes is not None:
        initializers.append(("sizes", np.array(sizes, dtype=np.int64)))
    while names[-1] == "":
        names.pop()
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, want.shape)
    # Float initializers would be params: the scales and roi go in as Constant nodes instead.
    nodes = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(a, n)) for n, a in initializers]
    got = run_onnx(nodes + [resize_node(names, **attributes)], [("x", x)], [], out, opset, str(tmp_path))
    assert_close(got, want, str(attributes), rtol=1e-5)


@pytest.mark.parametrize("op,opset,mode", [("Resize", 10, "nearest"), ("Resize", 10, "linear"),
                                           ("Upsample", 9, "nearest"), ("Upsample", 9, "linear"),
                                           ("Upsample", 7, "linear")])
def test_opset_10_resize_and_upsample_are_asymmetric(op, opset, mode, tmp_path):
    resize = onnx_reference()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 4, 5)).astype(np.float32)
    scales = np.array([1, 1, 2, 1.5] if op == "Upsample" else [1, 1, 0.5, 1.5], dtype=np.float32)
    coefficients = (lambda r: resize.nearest_coeffs(r, mode="floor")) if mode == "nearest" else resize.linear_coeffs
    want = resize.interpolate_nd(x, coefficients, scale_factors=scales,
                                 coordinate_transformation_mode="asymmetric").astype(np.float32)
    if opset < 9:
        nodes = [helper.make_node(op, ["x"], ["y"], mode=mode, scales=scales.tolist())]
    else:
        nodes = [helper.make_node("Constant", [], ["scales"], value=numpy_helper.from_array(scales, "scales")),
                 helper.make_node(op, ["x", "scales"], ["y"], mode=mode)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, want.shape)
    got = run_onnx(nodes, [("x", x)], [], out, opset, str(tmp_path))
    assert_close(got, want, f"{op}-{opset} {mode}", rtol=1e-5)


def test_resize_axes_and_aspect_ratio_policy_mean_the_full_scales(tmp_path):
    # Opset 18's axes and keep_aspect_ratio_policy restate a resize of scales on every axis:
    # (6, 8) to at most (3, 6) keeping the aspect ratio is scale 0.5 on both.
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, 3, 4))
    full = run_onnx([helper.make_node("Constant", [], ["scales"], value=numpy_helper.from_array(
        np.array([1, 1, 0.5, 0.5], dtype=np.float32), "scales")), resize_node(["x", "", "scales"], mode="linear")],
        [("x", x)], [], out, 18, str(tmp_path), "full")
    policy = run_onnx([resize_node(["x", "", "", "sizes"], mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_larger")],
                      [("x", x)], [("sizes", np.array([3, 6], dtype=np.int64))], out, 18, str(tmp_path), "policy")
    assert_close(policy, full, "not_larger over axes 2, 3", rtol=1e-6)
    want = F.interpolate(torch.from_numpy(x), scale_factor=0.5, mode="bilinear", align_corners=False).numpy()
    assert_close(full, want, "scales 0.5 against torch", rtol=1e-5)


# ---- RNN, GRU, LSTM through torch.nn ---------------------------------------------------------------

class Recurrent(torch.nn.Module):
    def __init__(self, cls, **options):
        super().__init__()
        self.rnn = cls(**options)

    def forward(self, x, weights):
        y, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return (y * weights).sum() + (h * h).sum(), y


RECURRENT = [
    (torch.nn.LSTM, dict(input_size=3, hidden_size=4, batch_first=True, bidirectional=True)),
    (torch.nn.LSTM, dict(input_size=3, hidden_size=5, num_layers=2)),
    (torch.nn.GRU, dict(input_size=3, hidden_size=4, batch_first=True, bidirectional=True)),
    (torch.nn.GRU, dict(input_size=4, hidden_size=3)),
    (torch.nn.RNN, dict(input_size=3, hidden_size=4, nonlinearity="tanh", bidirectional=True)),
    (torch.nn.RNN, dict(input_size=3, hidden_size=4, nonlinearity="relu", batch_first=True)),
]


@pytest.mark.parametrize("cls,options", RECURRENT, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(RECURRENT)])
def test_recurrent_layers_against_torch(cls, options):
    # torch exports its recurrent layers as ONNX's LSTM, GRU (linear_before_reset) and RNN ops,
    # which kiln unrolls over the 5 time steps.
    torch.manual_seed(0)
    model = Recurrent(cls, **options)
    x = torch.randn(2, 5, options["input_size"]) if options.get("batch_first") else torch.randn(5, 2, options["input_size"])
    with torch.no_grad():
        _, want = model(x, 1.0)
    weights = torch.randn(*want.shape)
    want_grads = torch_grads(model, (x, weights))
    (y,), grads = kiln_forward_and_grads(model, (x, weights))
    assert_close(y, want, "forward")
    for name, g in want_grads.items():
        assert_close(grads[name], g, f"gradient of {name}", rtol=1e-3)


# ---- GridSample through F.grid_sample -------------------------------------------------------------

class GridSample(torch.nn.Module):
    def __init__(self, shape, grid_shape, **options):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(*shape))
        self.grid = torch.nn.Parameter(torch.rand(*grid_shape) * 2.4 - 1.2)  # some taps outside
        self.options = options

    def forward(self, x, weights):
        y = F.grid_sample(self.p * x, self.grid, **self.options)
        return (y * weights).sum(), y


GRID_SAMPLES = [dict(mode=m, padding_mode=p, align_corners=a) for m in ("bilinear", "nearest", "bicubic")
                for p in ("zeros", "border", "reflection") for a in (False, True)]


@pytest.mark.parametrize("options", GRID_SAMPLES, ids=["-".join(str(v) for v in o.values()) for o in GRID_SAMPLES])
def test_grid_sample_against_torch(options):
    torch.manual_seed(0)
    model = GridSample((2, 3, 5, 6), (2, 4, 7, 2), **options)
    x = torch.randn(2, 3, 5, 6)
    with torch.no_grad():
        _, want = model(x, 1.0)
    weights = torch.randn(*want.shape)
    want_grads = torch_grads(model, (x, weights))
    (y,), grads = kiln_forward_and_grads(model, (x, weights))
    assert_close(y, want, "forward")
    for name, g in want_grads.items():
        if name == "grid" and options["mode"] == "nearest":
            continue  # a step function: torch's gradient is 0, kiln has none to give
        assert_close(grads[name], g, f"gradient of {name}", rtol=1e-3)


def test_lstm_sequence_lens_against_torch_on_each_sequence(tmp_path):
    # ONNX's sequence_lens: each batch entry is a sequence of its own length, the reverse
    # direction reads it from its own last step, Y is 0 past it and Y_h is its last state. torch
    # run on each entry cut to its length is the oracle. torch's gates are i f g o, ONNX's i o f c.
    torch.manual_seed(0)
    steps, batch, width, hidden = 5, 3, 3, 4
    lstm = torch.nn.LSTM(width, hidden, bidirectional=True)
    lengths = np.array([5, 2, 3], dtype=np.int32)
    x = np.random.default_rng(6).standard_normal((steps, batch, width)).astype(np.float32)

    def onnx_order(t):
        i, f, g, o = t.detach().numpy().reshape(4, hidden, -1)
        return np.concatenate([i, o, f, g]).reshape(4 * hidden, -1)

    directions = ["", "_reverse"]
    w = np.stack([onnx_order(getattr(lstm, "weight_ih_l0" + d)) for d in directions])
    r = np.stack([onnx_order(getattr(lstm, "weight_hh_l0" + d)) for d in directions])
    b = np.stack([np.concatenate([onnx_order(getattr(lstm, "bias_ih_l0" + d)).ravel(),
                                  onnx_order(getattr(lstm, "bias_hh_l0" + d)).ravel()]) for d in directions])
    node = helper.make_node("LSTM", ["x", "w", "r", "b", "lens"], ["y", "y_h"], hidden_size=hidden, direction="bidirectional")
    constants = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(a.astype(np.float32), n))
                 for n, a in (("w", w), ("r", r), ("b", b))]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, (steps, 2, batch, hidden))
    got = run_onnx(constants + [node], [("x", x), ("lens", lengths)], [], out, 14, str(tmp_path))
    for e, n in enumerate(lengths):
        with torch.no_grad():
            want, _ = lstm(torch.from_numpy(x[:n, e:e + 1]))  # (n, 1, 2 H): forward then reverse
        want = want.numpy().reshape(n, 2, hidden)
        assert_close(got[:n, :, e], want, f"entry {e} of length {n}", rtol=1e-5)
        assert not np.any(got[n:, :, e]), f"entry {e}: outputs past its length"
