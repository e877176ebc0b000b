"""Who writes each attribute, from the source alone (nothing is imported).

A part owns the attributes its own methods write (``self.x = ...``). This reads
every class of a package and reports the writes that break that:

* a class writing, through ``self``, an attribute that a class of its family
  (a base or a subclass: a mixin, an override) defined in another file also
  writes: one attribute, two files;
* a write to a field of a part defined in another file (``self.link.x = ...``
  where ``link`` is a ``ControllerLink``, ``rank.x = ...`` where the parameter
  ``rank`` is annotated as a part): a part writing a collaborator's state,
  which should ask it through a method instead. The type is read from the
  annotation, or from the ``self.x = Part(...)`` that set the field. A record
  (a ``@dataclass``: data its holder fills, no state of its own to keep
  consistent) may be written by whoever holds it.

And the size of each class: lines, methods, attributes (those its methods
write through ``self``, and those annotated in its body), and the widest
constructor's parameter count.

Usage: python3 tools/ownership.py [PACKAGE_DIR ...] [-v]   (default: flodl/rank flodl/controller)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ClassInfo:
    name: str
    path: Path
    node: ast.ClassDef
    bases: list[str]
    record: bool = False  # a @dataclass: data its holder fills
    writes: dict[str, int] = field(default_factory=dict)  # attribute -> first line writing it through self
    annotated: set[str] = field(default_factory=set)
    fields: dict[str, str | None] = field(default_factory=dict)  # attribute -> the class it holds, where known

    @property
    def lines(self) -> int:
        return (self.node.end_lineno or self.node.lineno) - self.node.lineno + 1

    @property
    def methods(self) -> int:
        return sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in self.node.body)

    @property
    def attributes(self) -> set[str]:
        return set(self.writes) | self.annotated

    @property
    def init_params(self) -> int:
        """Parameters of ``__init__`` other than self (-1: none defined here)."""
        for n in self.node.body:
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                a = n.args
                return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1 + bool(a.vararg) + bool(a.kwarg)
        return -1


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
        return [node.target]
    return []


def _functions(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions of ``body`` (a class's methods, a module's functions), nested ones too, not nested classes'."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.ClassDef):
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _type_name(annotation: ast.expr | None) -> str | None:
    """The class an annotation names: ``Part``, ``Part | None``, ``"Part"``, ``mod.Part`` (else None)."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp):  # X | None
        for side in (annotation.left, annotation.right):
            if not (isinstance(side, ast.Constant) and side.value is None):
                return _type_name(side)
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Attribute):
        return annotation.attr
    return None


def _built(value: ast.expr | None) -> str | None:
    """The class a value is built from, when it is a call of a name: ``Part(...)``."""
    if isinstance(value, ast.Call):
        return _type_name(value.func)
    return None


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(
        (d.func if isinstance(d, ast.Call) else d).__class__ in (ast.Name, ast.Attribute)
        and _type_name(d.func if isinstance(d, ast.Call) else d) == "dataclass"
        for d in node.decorator_list
    )


@dataclass
class _Write:
    path: Path
    line: int
    text: str
    where: str
    type_name: str  # the class of the object written to


def read(paths: list[Path]) -> tuple[list[ClassInfo], list[_Write]]:
    """Every class under ``paths``, and every write to a field of another object whose class is known."""
    classes: list[ClassInfo] = []
    writes: list[_Write] = []
    for root in paths:
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
            tree = ast.parse(path.read_text(), str(path))
            scopes: list[tuple[ClassInfo | None, list[ast.stmt]]] = [(None, tree.body)]
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases = [_type_name(b) or ast.unparse(b) for b in node.bases]
                    info = ClassInfo(node.name, path, node, bases, record=_is_dataclass(node))
                    for stmt in node.body:
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                            info.annotated.add(stmt.target.id)
                            info.fields[stmt.target.id] = _type_name(stmt.annotation)
                    classes.append(info)
                    scopes.append((info, node.body))
            for owner, body in scopes:
                for fn in _functions(body):
                    writes.extend(_writes(owner, fn, path))
    return classes, writes


