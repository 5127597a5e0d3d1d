"""Rules added from outside hoad (hoad.extend): a torch.library custom op, an override, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import hessian, jacrev

import hoad

aten = torch.ops.aten

# two custom ops of a user library: an elementwise one and a linear one (a fixed 3-point stencil
# along the last dim, batch dims in front)
LIB = torch.library.Library("hoadtest", "DEF")
LIB.define("scaled_tanh(Tensor x, float scale) -> Tensor")
LIB.define("stencil(Tensor x) -> Tensor")
LIB.define("scaled_by(Tensor x, Tensor s) -> Tensor")      # elementwise in x: s · sin(x)
LIB.define("apply_matrix(Tensor x, Tensor A) -> Tensor")   # linear in x: x @ A


@torch.library.impl(LIB, "scaled_tanh", "CompositeExplicitAutograd")
def _scaled_tanh(x, scale):
    return scale * torch.tanh(x)


@torch.library.impl(LIB, "stencil", "CompositeExplicitAutograd")
def _stencil(x):
    return x[..., 2:] - 2 * x[..., 1:-1] + x[..., :-2]


@torch.library.register_fake("hoadtest::scaled_tanh")
def _scaled_tanh_fake(x, scale):
    return torch.empty_like(x)


@torch.library.register_fake("hoadtest::stencil")
def _stencil_fake(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] - 2)


@torch.library.impl(LIB, "scaled_by", "CompositeExplicitAutograd")
def _scaled_by(x, s):
    return s * torch.sin(x)


@torch.library.impl(LIB, "apply_matrix", "CompositeExplicitAutograd")
def _apply_matrix(x, A):
    return x @ A


@torch.library.register_fake("hoadtest::scaled_by")
def _scaled_by_fake(x, s):
    return torch.empty_like(x)


@torch.library.register_fake("hoadtest::apply_matrix")
def _apply_matrix_fake(x, A):
    return x.new_empty(*x.shape[:-1], A.shape[-1])


SCALED_TANH = torch.ops.hoadtest.scaled_tanh.default
STENCIL = torch.ops.hoadtest.stencil.default
SCALED_BY = torch.ops.hoadtest.scaled_by.default
APPLY_MATRIX = torch.ops.hoadtest.apply_matrix.default


def _scaled_tanh_derivatives(n, x, y, scale):
    t = y / scale
    d1 = scale * (1 - t * t)
    out = [d1, -2 * t * d1, d1 * (6 * t * t - 2) / 1.0, 8 * t * d1 * (2 - 3 * t * t) / 1.0]
    return out[:n]  # up to order 4


def _stencil_transpose(g, x_shape, *args):
    out = g.new_zeros(*g.shape[:-1], x_shape[-1])
    out[..., 2:] += g
    out[..., 1:-1] -= 2 * g
    out[..., :-2] += g
    return out


@pytest.fixture
def user_rules():
    hoad.register_elementwise(SCALED_TANH, _scaled_tanh_derivatives)
    hoad.register_linear(STENCIL, _stencil_transpose)
    yield
    hoad.unregister_rule(SCALED_TANH)
    hoad.unregister_rule(STENCIL)


def test_a_custom_op_without_a_rule_is_unsupported():
    with pytest.raises(hoad.UnsupportedOperatorError, match="hoadtest.scaled_tanh"):
        hoad.compile(lambda x: SCALED_TANH(x, 2.0).sum(), order=2)(rand(3))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_custom_elementwise_op_at_order_4(user_rules, mode):
    W = rand(3, 2, seed=401)
    check(lambda x: (SCALED_TANH(x @ W, 1.5) * x.sum()).sin(), (rand(2, 3, seed=402),), order=4,
          reference_fn=lambda x: (1.5 * torch.tanh(x @ W) * x.sum()).sin(), mode=mode)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_custom_linear_op_with_two_inputs(user_rules, mode):
    def f(x, y):
        return (STENCIL(x.sin() * y) ** 2).sum(-1)

    def plain(x, y):
        z = x.sin() * y
        return ((z[..., 2:] - 2 * z[..., 1:-1] + z[..., :-2]) ** 2).sum(-1)

    check(f, (rand(2, 5, seed=403), rand(2, 5, seed=404)), wrt=(0, 1), order=3, reference_fn=plain, mode=mode)


def test_custom_ops_per_sample_and_in_training(user_rules):
    W = rand(4, 3, seed=405).requires_grad_(True)

    def u(X):
        return SCALED_TANH(X @ W, 0.5).sum(-1)

    X = rand(6, 4, seed=406)
    res = hoad.compile(u, order=2, batch_dim=0)(X)
    plain = lambda x: (0.5 * torch.tanh(x @ W)).sum()  # noqa: E731
    ref = torch.func.vmap(hessian(plain))(X)
    assert_close(res[0, 0], ref, "per-sample Hessian")
    got, = torch.autograd.grad(res[0, 0].pow(2).sum(), W)
    want, = torch.autograd.grad(ref.pow(2).sum(), W)
    assert_close(got, want, "gradient through the custom op")


def test_override_an_aten_rule_and_restore_it():
    calls = []

    def sin_derivatives(n, x, y):
        calls.append(n)
        c = x.cos()
        return [c, -y, -c, y][:n]

    with pytest.raises(hoad.InvalidArgumentError, match="override=True"):
        hoad.register_elementwise(aten.sin.default, sin_derivatives)
    hoad.register_elementwise(aten.sin.default, sin_derivatives, override=True)
    try:
        x = rand(3, seed=407)
        res = hoad.compile(lambda x: x.sin().sum(), order=3)(x)
        assert calls, "the override was not used"
        assert_close(res[0, 0, 0], jacrev(jacrev(jacrev(lambda x: x.sin().sum())))(x), "order 3")
    finally:
        hoad.unregister_rule(aten.sin.default)
    calls.clear()
    hoad.compile(lambda x: x.sin().sum(), order=2)(rand(4, seed=408))
    assert not calls, "hoad's own sin rule must be back"


@pytest.mark.parametrize("call, fragment", [
    (lambda: hoad.register_elementwise(torch.ops.aten.sin, lambda n, x, y: []), "overload packet"),
    (lambda: hoad.register_rule("sin", lambda *a: {}, lambda *a: []), "per ATen overload"),
    (lambda: hoad.unregister_rule(torch.ops.aten.cos.default), "no registered rule"),
    (lambda: hoad.register_linear(STENCIL, None), "transpose"),
    (lambda: hoad.register_elementwise(torch.ops.aten.pow.Scalar, lambda n, x, y: []),
     "first argument self is a number"),  # (it failed at the first use: "'float' object has no attribute 'primal'")
    (lambda: hoad.register_linear(torch.ops.aten.pow.Scalar, lambda g, s: g), "first argument self is a number"),
])
def test_bad_registrations(call, fragment):
    with pytest.raises(hoad.InvalidArgumentError, match=fragment):
        call()


def test_too_few_derivatives_name_the_op(user_rules):
    with pytest.raises(hoad.InvalidArgumentError, match="returned 4 entries where order 5 needs 5"):
        hoad.compile(lambda x: SCALED_TANH(x, 1.0).sum(), order=5)(rand(2, seed=409))


def _plain_stencil(z):
    return z[..., 2:] - 2 * z[..., 1:-1] + z[..., :-2]


@pytest.mark.parametrize("mode", ["auto", "reverse"])
def test_a_transpose_that_writes_in_place_in_a_biharmonic(user_rules, mode):
    """The stencil's transpose adds into a fresh buffer in place. hoad's passes merged the
    buffers of two of its calls (the biharmonic was 3.388 where the truth is -3.731; reverse
    mode failed): user code is traced functionalized."""
    def u(x):
        return (STENCIL(x.sin()) ** 2).sum().mul(0.05).exp()

    def plain(x):
        return (_plain_stencil(x.sin()) ** 2).sum().mul(0.05).exp()

    x = rand(6, seed=410)
    fourth = torch.func.jacfwd(torch.func.jacfwd(torch.func.jacfwd(torch.func.jacrev(plain))))(x)
    assert_close(hoad.biharmonic(u, mode=mode)(x).biharmonic, torch.einsum("iijj->", fourth), "biharmonic")


@pytest.fixture
def ops_with_tensor_arguments():
    hoad.register_elementwise(SCALED_BY, lambda n, x, y, s: [s * x.cos(), -y, -s * x.cos(), y][:n])
    hoad.register_linear(APPLY_MATRIX, lambda g, x_shape, A: g @ A.T)
    yield
    hoad.unregister_rule(SCALED_BY)
    hoad.unregister_rule(APPLY_MATRIX)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_constant_tensor_arguments_reach_user_functions_as_tensors(ops_with_tensor_arguments, mode):
    """They arrived as hoad's internal jets (a HoadInternalError at the first use)."""
    s, A = rand(2, 3, seed=411), rand(3, 4, seed=412)
    check(lambda x: SCALED_BY(APPLY_MATRIX(x, A) @ A.T, s.exp()).sum(), (rand(2, 3, seed=413),), order=3,
          reference_fn=lambda x: (s.exp() * torch.sin(x @ A @ A.T)).sum(), mode=mode)


