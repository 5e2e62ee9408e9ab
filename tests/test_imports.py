"""No import circle in the package, hidden ones included: importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``, so those count as imported (except a module's own packages,
already running when it is imported). A plug-in that config.py needed through a package whose
``__init__`` imports the plug-ins would close a circle here (see fedslice.registry)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph(root: Path = SRC, package: str = "fedslice") -> dict[str, set[str]]:
    mods = {}
    for f in (root / package).rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    def ancestors(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        own = set(ancestors(m)) | ({m} if f.name == "__init__.py" else set())
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                r = resolve(t)
                for a in ([*ancestors(r), r] if r else []):
                    if a in mods and a != m and a not in own:
                        graph[m].add(a)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_through_package_inits():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_circle_through_a_package_init():
    g = {"p.config": {"p.methods.registry"}, "p.methods.registry": set(),
         "p.methods": {"p.methods.heads"}, "p.methods.heads": {"p.config"}}
    g["p.config"].add("p.methods")  # importing p.methods.registry runs p/methods/__init__
    assert cycles(g) == [["p.config", "p.methods", "p.methods.heads"]]


def test_config_and_registry_stay_below_every_plug_in():
    g = import_graph()
    plugins = ("fedslice.methods", "fedslice.peft", "fedslice.fl.rules", "fedslice.plugins",
               "fedslice.experiment")
    lows = [m for m in g if m == "fedslice.registry" or m == "fedslice.config"
            or m.startswith("fedslice.config.")]  # the config package: every section's module
    assert "fedslice.config" in lows
    for low in lows:
        assert not any(t.startswith(plugins) for t in g[low]), (low, g[low])


def test_no_module_outside_the_methods_imports_a_method():
    """A method's package (raffm, heads, ...) is reached through the registry (its entry's hooks,
    e.g. ``elastic_export`` for ``fedslice export --size``), never imported by the layers that
    use methods."""
    import fedslice.plugins  # noqa: F401
    from fedslice.registry import METHODS

    g = import_graph()
    own = {f"fedslice.methods.{n}" for n in METHODS.names()} & set(g)
    assert own >= {"fedslice.methods.raffm", "fedslice.methods.heads"}
    bad = [(m, t) for m, ts in g.items() if not m.startswith("fedslice.methods")
           for t in ts if t in own or t.rpartition(".")[0] in own]
    assert bad == []
