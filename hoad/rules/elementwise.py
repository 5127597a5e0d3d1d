"""Elementwise nonlinear ops: each supplies its scalar derivatives φ', φ'', …; :func:`chain`
(Faà di Bruno) does the rest.

A derivative function ``f(n, x, y, *args)`` returns ``[φ'(x), …, φ^(n)(x)]`` given the input
``x`` and the output ``y = φ(x)``; an entry of ``None`` is a structural zero (relu past the first
order, a polynomial past its degree), a Python number a constant.
"""

from __future__ import annotations

import math

import torch

from hoad.rules.base import Ctx, Jet, RuleTable, out_labels
from hoad.algebra import Block
from hoad.rules.combinators import broadcast, chain, leibniz, scale_out, unbroadcast

aten = torch.ops.aten
RULES = RuleTable("elementwise")
VJPS = RuleTable("elementwise")


def derivatives(*ops):
    """Register a scalar-derivative function as the elementwise rule (and VJP) of ``ops``."""

    def deco(derivs):
        def rule(ctx: Ctx, x: Jet, *args, **kwargs):
            return chain(ctx, x, derivs(ctx.max_order, x.primal, ctx.out, *args, **kwargs))

        def vjp(v, g: Block, x: Jet, *args, **kwargs):
            first = derivs(1, x.primal, v.out, *args, **kwargs)[0]
            return [] if first is None else [(x, scale_out(g, first, x.shape))]

        rule.__name__ = rule.__qualname__ = derivs.__name__ + "_rule"
        vjp.__name__ = vjp.__qualname__ = derivs.__name__ + "_vjp"
        rule.derivatives = derivs  # type: ignore[attr-defined]
        RULES.register(*ops)(rule)
        VJPS.register(*ops)(vjp)
        return derivs

    return deco


# ------------------------------------------------------------------------ polynomial helpers
def _poly_chain(n: int, step: list[int]) -> list[list[int]]:
    """Derivatives of y as polynomials in y, when y' = step(y): P_{k+1} = P_k' · step."""
    polys, p = [], [0, 1]
    for _ in range(n):
        dp = [i * c for i, c in enumerate(p)][1:] or [0]
        q = [0] * (len(dp) + len(step) - 1)
        for i, a in enumerate(dp):
            for j, b in enumerate(step):
                q[i + j] += a * b
        while len(q) > 1 and q[-1] == 0:
            q.pop()
        polys.append(q)
        p = q
    return polys


def _falling(p: float, k: int) -> float:
    """p (p-1) … (p-k+1)."""
    out = 1.0
    for j in range(k):
        out *= p - j
    return out


def _power_of(r: torch.Tensor, k: int) -> torch.Tensor:
    out = r
    for _ in range(k - 1):
        out = out * r
    return out


# ---------------------------------------------------------------------------------- the ops
@derivatives(aten.exp.default)
def exp(n, x, y):
    return [y] * n


@derivatives(aten.expm1.default)
def expm1(n, x, y):
    e = y + 1
    return [e] * n


@derivatives(aten.log.default)
def log(n, x, y):
    r = x.reciprocal()
    return [((-1) ** (k - 1)) * math.factorial(k - 1) * _power_of(r, k) for k in range(1, n + 1)]


@derivatives(aten.log1p.default)
def log1p(n, x, y):
    r = (x + 1).reciprocal()
    return [((-1) ** (k - 1)) * math.factorial(k - 1) * _power_of(r, k) for k in range(1, n + 1)]


@derivatives(aten.sin.default)
def sin(n, x, y):
    c = x.cos()
    cycle = [c, -y, -c, y]
    return [cycle[k % 4] for k in range(n)]


@derivatives(aten.cos.default)
def cos(n, x, y):
    s = x.sin()
    cycle = [-s, -y, s, y]
    return [cycle[k % 4] for k in range(n)]


@derivatives(aten.sinh.default)
def sinh(n, x, y):
    c = x.cosh()
    return [c if k % 2 == 0 else y for k in range(n)]


@derivatives(aten.cosh.default)
def cosh(n, x, y):
    s = x.sinh()
    return [s if k % 2 == 0 else y for k in range(n)]


def _autonomous(n: int, y: torch.Tensor, step: list[int]) -> list:
    """Derivatives of y when y' = step(y): φ' = step(y), φ^(k+1) = P_k'(y) · φ'."""
    polys = _poly_chain(n, step)
    first = _polynomial(step, y)
    out = [first]
    for p in polys[:-1]:
        dp = [i * c for i, c in enumerate(p)][1:] or [0]
        q = _polynomial(dp, y)
        out.append(None if q is None else q * first)
    return out


