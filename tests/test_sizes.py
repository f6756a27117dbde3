"""Rooms with one job: in the product code (jaxrlhf, generator_service, jaxrlhf_wire), no file
over 500 lines and no function over 80, except the declarative tables named in `TABLES` (a
table reads top to bottom however long it is)."""

from __future__ import annotations

import ast

from tests.conftest import REPO

PACKAGES = ("jaxrlhf", "generator_service", "jaxrlhf_wire")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# "path:function": functions that are declarative tables.
TABLES: frozenset[str] = frozenset()


def product_files():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_generated" not in path.parts:
                yield path


def long_functions(path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            name = f"{path.relative_to(REPO)}:{node.name}"
            if length > limit and name not in TABLES:
                out.append(f"{name} ({length} lines)")
    return out


def test_no_product_file_is_over_500_lines():
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in product_files()
            if (n := p.read_text().count("\n")) > MAX_FILE_LINES]  # fmt: skip
    assert long == []


def test_no_product_function_is_over_80_lines():
    assert [name for path in product_files() for name in long_functions(path)] == []


def test_the_check_sees_a_long_function(tmp_path):
    """(the rule itself: an 81-line function is reported, an 80-line one is not)"""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    path = REPO / "tests" / f"_sizes_probe_{tmp_path.name}.py"
    try:
        path.write_text(f"def long():\n{body}\n    return 0\n\ndef short():\n    return 1\n")
        assert long_functions(path) == [f"{path.relative_to(REPO)}:long (81 lines)"]
        assert long_functions(path, limit=81) == []
    finally:
        path.unlink()
