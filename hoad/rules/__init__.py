"""The rule table: one entry per ATen overload, filled from one module per op family."""

from __future__ import annotations

import torch

from hoad.rules import (
    arithmetic,
    conv,
    elementwise,
    factorizations,
    indexing,
    linalg,
    linear,
    multilinear,
    pooling,
    reduction,
    special,
)
from hoad.rules.base import Ctx, Jet, merge_tables
from hoad.rules.constant import PIECEWISE_CONSTANT, RANDOM, is_random
from hoad.rules.flat import FLAT

# the modules filling the table, each with its OPS: per op the rule, the VJP and the flat mask,
# registered together (several share a family: pooling, indexing and arithmetic are linear,
# special is elementwise)
_TABLES = tuple(m.OPS for m in (linear, arithmetic, multilinear, elementwise, special, reduction, conv, pooling,
                                 indexing, linalg, factorizations))
RULES = merge_tables(_TABLES, "rules")
VJPS = merge_tables(_TABLES, "vjps")
FAMILIES = {op: table.family for table in _TABLES for op in table.rules}
merge_tables(_TABLES, "flats", FLAT)  # (FLAT holds the masks of ops without a rule already)

# ops with a rule registered from outside (hoad.extend): capture leaves them undecomposed
USER_OPS: set = set()
# registrations so far (hoad.extend): a program built before the last one may use another rule
EDITS = [0]
# user ops hoad gave an autograd formula (hoad.extend): op -> the torch.library.Library holding it
AUTOGRAD_GIVEN: dict = {}
_AUTOGRAD_KEYS = ("Autograd", "AutogradCPU", "AutogradCUDA", "CompositeImplicitAutograd")


def has_autograd(op) -> bool:
    """Whether autograd sees through ``op``: a formula of its own (or hoad's), or a composite of ops.
    A ``torch.library.custom_op`` always has an autograd kernel, which raises without a formula."""
    if op in AUTOGRAD_GIVEN:
        return True
    opdef = torch._library.custom_ops._maybe_get_opdef(op)
    if opdef is not None:
        return opdef._backward_fn is not None
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in _AUTOGRAD_KEYS)


__all__ = ["RULES", "VJPS", "FAMILIES", "USER_OPS", "EDITS", "AUTOGRAD_GIVEN", "has_autograd", "PIECEWISE_CONSTANT",
           "RANDOM", "is_random", "Ctx", "Jet"]