@derivatives(aten.tanh.default)
def tanh(n, x, y):
    return _autonomous(n, y, [1, 0, -1])  # y' = 1 - y²


@derivatives(aten.sigmoid.default)
def sigmoid(n, x, y):
    return _autonomous(n, y, [0, 1, -1])  # y' = y - y²


@derivatives(aten.tan.default)
def tan(n, x, y):
    return _autonomous(n, y, [1, 0, 1])  # y' = 1 + y²


@derivatives(aten.erf.default)
def erf(n, x, y):
    g = (-x * x).exp() * (2 / math.sqrt(math.pi))
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


def _power(n, x, y, p: float):
    """Derivatives of y = x^p written with y: φ^(k) = p(p-1)…(p-k+1) · y · x^-k."""
    out, r = [], None
    for k in range(1, n + 1):
        c = _falling(p, k)
        if c == 0:
            out.append(None)
            continue
        r = x.reciprocal() if r is None else r
        out.append(y * _power_of(r, k) * c)
    return out


@derivatives(aten.sqrt.default)
def sqrt(n, x, y):
    return _power(n, x, y, 0.5)


@derivatives(aten.rsqrt.default)
def rsqrt(n, x, y):
    return _power(n, x, y, -0.5)


@derivatives(aten.reciprocal.default)
def reciprocal(n, x, y):
    return [_falling(-1, k) * _power_of(y, k + 1) for k in range(1, n + 1)]


@derivatives(aten.pow.Tensor_Scalar)
def pow_scalar(n, x, y, exponent):
    p = float(exponent)
    out = []
    for k in range(1, n + 1):
        c = _falling(p, k)
        if c == 0:
            out.append(None)  # polynomial past its degree: structural zero
        elif p - k == 0:
            out.append(c)
        elif p - k == 1:
            out.append(x * c)
        else:
            out.append(x.pow(p - k) * c)
    return out


@derivatives(aten.abs.default)
def abs(n, x, y):
    return [x.sign()] + [None] * (n - 1)


@derivatives(aten.relu.default)
def relu(n, x, y):
    return [(x > 0).to(x.dtype)] + [None] * (n - 1)


@derivatives(aten.clamp.default)
def clamp(n, x, y, min=None, max=None):
    mask = torch.ones_like(x, dtype=torch.bool)
    if min is not None:
        mask = mask & (x >= min)
    if max is not None:
        mask = mask & (x <= max)
    return [mask.to(x.dtype)] + [None] * (n - 1)


@derivatives(aten.atan.default)
def atan(n, x, y):
    """atan^(k) = P_k(x) / (1 + x²)^k with P_1 = 1, P_{k+1} = P_k' (1 + x²) - 2k x P_k."""
    q = (x * x + 1).reciprocal()
    out, p, qk = [], [1], q
    for k in range(1, n + 1):
        out.append(qk if p == [1] else _polynomial(p, x) * qk)
        dp = [i * c for i, c in enumerate(p)][1:] or [0]
        nxt = [0] * (max(len(dp) + 2, len(p) + 1))
        for i, c in enumerate(dp):
            nxt[i] += c
            nxt[i + 2] += c
        for i, c in enumerate(p):
            nxt[i + 1] -= 2 * k * c
        while len(nxt) > 1 and nxt[-1] == 0:
            nxt.pop()
        p, qk = nxt, qk * q
    return out


@derivatives(aten.special_entr.default)
def entr(n, x, y):
    """-x log x: φ' = -(1 + log x), φ^(k) = (-1)^(k-1) (k-2)! x^(1-k) from k = 2 (torch's formula,
    so +inf at 0 and NaN below 0, where the decomposition's ``where`` would give 0)."""
    out = [-(x.log() + 1)]
    r = x.reciprocal()
    for k in range(2, n + 1):
        out.append(_power_of(r, k - 1) * ((-1) ** (k - 1) * math.factorial(k - 2)))
    return out


def _log_of(c: float) -> float:
    """log c for a Python number, as torch computes it: -inf at 0, NaN below."""
    return math.log(c) if c > 0 else (-math.inf if c == 0 else math.nan)


def _exponential_coeffs(n: int, y: torch.Tensor, log_c, at_zero_base: torch.Tensor | None) -> list:
    """φ^(k) = (log c)^k c^x for c^x; where the base is 0 and the exponent >= 0, torch takes the
    derivative as 0 (``at_zero_base``), not 0 · (-inf)^k."""
    coeffs = [y * log_c**k if not isinstance(log_c, torch.Tensor) else y * _power_of(log_c, k) for k in range(1, n + 1)]
    if at_zero_base is None:
        return coeffs
    return [torch.where(at_zero_base, torch.zeros((), dtype=y.dtype, device=y.device), c) for c in coeffs]


