"""The import graph of ``src/maxscore``: no cycles, and every arrow points down the layers.

Built with ``ast`` from the source, so it needs no imports of its own: every ``import`` and
``from ... import`` of a module counts (inside functions too), except those under
``if TYPE_CHECKING:``. A package's own ``__init__`` is not an edge of its submodules (Python
runs it first in any case).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Layers, lowest first: a module may import its own layer and the ones below, never above.
LAYERS: list[tuple[str, ...]] = [
    (
        "maxscore._lazy",
        "maxscore._autoregister",
        "maxscore.config_types",
        "maxscore.compiled",
        "maxscore.preset_tables",
        "maxscore.host_memory",
        "maxscore.file_modes",
        "maxscore.write_errors",
    ),
    ("maxscore.routing",),
    ("maxscore.moe",),
    ("maxscore.parallel",),
    ("maxscore.models",),
    ("maxscore.data", "maxscore.checkpoints"),
    ("maxscore.evaluation",),
    ("maxscore.analysis",),
    ("maxscore.training",),
    ("maxscore.cli", "maxscore.cli_options", "maxscore.model_commands", "maxscore"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "maxscore").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The maxscore modules ``module`` imports (module level and inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # for type checkers only
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:  # a submodule when it is one, else the module
                    out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    parents = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    return {name for name in out if name in known and name != module and name not in parents}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(name, path, known) for name, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := walk(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def _layer(module: str) -> int:
    best = -1, -1  # (length of the matching prefix, layer)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), index))
    if best[1] < 0:
        raise AssertionError(f"{module} is in no layer of tests/test_import_graph.py")
    return best[1]


def test_the_package_has_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_import_points_down_the_layers() -> None:
    upward = [
        f"{source} -> {target}"
        for source, targets in _graph().items()
        for target in sorted(targets)
        if _layer(target) > _layer(source)
    ]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", ["maxscore.routing.config", "maxscore.training.config"])
def test_config_modules_import_nothing_heavy(module: str) -> None:
    """A config is plain data: its module imports no registry, model or trainer."""
    graph = _graph()
    reached, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    heavy = {"maxscore.routing.strategies", "maxscore.routing.flow", "maxscore.models"}
    assert not reached & heavy, sorted(reached & heavy)
