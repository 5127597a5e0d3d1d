"""Properties every derivative program must have, whatever the function (STYLE.md "Tests"):
Schwarz symmetry of each block, agreement between orders, agreement between propagation modes,
and independence from the identity of the input objects."""

import itertools

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, check, rand, reference

import hoad

W23 = rand(2, 3, seed=201)
W32 = rand(3, 2, seed=202)

# (name, f, args, wrt): small functions of different structure
FUNCTIONS = {
    "elementwise": (lambda x: (x.sin() * x.exp()).sum(), (rand(2, 3),), (0,)),
    "matrix_out": (lambda x: (x @ W32).tanh(), (rand(2, 3),), (0,)),
    "softmax": (lambda x: (torch.softmax(x, -1) * W23).sum(0), (rand(2, 3),), (0,)),
    "prod": (lambda x: x.prod(1), (rand(2, 3),), (0,)),
    "two_inputs": (lambda x, w: (x @ w).sin().sum() * w.exp().sum(), (rand(2, 3), rand(3, 2)), (0, 1)),
    "reuse": (lambda x, y: (x * x * y + y.log1p() * x).sum(1), (rand(2, 3), rand(2, 3, positive=True)), (0, 1)),
}


def _permuted(t, out_axes, groups, order):
    return t.permute(out_axes + [a for i in order for a in groups[i]])


# -------------------------------------------------------------------------------- symmetry
@pytest.mark.parametrize("name", ["elementwise", "matrix_out", "softmax", "two_inputs"])
def test_blocks_symmetric_under_permutation_of_equal_slots(name):
    f, args, wrt = FUNCTIONS[name]
    res = hoad.compile(f, order=3, wrt=wrt)(*args)
    ranks = [args[w].ndim for w in wrt]
    r = res.value.ndim
    checked = 0
    for K in res:
        positions = [res.wrt.index(k) for k in K]
        offsets = [r + sum(ranks[p] for p in positions[:i]) for i in range(len(positions))]
        groups = [list(range(o, o + ranks[p])) for o, p in zip(offsets, positions)]
        t = res[K]
        for order in itertools.permutations(range(len(K))):
            if [positions[i] for i in order] != positions:
                continue  # only permutations that swap slots of the same input
            assert_close(_permuted(t, list(range(r)), groups, order), t, f"block {K} under slot permutation {order}")
            checked += 1
    assert checked > len(list(res))


def test_third_order_block_equals_all_axis_group_permutations():
    x = rand(2, 3)
    res = hoad.compile(lambda x: (x.sin() @ W32).exp().sum(), order=3)(x)
    t = res[0, 0, 0]
    assert t.shape == (2, 3) * 3
    groups = [[0, 1], [2, 3], [4, 5]]
    for order in itertools.permutations(range(3)):
        assert_close(_permuted(t, [], groups, order), t, f"permutation {order}")


def test_non_canonical_keys_agree_with_each_other():
    f, args, wrt = FUNCTIONS["two_inputs"]
    res = hoad.compile(f, order=3, wrt=wrt)(*args)
    ref = reference(f, args, wrt, 3)
    # every ordering of the multiset {0, 0, 1} against the reference, permuted independently
    for key in set(itertools.permutations((0, 0, 1))):
        canon = ref[(0, 0, 1)]
        canon_groups = {0: [[0, 1], [2, 3]], 1: [[4, 5]]}  # axes of each slot (the output is scalar)
        used, perm = {0: 0, 1: 0}, []
        for k in key:
            perm += canon_groups[k][used[k]]
            used[k] += 1
        assert_close(res[key], canon.permute(perm), f"block {key}")


# ------------------------------------------------------------------- order N vs order N - 1
@pytest.mark.parametrize("name", ["elementwise", "matrix_out", "prod", "reuse"])
def test_order_n_agrees_with_order_n_minus_1(name):
    f, args, wrt = FUNCTIONS[name]
    lower = hoad.compile(f, order=2, wrt=wrt)(*args)
    higher = hoad.compile(f, order=3, wrt=wrt)(*args)
    assert_close(higher.value, lower.value, "value")
    assert list(lower) == [K for K in higher if len(K) <= 2]
    for K in lower:
        assert_close(higher[K], lower[K], f"block {K}")
        assert higher.is_structural_zero(K) == lower.is_structural_zero(K), K


def test_order_4_agrees_with_order_1():
    f = lambda x: (x.sin() * W23).sum()  # noqa: E731
    x = rand(2, 3)
    one = hoad.compile(f, order=1)(x)
    four = hoad.compile(f, order=4)(x)
    assert_close(four[0], one[0], "gradient")
    assert_close(four[0], W23 * x.cos(), "gradient in closed form")


