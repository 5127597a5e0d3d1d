"""@hoad.compile on nn.Module methods: parameters and buffers are live inputs and wrt targets."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, rand
from torch.func import functional_call, hessian, jacfwd, jacrev, vmap

import hoad

DT = torch.float64


class Classifier(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(3, 5, dtype=DT)
        self.norm = nn.LayerNorm(5, dtype=DT)
        self.fc2 = nn.Linear(5, 2, dtype=DT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))

    @hoad.compile(order=2, wrt=("x", "fc1.weight"))
    def energy(self, x):
        return self(x).pow(2).sum()

    @hoad.compile(order=2, wrt=hoad.parameters)
    def loss(self, x, y):
        return F.cross_entropy(self(x), y)


class PlainLayerNorm(nn.Module):
    """nn.LayerNorm in plain ops, for references: torch.func's second derivatives through
    F.layer_norm are wrong in the (weight, input) block on torch 2.13 (both forward-over-reverse
    and reverse-over-reverse disagree with the same maths in plain ops, and with each other)."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, h):
        mean = h.mean(-1, keepdim=True)
        var = ((h - mean) ** 2).mean(-1, keepdim=True)
        return (h - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _twin(m: nn.Module) -> nn.Module:
    """``m`` with every LayerNorm computed in plain ops (same parameter names and values)."""
    import copy

    twin = copy.deepcopy(m)
    for name, child in list(twin.named_children()):
        if isinstance(child, nn.LayerNorm):
            setattr(twin, name, PlainLayerNorm(child))
    return twin


def reference(m, method, args, names, order):
    """Nested torch.func over functional_call, w.r.t. the named inputs/parameters."""
    m = _twin(m)
    params = {k: v.detach() for k, v in m.named_parameters()}
    arg_names = ["x", "y"][: len(args)]
    init = [args[arg_names.index(n)] if n in arg_names else params[n] for n in names]

    def f(*vals):
        p = dict(params)
        a = list(args)
        for n, v in zip(names, vals):
            if n in arg_names:
                a[arg_names.index(n)] = v
            else:
                p[n] = v
        return functional_call(m, p, tuple(a), strict=False) if method == "forward" else \
            _call_method(m, p, method, a)

    g = jacrev(f, argnums=tuple(range(len(names))))
    out = {1: g(*init)}
    for k in range(2, order + 1):
        g = jacfwd(g, argnums=tuple(range(len(names))))
        out[k] = g(*init)
    return out


def _call_method(m, p, method, a):
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(m, p):
        return getattr(type(m), method).fn(m, *a) if isinstance(getattr(type(m), method), hoad.Compiled) else \
            getattr(m, method)(*a)


def test_inputs_parameters_and_mixed_blocks():
    m = Classifier()
    x = rand(4, 3)
    res = m.energy(x)
    ref = reference(m, "energy", (x,), ["x", "fc1.weight"], 2)
    assert_close(res["x"], ref[1][0], "d/dx")
    assert_close(res["fc1.weight"], ref[1][1], "d/dW1")
    assert_close(res["x", "fc1.weight"], ref[2][0][1], "mixed")
    assert_close(res["fc1.weight", "x"], ref[2][1][0], "mixed, other order")
    assert_close(res["fc1.weight", "fc1.weight"], ref[2][1][1], "d2/dW1^2")


def test_all_parameters_shorthand_and_loss_with_labels():
    m = Classifier(seed=1)
    x, y = rand(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
    res = m.loss(x, y)
    names = [n for n, _ in m.named_parameters()]
    assert res.wrt == names
    ref = reference(m, "loss", (x, y), names, 2)
    for i, a in enumerate(names):
        assert_close(res[a], ref[1][i], a)
        for j, b in enumerate(names):
            assert_close(res[a, b], ref[2][i][j], f"{a}, {b}")


def test_all_parameters_follow_requires_grad_at_each_call():
    """hoad.parameters was expanded at the first call: a parameter frozen later stayed in wrt."""
    m = Classifier(seed=1)
    x, y = rand(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
    first = next(iter(m.parameters()))
    names = [n for n, _ in m.named_parameters()]
    assert m.loss(x, y).wrt == names
    first.requires_grad_(False)
    try:
        assert m.loss(x, y).wrt == names[1:]
    finally:
        first.requires_grad_(True)
    assert m.loss(x, y).wrt == names


def test_parameters_are_read_at_call_time_without_retracing():
    m = Classifier()
    x = rand(4, 3)
    m.energy(x)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x).sum().backward()
    opt.step()
    with torch.no_grad():
        m.fc2.weight.mul_(2.0)
    res = m.energy(x)
    assert len(m.energy._cache) == 1, "an in-place parameter update must not retrace"
    ref = reference(m, "energy", (x,), ["x", "fc1.weight"], 2)
    assert_close(res["x", "x"], ref[2][0][0], "after the update")
    assert_close(res.value, m(x).pow(2).sum(), "value after the update")


def test_two_instances_never_share_results():
    a, b = Classifier(seed=1), Classifier(seed=2)
    x = rand(4, 3)
    ra, rb = a.energy(x), b.energy(x)
    assert a.energy is not b.energy
    assert not torch.allclose(ra["x", "x"], rb["x", "x"])
    assert_close(rb["x", "x"], reference(b, "energy", (x,), ["x", "fc1.weight"], 2)[2][0][0], "second instance")


def test_module_moved_to_float32():
    m = Classifier()
    x = rand(4, 3)
    ref = m.energy(x)["x", "x"]
    m.float()
    res = m.energy(x.float())
    assert res["x", "x"].dtype == torch.float32
    torch.testing.assert_close(res["x", "x"], ref.float(), rtol=1e-4, atol=1e-4)


def test_graph_placeholders_include_parameters():
    m = Classifier()
    m.energy(rand(4, 3))
    signature = next(line for line in str(m.energy.graph).splitlines() if line.startswith("def program("))
    for name in ("fc1_weight", "fc1_bias", "norm_weight", "fc2_weight", "x"):
        assert name in signature, name


def test_train_mode_dropout_raises_and_eval_mode_works():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3, dtype=DT)
            self.drop = nn.Dropout(0.5)

        @hoad.compile(order=2)
        def forward(self, x):
            return self.drop(self.fc(x)).tanh().sum()

    m = Drop()
    x = rand(2, 3)
    with pytest.raises(hoad.RandomnessError, match="eval"):
        m(x)
    m.eval()
    res = m(x)
    assert_close(res[0, 0], torch.func.hessian(lambda x: m.fc(x).tanh().sum())(x), "eval-mode dropout is identity")


def test_batchnorm_train_mode_differentiates_through_batch_statistics():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3, dtype=DT)

        @hoad.compile(order=2)
        def forward(self, x):
            return self.bn(x).tanh().pow(2).sum()

    m = Net().train()
    x = rand(5, 3)
    before = m.bn.running_mean.clone()
    res = m(x)

    def plain(x):  # batch statistics, as training-mode batchnorm computes them
        mean = x.mean(0)
        var = ((x - mean) ** 2).mean(0)
        return ((x - mean) / torch.sqrt(var + m.bn.eps)).tanh().pow(2).sum()

    assert_close(res[0], jacrev(plain)(x), "gradient through batch statistics")
    assert_close(res[0, 0], torch.func.hessian(plain)(x), "Hessian through batch statistics")
    assert not torch.equal(m.bn.running_mean, before), "running statistics update as in a normal call"


