"""Special functions: the error function and its relatives (erf, erfc, erfcx, erfinv, ndtri,
log_ndtr), entr and sinc, the gamma family (lgamma, digamma, polygamma) and the modified Bessel
functions (i0, i0e, i1, i1e).

Elementwise ops like those of :mod:`hoad.rules.elementwise`, registered the same way (each gives
its scalar derivatives φ', φ'', …; :func:`chain` does the rest), in this module's own tables.
"""

from __future__ import annotations

import math

import torch

from hoad.algebra import Block
from hoad.rules import elementwise
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import chain, scale_out
from hoad.rules.elementwise import _polynomial, _power_of

aten = torch.ops.aten
OPS = RuleTable("elementwise")


def derivatives(*ops):
    """Register a scalar-derivative function as the elementwise rule, VJP and flat mask of ``ops`` here."""
    return elementwise.derivatives(*ops, table=OPS)


# ------------------------------------------------------------------ error function family
@derivatives(aten.erf.default)
def erf(n, x, y):
    """erf^(k) = (2/√π) (-1)^(k-1) H_{k-1}(x) exp(-x²). The Hermite polynomial takes x clamped to where
    exp(-x²) underflows to 0 in its dtype (float16 from |x| ≈ 4.2): beyond, H_{k-1}(x) overflows and
    0 · inf would be NaN where the derivative is 0."""
    g = (-x * x).exp() * (2 / math.sqrt(math.pi))
    info = torch.finfo(x.dtype)
    edge = math.sqrt(-math.log(info.tiny * info.eps)) + 0.5
    x = x.clamp(-edge, edge)
    out, h_prev, h = [], None, None  # physicists' Hermite polynomials H_{k-1}(x)
    for k in range(1, n + 1):
        if k == 1:
            h = 1
        elif k == 2:
            h_prev, h = h, 2 * x
        else:
            h_prev, h = h, 2 * x * h - 2 * (k - 2) * h_prev
        out.append(g * (h if (k - 1) % 2 == 0 else -h))
    return out


@derivatives(aten.erfc.default)
def erfc(n, x, y):
    return [-d for d in erf(n, x, y)]


@derivatives(aten.special_erfcx.default)
def erfcx(n, x, y):
    """erfcx = exp(x²) erfc(x): y' = 2x y - 2/√π, then y^(k+1) = 2x y^(k) + 2k y^(k-1)."""
    out = [2 * x * y - 2 / math.sqrt(math.pi)]
    for k in range(1, n):
        out.append(2 * x * out[-1] + 2 * k * (y if k == 1 else out[-2]))
    return out


def _inverse_gaussian(n: int, y: torch.Tensor, c: float, a: float) -> list:
    """Derivatives of y with y' = c · exp(a y²) (erfinv, ndtri): y^(k) = (c e^{a y²})^k Q_k(y),
    Q_1 = 1, Q_{k+1} = Q_k' + 2ak y Q_k."""
    e = (y * y * a).exp() * c
    out, poly, power = [], [1], e
    for k in range(1, n + 1):
        out.append(power if poly == [1] else power * _polynomial(poly, y))
        nxt = ([i * c for i, c in enumerate(poly)][1:] or [0]) + [0, 0]
        for i, c in enumerate(poly):
            nxt[i + 1] += int(2 * a * k) * c
        poly, power = nxt, power * e
    return out


@derivatives(aten.erfinv.default)
def erfinv(n, x, y):
    return _inverse_gaussian(n, y, math.sqrt(math.pi) / 2, 1)  # y' = √π/2 · exp(y²)


@derivatives(aten.special_ndtri.default)
def ndtri(n, x, y):
    return _inverse_gaussian(n, y, math.sqrt(2 * math.pi), 0.5)  # y' = √(2π) · exp(y²/2)


@derivatives(aten.special_log_ndtr.default)
def log_ndtr(n, x, y):
    """y = log Φ(x): y' = r = φ(x)/Φ(x) = exp(-x²/2 - y)/√(2π), and r' = -x·r - r², so each
    derivative is a polynomial in x and r (no Φ(x) is formed: exact deep in the left tail)."""
    r = torch.exp(-0.5 * x * x - y) / math.sqrt(2 * math.pi)
    poly = {(0, 1): 1}  # {(i, j): c}: Σ c·x^i·r^j
    out = []
    for _ in range(n):
        out.append(sum(c * x.pow(i) * r.pow(j) for (i, j), c in poly.items()))
        nxt: dict = {}
        for (i, j), c in poly.items():  # d/dx x^i r^j = i x^(i-1) r^j + j x^i r^(j-1) (-x r - r²)
            for key, v in (((i - 1, j), c * i), ((i + 1, j), -c * j), ((i, j + 1), -c * j)):
                if v:
                    nxt[key] = nxt.get(key, 0) + v
        poly = nxt
    return out


# ---------------------------------------------------------------------- entr and sinc
@derivatives(aten.special_entr.default)
def entr(n, x, y):
    """-x log x: φ' = -(1 + log x), φ^(k) = (-1)^(k-1) (k-2)! x^(1-k) from k = 2 (torch's formula,
    so +inf at 0 and NaN below 0, where the decomposition's ``where`` would give 0)."""
    out = [-(x.log() + 1)]
    r = x.reciprocal()
    for k in range(2, n + 1):
        out.append(_power_of(r, k - 1) * ((-1) ** (k - 1) * math.factorial(k - 2)))
    return out


