"""Reliability: compiled functions called from many threads, and hoad programs inside hoad programs."""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import threading

import pytest
import torch
from helpers import assert_close, rand
from torch.func import hessian, jacrev, vmap

import hoad

W = rand(3, 4, seed=301)
V = rand(4, seed=302)


def mlp(x):
    return (x @ W).tanh() @ V


def _programs(backend):
    """(compiled function, [(args, expected blocks)]) for a few programs of different shapes."""
    point = hoad.compile(lambda x: mlp(x).sin(), order=2, backend=backend)
    per_sample = hoad.compile(mlp, order=2, batch_dim=0, backend=backend)
    cube = hoad.compile(lambda x: (x.sin() * x.exp()).sum(), order=3, backend=backend)
    out = []
    for i in range(3):
        x = rand(3, seed=310 + i)
        g = lambda x: mlp(x).sin()  # noqa: E731
        out.append((point, (x,), {(0,): jacrev(g)(x), (0, 0): hessian(g)(x)}))
        X = rand(5, 3, seed=320 + i)
        out.append((per_sample, (X,), {(0, 0): vmap(hessian(mlp))(X)}))
        y = rand(2, 2, seed=330 + i)
        c = lambda y: (y.sin() * y.exp()).sum()  # noqa: E731
        out.append((cube, (y,), {(0, 0, 0): jacrev(jacrev(jacrev(c)))(y)}))
    return out


def _hammer(cases, threads=8, calls=50):
    """Every thread makes ``calls`` calls in its own random order, starting together (so that the
    first calls, which build, collide); returns the failures."""
    start = threading.Barrier(threads)
    failures: list = []

    def worker(seed):
        order = random.Random(seed)
        start.wait()
        for _ in range(calls):
            f, args, expected = order.choice(cases)
            try:
                res = f(*args)
                for K, ref in expected.items():
                    assert_close(res[K], ref, f"block {K}")
            except Exception as e:  # noqa: BLE001 - collected and reported by the test
                failures.append(f"{type(e).__name__}: {e}")

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return failures


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_many_threads_build_and_call_concurrently(backend):
    failures = _hammer(_programs(backend))
    assert not failures, f"{len(failures)} of 400 calls failed, e.g. {failures[0]}"


# ------------------------------------------------------------------ first calls at mixed shapes
# Fresh programs whose first calls come from 8 threads at once, each at its own shape and kind:
# point Hessians and third-order tensors at several shapes (one program per shape), per-sample
# Hessians dense and diagonal at several sample counts (the family that builds one program for
# every count), a Laplacian operator, and a function closing over weights (its hoisted prefix).
# The references are computed before the threads start: torch.func is not thread-safe (its
# forward-AD levels are process-wide; computed inside 6 threads, 93 of 240 of its own Hessians
# came out wrong or raised), so a reference taken in a thread can be the wrong side.
MIXED_SHAPES = (2, 3, 4, 5, 7)


def _mixed_kinds(backend):
    W, V = rand(3, 5, seed=350), rand(5, seed=351)

    def net(x):
        return (x @ W).tanh() @ V

    def cube(x):
        return (x.tanh() ** 3).sum()

    lap = hoad.laplacian(net, batch_dim=0, backend=backend)
    kinds = {
        "hessian": (hoad.compile(cube, order=2, backend=backend), lambda p, x: p(x)[0, 0], hessian(cube)),
        "order 3": (hoad.compile(cube, order=3, backend=backend), lambda p, x: p(x)[0, 0, 0],
                    jacrev(jacrev(jacrev(cube)))),
        "per sample": (hoad.compile(net, order=2, batch_dim=0, backend=backend), lambda p, x: p(x)[0, 0],
                       vmap(hessian(net))),
        "diagonal": (hoad.compile(net, order=2, batch_dim=0, diagonal=True, backend=backend),
                     lambda p, x: p(x)[0, 0], lambda X: vmap(hessian(net))(X).diagonal(dim1=-2, dim2=-1)),
        "laplacian": (lap, lambda p, x: p(x).laplacian,
                      lambda X: vmap(hessian(net))(X).diagonal(dim1=-2, dim2=-1).sum(-1)),
        "weights": (hoad.compile(lambda x: (net(x) * (W ** 2).sum()).sin().sum(), order=2, backend=backend),
                    lambda p, x: p(x)[0, 0], hessian(lambda x: (net(x) * (W ** 2).sum()).sin().sum())),
    }
    return kinds