def test_sequential_and_multihead_attention_inside():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4, dtype=DT), nn.GELU(), nn.LayerNorm(4, dtype=DT))
    attn = nn.MultiheadAttention(4, 2, batch_first=True, dtype=DT).eval()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq, self.attn = seq, attn

        def forward(self, x):
            h = self.seq(x)
            return self.attn(h, h, h, need_weights=False)[0].sin().sum()

    blk = Block().eval()
    x = rand(1, 3, 4)
    cf = hoad.compile(blk, order=2, wrt=("x", "attn.in_proj_weight"))
    res = cf(x)
    params = {k: v.detach() for k, v in blk.named_parameters()}

    def f(x, w):
        p = dict(params)
        p["attn.in_proj_weight"] = w
        return functional_call(blk, p, (x,))

    w = params["attn.in_proj_weight"]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # torch.func has no forward AD through the fused CPU kernel
        assert_close(res["x"], jacrev(f)(x, w), "d/dx")
        assert_close(res["x", "x"], jacfwd(jacrev(f))(x, w), "d2/dx2")
        assert_close(res["x", "attn.in_proj_weight"], jacfwd(jacrev(f), argnums=1)(x, w), "mixed")


def test_bound_method_and_errors():
    m = Classifier()
    x = rand(4, 3)
    cf = hoad.compile(m.energy.fn.__get__(m), order=1, wrt="fc2.bias")
    assert_close(cf(x)["fc2.bias"], reference(m, "energy", (x,), ["fc2.bias"], 1)[1][0], "bound method")
    with pytest.raises(hoad.InvalidArgumentError, match="valid names"):
        hoad.compile(m, order=1, wrt="fc3.weight")
    with pytest.raises(hoad.InvalidArgumentError, match="module"):
        hoad.compile(lambda x: x.sum(), order=1, wrt=hoad.parameters)(x)
    with pytest.raises(hoad.InvalidArgumentError, match="self"):
        Classifier.energy(x)


def test_a_method_whose_first_parameter_is_not_named_self():
    """wrt names a parameter of the module; the decorator cannot check it against the signature
    before an instance binds the method (it refused it as no argument of the function)."""

    class Net(nn.Module):
        def __init__(this):
            super().__init__()
            this.W = nn.Parameter(rand(3, 3, seed=4))

        @hoad.compile(order=2, wrt=("x", "W"), backend="eager")
        def energy(this, x):
            return torch.tanh(x @ this.W).square().sum()

        @hoad.compile(order=1, wrt="Q", backend="eager")
        def wrong(this, x):
            return x.sum()

    net, x = Net(), rand(3, seed=5)
    f = lambda x, w: torch.tanh(x @ w).square().sum()  # noqa: E731
    assert_close(net.energy(x)["x", "W"], jacfwd(jacrev(f), argnums=1)(x, net.W.detach()), "mixed")
    with pytest.raises(hoad.InvalidArgumentError, match=r"valid names are \('x', 'W'\)"):
        net.wrong(x)


