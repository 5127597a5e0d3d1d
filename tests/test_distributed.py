"""hoad under torch.distributed: 2 gloo ranks on the CPU, spawned by the test, each pinned to one
thread, each training on its own collocation points; after every step the parameters equal those
of one process trained on the union of the points (tests/distributed_cases.py runs the ranks)."""

from __future__ import annotations

import distributed_cases as cases
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
WORLD = 2
FORMS = {
    "operator": dict(form="operator"),          # hoad.laplacian(lambda X: ddp_model(X).squeeze(-1), batch_dim=0)
    "module": dict(form="module"),              # hoad.laplacian(ddp_model, batch_dim=0)
    "compile": dict(form="compile"),            # hoad.compile(..., order=2, batch_dim=0, diagonal=True)
    "method": dict(form="method"),              # ddp_model.module.lap(X), a decorated method
    "no_sync": dict(form="operator", accumulate=True),  # two micro-batches, the first under no_sync
}


def spawn(case: dict, tmp_path) -> list:
    """Each rank's result (an error as text fails the test with the rank's traceback)."""
    out = str(tmp_path / "rank")
    mp.spawn(cases.run, args=(WORLD, cases.free_port(), case, out), nprocs=WORLD, join=True)
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]
    for rank, r in enumerate(results):
        assert not isinstance(r, str), f"rank {rank}: {r}"
    return results


@pytest.fixture(scope="module")
def union() -> torch.Tensor:
    """The parameters after each step of one process trained on every rank's points."""
    model = cases.PINN()
    X = torch.cat([cases.points(rank) for rank in range(WORLD)])
    return cases.train(model, cases.laplacian_of("operator", model, "eager"), [X])


@pytest.fixture(scope="module")
def union_with_boundary() -> torch.Tensor:
    """One process's parameters after each step on every rank's loss with a boundary term from a
    plain forward (the mean over ranks: equal numbers of points)."""
    model = cases.PINN()
    lap = cases.laplacian_of("operator", model, "eager")
    opt = torch.optim.SGD(model.parameters(), lr=cases.LR)
    after = []
    for _ in range(cases.STEPS):
        opt.zero_grad()
        (sum(cases.with_boundary(model, lap, cases.points(r), cases.boundary_points(r)) for r in range(WORLD))
         / WORLD).backward()
        opt.step()
        after.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return torch.stack(after)