def _first_calls_race(backend, trials, threads=8, seed=0) -> tuple[int, list[str]]:
    """(calls made, failures) over ``trials`` rounds of fresh programs."""
    failures, calls = [], 0
    pick = random.Random(seed)
    for trial in range(trials):
        kinds = _mixed_kinds(backend)
        jobs = []
        for _ in range(threads):
            name = pick.choice(sorted(kinds))
            x = rand(pick.choice(MIXED_SHAPES), 3, seed=pick.randrange(1 << 20))
            jobs.append((name, x, kinds[name][2](x)))
        start = threading.Barrier(threads)
        got: list = [None] * threads

        def worker(i):
            name, x, _ = jobs[i]
            program, block, _ = kinds[name]
            start.wait()
            try:
                got[i] = block(program, x)
            except Exception as e:  # noqa: BLE001 - collected and reported by the test
                got[i] = e

        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        for (name, x, ref), out in zip(jobs, got):
            calls += 1
            try:
                if isinstance(out, Exception):
                    raise out
                assert_close(out, ref, f"{name} at {tuple(x.shape)}")
            except Exception as e:  # noqa: BLE001
                failures.append(f"trial {trial}, {name} at {tuple(x.shape)}: {type(e).__name__}: {e}")
    return calls, failures


def test_first_calls_from_threads_at_mixed_shapes():
    """30 rounds of 8 first calls: a race that spoils 1 round in 10 goes unseen with probability
    (9/10)^30 < 5% (1 in 12: 7%); the slow test runs 200."""
    calls, failures = _first_calls_race("eager", trials=30)
    assert not failures, f"{len(failures)} of {calls} calls failed, e.g. {failures[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("backend, trials", [("eager", 200), ("inductor", 20)])
def test_first_calls_from_threads_at_mixed_shapes_many_rounds(backend, trials):
    """200 rounds (eager): a 1-in-12 race goes unseen with probability (11/12)^200 < 1e-7."""
    calls, failures = _first_calls_race(backend, trials, seed=1)
    assert not failures, f"{len(failures)} of {calls} calls failed, e.g. {failures[:3]}"


# ------------------------------------------------------------------------------------ nesting
@pytest.mark.parametrize("inner_backend", ["eager", "inductor"])
def test_a_program_inside_a_program_composes(inner_backend):
    """The outer order works over the inner one: order 2 of a gradient is order 3 of f; the
    inner function still works on its own afterwards."""

    def f(x):
        return mlp(x).sin()

    inner = hoad.compile(f, order=1, backend=inner_backend)
    outer = hoad.compile(lambda x: inner(x)[0], order=2, backend="eager")
    x = rand(3, seed=340)
    res = outer(x)
    assert_close(res.value, jacrev(f)(x), "value: the inner gradient")
    assert_close(res[0], jacrev(jacrev(f))(x), "order 1 over the gradient")
    assert_close(res[0, 0], jacrev(jacrev(jacrev(f)))(x), "order 2 over the gradient")
    assert_close(inner(x)[0], jacrev(f)(x), "the inner program called directly")


def test_nested_programs_see_live_weights():
    """The inner program's closed-over weights are inputs of the outer program, read at every call."""
    w = rand(3, seed=341)

    def f(x):
        return (x * w).sin().sum()

    inner = hoad.compile(f, order=1)
    outer = hoad.compile(lambda x: inner(x)[0].sin().sum(), order=2)
    x = rand(3, seed=342)
    g = lambda x: jacrev(f)(x).sin().sum()  # noqa: E731
    assert_close(outer(x)[0, 0], hessian(g)(x), "before the update")
    with torch.no_grad():
        w.mul_(2.0)
    assert_close(outer(x)[0, 0], hessian(g)(x), "after an in-place update of the weights")


# ------------------------------------------------------------------------------ memory plan
def test_a_result_that_cannot_fit_is_refused_before_anything_is_allocated():
    """Order 3 of a 60000-entry input, dense: petabytes. Refused at build time, with the ways out."""
    x = rand(20000, 3, seed=350)
    with pytest.raises(hoad.MemoryBudgetError) as e:
        hoad.compile(lambda x: x.sin().sum(0), order=3)(x)
    message = str(e.value)
    for way in ("PiB", "memory budget", "batch_dim=0", "diagonal=True", "hoad.laplacian", "memory_budget="):
        assert way in message, f"{way!r} missing from: {message}"


def _per_sample(X):
    return (X.sin() @ W).tanh().sum(-1)


