"""The README's supported-op table is the one generated from the rule table."""

from pathlib import Path

from hoad import optable


def test_readme_op_table_matches_rule_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert optable.embedded(readme) == optable.markdown().strip(), (
        "README op table is stale: regenerate it with `python -m hoad.optable --write`")


def test_readme_examples_run(capsys):
    """The README's Python blocks, run in order in one namespace, do what they say."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["res"]["fc2.weight", "fc1.bias"].shape == (1, 8, 8)
    assert namespace["laplacian"].shape == (8,)
    assert "def program(" in capsys.readouterr().out


def test_passes_install_as_hoad_passes_only(tmp_path):
    """passes/ is packaged as hoad.passes: importable there, no top-level `passes` module
    (checked from outside the checkout, where the source tree is not on sys.path)."""
    import subprocess
    import sys

    code = ("import importlib.util, hoad.passes.differentiate as d; "
            "print(importlib.util.find_spec('passes') is None, d.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "hoad.passes.differentiate"]