def test_a_varying_second_argument_is_refused(ops_with_tensor_arguments):
    """register_elementwise differentiates x only; an s that depends on x lost its derivatives
    (the gradient was 0.87 off)."""
    for f in (lambda x: SCALED_BY(x.sin(), x.cos()).sum(), lambda x: APPLY_MATRIX(x, x.T).sum()):
        with pytest.raises(hoad.UnsupportedOperatorError, match="differentiates its first argument only"):
            hoad.compile(f, order=2)(rand(3, 3, seed=414))


def test_user_functions_of_the_wrong_shape_are_named():
    """They were HoadInternalErrors ("this is a bug in hoad") naming neither op nor rule."""
    hoad.register_elementwise(SCALED_BY, lambda n, x, y, s: [x.cos().sum(-1)] * n)
    hoad.register_linear(APPLY_MATRIX, lambda g, x_shape, A: g)
    s, A = rand(2, 3, seed=417), rand(3, 4, seed=418)
    try:
        with pytest.raises(hoad.InvalidArgumentError, match=r"scaled_by.*shape \(2,\) as derivative 1.*\(2, 3\)"):
            hoad.compile(lambda x: SCALED_BY(x, s).sum(), order=2)(rand(2, 3, seed=415))
        with pytest.raises(hoad.InvalidArgumentError, match=r"transpose registered for hoadtest.apply_matrix"):
            hoad.compile(lambda x: APPLY_MATRIX(x, A).sum(), order=1, mode="reverse")(rand(2, 3, seed=416))
    finally:
        hoad.unregister_rule(SCALED_BY)
        hoad.unregister_rule(APPLY_MATRIX)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_linear_op_acting_on_trailing_dims_stays_per_sample(mode):
    """acts_on=1: the stencil acts along the last dim, so dim 0 keeps its ties. Without it the op
    was one opaque map of all of x's dims, a false BatchCouplingError under batch_dim=0."""
    hoad.register_linear(STENCIL, _stencil_transpose, acts_on=1)
    try:
        def u(X):
            return (STENCIL(X.sin()) ** 2).sum(-1).mul(0.3).exp()

        def plain(X):
            return (_plain_stencil(X.sin()) ** 2).sum(-1).mul(0.3).exp()

        X = rand(3, 6, seed=419)
        check(u, (X,), order=3, batch_dim=0, mode=mode, reference_fn=plain)
        lap = hoad.laplacian(u, batch_dim=0, mode=mode)(X).laplacian
        hess = torch.func.vmap(hessian(lambda x: plain(x[None])[0]))(X)
        assert_close(lap, hess.diagonal(dim1=1, dim2=2).sum(-1), "laplacian")
    finally:
        hoad.unregister_rule(STENCIL)
    with pytest.raises(hoad.InvalidArgumentError, match="acts_on"):
        hoad.register_linear(STENCIL, _stencil_transpose, acts_on=-1)
    hoad.register_linear(STENCIL, _stencil_transpose)
    try:
        with pytest.raises(hoad.BatchCouplingError, match="acts_on=k"):
            hoad.compile(lambda X: STENCIL(X).sum(-1), order=1, batch_dim=0, mode=mode)(rand(3, 6, seed=421))
    finally:
        hoad.unregister_rule(STENCIL)