def _writes(owner: ClassInfo | None, fn: ast.FunctionDef | ast.AsyncFunctionDef, path: Path) -> Iterator[_Write]:
    """Record ``owner``'s own writes (``self.x``, with the type set there); yield writes to other objects' fields."""
    a = fn.args
    local: dict[str, str | None] = {p.arg: _type_name(p.annotation) for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    for node in ast.walk(fn):  # names the function binds itself: objects it built (their type if a call)
        for t in _targets(node):
            if isinstance(t, ast.Name):
                local[t.id] = None if t.id not in local or local[t.id] is None else local[t.id]
                if isinstance(node, ast.Assign | ast.AnnAssign):
                    local[t.id] = "<built>"
    where = f"{owner.name}.{fn.name}" if owner else fn.name
    for node in ast.walk(fn):
        for t in _targets(node):
            if not isinstance(t, ast.Attribute):
                continue
            obj = t.value
            if isinstance(obj, ast.Name) and obj.id == "self" and owner is not None:
                owner.writes.setdefault(t.attr, t.lineno)
                kind = _type_name(node.annotation) if isinstance(node, ast.AnnAssign) else _built(getattr(node, "value", None))
                if kind and owner.fields.get(t.attr) is None:
                    owner.fields[t.attr] = kind
                continue
            if isinstance(obj, ast.Attribute) and isinstance(obj.value, ast.Name) and obj.value.id == "self" and owner is not None:
                yield _Write(path, t.lineno, ast.unparse(t), where, f"{owner.name}.{obj.attr}")
            elif isinstance(obj, ast.Name) and local.get(obj.id) not in (None, "<built>"):
                yield _Write(path, t.lineno, ast.unparse(t), where, str(local[obj.id]))


def _family(cls: ClassInfo, by_name: dict[str, list[ClassInfo]]) -> list[ClassInfo]:
    """``cls``'s bases and subclasses among the classes read (by name)."""
    out: dict[int, ClassInfo] = {}
    todo = [cls]
    while todo:  # ancestors
        c = todo.pop()
        for b in c.bases:
            for base in by_name.get(b, []):
                if id(base) not in out:
                    out[id(base)] = base
                    todo.append(base)
    todo = [cls]
    everyone = [c for cs in by_name.values() for c in cs]
    while todo:  # descendants
        c = todo.pop()
        for sub in everyone:
            if c.name in sub.bases and id(sub) not in out:
                out[id(sub)] = sub
                todo.append(sub)
    out.pop(id(cls), None)
    return list(out.values())


def shared_writes(classes: list[ClassInfo]) -> list[str]:
    """Attributes a class writes through ``self`` that a class of its family in another file also writes."""
    by_name: dict[str, list[ClassInfo]] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)
    found = set()
    for c in classes:
        for other in _family(c, by_name):
            if other.path == c.path:
                continue
            for attr in sorted(set(c.writes) & set(other.writes)):
                a, b = sorted([(str(c.path), c.writes[attr], c.name), (str(other.path), other.writes[attr], other.name)])
                found.add(f"{attr}: {a[2]} ({a[0]}:{a[1]}) and {b[2]} ({b[0]}:{b[1]})")
    return sorted(found)


def foreign_writes(classes: list[ClassInfo], writes: list[_Write]) -> list[str]:
    """Writes to a field of a part (a class read here, not a record) defined in another file than the writer."""
    by_name: dict[str, list[ClassInfo]] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)

    def field_type(cls_name: str, attr: str) -> str | None:
        todo, seen = list(by_name.get(cls_name, [])), set()
        while todo:  # the class, then its bases
            c = todo.pop(0)
            if id(c) in seen:
                continue
            seen.add(id(c))
            if c.fields.get(attr):
                return c.fields[attr]
            todo.extend(b for base in c.bases for b in by_name.get(base, []))
        return None

    found = []
    for w in writes:
        name = field_type(*w.type_name.split(".", 1)) if "." in w.type_name else w.type_name
        targets = by_name.get(name or "", [])
        if len(targets) == 1 and not targets[0].record and targets[0].path != w.path:
            found.append(f"{w.text}: a {name} field ({targets[0].path}) written in {w.where} ({w.path}:{w.line})")
    return sorted(found)


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "-v"]
    roots = [Path(a) for a in args] or [Path("flodl/rank"), Path("flodl/controller")]
    classes, writes = read(roots)
    shared, foreign = shared_writes(classes), foreign_writes(classes, writes)
    print("largest classes (lines, methods, attributes, __init__ parameters):")
    for c in sorted(classes, key=lambda c: -c.lines)[:5]:
        print(f"  {c.name} ({c.path}): {c.lines} lines, {c.methods} methods, {len(c.attributes)} attributes, {c.init_params} parameters")
    widest = sorted(classes, key=lambda c: -c.init_params)[:5]
    print("widest constructors:", ", ".join(f"{c.name} {c.init_params}" for c in widest))
    attrs = {s.split(":")[0] for s in shared}
    print(
        f"attributes written from two files (a class and its family): {len(attrs)}; a part's field written from another file: {len(foreign)}"
    )
    if "-v" in argv:
        for line in (*shared, *foreign):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
