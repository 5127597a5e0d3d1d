"""The supported-op table, generated from the rule table: ``python -m hoad.optable``.

The README embeds this table between markers; a test keeps the two equal.
"""

from __future__ import annotations

import inspect

from hoad.rules import FAMILIES, PIECEWISE_CONSTANT, RULES, USER_OPS

BEGIN = "<!-- optable:begin -->"
END = "<!-- optable:end -->"


def _first_line(fn) -> str:
    doc = inspect.getdoc(getattr(fn, "derivatives", fn)) or ""
    return doc.splitlines()[0] if doc else ""


def markdown() -> str:
    own = {op: fn for op, fn in RULES.items() if op not in USER_OPS}  # hoad's table, not registrations
    rows = sorted(own.items(), key=lambda kv: (FAMILIES[kv[0]], str(kv[0])))
    lines = [f"{len(own)} ATen overloads have rules; composites (softmax, log_softmax, layer_norm, gelu, silu,",
             "clamp, logsumexp, var/std, `F.linear`, `F.scaled_dot_product_attention`, …) decompose into them at "
             "capture.",
             "",
             "| family | ATen overload | rule |",
             "|---|---|---|"]
    for op, fn in rows:
        lines.append(f"| {FAMILIES[op]} | `{op}` | `{fn.__name__}` |")
    constant = ", ".join(f"`{op}`" for op in sorted(PIECEWISE_CONSTANT, key=str))
    lines += ["", f"Piecewise-constant (derivative zero, like torch): {constant}; any op with a non-floating output "
              "(comparisons, argmax, integer casts) is constant too."]
    return "\n".join(lines)


def embedded(readme: str) -> str:
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip()


def write(path: str = "README.md") -> None:
    """Replace the table between the markers in ``path``."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + markdown() + "\n" + text[end:])


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv:
        write()
    else:
        print(markdown())
