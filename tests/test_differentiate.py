"""The derivative transform (passes/differentiate.py) on the programs an eager grad_fn-walking
engine (thoad) gets silently wrong: one tensor read twice by an op, paths that reconverge through
views, DAGs, mixed blocks of several inputs, broadcasting, outputs of any rank; each against
nested torch.func in float64 at orders up to 4."""

import torch
from helpers import check, rand

W23 = rand(2, 3, seed=101)
W32 = rand(3, 2, seed=103)


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
