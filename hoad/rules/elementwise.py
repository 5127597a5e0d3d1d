"""Elementwise nonlinear ops: each supplies its scalar derivatives φ', φ'', …; :func:`chain`
(Faà di Bruno) does the rest. Here the elementary functions (exp, log, powers and roots,
trigonometric and hyperbolic functions and their inverses) and the two-argument ops (pow, hypot,
copysign, fmax, fmin); the special functions are in :mod:`hoad.rules.special`.

A derivative function ``f(n, x, y, *args)`` returns ``[φ'(x), …, φ^(n)(x)]`` given the input
``x`` and the output ``y = φ(x)``; an entry of ``None`` is a structural zero (relu past the first
order, a polynomial past its degree), a Python number a constant.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from hoad.algebra import Block
from hoad.rules.arithmetic import _select, _select_vjp, _spread
from hoad.rules.base import Ctx, Jet, RuleTable, out_labels
from hoad.rules.combinators import (
    Scaled,
    broadcast,
    chain,
    leibniz,
    off_flat,
    scale_out,
    scaled,
    sum_blocks,
    unbroadcast,
)
from hoad.rules.flat import _either, unary

aten = torch.ops.aten
OPS = RuleTable("elementwise")


def elementwise_pair(derivs):
    """The rule and VJP of an elementwise op given by its scalar-derivative function."""

    def rule(ctx: Ctx, x: Jet, *args, **kwargs):
        return chain(ctx, x, derivs(ctx.max_order, x.primal, ctx.out, *args, **kwargs))

    def vjp(v, g: Block, x: Jet, *args, **kwargs):
        coeffs = derivs(1, x.primal, v.out, *args, **kwargs)
        (first,) = off_flat(x, [coeffs.plain(1)] if isinstance(coeffs, Scaled) else coeffs[:1])
        return [] if first is None else [(x, scale_out(g, first, x.shape))]

    rule.__name__ = rule.__qualname__ = derivs.__name__ + "_rule"
    vjp.__name__ = vjp.__qualname__ = derivs.__name__ + "_vjp"
    rule.derivatives = derivs  # type: ignore[attr-defined]
    return rule, vjp


def derivatives(*ops, table: RuleTable = OPS, flat=unary):
    """Register a scalar-derivative function as the elementwise rule, VJP and flat mask (by
    default: constant where the argument is) of ``ops`` in ``table`` (this module's;
    :mod:`hoad.rules.special` passes its own)."""

    def deco(derivs):
        rule, vjp = elementwise_pair(derivs)
        table.register(*ops, rule=rule, vjp=vjp, flat=flat)
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
    """φ^(k) = (-1)^(k-1) (k-1)! x^-k: the powers of 1/x on the factors (:class:`Scaled`)."""
    return Scaled([((-1) ** (k - 1)) * math.factorial(k - 1) for k in range(1, n + 1)], x.reciprocal())


@derivatives(aten.log1p.default)
def log1p(n, x, y):
    return Scaled([((-1) ** (k - 1)) * math.factorial(k - 1) for k in range(1, n + 1)], (x + 1).reciprocal())


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


def _power(n, x, y, p: float) -> Scaled:
    """Derivatives of y = x^p written with y: φ^(k) = p(p-1)…(p-k+1) · y · x^-k, as :class:`Scaled`
    by 1/x. For a fractional p, by 1/|x| and with |y|: x^(p-k) is +inf at -0.0 (IEEE pow)."""
    c = [_falling(p, k) for k in range(1, n + 1)]
    if p != int(p):
        x, y = x.abs(), y.abs()  # (x < 0 is NaN through y either way)
    return Scaled([None if ck == 0 else y * ck for ck in c], x.reciprocal())


def _root(n, x, y, p: float, signed: bool = False) -> Scaled:
    """Derivatives of y = x^p, 0 < p < 1: φ^(k) = c_k x^(p-k) = c_k (1/y)^(k-1) · (x^(p-1))^k, inf at
    0 as in torch (y · x^-k would be 0 · inf). +inf at -0.0 (IEEE pow), or, ``signed`` (sqrt), the
    sign torch's sqrt gives there (1/√-0 = -inf)."""
    r = y.reciprocal() if signed else y.abs().reciprocal()
    s = r if p == 0.5 else x.abs().pow(p - 1)
    return Scaled([_falling(p, 1)] + [_power_of(r, k - 1) * _falling(p, k) for k in range(2, n + 1)], s)