def check_forms(results: list, names, union, wrapper: str = "DDP") -> None:
    for name in names:
        for rank, by_name in enumerate(results):
            got = by_name[name]
            assert not isinstance(got, str), f"{wrapper} {name}, rank {rank}: {got}"
            torch.testing.assert_close(got["parameters"], union, rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{wrapper} {name}, rank {rank}: {m}")
            if wrapper == "DDP":
                # one gradient bucket averaged per step: DDP's hooks fired once per step, and not at all
                # for a micro-batch under no_sync
                assert got["averaged"] == cases.STEPS, f"{name}, rank {rank}: {got['averaged']} averagings"
                continue
            # FSDP's hooks fired once per step: one reduce-scatter per sharded layer (3) a step, none for
            # the inference call nor for a micro-batch under set_requires_gradient_sync(False)
            if name in FORMS:
                assert got["scattered"] == 3 * cases.STEPS, \
                    f"FSDP2 {name}, rank {rank}: {got['scattered']} reduce-scatters"
            else:  # beside a plain forward whose input requires grad FSDP ran one more reduce-scatter a step
                # (12 in 3 steps, measured): its post-backward hooks on that forward's inputs; the sums agree
                assert got["scattered"] >= 3 * cases.STEPS, f"FSDP2 {name}, rank {rank}: {got['scattered']}"
            assert got["sharded"], f"FSDP2 {name}, rank {rank}: parameters left gathered"


RUNS = [dict(name=name, **options) for name, options in FORMS.items()]


@pytest.fixture(scope="module")
def eager_suite(tmp_path_factory) -> list:
    """Every pattern on 2 ranks with eager programs: one process group for all of them."""
    runs = RUNS + [dict(name="default DDP", form="operator", find_unused=False)]
    return spawn({"kind": "suite", "options": {"backend": "eager", "runs": runs}}, tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="module")
def inductor_suite(tmp_path_factory) -> list:
    return spawn({"kind": "suite", "options": {"backend": "inductor", "runs": RUNS}},
                 tmp_path_factory.mktemp("inductor"))


def part(results: list, name: str) -> list:
    for rank, r in enumerate(results):
        assert not isinstance(r[name], str), f"{name}, rank {rank}: {r[name]}"
    return [r[name] for r in results]


def test_data_parallel_training_through_hoad_equals_one_process(eager_suite, union):
    results = part(eager_suite, "ddp")
    check_forms(results, FORMS, union)
    for by_name in results:  # DDP's default needs every parameter in the loss: said, with the setting
        assert by_name["default DDP"].startswith("DistributedError: DistributedDataParallel did not get a gradient")
        assert "find_unused_parameters=True" in by_name["default DDP"]


@pytest.mark.slow
@pytest.mark.inductor
def test_data_parallel_training_through_compiled_programs_equals_one_process(inductor_suite, union):
    check_forms(part(inductor_suite, "ddp"), FORMS, union)


def test_dtensor_arguments_run_each_ranks_program(eager_suite):
    """Points sharded along the samples (9 over 2 ranks: 5 and 4) and a replicated weight: the
    results come back sharded the same way and gather to one process's; a loss on them gives
    the weight a Partial gradient whose sum is one process's; other placements are refused."""
    from torch.func import hessian, vmap

    results = part(eager_suite, "dtensor")
    X = torch.rand(9, 3, generator=torch.Generator().manual_seed(5), dtype=cases.DT)
    W = torch.rand(3, 4, generator=torch.Generator().manual_seed(6), dtype=cases.DT).requires_grad_()

    def u(x, w):
        return (x @ w).tanh().pow(2).sum(-1)

    H = vmap(hessian(u), in_dims=(0, None))(X, W)
    lap = H.diagonal(dim1=-2, dim2=-1).sum(-1)
    (grad,) = torch.autograd.grad((lap ** 2).mean(), W)
    for rank, r in enumerate(results):
        assert r["placements"] == ["S(0)", "S(0)"] and r["local rows"] == (5, 4)[rank]
        torch.testing.assert_close(r["value"], u(X, W).detach())
        torch.testing.assert_close(r["hessian"], H.detach())
        torch.testing.assert_close(r["laplacian"], lap.detach())
        assert r["grad placement"] == "P(sum)"
        torch.testing.assert_close(r["grad"], grad)
        assert r["replicated"][0] == "R"
        torch.testing.assert_close(r["replicated"][1], torch.func.grad(u)(X[0], W.detach()))
        assert r["errors"]["Shard(1)"].startswith("DistributedError: argument 'x' is a DTensor placed as S(1)")
        assert "Shard(0), with batch_dim=0) or replicated (Replicate())" in r["errors"]["Shard(1)"]
        assert "pass batch_dim=0" in r["errors"]["no batch_dim"]


def _check_split(results: list) -> None:
    from torch.func import functional_call, hessian

    model = cases.Classifier()
    X, y = cases.classifier_data()
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for p in model.parameters())

    def loss(*ps):
        return torch.nn.functional.cross_entropy(functional_call(model.net, dict(zip([n[4:] for n in names], ps)),
                                                                 (X,)), y)

    H = hessian(loss, argnums=tuple(range(len(params))))(*params)
    want = {(names[i], names[j]): H[i][j] for i in range(len(names)) for j in range(i, len(names))}
    owners = results[0]["owners"]
    assert results[1]["owners"] == owners and set(owners.values()) == {0, 1}
    sizes = [sum(want[k].numel() for k, r in owners.items() if r == rank) for rank in (0, 1)]
    largest = max(v.numel() for v in want.values())
    assert abs(sizes[0] - sizes[1]) <= largest, f"unbalanced: {sizes} entries"
    for rank, r in enumerate(results):
        assert set(r["own"]) == {k for k, o in owners.items() if o == rank}
        for k, block in r["own"].items():
            torch.testing.assert_close(block, want[k], msg=lambda m: f"rank {rank}, block {k}: {m}")
        for k, block in r["gathered"].items():
            torch.testing.assert_close(block, want[k], msg=lambda m: f"gathered on rank {rank}, block {k}: {m}")
        assert r["refusal"].startswith("block (") and f"this is rank {rank}): res.gather()" in r["refusal"]
    assert set(results[0]["held after gather(dst=0)"]) == set(owners)
    assert set(results[1]["held after gather(dst=0)"]) == {k for k, o in owners.items() if o == 1}