def test_a_registration_rebuilds_programs_built_before_it():
    """A function compiled before an override kept hoad's rule, and one compiled while it was
    active kept it after unregister_rule."""
    def f(x):
        return x.sin().sum()

    cf = hoad.compile(f, order=2)
    x = rand(3, seed=420)
    true = jacrev(jacrev(f))(x)
    assert_close(cf(x)[0, 0], true, "hoad's rule")
    hoad.register_elementwise(aten.sin.default, lambda n, x, y: [10 * x.cos(), -10 * y][:n], override=True)
    try:
        assert_close(cf(x)[0, 0], 10 * true, "the override")
    finally:
        hoad.unregister_rule(aten.sin.default)
    assert_close(cf(x)[0, 0], true, "hoad's rule again")


def test_user_functions_that_return_the_wrong_kind_of_value_are_named():
    """A derivatives function returning one tensor (not a list) was iterated over its entries:
    every entry got the first entry's derivative (0.990 where 0.786 and 0.487 are right). A rule
    returning keys that are not multi-indices was skipped (derivatives 0), a VJP returning None
    was a HoadInternalError."""
    x = rand(3, seed=419)
    try:
        hoad.register_elementwise(SCALED_TANH, lambda n, x, y, scale: scale * (1 - (y / scale) ** 2))
        with pytest.raises(hoad.InvalidArgumentError, match="returned a tensor of shape .*return a list"):
            hoad.compile(lambda x: SCALED_TANH(x, 1.0).sum(), order=1, backend="eager")(x)
        hoad.unregister_rule(SCALED_TANH)
        with pytest.raises(hoad.InvalidArgumentError, match="needs a function"):
            hoad.register_elementwise(SCALED_TANH, 42)
        with pytest.raises(hoad.InvalidArgumentError, match="override must be True or False"):
            hoad.register_rule(SCALED_TANH, lambda ctx, x, s: {}, lambda v, g, x, s: [], override="no")
        hoad.register_rule(SCALED_TANH, lambda ctx, x, s: {"a": 1}, lambda v, g, x, s: None)
        for mode, what in (("forward", "forward rule .* keys \\['a'\\]"), ("reverse", "VJP .* returned None")):
            with pytest.raises(hoad.InvalidArgumentError, match=what):
                hoad.compile(lambda x: SCALED_TANH(x, 1.0).sum(), order=1, mode=mode, backend="eager")(x)
    finally:
        if SCALED_TANH in hoad.rules.USER_OPS:
            hoad.unregister_rule(SCALED_TANH)


