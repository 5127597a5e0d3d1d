"""Every failure a user can cause raises a specific ``HoadError`` subclass whose message names the
cause and the fix (STYLE.md "Errors"); never a bare KeyError/AssertionError/RuntimeError."""

import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import jacrev

import hoad

THIS_FILE = os.path.basename(__file__)
aten = torch.ops.aten


def f_xy(x, y):
    return (x.sin() * y).sum()


X = rand(2, 3, seed=1)
Y = rand(2, 3, seed=2)


def raises(exc, fn, *fragments):
    """Run ``fn``; it must raise exactly ``exc`` (or a subclass) and its message must contain each
    fragment (case-insensitive). Returns the message."""
    with pytest.raises(hoad.HoadError) as info:
        fn()
    e = info.value
    assert isinstance(e, exc), f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    assert not isinstance(e, hoad.HoadInternalError), f"a user error surfaced as an internal error: {e}"
    msg = str(e)
    for frag in fragments:
        assert frag.lower() in msg.lower(), f"{frag!r} not in message: {msg}"
    return msg


# ------------------------------------------------------------------------------ hierarchy
@pytest.mark.parametrize("cls", [
    hoad.InvalidArgumentError, hoad.CaptureError, hoad.DataDependentControlFlowError, hoad.RandomnessError,
    hoad.UnsupportedOperatorError, hoad.OutputError, hoad.BatchCouplingError, hoad.HoadInternalError,
])
def test_every_error_is_a_hoad_error(cls):
    assert issubclass(cls, hoad.HoadError)
    assert issubclass(hoad.HoadError, Exception)


class _Drifting:
    """An attribute whose value is not the same at two reads in a row."""

    def __init__(self):
        self.reads = 0

    def __getattribute__(self, name):
        if name == "scale":
            object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
            return float(object.__getattribute__(self, "reads"))
        return object.__getattribute__(self, name)

    scale = 1.0