class HoldsDrawnAndPerPoint(nn.Module):
    """Operators whose directions are drawn at every call, given per point, or bent into curves."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
        self.V, self.V2 = rand(2, 3, seed=9), rand(2, 3, seed=10)
        self.drawn = hoad.laplacian(self.u, batch_dim=0, randomization=("rademacher", 3),
                                    generator=torch.Generator().manual_seed(11), backend="eager")
        self.per = hoad.laplacian(self.u, batch_dim=0, factor=self.factor, backend="eager")
        self.curves = hoad.taylor(self.u, order=2, batch_dim=0, directions=self.V, higher=(self.V2,), backend="eager")

    def u(self, x):
        return self.net(x).squeeze(-1)

    def factor(self, X):  # (B, 3, 2)
        return torch.stack([X, X.flip(-1)], -1)


def _halved_copy(m: nn.Module, how: str) -> nn.Module:
    """A copy of ``m`` made by ``how`` (deepcopy, or torch.save and load), its weights halved."""
    import copy
    import io

    if how == "deepcopy":
        twin = copy.deepcopy(m)
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    return twin


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_module_differentiates_the_copy_with_drawn_and_per_point_directions(how):
    """A randomized operator's copy failed to deep-copy (c9cd3f5's lock) and to pickle (a local
    function, before it), as did pickling operators with directions per point; each copy now
    differentiates the copy's network, each original its own."""
    m, X = HoldsDrawnAndPerPoint(), rand(4, 3, seed=12)
    m.drawn(X), m.per(X), m.curves(X)
    twin = _halved_copy(m, how)
    for name, module in (("copy", twin), ("original", m)):
        H = vmap(hessian(lambda x: module.u(x[None])[0]))(X)
        g = vmap(torch.func.grad(lambda x: module.u(x[None])[0]))(X)
        drawn = module.drawn(X).laplacian
        V = module.drawn.directions
        assert_close(drawn, torch.einsum("sd,bde,se->b", V, H, V) / 3, f"{how}, {name}: drawn")
        L = module.factor(X)
        assert_close(module.per(X).laplacian, torch.einsum("bds,bde,bes->b", L, H, L), f"{how}, {name}: per point")
        want = torch.einsum("sd,bde,se->bs", module.V, H, module.V) + g @ module.V2.T
        assert_close(module.curves(X)[2], want, f"{how}, {name}: curves")


class HoldsOperators(nn.Module):
    """The guide's pattern: operators of ``self.u`` built in __init__."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
        self.lap = hoad.laplacian(self.u, batch_dim=0, backend="eager")
        self.bih = hoad.biharmonic(self.u, batch_dim=0, backend="eager")
        self.hess = hoad.compile(self.u, order=2, batch_dim=0, backend="eager")

    def u(self, x):
        return self.net(x).squeeze(-1)


@pytest.mark.parametrize("when", ["before the first call", "after calls and an update"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_module_differentiates_the_copy(how, when):
    """A deep copy before the first call differentiated the original module (its program closed
    over the original's u); after a biharmonic call deepcopy and torch.save failed (a local
    function, a getset_descriptor)."""
    m, X = HoldsOperators(), rand(4, 3, seed=7)
    if when != "before the first call":
        m.lap(X), m.bih(X), m.hess(X)
        with torch.no_grad():
            m.net[0].weight.add_(0.1)
        m.bih(X)
    twin = _halved_copy(m, how)

    def lap_of(module):
        def one(x):
            return module.u(x[None])[0]

        return torch.func.vmap(lambda x: torch.func.hessian(one)(x).diagonal().sum())(X)

    for module in (twin, m):
        want = lap_of(module)
        assert_close(module.lap(X).laplacian, want, f"{how} {when}: laplacian")
        assert_close(module.bih(X).laplacian, want, f"{how} {when}: biharmonic's Δu")
        assert_close(module.hess(X)[0, 0].diagonal(dim1=1, dim2=2).sum(-1), want, f"{how} {when}: Hessian")


class DecoratedOperators(nn.Module):
    """The operators and hoad.compile as method decorators, as ``hoad.compile`` is one."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)

    def forward(self, x):
        return self.net(x).squeeze(-1)

    @hoad.laplacian
    def lap(self, x):
        return self(x)

    @hoad.biharmonic(batch_dim=0, backend="eager")
    def bih(self, x):
        return self(x)

    @hoad.taylor(order=2, directions=torch.eye(3, dtype=DT), batch_dim=0, backend="eager")
    def jets(self, x):
        return self(x)

    @hoad.compile(order=2, batch_dim=0, backend="eager")
    def hess(self, x):
        return self(x)


def test_operators_decorate_methods_and_a_saved_module_keeps_working():
    """``@hoad.laplacian`` on a method said "decorate a method of a class and call it on an
    instance", which the user had done; ``@hoad.laplacian(batch_dim=0)`` was a raw TypeError;
    torch.save of a module whose decorated method ran raised a PicklingError."""
    import io

    X = rand(4, 3, seed=8)
    a, b = DecoratedOperators(1), DecoratedOperators(2)
    for m in (a, b, a):
        want = torch.func.vmap(lambda x: torch.func.hessian(lambda x: m(x[None])[0])(x).diagonal().sum())(X)
        assert_close(m.lap(X[0]).laplacian, want[0], "laplacian of one point")
        assert_close(m.bih(X).laplacian, want, "biharmonic's Δu")
        assert_close(m.jets(X)[2].sum(-1), want, "taylor")
        assert_close(m.hess(X)[0, 0].diagonal(dim1=1, dim2=2).sum(-1), want, "Hessian")
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    with torch.no_grad():
        twin.net[0].weight.mul_(0.5)
    for m in (twin, a):
        want = torch.func.vmap(lambda x: torch.func.hessian(lambda x: m(x[None])[0])(x).diagonal().sum())(X)
        assert_close(m.bih(X).laplacian, want, "after torch.save")
        assert_close(m.hess(X)[0, 0].diagonal(dim1=1, dim2=2).sum(-1), want, "Hessian after torch.save")


