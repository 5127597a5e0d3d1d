"""The classes of functions an eager grad_fn-walking engine (thoad) gets silently wrong
(DESIGN.md §7), each against nested torch.func in float64 at orders up to 4.

Where torch.func's own higher derivatives are wrong, the reference is the closed form instead:
``prod`` at an exact zero (order >= 3) and ``F.layer_norm`` (order >= 3; native_layer_norm's
double backward is not differentiated correctly by forward AD on torch 2.13). For those, hoad
compiles the library call and torch.func differentiates the same maths written out in plain ops.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand, reference
from torch.nn.attention import SDPBackend, sdpa_kernel

import hoad

W23 = rand(2, 3, seed=101)
W3 = rand(3, seed=102)
W32 = rand(3, 2, seed=103)


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


# ------------------------------------------------------------------ same tensor twice in one op
def test_x_times_x():
    check(lambda x: x * x, (rand(2, 3),), order=4)


def test_x_times_x_nonlinear():
    check(lambda x: (x * x).sin().sum(0), (rand(2, 3),), order=4)


def test_sin_times_sin_same_node():
    def f(x):
        s = x.sin()
        return s * s

    check(f, (rand(2, 3),), order=4)


def test_sin_times_sin_two_nodes():
    check(lambda x: (torch.sin(x) * torch.sin(x) * W23).sum(), (rand(2, 3),), order=4)


def test_mm_of_a_with_itself():
    res, _ = check(lambda a: torch.mm(a, a), (rand(3, 3),), order=3)
    assert res.is_structural_zero((0, 0, 0))


def test_mm_of_a_with_itself_nonlinear():
    check(lambda a: torch.mm(a, a).tanh().sum(), (rand(3, 3),), order=4)


def test_same_tensor_three_times():
    check(lambda x: (x * x * x.exp()).sum(1), (rand(2, 3),), order=4)


# ---------------------------------------------------------------- paths reconverging via views
def test_flat_view_slice_times_row():
    check(lambda x: (x.view(-1)[:3] * x[0]).sin(), (rand(2, 3),), order=4)


def test_transpose_matmul():
    check(lambda x: (x.t() @ x).sin().sum(), (rand(2, 3),), order=4)


def test_overlapping_slices_multiplied():
    check(lambda x: (x[:, :2] * x[:, 1:]).exp().sum(), (rand(2, 3),), order=4)


def test_reshape_and_permute_reconverge():
    def f(x):
        a = x.reshape(3, 2)
        b = x.permute(1, 0)
        return (a * b).sin().sum() + (a.sum(0) * x[1, :2]).prod()

    check(f, (rand(2, 3),), order=4)


def test_expand_of_a_row_against_the_matrix():
    check(lambda x: (x[:1].expand(2, 3) * x).cos().sum(), (rand(2, 3),), order=4)


# -------------------------------------------------------------------------------- softmax family
@pytest.mark.parametrize("order", [3, 4])
def test_softmax_weighted(order):
    check(lambda x: (torch.softmax(x, -1) * W23).sum(), (rand(2, 3),), order=order)


def test_softmax_matrix_output():
    check(lambda x: torch.softmax(x, 0), (rand(2, 3),), order=3)


def test_softmax_sum_is_constant():
    res = hoad.compile(lambda x: torch.softmax(x, -1).sum(), order=3)(rand(2, 3))
    for k in (1, 2, 3):
        assert torch.allclose(res[(0,) * k], torch.zeros(()).double(), atol=1e-12)


def test_log_softmax_order_4():
    check(lambda x: (F.log_softmax(x, -1) * W23).sum(), (rand(2, 3),), order=4)


def test_log_softmax_matrix_output():
    check(lambda x: F.log_softmax(x, 1), (rand(2, 3),), order=3)


def test_logsumexp():
    check(lambda x: torch.logsumexp(x, 1), (rand(2, 3),), order=4)


def test_logsumexp_all_dims():
    check(lambda x: torch.logsumexp(x, (0, 1)), (rand(2, 3),), order=4)


# ------------------------------------------------------------------------------------ prod
def test_prod_all_dims():
    check(lambda x: x.prod(), (rand(2, 3),), order=4)


def _prod_reference(x, k):
    """∂^k prod(x): at distinct flat indices the product of the other entries, else 0."""
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.zeros((n,) * k, dtype=x.dtype)
    for idx in itertools.permutations(range(n), k):
        out[idx] = math.prod(float(flat[j]) for j in range(n) if j not in idx)
    return out.reshape(tuple(x.shape) * k)


@pytest.mark.parametrize("zeros", [1, 2], ids=["one_zero", "two_zeros"])
def test_prod_all_dims_with_exact_zero(zeros):
    # torch.func is itself wrong here from order 3 on (prod_backward's zero handling is not
    # differentiated correctly), so the reference is the closed form
    x = rand(2, 3)
    x[0, 1] = 0.0
    if zeros == 2:
        x[1, 2] = 0.0
    res = hoad.compile(lambda t: t.prod(), order=4)(x)
    assert float(res.value) == 0.0
    for k in range(1, 5):
        assert_close(res[(0,) * k], _prod_reference(x, k), f"order {k}")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_prod_along_a_dim_with_exact_zeros(mode):
    """Lines with one and two exact zeros, keepdim: the derivative tensors of the product are
    formed without division (torch.func is wrong at a zero from order 3, so the reference is the
    closed form, line by line)."""
    x = rand(3, 4, seed=50)
    x[1, 2] = 0.0
    x[2, 0] = x[2, 3] = 0.0
    res = hoad.compile(lambda t: t.prod(1, keepdim=True), order=4, mode=mode)(x)
    for k in range(1, 5):
        expected = torch.zeros((3, 1) + (3, 4) * k, dtype=x.dtype)
        for row in range(3):
            block = _prod_reference(x[row], k)  # (4,) * k
            index = (row, 0) + (row, slice(None)) * k
            expected[index] = block
        assert_close(res[(0,) * k], expected, f"order {k}")


def test_prod_over_a_wide_line_of_few_inputs():
    """A product over 40 entries that depend on 2 inputs: built as a tree of pairwise products
    (the derivative tensors would be 40^k per entry against 2^k slots)."""
    W = rand(2, 40, seed=51)
    check(lambda x: (1.0 + 0.1 * torch.tanh(x @ W)).prod(-1), (rand(3, 2, seed=52),), order=3)


def test_prod_order_3_needs_memory_near_its_result():
    """Order 3 of a product of 100 entries per sample: its results take 15 MB. A tree of pairwise
    products made [50, 100, 100, 100] blocks (an estimated 6.7 GB); the derivative tensors fit in
    200 MB."""
    X = rand(2, 100, seed=55)
    cf = hoad.compile(lambda X: X.sin().prod(-1), order=3, batch_dim=0, backend="eager", memory_budget=200e6)
    res = cf(X)
    one = torch.func.jacfwd(torch.func.jacfwd(torch.func.jacrev(lambda x: x.sin().prod())))(X[1])
    assert_close(res[0, 0, 0][1], one, "order 3, sample 1")


def test_prod_per_sample_and_in_a_laplacian():
    """A PINN's hard boundary factor Π x_i (1 - x_i) times a network, per sample."""
    W = rand(3, 5, seed=53)

    def u(X):
        return (X * (1 - X)).prod(-1) * torch.tanh(X @ W).sum(-1)

    X = rand(4, 3, seed=54)
    check(u, (X,), order=4, batch_dim=0)
    lap = hoad.laplacian(u, batch_dim=0)(X).laplacian
    hess = torch.func.vmap(torch.func.hessian(lambda x: u(x[None])[0]))(X)
    assert_close(lap, hess.diagonal(dim1=1, dim2=2).sum(-1), "laplacian")


