"""Nothing silently wrong: the classes of wrong values and raw crashes the operator sweep found,
each fixed at its mechanism, checked here against nested torch.func in float64 (or the same maths
in plain ops where torch.func has no answer), in both directions.
"""

import copy
import math
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import jacfwd, jacrev, vmap

import hoad
from hoad.binding import bind_layout
from hoad.passes.capture import _mutates, capture

aten = torch.ops.aten
MODES = ["forward", "reverse"]


# ------------------------------------------------------------------- piecewise-linear modulo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [torch.fmod, torch.remainder])
def test_modulo_is_linear_in_both_arguments(op, mode):
    """d/da = 1 and d/db = -q with q the rounded quotient, not the zero of a step function."""
    check(lambda a, b: op(a * 3, b.exp()).sin() * a, (rand(2, 3), rand(3)), wrt=(0, 1), order=3, mode=mode)


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


# ----------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pad_mode,shape,pad", [
    ("circular", (1, 2, 5), (2, 1)), ("circular", (1, 2, 3, 4), (1, 2, 2, 1)),
    ("reflect", (1, 2, 5), (2, 1)), ("replicate", (1, 2, 3, 4), (1, 2, 2, 1)),
])
def test_padding_modes(pad_mode, shape, pad, mode):
    w = rand(*shape[:-len(pad) // 2], *[n + pad[2 * i] + pad[2 * i + 1] for i, n in
                                        enumerate(reversed(shape[-len(pad) // 2:]))][::-1], seed=5)
    check(lambda x: (F.pad(x, pad, mode=pad_mode).sin() * w).sum(), (rand(*shape),), order=3, mode=mode)


# ---------------------------------------------------------------------- fully masked softmax
ROW_MASK = torch.tensor([[True, False, True], [False, False, False]])


@pytest.mark.parametrize("mode", MODES)
def test_safe_softmax_of_a_fully_masked_row_is_zero_with_zero_derivatives(mode):
    def f(x):
        return aten._safe_softmax(x.masked_fill(~ROW_MASK, float("-inf")), -1).sin().sum()

    res, _cf = check(f, (rand(2, 3),), order=3, mode=mode)
    assert torch.isfinite(res[0, 0, 0]).all()


@pytest.mark.parametrize("mode", MODES)
def test_attention_where_a_query_sees_no_key(mode):
    """scaled_dot_product_attention with a boolean mask row of all False: torch gives zeros there.
    torch.func cannot differentiate CPU flash attention, so the reference is the same maths."""
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sin().sum()

    def plain(q):
        scores = (q @ q.transpose(-1, -2) / 2).masked_fill(~mask, float("-inf"))
        return (aten._safe_softmax(scores, -1) @ q).sin().sum()

    check(f, (rand(1, 2, 3, 4),), order=2, mode=mode, reference_fn=plain)


def test_masked_softmax_rescued_by_nan_to_num_in_forward_mode():
    """torch.softmax of an all -inf row is NaN; nan_to_num then replaces it. The ``where`` that
    does so selects, so the NaN branch's derivatives do not leak (they did through a product)."""
    def f(x):
        return torch.softmax(x.masked_fill(~ROW_MASK, float("-inf")), -1).nan_to_num().sin().sum()

    check(f, (rand(2, 3),), order=3, mode="forward")


def test_where_does_not_leak_the_untaken_branch():
    """Forward propagation selects: the derivatives of x·log x, untaken at x = 0, do not leak."""
    x = torch.tensor([0.0, 0.5, 2.0, 0.0], dtype=torch.float64)

    def f(x):
        return torch.where(x > 0, x * x.log(), torch.zeros_like(x)).sum() + x.sin().sum()

    def safe(x):  # the same function with the log's argument kept away from 0
        return torch.where(x > 0, x * torch.where(x > 0, x, 1.0).log(), torch.zeros_like(x)).sum() + x.sin().sum()

    res = hoad.compile(f, order=3, mode="forward")(x)
    g = jacrev(safe)
    assert_close(res[0], g(x), "gradient")
    assert_close(res[0, 0], jacfwd(g)(x), "Hessian")
    assert torch.isfinite(res[0, 0, 0]).all()
    # the adjoint sweep multiplied the zero cotangent of the untaken branch by log 0 (NaN, as
    # torch's backward does); capture now gives the log a safe argument there (safe_branches)
    rev = hoad.compile(f, order=2, mode="reverse")(x)
    assert_close(rev[0], g(x), "gradient, reverse")
    assert_close(rev[0, 0], jacfwd(g)(x), "Hessian, reverse")


@pytest.mark.parametrize("mode", ["auto", "reverse"])
def test_masked_self_interaction_is_finite_in_every_direction(mode):
    """A Coulomb sum with its self pairs masked by where(eye, 0, 1 / r), r_ii = 0: the adjoint
    form (the default for one energy of many coordinates) gave NaN gradient and Hessian."""
    def coulomb(x):
        eye = torch.eye(x.shape[-2], dtype=torch.bool)
        d = x[..., :, None, :] - x[..., None, :, :]
        return torch.where(eye, 0.0, 1 / (d * d).sum(-1).sqrt()).sum((-1, -2))

    def safe(x):  # the self pairs removed before the division
        eye = torch.eye(x.shape[-2], dtype=torch.bool)
        d = x[..., :, None, :] - x[..., None, :, :]
        return (1 / (d * d).sum(-1).masked_fill(eye, 1.0).sqrt()).masked_fill(eye, 0.0).sum((-1, -2))

    X = rand(3, 5, 3, seed=92)
    res = hoad.compile(coulomb, order=2, batch_dim=0, mode=mode, backend="eager")(X)
    assert_close(res[0], vmap(jacrev(safe))(X), "gradient")
    assert_close(res[0, 0], vmap(jacfwd(jacrev(safe)))(X), "Hessian")


def test_a_branch_value_read_elsewhere_keeps_its_entries():
    """The rewrite changes a branch only where nothing but the where reads it: log x read again
    outside keeps its NaN at x < 0 (0 · NaN is NaN), as the function computes it."""
    x = torch.tensor([-1.0, 0.5], dtype=torch.float64)
    f = lambda x: (lambda l: torch.where(x > 0, l, 0.0).sum() + 0 * l.sum())(x.log())  # noqa: E731
    assert hoad.compile(f, order=1, mode="reverse", backend="eager")(x).value.isnan()


# ---------------------------------------------------------------------------- domain edges
@pytest.mark.parametrize("mode", MODES)
def test_sinc_derivatives_at_and_near_zero(mode):
    """sinc's derivatives at 0 are its series' (-π²/3 at order 2, π⁴/5 at order 4, 0 at odd
    orders): the core decomposition's where() gave 0 at every order, and NaN in reverse mode.
    Elsewhere against torch.func of sin(πx)/(πx), on both sides of |πx| = 1, where the rule
    switches from its series to the closed form."""
    x = torch.tensor([0.0, 0.2, -0.25, 0.3, 0.33, -0.5, 1.3], dtype=torch.float64)
    res = hoad.compile(lambda x: torch.sinc(x).sum(), order=4, mode=mode, backend="eager")(x)
    at_zero = [0.0, -math.pi ** 2 / 3, 0.0, math.pi ** 4 / 5]
    g = jacrev(lambda x: (torch.sin(math.pi * x) / (math.pi * x)).sum())
    for k in range(1, 5):
        diagonal = torch.stack([res[(0,) * k][(i,) * k] for i in range(len(x))])
        assert abs(float(diagonal[0]) - at_zero[k - 1]) < 1e-12, f"order {k} at 0: {float(diagonal[0])}"
        ref = g(x[1:])
        assert_close(diagonal[1:], torch.stack([ref[(i,) * k] for i in range(len(x) - 1)]), f"order {k}")
        g = jacfwd(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn,ref", [
    (lambda x: F.hardtanh(x).sum(), None), (lambda x: F.hardtanh(x, -2.0, 3.0).sum(), None),
    (lambda x: F.relu6(x).sum(), None), (lambda x: (F.hardswish(x) * x).sum(), None),
    (lambda x: F.hardsigmoid(x).sum(),
     lambda x: torch.where((x > -3) & (x < 3), x / 6 + 0.5, (x >= 3).to(x.dtype)).sum()),
], ids=["hardtanh", "hardtanh(-2,3)", "relu6", "hardswish", "hardsigmoid"])
def test_kinks_of_piecewise_linear_activations_follow_torch(fn, ref, mode):
    """At a kink torch's backward gives 0 (min < x < max strictly): relu6 at 0 and 6, hardtanh at
    its ends, hardsigmoid and hardswish at ±3. Clamp's decomposition gave 1 there, hardsigmoid
    1/6 and hardswish its inner slope. (torch's hardsigmoid has no second derivative and a slope
    of float32's 1/6 in float64: its convention in plain ops is the reference.)"""
    order = 3
    x = torch.tensor([-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 6.0, -3.5, 7.0], dtype=torch.float64)
    res = hoad.compile(fn, order=order, mode=mode, backend="eager")(x)
    g = jacrev(ref or fn)
    for k in range(1, order + 1):
        assert_close(res[(0,) * k], g(x), f"order {k}")
        g = jacfwd(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [2, 3, 1, float("inf")])
def test_vector_norm_at_a_zero_vector_has_torchs_subgradient(p, mode):
    """‖x − y‖ where a row of x equals y (a coincident point, a residual that reached zero):
    core ATen's pow(Σ x², 1/2) gave 0 · inf = NaN gradients, torch's own formula the subgradient 0
    at every order. Compared at orders 1..3 on rows with zero, mixed and nonzero entries."""
    x = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [0.0, 1.5, -0.5]], dtype=torch.float64)
    y = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    def f(x):
        return torch.linalg.vector_norm(x - y, p, dim=1).sin() + x.norm(p=p) * x[:, 0]

    res, _ = check(f, (x,), order=3, mode=mode, backend="eager")
    assert all(torch.isfinite(res[(0,) * k]).all() for k in (1, 2, 3))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [
    lambda x: torch.special.entr(x).sum(),
    lambda x: torch.pow(0.0, x).sum(),
    lambda x: torch.pow(torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0], dtype=torch.float64), x).sum(),
], ids=["entr", "zero-base", "zero-base-tensor"])
def test_domain_edges_follow_torch(fn, mode):
    """At the edge, torch's own formula gives inf or 0 (entr' = -(1 + log x) is +inf at 0; 0**x has
    derivative 0 for x >= 0), where a where() decomposition gave NaN or 0. Compared on the
    diagonal: off it, torch's Hessian holds 0·inf NaNs of its forward tangents, hoad exact zeros."""
    x = torch.tensor([0.0, 0.5, 1.5, -0.3, 0.0], dtype=torch.float64)
    res = hoad.compile(fn, order=3, mode=mode)(x)
    g = jacrev(fn)
    torch.testing.assert_close(res[0], g(x), equal_nan=True)
    h = jacfwd(g)(x)
    torch.testing.assert_close(res[0, 0].diagonal(), h.diagonal(), equal_nan=True)
    off = ~torch.eye(5, dtype=torch.bool)
    assert (res[0, 0][off] == 0).all()


