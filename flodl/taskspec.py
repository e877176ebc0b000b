"""Naming a task so another process can import it: ``module:function`` specs.

Ranks never receive code over the network. The controller sends a string,
``pkg.module:function`` or ``path/to/file.py:function``, and each rank
imports it and calls the factory to get its ``Task``. ``spec_of`` turns a
factory function back into such a string for ``Trainer.builder(fn)``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import TaskError

if TYPE_CHECKING:
    from .task import Task


def _split(spec: str) -> tuple[str, str]:
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise TaskError(f"task spec must be 'module:function' or 'path/to/file.py:function', got {spec!r}")
    return module, attr


def _is_file(module_text: str) -> bool:
    """``path/to/file.py`` rather than ``package.module``."""
    return module_text.endswith(".py") or "/" in module_text or "\\" in module_text


def _import_file(path_text: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise TaskError(f"task file {path_text!r} not found (resolved to {path})")
    name = f"_flodl_task_{path.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    # the task file may import its neighbours, as it would when run as a script
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a path to an existing file: the source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def not_importable(module_text: str) -> str:
    """The one-line error for a task module no import root holds, saying what to do."""
    return (
        f"cannot import task module {module_text!r} from {Path.cwd()}: run from the directory that holds it, "
        f"add that directory to PYTHONPATH, or name the file (--task path/to/{module_text.replace('.', '/')}.py:function)"
    )


def _names_the_module(exc: ModuleNotFoundError, module_text: str) -> bool:
    """Is the missing module the task's module (or a package above it), not one it imports?"""
    return exc.name is not None and (module_text == exc.name or module_text.startswith(exc.name + "."))


def resolve(spec: str) -> Callable[[], Any] | Task:
    """Import the object a spec names (without calling it).

    Raises:
        TaskError: the spec is malformed or names nothing importable.
    """
    module_text, attr = _split(spec)
    if _is_file(module_text):
        module = _import_file(module_text)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # like `python -m`: the working directory is importable
        try:
            module = importlib.import_module(module_text)
        except ModuleNotFoundError as exc:
            if not _names_the_module(exc, module_text):
                raise  # the task module was found; something it imports is missing: the user's code raised
            raise TaskError(not_importable(module_text)) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskError(f"task spec {spec!r}: {module_text} has no attribute {attr!r}") from None
    return obj


def check_spec(spec: str) -> None:
    """Check, without running the user's code, that ``spec`` names something that exists: the file
    or module is found and defines the attribute at top level. The controller calls it before any
    rank starts, so a typo costs milliseconds, not a rank start-up; what only running the factory
    shows (an empty dataset, a raising factory) is the ranks' to find.

    Modules this process already imported (``Trainer.builder(task)``) are looked at directly; others
    are compiled, never executed: a module that imports torch costs nothing here, and one that does
    not compile (a syntax error) is refused with Python's own report of it (file, line, caret).

    Raises:
        TaskError: the spec is malformed, the file or module is not found, does not compile, or
            does not define the attribute.
    """
    module_text, attr = _split(spec)
    head = attr.split(".")[0]
    if _is_file(module_text):
        path = Path(module_text).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {module_text!r} not found (resolved to {path})")
        source: Path | None = path
    elif module_text in sys.modules:
        if not hasattr(sys.modules[module_text], head):
            raise TaskError(f"task spec {spec!r}: {module_text} has no attribute {head!r}")
        return
    else:
        source = _module_source(module_text)
    if source is None:
        return
    problem = compile_problem(source)
    if problem is not None:
        raise TaskError(f"task spec {spec!r}: {problem}")
    if head not in _top_level_names(source):
        raise TaskError(f"task spec {spec!r}: {module_text} defines no {head!r} at top level")


def compile_problem(path: Path) -> str | None:
    """Why the Python file ``path`` does not compile (``SyntaxError`` as Python prints it: the
    file, the line, a caret under the fault), or None when it compiles or cannot be read (whoever
    runs it reports that). Compiled only: nothing in it runs."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"{path} does not compile:\n" + "".join(traceback.format_exception_only(exc)).rstrip()
    except ValueError as exc:  # a null byte (a binary file)
        return f"{path} does not compile: {exc}"
    except OSError:
        return None
    return None


def _module_source(module_text: str) -> Path | None:
    """The source file of an importable module (None: not a plain .py file, e.g. an extension);
    its parent packages are imported, as finding it requires."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as resolve() does in the ranks
    try:
        found = importlib.util.find_spec(module_text)
    except ModuleNotFoundError as exc:
        if not _names_the_module(exc, module_text):
            return None  # a parent package imports something missing: the ranks show the user's traceback
        found = None
    except Exception:  # a parent package raised as it was imported: the ranks show it, with its traceback
        return None
    if found is None:
        raise TaskError(not_importable(module_text))
    origin = found.origin
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(path: Path) -> set[str] | frozenset[str]:
    """Names a module binds (anywhere in its source: a superset of its top level, so the check
    never refuses a good spec); everything (an empty check) where it could bind names the
    source does not spell (``from x import *``, a module ``__getattr__``) or cannot be parsed."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError, OSError):
        return _ANY_NAME  # the ranks' import reports it with the user's own traceback
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return _ANY_NAME
                names.add(alias.asname or alias.name.split(".")[0])
    return _ANY_NAME if "__getattr__" in names else names


class _AnyName(frozenset):
    """Contains every name: the check cannot tell, so it lets the ranks decide."""

    def __contains__(self, item: object) -> bool:
        return True


_ANY_NAME = _AnyName()


def load_task(spec: str) -> Task:
    """Import and call a task factory; return its ``Task``.

    Raises:
        TaskError: the spec does not resolve to a ``Task`` or a factory of one.
    """
    from .task import Task  # torch: only processes that build the task pay for it (check_spec does not)

    obj = resolve(spec)
    task = obj if isinstance(obj, Task) else obj() if callable(obj) else obj
    if not isinstance(task, Task):
        raise TaskError(f"task spec {spec!r} gave {type(task).__name__}, expected a flodl.Task")
    return task


def spec_of(obj: Any) -> str:
    """The importable spec of a task factory (or pass a spec string through).

    Raises:
        TaskError: ``obj`` is a lambda, a nested function or a bare Task, which
            other processes cannot import by name.
    """
    from .task import Task

    if isinstance(obj, str):
        _split(obj)
        return obj
    if isinstance(obj, Task):
        raise TaskError("pass the task factory function (or a 'module:function' spec), not a Task instance: ranks import it by name")
    qualname = getattr(obj, "__qualname__", None)
    module_name = getattr(obj, "__module__", None)
    if not callable(obj) or not qualname or not module_name:
        raise TaskError(f"cannot name {obj!r} for import; pass a 'module:function' spec")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TaskError(f"{qualname} is not importable by name; define the task factory at module top level")
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module_name.startswith("_flodl_task_"):
        file = getattr(module, "__file__", None)
        if not file:
            raise TaskError("a task defined in an interactive session cannot be imported by ranks; put it in a file")
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"
