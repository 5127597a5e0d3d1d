"""Training through derivatives: every result is differentiable by autograd with respect to every
tensor that requires grad (arguments, closed-over parameters, a decorated module's parameters),
under both backends, over several optimizer steps; closed-over tensors are read at every call.

The reference is plain autograd on the same maths (a Laplacian by two nested torch.autograd.grad).
"""

import collections
import copy

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, rand
from torch.func import hessian, vmap

import hoad

DT = torch.float64
# Inductor compiles cost seconds each: one program per backend and form
BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.inductor)]


def _net(seed=0, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1)).double()


def _laplacian_by_autograd(u, X):
    X = X.detach().requires_grad_(True)
    g, = torch.autograd.grad(u(X).sum(), X, create_graph=True)
    return sum(torch.autograd.grad(g[:, i].sum(), X, create_graph=True)[0][:, i] for i in range(X.shape[1]))


def _grads(params):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def _reference_grads(loss_fn, params):
    got = torch.autograd.grad(loss_fn(), params, allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(got, params)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinn_loss_trains_a_closed_over_network(backend):
    """The natural PINN code: a closure over the network, a Laplacian residual, optimizer steps."""
    net = _net()
    u = lambda X: net(X).squeeze(-1)  # noqa: E731
    lap = hoad.compile(u, order=2, batch_dim=0, diagonal=True, backend=backend)
    X, f = rand(16, 2, seed=1), rand(16, seed=2)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    params = list(net.parameters())
    for _step in range(3):
        opt.zero_grad()
        loss = ((lap(X)[0, 0].sum(-1) + f) ** 2).mean()
        loss.backward()
        expected = _reference_grads(lambda: ((_laplacian_by_autograd(u, X) + f) ** 2).mean(), params)
        for got, ref in zip(_grads(params), expected):
            assert_close(got, ref, "parameter gradient")
        opt.step()  # in place: the next call must see the new weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decorated_module_method_trains_its_parameters(backend):
    class Energy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3, 6), nn.Linear(6, 1)

        @hoad.compile(order=2, wrt="x", batch_dim=0, backend=backend)
        def energy(self, x):
            return self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)

    m = Energy().double()
    x = rand(5, 3, seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    params = list(m.parameters())
    for _step in range(2):
        opt.zero_grad()
        loss = m.energy(x)[0, 0].diagonal(dim1=1, dim2=2).sum()
        assert loss.requires_grad
        loss.backward()

        def plain(xb):
            return m.fc2(torch.tanh(m.fc1(xb))).squeeze(-1)

        expected = _reference_grads(lambda: _laplacian_by_autograd(plain, x).sum(), params)
        for got, ref in zip(_grads(params), expected):
            assert_close(got, ref, "parameter gradient")
        opt.step()


@pytest.mark.parametrize("backend", ["eager"])
def test_gradients_reach_explicit_arguments_and_non_wrt_inputs(backend):
    W = rand(3, 4, seed=4).requires_grad_(True)
    b = rand(4, seed=5).requires_grad_(True)

    def f(x, W, b):
        return torch.tanh(x @ W + b).sum(-1)

    x = rand(6, 3, seed=6)
    res = hoad.compile(f, order=2, wrt=0, batch_dim=0, backend=backend)(x, W, b)
    loss = res[0, 0].pow(2).sum() + res[0].sum()
    gW, gb = torch.autograd.grad(loss, (W, b))

    def reference():
        H = vmap(hessian(lambda xs: f(xs[None], W, b)[0]))(x)
        J = vmap(torch.func.grad(lambda xs: f(xs[None], W, b)[0]))(x)
        return H.pow(2).sum() + J.sum()

    rW, rb = torch.autograd.grad(reference(), (W, b))
    assert_close(gW, rW, "dL/dW")
    assert_close(gb, rb, "dL/db")


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward(backend):
    """A gradient penalty: the parameter gradient is itself differentiated."""
    W = rand(3, 4, seed=7).requires_grad_(True)

    def f(x):
        return (x @ W).tanh().sum(-1)

    x = rand(5, 3, seed=8)
    L = hoad.compile(f, order=2, batch_dim=0, backend=backend)(x)[0, 0].pow(2).sum()
    g, = torch.autograd.grad(L, W, create_graph=True)
    h, = torch.autograd.grad(g.pow(2).sum(), W)

    H = vmap(hessian(lambda xb: f(xb[None])[0]))(x)
    rg, = torch.autograd.grad(H.pow(2).sum(), W, create_graph=True)
    rh, = torch.autograd.grad(rg.pow(2).sum(), W)
    assert_close(g, rg, "gradient")
    assert_close(h, rh, "gradient of the gradient penalty")


def test_a_training_loop_lowers_the_loss():
    net = _net(seed=3)
    u = lambda X: net(X).squeeze(-1)  # noqa: E731
    lap = hoad.compile(u, order=2, batch_dim=0, diagonal=True)
    X = rand(32, 2, seed=9)
    target = (X ** 2).sum(-1) * 0 + 1.0  # Δu = 1
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _step in range(40):
        opt.zero_grad()
        loss = ((lap(X)[0, 0].sum(-1) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]


# ---------------------------------------------------------------- closed-over tensors are live
@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_updates_and_rebinding_of_closed_over_tensors(backend):
    state = {"W": rand(3, seed=10)}
    W = state["W"]

    def f(x):
        return (x * W).sin().sum()

    x = rand(3, seed=11)
    cf = hoad.compile(f, order=2, backend=backend)
    first = cf(x)[0, 0].clone()
    W.mul_(2.0)  # in place
    assert_close(cf(x)[0, 0], hessian(f)(x), "after an in-place update")
    assert not torch.allclose(first, cf(x)[0, 0])
    W = rand(3, seed=12)  # the closure cell now holds another tensor
    assert_close(cf(x)[0, 0], hessian(f)(x), "after rebinding")


GLOBAL_W = rand(3, seed=13)


def _reads_a_global(x):
    return (x * GLOBAL_W).exp().sum()


def test_a_rebound_global_is_seen_and_a_new_shape_traces_again():
    global GLOBAL_W
    cf = hoad.compile(_reads_a_global, order=2)
    x = rand(3, seed=14)
    cf(x)
    GLOBAL_W = rand(3, seed=15)
    assert_close(cf(x)[0, 0], hessian(_reads_a_global)(x), "after rebinding a global")
    GLOBAL_W = rand(1, seed=16)  # broadcasts: another program
    assert_close(cf(x)[0, 0], hessian(_reads_a_global)(x), "after a shape change")
    assert len(cf._cache) == 1  # the stale program was replaced, not kept beside


def test_a_module_parameter_replaced_by_a_new_one_is_seen():
    net = _net(seed=4, width=4)
    u = lambda X: net(X).sum()  # noqa: E731
    cf = hoad.compile(u, order=2)
    X = rand(2, 2, seed=17)
    cf(X)
    net[0].weight = nn.Parameter(rand(4, 2, seed=18))
    assert_close(cf(X)[0, 0], hessian(u)(X), "after replacing a parameter")


def test_hoisted_work_is_reused_until_the_weights_change():
    W = rand(4, 4, seed=19)
    cf = hoad.compile(lambda x: (x @ W).tanh().sum(), order=3)
    x = rand(4, seed=20)
    cf(x)
    prefix = cf._last.build.prefix
    assert prefix is not None, "W ⊗ W of the third-order remainder should be hoisted"
    calls = []
    run = prefix.run
    prefix.run = lambda *a: (calls.append(1), run(*a))[1]
    cf(x)
    cf(x)
    assert calls == []
    W.add_(0.5)
    assert_close(cf(x)[0, 0, 0], hessian_of_hessian(lambda x: (x @ W).tanh().sum(), x), "after an update")
    assert calls == [1]


def hessian_of_hessian(f, x):
    return torch.func.jacfwd(hessian(f))(x)


@pytest.mark.inductor
def test_batchnorm_running_statistics_update_once_per_call_under_training():
    """The compiled backward recomputes the forward on copies: the call stays the only update."""
    bn = nn.BatchNorm1d(3, dtype=DT).train()
    scale = rand(3, seed=21).requires_grad_(True)

    def f(X):
        return (bn(X) * scale).tanh().sum(1)

    cf = hoad.compile(f, order=1, backend="inductor")
    X = rand(4, 3, seed=22)
    cf(X)[0].sum().backward()
    once, mean = bn.num_batches_tracked.item(), bn.running_mean.clone()
    cf(X)[0].sum().backward()
    assert bn.num_batches_tracked.item() == once + 1
    assert_close(bn.running_mean, 0.9 * mean + 0.1 * X.mean(0), "one momentum update")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_tracing_does_not_update_buffers_and_leaves_them_without_a_graph(backend):
    """Batch norm in training mode adds 1 to num_batches_tracked in Python: the trace ran that for
    real, and the program replays it, so the first call counted twice (with momentum=None the
    running statistics were then wrong). Under autograd the written statistics carried a graph,
    and the module's next plain forward failed (and Inductor's training compile refused the
    write: no derivative for copy_). (momentum=None is refused: its factor 1/float(num_batches_tracked)
    reads a tensor's value, which the program kept, test_errors.py.)"""
    torch.manual_seed(46)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Tanh(), torch.nn.Linear(8, 1)).double().train()
    ref = copy.deepcopy(net)
    lap = hoad.laplacian(lambda x: net(x).sum(), backend=backend)
    for seed in (47, 147):
        X = rand(6, 3, seed=seed)
        lap(X).laplacian.backward()
        with torch.no_grad():
            ref(X)
    for got, want in zip(net[1].buffers(), ref[1].buffers()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not got.requires_grad
    net.eval()
    net(X)  # a plain forward still works


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retained_graph_runs_backward_twice(backend):
    """The caller's retain_graph=True: the second backward accumulates the same gradient."""
    W = rand(3, 4, seed=9).requires_grad_(True)

    def f(x):
        return (x @ W).tanh().sum(-1)

    x = rand(5, 3, seed=10)
    L = hoad.compile(f, order=2, batch_dim=0, backend=backend)(x)[0, 0].pow(2).sum()
    L.backward(retain_graph=True)
    once = W.grad.clone()
    L.backward()
    H = vmap(hessian(lambda xb: f(xb[None])[0]))(x)
    ref, = torch.autograd.grad(H.pow(2).sum(), W)
    assert_close(once, ref, "first backward")
    assert_close(W.grad, 2 * ref, "accumulated over two backwards")


@pytest.mark.inductor
@pytest.mark.inductor
def test_training_through_a_model_on_sets_of_points():
    """A Laplacian loss of nn.Linear layers on [B, N, d] samples through the Inductor program. Its
    compiled backward reads tensors of B·N rows only: with every size a symbol, Inductor failed to
    compile it (a raw InductorError at loss.backward()); now only the sample count may be one."""
    torch.manual_seed(31)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    params = list(net.parameters())

    def u(X):  # (B, N, 3) -> (B,)
        return net(X).squeeze(-1).pow(2).sum(-1)

    def laplacian(X):
        H = vmap(hessian(lambda x: u(x.unsqueeze(0)).squeeze(0)))(X)
        return H.flatten(1, 2).flatten(2).diagonal(dim1=1, dim2=2).sum(-1)

    X = rand(4, 5, 3, seed=32)
    (hoad.laplacian(u, batch_dim=0, backend="inductor")(X).laplacian ** 2).mean().backward()
    for got, ref in zip(_grads(params), _reference_grads(lambda: (laplacian(X) ** 2).mean(), params)):
        assert_close(got, ref, "parameter gradient")


def test_training_ignores_a_process_wide_cpp_wrapper():
    """torch._inductor.config.cpp_wrapper turned on by the user: the training compile pins it off
    (with it, the compiled program's outputs carried no autograd graph, and every gradient was
    silently zero)."""
    W = rand(3, 4, seed=11).requires_grad_(True)

    def f(x):
        return (x @ W).tanh().sum(-1)

    x = rand(5, 3, seed=12)
    with torch._inductor.config.patch(cpp_wrapper=True):
        L = hoad.compile(f, order=2, batch_dim=0, backend="inductor")(x)[0, 0].pow(2).sum()
        got, = torch.autograd.grad(L, W)
    H = vmap(hessian(lambda xb: f(xb[None])[0]))(x)
    ref, = torch.autograd.grad(H.pow(2).sum(), W)
    assert_close(got, ref, "gradient")


@pytest.mark.inductor
def test_a_plain_backward_calls_the_compiled_backward_directly(monkeypatch):
    """A plain backward runs the AOTAutograd program's backward node itself (no second run of the
    autograd engine); under the caller's retain_graph it goes through the engine, whose own run
    keeps no graph (the program's donated buffers require that)."""
    from hoad import training

    calls = []
    direct = training._compiled_backward
    monkeypatch.setattr(training, "_compiled_backward", lambda *a: calls.append(direct(*a)) or calls[-1])
    W = rand(3, 4, seed=13).requires_grad_(True)

    def f(x):
        return (x @ W).tanh().sum(-1)

    x = rand(5, 3, seed=14)
    H = vmap(hessian(lambda xb: f(xb[None])[0]))(x)
    ref, = torch.autograd.grad(H.pow(2).sum(), W)
    compiled = hoad.compile(f, order=2, batch_dim=0, backend="inductor")
    compiled(x)[0, 0].pow(2).sum().backward()
    assert calls and calls[-1] is not None
    assert_close(W.grad, ref, "gradient, direct")
    W.grad = None
    compiled(x)[0, 0].pow(2).sum().backward(retain_graph=True)
    assert calls[-1] is None
    assert_close(W.grad, ref, "gradient under retain_graph")


@pytest.mark.inductor
def test_the_training_program_computes_its_hoisted_part_itself():
    """Under autograd the hoisted prefix runs at every call anyway: the program AOTAutograd
    compiles takes the call's tensors alone and computes the prefix's values itself (no eager
    prefix, no autograd nodes of its own), with the same gradients."""
    net = _net(seed=5)
    u = lambda X: net(X).squeeze(-1)  # noqa: E731
    lap = hoad.compile(u, order=2, batch_dim=0, diagonal=True, backend="inductor")
    X, f = rand(12, 2, seed=6), rand(12, seed=7)
    params = list(net.parameters())
    loss = ((lap(X)[0, 0].sum(-1) + f) ** 2).mean()
    entry = lap._last
    assert entry.build.prefix is not None  # the weights' transposes etc. are hoisted for inference
    inputs = [n for n in entry.trainable.gm.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == len(entry.build.tensors) and not any(n.name.startswith("hoisted") for n in inputs)
    got = _reference_grads(lambda: loss, params)  # (the last bias has no gradient, as under autograd)
    expected = _reference_grads(lambda: ((_laplacian_by_autograd(u, X) + f) ** 2).mean(), params)
    for g, r in zip(got, expected):
        assert_close(g, r, "parameter gradient")


def _programs_calls(cf) -> list:
    return [n.target for n in cf._last.build.program.gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_loss_and_its_gradient_compile_to_one_program(backend):
    """hoad.compile(m.loss, order=1, wrt=hoad.parameters) of a loss through the module's own
    hoad.laplacian: the loss and every parameter's gradient from one program (no autograd), exact
    over optimizer steps. The nested Laplacian reads the parameters the outer trace binds, and
    its jets' products by each layer stay products by the weight (no bmm per point)."""

    class PINN(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net(width=6)
            self.lap = hoad.laplacian(self.u, batch_dim=0, backend=backend)

        def u(self, X):
            return self.net(X).squeeze(-1)

        def loss(self, X, f):
            return ((self.lap(X).laplacian + f) ** 2).mean()

    m = PINN()
    step = hoad.compile(m.loss, order=1, wrt=hoad.parameters, backend=backend)
    X, f = rand(12, 2, seed=1), rand(12, seed=2)
    opt = torch.optim.SGD(m.parameters(), lr=1e-1)
    params = dict(m.named_parameters())
    for _step in range(3):
        with torch.no_grad():
            res = step(X, f)
        expected = _reference_grads(lambda: ((_laplacian_by_autograd(m.u, X) + f) ** 2).mean(), list(params.values()))
        assert_close(res.value, ((_laplacian_by_autograd(m.u, X) + f) ** 2).mean().detach(), "loss")
        for (name, p), ref in zip(params.items(), expected):
            assert_close(res[name], ref, f"gradient of {name}")
            p.grad = res[name].clone()
        opt.step()  # in place: the next call must see the new weights
    assert torch.ops.aten.bmm.default not in _programs_calls(step)


# (SiLU under -m slow: the default suite keeps one smooth activation, 14 s of its 10 minutes)
@pytest.mark.parametrize("act", [pytest.param(nn.SiLU, marks=pytest.mark.slow), nn.GELU])
def test_a_biharmonic_loss_of_a_deep_smooth_net_compiles_to_one_program(act):
    """Through two hidden SiLU or GELU layers, the nested biharmonic's program, traced again,
    left a view of a value hoad's rules had permuted: an internal error. Checked against
    loss.backward() through the operator (its own eager programs under autograd)."""

    class Plate(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(9)
            self.net = nn.Sequential(nn.Linear(2, 8), act(), nn.Linear(8, 8), act(), nn.Linear(8, 1)).double()
            self.op = hoad.biharmonic(self.u, batch_dim=0, backend="eager")

        def u(self, X):
            return self.net(X).squeeze(-1)

        def loss(self, X):
            return (self.op(X).biharmonic ** 2).mean()

    m, X = Plate(), rand(7, 2, seed=10)
    with torch.no_grad():
        res = hoad.compile(m.loss, order=1, wrt=hoad.parameters, backend="eager")(X)
    params = dict(m.named_parameters())
    loss = m.loss(X)
    expected = torch.autograd.grad(loss, list(params.values()), allow_unused=True)  # (the last bias: Δ² drops it)
    assert_close(res.value, loss.detach(), "loss")
    for (name, p), ref in zip(params.items(), expected):
        assert_close(res[name], torch.zeros_like(p) if ref is None else ref, f"gradient of {name}")


def test_a_laplacian_built_inside_a_compiled_loss_reads_the_traced_parameters():
    """The operator built inside the traced function, closing over that trace's tensors."""

    def tanh_mlp(ps, x):
        return (torch.tanh(x @ ps[0] + ps[1]) @ ps[2] + ps[3]).squeeze(-1)

    X, f = rand(10, 2, seed=3), rand(10, seed=4)
    params = [rand(2, 5, seed=5), rand(5, seed=6), rand(5, 1, seed=7), rand(1, seed=8)]

    def loss(*ps):
        lap = hoad.laplacian(lambda x: tanh_mlp(ps, x), batch_dim=0, backend="eager")
        return ((lap(X).laplacian + f) ** 2).mean()

    res = hoad.compile(loss, order=1, wrt=(0, 1, 2, 3), backend="eager")(*params)
    leaves = [p.clone().requires_grad_() for p in params]
    expected = _reference_grads(lambda: ((_laplacian_by_autograd(lambda x: tanh_mlp(leaves, x), X) + f) ** 2).mean(),
                                leaves)
    for i, ref in enumerate(expected):
        assert_close(res[i], ref, f"gradient {i}")


def test_an_operator_holding_a_traced_value_builds_again_in_the_next_trace():
    """An operator that reads a traced value through an object hoad does not follow (a deque)
    holds that value; when the compiled loss traces again (a new shape of another argument), the
    held value belongs to the old trace: the operator builds again (before, the new program read
    the old trace's fake tensor and returned garbage)."""
    holder = collections.deque(maxlen=1)
    X = rand(5, 2, seed=9)
    lap = hoad.laplacian(lambda x: torch.tanh(x @ holder[0]).sum(-1), batch_dim=0, backend="eager")

    def loss(W, f):
        holder.append(W)
        return (lap(X).laplacian * f.sum()).sum()

    step = hoad.compile(loss, order=1, backend="eager")
    W = rand(2, 3, seed=10)
    for f in (rand(1, seed=11), rand(2, seed=12)):  # the second shape traces the loss again
        leaf = W.clone().requires_grad_()
        expected, = torch.autograd.grad((_laplacian_by_autograd(lambda x: torch.tanh(x @ leaf).sum(-1), X)
                                         * f.sum()).sum(), leaf)
        assert_close(step(W, f)[0], expected, "gradient")


@pytest.mark.parametrize("transform", ["grad", "jacrev", "jvp", "vmap"])
def test_a_first_call_under_a_torch_func_transform(transform):
    """Traced inside torch.func.grad (jacrev, jvp), the program saw the transform's wrappers: every
    derivative through it was 0, and later plain calls returned the trace's fake tensors."""
    P = rand(6, 2, seed=120)
    W = rand(2, 4, seed=121)

    def u(P, W):
        return torch.tanh(P @ W).sum(-1)

    def laplacians(W):  # the reference: traces of per-sample Hessians
        return vmap(hessian(lambda x: u(x[None], W)[0]))(P).diagonal(dim1=1, dim2=2).sum(-1)

    lap = hoad.laplacian(u, batch_dim=0, backend="eager")
    if transform == "grad":
        got, want = (torch.func.grad(lambda W: f(W).pow(2).sum())(W)
                     for f in (lambda W: lap(P, W).laplacian, laplacians))
    elif transform == "jacrev":
        got, want = (torch.func.jacrev(f)(W) for f in (lambda W: lap(P, W).laplacian, laplacians))
    elif transform == "jvp":
        got, want = (torch.func.jvp(f, (W,), (torch.ones_like(W),))[1]
                     for f in (lambda W: lap(P, W).laplacian, laplacians))
    else:
        Ws = torch.stack([W, 2 * W])
        got, want = (vmap(f)(Ws) for f in (lambda W: lap(P, W).laplacian, laplacians))
    assert_close(got, want, transform)
    assert type(lap(P, W).laplacian) is torch.Tensor
    assert_close(lap(P, W).laplacian, laplacians(W), "a plain call afterwards")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_parameter_the_loss_does_not_reach_gets_no_gradient(backend):
    """The last bias does not enter a Laplacian. Under Inductor its .grad was a zero tensor (the
    compiled backward's), not None as autograd gives, and AdamW's weight decay then moved it."""
    torch.manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    lap = hoad.laplacian(lambda P: net(P).squeeze(-1), batch_dim=0, backend=backend)
    (lap(rand(16, 2, seed=122)).laplacian ** 2).mean().backward()
    assert net[2].bias.grad is None
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0


def test_torch_func_transforms_over_an_inductor_program():
    """torch.func.grad and vmap over an Inductor program failed with raw torch errors (compiled
    kernels take plain tensors); they run an eager twin. A batched backward is a clear error."""
    torch.manual_seed(10)
    net = torch.nn.Sequential(torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()
    P = rand(8, 2, seed=123)
    u = lambda P, params: torch.func.functional_call(net, params, (P,)).squeeze(-1)  # noqa: E731
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    lap = hoad.laplacian(u, batch_dim=0, backend="inductor")

    def reference(params):
        return vmap(hessian(lambda x: u(x[None], params)[0]))(P).diagonal(dim1=1, dim2=2).sum(-1)

    loss = lambda params: (lap(P, params).laplacian ** 2).mean()  # noqa: E731
    loss(params)  # the Inductor program first
    got, want = torch.func.grad(loss)(params), torch.func.grad(lambda p: (reference(p) ** 2).mean())(params)
    for n in got:
        assert_close(got[n], want[n], n)
    assert_close(vmap(lambda x: lap(x[None], params).laplacian[0])(P), reference(params), "vmap")
    live = dict(net.named_parameters())
    r = hoad.laplacian(lambda P: net(P).squeeze(-1), batch_dim=0, backend="inductor")(P).laplacian
    with pytest.raises(hoad.ExecutionError, match="is_grads_batched"):
        torch.autograd.grad(r, live["0.weight"], grad_outputs=torch.eye(8, dtype=torch.float64), is_grads_batched=True)


def test_a_parameter_a_transform_wraps_read_without_being_passed_is_named():
    """grad of a functional_call loss whose module's operator reads the module's own parameters
    (swapped for torch.func's wrappers): a CaptureError wrapping functorch's internal assert
    ("wrapper == nullptr"). It names the tensor and the way out (pass them, as above)."""
    torch.manual_seed(12)

    class Field(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
            self.lap = hoad.laplacian(lambda P: self.net(P).squeeze(-1), batch_dim=0, backend="eager")

        def forward(self, P):
            return (self.lap(P).laplacian ** 2).mean()

    field, P = Field(), rand(5, 2, seed=125)
    params = {n: p.detach().clone() for n, p in field.named_parameters()}
    with pytest.raises(hoad.CaptureError, match="a torch.func transform wraps.*as arguments"):
        torch.func.grad(lambda ps: torch.func.functional_call(field, ps, (P,)))(params)


def test_a_torch_compiled_training_step_calls_hoad_through_a_graph_break():
    """Dynamo traced into hoad's call on the first call (InternalTorchDynamoError); hoad's calls
    are graph breaks, and the loss and its gradients are those of the plain step."""
    torch._dynamo.reset()
    torch.manual_seed(11)
    net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    lap = hoad.laplacian(lambda P: net(P).squeeze(-1), batch_dim=0, backend="eager")
    P = rand(16, 2, seed=124)

    def step(P):
        return ((lap(P).laplacian + 1) ** 2).mean()

    compiled = torch.compile(step, backend="eager")
    got = torch.autograd.grad(compiled(P), list(net.parameters()), allow_unused=True)
    want = torch.autograd.grad(step(P), list(net.parameters()), allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.allclose(g, w, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.inductor
def test_a_compiled_backward_lays_gradients_out_as_their_parameters():
    """A (1, 8) weight's gradient came back with strides (1, 1) for the weight's (8, 1): the same
    memory, but DDP's buckets compare strides and warned "Grad strides do not match bucket view
    strides" (and copied) at every step. The compiled backward now returns the parameter's layout."""
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    lap = hoad.laplacian(lambda X: net(X).squeeze(-1), batch_dim=0, backend="inductor")
    X = rand(16, 2, seed=731)
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        (lap(X).laplacian ** 2).mean().backward()
    assert [p.grad.stride() for p in net.parameters() if p.grad is not None] == \
        [p.stride() for p in net.parameters() if p.grad is not None]