@derivatives(aten.sqrt.default)
def sqrt(n, x, y):
    return _root(n, x, y, 0.5, signed=True)


@derivatives(aten.rsqrt.default)
def rsqrt(n, x, y):
    """φ^(k) = c_k x^(-1/2 - k) = c_k y · (y²)^k: inf at 0 as in torch."""
    return Scaled([y * _falling(-0.5, k) for k in range(1, n + 1)], y * y)


@derivatives(aten.reciprocal.default)
def reciprocal(n, x, y):
    """φ^(k) = (-1)^k k! y^(k+1) = (-1)^k k! y · y^k."""
    return Scaled([y * _falling(-1, k) for k in range(1, n + 1)], y)


@derivatives(aten.pow.Tensor_Scalar)
def pow_scalar(n, x, y, exponent):
    p = float(exponent)
    if p < 0:  # (x^-6 of a small x: x^(p-k) itself overflows from some order on)
        return _power(n, x, y, p)
    if 0 < p < 1:  # (a norm's √: as sqrt's, inf at 0)
        return _root(n, x, y, p)
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


@derivatives(aten.relu.default, flat=lambda x: _either(x, ~(x.primal > 0)))  # (it chooses 0 below 0)
def relu(n, x, y):
    return [(x > 0).to(x.dtype)] + [None] * (n - 1)


@derivatives(aten.atan.default)
def atan(n, x, y) -> Scaled:
    """atan^(k) = P_k(x) / (1 + x²)^k with P_1 = 1, P_{k+1} = P_k' (1 + x²) - 2k x P_k. P_k has degree
    k - 1 and the parity of k - 1, so with s = (1 + x²)^-½ and t = x s (t² + s² = 1) it is
    s^(k+1) R_k(t), R_k(t) = Σ_i p_i t^i (1 - t²)^((k-1-i)/2): :class:`Scaled` by s, with |t| <= 1.
    (1 + x²)^-k underflows and P_k(x) overflows float16 from |x| ≈ 12.)"""
    s = (x * x + 1).rsqrt()
    t = x * s
    coeffs = []
    for p in _atan_polynomials(n):
        r = [0] * len(p)
        for i, c in enumerate(p):  # c t^i (1 - t²)^j, j = (k-1-i)/2, expanded
            j = (len(p) - 1 - i) // 2
            for m in range(j + 1):
                r[i + 2 * m] += c * math.comb(j, m) * (-1) ** m
        poly = _polynomial(r, t)
        coeffs.append(s if isinstance(poly, int) and poly == 1 else s * poly)
    return Scaled(coeffs, s)


def _atan_polynomials(n: int) -> list[list[int]]:
    """P_1 … P_n of :func:`atan` as coefficient lists (P_k of length k: its degree is k - 1)."""
    out, p = [], [1]
    for k in range(1, n + 1):
        out.append(p + [0] * (k - len(p)))
        dp = [i * c for i, c in enumerate(p)][1:] or [0]
        nxt = [0] * (max(len(dp) + 2, len(p) + 1))
        for i, c in enumerate(dp):
            nxt[i] += c
            nxt[i + 2] += c
        for i, c in enumerate(p):
            nxt[i + 1] -= 2 * k * c
        while len(nxt) > 1 and nxt[-1] == 0:
            nxt.pop()
        p = nxt
    return out


