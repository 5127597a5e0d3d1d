"""Every rule-table entry against nested torch.func in float64, at orders 1..4 (5 where cheap)."""

import pytest
import torch
from helpers import check
from op_cases import CASES

from hoad.rules import RULES, VJPS

aten = torch.ops.aten


def test_table_and_cases_cover_each_other():
    from hoad.rules import USER_OPS

    own = set(RULES) - USER_OPS  # (a docs example or another test may have registered rules)
    assert own - set(CASES) == set(), "rules without a test case"
    assert set(CASES) - set(RULES) == set(), "test cases without a rule"


# The reverse sweep forms no order-N remainder at ops with several outputs (passes/differentiate.py):
# correct only while each is linear in its input given its indices. A new multi-output rule must be
# such a gather (then add it here) or the sweep must learn to contract per output first.
MULTI_OUTPUT_GATHERS = {
    aten.sort.default, aten.topk.default, aten.max.dim, aten.min.dim, aten.median.dim, aten.nanmedian.dim,
    aten.mode.default, aten.kthvalue.default, aten.cummax.default, aten.cummin.default,
    aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default, aten.max_pool3d_with_indices.default,
    aten.adaptive_max_pool3d.default,
}


def test_every_multi_output_rule_is_a_reviewed_gather():
    from hoad.rules import USER_OPS

    multi = {op for op in set(RULES) - USER_OPS if len(op._schema.returns) > 1}
    assert multi == MULTI_OUTPUT_GATHERS


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_rule(op, mode, monkeypatch):
    case = CASES[op]
    calls = []
    rule = RULES[op]

    def recording(ctx, *args, **kwargs):
        calls.append(ctx.keys)
        return rule(ctx, *args, **kwargs)

    monkeypatch.setitem(RULES, op, recording)
    vjp_calls = []
    vjp = VJPS[op]

    def recording_vjp(v, g, *args, **kwargs):
        vjp_calls.append(1)
        return vjp(v, g, *args, **kwargs)

    monkeypatch.setitem(VJPS, op, recording_vjp)
    options = {"mode": mode, **case.options}
    if case.tol is not None:
        import helpers

        monkeypatch.setattr(helpers, "assert_close", _loose(case.tol))
    check(case.fn, case.args, wrt=case.wrt, order=case.order, reference_fn=case.reference, **options)
    assert calls, f"{op} never reached its rule: the case does not exercise it"
    top = max(len(K) for keys in calls for K in keys)
    if mode == "forward":
        assert top == case.order
    else:  # orders < N forward, the top order from remainders (linear ops have none)
        assert vjp_calls, f"{op} never reached its VJP in the reverse sweep"
        assert top >= case.order - 1


def _loose(tol):
    import torch

    def assert_close(got, ref, what=""):
        assert got.shape == ref.shape, what
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=tol, atol=tol)

    return assert_close
