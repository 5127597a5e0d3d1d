"""hoad over PyTorch's OpInfo database against nested torch.func (tests/opinfo_sweep.py does the work).

``test_opinfo_fast`` (default suite, ~40 s) runs a fixed subset spread over the families;
``test_opinfo_full`` (``pytest -m slow``, ~8 min on 2 cores) runs every op, and
``test_opinfo_collapsed`` (slow, ~9 min, one process) every op through
``hoad.taylor(..., collapse=True)``. Each fails when an op is wrong or crashes unless it is listed
in ``KNOWN_BROKEN`` (reported, not failed), when an op is unsupported or refused without being
listed in ``UNSUPPORTED``/``REFUSED``, and when a listed op is now exact (remove it: coverage only
goes up). ``tests/opinfo_expected.py`` holds the lists;
``python tests/opinfo_sweep.py --all --write-expected tests/opinfo_expected.py`` regenerates them.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal imports both
pytest.importorskip("numpy")

import opinfo_expected as expected  # noqa: E402
import opinfo_sweep as sweep  # noqa: E402

LISTS = {"UNSUPPORTED": expected.UNSUPPORTED, "REFUSED": expected.REFUSED, "KNOWN_BROKEN": expected.KNOWN_BROKEN}
LIST_FOR = {"unsupported": "UNSUPPORTED", "refused": "REFUSED", "wrong": "KNOWN_BROKEN", "crash": "KNOWN_BROKEN"}


def listed_in(name: str) -> str | None:
    return next((k for k, v in LISTS.items() if name in v), None)


def judge(results) -> tuple[list[str], list[str]]:
    """(failures, notes) of a sweep against the expectations."""
    failures, notes = [], []
    for r in results:
        where = listed_in(r.name)
        if r.status == "skipped":
            if where:
                notes.append(f"{r.name}: listed in {where} but skipped now ({r.reason})")
            continue
        if r.status == "exact":
            if where:
                failures.append(f"{r.name}: exact now; remove it from {where} in tests/opinfo_expected.py "
                                "(coverage only goes up)")
            continue
        want = LIST_FOR[r.status]
        if where == want:
            if r.status in ("wrong", "crash"):
                notes.append(f"{r.name}: known broken ({r.status}): {r.reason}")
            elif r.status == "unsupported" and expected.UNSUPPORTED[r.name] != r.reason:
                notes.append(f"{r.name}: unsupported at {r.reason} now (listed: {expected.UNSUPPORTED[r.name]})")
            continue
        if where is None:
            failures.append(f"{r.name}: {r.status} and not listed in {want}: {r.reason}")
        else:
            failures.append(f"{r.name}: {r.status} now but listed in {where}: move it to {want} "
                            f"in tests/opinfo_expected.py ({r.reason})")
    return failures, notes


def run_and_judge(names, modes=sweep.MODES, exact_anyway=frozenset()):
    """Sweep ``names`` (every op: None) in ``modes`` and judge; an op in ``exact_anyway`` may be
    exact although listed."""
    results = sweep.sweep(names, modes)
    failures, notes = judge([r for r in results if not (r.status == "exact" and r.name in exact_anyway)])
    print()
    print(sweep.format_counts(results))
    for r in results:
        if r.status != "exact":
            print(f"  {r.name:<48} {r.status:<11} {r.reason}")
    for n in notes:
        print("note:", n)
    broken = [r.name for r in results if r.name in expected.KNOWN_BROKEN and r.status in ("wrong", "crash")]
    if broken:  # xfail-like: reported (in pytest's warnings summary too), not failed
        warnings.warn(f"OpInfo sweep, {sweep.format_counts(results)}; known broken (tests/opinfo_expected.py "
                      f"KNOWN_BROKEN): {', '.join(broken)}", stacklevel=2)
    assert not failures, f"{len(failures)} OpInfo failures:\n" + "\n".join(failures)
    return results


def test_expected_lists_are_disjoint_and_known():
    names = {sweep.op_name(op) for op in sweep.eligible_ops()}
    seen = {}
    for list_name, entries in LISTS.items():
        for name in entries:
            assert name in names, f"{list_name} lists {name!r}, which is not an eligible OpInfo"
            assert name not in seen, f"{name!r} is in both {seen[name]} and {list_name}"
            seen[name] = list_name


def test_opinfo_fast():
    eligible = {sweep.op_name(op) for op in sweep.eligible_ops()}
    assert set(sweep.FAST_OPS) <= eligible, f"not OpInfo names: {sorted(set(sweep.FAST_OPS) - eligible)}"
    results = run_and_judge(sweep.FAST_OPS)
    assert len(results) == len(sweep.FAST_OPS)


@pytest.mark.slow
def test_opinfo_full():
    results = run_and_judge(None)
    counts = sweep.counts(results)
    assert counts["exact"] > 0


@pytest.mark.slow
def test_opinfo_collapsed():
    """Every op under the rules' diagonal mode with the top order collapsed (the Laplacian's
    form), its input curved through the sample point so that every order of it reaches the
    rule: a collapsed top-order input crashed matrix_exp's rule, and no dense sweep reached it."""
    # (the curve hands as_strided a new tensor, not the sample's view, which dense mode refuses)
    results = run_and_judge(None, ("collapsed",), exact_anyway=frozenset({"as_strided.partial_views"}))
    assert sweep.counts(results)["exact"] > 0