def _planted_compile_failure(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(torch._inductor, "standalone_compile", broken)
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", broken)
    return lambda: hoad.compile(lambda x: x.cos().exp().sum(), order=2, backend="inductor")(rand(4, seed=3))


def _unfinished_reduction():
    """DDP's reducer refusing a forward after a backward that left a parameter out (the real case
    runs on 2 ranks in tests/test_distributed.py)."""
    from hoad.distributed import synchronized

    class Reducer:
        def _pre_forward(self):
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one")

    return synchronized([Reducer()], lambda: ())


def _drifting():
    obj = _Drifting()
    return hoad.compile(lambda x: (obj.scale * x.sin()).sum(), order=2)(rand(3, seed=4))


# every class a user can meet: a case, what its message must say caused it, and the way out it
# must give (regexes); test_every_error_class_has_a_case keeps the table complete
MESSAGES = {
    hoad.InvalidArgumentError: (_drifting, r"obj\.scale changed \(\d\.0 -> \d\.0\)",
                                r"Keep such a value in a tensor"),
    hoad.CaptureError: (lambda: hoad.compile(lambda x: torch.autograd.grad(x.sin().sum(), x)[0].sum(), order=1)(
        rand(3, seed=5).requires_grad_()), r"runs autograd itself", r"hoad\.compile|order"),
    hoad.DataDependentControlFlowError: (lambda: hoad.compile(lambda x: x.sin() if x.sum() > 0 else x.cos(), order=1)(
        rand(3, seed=6)), r"control flow .*depends on tensor values", r"torch\.where"),
    hoad.RandomnessError: (lambda: hoad.compile(lambda x: F.dropout(x, 0.5).sum(), order=1)(rand(3, seed=7)),
                           r"draws random numbers \(aten\.bernoulli", r"eval\(\) mode|pass the noise in"),
    hoad.UnsupportedOperatorError: (lambda: hoad.compile(lambda x: torch.special.bessel_j0(x).sum(), order=1)(
        rand(3, seed=8)), r"no derivative rule for aten\.special_bessel_j0", r"hoad\.register_"),
    hoad.OutputError: (lambda: hoad.compile(lambda x: (x, "label"), order=1)(rand(3, seed=9)),
                       r"output\[1\] is 'label', not a tensor", r"return other values from another function"),
    hoad.BatchCouplingError: (lambda: hoad.compile(lambda x: (x - x.mean(0)).sin().sum(-1), order=2, batch_dim=0)(
        rand(4, 3, seed=10)), r"aten\.mean\.dim .*mixes entries along the batch axis", r"drop batch_dim"),
    hoad.MemoryBudgetError: (lambda: hoad.compile(lambda x: x.sin().sum(), order=3, memory_budget=1000)(
        rand(200, seed=11)), r"over the memory budget of 1000 B", r"Ways out: .*a larger memory_budget"),
    hoad.DistributedError: (_unfinished_reduction, r"did not get a gradient for every parameter",
                            r"find_unused_parameters=True"),
    hoad.CompileError: (_planted_compile_failure, r"Inductor failed to compile .*planted", r"backend='eager'"),
    hoad.ExecutionError: (lambda: hoad.compile(lambda x, i: x[i].sin().sum(), order=1)(
        rand(3, seed=12), torch.tensor([0, 7])), r"itself fails on these inputs \(IndexError", r"Fix the inputs"),
}


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
def test_each_error_class_names_its_cause_and_the_way_out(cls, monkeypatch):
    case, cause, way_out = MESSAGES[cls]
    if case is _planted_compile_failure:
        case = case(monkeypatch)
    with pytest.raises(hoad.HoadError) as info:
        case()
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    assert re.search(cause, str(info.value)), f"the cause ({cause}) is not named: {info.value}"
    assert re.search(way_out, str(info.value)), f"no way out ({way_out}): {info.value}"


def test_every_error_class_has_a_case():
    import hoad.errors

    classes = {c for c in vars(hoad.errors).values() if isinstance(c, type) and issubclass(c, hoad.HoadError)}
    assert classes - {hoad.HoadError, hoad.HoadInternalError} == set(MESSAGES)


def test_capture_errors_share_a_base():
    assert issubclass(hoad.DataDependentControlFlowError, hoad.CaptureError)
    assert issubclass(hoad.RandomnessError, hoad.CaptureError)


# ---------------------------------------------------------------- where a failure comes from
def test_an_error_in_the_users_function_is_a_capture_error():
    def f(x):
        return x @ torch.ones(5, 2, dtype=torch.float64)  # shapes do not match

    with pytest.raises(hoad.CaptureError, match="tracing the function failed") as info:
        hoad.compile(f, order=1)(rand(2, 3))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_in_place_update_of_a_closed_over_buffer_names_the_way_out():
    """It was torch's 'INTERNAL ASSERT FAILED ... please report a bug to PyTorch'."""
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

        def forward(self, x):
            self.seen.add_(x.detach().sum())
            return x.sin().sum()

    m = Counting()
    with pytest.raises(hoad.CaptureError, match=r"updates in place a tensor it does not receive.*hoad.compile\(m\)"):
        hoad.compile(lambda x: m(x), order=2, backend="eager")(rand(3, seed=73))
    hoad.compile(m, order=2, backend="eager")(torch.ones(3, dtype=torch.float64))
    assert float(m.seen) == 3.0


def test_a_failure_at_run_time_is_an_execution_error():
    def f(x, i):
        return x[i].sin().sum()

    cf = hoad.compile(f, order=1)
    cf(rand(3), torch.tensor([0, 2]))
    with pytest.raises(hoad.ExecutionError, match=r"f itself fails on these inputs \(IndexError: index 7 is out of "
                                                  r"bounds.*Fix the inputs") as info:
        cf(rand(3), torch.tensor([0, 7]))
    assert info.value.__cause__ is not None


def test_a_program_failure_where_the_function_runs_is_reported_as_hoads(monkeypatch):
    """The function runs on these inputs, its program does not: hoad's bug, said so."""
    cf = hoad.compile(lambda x: x.sin().sum(), order=1)
    x = rand(3)
    cf(x)
    entry = next(iter(cf._cache.values()))

    def broken(*tensors):
        raise RuntimeError("planted")

    monkeypatch.setattr(entry, "run", broken)
    with pytest.raises(hoad.ExecutionError, match=r"planted\), although the function itself runs on these inputs: "
                                                  "this is a bug in hoad"):
        cf(x)


def test_an_internal_failure_names_the_node(monkeypatch):
    from hoad.rules import RULES

    def broken(ctx, *args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setitem(RULES, aten.sin.default, broken)
    with pytest.raises(hoad.HoadInternalError, match="sin") as info:
        hoad.compile(lambda x: x.sin().sum(), order=1)(rand(3))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


# ---------------------------------------------------------------------------------- order
@pytest.mark.parametrize("order", [0, -1, True, False, None, "2", 2.0])
def test_bad_order(order):
    msg = raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=order), "order")
    assert "1" in msg, f"the message should say the valid range (>= 1): {msg}"


def test_numpy_integers_are_integer_options():
    """np.int64 (what a shape or argmax gives) was refused as order, chunk_size and argnum ("must
    be an int >= 1, got np.int64(2)"), while batch_dim accepted it and a float 0.0 alike."""
    np = pytest.importorskip("numpy")
    res = hoad.compile(f_xy, order=np.int64(2), wrt=(np.int64(0), "y"), backend="eager")(X, Y)
    assert res[0, "y"].shape == X.shape + Y.shape
    g = lambda X: X.sin().sum(-1)  # noqa: E731
    res = hoad.compile(g, order=np.int32(2), batch_dim=np.int64(0), chunk_size=np.int64(2), backend="eager")(X)
    assert res[0, 0].shape == (X.shape[0], X.shape[1], X.shape[1])
    assert hoad.taylor(g, order=np.int64(2), directions=rand(2, X.shape[1]), batch_dim=0)(X)[2].shape == (X.shape[0], 2)
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(g, order=2, batch_dim=0.0), "batch_dim", "0.0")


def test_order_above_the_limit_is_refused_before_building():
    """order=1000 ran ten minutes in the differentiate stage and was killed at 22.8 GB."""
    for make in (lambda k: hoad.compile(f_xy, order=k),
                 lambda k: hoad.taylor(lambda x: x.sin().sum(), order=k, directions=rand(2, 3))):
        raises(hoad.InvalidArgumentError, lambda: make(13), "order=13", "limit of 12", "Bell")
        raises(hoad.InvalidArgumentError, lambda: make(1000), "order=1000")
        make(12)  # accepted (built at the first call)


def test_bad_order_in_decorator_form():
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(order=0), "order")


def test_missing_order():
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy), "order")


def test_not_a_function():
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(3, order=1), "function")


