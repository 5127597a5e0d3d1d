"""torch.nn's composite layers, as capture decomposes them (layer_norm, gelu, silu, linear, scaled
dot-product attention), and a small MLP of them, against nested torch.func in float64.

F.layer_norm's reference is the same maths in plain ops: native_layer_norm's double backward is
not differentiated correctly by forward AD on torch 2.13 (order >= 3), so hoad compiles the
library call and torch.func differentiates the maths written out.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand, reference
from torch.nn.attention import SDPBackend, sdpa_kernel

import hoad

W23 = rand(2, 3, seed=101)


def check_vs(f, ref_f, args, wrt=(0,), order=3):
    """hoad on ``f`` against torch.func on ``ref_f`` (the same function written in plain ops)."""
    res = hoad.compile(f, order=order, wrt=wrt)(*args)
    assert_close(res.value, ref_f(*args), "value")
    for K, expected in reference(ref_f, args, wrt, order).items():
        assert_close(res[tuple(wrt[k] for k in K)], expected, f"block {K}")
    return res


def _layer_norm_math(x, weight=None, bias=None, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) * (var + eps).rsqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def test_layer_norm_math_is_layer_norm():
    x = rand(2, 3)
    torch.testing.assert_close(_layer_norm_math(x), F.layer_norm(x, (3,)))


# ------------------------------------------------------------------------ composite layers
def test_layer_norm():
    check_vs(lambda x: (F.layer_norm(x, (3,)) * W23).sum(), lambda x: (_layer_norm_math(x) * W23).sum(),
             (rand(2, 3),), order=3)


def test_layer_norm_nonlinear_after():
    check_vs(lambda x: F.layer_norm(x, (3,)).sin(), lambda x: _layer_norm_math(x).sin(), (rand(2, 3),), order=3)


def test_layer_norm_affine_wrt_all():
    def f(x, g, b):
        return F.layer_norm(x, (3,), g, b).sin()

    def ref(x, g, b):
        return _layer_norm_math(x, g, b).sin()

    check_vs(f, ref, (rand(2, 3), rand(3, seed=5), rand(3, seed=6)), wrt=(0, 1, 2), order=2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    check(lambda x: F.gelu(x, approximate=approximate) * W23, (rand(2, 3),), order=4)


def test_silu():
    check(lambda x: (F.silu(x) * W23).sum(0), (rand(2, 3),), order=4)


def test_linear():
    def f(x, w, b):
        return F.linear(x, w, b).tanh()

    check(f, (rand(2, 3), rand(4, 3), rand(4)), wrt=(0, 1, 2), order=2)


def test_linear_without_bias():
    check(lambda x, w: F.linear(x.sin(), w).sum(), (rand(2, 3), rand(2, 3, seed=3)), wrt=(0, 1), order=3)


def _attention(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v)


def test_scaled_dot_product_attention_order_2():
    q, k, v = rand(1, 2, 3, seed=1), rand(1, 2, 3, seed=2), rand(1, 2, 3, seed=3)
    check(_attention, (q, k, v), wrt=(0, 1, 2), order=2)


def test_scaled_dot_product_attention_order_3():
    q, k, v = rand(1, 2, 3, seed=1), rand(1, 2, 3, seed=2), rand(1, 2, 3, seed=3)
    check(lambda q, k, v: (_attention(q, k, v) * W23).sum(), (q, k, v), wrt=(0,), order=3)


def test_small_mlp_with_layer_norm_and_softmax():
    W1, W2 = rand(3, 4, seed=51), rand(4, 3, seed=52)

    def f(x, norm=F.layer_norm):
        h = F.gelu(norm(x @ W1, (4,)))
        return (torch.softmax(h @ W2, -1) * W23).sum()

    check_vs(f, lambda x: f(x, norm=lambda t, _shape: _layer_norm_math(t)), (rand(2, 3),), order=2)
