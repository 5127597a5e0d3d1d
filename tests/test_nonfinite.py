"""Where a function's value is NaN or infinite: hoad's derivatives follow torch's per op, and its
structural zeros stay zeros (docs/guide.md, on NaN and infinity); and entries masked to -inf (a
whole softmax row, a query that sees no key, a scan's prefix) leave the derivatives finite."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import check, rand
from torch.func import hessian, jacfwd, jacrev

import hoad

aten = torch.ops.aten
DT = torch.float64
MODES = ["forward", "reverse"]
X = torch.tensor([-1.5, 0.5, -0.3, 2.0], dtype=DT)
W = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=DT)
OPS = {
    "entr below 0": lambda x: torch.special.entr(x),     # -inf at x < 0
    "rpow of a negative base": lambda x: (-2.0) ** x,    # NaN at non-integer x; log(-2) in every derivative
    "log of a negative": lambda x: x.log(),
}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_an_ops_own_derivatives_are_torchs_where_its_value_is_not_finite(name, mode):
    """Entry by entry, the op's derivatives of orders 1-3 are torch's own, NaN where torch's
    are, finite where torch's are (log'(x) = 1/x even where log x is NaN)."""
    op = OPS[name]
    res = hoad.compile(lambda x: op(x), order=3, mode=mode)(X)
    assert torch.equal(res.value.isfinite(), op(X).isfinite())
    ref = jacrev(op)
    for k in (1, 2, 3):
        got = res[(0,) * k]
        want = ref(X)
        diagonal = torch.stack([got[(i,) * (k + 1)] for i in range(4)])  # ∂^k op(x)_i / ∂x_i^k
        torch.testing.assert_close(diagonal, torch.stack([want[(i,) * (k + 1)] for i in range(4)]), equal_nan=True,
                                   msg=lambda m: f"order {k}: {m}")
        ref = jacfwd(ref)


@pytest.mark.parametrize("name", sorted(OPS))
def test_entries_no_path_connects_stay_zero_where_torch_func_spreads_nan(name):
    """∂²/∂x_i∂x_j of Σ w·sin(op(x)) for i != j is exactly 0: no path joins x_i to x_j. torch.func's
    dense products multiply the NaN of one entry by the 0 of another (0·NaN = NaN) and fill rows
    and columns with NaN; hoad keeps the zero (documented)."""
    op = OPS[name]

    def g(x):
        return (W * op(x).sin()).sum()

    H = hoad.compile(g, order=2)(X)[0, 0]
    off = ~torch.eye(4, dtype=torch.bool)
    assert torch.equal(H[off], torch.zeros_like(H[off]))
    assert torch.isnan(hessian(g)(X)[off]).any(), "torch.func no longer spreads NaN: revisit the note in docs/guide.md"


def test_torch_func_disagrees_with_itself_where_the_value_is_nan():
    """A masked log-softmax is -inf at the masked entries, and sin(-inf) is NaN: the value is NaN,
    and torch.func's own Hessians differ by nesting (jacfwd∘jacfwd NaN everywhere, jacrev∘jacrev
    0 in the masked columns). Once the -inf entries are replaced (masked_fill), the value is
    finite and hoad equals torch in both directions."""
    mask = torch.tensor([[True, False, True], [True, True, False]])
    weights = rand(2, 3, seed=1)
    y = rand(2, 3, seed=2)

    def nan_valued(y):
        return (torch.masked._ops.log_softmax(y, 1, mask=mask).sin() * weights).sum()

    assert torch.isnan(nan_valued(y))
    fwd, rev = jacfwd(jacfwd(nan_valued))(y), jacrev(jacrev(nan_valued))(y)
    assert not torch.equal(fwd.isnan(), rev.isnan())

    def finite(y):
        return (torch.masked._ops.log_softmax(y, 1, mask=mask).masked_fill(~mask, 0).sin() * weights).sum()

    for mode in ("forward", "reverse"):
        res = hoad.compile(finite, order=2, mode=mode)(y)
        torch.testing.assert_close(res[0, 0], jacfwd(jacrev(finite))(y))
        torch.testing.assert_close(res[0], jacrev(finite)(y))


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