# ------------------------------------------------------------------------------------ wrt
def test_wrt_argnum_out_of_range():
    msg = raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, wrt=2), "wrt")
    assert "x" in msg and "y" in msg, f"the message should list the function's arguments: {msg}"


def test_wrt_argnum_out_of_range_for_the_call():
    def f(*ts):
        return sum(t.sum() for t in ts)

    cf = hoad.compile(f, order=1, wrt=3)
    raises(hoad.InvalidArgumentError, lambda: cf(X, Y), "wrt", "3")


def test_wrt_negative():
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, wrt=-1), "wrt")


def test_unknown_wrt_name():
    msg = raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, wrt="z"), "'z'")
    assert "x" in msg and "y" in msg, f"the message should list the valid names: {msg}"


@pytest.mark.parametrize("wrt", [(0, 0), ("x", "x"), (0, 1, 0)])
def test_duplicate_wrt(wrt):
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, wrt=wrt), "twice")


@pytest.mark.parametrize("wrt", [("x", 0), (1, "y")])
def test_duplicate_wrt_by_name_and_argnum(wrt):
    """The same input named once by name and once by argnum is a duplicate too, whether caught at
    compile time or at the first call; it must not silently produce wrong (zero) blocks."""

    def go():
        hoad.compile(f_xy, order=2, wrt=wrt)(X, Y)

    raises(hoad.InvalidArgumentError, go, "wrt")


@pytest.mark.parametrize("wrt", [[0, 1.5], [], 0.0, None, (), ("x", 1.5)])
def test_wrt_of_wrong_type(wrt):
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, wrt=wrt), "wrt")


def test_wrt_argument_is_a_python_float():
    cf = hoad.compile(f_xy, order=2, wrt=1)
    raises(hoad.InvalidArgumentError, lambda: cf(X, 2.0), "float", "tensor")


def test_wrt_argument_is_an_integer_tensor():
    cf = hoad.compile(f_xy, order=2, wrt=1)
    raises(hoad.InvalidArgumentError, lambda: cf(X, torch.ones(2, 3, dtype=torch.int64)), "int64", "float")


_F32 = {"w": torch.randn(3, 3), "b": torch.randn(3), "conv": torch.randn(2, 3, 2)}
_MIXED = {  # a float64 input meets float32 weights: eager torch raises for each
    "linear": (lambda x: F.linear(x, _F32["w"], _F32["b"]), (4, 3)),
    "matmul": (lambda x: x @ _F32["w"], (4, 3)),
    "mv": (lambda x: _F32["w"] @ x, (3,)),
    "bias only": (lambda x: F.linear(x, _F32["w"].double(), _F32["b"]), (4, 3)),
    "bmm": (lambda x: torch.bmm(x, _F32["w"].expand(2, 3, 3)), (2, 3, 3)),
    "conv1d": (lambda x: F.conv1d(x, _F32["conv"]), (1, 3, 5)),
    "layer_norm": (lambda x: F.layer_norm(x, (3,), _F32["b"], _F32["b"]), (4, 3)),
    "group_norm": (lambda x: F.group_norm(x, 3, _F32["b"], _F32["b"]), (2, 3, 4)),
    "batch_norm": (lambda x: F.batch_norm(x, _F32["b"], _F32["b"].abs(), _F32["b"], _F32["b"]), (2, 3, 4)),
    # (decomposed in one of the dtypes: cholesky_solve gave float32 derivatives of a float64 input)
    "cholesky_solve": (lambda x: torch.cholesky_solve(x, torch.eye(3) + _F32["w"].tril(-1) * 0.1), (3, 3)),
    "lerp": (lambda x: torch.lerp(x, _F32["w"], 0.3), (3, 3)),
    "cross": (lambda x: torch.linalg.cross(x, _F32["w"]), (3, 3)),
    "cdist": (lambda x: torch.cdist(x, _F32["w"]), (4, 3)),
    "solve": (lambda x: torch.linalg.solve(torch.eye(3) * 3 + _F32["w"], x), (3, 2)),
    # (their integer and bool operands are indices and masks, free; their floating ones were promoted)
    "masked_scatter": (lambda x: x.masked_scatter(_F32["b"] > 0, _F32["w"]), (3, 3)),
    "cross_entropy weight": (lambda x: F.cross_entropy(x, torch.tensor([0, 2, 1, 1]), weight=_F32["b"].abs()), (4, 3)),
    "nll_loss2d weight": (lambda x: F.nll_loss(x, torch.zeros(1, 2, 2, dtype=torch.long), weight=_F32["b"]),
                          (1, 3, 2, 2)),
    "binary_cross_entropy": (lambda x: F.binary_cross_entropy(x.sigmoid(), _F32["w"].sigmoid()), (3, 3)),
}


@pytest.mark.parametrize("name", sorted(_MIXED))
def test_mixed_dtypes_where_torch_refuses_them(name):
    """Torch refuses these; hoad's trace once promoted them silently (addmm's and the norms'
    decompositions), or failed in the program (mm) or as an internal error (conv)."""
    fn, shape = _MIXED[name]
    x = torch.randn(*shape, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # the reference: torch itself refuses
        fn(x)
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(lambda x: fn(x).sum(), order=2, backend="eager")(x),
           "float64", "float32", "mixed dtypes", "module.to(x.dtype)")