def _stencil_of_every_block(ctx, x):
    """A user's linear rule written the natural way: the op applied to every block its input has
    (not only ``ctx.keys``), each block's last axis the stencil's."""
    r = x.ndim - 1
    return {K: hoad.algebra.Block.dense(_stencil(b.materialize().movedim(r, -1)).movedim(-1, r))
            for K, b in x.blocks.items()}


def _stencil_vjp(v, g, x):
    r = x.ndim - 1
    return [(x, hoad.algebra.Block.dense(_stencil_transpose(g.materialize().movedim(r, -1), (x.shape[-1],))
                                         .movedim(-1, r)))]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_rule_giving_blocks_of_other_orders(mode):
    """A rule returning every block of its input: forward mode kept ctx.keys only, but the reverse
    sweep used the lower-order blocks as remainders and overwrote right blocks (an order-3
    program's Hessian off by 6.8)."""
    x = rand(7, seed=431)
    hoad.register_rule(STENCIL, _stencil_of_every_block, _stencil_vjp)
    try:
        check(lambda x: STENCIL(x.sin()).exp().sum(), (x,), order=3, mode=mode,
              reference_fn=lambda x: _stencil(x.sin()).exp().sum(), backend="eager")
    finally:
        hoad.unregister_rule(STENCIL)


@pytest.mark.parametrize("vjp, fragment", [
    (lambda v, g, x, s: [(x, hoad.algebra.Block.dense(torch.ones(5, dtype=torch.float64)))],
     r"returned a Block of shape \(5,\) as a cotangent; it must be a Block of shape \(2, 3\)"),
    (lambda v, g, x, s: [(x, g.materialize())], r"returned a tensor of shape \(2, 3\) as a cotangent"),
    (lambda v, g, x, s: [(x.primal, g)], "not one of the op's arguments .* not x.primal"),
], ids=["shape", "tensor", "primal"])
def test_a_vjp_returning_a_wrong_cotangent_is_named(vjp, fragment):
    """A cotangent of the wrong shape came back as a (5,) gradient of a (2, 3) input; one paired
    with ``x.primal`` was skipped (gradient 0); a plain tensor was a HoadInternalError."""
    hoad.register_rule(SCALED_TANH, lambda ctx, x, s: {}, vjp)
    try:
        with pytest.raises(hoad.InvalidArgumentError, match=fragment):
            hoad.compile(lambda x: SCALED_TANH(x, 1.0).sum(), order=1, mode="reverse", backend="eager")(rand(2, 3))
    finally:
        hoad.unregister_rule(SCALED_TANH)