# -------------------------------------------------------------------------------- 0-d inputs
ZERO_D = {
    "cumsum": lambda s: s.cumsum(0).sin(),
    "mean": lambda s: s.mean(0).sin() * s.mean(),
    "sort": lambda s: s.sort(0).values.sin(),
    "topk": lambda s: s.topk(1).values.sin().sum(),
    "prod": lambda s: s.prod(0).sin() * s.exp().prod(),
    "prod-keepdim": lambda s: s.exp().prod(0, keepdim=True).sin(),
    "index_select": lambda s: s.index_select(0, torch.tensor([0])).sin().sum(),
    "gather": lambda s: s.gather(0, torch.tensor(0)).sin(),
    "amax": lambda s: s.exp().amax(0).sin(),
    "max.dim": lambda s: s.exp().max(0).values.sin(),
    "max.dim-keepdim": lambda s: s.exp().max(0, keepdim=True).values.sin(),
    "logsumexp": lambda s: s.sin().logsumexp(0).exp(),
    "softmax": lambda s: (s * s).softmax(0).sin(),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ZERO_D))
def test_zero_dimensional_inputs_of_ops_with_a_dim(name, mode):
    check(ZERO_D[name], (torch.tensor(0.7, dtype=torch.float64),), order=3, mode=mode)


# ------------------------------------------------------------------------------ model zoo
def _gru():
    cell = nn.GRUCell(3, 4).double()
    return lambda x: cell(x).sin().sum()


def _lstm():
    lstm = nn.LSTM(3, 4, num_layers=2).double()
    return lambda x: lstm(x[None])[0].sin().sum()


def _rnn():
    rnn = nn.RNN(3, 4, nonlinearity="tanh").double()
    return lambda x: rnn(x[None])[0].sin().sum()


def _mlp():
    net = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2), nn.SiLU()).double()
    return lambda x: net(x).sum()


def _norms():  # group_norm's decomposition emits as_strided (of a contiguous value: a view)
    ln, gn = nn.LayerNorm(3).double(), nn.GroupNorm(1, 3).double()
    rms = nn.RMSNorm(3).double()
    bn = nn.BatchNorm1d(3).double().eval()
    return lambda x: (ln(x).sin() + gn(x).cos() + rms(x) * bn(x)).sum() + F.cosine_similarity(x, x.flip(0)).sum()


ZOO = {"mlp": _mlp, "gru-cell": _gru, "lstm": _lstm, "rnn": _rnn, "norms": _norms}


def _in_place_ops(fn, x) -> set[str]:
    layout, tensors = bind_layout(fn, (x,), {})
    return {str(n.target) for n in capture(fn, layout, tensors, [0]).gm.graph.nodes if _mutates(n)}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_zoo_has_no_in_place_ops_and_matches_torch_func(name):
    torch.manual_seed(0)
    fn = ZOO[name]()
    x = rand(2, 3)
    assert not _in_place_ops(fn, x)
    check(fn, (x,), order=2)


def test_transformer_encoder_layer_has_no_in_place_ops():
    """torch.func cannot take its second derivatives (CPU flash attention has no forward AD), so
    the gradient is checked against torch.autograd and the Hessian for symmetry."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).double().eval()

    def f(x):
        return layer(x).sin().sum()

    x = rand(1, 3, 4)
    assert not _in_place_ops(f, x)
    res = hoad.compile(f, order=2)(x)
    assert_close(res[0], jacrev(f)(x), "gradient")
    h = res[0, 0].reshape(12, 12)
    assert_close(h, h.T, "Hessian symmetry")


# -------------------------------------------------------------- every error is a HoadError
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


def test_as_strided_of_a_view_into_a_larger_storage_is_refused():
    """as_strided reads storage: the program assumes inputs own theirs; a view would be read
    differently by torch, so it is refused, and a copy gives torch's answer."""
    def f(x):
        return torch.as_strided(x, (2, 2), (1, 2)).sin().sum()

    base = torch.randn(12, dtype=torch.float64)
    cf = hoad.compile(f, order=2)
    x = base[:10].clone()
    res = cf(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(f)(x))
    with pytest.raises(hoad.InvalidArgumentError, match="larger storage"):
        cf(base[2:12])


def test_as_strided_of_an_intermediate_reads_its_entries():
    """An as_strided of a computed value (group_norm's decomposition emits one) reads entries the
    program owns: inputs that are views are fine. They were refused ("input 'x' is a view into a
    larger storage") for a group_norm with weight and bias on x[:2] or a channels_last x. A view
    with an offset reads relative to that offset's storage (it read from the storage's start)."""
    def f(x):
        y = x.sin().reshape(-1)
        return torch.as_strided(y[2:], (2, 2), (1, 3), 4).exp().sum() + torch.as_strided(y[1:], (3,), (2,)).sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(hoad.compile(f, order=2, backend="eager")(x)[0, 0], torch.func.hessian(f)(x))
    gn = nn.GroupNorm(2, 4).double()
    nn.init.normal_(gn.weight), nn.init.normal_(gn.bias)

    def g(x):
        return gn(x).sin().sum((1, 2, 3))

    base = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    ref = torch.func.vmap(torch.func.hessian(lambda v: g(v[None])[0]))
    for x in (base[:2], base.to(memory_format=torch.channels_last)):
        torch.testing.assert_close(hoad.compile(g, order=2, batch_dim=0, backend="eager")(x)[0, 0], ref(x))


@pytest.mark.parametrize("layout", ["transposed", "step-sliced", "expanded", "channels_last"])
def test_a_non_contiguous_argument_is_read_by_its_entries(layout):
    """The program was traced on a dense copy of each argument, and a reshape traced as a view of
    it: under eager the call raised torch's "view size is not compatible with input tensor's size
    and stride" (Inductor's path copied the argument dense first; now both do)."""
    base = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    x = {"transposed": base.transpose(2, 3), "step-sliced": torch.randn(2, 3, 4, 8, dtype=torch.float64)[..., ::2],
         "expanded": base[:, :1].expand(2, 3, 4, 4),
         "channels_last": base.to(memory_format=torch.channels_last)}[layout]
    conv = nn.Conv2d(3, 2, 3).double()

    def f(x):
        return (conv(x).flatten(1).sin().sum(1) + x.reshape(2, -1).cos().sum(1)).sum()

    res = hoad.compile(f, order=2, backend="eager")(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(f)(x.contiguous()))