@pytest.mark.parametrize("fn", [lambda x: _INTS @ x.sin(), lambda x: (_INTS @ x.sin()).float(),
                                lambda x: x.sum() * F.layer_norm(_INTS, (4,)),
                                lambda x: F.binary_cross_entropy(x.sigmoid(), _INTS[0])],
                         ids=["mv", "mv-cast", "layer_norm", "bce-target"])
def test_integer_tensors_where_torch_refuses_them(fn):
    """An integer matrix times a float vector was typed as an integer: "the function's output has
    dtype int64", or "the derivative program failed while running"; an integer layer norm was
    hoad's own IndexError. A product of integers stays torch's (path counts)."""
    x = torch.randn(4, dtype=torch.float64)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the reference: torch itself refuses
        fn(x)
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(lambda x: fn(x).sum(), order=2, backend="eager")(x),
           "int64", "torch refuses", "Cast")
    counts = lambda x: ((_INTS @ _INTS).to(x.dtype) @ x.sin()).sum()  # noqa: E731
    torch.testing.assert_close(hoad.compile(counts, order=1, backend="eager")(x)[0], torch.func.grad(counts)(x))


_INTS = torch.tensor([[1, 0, 2, 1], [0, 1, 1, 0], [2, 1, 0, 1], [1, 1, 1, 1]])


def test_a_0d_weight_of_another_dtype_is_torchs_scalar():
    """lerp's 0-d weight may have any dtype (torch takes it as a scalar): it was refused."""
    x = torch.randn(3, dtype=torch.float64)
    for w in (torch.tensor(0.3), torch.tensor(1)):
        f = lambda x: torch.lerp(x.sin(), x * x, w).sum()  # noqa: E731
        torch.testing.assert_close(hoad.compile(f, order=2, backend="eager")(x)[0, 0], torch.func.hessian(f)(x))


def test_float32_parameters_of_a_half_input_norm_are_torchs_mixed_precision():
    x = torch.randn(4, 3, dtype=torch.bfloat16)
    f = lambda x: F.layer_norm(x, (3,), _F32["b"], _F32["b"]).float().sum()  # noqa: E731
    f(x)  # torch accepts it
    assert hoad.compile(f, order=1, backend="eager")(x).value.dtype == torch.float32


def test_wrt_argument_not_passed_by_name():
    def f(x, y=None):
        return x.sum() if y is None else (x * y).sum()

    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f, order=2, wrt="y")(X), "'y'", "pass")


def test_wrt_argument_not_passed_by_argnum():
    def f(x, y=None):
        return x.sum() if y is None else (x * y).sum()

    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f, order=2, wrt=1)(X), "wrt")


def test_wrt_argument_nested_in_a_list():
    """It was refused ("must be a tensor argument itself"); each tensor in it is a wrt entry now."""
    def f(xs):
        return (xs[0] * xs[1]).sum()

    res = hoad.compile(f, order=2, wrt=0)([X, Y])
    assert list(res.wrt) == ["xs[0]", "xs[1]"]
    torch.testing.assert_close(res["xs[0]", "xs[1]"], torch.func.hessian(f)([X, Y])[0][1])


def test_unhashable_non_tensor_argument():
    class Opaque:
        __hash__ = None

    cf = hoad.compile(lambda x, o: x.sin().sum(), order=1)
    raises(hoad.InvalidArgumentError, lambda: cf(X, Opaque()), "hashable")


# ---------------------------------------------------------------------------------- output
def test_a_tuple_holding_a_non_tensor_is_refused():
    cf = hoad.compile(lambda x: (x.sin().sum(), x.shape[0]), order=2)
    raises(hoad.OutputError, lambda: cf(X), "output[1] is 2, not a tensor", "a returned tuple, list or dict")


def test_list_output_names_its_entry():  # (it was "a immutable_list", torch.fx's container)
    raises(hoad.OutputError, lambda: hoad.compile(lambda x: [x.sum(), 2], order=1)(X), "output[1] is 2, not a tensor")


def test_none_output():
    raises(hoad.OutputError, lambda: hoad.compile(lambda x: None, order=1)(X), "tensor")


@pytest.mark.parametrize("fn", [lambda x: (x > 0).sum(), lambda x: x.argmax(), lambda x: x.long()],
                         ids=["count", "argmax", "cast"])
def test_integer_output(fn):
    raises(hoad.OutputError, lambda: hoad.compile(fn, order=2)(X), "int64", "floating")


# ---------------------------------------------------------------------------------- capture
def test_data_dependent_if():
    def f(x):
        if x.sum() > 0:
            return x.sin().sum()
        return x.cos().sum()

    msg = raises(hoad.DataDependentControlFlowError, lambda: hoad.compile(f, order=2)(X), "torch.where")
    assert THIS_FILE in msg, f"the message should name the user's source line: {msg}"
    assert "if x.sum() > 0" in msg


def test_item():
    def f(x):
        m = x.max().item()
        return x.sin().sum() * m

    msg = raises(hoad.DataDependentControlFlowError, lambda: hoad.compile(f, order=2)(X), ".item()")
    assert THIS_FILE in msg and "x.max().item()" in msg, msg