def _per_sample_reference(X):
    return vmap(jacrev(jacrev(jacrev(lambda x: _per_sample(x[None])[0]))))(X)


def test_over_budget_with_batch_dim_suggests_a_chunk_size_that_fits():
    X = rand(400, 3, seed=351)
    cf = hoad.compile(_per_sample, order=3, batch_dim=0)
    plan = cf.explain(X).build.stats["memory"]["plan"]
    assert plan.results < plan.peak
    budget = (plan.results + plan.peak) / 2
    with pytest.raises(hoad.MemoryBudgetError, match=r"chunk_size=(\d+)") as e:
        hoad.compile(_per_sample, order=3, batch_dim=0, memory_budget=budget)(X)
    size = int(re.search(r"chunk_size=(\d+)", str(e.value)).group(1))
    assert 1 <= size < 400
    chunked = hoad.compile(_per_sample, order=3, batch_dim=0, memory_budget=budget, chunk_size=size)
    res = chunked(X)
    assert chunked.explain().build.stats["memory"]["plan"].peak <= budget
    assert_close(res[0, 0, 0], _per_sample_reference(X), "order 3 joined from chunks")


def test_a_suggested_chunk_size_fits_where_the_results_take_most_of_the_budget():
    """Most of the budget holds the joined results: the advice (124) left no room for padding the
    last chunk to a whole one, so following it raised a second MemoryBudgetError (advising 88)."""
    g = torch.Generator().manual_seed(8)
    Wf, w2 = torch.randn(6, 16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)

    def f(X):
        return torch.tanh(X @ Wf) @ w2 + X.log().sum(-1)

    X = torch.rand(1000, 6, generator=g, dtype=torch.float64) + 0.1
    with pytest.raises(hoad.MemoryBudgetError, match=r"chunk_size=(\d+)") as e:
        hoad.compile(f, order=3, batch_dim=0, memory_budget=3e6, backend="eager")(X)
    size = int(re.search(r"chunk_size=(\d+)", str(e.value)).group(1))
    res = hoad.compile(f, order=3, batch_dim=0, memory_budget=3e6, chunk_size=size, backend="eager")(X)
    assert_close(res[0, 0, 0], hoad.compile(f, order=3, batch_dim=0, backend="eager")(X)[0, 0, 0], "chunked")


def test_a_suggested_chunk_size_counts_the_inputs_every_chunk_holds():
    """A program for 300 samples hoists W1⊗W1⊗W1 (8 MB), one for fewer samples does not: the
    advice counts the inputs every chunk holds (weights, free tensors), not those hoisted terms
    (counting them, nothing fit; a chunk of the size advised fits)."""
    g = torch.Generator().manual_seed(9)
    W1 = torch.randn(16, 256, generator=g, dtype=torch.float64)
    W2 = torch.randn(256, 1, generator=g, dtype=torch.float64)

    def energy(X):
        return (torch.tanh(X @ W1) @ W2).squeeze(-1)

    X = torch.randn(300, 16, generator=g, dtype=torch.float64)
    cf = hoad.compile(energy, order=3, batch_dim=0, mode="forward", backend="eager")
    plan = cf.explain(X).build.stats["memory"]["plan"]
    budget = plan.results + 0.6 * (plan.peak - plan.results)
    with pytest.raises(hoad.MemoryBudgetError, match=r"chunk_size=(\d+)") as e:
        hoad.compile(energy, order=3, batch_dim=0, mode="forward", backend="eager", memory_budget=budget)(X)
    size = int(re.search(r"chunk_size=(\d+)", str(e.value)).group(1))
    res = hoad.compile(energy, order=3, batch_dim=0, mode="forward", backend="eager", memory_budget=budget,
                       chunk_size=size)(X)
    assert_close(res[0, 0, 0], cf(X)[0, 0, 0], "chunked")


def test_a_sample_too_large_for_the_budget_is_not_blamed_on_the_results():
    """The results take a fraction of the budget and one sample's program is over it: the advice
    said "fewer samples per call (their results alone are over the budget)"."""
    X = rand(4, 16, seed=354)
    cf = hoad.compile(_per_sample_16, order=3, batch_dim=0, backend="eager")
    plan = cf.explain(X).build.stats["memory"]["plan"]
    budget = (plan.results + plan.peak / 4) / 2  # over the results, under one sample's share
    assert plan.results < budget < plan.peak / 4
    with pytest.raises(hoad.MemoryBudgetError, match="none by chunking.*one sample at a time still needs") as e:
        hoad.compile(_per_sample_16, order=3, batch_dim=0, backend="eager", memory_budget=budget)(X)
    assert "results alone" not in str(e.value)


