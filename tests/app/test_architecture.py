"""The import graph of the installed package: no circles, between modules or between subpackages, and
dependencies point one way (engine <- loader <- trainer).

Every import counts, including those inside functions: a function-local import can defer a heavy third-party
package, but it must not be a way to hide a circle between our own modules. Lazy export tables (``_LAZY``) and
``importlib.import_module("dutycycle...")`` with a literal name count as imports too.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil

PACKAGES = ("dutycycle.engine", "dutycycle.loader", "dutycycle.trainer")
ORDER = {p: i for i, p in enumerate(PACKAGES)}  # a package may import only the packages before it


def _modules() -> dict[str, tuple[str, bool]]:
    """Every module of the installed package: name -> (file, is_package)."""
    out = {}
    for top in PACKAGES:
        pkg = importlib.import_module(top)
        out[top] = (pkg.__file__, True)
        for info in pkgutil.walk_packages(pkg.__path__, top + "."):
            spec = importlib.util.find_spec(info.name)
            out[info.name] = (spec.origin, info.ispkg)
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The longest project module that ``name`` (a module or ``module.attribute``) names."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def _edges(module: str, path: str, is_pkg: bool, modules: dict) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if is_pkg else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def relative(level: int, name: str | None) -> str:
        base = package.split(".")
        if level > 1:
            base = base[: -(level - 1)]
        return ".".join(base + ([name] if name else []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = relative(node.level, node.module) if node.level else node.module
            for a in node.names:  # `from pkg import submodule` imports the submodule
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY" for t in node.targets):
            for v in node.value.values:
                s = v.value
                found.add(relative(len(s) - len(s.lstrip(".")), s.lstrip(".")) if s.startswith(".") else s)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            found.add(node.value)  # module names listed for importlib (the CLI's command modules)
    out = {_resolve(n, modules) for n in found if n.startswith("dutycycle.")}
    return {m for m in out if m and m != module}


def _graph():
    modules = _modules()
    return {m: _edges(m, path, is_pkg, modules) for m, (path, is_pkg) in modules.items()}, modules


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def _unit(module: str, modules: dict) -> str:
    """A module's subpackage (``dutycycle.trainer.step.loop`` -> ``dutycycle.trainer.step``); a module at the
    root of engine, loader or trainer is its own unit."""
    parts = module.split(".")
    if len(parts) <= 3:
        return module
    return ".".join(parts[:3]) if modules[".".join(parts[:3])][1] else module


def test_the_walk_sees_every_subpackage_and_local_imports():
    graph, modules = _graph()
    for name in ("dutycycle.engine.cache.format", "dutycycle.trainer.parallel.comm", "dutycycle.trainer.app.cli"):
        assert name in modules
    # a function-local import is an edge (the CLI imports what its commands do when one runs)
    assert "dutycycle.trainer.app.run" in graph["dutycycle.trainer.app.commands"]
    assert "dutycycle.trainer.launch.train" in graph["dutycycle.trainer.app.run"]
    assert "dutycycle.engine.cli" in graph["dutycycle.trainer.app.cli"]  # by name, through importlib


def test_no_import_circles_between_modules():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_no_import_circles_between_subpackages():
    graph, modules = _graph()
    units: dict[str, set[str]] = {}
    for m, targets in graph.items():
        u = _unit(m, modules)
        units.setdefault(u, set()).update(t for t in map(lambda t: _unit(t, modules), targets) if t != u)
    assert _cycles(units) == []


def test_dependencies_point_one_way_between_packages():
    graph, _ = _graph()
    against = sorted((m, t) for m, targets in graph.items() for t in targets
                     if ORDER[".".join(t.split(".")[:2])] > ORDER[".".join(m.split(".")[:2])])
    assert against == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
