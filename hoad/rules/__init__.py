"""The rule table: one entry per ATen overload, filled from one module per op family."""

from __future__ import annotations

from hoad.rules import elementwise, linear, multilinear, reduction
from hoad.rules.base import Ctx, Jet, merge_tables
from hoad.rules.constant import PIECEWISE_CONSTANT, RANDOM

RULES = merge_tables(linear.RULES, multilinear.RULES, elementwise.RULES, reduction.RULES)
VJPS = merge_tables(linear.VJPS, multilinear.VJPS, elementwise.VJPS, reduction.VJPS)

FAMILIES = {
    op: table.family
    for table in (linear.RULES, multilinear.RULES, elementwise.RULES, reduction.RULES)
    for op in table
}

__all__ = ["RULES", "VJPS", "FAMILIES", "PIECEWISE_CONSTANT", "RANDOM", "Ctx", "Jet"]