def _per_sample_16(X):
    return torch.tanh(X @ _W16).pow(3).sum(-1)


_W16 = rand(16, 64, seed=355)


def test_chunks_give_the_unchunked_result_with_one_program():
    X = rand(10, 3, seed=352)
    chunked = hoad.compile(_per_sample, order=3, batch_dim=0, chunk_size=4)  # 4 + 4 + 2 (padded)
    res, whole = chunked(X), hoad.compile(_per_sample, order=3, batch_dim=0)(X)
    assert len(chunked._cache) == 1, "the padded last chunk must reuse the program"
    assert_close(res.value, whole.value, "value")
    for K in whole:
        assert_close(res[K], whole[K], f"block {K}")
    assert_close(res[0, 0, 0], _per_sample_reference(X), "order 3 against torch.func")


def test_gradients_flow_through_joined_chunks():
    X = rand(7, 3, seed=353)
    Wg = W.clone().requires_grad_(True)

    def f(X):
        return (X.sin() @ Wg).tanh().sum(-1)

    loss = hoad.compile(f, order=2, batch_dim=0, chunk_size=3)(X)[0, 0].pow(2).sum()
    got, = torch.autograd.grad(loss, Wg)
    ref, = torch.autograd.grad(vmap(hessian(lambda x: f(x[None])[0]))(X).pow(2).sum(), Wg)
    assert_close(got, ref, "dL/dW through chunks")


def test_explain_shows_the_memory_plan():
    text = str(hoad.compile(_per_sample, order=2, batch_dim=0).explain(rand(5, 3, seed=354)))
    assert "estimated peak" in text and "budget" in text


def test_a_folded_constant_result_counts_in_the_memory_plan():
    """The Hessian of Σx² is a folded constant, copied as it is returned: the plan counted neither
    (results 30.5 MiB, estimated peak 46.9 KiB), so memory_budget=1e6 let it through."""
    x = rand(2000, seed=355)
    f = lambda x: (x ** 2).sum()  # noqa: E731
    plan = hoad.compile(f, order=2, backend="eager").explain(x).build.stats["memory"]["plan"]
    assert plan.peak >= 2 * 2000 * 2000 * 8, plan  # the constant, and the copy returned
    with pytest.raises(hoad.MemoryBudgetError, match="estimated peak of 61.1 MiB"):
        hoad.compile(f, order=2, backend="eager", memory_budget=1e6)(x)


@pytest.mark.parametrize("options, fragment", [
    (dict(chunk_size=4), "pass batch_dim=0"),
    (dict(batch_dim=0, chunk_size=0), "chunk_size must be"),
    (dict(memory_budget=-1), "memory_budget must be"),
])
def test_bad_chunk_and_budget_options(options, fragment):
    with pytest.raises(hoad.InvalidArgumentError, match=fragment):
        hoad.compile(_per_sample, order=2, **options)


# ---------------------------------------------------------------------- every number of samples
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_program_serves_every_number_of_samples(backend):
    """The second number of samples builds the general program; later ones build nothing."""
    cf = hoad.compile(mlp, order=2, batch_dim=0, backend=backend)
    for count in (6, 9, 4, 13, 9):
        X = rand(count, 3, seed=360 + count)
        assert_close(cf(X)[0, 0], vmap(hessian(mlp))(X), f"{count} samples")
    entries = {id(e) for e in cf._cache.values()}
    assert len(entries) == 2, "one program for 6 samples, one for every number"
    general = [e for e in cf._cache.values() if e.build.stats.get("any_samples")]
    assert general and "sym_size" in general[0].build.program.gm.code
    # the graph's shapes are those it was traced with (it showed [6, …] for a call of 9, unsaid)
    assert "one program for every number of samples: the shapes shown are those of 6 samples" in str(cf.graph)


def test_per_sample_tensors_beside_the_wrt_input_keep_one_program():
    """A per-sample loss with its labels (and a per-sample weight) as arguments: the labels were
    keyed by their full shape, so every count was a family of its own and built its own program
    (4 counts, 4 programs). Every tensor with a row per sample now counts as one."""
    W = rand(4, 3, seed=385)

    def loss(x, y, w):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ W), y, reduction="none") * w

    cf = hoad.compile(loss, order=2, batch_dim=0, backend="eager")
    for count in (16, 9, 23, 40):
        g = torch.Generator().manual_seed(count)
        X, y, w = rand(count, 4, seed=386 + count), torch.randint(0, 3, (count,), generator=g), rand(count, seed=count)
        ref = vmap(hessian(lambda x, y, w: loss(x[None], y[None], w[None])[0]))(X, y, w)
        assert_close(cf(X, y, w)[0, 0], ref, f"{count} samples")
    assert len({id(e) for e in cf._cache.values()}) == 2, "one program for 16 samples, one for every number"


