"""The package's layers (README "Layout"): every import of the package's own modules, at module level or inside a
function, goes down this list or stays in its layer, and the import graph has no cycle."""

import ast
import os
from pathlib import Path

import glm5_offload

LAYERS = [  # lowest first: a module may import from its own layer and those above it in this list
    {"__init__", "errors", "util"},
    {"config"},
    {"formats"},
    {"kernels", "checkpoint", "disk_store"},
    {"model"},
    {"ops"},
    {"rules", "planner"},
    {"loader"},
    {"runtime"},
    {"benchmark", "chat", "server", "tiny", "cli"},
]
ROOT = Path(glm5_offload.__file__).parent
PACKAGE = "glm5_offload"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (kernels/ and cli.py are links into the package)."""
    files = {}
    paths = [Path(d) / f for d, _, names in os.walk(ROOT, followlinks=True) for f in names if f.endswith(".py")]
    for path in sorted(paths):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join((PACKAGE,) + (parts[:-1] if parts[-1] == "__init__" else parts))
        files[name] = path
    return files


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file: `from X import a` counts X.a where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def layer_of(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    matches = [i for i, layer in enumerate(LAYERS) if top in layer]
    assert matches, f"{name} is in no layer of LAYERS"
    return matches[0]


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(name, path, set(files)) for name, path in files.items()}


def test_every_module_has_a_layer():
    for name in import_graph():
        layer_of(name)


def test_imports_only_go_down():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in import_graph().items() for b in sorted(targets) if layer_of(b) > layer_of(a)]
    assert upward == []


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_planner_knows_no_operator():
    """It sums what operators declare through ops/base.py's interface: no module class, no operator imported."""
    targets = import_graph()["glm5_offload.planner"]
    assert not [t for t in targets if t.startswith(("glm5_offload.model", "glm5_offload.ops")) and t != "glm5_offload.ops.base"]


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The graph reads imports inside functions and resolves relative ones (a check that could not see them would
    pass a package full of hidden cycles)."""
    path = tmp_path / "mod.py"
    path.write_text("from ..util import span\n\ndef f():\n    from ..loader import load_model\n    from . import engine\n")
    known = {"glm5_offload.util", "glm5_offload.loader", "glm5_offload.runtime.engine", "glm5_offload.runtime"}
    assert imports("glm5_offload.runtime.mod", path, known) == {"glm5_offload.util", "glm5_offload.loader",
                                                                "glm5_offload.runtime.engine"}
    graph = import_graph()
    assert "glm5_offload.formats" in graph["glm5_offload.kernels.dsa_triton"]  # through the kernels/ link
    assert "glm5_offload.runtime.engine" in graph["glm5_offload.cli"]  # cli imports inside its commands