@derivatives(aten.sinc.default)
def sinc(n, x, y):
    """sin(πx)/(πx) with g(t) = sin(t)/t, t = πx: φ^(k) = π^k g^(k)(t). For |t| >= 1 by Leibniz,
    g^(k) = Σ_j C(k,j) sin(t + jπ/2) (-1)^(k-j) (k-j)! t^(j-k-1); below, where that cancels (and
    at 0, where it divides by zero), by the series g^(k) = Σ_m (-1)^m (2m)!/((2m-k)! (2m+1)!)
    t^(2m-k): 14 terms reach float64 rounding for |t| < 1. sinc''(0) = -π²/3, where the core
    decomposition's where() gave 0 (and NaN in reverse mode)."""
    t = x * math.pi
    small = t.abs() < 1
    far = torch.where(small, torch.ones_like(t), t)    # the closed form's argument, 1 where unused
    near = torch.where(small, t, torch.zeros_like(t))  # the series' argument, 0 where unused
    inverse = far.reciprocal()
    out = []
    for k in range(1, n + 1):
        closed = sum(math.comb(k, j) * (-1) ** (k - j) * math.factorial(k - j) * torch.sin(far + j * math.pi / 2)
                     * _power_of(inverse, k - j + 1) for j in range(k + 1))
        first = (k + 1) // 2
        series = sum((-1) ** m * math.factorial(2 * m) / (math.factorial(2 * m - k) * math.factorial(2 * m + 1))
                     * (near ** (2 * m - k) if 2 * m > k else torch.ones_like(near)) for m in range(first, first + 14))
        out.append(torch.where(small, series, closed) * math.pi ** k)
    return out


# ------------------------------------------------------------------------- gamma family
@derivatives(aten.lgamma.default)
def lgamma(n, x, y):
    return [torch.special.polygamma(k - 1, x) for k in range(1, n + 1)]


@derivatives(aten.digamma.default)
def digamma(n, x, y):
    return [torch.special.polygamma(k, x) for k in range(1, n + 1)]


def polygamma_rule(ctx: Ctx, m: int, x: Jet):
    """The k-th derivative of polygamma(m, ·) is polygamma(m + k, ·)."""
    return chain(ctx, x, [torch.special.polygamma(m + k, x.primal) for k in range(1, ctx.max_order + 1)])


def polygamma_vjp(v, g: Block, m: int, x: Jet):
    return [(x, scale_out(g, torch.special.polygamma(m + 1, x.primal), x.shape))]


OPS.register(aten.polygamma.default, rule=polygamma_rule, vjp=polygamma_vjp)


# ------------------------------------------------------------- modified Bessel functions
def _bessel_i(n_max: int, x: torch.Tensor, scaled: bool) -> list:
    """[I_0(x), …, I_{n_max}(x)], times e^{-|x|} when ``scaled``.

    torch has I_0 and I_1 only. I_m for m >= 2 comes from the upward recurrence
    I_m = I_{m-2} - 2(m-1)/x · I_{m-1} where |x| >= max(2, m) (it loses accuracy near 0), and
    from the power series Σ_j (x/2)^{2j+m} / (j! (j+m)!) (24 terms) below that.
    """
    out = [torch.special.i0e(x) if scaled else torch.special.i0(x),
           torch.special.i1e(x) if scaled else torch.special.i1(x)]
    for m in range(2, n_max + 1):
        bound = max(2.0, float(m))
        small = x.abs() < bound
        # each branch sees safe inputs only, so neither makes inf or NaN where it is not taken
        r = torch.where(small, bound, x).reciprocal()
        upward = out[m - 2] - out[m - 1] * r * (2 * (m - 1))
        t = torch.where(small, x, 0.0) * 0.5
        t2, acc = t * t, None
        for j in reversed(range(24)):
            c = 1 / (math.factorial(j) * math.factorial(j + m))
            acc = c if acc is None else acc * t2 + c
        series = acc * _power_of(t, m)
        if scaled:
            series = series * (t.abs() * -2).exp()
        out.append(torch.where(small, series, upward))
    return out[: n_max + 1]


def _bessel_derivatives(n: int, x: torch.Tensor, order: int, scaled: bool) -> list:
    """Derivatives 1..n of I_order (0 or 1), or of e^{-|x|} I_order when ``scaled``.

    I_m' = (I_{m-1} + I_{m+1}) / 2 with I_{-m} = I_m, so I^(k) = 2^-k Σ_j C(k,j) I_{|order+k-2j|};
    the scaled one is Σ_j C(k,j) (-sign x)^(k-j) e^{-|x|} I^(j) by Leibniz (sign 0 at 0, as torch).
    """
    bessel = _bessel_i(n + order, x, scaled)

    def plain(k):  # e^{-|x|}-scaled or not, the k-th derivative of I_order itself
        acc = None
        for j in range(k + 1):
            term = bessel[order + k - 2 * j if order + k >= 2 * j else 2 * j - order - k] * (math.comb(k, j) / 2**k)
            acc = term if acc is None else acc + term
        return acc

    if not scaled:
        return [plain(k) for k in range(1, n + 1)]
    s = -x.sign()
    terms = [bessel[order]] + [plain(j) for j in range(1, n + 1)]
    out = []
    for k in range(1, n + 1):
        acc = terms[k]
        for j in range(k):
            acc = acc + terms[j] * _power_of(s, k - j) * math.comb(k, j)
        out.append(acc)
    return out


@derivatives(aten.i0.default)
def i0(n, x, y):
    return _bessel_derivatives(n, x, 0, scaled=False)


@derivatives(aten.special_i0e.default)
def i0e(n, x, y):
    return _bessel_derivatives(n, x, 0, scaled=True)


@derivatives(aten.special_i1.default)
def i1(n, x, y):
    return _bessel_derivatives(n, x, 1, scaled=False)


@derivatives(aten.special_i1e.default)
def i1e(n, x, y):
    return _bessel_derivatives(n, x, 1, scaled=True)