def test_an_operator_of_a_lambda_in_a_class_body_is_no_method():
    """``lap = hoad.laplacian(lambda x: …)`` in a class body was bound to the instance (its x
    taken for self): "wrt=0 but <lambda> takes 0 positional arguments"."""
    class Solver:
        lap = hoad.laplacian(lambda x: (x ** 3).sum(-1), batch_dim=0, backend="eager")

    X = rand(4, 3, seed=14)
    assert_close(Solver().lap(X).laplacian, (6 * X).sum(-1), "through an instance")


def test_a_shallow_copy_of_an_object_differentiates_the_copy():
    """copy.copy shares the instance's dict, and with it the original's compiled method: the copy's
    calls read the original's values."""
    import copy

    class Scaled:
        def __init__(self, w):
            self.w = w

        @hoad.compile(order=1, backend="eager")
        def e(self, x):
            return (x * self.w).sum()

    x = rand(3, seed=9)
    p = Scaled(torch.ones(3, dtype=DT))
    p.e(x)
    q = copy.copy(p)
    q.w = torch.full((3,), 3.0, dtype=DT)
    assert_close(q.e(x)[0], q.w, "the copy's gradient")
    assert_close(p.e(x)[0], p.w, "the original's gradient")


def test_warnings_name_the_decorated_method(caplog):
    """A plain object's decorated method is bound as ``functools.partial(method, self)``, and an
    operator's as a wrapper: warnings said "partial reads tensors ..." and
    "_wrapper.<locals>.wrapped reads tensors ..."."""
    import collections
    import logging

    class Holder:
        def __init__(self):
            self.box = collections.deque([torch.ones(3, dtype=DT)])  # (a container hoad does not follow)

        @hoad.compile(order=1, backend="eager")
        def e(self, x):
            return (self.box[0] * x).sum()

        @hoad.laplacian(backend="eager")
        def u(self, x):
            return (self.box[0] * x).sin().sum()

    h = Holder()
    with caplog.at_level(logging.WARNING, logger="hoad"):
        h.e(rand(3, seed=9))
        h.u(rand(3, seed=9))
    said = [r.getMessage() for r in caplog.records if "reads tensors" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("hoad: test_warnings_name_the_decorated_method.<locals>.Holder.e reads"), said
    assert said[1].startswith("hoad: test_warnings_name_the_decorated_method.<locals>.Holder.u reads"), said


def test_an_object_with_slots_is_read_afresh():
    """A ``__slots__`` object's attributes were not followed: rebinding ``self.w`` or changing
    ``self.k`` kept the traced values (gradient 2 where 10, then 15, is right)."""

    class Slotted:
        __slots__ = ("w", "__k", "__weakref__")  # (a private slot is stored as _Slotted__k)

        def __init__(self):
            self.w, self.__k = torch.ones(3, dtype=DT), 2.0

        def scale(self, k):
            self.__k = k

        @hoad.compile(order=1, backend="eager")
        def e(self, x):
            return (self.w * x * self.__k).sum()

    x = rand(3, seed=9)
    s = Slotted()
    assert_close(s.e(x)[0], torch.full((3,), 2.0, dtype=DT), "first call")
    s.w = torch.full((3,), 5.0, dtype=DT)
    assert_close(s.e(x)[0], torch.full((3,), 10.0, dtype=DT), "w rebound")
    s.scale(3.0)
    assert_close(s.e(x)[0], torch.full((3,), 15.0, dtype=DT), "k changed")


@pytest.mark.parametrize("decorator", ["compile", "laplacian"])
def test_a_decorated_method_on_slots_without_weakref_is_refused(decorator):
    """hoad keeps each instance's program on it or in a weak table; an object with neither
    ``__dict__`` nor ``__weakref__`` was torch's raw TypeError "cannot create weak reference"."""
    wrap = hoad.compile(order=1, backend="eager") if decorator == "compile" else hoad.laplacian(backend="eager")

    class Slotted:
        __slots__ = ("w",)

        def __init__(self):
            self.w = torch.ones(3, dtype=DT)

        @wrap
        def e(self, x):
            return (self.w * x).sin().sum()

    with pytest.raises(hoad.InvalidArgumentError, match="add '__weakref__' to Slotted.__slots__"):
        Slotted().e(rand(3, seed=9))


def test_a_new_program_for_a_train_eval_switch_says_so(caplog):
    """The log said "called with a new signature (tensors …)" listing the same shapes as before."""
    import logging

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh()).to(DT)
    cf = hoad.compile(net, order=1, wrt=hoad.parameters, backend="eager")
    x = rand(5, 3, seed=11)
    cf(x)
    with caplog.at_level(logging.INFO, logger="hoad"):
        net.eval()
        cf(x)
        net[0].weight.requires_grad_(False)
        cf(x)
    said = [r.getMessage() for r in caplog.records if "compiling program" in r.getMessage()]
    assert len(said) == 2 and not any("new signature" in m for m in said), said
    assert "train() and eval()" in said[0] and "require grad" in said[1], said