@pytest.mark.parametrize("way", ["numpy", "np.asarray", "tolist", "closed-over numpy"])
def test_values_read_out_of_torch_are_refused(way):
    """A traced tensor's .numpy() is uninitialised memory: the program kept it as a constant (a
    value of 1e-310 and a derivative that ignored it, both backends)."""
    import numpy as np

    W = X.detach().clone()
    uses = {"numpy": lambda x: torch.from_numpy(x.detach().numpy() * 2),
            "np.asarray": lambda x: torch.as_tensor(np.cos(np.asarray(x.detach()))),
            "tolist": lambda x: torch.tensor(x.tolist(), dtype=x.dtype),
            "closed-over numpy": lambda x: torch.from_numpy(W.numpy())}

    def f(x):
        return (uses[way](x) * x).sum()

    msg = raises(hoad.DataDependentControlFlowError, lambda: hoad.compile(f, order=1)(X), "out of torch")
    assert THIS_FILE in msg, msg


def test_a_custom_autograd_function_names_hoads_way():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            return 2 * ctx.saved_tensors[0] * g

    def f(x):
        return Square.apply(x).sum()

    msg = raises(hoad.CaptureError, lambda: hoad.compile(f, order=1)(X), "autograd.Function", "register_elementwise")
    assert THIS_FILE in msg, msg


@pytest.mark.parametrize("op", ["lstsq", "unique"])
def test_ops_of_value_dependent_shapes_are_named(op):
    """lstsq was reported as Python control flow, unique as <built-in function getitem>."""
    A = torch.randn(4, 2, dtype=torch.float64)

    def f(x):
        if op == "lstsq":
            return torch.linalg.lstsq(A, x[:4, None]).solution.sum()
        return torch.unique(x).sum()

    msg = raises(hoad.DataDependentControlFlowError, lambda: hoad.compile(f, order=1)(X.flatten()),
                 "linalg_lstsq" if op == "lstsq" else "unique")
    assert THIS_FILE in msg, msg


def test_wrt_naming_a_tied_parameter_names_the_listed_one():
    a, b = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(model, order=1, wrt="1.weight"),
           "same parameter as '0.weight'")


