"""The layering rules of docs/design.md §1, checked statically (ast; no module is imported).

Every ``import`` statement counts, including those inside functions (a lazy import still runs);
only ``if TYPE_CHECKING:`` blocks are skipped, since they never run. Circles are checked between
modules and between folders (a package below ``autopar/``, or a loose file, counts as one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "autopar"

# docs/design.md §1: the planner half never imports torch.distributed (it plans on a laptop) ...
NO_TORCH_DISTRIBUTED = ("autopar.modelfile", "autopar.spec", "autopar.graph", "autopar.cluster", "autopar.layout",
                        "autopar.cost", "autopar.search", "autopar.plan")
# ... and its cost/search half never imports torch at all (a cached graph plans without it).
NO_TORCH = ("autopar.layout", "autopar.cluster", "autopar.cost", "autopar.search", "autopar.plan")
# The executor and the profiler run plans; they never import the search that makes them.
NO_SEARCH = ("autopar.executor", "autopar.profiler")
# The commands are the top of the house: only the entry point (``python -m autopar``) imports them.
COMMANDS, ENTRY_POINT = "autopar.commands", "autopar.__main__"
# Folder circles older than the folder rule, each to be broken and then struck from this list:
# spec/tp_infer.py cuts a block for tp with graph/build.py's meta-device TP cut, while graph/ reads spec/.
KNOWN_FOLDER_CIRCLES: list[list[str]] = []


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(module: str, path: Path, type_only: bool = False) -> set[str]:
    """Every dotted name ``module`` imports: ``a.b`` for ``import a.b``, ``a.b`` and ``a.b.c`` for
    ``from a.b import c`` (c may be a submodule), relative imports resolved. ``type_only``: also
    the imports of ``if TYPE_CHECKING:`` blocks (they never run, but a circle through them is still
    two modules that need each other)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def import_graph(type_only: bool = False) -> nx.DiGraph:
    """autopar's modules and the imports between them (a package counts as its ``__init__``);
    ``type_only``: counting the imports made only for type checking."""
    files = module_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        for name in imported_names(module, path, type_only):
            if name in files and name != module:
                graph.add_edge(module, name)
    return graph


def folder_of(module: str) -> str:
    """``autopar.search.ilp`` -> ``autopar.search``; a loose file (``autopar.api``) is its own folder."""
    return ".".join(module.split(".")[:2])


def folder_graph() -> nx.DiGraph:
    """The folders of ``import_graph`` and the imports between them."""
    graph = nx.DiGraph()
    for a, b in import_graph().edges:
        if folder_of(a) != folder_of(b):
            graph.add_edge(folder_of(a), folder_of(b))
    return graph


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(layers: tuple[str, ...], forbidden: str) -> list[str]:
    out = []
    for module, path in module_files().items():
        if _within(module, layers):
            out += [f"{module} imports {name}" for name in sorted(imported_names(module, path))
                    if _within(name, (forbidden,))]
    return out


def test_the_scanner_sees_lazy_imports_and_skips_type_checking(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.distributed\n"
                   "def f():\n    from .sib import thing\n    import torch.distributed as dist\n")
    names = imported_names("autopar.cost.m", src)
    assert {"autopar.cost.sib", "autopar.cost.sib.thing", "torch.distributed"} <= names
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.distributed\n")
    assert "torch.distributed" not in imported_names("autopar.cost.m", src)


def test_the_graph_knows_the_package():
    graph = import_graph()
    assert graph.has_edge("autopar.cost.estimate", "autopar.plan")  # a known import, so the scan works
    assert "autopar.layout" in graph


@pytest.mark.parametrize("layers, forbidden", [(NO_TORCH_DISTRIBUTED, "torch.distributed"), (NO_TORCH, "torch"),
                                               (NO_SEARCH, "autopar.search")])
def test_layering_rules(layers, forbidden):
    assert _violations(layers, forbidden) == []


def test_no_import_circles():
    """Each strongly connected component of more than one module is a set of modules that import
    each other in a circle, counting lazy imports and imports made only for type checking; the
    message names every such set."""
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(import_graph(type_only=True))
                     if len(c) > 1)
    assert circles == [], "import circles among: " + "; ".join(", ".join(c) for c in circles)


def test_only_the_entry_point_imports_the_commands():
    """A command module is where a verb's arguments are parsed and its output printed; what a
    library module or another layer needs from it belongs in ``autopar.api`` or below."""
    out = [f"{module} imports {name}" for module, path in module_files().items()
           if not _within(module, (COMMANDS, ENTRY_POINT))
           for name in sorted(imported_names(module, path)) if _within(name, (COMMANDS,))]
    assert out == []
    assert import_graph().has_edge(f"{COMMANDS}.main", f"{COMMANDS}.plan")  # the scan sees the registry


def test_no_new_folder_circles():
    """A circle between folders (``explain`` -> ``api`` -> ``explain`` was one, made by a command
    module inside a library package) means two rooms each reach into the other."""
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(folder_graph()) if len(c) > 1)
    new = [c for c in circles if c not in KNOWN_FOLDER_CIRCLES]
    assert new == [], "folder circles among: " + "; ".join(", ".join(c) for c in new)


def test_library_code_names_features_not_tickets() -> None:
    """A reader cannot look up "issue 14": comments and docstrings name the feature instead."""
    import re

    hits = [f"{path.relative_to(PACKAGE.parent)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\b[Ii]ssue #?\d+", line)]
    assert hits == []