def test_a_call_inside_parametrize_cached_leaves_torch_cache_alone():
    """Tracing inside ``parametrize.cached()`` stored fake tensors in torch's cache (the model's
    next plain call returned one) and read the weight cached before it as a constant."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).T

    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).to(DT)
    parametrize.register_parametrization(net[0], "weight", Symmetric())
    x = rand(2, 3, seed=10)
    loss = lambda params: functional_call(net, params, (x,)).sum()  # noqa: E731
    want = torch.func.grad(loss)(dict(net.named_parameters()))
    with parametrize.cached():
        before = net(x).sum()
        res = hoad.compile(net, order=1, wrt=hoad.parameters, backend="eager")(x)
        after = net(x).sum()
    assert type(after) is torch.Tensor and float(after) == float(before)
    for name, g in want.items():
        assert_close(res[name].sum((0, 1)), g, name)


class SmallCNN(nn.Module):
    """Conv2d + MaxPool2d + AvgPool2d + Linear: the layer ops of issue 17 in one model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(2, 3, 3, padding=1, dtype=DT)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(3, 2, 2, groups=1, dtype=DT)
        self.fc = nn.Linear(2, 2, dtype=DT)

    def forward(self, x):
        h = self.pool(torch.tanh(self.conv(x)))
        h = F.adaptive_avg_pool2d(torch.tanh(self.conv2(h)), 1).flatten(1)
        return self.fc(h)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_small_cnn_hessians_against_torch_func(mode):
    m = SmallCNN()
    x = rand(2, 2, 4, 4)
    names = ["x", "conv.weight", "conv.bias"]
    got = hoad.compile(m, order=2, wrt=tuple(names), mode=mode)(x)
    ref = reference(m, "forward", (x,), names, 2)
    for i, a in enumerate(names):
        assert_close(got[a], ref[1][i], f"d/d{a}")
        for j, b in enumerate(names):
            assert_close(got[a, b], ref[2][i][j], f"d2/d{a}d{b}")
    loss = lambda x: m(x).pow(2).sum()  # noqa: E731
    assert_close(hoad.compile(loss, order=2, mode=mode)(x)[0, 0], jacfwd(jacrev(loss))(x), "loss Hessian")


def test_embedding_hessians_and_per_sample_cnn():
    torch.manual_seed(4)
    emb = nn.Embedding(5, 3, padding_idx=0, dtype=DT)
    head = nn.Linear(3, 1, dtype=DT)
    tokens = torch.tensor([[1, 0, 4], [2, 2, 3]])

    def f(w):
        return head(torch.tanh(F.embedding(tokens, w, padding_idx=0)).mean(1)).pow(2).sum()

    # The padding row is a constant (torch's backward gives it no gradient). torch's forward mode
    # ignores padding_idx, so jacfwd(jacrev(f)) is not even symmetric; the reference detaches the row.
    keep = (torch.arange(5) != 0)[:, None]

    def plain(w):
        return head(torch.tanh(F.embedding(tokens, torch.where(keep, w, w.detach()))).mean(1)).pow(2).sum()

    w = emb.weight.detach()
    for mode in ("forward", "reverse"):
        res = hoad.compile(f, order=3, mode=mode)(w)
        assert_close(res[0, 0], jacfwd(jacrev(plain))(w), f"embedding Hessian ({mode})")
        assert_close(res[0, 0], jacrev(jacrev(f))(w), f"embedding Hessian, reverse-over-reverse ({mode})")
        assert_close(res[0, 0, 0], jacfwd(jacfwd(jacrev(plain)))(w), f"embedding 3rd order ({mode})")
    assert float(res[0, 0][0].abs().max()) == 0.0  # the padding row carries no derivative

    m = SmallCNN()
    x = rand(3, 2, 4, 4)
    per_sample = hoad.compile(lambda x: m(x).pow(2).sum(1), order=2, batch_dim=0)(x)
    single = lambda xi: m(xi[None]).pow(2).sum()  # noqa: E731
    assert_close(per_sample[0, 0], torch.func.vmap(jacfwd(jacrev(single)))(x), "per-sample CNN Hessians")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_tied_weights_count_every_use(mode):
    """A decoder tied to its embedding (out.weight = emb.weight): one parameter, named once by
    named_parameters. The traced value once replaced only the embedding's use, so the decoder's
    read the live tensor as a constant (gradient off by 5, Hessian by 9)."""
    torch.manual_seed(14)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3).double()
            self.out = nn.Linear(3, 5, bias=False).double()
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return torch.log_softmax(self.out(torch.tanh(self.emb(ids))), -1).sum()

    m, ids = Tied(), torch.tensor([0, 3, 3])
    E = m.emb.weight.detach().clone()

    def plain(E):
        return torch.log_softmax(torch.tanh(F.embedding(ids, E)) @ E.T, -1).sum()

    for wrt in (["emb.weight"], hoad.parameters):
        res = hoad.compile(m, order=2, wrt=wrt, backend="eager", mode=mode)(ids)
        assert_close(res["emb.weight"], jacrev(plain)(E), "gradient")
        assert_close(res["emb.weight", "emb.weight"], jacfwd(jacrev(plain))(E), "Hessian")