def test_a_shape_mismatch_is_one_error_without_torchs_log():
    """The fake-tensor trace logged a traceback (to stderr) before the error was raised."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        W = torch.randn(4, 5, dtype=torch.float64)  # X is (2, 3)
        raises(hoad.CaptureError, lambda: hoad.compile(lambda x: (x @ W).sum(), order=1)(X), "reduction dim")
    finally:
        log.removeHandler(handler)
    assert not records, records[0].getMessage()


def test_boolean_mask_indexing_is_data_dependent():
    def f(x):
        return x[x > 0].sin().sum()

    raises(hoad.DataDependentControlFlowError, lambda: hoad.compile(f, order=1)(X), "depends on tensor values")


def test_dropout_in_training_mode():
    def f(x):
        return F.dropout(x.sin(), 0.5, training=True).sum()

    msg = raises(hoad.RandomnessError, lambda: hoad.compile(f, order=2)(X), "random", "eval")
    assert THIS_FILE in msg and "F.dropout" in msg, f"the message should name the user's line: {msg}"


def test_dropout_module_in_training_mode_but_fine_in_eval():
    drop = nn.Dropout(0.5)

    def f(x):
        return drop(x).exp().sum()

    drop.train()
    msg = raises(hoad.RandomnessError, lambda: hoad.compile(f, order=2)(X), "eval")
    assert THIS_FILE in msg and "drop(x)" in msg, msg
    drop.eval()
    res = hoad.compile(f, order=2)(X)
    torch.testing.assert_close(res[0, 0], torch.diag(X.exp().reshape(-1)).reshape(2, 3, 2, 3))


def test_random_tensor():
    def f(x):
        return (x * torch.rand(2, 3, dtype=x.dtype)).sum()

    raises(hoad.RandomnessError, lambda: hoad.compile(f, order=1)(X), "aten.rand", "argument")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_random_numbers_from_an_explicit_generator(backend):
    """aten.randn.generator is only tagged as seeded: eager ran it (new noise at every call) and
    Inductor failed to compile the generator argument."""
    gen = torch.Generator().manual_seed(0)

    def f(x):
        return (x * torch.randn(2, 3, generator=gen, dtype=x.dtype)).sum()

    msg = raises(hoad.RandomnessError, lambda: hoad.compile(f, order=1, backend=backend)(X), "randn.generator")
    assert THIS_FILE in msg, msg


def test_unsupported_operator():
    def f(x):
        return torch.special.bessel_j0(x.sin()).sum()

    msg = raises(hoad.UnsupportedOperatorError, lambda: hoad.compile(f, order=2)(X), "aten.special_bessel_j0", "rule")
    assert THIS_FILE in msg and "bessel_j0(x.sin())" in msg, f"the message should name the user's line: {msg}"


def test_unsupported_operator_off_the_differentiated_path_is_fine():
    def f(x, y):
        return x.sin().sum() * torch.special.bessel_j0(y).sum()

    res = hoad.compile(f, order=2, wrt=0)(X, Y)
    torch.testing.assert_close(res[0], X.cos() * torch.special.bessel_j0(Y).sum())


# --------------------------------------------------------------------------- complex values
@pytest.mark.parametrize("fn", [
    lambda x: torch.fft.irfft(torch.fft.rfft(x), n=x.shape[-1]).sin().sum(),
    lambda x: torch.view_as_real(torch.complex(x, 2 * x).exp()).sum(),
    lambda x: torch.fft.fft(x).abs().sum(),
], ids=["rfft-irfft", "complex-exp", "fft-abs"])
def test_complex_intermediates_raise_instead_of_zero(fn):
    with pytest.raises(hoad.UnsupportedOperatorError, match="complex"):
        hoad.compile(fn, order=1)(rand(2, 4))


def test_complex_values_off_the_differentiated_path_are_fine():
    phase = torch.view_as_real(torch.polar(torch.ones(4, dtype=torch.float64), torch.arange(4.0).double()))

    def f(x):
        return (x.sin() * phase[:, 0]).sum()

    check(f, (rand(4),), order=2)


@pytest.mark.parametrize("how", ["no_grad", "detach"])
def test_complex_values_autograd_sees_as_constants_are_fine(how):
    """Computed from x under no_grad or detached (constants to autograd, as docs/guide.md says),
    they were refused as complex values from a differentiated input. (torch.func's jacfwd is no
    reference here: forward AD differentiates through no_grad.)"""
    def scale(x):
        if how == "no_grad":
            with torch.no_grad():
                return torch.fft.fft(x).abs().sum()
        return torch.view_as_real(x.to(torch.cdouble)).detach().sum()

    def f(x):
        return x.sin().sum() * scale(x) + (x * x).sum()

    def constant(x):
        return x.sin().sum() * scale(x.detach()) + (x * x).sum()

    x = rand(3, 4, seed=13)
    res = hoad.compile(f, order=3, backend="eager")(x)
    g = jacrev(constant)
    for k in (1, 2, 3):
        assert_close(res[(0,) * k], g(x), f"order {k}")
        g = jacrev(g)


# ---------------------------------------------------------------------------------- options
@pytest.mark.parametrize("backend", ["xla", "", "EAGER", "Inductor"])
def test_bad_backend(backend):
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, backend=backend),
           "backend", "eager", "inductor")


def test_backend_none_means_the_default():
    assert hoad.compile(f_xy, order=2, backend=None).config.backend == hoad.options.default_backend()


@pytest.mark.parametrize("mode", ["backward", "", None, "Forward"])
def test_bad_mode(mode):
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(f_xy, order=2, mode=mode), "mode", "auto", "forward")


# ------------------------------------------------------------------------------ result keys
@pytest.fixture(scope="module")
def res2():
    return hoad.compile(f_xy, order=2, wrt=(0, 1))(X, Y)


@pytest.mark.parametrize("key", [5, "z", (0, 5), True, (1, "w")], ids=repr)
def test_bad_result_key(res2, key):
    raises(hoad.InvalidArgumentError, lambda: res2[key], "not a wrt key", "[0, 1]")


@pytest.mark.parametrize("key", [(0, 0, 0), (0, 1, 1), ()], ids=repr)
def test_result_key_of_wrong_order(res2, key):
    raises(hoad.InvalidArgumentError, lambda: res2[key], "order", "1..2")


def test_bad_result_key_is_not_in(res2):
    assert 5 not in res2 and (0, 0, 0) not in res2 and (0, 1) in res2


def test_bad_key_to_is_structural_zero(res2):
    raises(hoad.InvalidArgumentError, lambda: res2.is_structural_zero((0, 7)), "not a wrt key")


@pytest.mark.parametrize("k", [0, 3, "1", 1.0])
def test_bad_order_argument_to_result(res2, k):
    raises(hoad.InvalidArgumentError, lambda: res2.order(k), "order", "1..2")


def test_graph_before_any_call():
    cf = hoad.compile(f_xy, order=2)
    raises(hoad.InvalidArgumentError, lambda: cf.graph, "call")


def test_torch_compiled_module_names_the_fix():
    net = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double())
    raises(hoad.CaptureError,
           lambda: hoad.compile(lambda x: net(x).sum(), order=2)(torch.randn(3, dtype=torch.float64)),
           "torch.compile'd", "without torch.compile", "_orig_mod")


@pytest.mark.parametrize("which", ["compile", "laplacian"])
def test_a_hoad_call_in_a_fullgraph_torch_compile_says_why(which):
    """Inside torch.compile(fullgraph=True) a hoad call is a graph break: dynamo's message said
    "(reason: None) Hint: Remove the torch.compiler.disable call", pointing at hoad's internals.
    Dynamo's hint is fixed: hoad's reason, in its explanation, says it does not apply and what
    works instead; without fullgraph the call breaks the graph and runs."""
    import torch._dynamo

    u = lambda X: torch.tanh(X).sum(-1)  # noqa: E731
    call = (hoad.compile(lambda X: u(X).sum(), order=1, backend="eager") if which == "compile"
            else hoad.laplacian(u, batch_dim=0, backend="eager"))
    step = torch.compile(lambda X: call(X).value.sum(), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="call hoad outside the compiled region") as caught:
        step(torch.randn(4, 3, dtype=torch.float64))
    text = str(caught.value)
    assert "the hint below to remove torch.compiler.disable does not apply" in text, text
    assert "without fullgraph, torch.compile breaks its graph at the hoad call" in text, text
    plain = torch.compile(lambda X: call(X).value.sum(), backend="eager")  # (a graph break, then hoad's program)
    X = torch.randn(4, 3, dtype=torch.float64)
    assert torch.allclose(plain(X), call(X).value.sum())


def test_batch_norm_with_a_cumulative_average_is_refused():
    """BatchNorm(momentum=None) in training mode weighs its update by 1/float(num_batches_tracked):
    the program kept the first call's factor, so from the second call on the running statistics
    were silently wrong (unnoticed while every call saw the same batch)."""
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None), nn.Tanh()).double().train()
    raises(hoad.CaptureError, lambda: hoad.compile(lambda x: net(x).sum(), order=1, backend="eager")(rand(5, 3)),
           "also updates", "0-d int64", "BatchNorm(momentum=None)")


def test_autograd_grad_inside_the_function_names_the_hoad_way():
    """PINN code computes u_x with torch.autograd.grad: traced without autograd, torch's own
    message ("element 0 ... does not require grad") named neither the cause nor the fix."""
    def residual(x):
        return torch.autograd.grad(x.sin().sum(), x, create_graph=True)[0].sum()

    raises(hoad.CaptureError, lambda: hoad.compile(residual, order=1, backend="eager")(rand(3)),
           "torch.autograd.grad", "without autograd", "res[0, 0]", "hoad.laplacian", "test_errors.py")


def test_sparse_input_is_refused_up_front():
    """It failed while running (an ExecutionError after a long torch traceback)."""
    x = torch.eye(3, dtype=torch.float64).to_sparse()
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(lambda x: x.sin().sum(), order=2, backend="eager")(x),
           "'x'", "sparse_coo", "to_dense()")


def test_a_misspelt_option_names_the_close_one():
    with pytest.raises(hoad.InvalidArgumentError, match="did you mean 'chunk_size'"):
        hoad.compile(lambda x: x.sum(), order=1, chunksize=4)
    with pytest.raises(hoad.InvalidArgumentError, match="no option 'colour'"):
        hoad.compile(order=1, colour="red")


def test_a_generator_function_is_an_output_error():
    def gen(x):
        yield x.sum()

    with pytest.raises(hoad.OutputError, match="generator"):
        hoad.compile(gen, order=1)


def test_naming_a_star_args_parameter_says_to_use_positions():
    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(hoad.InvalidArgumentError, match="by position"):
        hoad.compile(lambda *a: (a[0] * a[1]).sum(), order=1, wrt="a", backend="eager")(x, x)


def test_torch_cond_names_torch_where():
    """torch.cond was advised by one error and refused by the next with advice to register a rule."""
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,)).sum()

    raises(hoad.UnsupportedOperatorError, lambda: hoad.compile(f, order=1)(X), "torch.cond", "torch.where")
    try:
        hoad.compile(lambda x: x.sin().sum() if x.sum() > 0 else x.sum(), order=1)(X)
    except hoad.DataDependentControlFlowError as e:
        assert "torch.cond" not in str(e)


def test_small_misuses_are_named():
    import torch.utils.checkpoint as checkpoint

    res = hoad.compile(lambda x: x.sin().sum(), order=2)(X)
    raises(KeyError, lambda: res[0.0], "not a wrt key")                     # (0.0 == 0: it was accepted)
    raises(hoad.InvalidArgumentError, lambda: res.order(True), "order must be an int")
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(2), "@hoad.compile(order=2)")
    raises(hoad.CaptureError, lambda: hoad.compile(
        lambda x: checkpoint.checkpoint(torch.sin, x, use_reentrant=True).sum(), order=2)(X), "use_reentrant=False")


def test_a_nested_tensor_argument_is_named():  # (it was torch's "Internal error ... Please file an issue")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.nested.nested_tensor([torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)])
    raises(hoad.InvalidArgumentError, lambda: hoad.compile(lambda x: x.sum(), order=1)(t), "nested tensor")


def test_explain_of_a_plain_function_names_what_it_takes():
    """It was a raw AttributeError ('function' object has no attribute 'explain')."""
    for what in (lambda x: x.sin().sum(), None):
        with pytest.raises(hoad.InvalidArgumentError, match="hoad.compile or an operator"):
            hoad.explain(what, torch.zeros(3))


def test_wrt_parameters_of_a_module_with_none_trainable_is_named():
    """It was a HoadInternalError ("the plan stage failed: IndexError")."""
    net = torch.nn.Linear(2, 1, dtype=torch.float64).requires_grad_(False)
    for module in (net, torch.nn.Tanh()):
        with pytest.raises(hoad.InvalidArgumentError, match="no parameter that requires grad"):
            hoad.compile(module, order=1, wrt=hoad.parameters, backend="eager")(torch.zeros(3, 2, dtype=torch.float64))


@pytest.mark.parametrize("wrt", [(hoad.parameters, "weight"), ("bias", hoad.parameters)])
def test_a_parameter_named_beside_hoad_parameters_is_a_duplicate(wrt):
    """It was dropped silently, where naming an input twice is refused."""
    net = torch.nn.Linear(2, 1, dtype=torch.float64)
    with pytest.raises(hoad.InvalidArgumentError, match="twice.*hoad.parameters includes"):
        hoad.compile(net, order=1, wrt=wrt, backend="eager")(torch.zeros(3, 2, dtype=torch.float64))


def test_keys_that_cannot_name_a_block_are_named():
    """A list or a slice as a key raised a bare TypeError (unhashable)."""
    res = hoad.compile(lambda x, y: (x * y).sum(), order=2, wrt=(0, 1), backend="eager")(torch.ones(2), torch.ones(2))
    for key in ([0, 1], slice(None), (0, [1])):
        with pytest.raises(hoad.InvalidArgumentError, match="not a wrt key.*tuple of them"):
            res[key]
    assert [0, 1] not in res and res.get([0]) is None


def test_operator_options_they_do_not_take_are_named():
    """Python's TypeError before; hoad.compile named the closest option."""
    u = lambda x: x.sin().sum(-1)  # noqa: E731
    V = torch.eye(2, dtype=torch.float64)
    for make, what in ((lambda: hoad.laplacian(u, diagonal=True), "hoad.laplacian has no option 'diagonal'"),
                       (lambda: hoad.biharmonic(u, batchdim=0), "did you mean 'batch_dim'"),
                       (lambda: hoad.taylor(u, 2, V, factor=V), "hoad.taylor has no option 'factor'"),
                       (lambda: hoad.taylor(u, order=2), "needs order=K and directions=V")):
        with pytest.raises(hoad.InvalidArgumentError, match=what):
            make()


