"""Imports flow one way: utilities ← algebra ← rules, lowering ← passes ← pipeline ← api.

The derivative algebra knows nothing about the machine, rules nothing about lowering, passes
nothing about the pipeline or the API. Checked on the source, so a new import that reaches up a
layer fails here, not in a review.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a module's layer: it may import from its own layer and those below (higher numbers are above)
LAYERS = {
    "hoad.errors": 0, "hoad.source": 0, "hoad.budget": 0, "hoad.binding": 0, "hoad.guards": 0, "hoad.distributed": 0,
    "hoad.progress": 0, "hoad.tiers": 0, "hoad.numbers": 0,
    "hoad.algebra": 1,
    "hoad.rules": 2, "hoad.lowering": 2,
    "hoad.passes": 3,
    "hoad.pipeline": 4, "hoad.training": 4, "hoad.derivatives": 4, "hoad.printing": 4, "hoad.explanation": 4,
    "hoad.optable": 4,
    "hoad.options": 4, "hoad.methods": 4, "hoad.cache": 4,
    "hoad.chunking": 5, "hoad.compiled": 5, "hoad.directions": 5,
    "hoad.api": 6,  # (hoad.compile(..., packed=True) is hoad.packed's operator)
    "hoad.operators": 6, "hoad.jets": 6, "hoad.packed": 6, "hoad": 7, "hoad.warm": 7,
}
# rules and lowering share a layer but must not know each other
APART = {("hoad.rules", "hoad.lowering"), ("hoad.lowering", "hoad.rules")}


def _layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return name, LAYERS[name]
    raise KeyError(module)


def _modules():
    for path in sorted((ROOT / "hoad").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts), path
    for path in sorted((ROOT / "passes").rglob("*.py")):
        rel = path.relative_to(ROOT / "passes").with_suffix("")
        yield ".".join(("hoad", "passes") + (rel.parts[:-1] if rel.name == "__init__" else rel.parts)), path


def _imports(path: Path, package: str = "hoad") -> list[str]:
    """Modules of ``package`` the file imports, at module level or inside functions (a deferred
    import is still a dependency: hoad/source.py reached up to hoad.passes from a function)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in names if n == package or n.startswith(package + ".")]


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_flow_one_way(module, path):
    own, level = _layer_of(module)
    for imported in _imports(path):
        if imported != "hoad" and _module_of(imported, _known()) is None:
            continue  # (a name imported from a module: its module is checked)
        other, other_level = _layer_of(_module_of(imported, _known()) or imported)
        assert other_level <= level, f"{module} (layer {level}) imports {imported} (layer {other_level})"
        assert (own, other) not in APART, f"{module} imports {imported}"


def test_no_module_level_flags_steer_the_algebra():
    """The layout switches travel in a Target; the algebra keeps no mutable module state."""
    for path in (ROOT / "hoad" / "algebra").glob("*.py"):
        text = path.read_text()
        assert "ContextVar" not in text and "global " not in text, path.name


@functools.cache
def _known() -> dict[str, Path]:
    """Every module of hoad (passes/ as hoad.passes) and of benchmarks/, by name."""
    known = dict(_modules())
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        known[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return known


def _module_of(name: str, known: dict) -> str | None:
    """The module ``name`` is, or is a name in (``hoad.passes.clean.cse`` -> ``hoad.passes.clean``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_no_import_cycles():
    """No module reaches itself through imports, deferred ones included: lowering.inductor and
    kernels, rules.elementwise and multilinear, source and passes.decompositions, and two
    groups of benchmarks/ modules did."""
    known = _known()
    graph = {}
    for module, path in known.items():
        package = "benchmarks" if module.startswith("benchmarks") else "hoad"
        targets = {_module_of(n, known) for n in _imports(path, package)}
        # (a package's __init__ re-exports its modules: importing it is not a dependency of them)
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", ["hoad.api", "hoad.compiled", "hoad.cache", "hoad.chunking", "hoad.methods",
                                    "hoad.options", "hoad.operators", "hoad.jets", "hoad.directions"])
def test_the_api_reads_a_build_not_the_passes(module):
    """The public layer reads what a build hands it (hoad.pipeline.Build: written inputs, user ops,
    the memory budget) and imports nothing from hoad.passes: cache and chunking did, to walk the
    captured graph and to redo the budget's arithmetic."""
    path = _known()[module]
    assert not [n for n in _imports(path) if n.startswith("hoad.passes")], module