# --------------------------------------------------- inverse trigonometric and hyperbolic
def _algebraic(n: int, x: torch.Tensor, a: int, b: int, p: float, lead: int) -> list:
    """Derivatives of φ with φ' = lead · u^p, u = a + b x²: φ^(k) = P_k(x) · u^(p-k+1), where
    P_1 = lead and P_{k+1} = P_k' · u + 2b (p-k+1) x · P_k (integer polynomials for p = -1, -1/2)."""
    u = x * x * b + a
    q = u.reciprocal()
    s = q if p == -1 else u.rsqrt()  # u^p
    out, poly, power = [], [lead], s
    for k in range(1, n + 1):
        out.append(power if poly == [1] else power * _polynomial(poly, x))
        dp = [i * c for i, c in enumerate(poly)][1:] or [0]
        nxt = [0] * (len(poly) + 2)
        for i, c in enumerate(dp):  # P_k' · (a + b x²)
            nxt[i] += a * c
            nxt[i + 2] += b * c
        step = 2 * b * (p - k + 1)
        for i, c in enumerate(poly):  # + 2b (p-k+1) x P_k
            nxt[i + 1] += int(step * c) if float(step * c).is_integer() else step * c
        poly, power = nxt, power * q
    return out


@derivatives(aten.asin.default)
def asin(n, x, y):
    return _algebraic(n, x, 1, -1, -0.5, 1)  # (1 - x²)^(-1/2)


@derivatives(aten.acos.default)
def acos(n, x, y):
    return _algebraic(n, x, 1, -1, -0.5, -1)  # -(1 - x²)^(-1/2)


@derivatives(aten.asinh.default)
def asinh(n, x, y):
    return _algebraic(n, x, 1, 1, -0.5, 1)  # (1 + x²)^(-1/2)


@derivatives(aten.acosh.default)
def acosh(n, x, y):
    return _algebraic(n, x, -1, 1, -0.5, 1)  # (x² - 1)^(-1/2)


@derivatives(aten.atanh.default)
def atanh(n, x, y):
    return _algebraic(n, x, 1, -1, -1, 1)  # (1 - x²)^(-1)


# --------------------------------------------------------------------------- other bases
@derivatives(aten.log2.default)
def log2(n, x, y):
    d = log(n, x, y)
    return Scaled([c / math.log(2) for c in d.coeffs], d.scale)


@derivatives(aten.log10.default)
def log10(n, x, y):
    d = log(n, x, y)
    return Scaled([c / math.log(10) for c in d.coeffs], d.scale)


@derivatives(aten.exp2.default)
def exp2(n, x, y):
    return [y * math.log(2) ** k for k in range(1, n + 1)]


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


def pow_base_rule(ctx: Ctx, base, x: Jet):
    """c^x: φ^(k) = (log c)^k c^x."""
    zero = (x.primal >= 0) if base == 0 else None
    return chain(ctx, x, _exponential_coeffs(ctx.max_order, ctx.out, _log_of(base), zero))


def pow_base_vjp(v, g: Block, base, x: Jet):
    zero = (x.primal >= 0) if base == 0 else None
    return [(x, scale_out(g, _exponential_coeffs(1, v.out, _log_of(base), zero)[0], x.shape))]


OPS.register(aten.pow.Scalar, rule=pow_base_rule, vjp=pow_base_vjp)


def pow_tensor_rule(ctx: Ctx, a: Jet, b: Jet):
    """a^b: a power when b is constant, an exponential when a is, exp(b·log a) otherwise."""
    y = ctx.out
    if b.constant:
        return chain(ctx, broadcast(a, y.shape), _power_coeffs(ctx.max_order, a.primal, b.primal, y))
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
    # at a = 0, log a is -inf: there the derivatives are a power's in a alone (torch: those in b
    # are 0 for b >= 0, and so are the mixed ones for b > 1)
    plain = replace(ctx, adjoint=None)
    power = chain(plain, broadcast(a, shape), _power_coeffs(ctx.max_order, a.primal, b.primal, y))
    zero = (a.primal == 0).expand(shape)
    return _select(plain, [(Jet(y, chain(plain, z, [y] * ctx.max_order)), ~zero), (Jet(y, power), zero)])


def pow_tensor_vjp(v, g: Block, a: Jet, b: Jet):
    """As torch: ∂/∂a = b a^(b-1), 0 where b = 0; ∂/∂b = a^b log a, taken as 0 where a = 0 and b >= 0."""
    y, r, shape = v.out, v.out.ndim, tuple(v.out.shape)
    pairs = []
    if not a.constant:
        coeff = torch.where(b.primal == 0, torch.zeros_like(y), b.primal * a.primal.pow(b.primal - 1))
        pairs.append((a, unbroadcast(scale_out(g, coeff, shape), r, a.shape)))
    if not b.constant:
        coeff = torch.where((a.primal == 0) & (b.primal >= 0), torch.zeros_like(y), y * a.primal.log())
        pairs.append((b, unbroadcast(scale_out(g, coeff, shape), r, b.shape)))
    return pairs