def test_prod_all_dims_of_nonlinear():
    check(lambda t: (t.sin() + 1.5).prod(), (rand(2, 3),), order=3)


# ------------------------------------------------------------------------- ≥ 2-D outputs
def test_matrix_valued_output():
    check(lambda x: x.sin() @ W32, (rand(2, 3),), order=4)


def test_outer_product_output():
    check(lambda x: x[:, None].exp() * x[None, :].sin(), (rand(3),), order=3)


def test_three_d_output():
    check(lambda x: (x[:, :, None] * x[:, None, :]).tanh(), (rand(2, 3),), order=3)


# ---------------------------------------------------------------------------- mixed blocks
def test_two_inputs_all_mixed_blocks():
    res, _ = check(lambda x, w: (w @ x).tanh().sum() * x.sin().sum(), (rand(2), rand(2, 2)), wrt=(0, 1), order=4)
    assert len(res) == 2 + 3 + 4 + 5


def test_three_inputs_all_mixed_blocks():
    def f(x, w, b):
        return ((x @ w + b).tanh() * b.exp()).sum(1)

    res, _ = check(f, (rand(2, 3), rand(3, 2), rand(2)), wrt=(0, 1, 2), order=3)
    assert len(res) == 3 + 6 + 10


def test_mixed_blocks_with_one_wrt_input_skipped():
    def f(x, c, w):
        return (x.sin() * c @ w).exp().sum()

    check(f, (rand(2, 3), rand(2, 3, seed=7), rand(3, 2)), wrt=(2, 0), order=3)