def test_a_parameter_hessian_split_over_ranks(eager_suite):
    """split_blocks=True deals the Hessian's canonical blocks to the 2 ranks, balanced by size:
    each rank's own blocks are torch.func's, another's block is refused with the way to it,
    gather() brings all of them to every rank, gather(dst=0) to rank 0 only."""
    _check_split(part(eager_suite, "split"))


@pytest.mark.slow
@pytest.mark.inductor
def test_a_parameter_hessian_split_over_ranks_compiled(inductor_suite):
    _check_split(part(inductor_suite, "split"))


def test_fsdp2_training_through_hoad_equals_one_process(eager_suite, union, union_with_boundary):
    """A PINN sharded by fully_shard (per layer and at the root): hoad runs FSDP's forward protocol
    around its program (gather before, free and hooks after), so every form trains as one process
    on the union of the points, and FSDP's set_requires_gradient_sync accumulates. A step that adds
    a plain forward of the sharded model (a boundary term) trains as one process too."""
    results = part(eager_suite, "fsdp")
    check_forms(results, FORMS, union, "FSDP2")
    check_forms(results, ["with a plain forward"], union_with_boundary, "FSDP2")


@pytest.mark.slow
@pytest.mark.inductor
def test_fsdp2_training_through_compiled_programs_equals_one_process(inductor_suite, union):
    check_forms(part(inductor_suite, "fsdp"), FORMS, union, "FSDP2")


def _check_fsdp_hessian(results: list) -> None:
    for rank, r in enumerate(results):
        assert r["sharded"], f"rank {rank}: parameters left gathered"
        assert set(r["whole"]) == set(r["reference"]) == set(r["split"])
        for part_name in ("whole", "split"):
            for k, block in r[part_name].items():
                torch.testing.assert_close(block, r["reference"][k], rtol=1e-13, atol=1e-15,
                                           msg=lambda m: f"{part_name} on rank {rank}, block {k}: {m}")


def test_a_parameter_hessian_over_fsdp2_shards(eager_suite):
    """A classifier loss's Hessian in parameters sharded by FSDP2 (DTensor shards): every block
    equals the unsharded model's, whole or split over the ranks, and the parameters are shards
    again after the call. The unsharded reference is checked against torch.func by the split test."""
    _check_fsdp_hessian(part(eager_suite, "fsdp hessian"))


@pytest.mark.slow
@pytest.mark.inductor
def test_a_parameter_hessian_over_fsdp2_shards_compiled(inductor_suite):
    _check_fsdp_hessian(part(inductor_suite, "fsdp hessian"))


def test_fsdp2_uses_hoad_cannot_follow_are_refused_naming_what_works(eager_suite):
    for rank, said in enumerate(r["fsdp refusals"] for r in eager_suite):
        assert said["mixed precision"].startswith("DistributedError: the function reaches FSDPPINN, sharded by "
                                                  "fully_shard with a MixedPrecisionPolicy"), f"rank {rank}"
        assert "module.to(dtype) before fully_shard" in said["mixed precision"]
        assert said["grouped"].startswith("DistributedError: the function reaches"), f"rank {rank}: {said['grouped']}"
        assert "call fully_shard on each module" in said["grouped"]


def test_a_model_sharded_after_the_first_call(eager_suite):
    """fully_shard applied after the operator's first call: the next call finds the sharded modules
    while it builds, runs FSDP's protocol around itself, gives the same Laplacian, and the loss's
    gradients land on the DTensor shards (it was a DistributedError naming a trace outside a call)."""
    for rank, r in enumerate(part(eager_suite, "sharded later")):
        torch.testing.assert_close(r["after"], r["before"], rtol=1e-13, atol=1e-13, msg=lambda m: f"rank {rank}: {m}")
        assert r["gradients"] and set(r["gradients"]) == {"DTensor"}, f"rank {rank}: {r['gradients']}"
