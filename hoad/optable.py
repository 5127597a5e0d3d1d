"""The supported-op table, generated from the rule table: ``python -m hoad.optable``.

docs/ops.md embeds this table between markers; a test keeps the two equal
(``python -m hoad.optable --write`` regenerates it there).
"""

from __future__ import annotations

import inspect
import os

from hoad.rules import FAMILIES, PIECEWISE_CONSTANT, RULES, USER_OPS

BEGIN = "<!-- optable:begin -->"
END = "<!-- optable:end -->"


def _defined(fn) -> str:
    """Where the rule is written: the ``def`` a grep finds (a factory's, for a rule it makes) and
    its file, e.g. ``exp`` in ``elementwise.py``."""
    f = inspect.unwrap(getattr(fn, "derivatives", fn))
    qualname = getattr(f, "__qualname__", f.__name__)
    name = qualname.split(".<locals>")[0].split(".")[-1] if "<locals>" in qualname else f.__name__
    return f"`{name}` in `{os.path.basename(inspect.getsourcefile(f))}`"


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
        lines.append(f"| {FAMILIES[op]} | `{op}` | {_defined(fn)} |")
    constant = ", ".join(f"`{op}`" for op in sorted(PIECEWISE_CONSTANT, key=str))
    lines += ["", f"Piecewise-constant (derivative zero, like torch): {constant}; any op with a non-floating output "
              "(comparisons, argmax, integer casts) is constant too."]
    return "\n".join(lines)


def embedded(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def write(path: str = "docs/ops.md") -> None:
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