LIB.define("numpy_tanh(Tensor x) -> Tensor")  # kernels autograd cannot see through
LIB.define("numpy_flip(Tensor x) -> Tensor")


@torch.library.impl(LIB, "numpy_tanh", "CPU")
def _numpy_tanh(x):
    return torch.from_numpy(np.tanh(x.detach().numpy()))


@torch.library.impl(LIB, "numpy_flip", "CPU")
def _numpy_flip(x):
    return torch.from_numpy(np.ascontiguousarray(np.flip(x.detach().numpy(), -1)))


for _name in ("numpy_tanh", "numpy_flip"):
    torch.library.register_fake(f"hoadtest::{_name}")(lambda x: torch.empty_like(x))
NUMPY_TANH = torch.ops.hoadtest.numpy_tanh.default
NUMPY_FLIP = torch.ops.hoadtest.numpy_flip.default


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_training_through_ops_autograd_cannot_see_through(backend):
    """hoad's programs run the op itself: for a kernel of the user's own, the gradient of a
    Laplacian loss with respect to W was off by 14.9 (of 16.6) and W.grad of the value was None.
    Such an op now gets the registered first derivative (or transpose) as its autograd formula,
    removed again by unregister_rule."""
    hoad.register_elementwise(NUMPY_TANH, lambda n, x, y: [1 - y * y, -2 * y * (1 - y * y)][:n])
    hoad.register_linear(NUMPY_FLIP, lambda g, shape: g.flip(-1), acts_on=1)
    try:
        W = rand(3, 5, seed=441).requires_grad_(True)
        V, X = rand(5, seed=442), rand(6, 3, seed=443)
        lap = hoad.laplacian(lambda X: NUMPY_FLIP(NUMPY_TANH(X @ W)) @ V, batch_dim=0, backend=backend)
        out = lap(X)
        got = torch.autograd.grad(out.laplacian.pow(2).sum() + out.value.sum(), W)[0]
        u = lambda W, x: torch.tanh(x @ W).flip(-1) @ V  # noqa: E731
        want = torch.func.grad(lambda W: torch.func.vmap(lambda x: torch.func.hessian(lambda x: u(W, x))(x).trace())(X)
                               .pow(2).sum() + torch.func.vmap(lambda x: u(W, x))(X).sum())(W.detach())
        assert_close(got, want, "gradient through the user's kernels")
    finally:
        hoad.unregister_rule(NUMPY_TANH)
        hoad.unregister_rule(NUMPY_FLIP)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(NUMPY_TANH.name(), "Autograd")


def test_training_through_a_register_rule_op_autograd_cannot_see_through_is_refused():
    """register_rule gives no autograd formula: a call whose results would need one is refused,
    not answered with gradients that miss the op; under no_grad it runs."""
    from hoad.rules.combinators import chain, scale_out

    def rule(ctx, x):
        d1 = 1 - ctx.out * ctx.out
        return chain(ctx, x, [d1, -2 * ctx.out * d1][:ctx.max_order])

    hoad.register_rule(NUMPY_TANH, rule, lambda v, g, x: [(x, scale_out(g, 1 - v.out * v.out, x.shape))])
    try:
        W = rand(3, 3, seed=451).requires_grad_(True)
        x = rand(3, seed=452)
        cf = hoad.compile(lambda x: NUMPY_TANH(W @ x).sum(), order=2, backend="eager")
        with pytest.raises(hoad.InvalidArgumentError, match="hoadtest.numpy_tanh.default .* no autograd formula"):
            cf(x)
        with torch.no_grad():
            assert_close(cf(x)[0], torch.func.grad(lambda x: torch.tanh(W.detach() @ x).sum())(x), "gradient")
    finally:
        hoad.unregister_rule(NUMPY_TANH)


LIB.define("cumsum_last(Tensor x) -> Tensor")
torch.library.impl(LIB, "cumsum_last", "CompositeExplicitAutograd")(lambda x: x.cumsum(-1))
torch.library.register_fake("hoadtest::cumsum_last")(lambda x: torch.empty_like(x))  # (docs/how-it-works.md's fake)
CUMSUM_LAST = torch.ops.hoadtest.cumsum_last.default