def test_a_closed_over_tensor_rebound_to_another_layout_traces_again():
    """A closed-over tensor's strides are part of what the program assumes (a reshape of it is
    traced as a view): rebinding it to a transposed tensor of the same shape raised torch's
    "view size is not compatible" under eager."""
    holder = {"W": torch.randn(3, 4, dtype=torch.float64)}

    def f(x):
        return (x * holder["W"].reshape(-1)).sin().sum()

    cf = hoad.compile(f, order=2, backend="eager")
    x = torch.randn(12, dtype=torch.float64)
    cf(x)
    holder["W"] = torch.randn(4, 3, dtype=torch.float64).T
    torch.testing.assert_close(cf(x)[0, 0], torch.func.hessian(f)(x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_float32_input_times_a_float64_constant(mode):
    """torch promotes the product to float64; hoad's contraction of the input's float32 blocks
    with the constant's float64 factor was refused from order 2 ("torch refuses mixed dtypes
    there (the function itself fails when run)": it does not)."""
    c = torch.arange(1, 7, dtype=torch.float64)
    x = torch.randn(6, dtype=torch.float32)
    for f in (lambda x: (torch.softmax(x, 0) * c).sum(), lambda x: (x / x.sum() * c).sin().sum(),
              lambda x: ((x - x.sum()).exp() * c).sum()):
        res = hoad.compile(f, order=3, mode=mode, backend="eager")(x)
        ref = torch.func.jacfwd(torch.func.jacfwd(torch.func.jacfwd(f)))(x)  # (jacrev's would be float32)
        assert res[0, 0, 0].dtype == ref.dtype == torch.float64
        torch.testing.assert_close(res[0, 0, 0], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


_EPS = 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,fn,order", [
    ("sqrt", lambda x: torch.sqrt(x * x + _EPS), 4), ("log", lambda x: torch.log(x * x + _EPS), 4),
    ("rsqrt", lambda x: torch.rsqrt(x * x + _EPS), 3), ("pow", lambda x: (x * x + _EPS) ** -0.5, 3),
    ("norm", lambda x: x.norm() * 1.0, 4), ("reciprocal", lambda x: 1 / (x * x + _EPS), 3),
])
def test_float32_derivatives_whose_scalar_factor_overflows(name, fn, order, mode):
    """φ^(4) of √u at u = 1e-12 is ∝ u^-3.5 = 1e42, past float32's range, while the derivative of
    √(x² + ε) is -3e18: NaN or -inf, where torch.func is finite. The powers of 1/u now go onto the
    first-order factors of each term (hoad.rules.combinators.Scaled)."""
    x = torch.tensor([0.0, 1e-7, -1e-6], dtype=torch.float64) if name != "norm" else \
        torch.tensor([1e-6, -2e-6, 0.5e-6], dtype=torch.float64)
    f = (lambda x: fn(x).sum()) if name != "norm" else fn
    res = hoad.compile(f, order=order, mode=mode, backend="eager")(x.float())[(0,) * order]
    g = jacrev(f)
    for _ in range(order - 1):
        g = jacfwd(g)
    want = g(x)
    assert torch.isfinite(res).all(), res
    torch.testing.assert_close(res.double(), want, rtol=1e-3, atol=1e-5 * float(want.abs().max()))


def test_float16_derivatives_of_a_reciprocal_keep_their_sign():
    """1/(1 + x²) at x = 5 in float16: φ^(4) = 24 y^5 = 8e-8 underflowed, and the fourth derivative
    came out -2.1e-4 where it is 5.8e-3."""
    x = torch.tensor([5.0, 6.0, -3.0], dtype=torch.float64)
    f = lambda x: (1 / (1 + x * x)).sum()  # noqa: E731
    res = hoad.compile(f, order=4, backend="eager")(x.half())[0, 0, 0, 0]
    want = jacfwd(jacfwd(jacfwd(jacrev(f))))(x)
    torch.testing.assert_close(res.double(), want, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,fn,xs", [
    ("atan", torch.atan, [12.0, 15.0, -40.0, 0.5]),
    ("atan2", lambda x: torch.atan2(x, torch.ones_like(x)), [12.0, 15.0, -40.0, 0.5]),
    ("erf", torch.erf, [25.0, -30.0, 3.0, 0.5]),
])
def test_float16_derivatives_out_of_range_factors(name, fn, xs, mode):
    """float16 at orders 3-4: atan's P_k(x) (1 + x²)^-k underflowed to 0 (-9e-5 at x = 12) or gave
    0 · inf = NaN (x = 15), and erf's Hermite polynomial times exp(-x²) was NaN from |x| = 25, where
    the derivative is 0."""
    x = torch.tensor(xs, dtype=torch.float64)
    f = lambda x: fn(x).sum()  # noqa: E731
    for order in (3, 4):
        res = hoad.compile(f, order=order, mode=mode, backend="eager")(x.half())[(0,) * order]
        g = jacrev(f)
        for _ in range(order - 1):
            g = jacfwd(g)
        want = torch.einsum("i" * order + "->i", g(x))
        got = torch.einsum("i" * order + "->i", res.double())
        assert torch.isfinite(got).all(), got
        torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-7)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_two_masked_pair_terms_sharing_a_distance(mode):
    """Coulomb and Lennard-Jones terms, each where(eye, 0, g(r)), read one r = √Σd²: the √ at
    r_ii = 0 was in neither where's region alone, and reverse mode gave an all-NaN gradient."""
    n = 4
    eye = torch.eye(n, dtype=torch.bool)
    q = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    iu = torch.triu_indices(n, n, 1)

    def energy(x):
        r = ((x[:, None] - x[None]) ** 2).sum(-1).sqrt()
        s6 = torch.where(eye, 0.0, r ** -6)
        return 0.5 * (torch.where(eye, 0.0, q[:, None] * q[None] / r) + 4 * (s6 * s6 - s6)).sum()

    def pairs(x):  # the same sum over i < j
        r = ((x[iu[0]] - x[iu[1]]) ** 2).sum(-1).sqrt()
        return (q[iu[0]] * q[iu[1]] / r + 4 * (r ** -12 - r ** -6)).sum()

    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1.5
    res = hoad.compile(energy, order=2, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(pairs)(x))


