"""The package's shape: no import cycle inside ``shardc/``, and private torch APIs (``torch._*``)
only in ``shardc/_torch.py``.

Both checks read the source (``ast``), so they see lazy imports inside functions as well as
module-level ones; imports under ``if TYPE_CHECKING:`` never run and are skipped. The checkers
are also run on small synthetic packages, so each is shown to fail when it should.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

SHARDC = Path(__file__).resolve().parent.parent / "shardc"
WRAPPER = "shardc._torch"  # the one module allowed to reach for torch._*


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (explicitly; a module's parent
    package, which Python imports first, is not counted)."""
    modules = _modules(root)
    package = root.name
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _walk_runtime(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(node, module, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target.split(".")[0] == package and target in modules and target != module:
                    graph[module].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _private(parts: list[str]) -> bool:
    """Whether the dotted path ``torch.<parts>`` names something private: a component starting
    with ``_`` (dunders aside). Under ``torch.ops`` only the namespace counts (``aten._to_copy``
    is an op's public name, ``torch.ops._c10d_functional`` a private namespace)."""
    if parts[:1] == ["ops"]:
        parts = parts[1:2]
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch":
        return names[::-1]
    return None


def private_torch_uses(path: Path) -> list[str]:
    """``"line: what"`` for every private torch import or attribute of ``torch`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names
                   if a.name.split(".")[0] == "torch" and _private(a.name.split(".")[1:])]
            what = ", ".join(bad) or None
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "torch":
            parts = node.module.split(".")[1:]
            bad = [a.name for a in node.names if _private(parts + [a.name])]
            what = f"from {node.module} import {', '.join(bad)}" if bad else None
        elif isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            # The outermost attribute of a chain reports it once (inner ones are its prefixes).
            if chain is not None and _private(chain) and not _private(chain[:-1]):
                what = "torch." + ".".join(chain)
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


def private_torch_outside(root: Path, allowed: str) -> dict[str, list[str]]:
    return {module: uses for module, path in _modules(root).items()
            if module != allowed and (uses := private_torch_uses(path))}


# ------------------------------------------------------------------------------ the package


def test_shardc_has_no_import_cycle():
    graph = import_graph(SHARDC)
    assert len(graph) > 40  # the walk found the package
    assert "shardc.planning.schedule" in graph["shardc.compile.pipeline"]
    assert import_cycles(graph) == []


def test_budget_search_is_given_the_pipeline_not_importing_it():
    # The pipeline calls the peak-budget search and hands it what it needs (its trial builder,
    # the blocks found on the joint graph); the search never imports the pipeline, not even
    # lazily (through another module would be a cycle, which the test above refuses).
    graph = import_graph(SHARDC)
    assert "shardc.compile.budget_search" in graph["shardc.compile.pipeline"]
    assert "shardc.compile.pipeline" not in graph["shardc.compile.budget_search"]


def test_private_torch_only_in_the_wrapper_module():
    assert private_torch_uses(SHARDC / "_torch.py")  # the wrapper is seen: it does use them
    assert private_torch_outside(SHARDC, WRAPPER) == {}


# ------------------------------------------------------------------------------ the checkers


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_cycle_checker_finds_a_cycle_through_a_lazy_import(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from pkg.b import f\n",
        "b.py": "def f():\n    from pkg import a\n    return a\n",
        "c.py": "import pkg.a\n",
    })
    assert import_cycles(import_graph(root)) == [["pkg.a", "pkg.b"]]


def test_cycle_checker_skips_type_checking_imports_and_accepts_a_dag(tmp_path):
    root = _package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import f\n",
        "b.py": "from pkg import a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from . import d\nfrom pkg.b import *\n",
        "sub/d.py": "",
    })
    graph = import_graph(root)
    assert graph["pkg.sub.c"] == {"pkg.sub.d", "pkg.b"}
    assert import_cycles(graph) == []


@pytest.mark.parametrize("line", [
    "import torch._dynamo",
    "from torch._inductor.compile_fx import compile_fx",
    "from torch.fx import _lazy_graph_module",
    "from torch.utils._pytree import tree_map",
    "import torch\nx = torch._ops.OpOverload",
    "import torch\nf = torch._scaled_mm",
    "import torch\nops = torch.ops._c10d_functional",
])
def test_private_torch_checker_flags(tmp_path, line):
    root = _package(tmp_path, {"m.py": line + "\n", "_torch.py": "import torch._dynamo\n"})
    assert list(private_torch_outside(root, "pkg._torch")) == ["pkg.m"]


def test_private_torch_checker_accepts_public_uses(tmp_path):
    root = _package(tmp_path, {"m.py": """
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        copy = torch.ops.aten._to_copy.default  # an op's name, not a private module
        path = torch.__file__
        doc = "torch._dynamo in a string is fine"
    """})
    assert private_torch_outside(root, "pkg._torch") == {}