@pytest.mark.parametrize("holder", ["list", "closure"])
def test_a_parameter_also_reached_another_way_counts_every_use(holder):
    """A parameter the module reaches both as its attribute and through a list or a closure it
    keeps: the second path read the live tensor as a constant, and with wrt=hoad.parameters the
    gradient was off by 0.76 and the Hessian by 3.6, silently. When the two places later hold two
    tensors (the parameter replaced, the list keeping the old one; then the list given another)
    each call follows what the function reads."""
    torch.manual_seed(15)

    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2).double()
            w = self.lin.weight
            self.held = [w] if holder == "list" else (lambda: w)

        def other(self):
            return self.held[0] if holder == "list" else self.held()

        def forward(self, x):
            return (torch.tanh(self.lin(x)) * (x @ self.other())).sum()

    m, x = Held(), rand(2, seed=16)
    cf = hoad.compile(m, order=2, wrt=hoad.parameters)

    def expected():  # autograd on the module itself, which follows both paths
        params = dict(m.named_parameters())
        g = torch.autograd.grad(m(x), list(params.values()), create_graph=True)
        w = params["lin.weight"]
        H = torch.stack([torch.autograd.grad(gi, w, retain_graph=True)[0] for gi in g[0].reshape(-1)])
        return g[0], H.reshape(2, 2, 2, 2)

    for step in ("first", "parameter replaced", "list given the parameter", "list given another"):
        if step == "parameter replaced":
            m.lin.weight = nn.Parameter(rand(2, 2, seed=17))
        elif step == "list given the parameter" and holder == "list":
            m.held[0] = m.lin.weight
        elif step == "list given another" and holder == "list":
            m.held[0] = rand(2, 2, seed=18)
        res = cf(x)
        g, H = expected()
        assert_close(res["lin.weight"], g, f"gradient, {step}")
        assert_close(res["lin.weight", "lin.weight"], H, f"Hessian, {step}")


def test_an_argument_also_held_elsewhere_is_other_data_there():
    """A closure that is the very tensor passed as the argument (G = X) is other data that equals
    it at this call, a constant as under torch.func: not read as the argument. Under batch_dim=0
    that read would mix the samples (a BatchCouplingError); a call with other samples keeps the
    one program."""
    X = rand(5, 3, seed=21)
    G = X

    def f(X):
        return X.sin().sum(-1) + G.mean(0).sum() * X[:, 0]

    cf = hoad.compile(f, order=1, batch_dim=0)
    for points in (X, rand(5, 3, seed=22)):
        assert_close(cf(points)[0], vmap(jacrev(lambda x: f(x[None])[0]))(points), "per-sample gradients")
    assert len(cf._cache) == 1
    x = X[0].clone()
    H = x

    def g(x):
        return (x.sin() * H).sum()

    assert_close(hoad.compile(g, order=2)(x)[0, 0], hessian(g)(x), "the closure a constant, as for torch.func")


def test_a_view_of_a_parameter_made_before_the_call_is_refused():
    """A transpose of a parameter kept from __init__ (self.wT = self.lin.weight.t()): autograd
    follows it to the parameter, hoad read it as a constant (gradient off by 2.1, silently). It is
    refused where that parameter is differentiated, and read live where it is not."""
    class Kept(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2).double()
            self.wT = self.lin.weight.t()

        def forward(self, x):
            return (torch.tanh(self.lin(x)) * (x @ self.wT)).sum()

    m, x = Kept(), rand(2, seed=19)
    with pytest.raises(hoad.CaptureError, match=r"view of 'lin.weight', which it differentiates, made before the call"):
        hoad.compile(m, order=1, wrt=hoad.parameters)(x)
    res = hoad.compile(m, order=2)(x)
    assert_close(res[0, 0], hessian(lambda x: m(x))(x), "the view read live, x differentiated")


# --------------------------------------------------------------- state the function stores
def _plain_tensors(module: nn.Module) -> bool:
    return all(type(t) in (torch.Tensor, nn.Parameter) for t in [*module.parameters(), *module.buffers()])


def test_spectral_norm_keeps_real_buffers_and_steps_like_a_plain_call():
    """Spectral norm assigns its power-iteration vectors (``self._u = normalize(..., out=self._u)``):
    the trace left its stand-ins in the module (printing, deepcopy and a plain call then failed).
    They are put back, and the program's in-place replay advances them as a plain call does."""
    import copy

    torch.manual_seed(4)
    sn = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4, dtype=torch.float64))
    twin = copy.deepcopy(sn)
    x = rand(6, 4, seed=56)
    cf = hoad.compile(lambda x: sn(x).tanh().sum(), order=2, backend="eager")
    for _ in range(2):
        cf(x)
        twin(x).tanh().sum()
    assert _plain_tensors(sn)
    u = sn.parametrizations.weight[0]._u
    assert_close(u, twin.parametrizations.weight[0]._u, "_u after two calls")
    copy.deepcopy(sn)
    assert type(sn(x)) is torch.Tensor


class _Smoothed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, dtype=torch.float64)
        self.register_buffer("ema", torch.zeros(3, dtype=torch.float64))

    def forward(self, x):
        h = self.fc(x)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)   # an assignment, not in place
        return h.tanh().sum()


def test_a_buffer_assigned_in_forward_is_updated_at_every_call():
    """It stayed at zero under hoad (the trace's assignment was dropped); compiled as a module
    the assignment is replayed as an in-place write of the buffer."""
    torch.manual_seed(5)
    m, twin = _Smoothed(), _Smoothed()
    twin.load_state_dict(m.state_dict())
    x = rand(5, 4, seed=57)
    cf = hoad.compile(m, order=2, backend="eager")
    for _ in range(3):
        res = cf(x)
        expected = twin(x)
    assert_close(m.ema, twin.ema, "ema after 3 calls")
    assert_close(res.value, expected, "value")
    assert _plain_tensors(m)


