"""The third order-2 candidate, forward mode over the gradient program (``passes/over_reverse.py``,
``mode="forward-over-reverse"``): every block equal to torch.func's, chosen by ``mode="auto"``
where it is the cheapest (a per-sample Hessian w.r.t. attention's input projection), refused
by name where it does not apply."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, check, rand, shared_parameter_reference
from torch import nn

import hoad

MODE = "forward-over-reverse"


def _f(x, w):  # R^4 x R^{4x3} -> R^2: mixed blocks, a non-scalar output
    h = torch.tanh(x @ w)
    return torch.stack([h.pow(3).sum(), (h.sin() * x[:3]).sum()])


def test_every_block_of_two_inputs_and_a_vector_output():
    check(_f, (rand(4, seed=1), rand(4, 3, seed=2)), wrt=(0, 1), order=2, mode=MODE, backend="eager")


def test_forced_it_builds_no_twin_with_jets_evaluated(monkeypatch):
    """A large program has its twin with jets evaluated built first, for the forward and reverse
    candidates it weighs: forced to forward-over-reverse, neither is built, nor the twin."""
    from hoad import pipeline

    monkeypatch.setattr(pipeline, "EVALUATED_SCORE", 0)  # (every program "large")
    cf = hoad.compile(_f, order=2, wrt=(0, 1), mode=MODE, backend="eager")
    cf(rand(4, seed=1), rand(4, 3, seed=2))
    build = cf.explain().build
    assert build.evaluated is None and set(build.stats["costs"]) == {MODE}


W = rand(5, 6, seed=3)


def test_per_sample_blocks_under_batch_dim():
    def energy(X):
        return torch.tanh(X @ W).pow(2).sum(-1) + X.prod(-1)

    check(energy, (rand(4, 5, seed=4),), order=2, mode=MODE, batch_dim=0, backend="eager")


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        torch.manual_seed(48)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.float64)

    def forward(self, X):
        return self.attn(X, X, X, need_weights=False)[0].pow(2).sum((1, 2))


NAMES = ["attn.in_proj_weight", "attn.in_proj_bias"]


# (inductor under -m slow: 25 s of cold compile in the default suite's 10 minutes; the eager case
# checks the same blocks, forced)
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_auto_chooses_it_for_attentions_input_projection_and_is_exact(backend):
    """Per-sample Hessians w.r.t. the packed input projection (216 entries): the head split makes
    the other two directions' blocks dense, so they sum P² products over every intermediate value.
    Under Inductor mode="auto" builds the third candidate and keeps it; the eager backend builds
    the other two only (its many small tangent ops cost more than estimated), and forced it is exact."""
    model, X = Attention(), rand(3, 3, 8, seed=5)
    auto = backend == "inductor"
    cf = hoad.compile(model, order=2, wrt=NAMES, batch_dim=0, backend=backend, mode="auto" if auto else MODE)
    with torch.no_grad():
        res = cf(X)
    assert cf.graph.program.direction == MODE
    if auto:
        costs = cf.explain().build.stats["costs"]
        assert set(costs) == {"forward", "reverse", MODE}
        assert costs[MODE]["score"] == min(c["score"] for c in costs.values())
    else:
        eager = hoad.compile(model, order=2, wrt=NAMES, batch_dim=0, backend="eager")
        with torch.no_grad():
            eager(X)
        assert eager.graph.program.direction != MODE and MODE not in eager.explain().build.stats["costs"]
    ref = shared_parameter_reference(model, NAMES, (X,), 2)
    for K, expected in ref.items():
        assert_close(res[tuple(NAMES[k] for k in K)], expected, f"block {K}")


def test_one_program_serves_every_number_of_samples():
    model = Attention()
    cf = hoad.compile(model, order=2, wrt=NAMES, batch_dim=0, backend="eager", mode=MODE)
    for count in (5, 7, 6):  # (counts that no other size of the model equals)
        X = rand(count, 3, 8, seed=10 + count)
        with torch.no_grad():
            res = cf(X)
        expected = shared_parameter_reference(model, NAMES, (X,), 2)[(0, 1)]
        assert_close(res[NAMES[0], NAMES[1]], expected, f"{count} samples")
    assert cf.graph.program.direction == MODE
    assert len({id(e) for e in cf._cache.values()}) == 2, "one program for 5 samples, one for every number"


@pytest.mark.parametrize("options, fragment", [
    (dict(order=3), "order 2 with every block.*not order=3"),
    (dict(order=2, diagonal=True), "not order=2, diagonal=True"),
])
def test_it_is_refused_where_it_does_not_apply(options, fragment):
    with pytest.raises(hoad.InvalidArgumentError, match=fragment):
        hoad.compile(_f, wrt=(0, 1), mode=MODE, **options)


def test_an_operator_refuses_it_by_name():
    with pytest.raises(hoad.InvalidArgumentError, match="or an operator's program"):
        hoad.laplacian(lambda X: X.sin().sum(-1), batch_dim=0, mode=MODE, backend="eager")(rand(3, 2))


def test_a_gradient_program_hoad_cannot_differentiate_is_named_when_forced_and_skipped_under_auto():
    """Convolution's VJP is an op of its own (convolution_backward), with no forward rule."""
    torch.manual_seed(49)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 1)).double()

    class Energy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, X):
            return self.net(X).squeeze(-1)

    X = rand(2, 1, 5, 5, seed=6)
    with pytest.raises(hoad.UnsupportedOperatorError, match="convolution_backward"):
        hoad.compile(Energy(), order=2, wrt=hoad.parameters, batch_dim=0, mode=MODE, backend="eager")(X)
    cf = hoad.compile(Energy(), order=2, wrt=hoad.parameters, batch_dim=0, backend="inductor")
    with torch.no_grad():
        cf(X)
    assert cf.graph.program.direction in ("forward", "reverse")