def test_a_shared_tensor_sized_like_the_first_count_keeps_working():
    """A tensor every sample shares whose dim 0 equals the first count by chance is taken for a
    per-sample one at that count only: the other counts share one program, and every result is
    right."""
    M = rand(6, 3, seed=390)  # 6 rows, as the first call's 6 samples

    def f(x, M):
        return torch.tanh(x @ M.T).sum(-1)

    cf = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    for count in (6, 9, 4, 13):
        X = rand(count, 3, seed=391 + count)
        assert_close(cf(X, M)[0, 0], vmap(hessian(lambda x: f(x[None], M)[0]))(X), f"{count} samples")
    assert len({id(e) for e in cf._cache.values()}) <= 3


def test_points_of_a_sample_keep_one_program_and_chunk():
    """nn.Linear on (B, N, d) points: the check that the function uses its count only as a size
    compared a fresh trace with the program after its samples were kept apart (torch's B·N rows
    unmerged), so chunk_size was refused ("uses its number of samples as a value") and every
    count built its own program."""
    fc = torch.nn.Linear(3, 1, dtype=torch.float64)

    def f(X):
        return fc(X.view(X.shape[0], -1, 3).tanh()).squeeze(-1).sum(-1)

    one = lambda x: f(x[None])[0]  # noqa: E731
    cf = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    for count in (8, 16, 5):
        X = rand(count, 6, seed=375 + count)
        assert_close(cf(X)[0, 0], vmap(hessian(one))(X), f"{count} samples")
    assert len({id(e) for e in cf._cache.values()}) == 2, "one program for 8 samples, one for every number"
    X = rand(10, 6, seed=380)
    chunked = hoad.compile(f, order=2, batch_dim=0, backend="eager", chunk_size=4)
    assert_close(chunked(X)[0, 0], vmap(hessian(one))(X), "chunked")


def test_a_structure_that_depends_on_the_count_keeps_one_program_per_count():
    """The count squared is a constant of the program, not a size that follows the input: no
    general program exists, and each count is built on its own, correctly."""
    def f(X):
        return (X.sin() * X.shape[0] ** 2).sum(-1)

    cf = hoad.compile(f, order=2, batch_dim=0)
    for count in (3, 5, 7):
        X = rand(count, 2, seed=370 + count)
        assert_close(cf(X)[0, 0], vmap(hessian(lambda x: (x.sin() * count ** 2).sum()))(X), f"{count} samples")
    assert not any(e.build.stats.get("any_samples") for e in cf._cache.values())
    assert len(cf._cache) == 3


def test_sample_sized_constants_keep_one_program():
    """A full per-sample Hessian of an elementwise function: the program stored a [B, 1] index over
    the samples and a [B, 2, 2] block of zeros, folded as constants, so the builds for two counts
    differed in their constants and every count built its own program. Values made with the
    count's sizes now stay ops, whose sizes follow it."""
    f = lambda X: (X.sin() * 2).sum(-1)  # noqa: E731
    cf = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    for count in (100, 128, 200, 3):
        X = rand(count, 2, seed=395 + count)
        assert_close(cf(X)[0, 0], vmap(hessian(lambda x: (x.sin() * 2).sum()))(X), f"{count} samples")
    assert len({id(e) for e in cf._cache.values()}) == 2, "one program for 100 samples, one for every number"


def test_a_count_dependent_program_says_why_and_where(caplog):
    """Where the count changes the program, the log says how (the value at each count) and at
    which line, once per new count."""
    def f(X):
        return (X.sin() * X.shape[0] ** 2).sum(-1)

    cf = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    with caplog.at_level(logging.INFO, logger="hoad"):
        for count in (3, 5, 7):
            cf(rand(count, 2, seed=396 + count))
    text = caplog.text
    assert "no one program serves every number of samples" in text
    assert "takes 9 at 3 samples and 25 at 5 (an operand computed from the number of samples" in text, text
    assert "X.shape[0] ** 2" in text, "the user's line"
    assert "compiling program 3 for it, since its program depends on the number of samples" in text


