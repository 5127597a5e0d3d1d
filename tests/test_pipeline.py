"""PIPELINE names every rewrite a build runs, and explain() times and counts each one."""

import torch
from helpers import rand

import hoad
from hoad.passes.capture import REWRITES
from hoad.pipeline import PIPELINE, SETTLE


def _captured_rewrites(cf, *args) -> dict:
    return hoad.explain(cf, *args).build.stats["capture"]["rewrites"]


def test_pipeline_lists_the_rewrites_a_build_runs_in_order():
    listed = dict((name, rewrites) for name, _, rewrites in PIPELINE)["capture"]
    assert listed == ("trace", *(name for name, _ in REWRITES), *SETTLE)
    f = lambda x: x.norm(dim=-1) ** 2 + torch.sin(x).sum(-1)  # noqa: E731
    ran = _captured_rewrites(hoad.compile(f, order=2, backend="eager", batch_dim=0), rand(4, 3, seed=1))
    assert tuple(ran) == listed
    # without samples, keep_samples_apart is not wanted and does not run
    ran = _captured_rewrites(hoad.compile(lambda x: torch.sin(x).sum(), order=2, backend="eager"), rand(3, seed=2))
    assert tuple(ran) == tuple(name for name in listed if name != "keep_samples_apart")


def test_explain_shows_each_rewrite_and_whether_it_changed_the_graph():
    f = lambda x: torch.norm(x) ** 2 + x.sum()  # noqa: E731 (the square of a norm is rewritten to Σx²)
    explanation = hoad.explain(hoad.compile(f, order=2, backend="eager"), rand(3, seed=3))
    ran = explanation.build.stats["capture"]["rewrites"]
    assert ran["squares_of_norms"]["changed"] and not ran["view_mutations"]["changed"]
    assert ran["squares_of_norms"]["nodes"] < ran["cse"]["nodes"]
    text = str(explanation)
    assert "· squares_of_norms " in text and "· view_mutations (no change)" in text
    for name, _, rewrites in PIPELINE:
        assert f"\n{name} " in text
        for sub in rewrites:
            assert f"· {sub}" in text or sub == "keep_samples_apart"


def test_every_stage_with_rewrites_records_each_by_the_name_pipeline_lists():
    """prune, clean and lower run their rewrites under the same driver as capture: explain() has
    each one's time and each candidate's node count after it."""
    f = lambda x: torch.tanh(x @ x.T).sum()  # noqa: E731
    build = hoad.explain(hoad.compile(f, order=2, backend="eager"), rand(3, 2, seed=4)).build
    for name, _, rewrites in PIPELINE:
        recorded = build.stats[name].get("rewrites", {})
        assert tuple(recorded) == tuple(r for r in rewrites if r != "keep_samples_apart"), name  # (no batch_dim)
        for sub in recorded.values():
            if name != "capture":
                assert set(sub["nodes"]) == set(build.candidates), (name, sub)
    assert build.stats["clean"]["rewrites"]["fold_layout, cse, dce"]["changed"]
