"""Private torch APIs sit in one module, trainer/parallel/fsdp_api.py: an AST scan over the package finds every
private torch name another module touches (a module path or an imported name with a leading underscore under
``torch``, or a private attribute that the package does not define itself and torch does), and fails on any. The
installed torch must be one of the versions fsdp_api.py was checked against, so an upgrade fails here until each
entry there has been checked again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from ..support import REPO

FOLDERS = ("api", "engine", "loader", "trainer")
ALLOWED = Path("trainer/parallel/fsdp_api.py")
PROBES = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package() -> dict[Path, ast.AST]:
    return {path.relative_to(REPO): ast.parse(path.read_text(encoding="utf-8"), str(path))
            for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py"))}


def _own_names(trees) -> set[str]:
    """Names the package defines: functions, classes, module-level and local names, and attributes it sets on
    ``self`` / ``cls`` (a subclass overriding torch's hook defines it too)."""
    names: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                  and n.value.id in ("self", "cls")):
                names.add(n.attr)
    return names


def private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str, str]]:
    """``(line, name, how)`` for each private torch import in ``tree`` and each private attribute (read, written,
    or named in getattr/setattr/hasattr/delattr) that is not in ``own``; the caller keeps the attributes torch
    defines."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch" and n.level == 0:
            parts = n.module.split(".")
            for a in n.names:
                if any(map(_private, parts)) or _private(a.name):
                    found.append((n.lineno, f"{n.module}.{a.name}", "import"))
        elif isinstance(n, ast.Import):
            found += [(n.lineno, a.name, "import") for a in n.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own:
            found.append((n.lineno, n.attr, "attribute"))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in PROBES and len(n.args) >= 2
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
              and _private(n.args[1].value) and n.args[1].value not in own):
            found.append((n.lineno, n.args[1].value, "attribute"))
    return found


def _torch_defines(names: set[str]) -> set[str]:
    """Of ``names``, those that torch's Python sources define or use (read only when there is something to
    check: a clean package costs nothing)."""
    if not names:
        return set()
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    hits: set[str] = set()
    for path in Path(torch.__file__).parent.rglob("*.py"):
        hits.update(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
        if hits == names:
            break
    return hits


def _violations(trees: dict[Path, ast.AST], own: set[str]) -> list[str]:
    uses = {path: private_uses(tree, own) for path, tree in trees.items()}
    attrs = {name for found in uses.values() for _, name, how in found if how == "attribute"}
    torch_attrs = _torch_defines(attrs)
    return [f"{path}:{line}: {name}" for path, found in uses.items() for line, name, how in found
            if how == "import" or name in torch_attrs]


@pytest.fixture(scope="module")
def trees() -> dict[Path, ast.AST]:
    return _package()


def test_no_module_but_fsdp_api_touches_a_private_torch_name(trees):
    own = _own_names(trees.values())
    others = {path: tree for path, tree in trees.items() if path != ALLOWED}
    bad = _violations(others, own)
    assert not bad, ("private torch names outside trainer/parallel/fsdp_api.py; put each behind a function there, "
                     "with the torch versions it was checked against:\n" + "\n".join(bad))
    # the scan sees what fsdp_api.py does touch (it cannot pass by seeing nothing)
    inside = {name for _, name, _ in private_uses(trees[ALLOWED], own)}
    assert {"torch.distributed.fsdp._fully_shard._fsdp_api.AllGather", "_c10d_functional", "_cached_plans_key",
            "_local_tensor", "_set_unshard_async_op"} <= inside, sorted(inside)


def test_the_scan_finds_each_kind_of_private_use():
    source = ("import torch._dynamo\nfrom torch.nn.modules.batchnorm import _BatchNorm\n"
              "from torch.utils._pytree import tree_map\nx = torch.ops._c10d_functional\n"
              "planner._cached_plans_key = 'k'\ny = getattr(t, '_local_tensor', t)\nself._ours = 1\nself._ours\n")
    found = private_uses(ast.parse(source), own={"_ours"})
    assert [(line, how) for line, _, how in found] == [(1, "import"), (2, "import"), (3, "import"),
                                                       (4, "attribute"), (5, "attribute"), (6, "attribute")], found


def test_the_installed_torch_is_one_fsdp_api_was_checked_against(trees):
    # read from the source (importing the module would load torch's distributed packages for one constant)
    CHECKED_TORCH = next(ast.literal_eval(n.value) for n in trees[ALLOWED].body if isinstance(n, ast.Assign)
                         and [getattr(t, "id", None) for t in n.targets] == ["CHECKED_TORCH"])
    assert torch.__version__.split("+")[0] in CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the versions trainer/parallel/fsdp_api.py was checked against "
        f"({', '.join(CHECKED_TORCH)}): check each private API listed there against it, then add the version")