def test_a_linear_op_gets_contiguous_blocks():
    """hoad called a linear op on permuted blocks, where the fake kernel's empty_like(x) strides
    differ from the real kernel's contiguous output: "view size is not compatible" (eager) or a
    stride check (Inductor), an ExecutionError asking to report it."""
    hoad.register_linear(CUMSUM_LAST, lambda g, shape: g.flip(-1).cumsum(-1).flip(-1), acts_on=1)
    try:
        W = rand(3, 4, seed=461)
        f = lambda x, y: CUMSUM_LAST(F.softplus(x @ W, 1.7) * y.sin()).pow(2).sum(-1)  # noqa: E731
        plain = lambda x, y: (F.softplus(x @ W, 1.7) * y.sin()).cumsum(-1).pow(2).sum(-1)  # noqa: E731
        x, y = rand(2, 3, seed=462), rand(2, 4, seed=463)
        res = hoad.compile(f, order=3, wrt=(0, 1), batch_dim=0, diagonal=True, backend="eager", mode="forward")(x, y)
        one = lambda x, y: plain(x[None], y[None])[0]  # noqa: E731
        ref = torch.func.vmap(torch.func.jacfwd(torch.func.jacfwd(torch.func.jacrev(one))))(x, y)
        assert_close(res[0, 0, 0], torch.einsum("biii->bi", ref), "diagonal of the third derivative")
    finally:
        hoad.unregister_rule(CUMSUM_LAST)


LIB.define("numpy_scaled_tanh(Tensor x, *, float scale) -> Tensor")
torch.library.impl(LIB, "numpy_scaled_tanh", "CPU")(
    lambda x, *, scale: torch.from_numpy(np.tanh(scale * x.detach().numpy())))
torch.library.register_fake("hoadtest::numpy_scaled_tanh")(lambda x, *, scale: torch.empty_like(x))
NUMPY_SCALED_TANH = torch.ops.hoadtest.numpy_scaled_tanh.default


@torch.library.custom_op("hoadtest::custom_tanh", mutates_args=())
def _custom_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.tanh(x.detach().numpy()))


_custom_tanh.register_fake(lambda x: torch.empty_like(x))
CUSTOM_TANH = torch.ops.hoadtest.custom_tanh.default


def _tanh_derivatives(n, x, y, scale=1.0):
    return [scale * (1 - y * y), -2 * scale * scale * y * (1 - y * y)][:n]


def test_the_autograd_formula_follows_the_registration():
    """A keyword-only argument (setup_context got keyword_only_inputs: every call with a
    requires-grad input failed), a re-registration with override=True (the first formula stayed:
    wrong gradients), a torch.library.custom_op (its own autograd kernel raised without a
    formula), and a register_rule refusal lifted once the user registers a formula."""
    W = rand(3, 3, seed=471).requires_grad_(True)
    x = rand(3, seed=472)

    def gradient(op, **kw):
        out = hoad.compile(lambda x: op(W @ x, **kw).sum(), order=1, backend="eager")(x)
        return torch.autograd.grad(out.value, W)[0]

    def want(scale=1.0):
        return torch.func.grad(lambda W: torch.tanh(scale * (W @ x)).sum())(W.detach())

    try:
        hoad.register_elementwise(NUMPY_SCALED_TANH, lambda n, x, y, *, scale: _tanh_derivatives(n, x, y, scale))
        assert_close(gradient(NUMPY_SCALED_TANH, scale=2.0), want(2.0), "keyword-only scale")
        hoad.register_elementwise(NUMPY_TANH, lambda n, x, y: [1 + 0 * y, 0 * y][:n])  # wrong, then corrected
        hoad.register_elementwise(NUMPY_TANH, _tanh_derivatives, override=True)
        assert_close(gradient(NUMPY_TANH), want(), "after override")
        hoad.register_elementwise(CUSTOM_TANH, _tanh_derivatives)
        assert_close(gradient(CUSTOM_TANH), want(), "custom_op")
        hoad.unregister_rule(CUSTOM_TANH)
        assert torch._library.custom_ops._maybe_get_opdef(CUSTOM_TANH)._backward_fn is None
        hoad.register_rule(NUMPY_TANH, lambda ctx, x: {}, lambda v, g, x: [], override=True)  # (its formula goes)
        with pytest.raises(hoad.InvalidArgumentError, match="no autograd formula"):
            gradient(NUMPY_TANH)
    finally:
        for op in (NUMPY_SCALED_TANH, NUMPY_TANH, CUSTOM_TANH):
            if op in hoad.rules.USER_OPS:
                hoad.unregister_rule(op)
