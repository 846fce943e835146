"""The import graph: no cycles, and no lower layer importing a higher one.

Layers, lowest first: data_builders < models < analysis < scripts, train; inside models, the attention
surgery < model loading (models/*.py) < training infrastructure; inside analysis, measurement < evaluation <
reports < the command-line reports on top (analysis/*.py and the study package), except `analysis.stats` (numpy and
scipy only),
which sits below them all: every layer's intervals go through it. Every import statement of the project's own
modules counts, also one inside a function (it is a dependency all the same).
"""
from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

PACKAGES = ("data_builders", "models", "analysis", "scripts")
LAYER = {"data_builders": 0, "models": 1, "analysis": 2, "scripts": 3, "train": 3}
# Sub-packages, lowest first; a module directly in the package sits at the rank named by "".
SUBLAYER = {"models": {"attention": 0, "": 1, "training": 2},
            "analysis": {"measure": 0, "evaluation": 1, "report": 2, "": 3, "study": 3}}
BELOW_SUB_PACKAGES = {"analysis.stats"}  # modules directly in a package that rank below its sub-packages


def project_modules() -> dict[str, ast.Module]:
    modules = {"train": ast.parse((ROOT / "train.py").read_text())}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = ast.parse(path.read_text())
    return modules


def imports_of(tree: ast.Module, known: set[str]) -> set[str]:
    """Project modules imported anywhere in `tree` (`from pkg import mod` resolves to the module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` is the module; `from mod import name` the module it names
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if name in known else node.module for name in names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imports_of(tree, known) - {name} for name, tree in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer(module: str) -> int:
    return LAYER[module.split(".")[0]]


def sublayer(module: str) -> tuple[str, int] | None:
    """(package, rank) of a module of a layered package; None for the others."""
    package, *rest = module.split(".")
    ranks = SUBLAYER.get(package)
    if ranks is None or not rest:
        return None
    if module in BELOW_SUB_PACKAGES:
        return package, min(ranks.values()) - 1
    return package, ranks.get(rest[0] if len(rest) > 1 else "", ranks[""])


def test_the_walker_sees_a_cycle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def f():\n    from analysis.measure.prior import prior_profile\n")
    assert imports_of(tree, {"analysis", "analysis.measure.prior"}) == {"analysis.measure.prior"}
    tree = ast.parse("from analysis import stats\nfrom analysis.stats import ALPHA\n")
    assert imports_of(tree, {"analysis", "analysis.stats"}) == {"analysis.stats"}  # not the package itself


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("package", ["data_builders", "models", "analysis"])
def test_no_upward_import(package):
    upward = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                    if module.split(".")[0] == package for target in targets if layer(target) > layer(module))
    assert upward == []


def test_every_sub_package_has_a_rank():
    for package, ranks in SUBLAYER.items():
        folders = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
        assert folders == set(ranks) - {""}, f"{package}: give every sub-package a rank in SUBLAYER"


@pytest.mark.parametrize("package", sorted(SUBLAYER))
def test_no_upward_import_between_sub_packages(package):
    upward = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                    if module.split(".")[0] == package for target in targets
                    if target.split(".")[0] == package and sublayer(target)[1] > sublayer(module)[1])
    assert upward == []