@pytest.mark.parametrize("how", ["/ count", "* count", "/ tensor(count)", "* (count % 7)"])
def test_a_count_used_as_a_value_keeps_one_program_per_count(how):
    """The one program for every count took an integer operand equal to the count for a size
    that follows it (X.shape[0] in a mean: the gradient was x1.28 at the second count, x2 at the
    third), compared folded constants by shape alone (a tensor made from the count), and missed a
    number that two counts share by chance (100 % 7 == 128 % 7)."""
    scale = {"/ count": lambda n: 1 / n, "* count": lambda n: n, "/ tensor(count)": lambda n: 1 / n,
             "* (count % 7)": lambda n: n % 7}[how]

    def f(X):
        n = X.shape[0]
        s = {"/ count": lambda y: y / n, "* count": lambda y: y * n,
             "/ tensor(count)": lambda y: y / torch.tensor(float(n), dtype=y.dtype),
             "* (count % 7)": lambda y: y * (n % 7)}
        return s[how](mlp(X))

    cf = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    for count in (100, 128, 200):
        X = rand(count, 3, seed=371)
        res = cf(X)
        one = lambda x: mlp(x) * scale(count)  # noqa: E731
        assert_close(res[0], vmap(torch.func.grad(one))(X), f"gradient at {count} samples")
        assert_close(res[0, 0], vmap(hessian(one))(X), f"Hessian at {count} samples")


def test_chunks_of_a_function_that_reads_its_count_are_refused():
    """Each chunk's function saw the chunk's count: a per-sample value divided by X.shape[0] was
    off by samples / chunk_size (x15.6 at 1000 and 64)."""
    def f(X):
        return mlp(X) / X.shape[0]

    with pytest.raises(hoad.InvalidArgumentError, match="number of samples as a value"):
        hoad.compile(f, order=1, batch_dim=0, chunk_size=16, backend="eager")(rand(40, 3, seed=372))
    res = hoad.compile(mlp, order=1, batch_dim=0, chunk_size=16, backend="eager")(rand(40, 3, seed=372))
    assert_close(res[0], vmap(jacrev(mlp))(rand(40, 3, seed=372)), "chunks of a function that does not")


@pytest.mark.parametrize("layer", ["instance norm", "attention"])
def test_weights_repeated_per_sample_keep_one_program_per_count(layer):
    """Instance norm repeats its weight B times, attention splits B·heads rows: those sizes sat in
    the hoisted prefix, which reads no batched input and kept the second count's size, so a third
    count failed (ExecutionError). The prefix must match too before one program serves all."""
    torch.manual_seed(93)
    if layer == "instance norm":
        norm = torch.nn.InstanceNorm1d(3, affine=True).double()
        f = lambda X: norm(X).tanh().sum((1, 2))  # noqa: E731
        shape, mode = (3, 4), "reverse"
    else:
        mha = torch.nn.MultiheadAttention(4, 2, batch_first=True).double()
        f = lambda X: mha(X, X, X, need_weights=False)[0].tanh().sum((1, 2))  # noqa: E731
        shape, mode = (3, 4), "forward"
    cf = hoad.compile(f, order=1, batch_dim=0, mode=mode, backend="eager")
    for count in (2, 3, 4):
        X = rand(count, *shape, seed=390 + count)
        want = torch.stack([torch.func.jacrev(lambda x: f(x[None])[0])(x) for x in X])
        assert_close(cf(X)[0], want, f"{count} samples")


def test_samples_over_budget_with_the_general_program_are_refused():
    cf = hoad.compile(mlp, order=2, batch_dim=0)
    cf(rand(4, 3, seed=380))
    cf(rand(5, 3, seed=381))
    b = [e for e in cf._cache.values() if e.build.stats.get("any_samples")][0].build
    b.budget = dataclasses.replace(b.budget, limit=b.budget.plan.peak * 2)  # as if little memory were free
    with pytest.raises(hoad.MemoryBudgetError, match="chunk_size="):
        cf(rand(50, 3, seed=382))


def test_a_nan_python_argument_reuses_its_program():
    """NaN equals no NaN: every call with k=float('nan') built a new program."""
    cf = hoad.compile(lambda x, k: (x * k).sum() + x.sin().sum(), order=1, backend="eager")
    x = rand(3, seed=373)
    for _ in range(3):
        res = cf(x, float("nan"))
    assert len(cf._cache) == 1 and res[0].isnan().all()