def test_a_buffer_assigned_by_a_closed_over_module_is_refused():
    """Reached through a closure, the module's buffer is a tensor the program reads; an
    assignment cannot be replayed there, so it is a CaptureError, not a dropped update."""
    m = _Smoothed()
    with pytest.raises(hoad.CaptureError, match=r"_Smoothed\.ema.*in place"):
        hoad.compile(lambda x: m(x), order=2, backend="eager")(rand(5, 4, seed=58))
    assert _plain_tensors(m) and m.ema.abs().sum() == 0


@functools.lru_cache(maxsize=None)
def _frequencies(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * 0.5 + 1.0


def test_an_lru_cache_the_trace_fills_is_emptied(caplog):
    """A memoized helper (functools.lru_cache, functools.cache on a method, a dict a class keeps for
    its instances) first called inside hoad's trace kept the trace's stand-in: afterwards the user's
    own f(x) returned a fake tensor wrapped in a FunctionalTensor, silently, and torch.func computed
    garbage from it. An lru_cache is emptied after the trace, with an info line, and the class's
    dict gets its entry taken back, with a warning; the next call outside computes it again."""

    class Basis(nn.Module):
        @functools.cache  # noqa: B019 (what users write; the test is about it)
        def basis(self, n):
            return torch.arange(n, dtype=torch.float64) + 1.0

        def forward(self, x):
            return (x * self.basis(3)).sin().sum()

    class Memo(nn.Module):
        _cache: dict = {}  # (a class attribute every instance fills)

        def forward(self, x):
            if 3 not in self._cache:
                self._cache[3] = torch.arange(3, dtype=torch.float64) + 2.0
            return (x * self._cache[3]).sin().sum()

    def f(x):
        return (x * _frequencies(3)).sin().sum()

    _frequencies.cache_clear()
    x = rand(3, seed=23)
    for fn, values in ((f, torch.arange(3, dtype=torch.float64) * 0.5 + 1.0),
                       (Basis(), torch.arange(3, dtype=torch.float64) + 1.0),
                       (Memo(), torch.arange(3, dtype=torch.float64) + 2.0)):
        with caplog.at_level("INFO", logger="hoad"):
            res = hoad.compile(fn, order=2)(x)
        after = fn(x)
        assert type(after) is torch.Tensor and not torch._is_functional_tensor(after)
        assert_close(after, (x * values).sin().sum(), "the function called afterwards")
        assert ("lru_cache of" in caplog.text and "emptied them" in caplog.text) if not isinstance(fn, Memo) else \
            "a dict's entry 3" in caplog.text
        assert_close(res[0, 0], torch.diag(-(values ** 2) * (x * values).sin()), "the Hessian")
        caplog.clear()


def test_a_memo_of_the_users_module_gets_its_entry_back(tmp_path, monkeypatch):
    """A helper module of the user's whose function fills a module-level dict (_CACHE[n] = ...),
    called as helpers.basis(3): the trace's stand-in stayed in _CACHE, and the function called
    afterwards returned a FakeTensor inside a FunctionalTensor, silently."""
    (tmp_path / "memo_helpers.py").write_text(
        "import torch\n_CACHE = {}\n\n\ndef basis(n):\n    if n not in _CACHE:\n"
        "        _CACHE[n] = torch.arange(n, dtype=torch.float64) + 1.0\n    return _CACHE[n]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers = __import__("memo_helpers")

    def f(x):
        return (x * helpers.basis(3)).sin().sum()

    x = rand(3, seed=24)
    values = torch.arange(3, dtype=torch.float64) + 1.0
    assert_close(hoad.compile(f, order=2)(x)[0, 0], torch.diag(-(values ** 2) * (x * values).sin()), "the Hessian")
    after = f(x)
    assert not torch._is_functional_tensor(after)
    assert_close(after, (x * values).sin().sum(), "the function called afterwards")


def test_values_saved_by_a_hook_are_put_back_with_a_warning(caplog):
    """A forward hook saving features held a trace stand-in after the call (its .item() returned
    a symbol); the dict gets its old content back and a warning says why."""
    net = nn.Sequential(nn.Linear(4, 3, dtype=torch.float64), nn.Tanh(), nn.Linear(3, 1, dtype=torch.float64))
    feats = {"fc0": None}
    net[0].register_forward_hook(lambda mod, inp, out: feats.__setitem__("fc0", out.detach()))
    with caplog.at_level("WARNING", logger="hoad"):
        hoad.compile(lambda x: net(x).sum(), order=2, backend="eager")(rand(5, 4, seed=59))
    assert feats == {"fc0": None}
    assert "stored tensors on objects (a dict's entry 'fc0')" in caplog.text


def test_a_float32_lstm_is_differentiated_as_its_float64_twin():
    """On the CPU a float32 LSTM runs aten.mkldnn_rnn_layer (a fused kernel with no rule): it was
    refused, while float64 (torch's plain gate ops) worked. Traced without mkldnn it is the same."""
    import copy

    torch.manual_seed(12)
    lstm = nn.LSTM(2, 3, batch_first=True)
    twin = copy.deepcopy(lstm).double()
    x = torch.randn(1, 3, 2)
    res = hoad.compile(lambda x: lstm(x)[0].sum(), order=2, backend="eager")(x)
    want = jacfwd(jacrev(lambda x: twin(x)[0].sum()))(x.double())
    torch.testing.assert_close(res[0, 0].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_a_recurrent_layers_list_of_its_weights_is_no_stored_value(cls, caplog):
    """RNNBase keeps its parameters in ``_flat_weights``, rebuilt from them: the trace's rebuild
    was warned about as a value stored on an object that calls would not update."""
    torch.manual_seed(7)
    rnn = cls(2, 3, batch_first=True).double()

    class Summed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            return self.rnn(x)[0].sum()

    flat = rnn._flat_weights
    with caplog.at_level("WARNING", logger="hoad"):
        res = hoad.compile(Summed(), order=1, backend="eager")(rand(2, 3, 2, seed=60))
    assert "stored tensors" not in caplog.text
    assert rnn._flat_weights is flat and all(isinstance(w, nn.Parameter) for w in rnn._flat_weights)
    x = rand(2, 3, 2, seed=60)
    torch.testing.assert_close(res[0], torch.func.grad(lambda x: rnn(x)[0].sum())(x))


def test_a_hook_added_or_removed_after_a_call_is_traced_again():
    """Hooks change what a call computes; a program traced before one was added kept running."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(4, 3, dtype=torch.float64), nn.Tanh(), nn.Linear(3, 1, dtype=torch.float64))

    def f(x):
        return net(x).sum()

    cf = hoad.compile(f, order=2, backend="eager")
    x = rand(2, 4, seed=60)
    cf(x)
    handle = net[0].register_forward_pre_hook(lambda mod, inp: (inp[0] * 2,))
    assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "with the hook")
    handle.remove()
    assert_close(cf(x)[0, 0], jacfwd(jacrev(f))(x), "hook removed")


def test_a_submodule_called_twice_keeps_its_parameters():
    """Reparametrizing a module that holds one layer twice left the traced stand-ins in that
    layer (its Parameters became plain tensors that no longer trained); putting them back then
    raised a false CaptureError."""
    torch.manual_seed(7)
    a, h, o = (nn.Linear(2, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64),
               nn.Linear(4, 1, dtype=torch.float64))
    m = nn.Sequential(a, nn.Tanh(), h, nn.Tanh(), h, nn.Tanh(), o)
    P = rand(5, 2, seed=61)
    res = hoad.compile(m, order=1, wrt=hoad.parameters, backend="eager")(P)  # (5, 1) outputs
    names = [n for n, _ in m.named_parameters()]
    grads = torch.autograd.grad(m(P).sum(), list(m.parameters()))
    for n, g in zip(names, grads):
        assert_close(res[n].sum((0, 1)), g, n)
    assert all(type(p) is nn.Parameter and p.requires_grad for p in m.parameters())


def test_a_lazy_module_before_its_first_call_is_a_capture_error():
    """It was a HoadInternalError (a closure over it) or a raw RuntimeError (compiled itself)."""
    net = nn.Sequential(nn.LazyLinear(4, dtype=torch.float64), nn.Tanh())
    P = rand(3, 2, seed=62)
    for f in (net, lambda P: net(P).sum()):
        with pytest.raises(hoad.CaptureError, match="lazy"):
            hoad.compile(f, order=1, backend="eager")(P)
    net(P)
    hoad.compile(net, order=1, backend="eager")(P)


def test_an_instance_whose_decorated_method_ran_is_freed():
    """Each instance's program sat in a weak table whose value held its key: no instance whose
    decorated method was called was ever freed (a hyperparameter search kept every model)."""
    import gc
    import weakref

    class Energy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2, dtype=torch.float64)

        @hoad.compile(order=2, backend="eager")
        def energy(self, x):
            return self.fc(x).tanh().sum()

    refs = []
    for seed in range(3):
        m = Energy()
        m.energy(rand(2, 3, seed=63 + seed))
        refs.append(weakref.ref(m))
        del m
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_module_inside_the_function(how):
    """A ScriptModule's tables are wrappers that do not iterate as dicts: a HoadInternalError."""
    lin = nn.Linear(3, 3, dtype=torch.float64)
    x = rand(2, 3, seed=64)
    sm = torch.jit.script(lin) if how == "script" else torch.jit.trace(lin, (x,))
    cf = hoad.compile(lambda x: torch.tanh(sm(x)).sum(), order=2, backend="eager")
    assert_close(cf(x)[0, 0], jacfwd(jacrev(lambda x: torch.tanh(lin(x)).sum()))(x), "Hessian")


def test_a_new_program_for_a_python_number_names_it(caplog):
    """A retrace for another Python number named no argument ("a new signature (tensors (3,)
    float64)", the same tensors as before): the log names the argument, its new and old value, and
    says that it becomes a program input (hoad.numbers); a call whose arguments are arranged
    otherwise shows both calls."""
    import logging

    class Boltzmann(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1).to(DT)

        @hoad.compile(order=2, backend="eager")
        def energy(self, x, beta, shift=0.0):
            return self.lin(x).sum() * beta + shift

    m, x = Boltzmann(), rand(3, seed=12)
    m.energy(x, 1.0)
    with caplog.at_level(logging.INFO, logger="hoad"):
        m.energy(x, 2.0)
        m.energy(x, 2.0, shift=0.5)
    said = [r.getMessage() for r in caplog.records if "compiling program" in r.getMessage()]
    assert len(said) == 2, said
    assert "energy called with beta=2.0 (was 1.0); compiling program 2 with it as program input" in said[0], said[0]
    assert ("called with (x=tensor (3,) float64, beta=2.0; by keyword shift=0.5), where it was called with "
            "(x=tensor (3,) float64, beta=1.0)") in said[1], said[1]  # (the call beta=2.0 made it an input)
