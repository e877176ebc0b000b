"""Import cycles inside a package, from its source alone (nothing is imported).

Builds the package's import graph from each module's top-level ``import`` and
``from ... import`` statements (those inside functions, which run late, are
left out), resolving relative imports and ``from pkg import submodule``. Imports
under ``if TYPE_CHECKING:`` never run, so they form a graph of their own: the
report counts the cycles of the runtime graph, then those that the
TYPE_CHECKING imports would add.

A cycle is counted once, as the set of modules of a strongly connected
component (``components``), and as the elementary cycles within (``cycles``).

Usage: python3 tools/import_cycles.py [PACKAGE_DIR] [-v]   (default: flodl; -v lists them)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Graph = dict[str, set[str]]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package is its __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_imports(body: list[ast.stmt], typing_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Module-level import statements (also inside top-level if/try/with), each with whether it is TYPE_CHECKING-only."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, typing_only
        elif isinstance(node, ast.If):
            yield from _top_imports(node.body, typing_only or _is_type_checking(node.test))
            yield from _top_imports(node.orelse, typing_only)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_imports(block, typing_only)
        elif isinstance(node, ast.With):
            yield from _top_imports(node.body, typing_only)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``node``, in module ``name``, imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = {source} if source in known else set()
    for alias in node.names:  # ``from pkg import submodule``
        if f"{source}.{alias.name}" in known:
            out.add(f"{source}.{alias.name}")
    return out


def graphs(root: Path) -> tuple[Graph, Graph]:
    """(runtime graph, TYPE_CHECKING-only edges) of the package under ``root``."""
    known = modules(root)
    runtime: Graph = {name: set() for name in known}
    typing: Graph = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, typing_only in _top_imports(tree.body):
            for target in _targets(node, name, path.name == "__init__.py", known) - {name}:
                (typing if typing_only else runtime)[name].add(target)
    return runtime, typing


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it stands: ``scope`` is the enclosing function's name
    ("" at module level); ``typing_only`` when it is under ``if TYPE_CHECKING:``."""

    source: str
    target: str
    scope: str
    typing_only: bool
    line: int


def every_import(root: Path) -> list[Import]:
    """Every import of a package module by a package module, at module level or inside a function
    (a late import is still an arrow between the two: the layering rules count it)."""
    known = modules(root)
    found = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        found.extend(_imports_in(tree.body, name, path.name == "__init__.py", known, "", False))
    return found


def _imports_in(
    body: list[ast.stmt], name: str, is_package: bool, known: dict[str, Path], scope: str, typing_only: bool
) -> Iterator[Import]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in sorted(_targets(node, name, is_package, known) - {name}):
                yield Import(name, target, scope, typing_only, node.lineno)
            continue
        inner = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else scope
        guarded = isinstance(node, ast.If) and _is_type_checking(node.test)  # its body only: not its else
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                stmts = [s for item in block for s in (item.body if isinstance(item, ast.ExceptHandler) else [item])]
                yield from _imports_in(stmts, name, is_package, known, inner, typing_only or (guarded and field == "body"))


def components(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
    return found


def cycles(graph: Graph, limit: int = 10_000) -> list[list[str]]:
    """Elementary cycles, each once (started at its smallest module), up to ``limit``."""
    found: list[list[str]] = []
    for start in sorted(graph):
        path, stack = [start], [iter(sorted(n for n in graph[start] if n > start or n == start))]
        while stack and len(found) < limit:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt == start:
                found.append(list(path))
            elif nxt not in path:
                path.append(nxt)
                stack.append(iter(sorted(n for n in graph[nxt] if n >= start)))
    return found


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "-v"]
    root = Path(args[0] if args else "flodl").resolve()
    runtime, typing = graphs(root)
    combined = {name: runtime[name] | typing[name] for name in runtime}
    for label, graph in (("runtime (module-level imports)", runtime), ("with TYPE_CHECKING imports", combined)):
        sccs, loops = components(graph), cycles(graph)
        print(f"{label}: {sum(map(len, graph.values()))} edges, {len(sccs)} components in cycles, {len(loops)} cycles")
        if "-v" in argv:
            for scc in sccs:
                print("  component:", ", ".join(scc))
            for loop in loops:
                print("  cycle:", " -> ".join([*loop, loop[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
