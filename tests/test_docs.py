"""The README's supported-op table is the one generated from the rule table."""

from pathlib import Path

from hoad import optable


def test_readme_op_table_matches_rule_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert optable.embedded(readme) == optable.markdown().strip(), (
        "README op table is stale: regenerate it with `python -m hoad.optable --write`")