@RULES.register(aten.pow.Scalar)
def pow_base_rule(ctx: Ctx, base, x: Jet):
    """c^x: φ^(k) = (log c)^k c^x."""
    zero = (x.primal >= 0) if base == 0 else None
    return chain(ctx, x, _exponential_coeffs(ctx.max_order, ctx.out, _log_of(base), zero))


@RULES.register(aten.pow.Tensor_Tensor)
def pow_tensor_rule(ctx: Ctx, a: Jet, b: Jet):
    """a^b: a power when b is constant, an exponential when a is, exp(b·log a) otherwise."""
    y = ctx.out
    if b.constant:
        p = b.primal
        coeffs, r = [], a.primal.reciprocal()
        falling = p
        for k in range(1, ctx.max_order + 1):
            coeffs.append(y * falling * _power_of(r, k))
            falling = falling * (p - k)
        return chain(ctx, broadcast(a, y.shape), [c.expand(y.shape) for c in coeffs])
    log_a = a.primal.log()
    if a.constant:
        lb = log_a.expand(y.shape)
        zero = ((a.primal == 0) & (b.primal >= 0)).expand(y.shape)
        return chain(ctx, broadcast(b, y.shape), _exponential_coeffs(ctx.max_order, y, lb, zero))
    # both vary: a^b = exp(b · log a), composed from the log, product and exp rules
    inner = ctx.inner(log_a)
    la = Jet(log_a, chain(inner, a, log(inner.max_order, a.primal, log_a)))
    shape = tuple(y.shape)
    o = out_labels(len(shape))
    exponent = ctx.inner((b.primal * log_a).expand(shape))
    z = Jet(exponent.out, leibniz(exponent, [(broadcast(b, shape), o), (broadcast(la, shape), o)], o, shape))
    return chain(ctx, z, [y] * ctx.max_order)


def _polynomial(coeffs: list[int], y: torch.Tensor):
    """Σ coeffs[i] y^i; None for the zero polynomial, a number for a constant one.

    Even and odd polynomials are evaluated in y² (one shared square), and Horner's steps fold
    ±1 coefficients into additions, so 1 - y² costs two ops.
    """
    while len(coeffs) > 1 and coeffs[-1] == 0:
        coeffs = coeffs[:-1]
    if all(c == 0 for c in coeffs):
        return None
    if len(coeffs) == 1:
        return coeffs[0]
    odd = all(c == 0 for c in coeffs[0::2])
    even = all(c == 0 for c in coeffs[1::2])
    if odd or even:
        inner = _horner(coeffs[1::2] if odd else coeffs[0::2], y * y)
        return inner * y if odd else inner
    return _horner(coeffs, y)


def _horner(coeffs: list[int], z: torch.Tensor):
    """Horner in z: ((c_d z + c_{d-1}) z + …) + c_0, with ±1 folded into signs."""
    acc, sign = coeffs[-1], 1  # acc: a number, or a tensor carrying ``sign``
    for c in reversed(coeffs[:-1]):
        if isinstance(acc, torch.Tensor):
            term, tsign = acc * z, sign
        elif acc in (1, -1):
            term, tsign = z, acc
        else:
            term, tsign = z * acc, 1
        if c == 0:
            acc, sign = term, tsign
        else:
            acc, sign = (term + c if tsign > 0 else c - term), 1
    if isinstance(acc, torch.Tensor) and sign < 0:
        acc = -acc
    return acc


@VJPS.register(aten.pow.Scalar)
def pow_base_vjp(v, g: Block, base, x: Jet):
    zero = (x.primal >= 0) if base == 0 else None
    return [(x, scale_out(g, _exponential_coeffs(1, v.out, _log_of(base), zero)[0], x.shape))]


@VJPS.register(aten.pow.Tensor_Tensor)
def pow_tensor_vjp(v, g: Block, a: Jet, b: Jet):
    """As torch: ∂/∂a = b a^(b-1); ∂/∂b = a^b log a, taken as 0 where a = 0 and b >= 0."""
    y, r, shape = v.out, v.out.ndim, tuple(v.out.shape)
    pairs = []
    if not a.constant:
        pairs.append((a, unbroadcast(scale_out(g, b.primal * a.primal.pow(b.primal - 1), shape), r, a.shape)))
    if not b.constant:
        coeff = torch.where((a.primal == 0) & (b.primal >= 0), torch.zeros_like(y), y * a.primal.log())
        pairs.append((b, unbroadcast(scale_out(g, coeff, shape), r, b.shape)))
    return pairs