@pytest.mark.parametrize("mask", ["nan_to_num", "isfinite", "masked_fill"])
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_branch_masked_by_its_own_infinity(mask, mode):
    """1 / r at r_ii = 0 masked by a condition computed from 1 / r itself (nan_to_num, isfinite,
    isinf): reverse mode's Hessian was NaN in every entry (the second-order term of the division
    multiplies the untaken entries' zero cotangent by 1/0³). The branch reads a guarded copy."""
    n = 4
    iu = torch.triu_indices(n, n, 1)
    masks = {"nan_to_num": lambda y: torch.nan_to_num(y, posinf=0.0),
             "isfinite": lambda y: torch.where(torch.isfinite(y), y, 0.0),
             "masked_fill": lambda y: y.masked_fill(y.isinf(), 0.0)}

    def energy(x):
        return masks[mask](1 / torch.cdist(x, x)).sum()

    def pairs(x):  # the same sum over i ≠ j
        return 2 * (1 / ((x[iu[0]] - x[iu[1]]) ** 2).sum(-1).sqrt()).sum()

    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    res = hoad.compile(energy, order=3, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res[0], torch.func.grad(pairs)(x))
    torch.testing.assert_close(res[0, 0], torch.func.hessian(pairs)(x))
    torch.testing.assert_close(res[0, 0, 0], torch.func.jacfwd(torch.func.hessian(pairs))(x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_two_singular_ops_in_a_branch_the_second_read_by_a_condition(mode):
    """log(1/x - 1) with the log's NaN counted by a condition elsewhere: after the division was
    copied, the log's original (kept for the condition) was guarded in place, and the count it
    feeds lost its NaN (value 5.10 where torch gives 6.10)."""
    def f(x):
        z = torch.log(1 / x - 1)
        return torch.where((x > 0) & (x < 1), z, x * x).sum() + (~torch.isfinite(z)).double().sum()

    def plain(x):  # the same function with the log's argument kept in its domain, and the count
        inside = (x > 0) & (x < 1)
        z = torch.log(torch.where(inside, 1 / torch.where(inside, x, 0.5) - 1, 1.0))
        return torch.where(inside, z, x * x).sum() + (~inside).double().sum()

    x = torch.tensor([0.5, 2.0, 0.25], dtype=torch.float64)
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res.value, f(x))
    torch.testing.assert_close(res[0], torch.func.grad(plain)(x))
    torch.testing.assert_close(res[0, 0], torch.func.hessian(plain)(x))


@pytest.mark.parametrize("name", ["pow", "acosh", "xlogy", "erfinv", "lgamma", "digamma", "log1p"])
def test_singular_ops_in_an_untaken_branch_in_reverse_mode(name):
    """Their argument is made safe where the branch is not taken: NaN in reverse mode before."""
    p = torch.tensor(2.5, dtype=torch.float64)
    op, inside, safe = {"pow": (lambda u: torch.pow(2.0 - u, p), lambda x: x < 2, 0.0),
                        "acosh": (torch.acosh, lambda x: x > 1, 2.0),
                        "xlogy": (lambda u: torch.xlogy(u, u), lambda x: x > 0, 1.0),
                        "erfinv": (torch.erfinv, lambda x: x.abs() < 1, 0.0),
                        "lgamma": (torch.lgamma, lambda x: x > 0, 1.0),
                        "digamma": (torch.digamma, lambda x: x > 0, 1.0),
                        "log1p": (torch.log1p, lambda x: x > -1, 0.0)}[name]
    x = torch.linspace(-2.5, 3, 12, dtype=torch.float64)

    def f(x):
        return torch.where(inside(x), op(x), 0.0).sin().sum()

    def plain(x):  # the double-where idiom
        return torch.where(inside(x), op(torch.where(inside(x), x, safe)), 0.0).sin().sum()

    res = hoad.compile(f, order=2, mode="reverse", backend="eager")(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(plain)(x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_indexing_by_a_traced_integer_tensor(mode):
    """x[x.argmax()] or x[i] for a 0-d index argument: Python indexing read the tensor's value (a
    DataDependentControlFlowError advising torch.where); it is a one-entry gather."""
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    i, j = torch.tensor(2), torch.tensor(-1)
    for f in (lambda x, i, j: (x[x.sum(1).argmax()] ** 2).sum() + x.sum(),
              lambda x, i, j: (x[i] * x[:, j]).sum() + x[i, j] ** 3,
              lambda x, i, j: (x[i, 1:] ** 2).sum() * x[None, j].sin().sum()):
        res = hoad.compile(f, order=2, mode=mode, backend="eager")(x, i, j)
        torch.testing.assert_close(res[0, 0], torch.func.hessian(f)(x, i, j))


# ------------------------------------------------------------------ nothing stale between calls
def _laplacian_of(f):
    return lambda x: torch.func.hessian(f)(x).diagonal().sum()


def test_a_closed_over_tensor_read_by_tolist_is_read_at_every_call():
    """.tolist() reads values outside ATen (no op the trace sees): the program kept the first
    call's box size after an in-place update (7.0 where 10.5 is right, the gradient x1.5 off)."""
    box = torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)

    def f(x):
        return (x ** 2).sum() / box.tolist()[0]

    cf = hoad.compile(f, order=1, backend="eager")
    x = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    cf(x)
    box.fill_(2.0)
    res = cf(x)
    torch.testing.assert_close(res.value, f(x))
    torch.testing.assert_close(res[0], x)


_A = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)  # a global with an attribute's name
_HOLDER = types.SimpleNamespace(_A=_A)


class _Holds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._A = _A

    def forward(self, x):
        return torch.tanh(x @ self._A).sum()


def test_an_attribute_named_like_a_global_is_read_through_the_attribute():
    """``params._A`` (or a module's ``self._A``) read the global ``_A`` bound to the same tensor:
    code.co_names lists attribute names too, so the global was the tensor's source. Rebinding the
    attribute was not seen, and rebinding the global, which the function never reads, was."""
    global _A
    x = torch.tensor([[0.3, -0.7], [1.1, 0.2]], dtype=torch.float64)
    m = _Holds()
    f = lambda x: torch.tanh(x @ _HOLDER._A).sum()  # noqa: E731
    for fn, cf in ((f, hoad.compile(f, order=1, backend="eager")), (m, hoad.compile(m, order=1, backend="eager"))):
        cf(x)
        _HOLDER._A = m._A = _HOLDER._A * 2 + 1
        torch.testing.assert_close(cf(x)[0], torch.func.grad(fn)(x), msg="after rebinding the attribute")
        saved, _A = _A, torch.zeros(2, 2, dtype=torch.float64)
        try:
            torch.testing.assert_close(cf(x)[0], torch.func.grad(fn)(x), msg="after rebinding the global")
        finally:
            _A = saved
            _HOLDER._A = m._A = _A


def test_a_closed_over_python_number_is_read_at_every_call():
    """Tracing bakes Python numbers into the program; a changed one traces the function again."""
    k = 2.0

    def u(x):
        return torch.sin(k * x).sum(-1)

    lap, X = hoad.laplacian(u, batch_dim=0, backend="eager"), rand(3, 4, seed=40)
    lap(X)
    k = 3.0
    assert_close(lap(X).laplacian, torch.func.vmap(_laplacian_of(u))(X), "after k = 3.0")


def test_module_attributes_and_train_eval_switches_are_read_at_every_call():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.scale = torch.nn.Linear(4, 3).double(), 2.5

        def forward(self, x):
            return torch.tanh(self.scale * self.lin(x)).sum(-1)

    torch.manual_seed(41)
    net = Scaled()
    X = rand(3, 4, seed=42)
    lap = hoad.laplacian(lambda x: net(x), batch_dim=0, backend="eager")
    lap(X)
    net.scale = 0.5
    assert_close(lap(X).laplacian, torch.func.vmap(_laplacian_of(net))(X), "after net.scale = 0.5")
    drop = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5)).double().eval()
    lap = hoad.laplacian(lambda x: drop(x).sum(-1), batch_dim=0, backend="eager")
    lap(X)
    drop.train()  # dropout draws random numbers now: refused, not the eval program
    with pytest.raises(hoad.RandomnessError):
        lap(X)


def test_weights_changed_behind_autograd_are_seen():
    """A write through .data (or numpy) bumps no version counter: the hoisted weight-only part of
    the program (here Σ_i W_ij²) is recomputed anyway."""
    W, a = rand(3, 5, seed=43), rand(5, seed=44)

    def u(x):
        return torch.tanh(x @ W) @ a

    lap, X = hoad.laplacian(u, batch_dim=0, backend="eager"), rand(4, 3, seed=45)
    lap(X)
    W.data.mul_(2.0)
    assert_close(lap(X).laplacian, torch.func.vmap(_laplacian_of(u))(X), "after W.data.mul_(2)")
    W.numpy()[:] *= 0.5
    assert_close(lap(X).laplacian, torch.func.vmap(_laplacian_of(u))(X), "after a write through numpy")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_tracing_does_not_update_buffers_and_leaves_them_without_a_graph(backend):
    """Batch norm in training mode adds 1 to num_batches_tracked in Python: the trace ran that for
    real, and the program replays it, so the first call counted twice (with momentum=None the
    running statistics were then wrong). Under autograd the written statistics carried a graph,
    and the module's next plain forward failed (and Inductor's training compile refused the
    write: no derivative for copy_). (momentum=None is refused: its factor 1/float(num_batches_tracked)
    reads a tensor's value, which the program kept, test_errors.py.)"""
    torch.manual_seed(46)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Tanh(), torch.nn.Linear(8, 1)).double().train()
    ref = copy.deepcopy(net)
    lap = hoad.laplacian(lambda x: net(x).sum(), backend=backend)
    for seed in (47, 147):
        X = rand(6, 3, seed=seed)
        lap(X).laplacian.backward()
        with torch.no_grad():
            ref(X)
    for got, want in zip(net[1].buffers(), ref[1].buffers()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not got.requires_grad
    net.eval()
    net(X)  # a plain forward still works


def test_switching_back_to_train_or_eval_reuses_its_program():
    torch.manual_seed(48)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1)).double()
    X = rand(6, 3, seed=49)

    def u(x):
        return net(x).sum()

    def reference():  # batch norm in plain ops: torch.func's own batch norm is not used here
        bn = net[1]
        h = net[0](X)
        if net.training:
            mean, var = h.mean(0), h.var(0, unbiased=False)
        else:
            mean, var = bn.running_mean, bn.running_var
        h = (h - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
        return net[3](torch.tanh(h)).sum()

    lap = hoad.laplacian(u, backend="eager")
    programs = []
    for training in (False, True, False, True):
        net.train(training)
        with torch.no_grad():
            got = lap(X).value
            ref = reference()
        assert_close(got, ref, f"value, training={training}")
        programs.append(lap.compiled._last)
    assert programs[0] is not programs[1] and programs[2] is programs[0] and programs[3] is programs[1]


ALPHA = 1.0


class _Act(torch.nn.Module):
    def forward(self, x):
        return torch.sin(ALPHA * x)


class _Scaled(torch.nn.Module):
    scale = 2.0  # a class default an instance may override

    def forward(self, x):
        return (self.scale * x).sin().sum()


def test_values_read_through_classes_and_globals_of_modules_are_watched():
    """Values the code reads that the instance did not hold when traced: a class default later
    set on the instance, a global read in a submodule's forward. (Not watched: an entry a list or
    dict gains later; watching their lengths retraced every function that logs into a list.)"""
    global ALPHA
    x = rand(5, 3, seed=67)
    m = _Scaled()
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), _Act()).double()
    import types

    import numpy as np

    h = types.SimpleNamespace(k=np.float32(2.0))
    cases = [(m, lambda: setattr(m, "scale", 3.0)),
             (lambda x: net(x).sum(), lambda: globals().__setitem__("ALPHA", 2.5)),
             (lambda x: (float(h.k) * x).sin().sum(), lambda: setattr(h, "k", np.float32(3.0)))]
    try:
        for f, change in cases:
            cf = hoad.compile(f, order=1, backend="eager")
            cf(x)
            change()
            assert_close(cf(x).value, f(x), "value after the change")
    finally:
        ALPHA = 1.0


