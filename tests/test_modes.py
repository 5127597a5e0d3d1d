"""Direction choice (the cost model), explain(), and the two directions agreeing."""

import pytest
import torch
from helpers import check, rand

import hoad

W3 = rand(64, 3, seed=11)
V64 = rand(64, 64, seed=12) / 8
W16 = rand(16, 64, seed=13) / 4


def wide(x):  # R^3 -> R^64: outputs outnumber inputs
    return torch.tanh(V64 @ torch.tanh(W3 @ x))


def scalar(x):  # R^16 -> R
    return torch.tanh(x @ W16).sum()


@pytest.mark.parametrize("order", [1, 2])
def test_cost_model_picks_forward_for_wide_outputs(order):
    # (at order 3 the adjoint form wins even here: its remainders absorb the lazy second-order
    # jets, measured 378 vs 480 µs eager for R^2 -> R^256, and the cost model picks it)
    e = hoad.compile(wide, order=order).explain(rand(3))
    assert e.direction == "forward"
    costs = e.build.stats["costs"]
    assert costs["forward"]["score"] < costs["reverse"]["score"]


@pytest.mark.parametrize("order", [1, 2, 3])
def test_cost_model_picks_reverse_for_scalar_outputs(order):
    e = hoad.compile(scalar, order=order).explain(rand(16))
    assert e.direction == "reverse"


def test_mode_overrides_the_cost_model():
    x = rand(16)
    assert hoad.compile(scalar, order=2, mode="forward").explain(x).direction == "forward"
    assert hoad.compile(wide, order=2, mode="reverse").explain(rand(3)).direction == "reverse"
    assert set(hoad.compile(scalar, order=2, mode="forward").explain(x).build.stats["costs"]) == {"forward"}


def _pair_energy(x):  # R^12 -> R over every pair: forward at order 3 is estimated 2-3x reverse
    return (x[:, None] - x[None, :]).sin().pow(2).sum()


def test_a_forced_direction_far_costlier_than_the_other_says_so(monkeypatch, caplog):
    """mode="forward" on a Lennard-Jones energy at order 4 cost 370x mode="auto" (19.9 s per call
    against 54 ms) and said nothing. Over about a GFLOP, the other direction is built for its
    estimate, and past 10x the log gives both (here both bounds lowered, to keep the build small:
    8 atoms at order 4 estimate 16x, with a 9 s build)."""
    import logging

    from hoad import pipeline

    monkeypatch.setattr(pipeline, "WEIGH_OTHER_SCORE", 0)
    monkeypatch.setattr(pipeline, "OTHER_COSTS_MORE", 1.5)
    x = rand(12)
    with caplog.at_level(logging.WARNING, logger="hoad"):
        e = hoad.compile(_pair_energy, order=3, mode="forward").explain(x)
    costs = e.build.stats["costs"]
    assert e.direction == "forward" and set(costs) == {"forward", "reverse"}
    ratio = costs["forward"]["score"] / costs["reverse"]["score"]
    said = [r.getMessage() for r in caplog.records if "mode='forward' is estimated" in r.getMessage()]
    assert ratio > 1.5 and len(said) == 1, (ratio, caplog.text)
    assert "mode='reverse' at" in said[0] and f"({ratio:.0f}x less)" in said[0], said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hoad"):  # the cheaper one forced: nothing to say
        e = hoad.compile(_pair_energy, order=3, mode="reverse").explain(x)
    assert "is estimated at" not in caplog.text and set(e.build.stats["costs"]) == {"forward", "reverse"}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_directions_agree_with_torch_func_on_wide_and_scalar(mode):
    check(wide, (rand(3),), order=3, mode=mode)
    check(scalar, (rand(16),), order=3, mode=mode)


def test_reverse_on_parameter_hessian_all_mixed_blocks():
    X = rand(6, 4, seed=3)
    y = torch.tensor([0, 2, 1, 1, 0, 2])

    def loss(W1, b1, W2):
        h = torch.tanh(X @ W1 + b1)
        return torch.nn.functional.cross_entropy(h @ W2, y)

    res, cf = check(loss, (rand(4, 5, seed=4), rand(5, seed=5), rand(5, 3, seed=6)), wrt=(0, 1, 2), order=2,
                    mode="reverse")
    assert cf.explain().direction == "reverse"


def test_explain_lists_blocks_costs_and_stages():
    x = rand(16)
    text = str(hoad.compile(scalar, order=2).explain(x))
    for word in ("block", "dense entries", "stored entries", "forward", "reverse", "chosen", "capture", "clean"):
        assert word in text
    e = hoad.explain(hoad.compile(lambda x: torch.sin(x).sum(), order=3), rand(5))
    rows = {row[1]: row for row in e.blocks_table()}
    # 125 dense entries, C(5 + 2, 3) = 35 unique (symmetric), 5 stored (the diagonal of sin's)
    assert rows["(x, x, x)"][2:5] == [125, 35, 5]
    assert "unique entries" in str(e)


def test_explain_under_inductor_and_of_operators():
    """explain() raised KeyError under Inductor, the default backend; an operator's explain()
    without arguments and hoad.explain of a biharmonic failed; a Taylor result had no repr."""
    x = rand(5, seed=7)
    text = str(hoad.compile(lambda x: x.sin().sum(), order=2, backend="inductor").explain(x))
    assert "inductor" in text and "kernels" in text
    W = rand(5, 3, seed=8)
    X = rand(4, 5, seed=9)

    def u(X):
        return torch.tanh(X @ W).sum(-1)

    lap = hoad.laplacian(u, batch_dim=0, backend="eager")
    lap(X)
    assert "diagonal" in str(lap.explain())
    assert "batch_dim=0" in str(hoad.explain(hoad.biharmonic(u, batch_dim=0, backend="eager"), X))
    taylor = hoad.taylor(lambda x: u(x[None])[0], order=2, directions=rand(3, 5, seed=10), backend="eager")(X[0])
    assert repr(taylor) == "TaylorResult(order=2, shapes=[(), (3,), (3,)])"


def test_non_scalar_output_reverse_sweep_is_batched():
    def f(x):
        return torch.stack([x.sin().sum(), (x * x).prod(), x.exp().mean()])

    res, cf = check(f, (rand(4),), order=3, mode="reverse")
    # one program whose adjoints carry the output axis: the output seed is an identity over f
    assert cf.explain().direction == "reverse"
    assert res[0, 0, 0].shape == (3, 4, 4, 4)
