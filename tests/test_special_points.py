"""Elementwise ops at the points where their formulas have seams: exact zeros, ±1, ±0.5, ±2 and
ties between two arguments, orders 1-3, both directions, against nested torch.func.

Random samples (the OpInfo sweep) never land on these points, and there a decomposition whose
kinks cancel in value only (log σ as min(0, x) - log1p(e^-|x|), d² as |d|²) or a formula with 0 · inf
gives a wrong derivative. Only the diagonal of each derivative tensor is compared (torch.func's
off-diagonals are 0 · inf = NaN at poles); an entry is accepted when both are non-finite.
"""

import pytest
import torch
from torch.func import jacfwd, jacrev
from torch.testing._internal.common_methods_invocations import binary_ufuncs, op_db, unary_ufuncs

import hoad

pytestmark = pytest.mark.slow

DT = torch.float64
POINTS = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0], dtype=DT)
A = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0, 0.0, 1.0, -2.0], dtype=DT)
B = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0, 1.0, 0.0, 3.0], dtype=DT)  # ties in the first five
WEIGHTS = torch.linspace(0.3, 1.7, 8, dtype=DT)

UNARY_EXTRA = {"nn.functional.logsigmoid", "nn.functional.softplus", "nn.functional.silu", "nn.functional.mish",
               "nn.functional.gelu", "nn.functional.elu", "nn.functional.celu", "nn.functional.selu",
               "nn.functional.softsign", "nn.functional.tanhshrink", "nn.functional.hardshrink",
               "nn.functional.softshrink", "special.log_ndtr", "special.ndtr", "special.erfcx", "special.i0e",
               "special.i1", "special.i1e", "special.entr"}
BINARY_EXTRA = {"logaddexp", "logaddexp2", "atan2", "hypot", "maximum", "minimum", "fmax", "fmin", "copysign",
                "xlogy", "special.xlog1py", "nextafter", "pow", "float_power", "remainder", "fmod",
                "nn.functional.binary_cross_entropy_with_logits", "nn.functional.soft_margin_loss",
                "nn.functional.huber_loss", "nn.functional.smooth_l1_loss", "nn.functional.l1_loss",
                "nn.functional.mse_loss"}

# where torch.func is the one that is off (checked against the series or the plain maths), or
# hoad differs on purpose
KNOWN = {
    "sinc": "torch's sinc backward is 0 at 0 at every order; sinc''(0) = -π²/3 (hoad's series)",
    "special.i1": "I1'''(0) = 3/8 from I1(x) = x/2 + x³/16 + …; torch.func gives 0",
    "special.i1e": "e^-|x| I1(x) is not three times differentiable at 0; torch.func gives 0, hoad I1's 3/8",
    "xlogy[1]": "∂ xlogy(0, y)/∂y at y = 0: torch 0/0 = NaN, hoad 0 (xlogy(0, ·) is 0 everywhere)",
    "atan2[0]": "at the origin the angle is discontinuous: hoad NaN at every order, torch 0 at order 1",
    "atan2[1]": "at the origin the angle is discontinuous: hoad NaN at every order, torch 0 at order 1",
    "logit": "outside [0, 1] the value is NaN; torch's derivative is NaN there too, hoad's is 1/(x(1-x))",
}


def _ops(base, extra):
    seen, out = set(), []
    for op in base + [o for o in op_db if o.name in extra]:
        if op.name in seen or op.name.startswith("_refs") or not op.supports_dtype(DT, "cpu"):
            continue
        if op.name in ("bfloat16", "half"):  # casts to a lower precision: their derivative is rounded
            continue
        seen.add(op.name)
        out.append(op)
    return out


def _close(got, ref) -> bool:
    finite = torch.isfinite(got)
    return torch.equal(finite, torch.isfinite(ref)) and torch.allclose(got[finite], ref[finite], rtol=1e-7,
                                                                       atol=1e-7)


def _compare(name, f, args, wrt):
    try:
        refs, g = [], jacrev(f, argnums=wrt)
        refs.append(g(*args))
        for _ in range(2):
            g = jacfwd(g, argnums=wrt)
            refs.append(g(*args))
    except Exception:  # noqa: BLE001 - no torch.func reference (no forward AD, ...)
        pytest.skip("no torch.func reference")
    idx = torch.arange(8)
    for mode in ("forward", "reverse"):
        try:
            res = hoad.compile(f, order=3, wrt=wrt, backend="eager", mode=mode)(*args)
        except hoad.UnsupportedOperatorError:
            pytest.skip("unsupported")
        for k, ref in enumerate(refs, 1):
            got = res[(wrt,) * k]
            assert _close(got[(idx,) * k], ref[(idx,) * k]), (
                f"{name} {mode} order {k}:\n torch {ref[(idx,) * k].tolist()}\n hoad  {got[(idx,) * k].tolist()}")


@pytest.mark.parametrize("op", _ops(unary_ufuncs, UNARY_EXTRA), ids=lambda op: op.name)
def test_unary_at_special_points(op):
    if op.name in KNOWN:
        pytest.skip(KNOWN[op.name])
    _compare(op.name, lambda x: (op.op(x) * WEIGHTS).sum(), (POINTS.clone(),), 0)


@pytest.mark.parametrize("wrt", [0, 1])
@pytest.mark.parametrize("op", _ops(binary_ufuncs, BINARY_EXTRA), ids=lambda op: op.name)
def test_binary_at_special_points_and_ties(op, wrt):
    if f"{op.name}[{wrt}]" in KNOWN:
        pytest.skip(KNOWN[f"{op.name}[{wrt}]"])

    def f(a, b):
        out = op.op(a, b)
        return (out * WEIGHTS).sum() if out.ndim else out

    try:
        f(A, B)
    except Exception:  # noqa: BLE001 - integer-only ops, and the like
        pytest.skip("does not take these float64 arguments")
    _compare(op.name, f, (A.clone(), B.clone()), wrt)
