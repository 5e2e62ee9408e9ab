"""The benchmarks import what the library has: every ``from fedslice... import name`` of a bench/
script names a module and a name that exist (benchmarks run rarely; a renamed or moved name
would otherwise only show when someone runs them)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.rglob("*.py"))


def fedslice_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from fedslice... import name`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedslice"):
            out += [(node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(BENCH)) for p in SCRIPTS])
def test_bench_script_imports_exist(script):
    missing = []
    for module, name in fedslice_imports(script):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{script.name} imports what fedslice does not have: {missing}"