def test_a_budget_that_not_even_the_results_fit_names_its_ways_out():
    """The list of ways out was empty ("Ways out: .") for an operator with batch_dim=0."""
    with pytest.raises(hoad.MemoryBudgetError, match="Ways out: fewer samples per call.*a larger memory_budget"):
        hoad.laplacian(lambda x: x.sin().sum(-1), batch_dim=0, memory_budget=1, backend="eager")(torch.ones(4, 3))


def test_autograd_inside_the_function_names_torch_func():
    """requires_grad_() or .backward() inside f gave torch's functorch message; a force taken
    with torch.func.grad inside f is the way that works."""
    def energy(x):
        return (x ** 4).sum()

    def by_backward(x):
        x = x.detach().requires_grad_()
        energy(x).backward()
        return -x.grad

    def by_autograd_grad(x):
        return -torch.autograd.grad(energy(x), x, create_graph=True)[0]

    x = torch.randn(3, dtype=torch.float64)
    for f in (by_backward, by_autograd_grad):
        with pytest.raises(hoad.CaptureError, match="runs autograd itself.*torch.func"):
            hoad.compile(lambda x: f(x).sum(), order=1, backend="eager")(x)
    res = hoad.compile(lambda x: -torch.func.grad(energy)(x), order=1, backend="eager")(x)
    torch.testing.assert_close(res[0], -torch.func.hessian(energy)(x))


