"""The packages import one way: spec <- models <- actors <- graphs <- serve/jobs/bench/train, with no
import cycles between modules (lazy imports inside functions included: a cycle through one still
ties two layers' modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"spec": 0, "models": 1, "actors": 2, "graphs": 3, "serve": 4, "serve_app": 4, "jobs": 4, "bench": 4,
          "train": 4}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layered packages."""
    out = {}
    for top in LAYERS:
        if (ROOT / f"{top}.py").is_file():
            out[top] = ROOT / f"{top}.py"
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body, each resolved to the most specific
    module it names (`from graphs import engine` is graphs.engine; `from graphs import X` of a name
    is the package graphs)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in LAYERS and name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        # A module's own package (its __init__) runs first anyway; an edge to it is not a dependency.
        graph[name] = {m for m in imports_of(path, modules) if not name.startswith(m + ".") and m != name}
    return graph


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{name} ({name.split('.')[0]}) imports {dep} ({dep.split('.')[0]})"
              for name, deps in import_graph().items() for dep in sorted(deps)
              if LAYERS[dep.split(".")[0]] > LAYERS[name.split(".")[0]]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_every_package_says_what_it_holds_and_may_import():
    """Each package's docstring names what it holds and the layers it may import (test_layers)."""
    missing = [top for top in LAYERS if (ROOT / top / "__init__.py").is_file()
               and "may import" not in (ast.get_docstring(ast.parse((ROOT / top / "__init__.py").read_text())) or "").lower()]
    assert not missing, f"packages whose __init__ docstring does not say what they may import: {missing}"
