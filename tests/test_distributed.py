"""hoad under torch.distributed: 2 gloo ranks on the CPU, spawned by the test, each pinned to one
thread, each training on its own collocation points; after every step the parameters equal those
of one process trained on the union of the points (tests/distributed_cases.py runs the ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_cases as cases

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


def check_forms(results: list, names, union) -> None:
    for name in names:
        for rank, by_name in enumerate(results):
            got = by_name[name]
            assert not isinstance(got, str), f"{name}, rank {rank}: {got}"
            torch.testing.assert_close(got["parameters"], union, rtol=1e-12, atol=1e-14,
                                       msg=lambda m: f"{name}, rank {rank}: {m}")
            # one gradient bucket averaged per step: DDP's hooks fired once per step, and not at all
            # for a micro-batch under no_sync
            assert got["averaged"] == cases.STEPS, f"{name}, rank {rank}: {got['averaged']} averagings"


def test_data_parallel_training_through_hoad_equals_one_process(tmp_path, union):
    runs = [dict(name=name, **options) for name, options in FORMS.items()]
    runs.append(dict(name="default DDP", form="operator", find_unused=False))
    results = spawn({"kind": "ddp_forms", "options": {"backend": "eager", "runs": runs}}, tmp_path)
    check_forms(results, FORMS, union)
    for by_name in results:  # DDP's default needs every parameter in the loss: said, with the setting
        assert by_name["default DDP"].startswith("DistributedError: DistributedDataParallel did not get a gradient")
        assert "find_unused_parameters=True" in by_name["default DDP"]


@pytest.mark.slow
@pytest.mark.inductor
def test_data_parallel_training_through_compiled_programs_equals_one_process(tmp_path, union):
    runs = [dict(name=name, **options) for name, options in FORMS.items()]
    results = spawn({"kind": "ddp_forms", "options": {"backend": "inductor", "runs": runs}}, tmp_path)
    check_forms(results, FORMS, union)