# ------------------------------------------------------------------------- forward vs auto
@pytest.mark.parametrize("name", ["elementwise", "matrix_out", "softmax", "two_inputs", "reuse"])
def test_forward_and_auto_modes_agree(name):
    f, args, wrt = FUNCTIONS[name]
    auto = hoad.compile(f, order=3, wrt=wrt, mode="auto")(*args)
    fwd = hoad.compile(f, order=3, wrt=wrt, mode="forward")(*args)
    assert_close(auto.value, fwd.value, "value")
    assert list(auto) == list(fwd)
    for K in fwd:
        assert auto[K].shape == fwd[K].shape, K
        assert_close(auto[K], fwd[K], f"block {K}")


def test_forward_and_auto_modes_agree_on_structural_zeros():
    def f(x, y):
        return (x * x * y).sum() + y.sin().sum()

    args = (rand(2, 3), rand(2, 3, seed=3))
    auto = hoad.compile(f, order=4, wrt=(0, 1), mode="auto")(*args)
    fwd = hoad.compile(f, order=4, wrt=(0, 1), mode="forward")(*args)
    for K in fwd:
        assert_close(auto[K], fwd[K], f"block {K}")
        if fwd.is_structural_zero(K):
            assert torch.count_nonzero(auto[K]) == 0, K
    for K in [(0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 1)]:
        assert auto.is_structural_zero(K) and fwd.is_structural_zero(K), K


# ----------------------------------------------------------------- identity of input objects
def _counting(body):
    calls = []

    def f(*args):
        calls.append(1)
        return body(*args)

    return f, calls


def test_new_tensors_give_new_values_without_retracing():
    body = lambda x, w: ((x @ w).tanh() * x.sum()).sum()  # noqa: E731
    f, calls = _counting(body)
    cf = hoad.compile(f, order=3, wrt=(0, 1))
    cf(rand(2, 3, seed=1), rand(3, 2, seed=2))
    traced = len(calls)
    for seed in (3, 4):
        args = (rand(2, 3, seed=seed), rand(3, 2, seed=seed + 10))
        res = cf(*args)
        for K, r in reference(body, args, (0, 1), 3).items():
            assert_close(res[K], r, f"block {K} at seed {seed}")
    assert len(calls) == traced


def test_earlier_results_are_not_overwritten_by_later_calls():
    f = lambda x: (x.sin() * x).sum(0)  # noqa: E731
    cf = hoad.compile(f, order=2)
    x1, x2 = rand(2, 3, seed=1), rand(2, 3, seed=2)
    r1 = cf(x1)
    saved = {K: r1[K].clone() for K in r1}
    value = r1.value.clone()
    cf(x2)
    assert torch.equal(r1.value, value)
    for K in r1:
        assert torch.equal(r1[K], saved[K]), f"block {K} of the first result changed after a second call"


def test_result_does_not_alias_a_mutated_input():
    f = lambda x: x * 2.0  # noqa: E731
    x = rand(2, 3)
    res = hoad.compile(f, order=1)(x)
    value = res.value.clone()
    x.add_(1.0)
    assert torch.equal(res.value, value), "the value must not be a view of the input"


def test_non_contiguous_and_view_inputs():
    body = lambda x: (x.sin() @ W32).exp().sum()  # noqa: E731
    f, calls = _counting(body)
    cf = hoad.compile(f, order=3)
    cf(rand(2, 3))
    traced = len(calls)
    base = rand(3, 2, seed=7)
    xt = base.t()  # (2, 3), non-contiguous
    big = rand(4, 5, seed=8)
    xs = big[1:3, 1:4]  # (2, 3), a strided view with an offset
    for x in (xt, xs):
        res = cf(x)
        for K, r in reference(body, (x.contiguous(),), (0,), 3).items():
            assert_close(res[K], r, f"block {K}")
    assert len(calls) == traced


def test_requires_grad_inputs_are_fine():
    f = lambda x: (x.sin() * W23).sum()  # noqa: E731
    x = rand(2, 3).requires_grad_()
    res = hoad.compile(f, order=2)(x)
    ref = reference(f, (x.detach(),), (0,), 2)
    assert_close(res[0].detach(), ref[(0,)], "gradient")
    assert_close(res[0, 0].detach(), ref[(0, 0)], "hessian")


def test_same_tensor_in_two_slots_then_distinct_tensors():
    body = lambda x, y: (x.exp() * y.sin()).sum()  # noqa: E731
    f, calls = _counting(body)
    cf = hoad.compile(f, order=2, wrt=(0, 1))
    x = rand(2, 3)
    same = cf(x, x)
    traced = len(calls)
    y = rand(2, 3, seed=5)
    other = cf(x, y)
    assert len(calls) == traced
    for args, res in (((x, x), same), ((x, y), other)):
        for K, r in reference(body, args, (0, 1), 2).items():
            assert_close(res[K], r, f"block {K}")


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


# ------------------------------------------------------------------------------ polynomials
W23 = rand(2, 3, seed=101)


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