def test_a_tensor_of_a_config_module_is_live(tmp_path, monkeypatch):
    """cfg.W of an imported module of the user's, rebound: the old tensor was kept (no module's
    attributes were searched; its floats were watched)."""
    import importlib

    (tmp_path / "hoad_test_config.py").write_text("import torch\nW = torch.ones(3, dtype=torch.float64)\nk = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = importlib.import_module("hoad_test_config")

    def f(x):
        return (cfg.W * x * cfg.k).sin().sum()

    cf = hoad.compile(f, order=2, backend="eager")
    x = rand(3, seed=68)
    cf(x)
    cfg.W = rand(3, seed=69)
    assert_close(cf(x)[0, 0], torch.func.hessian(f)(x), "Hessian after cfg.W = ...")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_editing_a_result_in_place_changes_no_other_tensor(backend):
    """A constant Hessian was the prefix's cached tensor (damping it in place changed every later
    call), and the Jacobian of W @ x was W itself (editing it edited the weights)."""
    A, W = rand(3, 3, seed=70), rand(4, 3, seed=71)
    x = rand(3, seed=72)
    quadratic = hoad.compile(lambda x: x @ A @ x, order=2, backend=backend)
    linear = hoad.compile(lambda x: W @ x, order=1, backend=backend)
    square = hoad.compile(lambda x: (x * x).sum(), order=2, backend=backend)
    W0 = W.clone()
    for _ in range(2):
        quadratic(x)[0, 0].diagonal().add_(1.0)
        linear(x)[0].mul_(2.0)
        square(x)[0, 0].add_(1.0)
    assert_close(quadratic(x)[0, 0], A + A.T, "quadratic")
    assert torch.equal(W, W0) and torch.equal(linear(x)[0], W0)
    assert_close(square(x)[0, 0], 2 * torch.eye(3, dtype=x.dtype), "square")
    # blocks the program computes by one node: ∂/∂x and ∂/∂y of exp(x + y); exp's pure derivatives
    y = rand(3, seed=74)
    res = hoad.compile(lambda x, y: (x + y).exp().sum(), order=2, wrt=(0, 1), backend=backend)(x, y)
    res[0].mul_(0.1)
    assert_close(res[1], (x + y).exp(), "∂/∂y after editing ∂/∂x")
    X = rand(4, 3, seed=75)
    res = hoad.compile(lambda X: X.exp().sum(-1), order=2, batch_dim=0, diagonal=True, backend=backend)(X)
    res[0].zero_()
    assert_close(res[0, 0], X.exp(), "∂² after editing ∂")


def test_a_numpy_array_too_large_to_compare_is_named_in_a_warning(caplog):
    """Arrays up to 2^16 entries are compared at each call; a larger one was baked in silently."""
    import numpy as np

    table = np.ones(70000)

    def f(x):
        return (x * torch.from_numpy(table)[:3]).sin().sum()

    with caplog.at_level("WARNING", logger="hoad"):
        hoad.compile(f, order=1, backend="eager")(rand(3, seed=76))
    assert "numpy array table (70000 entries)" in caplog.text and "pass it as a tensor" in caplog.text


class _Consts:  # class attributes read through the class itself, as a config
    T = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    k = 2.0


def test_class_attributes_read_through_the_class_are_live():
    """f reads _Consts.T and _Consts.k: classes were not followed, so rebinding the tensor or
    changing the float left the program on the old values, silently (errors 26 and 73)."""
    f = lambda x: (_Consts.T * x * _Consts.k).sin().sum()  # noqa: E731
    cf, x = hoad.compile(f, order=2, backend="eager"), rand(3, seed=70)
    old_T, old_k = _Consts.T, _Consts.k
    try:
        cf(x)
        _Consts.T = rand(3, seed=71)
        assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "after C.T = new tensor")
        _Consts.k = 5.0
        assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "after C.k = 5.0")
        _Consts.T.mul_(3.0)
        assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "after C.T.mul_(3)")
    finally:
        _Consts.T, _Consts.k = old_T, old_k


def test_attributes_read_through_getattr_are_watched():
    """getattr(self, "be" + "ta") names no attribute in the bytecode: the value was baked in and a
    change of it silently ignored. Code that calls getattr now has every scalar attribute watched."""
    class G(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.beta, self.which = 1.0, "beta"

        def forward(self, x):
            return (x * getattr(self, "be" + "ta") + getattr(self, self.which)).sin().sum()

    g, x = G(), rand(3, seed=72)
    cg = hoad.compile(g, order=2, backend="eager")
    cg(x)
    g.beta = 3.0
    assert_close(cg(x)[0, 0], jacfwd(jacrev(g))(x), "after g.beta = 3.0")


@pytest.mark.parametrize("read", [lambda s: s.item(), float, int], ids=["item", "float", "int"])
def test_value_of_a_closed_over_tensor_is_watched(read):
    """x * S.item() with S closed over: the program keeps the number, and kept it silently after
    S.fill_(5) or a rebinding of S. Now every call compares it and builds again when it changed."""
    S = torch.tensor(2.0, dtype=torch.float64)
    f = lambda x: (x * read(S)).sin().sum()  # noqa: E731
    cf, x = hoad.compile(f, order=2, backend="eager"), rand(3, seed=73)
    cf(x)
    S.fill_(5.0)
    assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "after S.fill_(5)")
    S = torch.tensor(3.0, dtype=torch.float64)
    assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "after S = tensor(3)")
    n = len(cf._cache)
    cf(x)
    assert len(cf._cache) == n  # unchanged: nothing built


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_hot_checks_its_classes_and_follows_a_closed_over_index(backend):
    """F.one_hot's class checks were dropped by the trace (a class out of range gave a row of
    zeros), and a closed-over index was refused as control flow; it is a checked scatter now."""
    W, labels = rand(3, 4, seed=71), torch.tensor([0, 3, 1])

    def f(x, i):
        return (F.one_hot(i, 4).to(x.dtype) * torch.tanh(x @ W)).sum()

    def g(x):
        return f(x, labels)

    x = rand(3, 3, seed=72)
    cf, cg = hoad.compile(f, order=2, backend=backend), hoad.compile(g, order=2, backend=backend)
    assert_close(cf(x, labels)[0, 0], jacfwd(jacrev(f))(x, labels), "index passed")
    assert_close(cg(x)[0, 0], jacfwd(jacrev(g))(x), "index closed over")
    labels[1] = 2
    assert_close(cg(x)[0, 0], jacfwd(jacrev(g))(x), "after labels[1] = 2")
    for bad in ([0, 4, 1], [0, -1, 1]):
        with pytest.raises(hoad.ExecutionError, match="out of bounds"):
            cf(x, torch.tensor(bad))
    with pytest.raises(hoad.DataDependentControlFlowError, match="pass num_classes"):
        hoad.compile(lambda x, i: (F.one_hot(i).to(x.dtype) * x).sum(), order=1, backend=backend)(x, labels)


# ------------------------------------------------------- smooth functions at their seams
ZEROS = torch.tensor([0.0, 0.0, 1.5, -1.5], dtype=torch.float64)  # exact zeros: where the seams are


@pytest.mark.parametrize("mode", MODES)
def test_log_sigmoid_is_smooth_at_zero(mode):
    """Core ATen writes log σ(x) as min(0, x) - log1p(e^-|x|): its kinks cancel in value only,
    and hoad differentiated the pieces (Hessian 0 at x = 0, not -1/4: Newton's first step of a
    logistic regression from w = 0 was wrong). Checked against the plain-op formula -log1p(e^-x)."""
    X = rand(6, 4, seed=73)
    check(lambda w: F.logsigmoid(X @ w).sum() + F.logsigmoid(w).sum(), (ZEROS.clone(),), order=4, mode=mode,
          reference_fn=lambda w: -torch.log1p(torch.exp(-(X @ w))).sum() - torch.log1p(torch.exp(-w)).sum())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", ["smooth_l1", "huber"])
