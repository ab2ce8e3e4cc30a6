"""The floor plan holds: each grpo_core sub-package imports only from the floors below it (imports
inside functions count too), the math imports nothing but torch, no module imports its way back
to itself, and only the packages named for it touch torch.distributed, mlflow, boto3 or vLLM.

Read from the source with `ast`, so a new upward import fails here before anyone draws the map."""
import ast
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "grpo_core"
# bottom floor first; a package may import its own floor and every floor below it
FLOORS = [{"io", "algo"}, {"data"}, {"config"}, {"model"}, {"rollout"}, {"policy"}, {"evaluation"},
          {"tracking"}, {"train"}, {"pipeline"}]
FLOOR_OF = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}
# third-party modules that only some packages may import
ONLY_IN = {"torch.distributed": {"policy"}, "mlflow": {"tracking"}, "boto3": {"io"},
           "botocore": {"io"}, "vllm": set()}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "grpo_core":  # from grpo_core import x: x is a sub-package
                found += [(f"grpo_core.{alias.name}", node.lineno) for alias in node.names]
            else:
                found += [(node.module, node.lineno)]
                found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names
                          if (PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/")).with_suffix(
                              ".py").exists()]
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOOR_OF) else None


def test_every_sub_package_has_a_floor_and_a_docstring():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(FLOOR_OF), "a new sub-package needs a floor in FLOORS (and docs/architecture.md)"
    for name in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc and "import" in doc.lower(), f"grpo_core/{name}/__init__.py: what lives there, what it may import"
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the sub-packages: {loose}"


@pytest.mark.parametrize("module", [m for m in MODULES if _package(m)])
def test_imports_go_down_the_floors_only(module):
    own = FLOOR_OF[_package(module)]
    upward = [(target, line) for target, line in _imports(MODULES[module])
              if target.startswith("grpo_core.") and _package(target) and FLOOR_OF[_package(target)] > own]
    assert not upward, f"{module} imports from a higher floor: {upward}"


def test_the_math_imports_nothing_but_torch():
    for module, path in MODULES.items():
        if _package(module) != "algo":
            continue
        outside = {t.split(".")[0] for t, _ in _imports(path)} - {"torch", "grpo_core"} - sys.stdlib_module_names
        inside = {t for t, _ in _imports(path) if t.startswith("grpo_core.") and _package(t) != "algo"}
        assert not outside and not inside, (module, outside, inside)


@pytest.mark.parametrize("library", sorted(ONLY_IN))
def test_libraries_stay_in_their_package(library):
    users = {module for module, path in MODULES.items()
             for target, _ in _imports(path) if target == library or target.startswith(library + ".")}
    strays = {m for m in users if _package(m) not in ONLY_IN[library]}
    assert not strays, f"{library} is imported outside {sorted(ONLY_IN[library])}: {sorted(strays)}"


def test_only_the_policy_calls_torch_distributed():
    """Attribute calls too (``torch.distributed.broadcast_object_list``), which an import scan misses."""
    callers = {module for module, path in MODULES.items() if _package(module) != "policy"
               and any(isinstance(n, ast.Attribute) and n.attr == "distributed" and isinstance(n.value, ast.Name)
                       and n.value.id == "torch" for n in ast.walk(ast.parse(path.read_text())))}
    assert not callers, f"torch.distributed used outside policy/: {sorted(callers)}"


def test_no_import_circle():
    graph = {m: {t for t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # a package's __init__ is imported with every module under it: edges to it are edges to its parent
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_project_dir_is_the_repository_root():
    """The local default's stores live under it: one definition, one floor below every user of it,
    and a module that moves deeper cannot silently move ``.grpo/`` into the package."""
    from grpo_core.io.paths import PROJECT_DIR

    assert PROJECT_DIR == REPO.resolve()
    stray = [m for m, p in MODULES.items() if "parents[" in p.read_text() and m != "grpo_core.io.paths"]
    assert not stray, f"compute the project's directory through grpo_core.io.paths, not __file__: {stray}"