# ----------------------------------------------------------------------------- broadcasting
def test_bias_vector_broadcast():
    check(lambda x, b: (x @ W32 + b).tanh(), (rand(2, 3), rand(2)), wrt=(0, 1), order=3)


def test_column_times_row():
    check(lambda u, v: (u * v).sin(), (rand(3, 1), rand(1, 2)), wrt=(0, 1), order=3)


def test_scalar_tensor_broadcast():
    check(lambda x, s: (x * s).exp().sum(0) * s, (rand(2, 3), rand(())), wrt=(0, 1), order=3)


def test_broadcast_over_leading_dim():
    check(lambda x, r: (x - r).pow(2).sum(-1).sqrt(), (rand(2, 3), rand(3)), wrt=(0, 1), order=3)


# -------------------------------------------------------------------------------------- DAG
def test_dag_reusing_a_node():
    def f(x):
        h = x.sin()
        g = h * h + h.exp() * h
        k = g.tanh() + h
        return (k * h).sum(0) + h.sum(0)

    check(f, (rand(2, 3),), order=4)


def test_dag_diamond_with_two_inputs():
    def f(x, y):
        h = x * y
        return (h.exp() + h.sin() * h + y).sum()

    check(f, (rand(2, 3), rand(2, 3, seed=9)), wrt=(0, 1), order=3)


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


# ------------------------------------------------------------------------------ polynomials
def test_polynomial_structural_zeros_past_its_degree():
    def f(x, y):
        return (x * x * y).sum() + (x * y).sum(0)  # degree 3

    x, y = rand(2, 3), rand(2, 3, seed=4)
    res, _ = check(f, (x, y), wrt=(0, 1), order=4)
    for K in itertools.combinations_with_replacement((0, 1), 4):
        assert res.is_structural_zero(K), f"order-4 block {K} of a cubic must be a structural zero"
        assert torch.count_nonzero(res[K]) == 0
        assert res[K].shape == (3,) + (2, 3) * 4
    assert res.is_structural_zero((1, 1)) and res.is_structural_zero((0, 1, 1))
    assert not res.is_structural_zero((0, 0, 1))


def test_integer_power_structural_zeros_past_its_degree():
    res, _ = check(lambda x: (x ** 3 * W23).sum(), (rand(2, 3),), order=4)
    assert not res.is_structural_zero((0, 0, 0))
    assert res.is_structural_zero((0, 0, 0, 0)), "x**3 has no fourth derivative"
    assert torch.count_nonzero(res[0, 0, 0, 0]) == 0