def test_robust_losses_are_quadratic_at_zero_residual(loss, mode):
    """Inside |d| < β they are d²/2 (over β): core wrote d² as |d|², whose Hessian is 0 at d = 0
    (prediction equal to target), not 1/β. The reference is the same loss in plain ops."""
    target = torch.tensor([0.0, 0.5, 1.5, -3.0], dtype=torch.float64)
    fn = {"smooth_l1": lambda x: F.smooth_l1_loss(x, target, beta=0.7),
          "huber": lambda x: F.huber_loss(x, target, delta=0.7)}[loss]
    scale = 1 / 0.7 if loss == "smooth_l1" else 1.0

    def plain(x):
        d = x - target
        inner = 0.5 * d * d * scale
        outer = (d.abs() - 0.35) * (1.0 if loss == "smooth_l1" else 0.7)
        return torch.where(d.abs() < 0.7, inner, outer).mean()

    check(fn, (torch.tensor([0.0, 0.5, 0.2, 1.0], dtype=torch.float64),), order=3, mode=mode, reference_fn=plain)


@pytest.mark.parametrize("mode", MODES)
def test_robust_losses_at_their_seam_follow_torch(mode):
    """|d| = δ exactly (a zero-initialised output and targets ±δ): Huber's curvature there is
    torch's 1 (it was 0, a singular Newton step), smooth L1's torch's 0."""
    target = torch.tensor([1.0, -1.0, 0.25], dtype=torch.float64)
    x = torch.zeros(3, dtype=torch.float64)
    for fn in (lambda x: F.huber_loss(x, target, delta=1.0, reduction="sum"),
               lambda x: F.smooth_l1_loss(x, target, beta=1.0, reduction="sum")):
        res = hoad.compile(fn, order=2, mode=mode, backend="eager")(x)
        assert_close(res[0, 0], jacrev(jacrev(fn))(x), "Hessian at the seam")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["elu", "celu", "selu"])
def test_elu_family_at_zero_follows_torch(name, mode):
    """At x = 0 torch differentiates the negative branch once (slope s·α) and the positive one
    after that (no curvature); hoad took the negative branch at every order (Hessian α, not 0)."""
    fn = {"elu": F.elu, "celu": lambda x: F.celu(x, alpha=2.0), "selu": F.selu}[name]
    check(lambda x: (fn(x) * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), (ZEROS.clone(),), order=3,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_powers_at_a_zero_base_follow_torch(mode):
    """x ** p with a tensor p: at x = 0, torch's p·x^(p-1) is 1 for p = 1 and 0 for p = 0
    (forward mode formed y · x⁻¹ = 0 · inf = NaN); sqrt and rsqrt are inf at 0, not NaN."""
    p = torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=torch.float64)
    x = torch.tensor([0.0, 0.0, 0.0, 1.5], dtype=torch.float64)
    check(lambda x: (x ** p).sum(), (x,), order=3, mode=mode)
    # base and exponent both differentiated: a^b = exp(b log a) has log 0 = -inf at a = 0, where
    # the blocks in a were NaN; torch takes them as the power's (those in b, and mixed, as 0:
    # the limit a^(b-1) log a -> 0 for b > 1 at order 2; from order 3 the mixed ones are log 0)
    q = torch.tensor([2.0, 3.0, 2.0, 0.5], dtype=torch.float64)
    check(lambda x, q: (x ** q).sum(), (torch.tensor([0.0, 0.0, 1.0, 2.0], dtype=torch.float64), q), wrt=(0, 1),
          order=2, mode=mode)
    for fn, slope in ((torch.sqrt, math.inf), (torch.rsqrt, -math.inf)):
        assert hoad.compile(lambda x: fn(x).sum(), order=1, mode=mode, backend="eager")(x)[0][0] == slope


