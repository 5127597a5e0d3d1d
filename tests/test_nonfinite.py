"""Where a function's value is NaN or infinite: hoad's derivatives follow torch's per op, and its
structural zeros stay zeros (docs/guide.md, on NaN and infinity)."""

import pytest
import torch
from helpers import rand
from torch.func import hessian, jacfwd, jacrev

import hoad

DT = torch.float64
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