OPS.register(aten.pow.Tensor_Tensor, rule=pow_tensor_rule, vjp=pow_tensor_vjp)


def _power_coeffs(n: int, a: torch.Tensor, p, y: torch.Tensor) -> list:
    """The derivatives p(p-1)…(p-k+1) a^(p-k) of a^p, with 0 where that factor is (at a = 0
    torch's, not 0 · inf as y · a^-k would make them)."""
    coeffs, falling = [], p
    for k in range(1, n + 1):
        c = torch.where(falling == 0, torch.zeros((), dtype=y.dtype, device=y.device), falling * a.pow(p - k))
        coeffs.append(c.expand(y.shape))
        falling = falling * (p - k)
    return coeffs


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


# --------------------------------------------------------------------- two arguments
def _varies(x) -> bool:
    return isinstance(x, Jet) and not x.constant


def _value(x):
    return x.primal if isinstance(x, Jet) else x


def hypot_rule(ctx: Ctx, a, b):
    """hypot(a, b) = √u with u = a² + b²: u by Leibniz, then the square root's derivatives."""
    shape = tuple(ctx.out.shape)
    o = out_labels(len(shape))
    u = ctx.out * ctx.out
    inner = ctx.inner(u)
    squares = [leibniz(inner, [(broadcast(t, shape), o)] * 2, o, shape) for t in (a, b) if _varies(t)]
    return chain(ctx, Jet(u, sum_blocks(*squares)), _power(ctx.max_order, u, ctx.out, 0.5))


def hypot_vjp(v, g: Block, a, b):
    return _spread(v, g, [(a, _value(a) / v.out), (b, _value(b) / v.out)])


OPS.register(aten.hypot.default, rule=hypot_rule, vjp=hypot_vjp)


def _copysign_coeff(a, out: torch.Tensor) -> torch.Tensor:
    """∂ copysign(a, b) / ∂a: +1 where a already has the output's sign, -1 where not, 0 at a = 0 (torch)."""
    va = _value(a)
    same = (va.signbit() == out.signbit()).to(out.dtype)
    return (same * 2 - 1) * (va != 0).to(out.dtype)


def copysign_rule(ctx: Ctx, a: Jet, b):
    """|a| with the sign of b: ±a, linear in a piecewise; constant in b."""
    return scaled(ctx, a, _copysign_coeff(a, ctx.out), tuple(ctx.out.shape)) if _varies(a) else {}


def copysign_vjp(v, g: Block, a, b):
    return _spread(v, g, [(a, _copysign_coeff(a, v.out))])


OPS.register(aten.copysign.Tensor, aten.copysign.Scalar, rule=copysign_rule, vjp=copysign_vjp)


def _nan_max_take_a(a, b, larger: bool) -> torch.Tensor:
    """Where fmax (fmin) takes a, as torch's backward assigns it: ties and a NaN b go to a."""
    va, vb = _value(a), _value(b)
    return (va >= vb if larger else va <= vb) | vb.isnan()


def fmax_rule(ctx: Ctx, a, b):
    take = _nan_max_take_a(a, b, larger=True)
    return _select(ctx, [(a, take), (b, ~take)])


def fmax_vjp(v, g: Block, a, b):
    take = _nan_max_take_a(a, b, larger=True)
    return _select_vjp(v, g, [(a, take), (b, ~take)])


OPS.register(aten.fmax.default, rule=fmax_rule, vjp=fmax_vjp)


def fmin_rule(ctx: Ctx, a, b):
    take = _nan_max_take_a(a, b, larger=False)
    return _select(ctx, [(a, take), (b, ~take)])


def fmin_vjp(v, g: Block, a, b):
    take = _nan_max_take_a(a, b, larger=False)
    return _select_vjp(v, g, [(a, take), (b, ~take)])


OPS.register(aten.fmin.default, rule=fmin_rule, vjp=fmin_vjp)