def test_a_sparse_tensor_after_a_dense_call_of_the_same_shape_is_named():
    """The cached program for the dense call's shape ran on it: torch's "unsupported memory format"."""
    cf = hoad.compile(lambda x, w: (x @ w).sin().sum(), order=1, backend="eager")
    x, w = torch.eye(3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64)
    cf(x, w)
    with pytest.raises(hoad.InvalidArgumentError, match="input 'x' is a sparse_coo tensor.*to_dense"):
        cf(x.to_sparse(), w)


def test_an_input_written_in_place_and_passed_again_is_refused():
    """f(x, x) writing y.mul_(2): torch reads the write through x, hoad's program (each input on
    storage of its own) read x as it was: 1.56 where 2.56 is right."""
    def f(x, y):
        y.mul_(2)
        return (x.sin() * y).sum()

    x = torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64)
    cf = hoad.compile(f, order=1, backend="eager")
    for same in (x, x.view(3)):  # the tensor itself, a view of it
        with pytest.raises(hoad.InvalidArgumentError, match="writes into input 'y' in place, and input 'x' shares"):
            cf(x, same)
    y = x.clone()
    want = f(x.clone(), y.clone())
    assert torch.allclose(cf(x, y).value, want)  # separate tensors: as before


def test_operator_inputs_and_environment_named(monkeypatch):
    u = lambda x: x.sin().sum(-1)  # noqa: E731
    with pytest.raises(hoad.InvalidArgumentError, match="has no columns"):
        hoad.laplacian(u, factor=torch.ones(3, 0, dtype=torch.float64))
    with pytest.raises(hoad.InvalidArgumentError, match="floating-point tensor, got a torch.int64 tensor"):
        hoad.laplacian(u, backend="eager")(torch.ones(3, dtype=torch.int64))
    with pytest.raises(hoad.InvalidArgumentError, match="directions must be .*, got a torch.int64 tensor"):
        hoad.taylor(u, order=2, directions=torch.ones(1, 3, dtype=torch.int64))  # (it named the shape, (1, 3))
    monkeypatch.setenv("HOAD_DEFAULT_BACKEND", "egaer")
    with pytest.raises(hoad.InvalidArgumentError, match="environment variable HOAD_DEFAULT_BACKEND"):
        hoad.compile(u, order=1)


def test_a_number_read_from_a_value_the_function_computes_is_named():
    """float(box[0]) of a closed-over box: box[0] is computed, so its number is data-dependent.
    The message was the generic one about control flow, advising torch.where."""
    box = torch.tensor([3.0, 2.0], dtype=torch.float64)
    for f in (lambda x: (x ** 2).sum() / float(box[0]), lambda x: (x ** 2).sum() / float(box.max())):
        with pytest.raises(hoad.DataDependentControlFlowError, match="reads into Python.*Keep it a tensor"):
            hoad.compile(f, order=1, backend="eager")(torch.ones(3, dtype=torch.float64))


def test_a_cache_path_with_spaces_is_named_before_inductor_fails_on_it(monkeypatch, tmp_path):
    """Inductor passes its cache path to g++ unquoted: every program failed to build."""
    from hoad.lowering import kernels

    monkeypatch.setenv("HOAD_CACHE_DIR", str(tmp_path / "my caches"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(kernels, "_state", False)  # (not a build of the kernels into the new directory)
    raises(hoad.CompileError, lambda: hoad.compile(lambda x: x.sin().sum(), order=1, backend="inductor")(X),
           "path with spaces", "HOAD_CACHE_DIR")
