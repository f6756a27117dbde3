"""The packages' layers point down, and no module imports itself back through others.

Every import counts, also one deferred into a function (moving that function elsewhere must not
turn it into an upward import unseen). Each `jaxrlhf` package or top-level module has a rank
(`RANKS`): it may import its own modules and modules of lower ranks only. `generator_service`
imports nothing of `jaxrlhf` (the wire contract, `jaxrlhf_wire`, is all they share:
tests/generator_service/test_contract.py). And the graph of modules has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("jaxrlhf", "generator_service", "jaxrlhf_wire")
# Bottom to top. A group is `jaxrlhf.<name>` (a package or a top-level module).
RANKS = {
    "jaxrlhf_wire": 0,
    "generator_service": 1,
    "jaxrlhf.report": 1,
    "jaxrlhf.tokenization": 1,
    "jaxrlhf.sharding": 1,
    "jaxrlhf.fleet.rpc": 1,
    "jaxrlhf.data": 2,
    "jaxrlhf.distributed": 2,
    "jaxrlhf.models": 3,
    "jaxrlhf.losses": 4,
    "jaxrlhf.train_state": 4,
    "jaxrlhf.checkpointing": 4,
    "jaxrlhf.config": 5,
    "jaxrlhf.fleet": 5,
    "jaxrlhf.rl": 6,
    "jaxrlhf.stages": 7,
    "jaxrlhf.prerequisites": 8,
    "jaxrlhf.stage_programs": 8,
    "jaxrlhf.evaluate": 9,
    "jaxrlhf.plan": 9,
    "jaxrlhf.experiments": 9,
    "jaxrlhf.main": 10,
    "jaxrlhf": 11,  # the package's own __init__
}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "_generated" not in path.parts:
                found[module_of(path)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in it (`from a import b` counts a.b when
    it is a module, else a)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]  # fmt: skip
        out |= {n for n in names if n.split(".")[0] in PACKAGES}
    return out


def group(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxrlhf" and len(parts) > 1 else parts[0]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {module: imports(path, set(found)) for module, path in found.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a group of the same or a higher rank than the importer's."""
    bad = []
    for module, targets in edges.items():
        for target in targets:
            mine, theirs = group(module), group(target)
            if mine == theirs:
                continue
            if mine not in RANKS or theirs not in RANKS:
                bad.append(f"{module} -> {target} (no rank: add it to RANKS)")
            elif RANKS[theirs] >= RANKS[mine]:
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in edges:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_imports_point_down_the_layers():
    assert upward(graph()) == []


def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


@pytest.mark.parametrize(
    ("module", "target"),
    [("jaxrlhf.config", "jaxrlhf.rl.rollout"), ("jaxrlhf.rl.learner", "jaxrlhf.stages.reward"),
     ("jaxrlhf.models.paths", "jaxrlhf.config")],
)  # fmt: skip
def test_an_upward_import_is_caught(module, target):
    """The check itself: an import added upward (the three this test was written against)."""
    edges = graph()
    edges[module] = edges[module] | {target}
    assert f"{module} -> {target}" in upward(edges)


def test_a_cycle_is_caught():
    edges = graph()
    edges["jaxrlhf.models.tiny"] = edges["jaxrlhf.models.tiny"] | {"jaxrlhf.models.paths"}
    edges["jaxrlhf.models.paths"] = edges["jaxrlhf.models.paths"] | {"jaxrlhf.models.tiny"}
    pair = {"jaxrlhf.models.paths", "jaxrlhf.models.tiny"}
    assert any(pair <= set(component) for component in cycles(edges))
