"""The dataset fixtures (tests/fixtures/data) and a way to import their generator scripts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def fixture_script():
    """Import a generator script of tests/fixtures/data by name (that folder is no package)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
