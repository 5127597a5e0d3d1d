"""The docs say what the code does: the generated op table is current, every Python block of the
README and of the docs runs, and each doc the README links to exists."""

import re
from pathlib import Path

import pytest

from hoad import optable

ROOT = Path(__file__).resolve().parents[1]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _run(path: Path, namespace: dict) -> dict:
    """The file's Python blocks, in order, in one namespace."""
    for block in _blocks(path):
        exec(compile(block, str(path.relative_to(ROOT)), "exec"), namespace)
    return namespace


def test_op_table_matches_rule_table():
    assert optable.embedded((ROOT / "docs" / "ops.md").read_text()) == optable.markdown().strip(), (
        "docs/ops.md's op table is stale: regenerate it with `python -m hoad.optable --write`")


def test_every_rule_in_the_op_table_is_a_def_a_grep_finds():
    """52 of the table's 141 rule names (``cos_rule``) were made by decorators and factories and
    appeared in no ``def``: each row names the def and its file."""
    rows = re.findall(r"\| `([^`]+)` in `([^`]+)` \|", (ROOT / "docs" / "ops.md").read_text())
    sources = {p.name: p.read_text() for p in (ROOT / "hoad" / "rules").rglob("*.py")}
    assert len(rows) > 100
    missing = [(name, file) for name, file in rows
               if not re.search(rf"^\s*def {re.escape(name)}\b", sources[file], re.M)]
    assert not missing, missing


def test_readme_quickstart_runs():
    namespace = _run(ROOT / "README.md", {})
    assert namespace["res"][0, 1].shape == (5, 4, 4, 3)
    assert namespace["hess"].shape == (256, 2, 2) and namespace["laplacian"].shape == (256,)
    assert namespace["laplacian"].allclose(namespace["hess"].diagonal(dim1=-2, dim2=-1).sum(-1))


def test_guide_examples_run(capsys):
    """docs/guide.md's blocks, run in order in one namespace, do what they say."""
    namespace = _run(ROOT / "docs" / "guide.md", {})
    assert namespace["res"]["fc2.weight", "fc1.bias"].shape == (1, 8, 8)
    assert namespace["laplacian"].shape == (8,)
    assert "def program(" in capsys.readouterr().out


def test_how_it_works_examples_run():
    """docs/how-it-works.md's blocks (a rule for an op of your own) run after the imports they assume."""
    import torch

    import hoad

    _run(ROOT / "docs" / "how-it-works.md", {"torch": torch, "hoad": hoad})


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_between_docs_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).resolve().exists(), f"{doc} links to {target}, which does not exist"


def _slug(heading: str) -> str:
    """A heading's anchor as Markdown's table of contents (and so mkdocs) makes it."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_site_lists_every_page_and_its_links_resolve():
    """What ``mkdocs build --strict`` checks, without mkdocs (not installed in CI): the nav in
    mkdocs.yml names every page of docs/ and nothing else, and every link between pages stays in
    docs/ and lands on a page and a heading that exist."""
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages and len(nav) == len(set(nav))
    bad = []
    for page in pages:
        path = ROOT / "docs" / page
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", text):
            dest = (path.parent / target).resolve() if target else path
            if dest.parent != (ROOT / "docs").resolve() or not dest.exists():
                bad.append(f"{page} -> {target} (not a page of docs/)")
            elif anchor and anchor not in _anchors(dest):
                bad.append(f"{page} -> {target}#{anchor} (no such heading)")
    assert not bad, bad


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs comes with the docs extra: pip install -e '.[docs]'")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_readme_is_a_front_page():
    """The manual lives in docs/: the README stays a front page (at most 10 KB)."""
    assert len((ROOT / "README.md").read_text().encode()) <= 10 * 1024


def test_passes_install_as_hoad_passes_only(tmp_path):
    """passes/ is packaged as hoad.passes: importable there, no top-level `passes` module
    (checked from outside the checkout, where the source tree is not on sys.path)."""
    import subprocess
    import sys

    code = ("import importlib.util, hoad.passes.differentiate as d; "
            "print(importlib.util.find_spec('passes') is None, d.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "hoad.passes.differentiate"]


def test_the_test_map_names_every_module():
    """tests/README.md maps each module to its tests: a new module of hoad/ or passes/ gets a row,
    and a row names only modules that exist."""
    text = (ROOT / "tests" / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    named = set()
    for row in rows:
        first = row.split("|")[1]
        folder = re.match(r"\s*`((?:hoad|passes)(?:/\w+)?)/", first)
        for name in re.findall(r"`([^`]+)`", first):
            path = name if "/" in name or folder is None else f"{folder.group(1)}/{name}"
            if path.endswith(".py"):
                named.add(path)
    modules = {str(p.relative_to(ROOT)) for top in ("hoad", "passes") for p in (ROOT / top).rglob("*.py")}
    covered = {m for m in modules if m in named or f"{m.rsplit('/', 1)[0]}/*" in text.replace("`", "")
               or m.endswith("__init__.py")}
    assert not modules - covered, sorted(modules - covered)
    assert not {n for n in named if n not in modules}, sorted(n for n in named if n not in modules)