@pytest.mark.parametrize("mode", MODES)
def test_atan2_at_the_origin_is_nan_and_xlogy_at_zero_follows_torch(mode):
    """The angle is discontinuous at the origin: its derivatives there are NaN at every order
    (torch's 0 at order 1 let r² cos 2θ = x² - y² come out with Hessian diag(2, 2), not
    diag(2, -2)); elsewhere torch's. ∂ xlogy(x, y)/∂x at x = 0 is log y (it was 0), and 0 at
    x = y = 0 in reverse mode too (0 · log 0 = NaN before)."""
    a = torch.tensor([0.0, 1.0, -2.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)
    res = hoad.compile(lambda a, b: torch.atan2(a, b).sum(), order=2, wrt=(0, 1), mode=mode, backend="eager")(a, b)
    ref = jacrev(lambda a: torch.atan2(a, b).sum())(a)
    assert bool(res[0][0].isnan()) and bool(res[0, 0][0, 0].isnan()) and bool(res[0, 1][0, 0].isnan())
    assert_close(res[0][1:], ref[1:], "away from the origin")
    check(lambda a, b: torch.atan2(a, b).sum(), (a[1:], b[1:]), wrt=(0, 1), order=3, mode=mode)
    check(lambda x: torch.xlogy(x, b).sum() + torch.special.xlog1py(x, b - 1).sum(), (a.clone(),), order=2,
          mode=mode)
    # with y a number (another overload): x · log 2 has derivative log 2 at x = 0 too
    check(lambda x: torch.xlogy(x, 2.0).sum() + torch.special.xlog1py(x, 1.0).sum(), (a.clone(),), order=2,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_xlogy_of_counts_and_rates_of_two_dtypes(mode):
    """A Poisson log-likelihood xlogy(k int64, λ) - λ, and xlogy of float32 and float64 tensors,
    were refused ("no derivative rule for aten.xlogy.Tensor"): torch promotes, so does hoad."""
    k = torch.tensor([0, 1, 3, 7])
    w = torch.tensor([0.0, 0.5, 2.0, 1.5], dtype=torch.float32)
    check(lambda lam: (torch.xlogy(k, lam) - lam).sum() + torch.special.xlog1py(k, lam).sum()
          + torch.xlogy(w, lam).sum(), (rand(4, seed=12).abs() + 0.5,), order=3, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_std_of_a_constant_row_has_torchs_zero_derivative(mode):
    """√var at var = 0 gave inf · 0 = NaN; torch's derivative there is 0 (a subgradient)."""
    X = torch.tensor([[1.0, 1.0, 1.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    check(lambda X: X.std(dim=1).sum() + torch.std_mean(X, dim=1, keepdim=True)[0].sum(), (X,), order=2,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_embedding_with_max_norm_differentiates_the_table_as_torch_does(mode):
    """max_norm renormalises the table's rows in place under no_grad: autograd sees the table
    itself, with the new values (every derivative was 0: the trace read a detached copy)."""
    idx = torch.tensor([0, 2, 2, 4])

    def f(W):
        return (F.embedding(idx, W, max_norm=1.0) ** 3).sum() + (W * W).sum()

    W = rand(5, 3, seed=74) * 2
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(W.clone())
    renormed = W.clone()
    f(renormed)  # torch's own call renormalises in place; its derivatives are those at the new table
    g = lambda W: (W[idx] ** 3).sum() + (W * W).sum()  # noqa: E731
    assert_close(res[0], jacrev(g)(renormed), "gradient")
    assert_close(res[0, 0], jacfwd(jacrev(g))(renormed), "Hessian")
    W2 = W.clone()
    hoad.compile(f, order=1, mode=mode, backend="eager")(W2)
    assert_close(W2, renormed, "the table renormalised in place, as torch does")


@pytest.mark.parametrize("mode", MODES)
def test_logcumsumexp_over_a_masked_prefix_is_finite(mode):
    """Where every entry up to i is -inf, exp(x_j - y_i) was exp(-inf + inf) = NaN and spread to
    the row (torch.func gives NaN at the masked inputs too). The reference is the same scan with
    the masked entries' terms held at 0: their derivatives are 0."""
    inf = math.inf
    x = torch.tensor([[-inf, -inf, 1.0, 2.0], [0.5, -inf, 1.0, 2.0]], dtype=torch.float64)
    w = torch.arange(1.0, 9.0, dtype=torch.float64).reshape(2, 4)[:, 2:]

    def f(x):
        return (torch.logcumsumexp(x, 1)[:, 2:] * w).sum()

    def plain(x):
        kept = torch.isfinite(x)
        terms = torch.where(kept, torch.where(kept, x, 0.0).exp(), 0.0)
        return (torch.log(torch.cumsum(terms, 1))[:, 2:] * w).sum()

    check(f, (x,), order=3, mode=mode, reference_fn=plain)


@pytest.mark.parametrize("mode", MODES)
def test_binary_cross_entropy_at_certain_predictions_is_finite(mode):
    """At p = 0 (target 0) and p = 1 (target 1) the clamped log's derivative was inf · 0 = NaN.
    There the loss is the other term alone: -log(1 - p) has slope 1 at p = 0. Elsewhere it is the
    plain formula (torch's own backward divides by max(p(1 - p), 1e-12): 0 at the ends)."""
    t = torch.tensor([0.0, 1.0, 1.0, 0.2], dtype=torch.float64)

    def f(p):
        return F.binary_cross_entropy(p, t, reduction="sum")

    def plain(p):
        return -(t * torch.log(p) + (1 - t) * torch.log1p(-p)).sum()

    check(f, (torch.tensor([0.1, 0.7, 0.5, 0.3], dtype=torch.float64),), order=3, mode=mode, reference_fn=plain)
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(torch.tensor([0.0, 1.0, 0.5, 0.3], dtype=torch.float64))
    assert_close(res[0][:2], torch.tensor([1.0, -1.0], dtype=torch.float64), "slopes at p = 0 and 1")
    assert_close(res[0, 0].diagonal()[:2], torch.tensor([1.0, 1.0], dtype=torch.float64), "curvatures there")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["rbf kernel", "norm squared", "norm times norm", "two norm calls", "pdist squared"])
def test_squared_distances_are_smooth_at_coincident_points(form, mode):
    """A 2-norm squared is the sum of squares: Hessian 2I at a zero difference. Through the
    norm's subgradient 0 it was 0 (an RBF kernel's curvature at x = x', on its diagonal)."""
    y = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)  # x[0] = y[0], and a zero row
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    fn, plain = {
        "rbf kernel": (lambda x: torch.exp(-torch.cdist(x, y) ** 2).sum(),
                       lambda x: torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)).sum()),
        "norm squared": (lambda x: (torch.linalg.vector_norm(x, dim=1) ** 2 * w).sum(),
                         lambda x: ((x * x).sum(1) * w).sum()),
        "norm times norm": (lambda x: (lambda n: (n * n).sum())(x.norm(dim=1)), lambda x: (x * x).sum()),
        "two norm calls": (lambda x: (x.norm(dim=1) * x.norm(dim=1)).sum(), lambda x: (x * x).sum()),
        "pdist squared": (lambda x: (F.pdist(torch.cat([x, y])) ** 2).sum(),
                          lambda x: (lambda z: ((z[:, None] - z[None]) ** 2).sum(-1).triu(1).sum())(torch.cat([x, y]))),
    }[form]
    check(fn, (x,), order=3, mode=mode, reference_fn=plain)


@pytest.mark.parametrize("var_shape", ["per entry", "one per row"])
def test_gaussian_nll_loss_is_traced(var_shape):
    """torch checks var >= 0 with a Python `if` on its values: refused as control flow before;
    now the same loss, var clamped at eps with derivative 1 as torch's in-place clamp has it."""
    x, t = rand(4, 3, seed=79), rand(4, 3, seed=80)
    var = rand(4, 3, seed=81, positive=True) if var_shape == "per entry" else rand(4, seed=81, positive=True)
    check(lambda x, v: F.gaussian_nll_loss(x, t, v, full=True), (x, var), wrt=(0, 1), order=3)


@pytest.mark.parametrize("mode", MODES)
def test_nextafter_at_equal_arguments_follows_torch(mode):
    a = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    check(lambda a, b: (torch.nextafter(a, b) * a).sum(), (a, b), wrt=(0, 1), order=2, mode=mode)


def helper(x):  # rebound by the test below, as a notebook cell run again would
    return torch.tanh(x)


@pytest.mark.parametrize("swap", ["submodule", "function attribute", "global function", "closed-over function",
                                  "layer appended", "forward patched", "class forward patched",
                                  "tensor appended"])
def test_code_swapped_after_tracing_is_traced_again(swap):
    """A program keeps the code it traced: a submodule, function or layer list swapped after the
    first call was silently ignored (the old program's values), under both backends."""
    global helper
    torch.manual_seed(75)

    class Act(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(3, 3).double(), torch.tanh

        def forward(self, x):
            return self.act(self.lin(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(3, 3).double()])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.sum()

    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    stack = Stack()
    act, model = torch.tanh, Act()
    Ws = [rand(3, 3, seed=76)]

    def by_closure(x):
        return act(x).sum()

    def through_list(x):
        for W in Ws:
            x = torch.tanh(x @ W)
        return x.sum()

    fn = {"submodule": lambda x: net(x).sum(), "function attribute": model, "global function":
          lambda x: helper(x).sum(), "closed-over function": by_closure, "layer appended":
          lambda x: stack(x), "forward patched": lambda x: model(x).sum(),
          "class forward patched": lambda x: model(x).sum(), "tensor appended": through_list}[swap]
    cf = hoad.compile(fn, order=2, backend="eager")
    x = rand(3, seed=77)
    cf(x)
    original_forward = Act.forward
    try:
        if swap == "submodule":
            net[1] = nn.Sigmoid()
        elif swap == "function attribute":
            model.act = torch.sin
        elif swap == "global function":
            helper = torch.sin
        elif swap == "closed-over function":
            act = torch.sin
        elif swap == "layer appended":
            stack.layers.append(nn.Linear(3, 3).double())
        elif swap == "forward patched":
            model.forward = lambda x: torch.sin(model.lin(x))
        elif swap == "class forward patched":
            Act.forward = lambda self, x: torch.cos(self.lin(x))
        else:
            Ws.append(rand(3, 3, seed=78))
        res = cf(x)
        f = fn if swap != "function attribute" else (lambda x: model(x))
        assert_close(res[0, 0], jacfwd(jacrev(f))(x), f"after the {swap}")
    finally:
        Act.forward = original_forward
        helper = torch.tanh


CHARGES = np.array([1.0, -2.0, 0.5])  # read with torch.from_numpy by the test below; rebound by it
SIGN = 0.0


@pytest.mark.parametrize("change", ["callable attribute", "numpy in place", "numpy rebound",
                                    "numpy attribute", "signed zero", "signed zero via .data"])
def test_values_read_from_objects_and_arrays_are_watched(change):
    """A plain callable object's number attribute, a numpy array the function turns into a tensor
    (torch.from_numpy, torch.as_tensor), and the sign of a zero (atan2 reads it) were baked into
    the program: after a change the old result came back."""
    global CHARGES, SIGN
    x = rand(3, seed=90)

    class Model:  # not an nn.Module: its __call__ is the code that reads .scale and .k
        def __init__(self):
            self.scale, self.k = 1.0, np.array([0.5, 1.0, 2.0])

        def __call__(self, x):
            return (self.scale * torch.as_tensor(self.k) * x).sin().sum()

    m, W = Model(), torch.tensor([0.0], dtype=torch.float64)
    fn = {"callable attribute": m, "numpy attribute": m,
          "numpy in place": lambda x: (torch.from_numpy(CHARGES) * x ** 2).sum() ** 2,
          "numpy rebound": lambda x: (torch.from_numpy(CHARGES) * x ** 2).sum() ** 2,
          "signed zero": lambda x: (x ** 2 * math.atan2(SIGN, -1.0)).sum(),
          "signed zero via .data": lambda x: (x ** 2 * torch.atan2(W, torch.tensor(-1.0, dtype=torch.float64))).sum(),
          }[change]
    cf = hoad.compile(fn, order=2, backend="eager")
    cf(x)
    try:
        if change == "callable attribute":
            m.scale = 2.0
        elif change == "numpy attribute":
            m.k = np.array([3.0, 1.0, -1.0])
        elif change == "numpy in place":
            CHARGES *= 2
        elif change == "numpy rebound":
            CHARGES = np.array([0.1, 0.2, 0.3])
        elif change == "signed zero":
            SIGN = -0.0
        else:
            W.data[0] = -0.0
        res = cf(x)
        assert_close(res[0, 0], jacfwd(jacrev(fn))(x), f"after the {change}")
    finally:
        CHARGES, SIGN = np.array([1.0, -2.0, 0.5]), 0.0


def test_a_counter_the_function_never_reads_traces_nothing_again():
    """A PINN class whose method is compiled keeps an iteration counter and a loss log; global
    `t` of a time loop shares its name with the method t()."""
    class PINN:
        def __init__(self):
            torch.manual_seed(68)
            self.net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
            self.iter, self.last_loss = 0, 0.0

        def u(self, x):
            return self.net(x).squeeze(-1)

    pinn, X = PINN(), rand(6, 2, seed=69)
    lap = hoad.laplacian(pinn.u, batch_dim=0, backend="eager")
    lap(X)
    first = lap.compiled._last
    for _ in range(3):
        pinn.iter += 1
        pinn.last_loss = float(lap(X).laplacian.sum())
        assert lap.compiled._last is first
    W = rand(3, 2, seed=70)
    cf = hoad.compile(lambda x: torch.tanh(x @ W.t()).sum(-1), order=2, batch_dim=0, backend="eager")
    global t
    t = 0.0
    cf(X)
    first = cf._last
    t = 0.5
    cf(X)
    assert cf._last is first


t = 0.0


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_and_data_inside_the_function_are_constants_as_in_autograd(mode):
    """What the function computes under no_grad / set_grad_enabled(False), or reads through
    .data, has no derivative in autograd; hoad differentiated through it. A call made under
    no_grad from outside still gets every derivative (only the function's own blocks count)."""
    x = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)

    def under_no_grad(x):
        with torch.no_grad():
            shift = (x ** 2).sum()
        return shift * x.sin().sum()

    def switched_off(x):
        torch.set_grad_enabled(False)
        shift = (x ** 2).sum()
        torch.set_grad_enabled(True)
        return shift * x.sin().sum()

    def through_data(x):
        return (x.data ** 2).sum() * x.sin().sum()

    def detached(x):  # the reference: the same function with detach
        return (x.detach() ** 2).sum() * x.sin().sum()

    want = hoad.compile(detached, order=2, backend="eager", mode=mode)(x)
    assert_close(want[0], jacrev(detached)(x), "reference")
    for f in (under_no_grad, switched_off, through_data):
        got = hoad.compile(f, order=2, backend="eager", mode=mode)(x)
        assert_close(got[0], want[0], f.__name__)
        assert_close(got[0, 0], want[0, 0], f.__name__)
    with torch.no_grad():
        outside = hoad.compile(lambda x: (x ** 2).sum() * x.sin().sum(), order=1, backend="eager", mode=mode)(x)
    assert_close(outside[0], jacrev(lambda x: (x ** 2).sum() * x.sin().sum())(x), "called under no_grad")


def _autograd_derivatives(f, x, order):
    """∂^k f / ∂x^k for k = 1..order by nested torch.autograd.grad (autograd's own semantics for
    writes it does not see; torch.func's transforms differ there)."""
    x = x.clone().requires_grad_()
    out, d = [], f(x)
    for k in range(order):
        if k == 0:
            d = torch.autograd.grad(d, x, create_graph=True)[0]
        else:
            d = torch.stack([torch.autograd.grad(e, x, create_graph=True, allow_unused=True)[0]
                             for e in d.reshape(-1)]).reshape(*d.shape, *x.shape)
        out.append(d.detach())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_writes_autograd_does_not_see_keep_their_targets_derivatives(mode):
    """y = 2x, then y.mul_(3) under no_grad: autograd keeps dy/dx = 2 and reads the new values
    (2 cos 6x); hoad differentiated through the write (6 cos 6x). Through .data every derivative
    was 0, and y[0] = 5 under no_grad gave 0 at entry 0 where autograd gives 2 cos 5."""
    x = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)

    def scaled_under_no_grad(x):
        y = x * 2
        with torch.no_grad():
            y.mul_(3)
        return (y.sin() * x).sum()

    def scaled_through_data(x):
        y = x * 2
        y.data.mul_(3)
        return (y.sin() * x).sum()

    def scaled_through_detach(x):
        y = x * 2
        y.detach().add_(1.5)
        return (y.sin() * x).sum()

    def entry_set_under_no_grad(x):
        y = x * 2
        with torch.no_grad():
            y[0] = 5.0
            y[1] = float("inf")  # (a target's inf stays the written value's business)
        return (y[[0, 2]].sin() * x[[0, 2]]).sum()

    for f in (scaled_under_no_grad, scaled_through_data, scaled_through_detach, entry_set_under_no_grad):
        got = hoad.compile(f, order=3, backend="eager", mode=mode)(x)
        for k, want in enumerate(_autograd_derivatives(f, x, 3), 1):
            assert_close(got[(0,) * k], want, f"{f.__name__} order {k}")

    def transposed_under_no_grad(x):  # (a write of its shape, not its values: the kept clone failed to broadcast)
        y = (x * 2)[None].expand(2, 3).clone()
        with torch.no_grad():
            y.t_()
        return (y.sin() * x[:, None]).sum()

    plain = lambda x: ((x * 2)[None].expand(2, 3).t().sin() * x[:, None]).sum()  # noqa: E731
    assert_close(hoad.compile(transposed_under_no_grad, order=1, backend="eager", mode=mode)(x)[0], jacrev(plain)(x),
                 "transposed under no_grad")


_BOTH_BRANCHES = {  # a singular op's value read by both branches of a where
    "where": lambda x: torch.where(x > 1, x.sqrt(), 2 * x.sqrt()),
    "where cse": lambda x: torch.where(x > 1, -1 / x + x.sqrt(), 1 / x),
    "leaky_relu(log)": lambda x: F.leaky_relu(x.log(), 0.1),
    "elu(sqrt - 1)": lambda x: F.elu(x.sqrt() - 1),
    "softplus(5 sqrt)": lambda x: F.softplus(5 * x.sqrt()),
    "logsigmoid(sqrt)": lambda x: F.logsigmoid(x.sqrt()),
    "logaddexp": lambda x: torch.logaddexp(x, 2 * x.sqrt()),
    "hardswish(1/x)": lambda x: F.hardswish(1 / x),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(_BOTH_BRANCHES))
def test_a_value_both_branches_of_a_where_read(name, mode):
    """safe_branches counted a value the where reads as its other branch (or the taken one) as its
    branch's own, and gave it the guard's safe value: where(x > 1, √x, 2√x) came out [1.41, 1, 1]
    where torch gives [1.41, 1.41, 2]; leaky_relu(log x) was 3.4 off."""
    x = torch.tensor([0.3, 1.0, 2.0, 30.0, 0.05], dtype=torch.float64)
    f = _BOTH_BRANCHES[name]
    res = hoad.compile(lambda x: f(x), order=2, mode=mode, backend="eager")(x)
    assert_close(res.value, f(x), "value")
    assert_close(res[0], jacrev(f)(x), "first derivative")
    assert_close(res[0, 0], jacfwd(jacrev(f))(x), "second derivative")


def _pair_energy(clamped: bool):
    def energy(X):  # the diagonal r_ii = 0 is clamped to ε, where √'s derivative is infinite
        D = X[:, None, :] - X[None, :, :]
        s = torch.sqrt((D ** 2).sum(-1))
        r = s.clamp(min=1e-3) if clamped else torch.where(s > 1e-3, s, 1e-3)
        return (torch.exp(-r) + 1 / r).sum()
    return energy


@pytest.mark.parametrize("mode", MODES)
def test_a_clamped_value_whose_argument_has_an_infinite_derivative_is_flat(mode):
    """clamp(√Σd², min=ε) at a zero distance: clamp's derivative 0 times √'s infinite one made
    every entry of the gradient NaN (torch.func's too), where the function is flat there; the
    where form was right. clamp now decomposes into wheres, whose untaken branches are guarded."""
    X = torch.tensor([[0.0, 0.0], [1.0, 0.5], [-0.3, 2.0]], dtype=torch.float64)
    got = hoad.compile(_pair_energy(True), order=2, mode=mode, backend="eager")(X)
    want = hoad.compile(_pair_energy(False), order=2, mode=mode, backend="eager")(X)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[0, 0]).all()
    assert_close(got[0], want[0], "gradient")
    assert_close(got[0, 0], want[0, 0], "Hessian")
    off = ~torch.eye(3, dtype=torch.bool)  # the same sum over i != j, by torch.func
    plain = lambda X: (lambda r: (torch.exp(-r) + 1 / r)[off].sum())(  # noqa: E731
        torch.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(-1) + torch.eye(3, dtype=X.dtype)))
    assert_close(got[0], jacrev(plain)(X), "gradient against torch.func")
    x = torch.tensor([0.0, 0.01, 0.5, 2.0], dtype=torch.float64)
    nan_bound = hoad.compile(lambda x: x.clamp(min=math.nan), order=1, mode=mode, backend="eager")(x)
    assert nan_bound.value.isnan().all()  # (torch's; the wheres gave x)
    for f in (lambda x: (x.sqrt() - 0.1).clamp(min=0).pow(2).sum(), lambda x: x.log().clamp(min=-5).exp().sum()):
        res = hoad.compile(f, order=2, mode=mode, backend="eager")(x)
        assert torch.isfinite(res[0]).all() and torch.isfinite(res[0, 0]).all(), res[0]
        assert_close(res[0][1:], jacrev(f)(x)[1:], "gradient away from 0")


def test_a_condition_computed_through_a_longer_chain_still_guards_its_branch():
    """where(((2/x + 1)·3 − 1) > 5, x, 1/x): the condition reads 1/x through four ops; the search
    for conditions stopped at three, left 1/x unguarded, and reverse mode gave NaN at x = 0 where
    the where takes x (derivative 1)."""
    f = lambda x: torch.where(((1 / x) * 2 + 1) * 3 - 1 > 5, x, 1 / x)  # noqa: E731
    x = torch.tensor([0.0, 2.0], dtype=torch.float64)
    got = hoad.compile(f, order=1, mode="reverse", backend="eager", batch_dim=0)(x)[0]
    assert_close(got, torch.tensor([1.0, -0.25], dtype=torch.float64), "per-sample derivative")
